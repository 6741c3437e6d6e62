"""Every check of a params file that costs no load: what ``servebook check`` runs, in seconds, before any server.

The whole-file validation (:mod:`servebook.params`), then vLLM's own parser on the whole serving command
(``extra_args`` included), flags that ``extra_args`` sets twice, and a dataset's every request against
``max_model_len`` with the served tokenizer where the checkpoint is on this machine.
"""

from __future__ import annotations

from pathlib import Path

from servebook import hardware, loadgen, models, vllm_compat
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
    if p.bench_dataset and Path(cfg.model_path).is_dir():
        found += _dataset_problems(p, cfg)
    return found


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
