"""vLLM's acceptance rules for a layout, each with the message vLLM prints (:data:`RULES` lists every rule in
the order they run), and where the layout's groups fall on the nodes."""

from __future__ import annotations

import math

from servebook.modelspec import ModelSpec
from servebook.planner.layout import MARLIN_GROUPS, VOCAB_PAD, Device, Layout


def _reject(layout: Layout, message: str) -> None:
    layout.accepted = False
    layout.reasons.append(message)


MULTINODE_STRATEGIES = {
    "mp": "one engine across the nodes: vLLM's multiprocessing launch (--nnodes, --node-rank, --master-addr); "
    "the other nodes run --headless",
    "dp": "a data-parallel replica per node group: the head serves the API (--data-parallel-size-local, "
    "--data-parallel-address), the other nodes run --headless --data-parallel-start-rank",
}


def nodes_rule(world_size: int, nodes: int) -> str | None:
    """vLLM's own refusal of a node count (EngineArgs.create_engine_config), or None."""
    if nodes > 1 and world_size % nodes:
        return (
            f"ValueError: Invalid data-parallel launch options: `--nnodes {nodes}` must evenly divide the total world "
            f"size ({world_size}). Adjust `--nnodes`, `--data-parallel-size`, `--pipeline-parallel-size`, "
            "`--tensor-parallel-size`, or `--prefill-context-parallel-size`."
        )
    return None


def place(spec: ModelSpec, layout: Layout, device: Device) -> None:
    """Where a layout's groups fall on the nodes (vLLM's rank order: TP innermost, then PP, then DP), the launch
    strategy that fits, and what each crossing costs in words."""
    if device.nodes <= 1:
        return
    if message := nodes_rule(layout.tp * layout.pp * layout.dp, device.nodes):
        _reject(layout, message)
        return
    per_node, inner = device.per_node, layout.tp * layout.pp
    link = device.link.name if device.link else "the network"
    if layout.tp > per_node:
        layout.crosses.append("TP")
        layout.warnings.append(
            f"TP={layout.tp} spans {math.ceil(layout.tp / per_node)} nodes: each of the {2 * spec.layers} "
            f"all-reduces per token crosses {link}"
        )
    if layout.pp > 1 and inner > per_node:
        layout.crosses.append("PP")
    if layout.dp > 1:
        layout.crosses.append("DP")
        if spec.is_moe:
            layout.warnings.append(
                f"the MoE layers' {'all-to-all' if layout.ep else 'all-gather'} among DP ranks crosses {link}: "
                f"{2 * spec.moe_layers} per token"
            )
    layout.strategy = layout.parallelism.strategy(per_node)


def _expert_parallel_rule(spec: ModelSpec, layout: Layout) -> None:
    """1. Expert parallelism spans TP x DP and needs an MoE model."""
    if not layout.ep:
        return
    if not spec.is_moe:
        _reject(
            layout,
            "ValueError: Number of experts in the model must be greater than 0 when expert parallelism is enabled.",
        )
    elif layout.tp * layout.dp == 1:
        # vLLM accepts the flag and runs as without it: a warning, not a refusal
        layout.warnings.append("expert parallelism has no effect at TP x DP = 1 (EP size = TP x DP = 1)")


def _head_rules(spec: ModelSpec, layout: Layout) -> None:
    """2. Attention heads and KV heads against the tensor-parallel size."""
    tp = layout.tp
    if spec.heads % tp:
        _reject(
            layout,
            f"ValueError: Total number of attention heads ({spec.heads}) must be divisible by tensor parallel size ({tp}).",
        )
    if spec.mla:
        return
    if spec.model_type == "gpt_oss" and tp > spec.kv_heads:
        _reject(
            layout,
            f"gpt-oss shards {spec.kv_heads} KV heads without replication: tensor_parallel_size must be <= {spec.kv_heads}",
        )
    elif spec.kv_heads % tp and tp % spec.kv_heads:
        bigger, smaller = (spec.kv_heads, tp) if spec.kv_heads > tp else (tp, spec.kv_heads)
        _reject(
            layout,
            f"AssertionError: {bigger} is not divisible by {smaller} (KV heads {spec.kv_heads} vs tensor parallel size {tp})",
        )


def _vocabulary_and_pipeline_rules(spec: ModelSpec, layout: Layout) -> None:
    """3. Vocabulary padding, and pipeline support."""
    tp, pp = layout.tp, layout.pp
    padded_vocab = math.ceil(spec.vocab / VOCAB_PAD) * VOCAB_PAD
    if padded_vocab % tp:
        _reject(
            layout,
            f"AssertionError: {padded_vocab} is not divisible by {tp} (padded vocabulary against tensor parallel size)",
        )
    if pp > 1 and not spec.supports_pp:
        _reject(layout, "NotImplementedError: Pipeline parallelism is not supported for this model.")
    if pp > spec.layers:
        _reject(layout, f"pipeline_parallel_size {pp} exceeds the model's {spec.layers} layers")


def _moe_tp_rule(spec: ModelSpec, layout: Layout) -> None:
    """4. The MoE tensor-parallel size (EP keeps experts whole; otherwise they are sliced over TP x DP), and that
    it slices every expert evenly."""
    tp, dp = layout.tp, layout.dp
    if not spec.is_moe:
        layout.moe_tp = 1
        return
    layout.moe_tp = 1 if layout.ep else tp * dp
    layout.ep_size = tp * dp if layout.ep else 1
    if spec.model_type in ("minimax_m2", "qwen3_moe") and tp > spec.experts:
        _reject(layout, f"ValueError: Tensor parallel size {tp} is greater than the number of experts {spec.experts}.")
    if spec.expert_intermediate % layout.moe_tp:
        _reject(
            layout,
            f"AssertionError: intermediate_size {spec.expert_intermediate} % moe tensor-parallel size {layout.moe_tp} != 0",
        )


def _expert_slice(spec: ModelSpec, layout: Layout) -> int | None:
    """Each rank's slice of an expert's intermediate size (after rule 4); None without experts or an even slice."""
    if not spec.is_moe or spec.expert_intermediate % layout.moe_tp:
        return None
    return spec.expert_intermediate // layout.moe_tp


def _fp8_expert_rule(spec: ModelSpec, layout: Layout) -> None:
    """5. FP8 block alignment of the experts' slices."""
    per_rank = _expert_slice(spec, layout)
    if per_rank is None or spec.quant.method != "fp8":
        return
    bn, bk = spec.quant.block or (128, 128)
    if per_rank % bn:
        _reject(
            layout,
            f"ValueError: The output_size of gate's and up's weight = {per_rank} is not divisible by "
            f"weight quantization block_n = {bn}.",
        )
    elif layout.tp > 1 and per_rank % bk:
        _reject(
            layout,
            f"ValueError: The input_size of down's weight = {per_rank} is not divisible by "
            f"weight quantization block_k = {bk}.",
        )


def _int4_expert_rule(spec: ModelSpec, layout: Layout) -> None:
    """6. INT4 Marlin MoE: its group sizes, its alignment (else the slower Triton kernel), symmetric weights."""
    q = spec.quant
    per_rank = _expert_slice(spec, layout)
    if per_rank is None or q.method != "int4":
        return
    g = q.group_size or 128
    if g not in MARLIN_GROUPS:
        _reject(layout, f"INT4 group_size {g} is not one Marlin supports {MARLIN_GROUPS}")
    elif spec.hidden % 128 or per_rank % max(64, g):
        if q.actorder in ("group", "dynamic"):
            _reject(layout, "ValueError: WNA16MoE is not supported with actorder=group/dynamic.")
        else:
            layout.warnings.append(
                f"Marlin MoE needs hidden % 128 == 0 and intermediate per rank ({per_rank}) % "
                f"{max(64, g)} == 0: vLLM falls back to the slower Triton WNA16 kernel"
            )
    if not q.symmetric:
        _reject(layout, "Only symmetric quantization is supported for MoE")


def _experts_per_rank(spec: ModelSpec, layout: Layout) -> None:
    """7. Experts per rank: every expert on every GPU without EP; an even split with it."""
    if not spec.is_moe:
        return
    if not layout.ep:
        layout.experts_per_gpu = spec.experts
        return
    layout.experts_per_gpu = math.ceil(spec.experts / layout.ep_size)
    if spec.experts < layout.ep_size:
        layout.warnings.append(f"{layout.ep_size - spec.experts} of {layout.ep_size} EP ranks hold no expert")
    elif spec.experts % layout.ep_size:
        layout.warnings.append(
            f"{spec.experts} experts over {layout.ep_size} ranks: uneven ({layout.experts_per_gpu} on the "
            f"first {spec.experts % layout.ep_size}); --enable-eplb would refuse this split"
        )


def _fp8_unsplit_dense_rule(spec: ModelSpec, layout: Layout, bn: int) -> None:
    """A block-FP8 dense MLP at TP=1: its gate and up share one scale tensor of ceil(2 x width / block_n) rows, and
    the up shard starts at ceil(width / block_n), one row past the end where the width ends in the first half of a
    block (a GLM-4.5-Air-shaped mini, 10,944 wide, on an H100 with vLLM 0.25, 2026-12-06: after 47 s of loading)."""
    width = spec.dense_intermediate if spec.dense_layers else 0
    if not (spec.quant.block and width % bn) or 2 * -(-width // bn) <= -(-2 * width // bn):
        return
    rows = -(-width // bn)
    _reject(
        layout,
        f"RuntimeError: start ({rows}) + length ({rows}) exceeds dimension size ({-(-2 * width // bn)}). (loading "
        f"the dense layers' merged gate_up_proj: {width} is not a multiple of the weight quantization block_n = {bn})",
    )


def _fp8_linear_rule(spec: ModelSpec, layout: Layout) -> None:
    """8. FP8 block alignment of the attention and dense layers' slices."""
    tp = layout.tp
    if spec.quant.method != "fp8" or spec.quant.experts_only:
        return
    bn, bk = spec.quant.block or (128, 128)
    if tp == 1:
        _fp8_unsplit_dense_rule(spec, layout, bn)
        return
    if spec.mla:
        row_in = spec.heads * spec.v_head_dim // tp
        col_out: int | None = spec.heads * (spec.qk_nope_head_dim + spec.v_head_dim) // tp
    else:
        row_in, col_out = spec.heads * spec.head_dim // tp, None
    if row_in % bk:
        _reject(
            layout,
            f"ValueError: Weight input_size_per_partition = {row_in} is not divisible by weight quantization block_k = {bk}.",
        )
    if col_out is not None and col_out % bn:
        _reject(
            layout,
            f"ValueError: Weight output_partition_size = {col_out} is not divisible by weight quantization block_n = {bn}.",
        )
    if spec.dense_layers and spec.dense_intermediate and (spec.dense_intermediate // tp) % bk:
        _reject(
            layout,
            f"ValueError: Weight input_size_per_partition = {spec.dense_intermediate // tp} is not divisible by "
            f"weight quantization block_k = {bk}.",
        )


RULES = (  # every rule, numbered as in its docstring; a rule reads what the rules before it set on the layout
    _expert_parallel_rule,
    _head_rules,
    _vocabulary_and_pipeline_rules,
    _moe_tp_rule,
    _fp8_expert_rule,
    _int4_expert_rule,
    _experts_per_rank,
    _fp8_linear_rule,
)


def check_rules(spec: ModelSpec, layout: Layout) -> None:
    """vLLM's acceptance rules, in the reference checklist's order; each failure adds vLLM's message."""
    for rule in RULES:
        rule(spec, layout)


# ---------------------------------------------------------------- the reserve: what vLLM keeps that is neither
# weights nor KV cache. vLLM sizes the KV cache as (gpu_memory_utilization x the memory CUDA reports) minus
# weights, the profile run's activation peak, non-torch memory and (since v0.21) its CUDA-graph estimate
# (vllm/v1/worker/gpu_worker.py, determine_available_memory). Calibrated on two H200s with vLLM 0.25.0
# and a Qwen3-30B-A3B-shaped MoE (docs/examples/h200-vllm/README.md has the table): with the constants below
