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

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field, computed_field
from pydantic.dataclasses import dataclass as pydantic_dataclass

from servebook.errors import PlanInputError
from servebook.gpus import GpuModel
from servebook.modelspec import ModelSpec
from servebook.units import GiB

BLOCK_SIZE = 16  # vLLM's default KV block size
VOCAB_PAD = 64  # vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
MARLIN_GROUPS = (-1, 32, 64, 128)
# One small all-reduce: 26-48 us measured on 8 PCIe GPUs; 35-45 us through torch.distributed on two NVLink H200s,
# less inside vLLM's custom all-reduce.
PCIE_COLLECTIVE_S = 45e-6
NVLINK_COLLECTIVE_S = 30e-6
GPU_MEMORY_UTILIZATION = 0.90  # vLLM's default (CacheConfig.gpu_memory_utilization); the params' default too


# One small collective between two nodes: nccl-tests' small-message all-reduce across two nodes is some tens of
# microseconds over RDMA (InfiniBand, RoCE, EFA) and about a hundred over TCP sockets. Estimates, not
# measurements of this project; `node_interconnect` takes a measured figure ("... 18us").
RDMA_COLLECTIVE_S = 25e-6
TCP_COLLECTIVE_S = 100e-6
_LINK = re.compile(
    r"^\s*(?:(?P<nics>\d+)\s*[x×]\s*)?(?P<gbit>\d+(?:\.\d+)?)\s*g(?:bit/s|b/s|bps|be|b|bit)?\b(?P<rest>.*)$", re.I
)


@dataclass
class NodeLink:
    """The network between nodes, which every collective that crosses nodes pays for."""

    name: str
    bandwidth_bytes_s: float  # per node, all its NICs together
    latency_s: float  # one small collective between nodes
    rdma: bool


def parse_interconnect(text: str) -> NodeLink:
    """``400Gb/s InfiniBand``, ``8x400G IB``, ``100GbE``, ``200G RoCE 18us``: NICs per node, speed of each, kind,
    and optionally a measured small-collective latency."""
    m = _LINK.match(text or "")
    if not m:
        raise PlanInputError(
            f"node_interconnect {text!r} is not a link speed; write it as e.g. '400Gb/s InfiniBand', "
            "'8x400G IB' (NICs per node) or '100GbE'"
        )
    rest = m["rest"].lower()
    rdma = re.search(r"\b(infiniband|ib|roce|efa|rdma)\b", rest) is not None
    latency = re.search(r"(\d+(?:\.\d+)?)\s*(us|µs)", rest)
    nics = int(m["nics"] or 1)
    return NodeLink(
        name=text.strip(),
        bandwidth_bytes_s=nics * float(m["gbit"]) * 1e9 / 8,
        latency_s=float(latency[1]) * 1e-6 if latency else (RDMA_COLLECTIVE_S if rdma else TCP_COLLECTIVE_S),
        rdma=rdma,
    )


@dataclass
class Device:
    """What the plan packs into: ``count`` devices of ``memory_bytes`` at ``bandwidth_bytes_s``, on ``nodes``
    machines of ``count / nodes`` each joined by ``link``."""

    name: str
    count: int
    memory_bytes: int
    bandwidth_bytes_s: float
    kind: str = "cuda"  # or "cpu": the KV cache is a fixed size (VLLM_CPU_KVCACHE_SPACE)
    cpu_kv_bytes: int = 0
    collective_latency_s: float = NVLINK_COLLECTIVE_S
    source: str = ""
    nodes: int = 1
    link: NodeLink | None = None

    @property
    def per_node(self) -> int:
        return self.count // max(self.nodes, 1)

    @classmethod
    def for_gpu(
        cls,
        gpu: GpuModel,
        count: int,
        nvlink: bool | None = None,
        memory_bytes: int | None = None,
        nodes: int = 1,
        link: NodeLink | None = None,
    ) -> Device:
        """``count`` GPUs of a datasheet model (on ``nodes`` machines joined by ``link``); ``nvlink`` and
        ``memory_bytes`` from NVML where measured."""
        linked = "NVLink" in gpu.interconnect if nvlink is None else nvlink
        if nodes > 1 and (link is None or count % nodes):
            raise PlanInputError(f"{count} GPUs on {nodes} nodes need a whole number per node and a node_interconnect")
        return cls(
            gpu.name,
            count,
            memory_bytes or gpu.memory_bytes,
            gpu.bandwidth_bytes_s,
            kind="cuda",
            collective_latency_s=NVLINK_COLLECTIVE_S if linked else PCIE_COLLECTIVE_S,
            source=gpu.source,
            nodes=nodes,
            link=link if nodes > 1 else None,
        )

    @classmethod
    def for_cpu(cls, kv_cache_bytes: int, count: int = 1, nodes: int = 1) -> Device:
        """vllm-cpu: the KV cache is a fixed size (VLLM_CPU_KVCACHE_SPACE) per worker, no collectives charged;
        ``count`` workers on ``nodes`` machines."""
        import psutil

        return cls(
            "CPU",
            count,
            psutil.virtual_memory().total,
            0.0,
            kind="cpu",
            cpu_kv_bytes=kv_cache_bytes,
            collective_latency_s=0.0,
            source="vllm-cpu: the KV cache is VLLM_CPU_KVCACHE_SPACE, fixed by cpu_kv_cache_gib",
            nodes=nodes,
        )


@dataclass
class Weights:
    """Bytes by component for the whole model."""

    attention: float  # per layer, TP-sharded part
    attention_replicated: float  # per layer, replicated on every TP rank (MLA down-projections)
    experts: float  # per MoE layer, all routed experts
    shared: float  # per MoE layer, shared experts
    dense_mlp: float  # per dense layer
    embedding: float
    lm_head: float
    router: float  # per MoE layer
    scaled_to_checkpoint: float = 1.0

    def total(self, spec: ModelSpec) -> float:
        return (
            spec.layers * (self.attention + self.attention_replicated)
            + spec.moe_layers * (self.experts + self.shared + self.router)
            + spec.dense_layers * self.dense_mlp
            + self.embedding
            + self.lm_head
        )


def weight_bytes(spec: ModelSpec) -> Weights:
    """Bytes per component from the shapes and the quantization; scaled to the index's exact total when known."""
    q = spec.quant
    quantized_linear = q.weight_bytes_per_param(not q.experts_only)
    expert_b = q.weight_bytes_per_param(True)
    h = spec.hidden
    if spec.mla:
        q_proj = (
            h * spec.q_lora_rank + spec.q_lora_rank * spec.heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
            if spec.q_lora_rank
            else h * spec.heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        )
        replicated = h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + (h * spec.q_lora_rank if spec.q_lora_rank else 0)
        sharded = q_proj - (h * spec.q_lora_rank if spec.q_lora_rank else 0)
        sharded += (
            spec.kv_lora_rank * spec.heads * (spec.qk_nope_head_dim + spec.v_head_dim)
            + spec.heads * spec.v_head_dim * h
        )
        attn, attn_rep = sharded * quantized_linear, replicated * quantized_linear
    else:
        attn = (h * spec.heads * spec.head_dim * 2 + h * spec.kv_heads * spec.head_dim * 2) * quantized_linear
        attn_rep = 0.0
    w = Weights(
        attention=attn,
        attention_replicated=attn_rep,
        experts=spec.experts * 3 * h * spec.expert_intermediate * expert_b,
        shared=3 * h * spec.shared_intermediate * quantized_linear,
        dense_mlp=3 * h * spec.dense_intermediate * quantized_linear,
        embedding=spec.vocab * h * 2.0,
        lm_head=0.0 if spec.tie_embeddings else spec.vocab * h * 2.0,
        router=h * spec.experts * 2.0,
    )
    if spec.checkpoint_bytes:
        scale = spec.checkpoint_bytes / w.total(spec)
        if 0.8 < scale < 1.25:  # a checkpoint carrying MTP layers or a vision tower differs more: keep the estimate
            for name in (
                "attention",
                "attention_replicated",
                "experts",
                "shared",
                "dense_mlp",
                "embedding",
                "lm_head",
                "router",
            ):
                setattr(w, name, getattr(w, name) * scale)
            w.scaled_to_checkpoint = scale
    return w


def pp_split(layers: int, pp: int) -> list[int]:
    """vLLM's get_pp_indices: L // pp each, the remainder to the partitions other than the last."""
    base, rem = divmod(layers, pp)
    sizes = [base] * pp
    for i in range(rem):
        sizes[i] += 1  # earlier partitions take the extra layers
    return sizes


def default_max_num_seqs(device: Device, world_size: int = 1) -> int:
    """Sequences one vLLM engine runs at once by default for its API server: 1024 on GPUs of 70 GiB or more
    (except A100), 256 on other GPUs, 128 per CPU rank (vllm/engine/arg_utils.py, as for the batched tokens)."""
    if device.kind == "cpu":
        return 128 * world_size
    return 1024 if device.memory_bytes >= 70 * GiB and "A100" not in device.name else 256


class Reserve(BaseModel):
    """The per-GPU memory vLLM keeps beside weights and KV cache, by vLLM's own terms (bytes)."""

    cuda_hidden: float  # x gpu_memory_utilization: vLLM takes its share of what CUDA reports, not of NVML's total
    non_torch: float
    activation: float  # the profile run's torch peak: the larger of the forward and the sampler below
    cuda_graphs: float  # vLLM's CUDA-graph estimate: first capture + (captures - 1) x per graph
    tokens: int  # max_num_batched_tokens the activation is sized for
    flat: bool = False  # a fixed reserve from the params (plan_reserve_gib), not the model
    forward: float = 0.0  # the profile forward's peak at max_num_batched_tokens
    sampler: float = 0.0  # the dummy sampler run's logits for min(max_num_seqs, tokens) requests, float32
    graph_captures: int = 0  # CUDA graphs vLLM captures (decode FULL and mixed PIECEWISE sizes)
    max_num_seqs: int = 0

    @property
    def total(self) -> float:
        return self.cuda_hidden + self.non_torch + self.activation + self.cuda_graphs

    def terms(self) -> dict[str, float]:
        """Each term in GiB, named as vLLM's log names it."""
        return {
            "activation peak": self.activation / GiB,
            "of which forward": self.forward / GiB,
            "of which sampler": self.sampler / GiB,
            "non-torch": self.non_torch / GiB,
            "CUDA-graph estimate": self.cuda_graphs / GiB,
            "memory CUDA does not report": self.cuda_hidden / GiB,
        }


class LayoutFields(Protocol):
    """The four serving fields a layout is made of, as the params and a server's configuration name them."""

    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def pipeline_parallel_size(self) -> int: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def enable_expert_parallel(self) -> bool: ...


class Parallelism(BaseModel):
    """A parallel layout as vLLM takes it; the one owner of its name and its serving flags."""

    model_config = ConfigDict(frozen=True)

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @computed_field  # type: ignore[prop-decorator]
    @property
    def name(self) -> str:
        parts = (
            [f"TP={self.tp}"] + ([f"PP={self.pp}"] if self.pp > 1 else []) + ([f"DP={self.dp}"] if self.dp > 1 else [])
        )
        return "+".join(parts) + ("+EP" if self.ep else "")

    def flags(self) -> list[str]:
        """vLLM's flags for this layout; sizes of 1 are vLLM's defaults and left out."""
        out: list[str] = []
        for flag, size in (
            ("--tensor-parallel-size", self.tp),
            ("--pipeline-parallel-size", self.pp),
            ("--data-parallel-size", self.dp),
        ):
            if size > 1:
                out += [flag, str(size)]
        if self.ep:
            out.append("--enable-expert-parallel")
        return out

    @classmethod
    def of(cls, fields: LayoutFields) -> Parallelism:
        """The layout of anything that holds the serving fields (the params, a server's configuration)."""
        return cls(
            tp=fields.tensor_parallel_size,
            pp=fields.pipeline_parallel_size,
            dp=fields.data_parallel_size,
            ep=fields.enable_expert_parallel,
        )

    def strategy(self, gpus_per_node: int) -> str:
        """How vLLM launches this layout across nodes: ``dp`` (a data-parallel group per node, each node's own
        engines) when every replica fits inside a node, else ``mp`` (one engine spanning the nodes)."""
        inner = self.tp * self.pp
        return "dp" if self.dp > 1 and inner <= gpus_per_node and gpus_per_node % inner == 0 else "mp"

    def params(self) -> dict[str, int | bool]:
        """The layout as servebook parameters (what a params file or an A/B variant sets)."""
        return {
            "tensor_parallel_size": self.tp,
            "pipeline_parallel_size": self.pp,
            "data_parallel_size": self.dp,
            "enable_expert_parallel": self.ep,
        }

    def updated(self, changes: Mapping[str, int | bool]) -> Parallelism:
        """This layout with the fields ``changes`` names (as the params name them) changed, validated."""
        short = dict(zip(self.params(), ("tp", "pp", "dp", "ep")))
        mine = {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep}
        return Parallelism.model_validate(mine | {short[k]: v for k, v in changes.items()})


@pydantic_dataclass
class Layout:
    """One layout as the plan judged it: vLLM's verdict, memory per GPU, KV capacity and decode ceilings."""

    tp: int
    pp: int
    dp: int
    ep: bool
    accepted: bool = True
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    moe_tp: int = 1
    ep_size: int = 1
    experts_per_gpu: int = 0
    weight_bytes_per_gpu: float = 0.0
    weight_breakdown: dict[str, float] = field(default_factory=dict)
    reserve: Reserve | None = None  # per GPU, beside weights and KV (GPU plans)
    kv_bytes_per_token_per_gpu: float = 0.0
    available_kv_bytes_per_gpu: float = 0.0
    max_kv_tokens: int = 0  # per engine (one DP rank)
    max_concurrency: float = 0.0  # requests of max_model_len, all DP ranks together
    fits: bool = True
    allreduces_per_token: int = 0
    all2all_per_token: int = 0
    decode_tok_s_single: float = 0.0
    decode_tok_s_batch: float = 0.0
    # the bandwidth ceiling on decode tok/s with this many sequences in the batch (powers of two)
    decode_ceiling: dict[int, float] = Field(default_factory=dict)
    batch: int = 0
    batch_fit: int = 0  # of the batch, the requests of max_model_len the KV cache holds at once (all DP ranks)
    score: float = 0.0
    # across nodes: which dimensions span machines, how vLLM is launched there, collectives on the network
    crosses: list[str] = field(default_factory=list)
    strategy: str = ""
    network_collectives_per_token: int = 0

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def name(self) -> str:
        return self.parallelism.name

    @computed_field  # type: ignore[prop-decorator]
    @property
    def flags(self) -> list[str]:
        return self.parallelism.flags()

    @property
    def usable(self) -> bool:
        return self.accepted and self.fits


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


def _fp8_linear_rule(spec: ModelSpec, layout: Layout) -> None:
    """8. FP8 block alignment of the attention and dense layers' slices."""
    tp = layout.tp
    if spec.quant.method != "fp8" or spec.quant.experts_only or tp == 1:
        return
    bn, bk = spec.quant.block or (128, 128)
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
# the KV tokens of all seven launched layouts (TP, EP, DP, PP, bf16 and FP8) come within 0.11 %.
CUDA_HIDDEN_BYTES = 0.60 * GiB  # NVML's total (140.40 GiB on an H200) minus what CUDA reports (139.80 GiB)
NON_TORCH_BYTES = 0.25 * GiB  # CUDA context, cuBLAS workspaces (logged 0.23 GiB at TP=1; 0.08 per DP engine)
NON_TORCH_COLLECTIVE_BYTES = 0.30 * GiB  # NCCL and custom all-reduce buffers at TP > 1 (logged 0.56; PP=2: 0.07)
ACTIVATION_FACTOR = 2.06  # logged profile peak / the tensors the profile run must hold at once (below)
GRAPH_TP_EXPONENT = 0.65  # TP=2 needed 0.224 GiB: graphs shrink with the activations they hold


def max_num_batched_tokens(device: Device) -> int:
    """vLLM's default for its API server: 8192 on GPUs of 70 GiB or more (except A100), else 2048
    (vllm/engine/arg_utils.py, _set_default_max_num_seqs_and_batched_tokens_args)."""
    return 8192 if device.memory_bytes >= 70 * GiB and "A100" not in device.name else 2048


def capture_sizes(max_num_seqs: int, max_capture: int = 0) -> list[int]:
    """vLLM's default CUDA-graph capture sizes: 1, 2, 4, then every 8 to 256, then every 16, up to the largest,
    min(2 x max_num_seqs, 512) (vllm/config/vllm.py, _set_cudagraph_sizes)."""
    largest = max_capture or min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [n for n in sizes if n <= largest]


# The dummy sampler run's logits, min(max_num_seqs, tokens) requests x vocabulary, on top of the forward's peak:
# Kimi-shaped, 163,840 tokens of vocabulary, 1,024 requests against 128 logged 0.41 GiB more (3.0 bytes per logit)
SAMPLER_BYTES_PER_LOGIT = 3.0
# MLA's profile forward (DeepSeek-V3 / Kimi shapes, FLASH_ATTN_MLA, Marlin INT4 MoE), fitted on the Kimi-shaped
# mini at 4,096, 8,192 and 16,384 batched tokens (docs/examples/h200-vllm/README.md): a fixed part (MLA's absorbed
# weights and the Marlin workspace) and, beside the MoE term every model has, bytes per token and head
MLA_FIXED_BYTES = 1.995 * GiB
MLA_BYTES_PER_TOKEN_HEAD = 933.0
# vLLM's CUDA-graph estimate captures the two largest graphs of each mode and extrapolates: the first capture's
# pool, plus one MiB (its floor) per further graph (gpu_model_runner.py, profile_cudagraph_memory); the pool is
# the larger of the two modes'. The first FULL capture of N requests (at min(max_model_len, tokens // N) tokens
# each, which moved nothing measurable): MLA (FLASH_ATTN_MLA) logged 4,130 MiB at N = 512 with 8,192 and with
# 16,384 batched tokens, 1,082 at 256, 514 at 128, 264 at 64: the larger of a term in N² and one per request.
# GQA (FlashAttention 3): 384 MiB at 512 requests for hidden 3,072, and 0.35 GiB in all for hidden 2,048
GRAPH_MLA_BYTES_PER_REQUEST_SQUARED = 0.015755 * 2**20
GRAPH_MLA_BYTES_PER_REQUEST = 4.1 * 2**20
GRAPH_GQA_BYTES_PER_REQUEST_HIDDEN = 256.0
GRAPH_PIECEWISE_BYTES_PER_HIDDEN = 144 * 2**20 / 7168  # Kimi 144 MiB, MiniMax 96 MiB (first PIECEWISE capture)
GRAPH_EXTRA_BYTES = 2**20
# A start that compiles (a torch.compile cache miss) profiles with Inductor's compile-time buffers still in torch's
# peak: the Kimi-shaped mini at vLLM's defaults logged 5.30 GiB on a miss, 4.21 GiB on a hit (warm relaunch and
# dummy-weight start), 1.2 % of its KV cache. Measured on MLA only; the GQA rows were all misses, their fit holds it.
MLA_COMPILE_MISS_BYTES = 1.09 * GiB


def graph_estimate(
    spec: ModelSpec, serving: Serving, seqs: int, tokens: int, max_model_len: int, tp: int
) -> tuple[float, int]:
    """(bytes, graphs captured) of vLLM's CUDA-graph estimate: FULL decode graphs up to max_num_seqs requests,
    PIECEWISE graphs up to the largest capture size, as vLLM 0.25's default FULL_AND_PIECEWISE mode does."""
    if serving.enforce_eager:
        return 0.0, 0
    piecewise = capture_sizes(seqs, serving.max_capture_size)
    full = [n for n in piecewise if n <= seqs]
    largest = full[-1] if full else 0
    if spec.mla:
        first_full = max(GRAPH_MLA_BYTES_PER_REQUEST_SQUARED * largest**2, GRAPH_MLA_BYTES_PER_REQUEST * largest)
    else:
        first_full = GRAPH_GQA_BYTES_PER_REQUEST_HIDDEN * largest * spec.hidden
    first_piecewise = GRAPH_PIECEWISE_BYTES_PER_HIDDEN * spec.hidden
    pool = max(first_full, first_piecewise) / tp**GRAPH_TP_EXPONENT
    return pool + GRAPH_EXTRA_BYTES * (max(len(full) - 1, 0) + max(len(piecewise) - 1, 0)), len(full) + len(piecewise)


def reserve_for(
    spec: ModelSpec,
    layout: Layout,
    device: Device,
    gpu_memory_utilization: float,
    serving: Serving | None = None,
    max_model_len: int = 4096,
) -> Reserve:
    """What vLLM will keep per GPU for this layout, term by term as its memory profile logs them."""
    serving = serving or Serving()
    tokens = serving.max_num_batched_tokens or max_num_batched_tokens(device)
    seqs = serving.max_num_seqs or default_max_num_seqs(device)
    tp, dp = layout.tp, layout.dp
    # The profile run's peak sits in a MoE layer: fused_moe's shared cache for the gate/up and down outputs
    # (M x top-k x max(2 I, H)) and its activation cache (M x top-k x I), in bf16. DP ranks gather each
    # other's tokens before the experts, with EP too (vLLM's default all2all backend, allgather-reducescatter:
    # TP=1+DP=2+EP logged 1.34 GiB, as much as without EP); without EP the experts are TP-sliced over TP x DP.
    if spec.is_moe and spec.expert_intermediate:
        moe_tokens = tokens * dp
        inter = spec.expert_intermediate // max(layout.moe_tp, 1)
        moe = moe_tokens * spec.experts_per_token * (max(2 * inter, spec.hidden) + inter) * 2
    else:
        moe = tokens * (2 * max(spec.dense_intermediate // tp, 1) + spec.hidden) * 2
    if spec.mla:
        forward = ACTIVATION_FACTOR * moe + MLA_FIXED_BYTES + tokens * spec.heads / tp * MLA_BYTES_PER_TOKEN_HEAD
        if serving.compile_cache_hit:
            forward -= MLA_COMPILE_MISS_BYTES
    else:
        attention = tokens * (spec.heads + 2 * spec.kv_heads) * spec.head_dim * 2 / tp
        forward = ACTIVATION_FACTOR * (moe + attention)
    sampler = min(seqs, tokens) * (spec.vocab / tp) * SAMPLER_BYTES_PER_LOGIT
    collective = NON_TORCH_COLLECTIVE_BYTES if tp > 1 else 0.0
    graphs, captures = graph_estimate(spec, serving, seqs, tokens, max_model_len, tp)
    return Reserve(
        cuda_hidden=gpu_memory_utilization * CUDA_HIDDEN_BYTES,
        non_torch=NON_TORCH_BYTES + collective,
        activation=forward + sampler,
        cuda_graphs=graphs,
        tokens=tokens,
        forward=forward,
        sampler=sampler,
        graph_captures=captures,
        max_num_seqs=seqs,
    )


@dataclass(frozen=True)
class Serving:
    """The engine settings the reserve moves with; 0 means vLLM's default for the device."""

    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    enforce_eager: bool = False
    max_capture_size: int = 0  # compilation_config's max_cudagraph_capture_size; 0: vLLM's rule
    compile_cache_hit: bool = False  # a relaunch that loads its torch.compile artefacts profiles a smaller peak


@dataclass(frozen=True)
class Sizing:
    """What every layout of one plan is sized against: the checkpoint's bytes and the serving settings."""

    weights: Weights
    max_model_len: int
    gpu_memory_utilization: float
    kv_dtype_bytes: int
    reserve_bytes: float | None  # a fixed reserve per GPU; None models it per layout
    batch: int
    serving: Serving = Serving()


def size(spec: ModelSpec, layout: Layout, device: Device, sizing: Sizing) -> None:
    """Memory per GPU, KV capacity, communication and a bandwidth ceiling for decode."""
    stage_layers = max(pp_split(spec.layers, layout.pp))
    moe_share = spec.moe_layers / spec.layers if spec.layers else 0
    moe_stage = stage_layers * moe_share
    parts = _weights_per_gpu(spec, layout, sizing.weights, stage_layers, moe_stage)
    layout.weight_breakdown = parts
    layout.weight_bytes_per_gpu = sum(parts.values())
    _size_kv_cache(spec, layout, device, sizing, stage_layers)
    _rate_decode(spec, layout, device, sizing, stage_layers, moe_stage)


def _expert_fraction(spec: ModelSpec, layout: Layout) -> float:
    """The share of each MoE layer's experts one GPU holds."""
    if layout.ep and spec.experts:
        return layout.experts_per_gpu / spec.experts
    return 1 / (layout.tp * layout.dp) if spec.is_moe else 0


def _weights_per_gpu(
    spec: ModelSpec, layout: Layout, weights: Weights, stage_layers: int, moe_stage: float
) -> dict[str, float]:
    """The bytes of each part of the model one GPU of the largest pipeline stage holds."""
    tp, pp = layout.tp, layout.pp
    dense_stage = stage_layers - moe_stage
    emb = (weights.embedding + weights.lm_head) / tp if pp == 1 else max(weights.embedding, weights.lm_head) / tp
    return {
        "attention": stage_layers * (weights.attention / tp + weights.attention_replicated),
        "experts": moe_stage * weights.experts * _expert_fraction(spec, layout),
        "shared_and_dense": moe_stage * (weights.shared / tp + weights.router) + dense_stage * weights.dense_mlp / tp,
        "embeddings": emb,
    }


def _size_kv_cache(spec: ModelSpec, layout: Layout, device: Device, sizing: Sizing, stage_layers: int) -> None:
    """KV bytes per token, the memory left for them beside weights and vLLM's reserve, the tokens and requests of
    max_model_len that fit, and vLLM's refusal where not one does."""
    max_model_len, utilization = sizing.max_model_len, sizing.gpu_memory_utilization
    if spec.mla:
        per_layer = (spec.kv_lora_rank + spec.qk_rope_head_dim) * sizing.kv_dtype_bytes
    else:
        per_layer = 2 * max(1, spec.kv_heads // layout.tp) * spec.head_dim * sizing.kv_dtype_bytes
    layout.kv_bytes_per_token_per_gpu = stage_layers * per_layer
    if device.kind == "cpu":
        available, reserve_bytes = float(device.cpu_kv_bytes), 0.0
    else:
        if sizing.reserve_bytes is None:
            layout.reserve = reserve_for(spec, layout, device, utilization, sizing.serving, max_model_len)
        else:
            layout.reserve = Reserve(
                cuda_hidden=0.0, non_torch=0.0, activation=sizing.reserve_bytes, cuda_graphs=0.0, tokens=0, flat=True
            )
        reserve_bytes = layout.reserve.total
        available = device.memory_bytes * utilization - layout.weight_bytes_per_gpu - reserve_bytes
    layout.available_kv_bytes_per_gpu = max(0.0, available)
    page = BLOCK_SIZE * per_layer
    blocks = int(layout.available_kv_bytes_per_gpu // page // stage_layers) if page and stage_layers else 0
    layout.max_kv_tokens = blocks * BLOCK_SIZE
    layout.max_concurrency = layout.dp * layout.max_kv_tokens / max_model_len if max_model_len else 0.0
    if not layout.accepted or layout.max_kv_tokens >= max_model_len:
        return
    layout.fits = False
    need = max_model_len * layout.kv_bytes_per_token_per_gpu / GiB
    if available <= 0:
        layout.reasons.append(
            f"ValueError: No available memory for the cache blocks: weights {layout.weight_bytes_per_gpu / GiB:.1f} GiB "
            f"+ reserve {reserve_bytes / GiB:.1f} GiB exceed {utilization:.0%} of "
            f"{device.memory_bytes / GiB:.0f} GiB per GPU"
        )
    else:
        layout.reasons.append(
            f"ValueError: To serve at least one request with the model's max seq len ({max_model_len}), "
            f"({need:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
            f"({available / GiB:.2f} GiB)."
        )


def _rate_decode(
    spec: ModelSpec, layout: Layout, device: Device, sizing: Sizing, stage_layers: int, moe_stage: float
) -> None:
    """Collectives per token and the decode bandwidth ceiling, at one stream and at the batch the layout holds."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    # Collectives per decode step (per token of one sequence): two all-reduces per layer under TP; MoE layers
    # spanning DP add an all-gather/reduce-scatter (no EP) or a dispatch/combine all-to-all (EP) each.
    layout.allreduces_per_token = 2 * spec.layers if tp > 1 else 0
    layout.all2all_per_token = 2 * spec.moe_layers if spec.is_moe and dp > 1 else 0
    stage_collectives = (layout.allreduces_per_token + layout.all2all_per_token) * stage_layers / max(spec.layers, 1)
    # Bandwidth ceiling: bytes each GPU of a stage reads per step (weights of the experts the batch touches,
    # everything else, the batch's KV), plus a fixed latency per collective. Stages run in sequence for one
    # sequence; with a batch, vLLM keeps PP micro-batches in flight, so stages overlap.
    parts = layout.weight_breakdown
    non_expert = parts["attention"] + parts["shared_and_dense"] + parts["embeddings"]
    expert_per_layer_gpu = sizing.weights.experts * _expert_fraction(spec, layout)
    context = min(sizing.max_model_len, 2048)
    network = _network_seconds(spec, layout, device, stage_layers, moe_stage)

    def step_seconds(b: float) -> float:
        experts = 0.0
        if spec.is_moe:
            # distinct experts a batch of b sequences touches in a layer (uniform routing)
            touched = spec.experts * (1 - (1 - spec.experts_per_token / spec.experts) ** max(b, 1))
            experts = moe_stage * expert_per_layer_gpu * touched / spec.experts
        read = non_expert + experts + b * context * layout.kv_bytes_per_token_per_gpu
        return read / device.bandwidth_bytes_s + stage_collectives * device.collective_latency_s + network(b)

    batch = sizing.batch
    layout.batch = batch
    # a layout is ranked at the batch it can hold at full context: one whose KV cache takes 20 requests of
    # max_model_len serves a batch of 64 long ones 20 at a time, however fast its steps
    layout.batch_fit = max(1, min(batch, int(layout.max_concurrency))) if layout.max_concurrency else batch
    if device.bandwidth_bytes_s:
        layout.decode_tok_s_single = 1 / (pp * step_seconds(1))
        fit = layout.batch_fit
        per_micro = max(fit / (dp * pp), 1)
        layout.decode_tok_s_batch = min(fit, dp * pp * per_micro) / (pp * step_seconds(per_micro))
        layout.decode_ceiling = {b: b / (pp * step_seconds(max(b / (dp * pp), 1))) for b in (2**k for k in range(15))}


def _network_seconds(
    spec: ModelSpec, layout: Layout, device: Device, stage_layers: int, moe_stage: float
) -> Callable[[float], float]:
    """What a stage's step pays beyond the in-node collectives it is already charged, for ``b`` sequences, when
    its collectives cross nodes: the link's latency and the bytes at its bandwidth (bf16 activations)."""
    link = device.link
    if link is None or not layout.crosses:
        return lambda b: 0.0
    tp, pp = layout.tp, layout.pp
    activation = spec.hidden * 2
    allreduces = 2 * stage_layers if "TP" in layout.crosses else 0
    all2all = 2 * moe_stage if "DP" in layout.crosses and spec.is_moe else 0.0
    # pipeline boundaries that cross nodes, per stage (a stage's step is 1/pp of a token's pass)
    boundaries = (math.ceil(tp * pp / device.per_node) - 1) / pp if "PP" in layout.crosses else 0.0
    layout.network_collectives_per_token = round(
        (allreduces + all2all) * spec.layers / max(stage_layers, 1) + boundaries * pp
    )
    away = 1 - 1 / max(device.nodes, 1)  # share of an all-to-all's tokens bound for other nodes

    def seconds(b: float) -> float:
        ring = b * activation * 2 * (tp - 1) / tp
        extra = allreduces * (link.latency_s - device.collective_latency_s + ring / link.bandwidth_bytes_s)
        extra += all2all * (
            link.latency_s
            - device.collective_latency_s
            + b * spec.experts_per_token * activation * away / link.bandwidth_bytes_s
        )
        return extra + boundaries * (link.latency_s + b * activation / link.bandwidth_bytes_s)

    return seconds


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


def plan(
    spec: ModelSpec,
    device: Device,
    *,
    max_model_len: int = 4096,
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION,
    kv_cache_dtype: str = "auto",
    reserve_gib: float | None = None,
    batch: int = 64,
    serving: Serving | None = None,
) -> Plan:
    """Every TP x PP x DP = G layout, with and without expert parallelism, checked, sized and ranked."""
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
        serving=serving or Serving(),
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
        candidate.score = candidate.decode_tok_s_batch
    # the highest ceiling at the batch each holds; among equals, fewer pipeline stages, then fewer collectives
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
        activation_reserve_bytes=sizing.reserve_bytes,
        weights_total_bytes=sizing.weights.total(spec),
        weights_scaled_to_checkpoint=sizing.weights.scaled_to_checkpoint,
        batch=batch,
        layouts=layouts,
        recommended=recommended,
        why=_why(recommended, usable, batch, device),
    )


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
        listed = ", ".join(f"{c.name}: {c.batch_fit}" for c in short[:4]) + (", ..." if len(short) > 4 else "")
        held = f"; {len(short)} hold fewer than {batch} requests of max_model_len and were ranked at that ({listed})"
    else:
        held = ""
    return (
        f"{recommended.name}: highest decode ceiling at {recommended.batch_fit} concurrent sequences "
        f"({recommended.decode_tok_s_batch:,.0f} tok/s) among {len(usable)} layouts that vLLM accepts and that fit"
        + held
    )
