"""What a layout is: the device it runs on, the parallel sizes, and what the rules and the sizing write onto it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from servebook import vllm_defaults
from servebook.errors import PlanInputError
from servebook.gpus import GpuModel
from servebook.modelspec import ModelSpec
from servebook.planner.truth import Band, Measured, Provenance
from servebook.units import GiB

BLOCK_SIZE = 16  # vLLM's default KV block size
VOCAB_PAD = 64  # vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE
MARLIN_GROUPS = (-1, 32, 64, 128)
# One small all-reduce: 26-48 us measured on 8 PCIe GPUs; 35-45 us through torch.distributed on two NVLink H200s,
# less inside vLLM's custom all-reduce.
PCIE_COLLECTIVE_S = 45e-6
NVLINK_COLLECTIVE_S = 30e-6
GPU_MEMORY_UTILIZATION = vllm_defaults.NEWEST.gpu_memory_utilization  # the params' default: vLLM's own


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
    # what vLLM allocates while loading beyond the files (not in total(), which is the checkpoint's)
    mla_absorbed: float = 0.0  # per layer, TP-sharded: MLA's bf16 copy of a quantized kv_b_proj
    rope_cache: float = 0.0  # per GPU: RoPE's cos/sin table

    def total(self, spec: ModelSpec) -> float:
        """The checkpoint's bytes as vLLM loads them (MTP layers out), without what loading adds."""
        return (
            spec.layers * (self.attention + self.attention_replicated)
            + spec.moe_layers * (self.experts + self.shared + self.router)
            + spec.dense_layers * self.dense_mlp
            + self.embedding
            + self.lm_head
        )


def weight_bytes(spec: ModelSpec) -> Weights:
    """Bytes per component from the shapes and the quantization; scaled to the exact total vLLM loads when known
    (the files less the MTP layers it skips: counting them overstated a mini with one such layer by 21 %)."""
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
    if loaded := spec.loaded_bytes:
        scale = loaded / w.total(spec)
        if 0.8 < scale < 1.25:  # a checkpoint carrying a vision tower differs more: keep the estimate
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
    _load_buffers(spec, w)
    return w


def _load_buffers(spec: ModelSpec, w: Weights) -> None:
    """What vLLM's load adds to the files' bytes, in its "Model loading took" figure (vLLM 0.25). RoPE's cos/sin
    table for max_position_embeddings positions in the model's dtype (rotary_embedding/base.py; one table shared by
    every layer through get_rope's cache): Qwen3-235B's 10 MiB, GLM-4.5's 16, DeepSeek-V3's 20 logged within the
    log's 0.01 GiB. Under MLA with a quantized kv_b_proj, process_weights_after_loading dequantizes it into bf16
    W_UK_T and W_UV beside the FP8 original (mla_attention.py: "we just store fp16/bf16 copies"): kv_lora_rank x
    (nope + v) x 2 bytes per head and layer. Block-FP8 MLA minis at 16 to 128 heads loaded 44 to 85 MiB above their
    files (run-truth-heads, run-truth-h100, run-truth-small), these two 28 to 84; the 0 to 21 MiB left is in the
    weights' band."""
    w.rope_cache = spec.max_position_embeddings * spec.rotary_dim * 2.0
    if spec.mla and not spec.quant.experts_only and spec.quant.method != "none":
        w.mla_absorbed = spec.kv_lora_rank * spec.heads * (spec.qk_nope_head_dim + spec.v_head_dim) * 2.0


def pp_split(layers: int, pp: int) -> list[int]:
    """vLLM's get_pp_indices: L // pp each, the remainder to the partitions other than the last."""
    base, rem = divmod(layers, pp)
    sizes = [base] * pp
    for i in range(rem):
        sizes[i] += 1  # earlier partitions take the extra layers
    return sizes


def default_max_num_seqs(device: Device, world_size: int = 1, vllm_version: str = "") -> int:
    """Sequences one vLLM engine runs at once by default for its API server, by that vLLM's table
    (:mod:`servebook.vllm_defaults`): 1024 on H100/H200-class GPUs, 256 on smaller ones and A100s, 128 per CPU rank."""
    row = vllm_defaults.for_version(vllm_version)
    if device.kind == "cpu":
        return row.cpu_max_num_seqs_per_rank * world_size
    return row.batch_limits(device.memory_bytes, device.name)[0]


class Reserve(BaseModel):
    """The per-GPU memory vLLM keeps beside weights and KV cache, by vLLM's own terms (bytes)."""

    cuda_hidden: float  # x gpu_memory_utilization: vLLM takes its share of what CUDA reports, not of NVML's total
    non_torch: float
    activation: float  # the profile run's torch peak: what the forward keeps, then its transient part or the sampler
    cuda_graphs: float  # vLLM's CUDA-graph estimate: first capture + (captures - 1) x per graph
    tokens: int  # max_num_batched_tokens the activation is sized for
    flat: bool = False  # a fixed reserve from the params (plan_reserve_gib), not the model
    forward: float = 0.0  # the profile forward's peak at max_num_batched_tokens
    transient: float = 0.0  # the part of it freed before the sampler runs
    sampler: float = 0.0  # the dummy sampler run for min(max_num_seqs, tokens) requests
    graph_captures: int = 0  # CUDA graphs vLLM captures (decode FULL and mixed PIECEWISE sizes)
    graph_further: float = 0.0  # of cuda_graphs, what the graphs after each mode's first are charged
    graph_piecewise: int = 0  # of graph_captures, the PIECEWISE ones (a FULL graph after the first takes 1 MiB)
    graph_spread: float = 0.0  # how far a further PIECEWISE graph may pass its charge (sizing.piecewise_spread)
    compile_miss: float = 0.0  # of activation, what a start that compiles is taken to keep beyond a warm one
    compile_cache_hit: bool = False  # sized for a start that loads its torch.compile artefacts
    real_first_start: float = 0.0  # what a cold start on real weights keeps beyond a dummy-weight one (rehearsal)
    max_num_seqs: int = 0

    @property
    def total(self) -> float:
        return self.cuda_hidden + self.non_torch + self.activation + self.cuda_graphs

    def terms(self) -> dict[str, float]:
        """Each term in GiB, named as vLLM's log names it."""
        left = {"of which a first start's compile leaves for Python's collector": self.compile_miss / GiB}
        return {
            "activation peak": self.activation / GiB,
            "of which the forward keeps": (self.forward - self.transient) / GiB,
            "of which the larger of the forward's transient part and the sampler": max(self.transient, self.sampler)
            / GiB,
            **(left if self.compile_miss else {}),
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

    model_config = ConfigDict(frozen=True, extra="forbid")  # Parallelism(tensor_parallel_size=2) is no TP=1

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False

    @model_validator(mode="before")
    @classmethod
    def _without_its_name(cls, data: object) -> object:
        """A saved layout carries its computed ``name``; it is read back from the sizes, not taken."""
        if isinstance(data, dict) and "name" in data:
            return {k: v for k, v in data.items() if k != "name"}
        return data

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
    # the same ceiling for the benchmark's workload, each stream holding its mean context (prompt and half the
    # output) rather than a long request's: the bound a sweep's levels are read against (empty: no workload given)
    workload_ceiling: dict[int, float] = Field(default_factory=dict)
    # what the layout is forecast to deliver at those batches (planner.sizing.forecast_tok_s), and at its batch
    forecast: dict[int, float] = Field(default_factory=dict)
    forecast_tok_s_batch: float = 0.0
    batch: int = 0
    batch_fit: int = 0  # of the batch, the requests of max_model_len the KV cache holds at once (all DP ranks)
    score: float = 0.0
    # across nodes: which dimensions span machines, how vLLM is launched there, collectives on the network
    crosses: list[str] = field(default_factory=list)
    strategy: str = ""
    network_collectives_per_token: int = 0
    # how sure the plan is (planner.truth): each predicted figure with its band, and where the KV figure comes from
    provenance: Provenance | Literal[""] = ""  # measured, calibrated, extrapolated
    learned_from: Measured | None = None  # the earlier start the KV figure learned from
    same_command_measured: bool = False  # ... with this very layout and these settings
    learned_bytes: float = 0.0  # what the KV memory moved by for it (truth.Measured.gap_for)
    # where the rest of an earlier start was set aside: the CUDA-graph estimate it logged at the same captures
    graphs_measured_by: Measured | None = None
    signature: str = ""  # the model's, as the history keys it
    settings: dict[str, str] = field(default_factory=dict)  # what moves the reserve, as the history keys it
    kv_basis: str = ""
    bands: dict[str, Band] = field(default_factory=dict)

    @property
    def sweep_ceiling(self) -> dict[int, float]:
        """The ceiling a sweep's levels are read against: the workload's, else the long-request one."""
        return self.workload_ceiling or self.decode_ceiling

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
