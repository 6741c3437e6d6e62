"""Every check of a params file that costs no load: what ``servebook check`` runs, in seconds, before any server.

The whole-file validation (:mod:`servebook.params`), then vLLM's own parser on the whole serving command
(``extra_args`` included), flags that ``extra_args`` sets twice, what the plan knows from the model's config alone
(vLLM's layout rules for this model, ``max_model_len`` against its positions; a hub model that cannot be
reached), the port held by another program, and a dataset's every request against ``max_model_len`` with the
served tokenizer where the checkpoint is on this machine.
"""

from __future__ import annotations

from pathlib import Path

from servebook import hardware, loadgen, models, serving, vllm_compat
from servebook.errors import DatasetError, ServebookError
from servebook.params import Params
from servebook.server_config import ServerConfig


def problems(p: Params) -> list[str]:
    """What would fail later for these params, each with its fix; empty when nothing would."""
    device = hardware.resolve_device(p.device, hardware.inventory())
    try:
        cfg = ServerConfig.from_params(p, device)
    except ServebookError as exc:
        return [str(exc)]
    found = cfg.conflicts()
    parsed = vllm_compat.parse_serve_args(cfg.model_path, cfg.serve_args())
    if not parsed.ok:
        found.append(f"vLLM {vllm_compat.vllm_version()} rejects the serving command: {parsed.message}")
    found += [
        f"extra_env: {problem}" for problem in vllm_compat.unknown_vllm_env(list(cfg.extra_env), parsed.known_env)
    ]
    found += plan_problems(p, cfg) + port_problems(cfg)
    if p.bench_dataset and Path(cfg.model_path).is_dir():
        found += _dataset_problems(p, cfg)
    return found


def plan_problems(p: Params, cfg: ServerConfig) -> list[str]:
    """What the plan knows from the model's config alone, nothing loaded: vLLM's layout rules for this model
    (heads and KV heads over TP, FP8 blocks over TP, experts over EP…) and ``max_model_len`` against the model's
    positions; a model that cannot be read (a hub repository out of reach) says so."""
    from servebook import modelspec, planner

    try:
        spec = modelspec.load(p.model, p.download_revision)
    except ServebookError as exc:
        return [f"model: {exc}"]
    found = []
    if p.max_model_len > spec.max_position_embeddings > 0:
        found.append(
            f"max_model_len {p.max_model_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}: vLLM refuses it; set max_model_len: {spec.max_position_embeddings} "
            "or less"
        )
    lay = cfg.layout
    judged = planner.Layout(lay.tp, lay.pp, lay.dp, lay.ep)
    planner.check_rules(spec, judged)
    if judged.reasons:
        more = f" (and {len(judged.reasons) - 1} more rule(s))" if len(judged.reasons) > 1 else ""
        found.append(
            f"layout {judged.name}: vLLM refuses it for this model: {judged.reasons[0]}{more}; set "
            f"{', '.join(serving.LAYOUT[:-1])} and {serving.LAYOUT[-1]} to a layout `servebook plan` lists as accepted"
        )
    return found


def port_problems(cfg: ServerConfig) -> list[str]:
    """The port held by a program that is no servebook server (launch reuses or stops its own, and says so)."""
    import psutil

    from servebook import processes, server

    holder = processes.port_holder(cfg.host, cfg.port)
    if holder is None or server.registered(cfg.port) is not None:
        return []
    who = f"{holder.name()} (pid {holder.pid})" if isinstance(holder, psutil.Process) else "another program"
    return [f"port {cfg.port} on {cfg.host} is held by {who}: set port to a free one, or stop that program"]


def _dataset_problems(p: Params, cfg: ServerConfig) -> list[str]:
    """The dataset's requests counted with the checkpoint's own tokenizer, as the benchmark will count them."""
    from servebook import datasets

    tokenizer = loadgen.load_tokenizer(cfg.model_path)
    overhead = loadgen.PromptMaker(tokenizer).chat_overhead() if p.bench_endpoint == "chat" else 0
    try:
        datasets.load(
            p.bench_dataset, tokenizer, max_model_len=p.max_model_len, output_len=p.bench_output_len,
            fmt=p.bench_dataset_format, chat_overhead=overhead,
        )  # fmt: skip
    except DatasetError as exc:
        return [str(exc)]
    return []


def where(p: Params) -> str:
    """What the params describe, in a few words, for ``servebook check``'s answer."""
    model = "the embedded model" if models.is_builtin(p.model) else p.model
    return f"{model}, {p.layout.name}, world size {p.world_size}"
