"""Which parallel layouts vLLM will accept for a model on G devices, and what each holds per GPU.

Every rule is vLLM's (``vllm/config/parallel.py``, ``vllm/model_executor/layers/fused_moe``, the FP8 and
compressed-tensors quantization methods), checked in :data:`RULES`' order, and a rejected layout carries the
message vLLM would print.  Sizes follow vLLM's own
arithmetic: weights per GPU (experts sharded or split across TP x DP, everything else
sharded by TP and replicated per DP rank, layers split across PP stages), KV bytes per
token per GPU (``2 x kv_heads/TP x head_dim`` per layer, or the MLA latent replicated on
every TP rank), and KV tokens = (memory x utilization - weights - reserve) rounded down to
whole blocks, as ``kv_cache_utils`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel

from servebook import vllm_defaults
from servebook.errors import PlanInputError
from servebook.gpus import GpuModel
from servebook.modelspec import ModelSpec
from servebook.planner import truth
from servebook.planner.layout import (
    _LINK,
    BLOCK_SIZE,
    GPU_MEMORY_UTILIZATION,
    MARLIN_GROUPS,
    NVLINK_COLLECTIVE_S,
    PCIE_COLLECTIVE_S,
    RDMA_COLLECTIVE_S,
    TCP_COLLECTIVE_S,
    VOCAB_PAD,
    Device,
    Layout,
    LayoutFields,
    NodeLink,
    Parallelism,
    Reserve,
    Weights,
    default_max_num_seqs,
    parse_interconnect,
    pp_split,
    weight_bytes,
)
from servebook.planner.rules import (
    MULTINODE_STRATEGIES,
    RULES,
    _expert_parallel_rule,
    _expert_slice,
    _experts_per_rank,
    _fp8_expert_rule,
    _fp8_linear_rule,
    _head_rules,
    _int4_expert_rule,
    _moe_tp_rule,
    _reject,
    _vocabulary_and_pipeline_rules,
    check_rules,
    nodes_rule,
    place,
)
from servebook.planner.sizing import (
    ACTIVATION_FACTOR,
    CUDA_HIDDEN_BYTES,
    GRAPH_BYTES_PER_REQUEST_HEAD_VALUE,
    GRAPH_EXTRA_BYTES,
    GRAPH_MLA_INT4_BYTES_PER_REQUEST_SQUARED,
    GRAPH_PIECEWISE_BYTES_PER_HIDDEN,
    GRAPH_TP_EXPONENT,
    MLA_BYTES_PER_TOKEN_HEAD,
    MLA_COMPILE_MISS_BYTES,
    MLA_FIXED_BYTES,
    NON_TORCH_BYTES,
    NON_TORCH_COLLECTIVE_BYTES,
    SAMPLER_BYTES_PER_LOGIT,
    Serving,
    Sizing,
    _expert_fraction,
    _network_seconds,
    _rate_decode,
    _size_kv_cache,
    _weights_per_gpu,
    capture_sizes,
    graph_estimate,
    max_num_batched_tokens,
    reserve_for,
    size,
)
from servebook.units import GiB


def enumerate_layouts(count: int) -> list[tuple[int, int, int]]:
    out = []
    for tp in range(1, count + 1):
        for pp in range(1, count + 1):
            if count % (tp * pp) == 0:
                out.append((tp, pp, count // (tp * pp)))
    return out


class Plan(BaseModel):
    """Every layout of one model on one device set, judged, sized and ranked."""

    model: ModelSpec
    device: Device
    max_model_len: int
    gpu_memory_utilization: float
    kv_cache_dtype: str
    vllm_version: str = ""  # the vLLM whose defaults the plan sized with (servebook.vllm_defaults)
    vllm_defaults_row: str = ""  # the table's row it used: the version's own, or the nearest older one known
    activation_reserve_bytes: float | None  # a fixed reserve from the params; None: modelled per layout
    weights_total_bytes: float
    weights_scaled_to_checkpoint: float
    batch: int
    layouts: list[Layout]
    recommended: Layout | None
    why: str

    def find(self, layout: Parallelism) -> Layout | None:
        return next((candidate for candidate in self.layouts if candidate.parallelism == layout), None)

    def rank_by(self, by: str) -> Plan:
        """The same plan recommending the best layout for latency (one stream) or concurrency (KV capacity)."""
        usable = [candidate for candidate in self.layouts if candidate.usable]
        if not usable or by == "throughput":
            return self
        keys = {"latency": lambda c: c.decode_tok_s_single, "concurrency": lambda c: c.max_concurrency}
        best = max(usable, key=keys[by])
        why = f"{best.name}: best {by} among {len(usable)} layouts that vLLM accepts and that fit"
        return self.model_copy(update={"recommended": best, "why": why})


def plan(  # noqa: PLR0913  (keyword-only beyond the device: each a setting vLLM or the workload sizes by)
    spec: ModelSpec,
    device: Device,
    *,
    max_model_len: int = 4096,
    gpu_memory_utilization: float | None = None,
    kv_cache_dtype: str = "auto",
    reserve_gib: float | None = None,
    batch: int = 64,
    serving: Serving | None = None,
    history: Sequence[truth.Measured] = (),
    prompt_ratio: float = 1.0,
    context_tokens: int | None = None,
) -> Plan:
    """Every TP x PP x DP = G layout, with and without expert parallelism, checked, sized and ranked; what is
    not given (``gpu_memory_utilization`` None, zeros in ``serving``) is vLLM's default for
    ``serving.vllm_version``."""
    serving = serving or Serving()
    defaults = vllm_defaults.for_version(serving.vllm_version)
    if gpu_memory_utilization is None:
        gpu_memory_utilization = defaults.gpu_memory_utilization
    if max_model_len > spec.max_position_embeddings > 0:
        raise PlanInputError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{spec.max_position_embeddings}; vLLM refuses it"
        )
    sizing = Sizing(
        weights=weight_bytes(spec),
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_dtype_bytes=1 if kv_cache_dtype.startswith("fp8") else 2,
        reserve_bytes=reserve_gib * GiB if reserve_gib is not None and device.kind != "cpu" else None,
        batch=batch,
        serving=serving,
        history=tuple(history),
        prompt_ratio=prompt_ratio,
        context_tokens=context_tokens,
    )
    layouts = []
    for tp, pp, dp in enumerate_layouts(device.count):
        for ep in (False, True) if spec.is_moe else (False,):
            layout = Layout(tp, pp, dp, ep)
            check_rules(spec, layout)
            place(spec, layout, device)
            size(spec, layout, device, sizing)
            layouts.append(layout)
    usable = [candidate for candidate in layouts if candidate.usable]
    for candidate in usable:
        candidate.score = candidate.forecast_tok_s_batch or candidate.decode_tok_s_batch
    # the highest forecast (the ceiling, where none) at the batch each holds; among equals, fewer pipeline stages, then fewer collectives
    # (on the network first)
    usable.sort(
        key=lambda c: (
            -round(c.score, 6),
            c.pp,
            c.network_collectives_per_token,
            c.allreduces_per_token + c.all2all_per_token,
        )
    )
    recommended = usable[0] if usable else None
    return Plan(
        model=spec,
        device=device,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_dtype=kv_cache_dtype,
        vllm_version=serving.vllm_version or defaults.version,
        vllm_defaults_row=defaults.version,
        activation_reserve_bytes=sizing.reserve_bytes,
        weights_total_bytes=sizing.weights.total(spec),
        weights_scaled_to_checkpoint=sizing.weights.scaled_to_checkpoint,
        batch=batch,
        layouts=layouts,
        recommended=recommended,
        why=_why(recommended, usable, batch, device),
    )


def sized_for_compile_cache(
    planned: Plan, layout: Layout, compile_cache_hit: bool, history: Sequence[truth.Measured] = ()
) -> Layout:
    """``layout`` sized again, at the settings it was planned with, for a start that will find (or miss)
    torch.compile's cache, or did: what the launch checks its start against, and what a start that went
    otherwise than planned is learned against (without ``history``)."""
    s = layout.settings
    serving = Serving(
        int(s.get("max_num_seqs", 0)), int(s.get("max_num_batched_tokens", 0)), s.get("enforce_eager") == "True",
        int(s.get("max_capture_size", 0)), compile_cache_hit=compile_cache_hit, vllm_version=planned.vllm_version,
    )  # fmt: skip
    reserve = planned.activation_reserve_bytes
    again = plan(
        planned.model, planned.device, max_model_len=planned.max_model_len,
        gpu_memory_utilization=planned.gpu_memory_utilization, kv_cache_dtype=planned.kv_cache_dtype,
        reserve_gib=reserve / GiB if reserve is not None else None, batch=planned.batch, serving=serving,
        history=history,
    ).find(layout.parallelism)  # fmt: skip
    return again or layout


def _forecast_band(layout: Layout) -> float:
    band = layout.bands.get("forecast_tok_s")
    return band.band if band else 0.0


def _why(recommended: Layout | None, usable: list[Layout], batch: int, device: Device) -> str:
    if recommended is None:
        return "no layout is both accepted by vLLM and fits in memory"
    if not device.bandwidth_bytes_s:
        return (
            f"{recommended.name}: {'the only' if len(usable) == 1 else 'the first of ' + str(len(usable))} layout(s) "
            f"that vLLM accepts and that fit ({device.name} has no bandwidth figure to rank by)"
        )
    short = [c for c in usable if c.batch_fit < batch]
    if len(short) == len(usable):
        held = f"; none holds {batch} requests of max_model_len in KV cache, so each was ranked at what it holds"
    elif short:
        listed = _first_four(f"{c.name}: {c.batch_fit}" for c in short)
        held = f"; {len(short)} hold fewer than {batch} requests of max_model_len and were ranked at that ({listed})"
    else:
        held = ""
    return (
        f"{recommended.name}: highest forecast throughput at {recommended.batch_fit} concurrent sequences "
        f"({recommended.forecast_tok_s_batch:,.0f} tok/s ± {100 * _forecast_band(recommended):.0f} %; bandwidth "
        f"ceiling {recommended.decode_tok_s_batch:,.0f}) among {len(usable)} layouts that vLLM accepts and that fit"
        + held
        + _within_band(recommended, usable)
    )


def _within_band(recommended: Layout, usable: list[Layout]) -> str:
    """The runners-up whose forecast lies inside the leader's band: the forecast alone cannot order them, a
    rehearsal (``rehearse_layouts``) or a launch of each can."""
    band = _forecast_band(recommended)
    if not band or not recommended.forecast_tok_s_batch:
        return ""
    floor = recommended.forecast_tok_s_batch * (1 - band)
    close = [c for c in usable if c is not recommended and c.forecast_tok_s_batch >= floor]
    if not close:
        return ""
    listed = _first_four(f"{c.name} {c.forecast_tok_s_batch:,.0f}" for c in close)
    to_rehearse = min(len(close) + 1, 4)
    return (
        f"; {len(close)} other layout(s) forecast within its ±{100 * band:.0f} % ({listed}): the forecast cannot "
        f"order them, so rehearse the first {to_rehearse} on dummy weights (rehearse_layouts: {to_rehearse}) "
        "and launch the one measured best"
    )


def _first_four(names: Iterable[str]) -> str:
    shown = list(names)
    return ", ".join(shown[:4]) + (", ..." if len(shown) > 4 else "")


__all__ = [
    "ACTIVATION_FACTOR",
    "BLOCK_SIZE",
    "CUDA_HIDDEN_BYTES",
    "Device",
    "GPU_MEMORY_UTILIZATION",
    "GRAPH_EXTRA_BYTES",
    "GRAPH_BYTES_PER_REQUEST_HEAD_VALUE",
    "GRAPH_MLA_INT4_BYTES_PER_REQUEST_SQUARED",
    "GRAPH_PIECEWISE_BYTES_PER_HIDDEN",
    "GRAPH_TP_EXPONENT",
    "Layout",
    "LayoutFields",
    "MARLIN_GROUPS",
    "MLA_BYTES_PER_TOKEN_HEAD",
    "MLA_COMPILE_MISS_BYTES",
    "MLA_FIXED_BYTES",
    "MULTINODE_STRATEGIES",
    "NON_TORCH_BYTES",
    "NON_TORCH_COLLECTIVE_BYTES",
    "NVLINK_COLLECTIVE_S",
    "NodeLink",
    "PCIE_COLLECTIVE_S",
    "Parallelism",
    "Plan",
    "RDMA_COLLECTIVE_S",
    "RULES",
    "Reserve",
    "SAMPLER_BYTES_PER_LOGIT",
    "Serving",
    "Sizing",
    "TCP_COLLECTIVE_S",
    "VOCAB_PAD",
    "Weights",
    "_LINK",
    "_expert_fraction",
    "_expert_parallel_rule",
    "_expert_slice",
    "_experts_per_rank",
    "_fp8_expert_rule",
    "_fp8_linear_rule",
    "_head_rules",
    "_int4_expert_rule",
    "_moe_tp_rule",
    "_network_seconds",
    "_rate_decode",
    "_reject",
    "_size_kv_cache",
    "_vocabulary_and_pipeline_rules",
    "_weights_per_gpu",
    "capture_sizes",
    "check_rules",
    "default_max_num_seqs",
    "enumerate_layouts",
    "graph_estimate",
    "max_num_batched_tokens",
    "nodes_rule",
    "parse_interconnect",
    "place",
    "plan",
    "pp_split",
    "reserve_for",
    "size",
    "sized_for_compile_cache",
    "weight_bytes",
    "GpuModel",
]
