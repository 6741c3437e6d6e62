"""The load path and the start a plan predicts for a params file: the stages' shared use of
:mod:`servebook.loadpath` (evidence, rules) and :mod:`servebook.startup` (prediction)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from servebook import loadpath, models, modelspec, planner, server_config, startup, vllm_compat
from servebook.params import Params
from servebook.vllm_log import LogValues

# a probe that could not run: a Gen4 NVMe drive's sequential read, the datasheet figure the plan falls back to
DATASHEET_DISK_GB_S = 7.0


def plan(p: Params, device: planner.Device, model: str = "") -> planner.Plan:
    """The plan for these params on ``device``, ranked as they ask; ``model`` (a config.json) stands in for
    ``p.model`` where the architecture must come from elsewhere. A layout whose start will load torch.compile's
    cache is sized for it (:func:`warm_layouts`)."""
    spec = modelspec.load(model or p.model)
    serving = planner.Serving(
        p.max_num_seqs, p.max_num_batched_tokens, p.enforce_eager, vllm_version=planned_vllm_version(p)
    )

    def planned(serving: planner.Serving) -> planner.Plan:
        return planner.plan(
            spec, device, max_model_len=p.max_model_len, gpu_memory_utilization=p.gpu_memory_utilization,
            kv_cache_dtype=p.kv_cache_dtype, reserve_gib=p.plan_reserve_gib or None, batch=p.plan_batch,
            serving=serving, history=planner.truth.history() if device.kind != "cpu" else (),
            prompt_ratio=p.bench_input_len / p.bench_output_len,  # the workload stage 05 measures, forecast alike
            context_tokens=workload_context(p),
        )  # fmt: skip

    cold = planned(serving)
    warm = warm_layouts(p, cold)
    return (planned(dataclasses.replace(serving, warm_layouts=warm)) if warm else cold).rank_by(p.plan_rank_by)


def workload_context(p: Params) -> int:
    """The KV a stream of stage 05's workload holds on average while it decodes: its prompt and half its output."""
    return p.bench_input_len + p.bench_output_len // 2


def warm_layouts(p: Params, planned: planner.Plan) -> frozenset[str]:
    """The layouts whose start will load torch.compile's artefacts rather than compile: a launch or rehearsal with
    the same compile key (``startup.compile_key``: the model folder, layout, batch limits, compilation flags;
    not the load format, so a dummy-weight rehearsal counts) is in the start history and vLLM's cache folder is
    still there. On a GQA model a start that compiles keeps up to 1.5 GiB more in vLLM's profile peak, which a
    warm one does not (sizing.GQA_COMPILE_MISS_HIDDEN_TENSORS). None on the CPU (no reserve is sized there)."""
    if planned.device.kind == "cpu" or p.enforce_eager:
        return frozenset()
    starts = startup.history()
    if not starts:
        return frozenset()
    version = vllm_compat.vllm_version()
    keys = {
        layout.name: startup.compile_key(
            server_config.ServerConfig.from_params(p, planned.device.kind, layout.parallelism), version
        )
        for layout in planned.layouts
        if layout.accepted
    }
    return frozenset(name for name, key in keys.items() if startup.compile_cache_expected(key, starts))


def for_start(
    planned: planner.Plan, cfg: server_config.ServerConfig, predicted: planner.Layout | None
) -> planner.Layout | None:
    """The plan's figures for the start of ``cfg``, as its compile cache will find it: where the plan expected a
    cold compile and a rehearsal or launch of the same compile key has run since (or the other way round), the
    layout sized again from the plan's own inputs, with what the history learned since."""
    if predicted is None or planned.device.kind == "cpu" or cfg.enforce_eager:
        return predicted
    expected = startup.compile_cache_expected(startup.compile_key(cfg, vllm_compat.vllm_version()))
    if predicted.settings.get("compile_cache_hit") == str(expected):
        return predicted
    return planner.sized_for_compile_cache(planned, predicted, expected, history=planner.truth.history())


def planned_vllm_version(p: Params) -> str:
    """The vLLM the plan is for: the one the params name (``plan_vllm_version``), else the installed one."""
    return p.plan_vllm_version or vllm_compat.vllm_version() or ""


def chosen_layout(p: Params, planned: planner.Plan) -> planner.Layout | None:
    """The layout stage 03 launches: the plan's recommendation with ``layout_from_plan``, else the params' own."""
    return planned.recommended if p.layout_from_plan and planned.recommended else planned.find(p.layout)


def load_evidence(p: Params, probe: bool = True) -> loadpath.CheckpointEvidence:
    """What a start of this model reads; a checkpoint not on disk yet has its size and says so."""
    path = models.resolve(p.model) if models.is_builtin(p.model) else str(Path(p.model).expanduser())
    if p.model.endswith("config.json"):
        path = str(Path(path).parent)
    if Path(path).is_dir():
        limit = int(p.read_probe_gb * 1e9)
        return loadpath.gather(path, probe=probe and limit > 0, max_bytes=limit, max_s=p.read_probe_s)
    size, _ = models.checkpoint_bytes(p.model, p.checkpoint_gb)
    return loadpath.CheckpointEvidence(
        path=p.model, bytes=size or 0, mem_available_bytes=loadpath.mem_available(),
        error="not on this disk yet: the plan assumes the datasheet disk rate until the download",
    )  # fmt: skip


def load_plan(
    p: Params, planned: planner.Plan, layout: planner.Layout, evidence: loadpath.CheckpointEvidence
) -> tuple[loadpath.LoadChoice, startup.StartPrediction]:
    """The load options the rule table picks (where the params leave them at auto) and the start they predict."""
    version = vllm_compat.vllm_version()
    choice = loadpath.recommend(evidence, expert_parallel=layout.ep, vllm_version=version)
    if p.load_strategy != "auto":
        choice.load_strategy = p.load_strategy
        choice.reasons.append(f"load_strategy {p.load_strategy} from the params")
    if p.load_format != "auto":
        choice.load_format = p.load_format
        choice.reasons.append(f"load_format {p.load_format} from the params")
    if p.ep_weight_filter != "auto":
        choice.ep_weight_filter = p.ep_weight_filter == "on"
    weights = planner.weight_bytes(planned.model)
    total = weights.total(planned.model)
    share = planned.model.moe_layers * weights.experts / total if total else 0.0
    cfg = server_config.ServerConfig.from_params(p, planned.device.kind, layout.parallelism)
    query = startup.StartQuery(
        device=planned.device.kind, world_size=layout.parallelism.world_size, ep_ranks=layout.tp * layout.dp if layout.ep else 1,
        choice=choice, vllm_version=version, key=startup.compile_key(cfg, version), model_path=cfg.model_path,
        expert_share=share, enforce_eager=p.enforce_eager, fallback_gb_per_s=DATASHEET_DISK_GB_S,
        loader=startup.loader_of(choice.load_strategy, list(p.extra_args), choice.load_format),
    )  # fmt: skip
    prediction = startup.predict(evidence, query)
    return choice, prediction


def with_load_choice(cfg: server_config.ServerConfig, choice: loadpath.LoadChoice | None) -> server_config.ServerConfig:
    """The configuration with the params' ``auto`` load options replaced by the plan's choice."""
    if choice is None:
        return cfg
    return dataclasses.replace(
        cfg,
        load_strategy=choice.load_strategy if cfg.load_strategy == "auto" else cfg.load_strategy,
        load_format=choice.load_format if cfg.load_format == "auto" else cfg.load_format,
        ep_weight_filter=("on" if choice.ep_weight_filter else "off")
        if cfg.ep_weight_filter == "auto"
        else cfg.ep_weight_filter,
    )


def learn(
    plan: planner.Plan,
    planned: planner.Layout | None,
    values: LogValues,
    source: str,
    throughput: dict[str, float] | None = None,
    prompt_ratio: float = 1.0,
) -> None:
    """Keep what a GPU start of a planned layout showed in the plan history (:mod:`servebook.planner.truth`), so
    the next plan of the same signature on this GPU and vLLM starts from it; with ``throughput`` (concurrency ->
    output tok/s, measured with ``prompt_ratio`` prompt tokens per output token), its forecast too. CPU plans size
    no reserve."""
    if planned is None or plan.device.kind == "cpu" or not values.kv_cache_tokens or not planned.signature:
        return
    found = {"hit": True, "miss": False}.get(values.compile_cache or "")
    if found is not None and planned.settings.get("compile_cache_hit") != str(found):
        planned = planner.sized_for_compile_cache(plan, planned, found)  # keyed and judged as it really started
    planner.truth.remember(
        planner.truth.learned(
            planned, plan.device.name, values.vllm_version or plan.vllm_version, source,  # type: ignore[arg-type]
            values.kv_cache_tokens, weight_gib=values.model_memory_gib, graph_gib=values.graph_estimate_gib,
            throughput=throughput,
            workload=planner.truth.workload_key(prompt_ratio),
        )
    )  # fmt: skip
