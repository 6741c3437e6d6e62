"""What a layout holds per GPU: weights, the reserve, the KV cache, and the decode rate its memory traffic allows."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from servebook import vllm_defaults
from servebook.modelspec import ModelSpec
from servebook.planner import truth
from servebook.planner.layout import BLOCK_SIZE, Device, Layout, Reserve, Weights, default_max_num_seqs, pp_split
from servebook.units import GiB

# the KV tokens of all seven launched layouts (TP, EP, DP, PP, bf16 and FP8) come within 0.11 %.
CUDA_HIDDEN_BYTES = 0.60 * GiB  # NVML's total (140.40 GiB on an H200) minus what CUDA reports (139.80 GiB)
# where a card of that name was measured: the H100 SXM's NVML 81,559 MiB against the 79.18 GiB vLLM's worker logs
# as total_memory (22 starts, 2026-12-05); planned with the H200's 0.60 every H100 start's KV memory was 0.10-0.16
# GiB short
CUDA_HIDDEN_BYTES_BY_GPU = {"H100": 81_559 * 2**20 - 79.18 * GiB}


def cuda_hidden_bytes(device: Device) -> float:
    """What NVML counts on this card that CUDA does not give out (vLLM takes its share of CUDA's total)."""
    name = device.name.upper()
    return next((b for gpu, b in CUDA_HIDDEN_BYTES_BY_GPU.items() if gpu in name), CUDA_HIDDEN_BYTES)


NON_TORCH_BYTES = 0.25 * GiB  # CUDA context, cuBLAS workspaces (logged 0.23 GiB at TP=1; 0.08 per DP engine)
NON_TORCH_COLLECTIVE_BYTES = 0.30 * GiB  # NCCL and custom all-reduce buffers at TP > 1 (logged 0.56; PP=2: 0.07)
ACTIVATION_FACTOR = 2.06  # logged profile peak / the tensors the profile run must hold at once (below)
GRAPH_TP_EXPONENT = 0.65  # TP=2 needed 0.224 GiB: graphs shrink with the activations they hold


def max_num_batched_tokens(device: Device, vllm_version: str = "") -> int:
    """vLLM's default for its API server, by that vLLM's table (:mod:`servebook.vllm_defaults`): 8192 on
    H100/H200-class GPUs, 2048 on smaller ones and A100s (16384 from 160 GiB in 0.32), 2048 per CPU rank."""
    row = vllm_defaults.for_version(vllm_version)
    if device.kind == "cpu":
        return row.cpu_max_num_batched_tokens_per_rank
    return row.batch_limits(device.memory_bytes, device.name)[1]


def capture_sizes(max_num_seqs: int, max_capture: int = 0) -> list[int]:
    """vLLM's default CUDA-graph capture sizes: 1, 2, 4, then every 8 to 256, then every 16, up to the largest,
    min(2 x max_num_seqs, 512) (vllm/config/vllm.py, _set_cudagraph_sizes)."""
    largest = max_capture or min(2 * max_num_seqs, 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [n for n in sizes if n <= largest]


# vLLM's profile run is the forward at max_num_batched_tokens, then the dummy sampler run on min(max_num_seqs,
# tokens) requests (gpu_model_runner.py, profile_run and _dummy_sampler_run) with top-k and top-p set, over the
# whole vocabulary on every GPU (logits_processor.py all-gathers the TP shards). By then the forward's transient
# buffers are freed and what it keeps is still held, so the torch peak is the kept part plus the larger of the
# transient part and the sampler. Under GQA both are read off vLLM 0.25's code and its allocator: the
# profile_peak/ hook (docs/examples/h200-vllm/run-profile-peak) recorded every allocation alive at the peak of four
# GLM-4.5-shaped minis (GLM-4.5 and the Air, 2 and 4 layers, H100, 2026-12-06), and these terms give each peak to
# within 8 MiB once Python's collector has run (below).
# The sampler: the bf16 logits, their float32 copy (sampler.py:96), the float32 probabilities
# (topk_topp_sampler.py:141) and random_sample's float32 exponential noise (:434), 14 bytes per logit, 2,148 MiB at
# 1,024 requests and 151,552 tokens of vocabulary; the top-k/top-p Triton kernel's scratch, one float32 row of the
# vocabulary per program, as many programs as the GPU has SMs up to the next power of two of the requests
# (topk_topp_triton.py, 76.3 MiB on an H100's 132); the last hidden states and their random stand-in, bf16.
GQA_SAMPLER_BYTES_PER_LOGIT = 14.0
TOP_K_TOP_P_PROGRAMS = 132  # SMs of an H100 or H200
# What the forward keeps: fused_moe's Triton workspaces, which vLLM's workspace manager holds for the process
# (v1/worker/workspace.py; modular_kernel.py, _allocate_buffers; triton_moe.py, workspace_shapes: top-k x
# max(I, H) and top-k x max(2 I, H) per token, bf16: 1,024 MiB for the Air, 1,280 for GLM-4.5 at 8,192 tokens),
# the model's output hidden states and a buffer of the attention's k and v size (32 MiB at 8,192 tokens on both).
# A start that compiles (a torch.compile cache miss) also keeps what the compile's run left in reference cycles
# until profile_run's own gc.collect(): 0, 0.44, 0.50 and 1.53 GiB at vLLM's defaults on the four minis (the Air
# at 8 and 16 layers 1.43), none on a warm start or with the collector run before the sampler (GLM-4.5 at 4
# layers: 5.01 GiB cold, 3.48 collected, 3.48 warm). How much is left depends on when Python's collector last ran, which no shape figure tells: the point
# is the minis' median, 6.6 hidden-sized bf16 tensors per batched token; the band reaches from none to the most
# seen, one set of tensors per distinct compiled piece (gqa_compile_garbage_bound: 1.53 GiB for GLM-4.5 at 4
# layers, 1.43 for the Air at 8 and at 16 layers alike, 20-22 hidden tensors). The first GQA fit (six hidden
# tensors and the dense MLP's buffers kept, 16 bytes per logit) fitted GLM-4.5's 2-layer mini and put the Air's peak
# 0.50 GiB high.
GQA_COMPILE_MISS_HIDDEN_TENSORS = 6.6
# within this share of what vLLM's allocator held at the peak of the four recorded starts (the code-read terms)
GQA_CODE_READ_ACTIVATION_BAND = 0.03
# A dense GQA model keeps a share of its forward: no dense start has been measured.
TRANSIENT_SHARE_GQA = 0.42
# The MLA fits below take the sampler at 16 bytes per logit, as they were fitted with it.
SAMPLER_BYTES_PER_LOGIT = 16.0
# MLA's sampler, fitted as a term on top of its forward: the Kimi-shaped mini (163,840) logged 0.41 GiB more at
# 1,024 requests than at 128 with real weights, and the same peak at 32, 256 and 1,024 on dummy weights: its
# forward's transient part covers most of the sampler, in a way these starts cannot yet separate.
MLA_SAMPLER_BYTES_PER_LOGIT = 3.0
# MLA's profile forward (DeepSeek-V3 / Kimi shapes, FLASH_ATTN_MLA, Marlin INT4 MoE), fitted on the Kimi-shaped
# mini at 4,096, 8,192 and 16,384 batched tokens (docs/examples/h200-vllm/README.md): a fixed part (MLA's absorbed
# weights and the Marlin workspace) and, beside the MoE term every model has, bytes per token and head
MLA_FIXED_BYTES = 1.995 * GiB
MLA_BYTES_PER_TOKEN_HEAD = 933.0
# Block-FP8 MLA (DeepSeek-V3's own format, Triton FP8 MoE), fitted on DeepSeek-V3-shaped minis at 16, 32, 64 and
# 128 heads (64 experts) at 2,048 and 8,192 batched tokens, 128 and 1,024 requests, 4k and 8k context, on an H100
# (docs/examples/h200-vllm/run-truth-heads): the context moves nothing; up to 64 heads per GPU the peak is the
# sampler's (16 bytes per logit, as on GQA) on top of what the forward keeps (in step with fused_moe's workspaces),
# the same at every head count; at 128 the forward's transient part passes it (4.74 GiB at vLLM's defaults, 3.71 at
# 64 heads and below), and it shrinks as each request brings more tokens. Between 64 and 128 heads the rise is
# steep (1.9 GiB at 1,024 requests and 2,048 tokens), steeper than heads squared (which misses two of the points
# by 0.16 GiB): the fourth power below stands for a change these head counts cannot locate, and it matches the
# head counts real layouts give (8 to 128 per GPU). Held out of the fit and inside 0.1 GiB of it: the DeepSeek-V3
# (256 experts), Kimi-K2 (384 experts, vocabulary 163,840) and 64-head minis of run-truth-h100. Refitted and
# checked by benchmarks/mla_fp8_activation_fit.py.
MLA_FP8_KEPT_PER_MOE = 1.647
MLA_FP8_KEPT_BYTES = -0.116 * GiB
MLA_FP8_TRANSIENT_BYTES = 2.153 * GiB
MLA_FP8_TRANSIENT_BYTES_PER_TOKEN = -146_800.0  # the GPU's own batched tokens: attention is not gathered over DP
MLA_FP8_TRANSIENT_BYTES_PER_REQUEST_AT_128_HEADS = 2.066e6
# A block-FP8 MLA start that compiles cold keeps more at depth than the 2-layer minis above showed: the DeepSeek-V3-
# shaped mini at 24 layers (23 MoE, 16 experts, dummy weights, vLLM's defaults, one H100, run-graphs/mla) profiled
# 3.43 GiB above this fit, its KV 10.2 % short of the plan. A 2-layer mini has no piece from one MoE layer to the
# next: under GQA that piece's set of tensors is what a cold compile leaves for Python's collector, once for the
# whole model whatever its depth (the GLM-4.5-Air mini at 8 and at 16 layers, run-profile-peak), and a warm start
# leaves none. The 3.43 GiB is taken as that set under MLA, 31.4 hidden-sized bf16 tensors per batched token (its
# 128-head queries are 3.4 hidden states each). One start showed it; whether it is the compile's (gone warm) or
# grows with depth is not yet measured (on-h200-graphs.sh THEN="ds-24l:again ds-24l:eager ds-12l:first" tells). So
# a cold start is charged half of it and the activation's band reaches from none to all of it.
MLA_FP8_COMPILE_GARBAGE_HIDDEN_TENSORS = 31.4
MLA_FP8_COMPILE_MISS_SHARE = 0.5
# The transient part at the hidden size it was fitted on; it moves with the hidden size (the forward's activations
# are tokens x hidden): the Moonlight-like mini (hidden 2048, held out, run-truth-small, 2026-12-05) peaked at
# 0.81 GiB at 128 requests, what the transient scaled by 2048 / 7168 gives (0.29 GiB beside 0.52 kept); unscaled
# it planned 1.55 GiB and its KV 1.25 % short, outside the band
MLA_FP8_TRANSIENT_HIDDEN = 7168
# vLLM's CUDA-graph estimate captures the two largest graphs of each mode and extrapolates: the first capture's
# pool, plus one MiB (its floor) per further graph (gpu_model_runner.py, profile_cudagraph_memory); the pool is
# the larger of the two modes'. The first FULL capture of N requests holds 128 bytes per request, attention head on
# the GPU and value dimension (head_dim under GQA, kv_lora_rank under MLA): FlashAttention 3's split-KV
# accumulators, fp32. Logged by vLLM 0.25 (DEBUG, "Estimated FULL CUDA graph memory"): GQA 768 MiB at 512
# requests for GLM-4.5's 96 heads (194 at 128), 384 for MiniMax's 48, 0.224 GiB in all at TP=2 for Qwen3-30B's 32;
# block-FP8 MLA 4,224 MiB at 512 for DeepSeek-V3's 128 heads (1,026 at 128), 2,080 for Kimi-K2's 64 (514 at 128)
# (docs/examples/h200-vllm/run-truth-h100). The INT4 Kimi-K2.5 mini (64 heads, Marlin MoE) logged the same rate
# up to 256 requests and twice it, 4,130 MiB, at 512: a term in N² that only INT4 MLA has shown.
GRAPH_BYTES_PER_REQUEST_HEAD_VALUE = 128.0
GRAPH_MLA_INT4_BYTES_PER_REQUEST_SQUARED = 0.015755 * 2**20
# The first PIECEWISE capture: block-FP8 MLA at the FULL rate per token (DeepSeek-V3 mini 4,204 MiB at 512 tokens
# and 2,136 at 256, Kimi-K2 mini 2,140 and 1,088); elsewhere by the hidden size (Kimi INT4 144 MiB, MiniMax 96)
GRAPH_PIECEWISE_BYTES_PER_HIDDEN = 144 * 2**20 / 7168
# and a part that does not grow with heads: 64-108 MiB above the FULL rate on every block-FP8 MLA start at 16-128
# heads, 256 and 512 tokens (run-truth-heads, run-truth-h100)
GRAPH_MLA_FP8_PIECEWISE_EXTRA_BYTES = 84 * 2**20
GRAPH_EXTRA_BYTES = 2**20
# Each further PIECEWISE graph is charged what the second-largest capture took from the device: vLLM's 1 MiB floor,
# unless the attention's bf16 output for that many tokens (heads x head_dim per token) reaches 10 MiB, PyTorch's
# size for a segment of its own (kMinLargeAlloc). Then the capture may find no free segment for it: GLM-4.5's 2-layer
# mini (96 heads; 11.6 MiB at 496 tokens) logged 12 MiB per graph, its own segment rounded to 2 MiB; the same 96
# heads at 4 layers logged 2 MiB, and so did the GLM-4.5-Air at 4 layers, at 2 layers the floor (run-truth-air,
# run-profile-peak; graph_snapshot/ showed the Air's first capture leaving free 12 MiB segments GLM-4.5's did
# not). Which one a shape gets depends on how its first capture packed: the point is the 2 MiB most took, and the
# graphs' band spreads each further PIECEWISE graph by 11 MiB (truth.GRAPH_PER_GRAPH_SPREAD_BYTES). Block-FP8 MLA
# logged the floor at every head count: its first PIECEWISE capture frees GiBs of blocks the second one is served
# from. One start at the same captures replaces the point (truth.Measured.measured_terms_gap).
GRAPH_OWN_SEGMENT_BYTES = 10 * 2**20
GRAPH_LARGE_OUTPUT_PER_GRAPH_BYTES = 2 * 2**20
# A PIECEWISE "graph" is one CUDA graph per piece between the splitting ops (attention and its KV-cache write, so
# pieces per layer), and what a further one takes grows with the layers: at 40 layers the Qwen3-30B-shaped mini
# logged 6 MiB per graph in bf16 and in block FP8 and so did a 64-head, 4,096-hidden bf16 shape (7 MiB once, from
# the 0.64 GiB total of run-reach-h100); 4 MiB at 24 layers, 1-2 MiB at 2-12 (DEBUG lines, one H100, vLLM 0.25,
# docs/examples/h200-vllm/run-graphs). On 13 of the 14 GQA logs that say, this rate's charge (or the floor) is
# within 1.6 MiB of vLLM's, which moves in 2 MiB pages (GRAPH_PER_GRAPH_PAGE_SPREAD_BYTES); GLM-4.5's 2-layer mini
# took 12 MiB (its attention output's own segment, above).
GRAPH_PIECEWISE_BYTES_PER_LAYER = 0.15 * 2**20
GRAPH_PER_GRAPH_PAGE_SPREAD_BYTES = 2 * 2**20
# A start that compiles (a torch.compile cache miss) profiles with what the compile's run left for Python's
# collector still in torch's peak (on GQA, GQA_COMPILE_MISS_HIDDEN_TENSORS): the Kimi-shaped mini at vLLM's
# defaults logged 5.30 GiB on a miss, 4.21 GiB on a hit (warm relaunch and dummy-weight start), 1.2 % of its KV cache.
MLA_COMPILE_MISS_BYTES = 1.09 * GiB
# Dummy weights never add it: the Kimi-shaped mini's dummy starts logged the warm figure also when they compiled
# cold, and its first real start after a rehearsal sized 0.285 % fewer KV tokens than the rehearsal, twice (0.28 GiB
# at 2,048 batched tokens, where this rate says 0.27). So what a first start on real weights keeps beyond its
# dummy rehearsal, per batched token, on MLA (measured with INT4 experts; the block-FP8 GQA pair sized the same).
MLA_REAL_COLD_BYTES_PER_TOKEN = MLA_COMPILE_MISS_BYTES / 8192


def real_first_start_bytes(spec: ModelSpec, tokens: int) -> float:
    """Per GPU, what a real-weight start that compiles cold keeps in its profile peak beyond a dummy-weight start of
    the same command (:data:`MLA_REAL_COLD_BYTES_PER_TOKEN`); 0 where none was measured."""
    return MLA_REAL_COLD_BYTES_PER_TOKEN * tokens if spec.mla else 0.0


def graph_estimate(
    spec: ModelSpec, serving: Serving, seqs: int, tokens: int, max_model_len: int, tp: int, *, layers: int = 0
) -> tuple[float, int, float]:
    """(bytes, graphs captured, of those bytes the graphs' after each mode's first) of vLLM's CUDA-graph estimate:
    FULL decode graphs up to max_num_seqs requests, PIECEWISE graphs up to the largest capture size, as vLLM 0.25's
    default FULL_AND_PIECEWISE mode does. ``layers``: the GPU's pipeline stage's (all of them where 0)."""
    if serving.enforce_eager:
        return 0.0, 0, 0.0
    piecewise = capture_sizes(seqs, serving.max_capture_size)
    full = [n for n in piecewise if n <= seqs]
    largest = full[-1] if full else 0
    per_size = GRAPH_BYTES_PER_REQUEST_HEAD_VALUE * spec.heads / tp * (spec.kv_lora_rank if spec.mla else spec.head_dim)
    first_full = per_size * largest
    if spec.mla and spec.quant.method == "int4":
        first_full = max(first_full, GRAPH_MLA_INT4_BYTES_PER_REQUEST_SQUARED * largest**2 / tp**GRAPH_TP_EXPONENT)
    if spec.mla and spec.quant.method == "fp8":
        first_piecewise = per_size * (piecewise[-1] if piecewise else 0) + GRAPH_MLA_FP8_PIECEWISE_EXTRA_BYTES
    else:
        first_piecewise = GRAPH_PIECEWISE_BYTES_PER_HIDDEN * spec.hidden / tp**GRAPH_TP_EXPONENT
    pool = max(first_full, first_piecewise)
    further_full = GRAPH_EXTRA_BYTES * max(len(full) - 1, 0)
    per_graph = piecewise_per_graph(spec, piecewise, tp, layers)
    further = further_full + per_graph * max(len(piecewise) - 1, 0)
    return pool + further, len(full) + len(piecewise), further


def piecewise_per_graph(spec: ModelSpec, piecewise: list[int], tp: int, layers: int = 0) -> float:
    """What vLLM 0.25 charges each PIECEWISE graph after the first: its pieces' own
    (:data:`GRAPH_PIECEWISE_BYTES_PER_LAYER`) or a segment of the attention output's
    (:data:`GRAPH_OWN_SEGMENT_BYTES`), at least vLLM's floor."""
    if len(piecewise) < 2:
        return GRAPH_EXTRA_BYTES
    own_segment = not spec.mla and large_attention_output(spec, piecewise, tp)
    pieces = GRAPH_PIECEWISE_BYTES_PER_LAYER * (layers or spec.layers)
    return max(GRAPH_LARGE_OUTPUT_PER_GRAPH_BYTES if own_segment else GRAPH_EXTRA_BYTES, pieces)


def large_attention_output(spec: ModelSpec, piecewise: list[int], tp: int) -> bool:
    """Whether the attention's bf16 output at the second-largest capture needs a segment of its own."""
    return len(piecewise) >= 2 and spec.heads / tp * spec.head_dim * 2 * piecewise[-2] >= GRAPH_OWN_SEGMENT_BYTES


def piecewise_spread(spec: ModelSpec, piecewise: list[int], tp: int, layers: int = 0) -> float:
    """How far one further PIECEWISE graph's charge has been seen to pass the plan's, bytes: under GQA, PyTorch's
    2 MiB pages unless the attention output takes a segment of its own (then how the first capture packed decides:
    truth.GRAPH_PER_GRAPH_SPREAD_BYTES); under block-FP8 MLA, the pieces' charge itself: the floor on all 38 modes
    logged at 2-3 layers, 6 MiB at 24 layers where the charge is 3.6 (run-graphs/mla)."""
    if not spec.mla and not large_attention_output(spec, piecewise, tp):
        return GRAPH_PER_GRAPH_PAGE_SPREAD_BYTES
    if spec.mla and spec.quant.method == "fp8":
        return GRAPH_PIECEWISE_BYTES_PER_LAYER * (layers or spec.layers)
    return truth.GRAPH_PER_GRAPH_SPREAD_BYTES


def moe_workspace_bytes(spec: ModelSpec, layout: Layout, tokens: int) -> float:
    """Per GPU, the MLP buffers of vLLM's profile forward at ``tokens`` batched tokens, which its peak sits in."""
    # fused_moe's shared cache for the gate/up and down outputs (M x top-k x max(2 I, H)) and its activation cache
    # (M x top-k x I), in bf16. DP ranks gather each other's tokens before the experts, with EP too (vLLM's default
    # all2all backend, allgather-reducescatter: TP=1+DP=2+EP logged 1.34 GiB, as much as without EP); without EP
    # the experts are TP-sliced over TP x DP.
    if spec.is_moe and spec.expert_intermediate:
        inter = spec.expert_intermediate // max(layout.moe_tp, 1)
        return tokens * layout.dp * spec.experts_per_token * (max(2 * inter, spec.hidden) + inter) * 2
    return tokens * (2 * max(spec.dense_intermediate // layout.tp, 1) + spec.hidden) * 2


def triton_moe_workspace_bytes(spec: ModelSpec, layout: Layout, tokens: int) -> float:
    """Per GPU, fused_moe's Triton workspaces as vLLM 0.25 sizes them (TritonExperts.workspace_shapes), held by its
    workspace manager once the profile forward has asked for them; tokens gathered over DP as moe_workspace_bytes
    says."""
    inter = spec.expert_intermediate // max(layout.moe_tp, 1)
    per_token = spec.experts_per_token * (max(inter, spec.hidden) + max(2 * inter, spec.hidden)) * 2
    return tokens * layout.dp * per_token


def gqa_kept_bytes(spec: ModelSpec, layout: Layout, tokens: int, forward: float) -> float:
    """Per GPU, what a GQA forward still holds when vLLM's profile runs the sampler after it (a warm start's)."""
    if not (spec.is_moe and spec.expert_intermediate):
        return (1 - TRANSIENT_SHARE_GQA) * forward
    kv = 2 * max(spec.kv_heads // layout.tp, 1) * spec.head_dim * 2
    return triton_moe_workspace_bytes(spec, layout, tokens) + tokens * (spec.hidden * 2 + kv)


def gqa_compile_miss_bytes(spec: ModelSpec, tokens: int) -> float:
    """Per GPU, what a GQA MoE start that compiles is taken to keep beyond a warm one at its sampler
    (:data:`GQA_COMPILE_MISS_HIDDEN_TENSORS`)."""
    if not (spec.is_moe and spec.expert_intermediate):
        return 0.0
    return GQA_COMPILE_MISS_HIDDEN_TENSORS * tokens * spec.hidden * 2


def compile_garbage_bound(spec: ModelSpec, layout: Layout, tokens: int) -> float:
    """Per GPU, the most a start that compiles cold was seen to leave for Python's collector at its profile peak:
    under GQA one set of tensors per distinct compiled piece (:func:`gqa_compile_garbage_bound`); under block-FP8
    MLA the set :data:`MLA_FP8_COMPILE_GARBAGE_HIDDEN_TENSORS` stands for, where a GPU's stage has a piece from one
    MoE layer to the next; 0 where none was seen (MLA with INT4 experts: its fit holds it, MLA_COMPILE_MISS_BYTES)."""
    if not spec.mla:
        return gqa_compile_garbage_bound(spec, layout, tokens)
    if spec.quant.method != "fp8":
        return 0.0
    moe_on_a_stage = max(min(layers, spec.moe_layers) for layers in pp_split(spec.layers, layout.pp))
    return MLA_FP8_COMPILE_GARBAGE_HIDDEN_TENSORS * tokens * spec.hidden * 2 if moe_on_a_stage >= 2 else 0.0


def gqa_compile_garbage_bound(spec: ModelSpec, layout: Layout, tokens: int) -> float:
    """Per GPU, the most a GQA MoE start that compiles was seen to leave for Python's collector at its sampler:
    one set of tensors for each distinct compiled piece between two attentions, as the four-layer GLM-4.5 and the
    Air at 8 and 16 layers left them (run-profile-peak): from a dense layer's o_proj to the next attention, a query
    and a hidden state; from a MoE layer's, three queries, a q/k/v, three hidden states and 2 kB; from the last
    one, three hidden states and the router's float32 logits."""
    if not (spec.is_moe and spec.expert_intermediate):
        return 0.0
    q = spec.heads / layout.tp * spec.head_dim * 2
    qkv = (spec.heads + 2 * spec.kv_heads) / layout.tp * spec.head_dim * 2
    hidden = spec.hidden * 2
    per_token: float = 3 * hidden + spec.experts * 4
    if spec.dense_layers:
        per_token += q + hidden
    if spec.moe_layers >= 2:
        per_token += 3 * q + qkv + 3 * hidden + 2048
    return tokens * per_token


def gqa_sampler_bytes(spec: ModelSpec, requests: int) -> float:
    """Per GPU, vLLM 0.25's dummy sampler run for ``requests`` requests under GQA
    (:data:`GQA_SAMPLER_BYTES_PER_LOGIT`)."""
    programs = min(2 ** math.ceil(math.log2(max(requests, 1))), TOP_K_TOP_P_PROGRAMS)
    return (requests * GQA_SAMPLER_BYTES_PER_LOGIT + programs * 4) * spec.vocab + 2 * requests * spec.hidden * 2


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
    tokens = serving.max_num_batched_tokens or max_num_batched_tokens(device, serving.vllm_version)
    seqs = serving.max_num_seqs or default_max_num_seqs(device, vllm_version=serving.vllm_version)
    tp = layout.tp
    warm = serving.finds_compile_cache(layout.name)
    moe = moe_workspace_bytes(spec, layout, tokens)
    logits = min(seqs, tokens) * spec.vocab
    compile_miss = 0.0
    if spec.mla and spec.quant.method == "fp8":
        compile_miss = 0.0 if warm else MLA_FP8_COMPILE_MISS_SHARE * compile_garbage_bound(spec, layout, tokens)
        kept = MLA_FP8_KEPT_BYTES + MLA_FP8_KEPT_PER_MOE * moe + compile_miss
        transient = max(
            MLA_FP8_TRANSIENT_BYTES
            + MLA_FP8_TRANSIENT_BYTES_PER_TOKEN * tokens
            + MLA_FP8_TRANSIENT_BYTES_PER_REQUEST_AT_128_HEADS * min(seqs, tokens) * (spec.heads / tp / 128) ** 4,
            0.0,
        ) * (spec.hidden / MLA_FP8_TRANSIENT_HIDDEN)
        forward, sampler = kept + transient, logits * SAMPLER_BYTES_PER_LOGIT
    elif spec.mla:
        forward = ACTIVATION_FACTOR * moe + MLA_FIXED_BYTES + tokens * spec.heads / tp * MLA_BYTES_PER_TOKEN_HEAD
        if warm:
            forward -= MLA_COMPILE_MISS_BYTES
        transient, sampler = 0.0, logits * MLA_SAMPLER_BYTES_PER_LOGIT  # on top of the whole forward, as fitted
    else:
        attention = tokens * (spec.heads + 2 * spec.kv_heads) * spec.head_dim * 2 / tp
        compile_miss = 0.0 if warm else gqa_compile_miss_bytes(spec, tokens)
        kept = gqa_kept_bytes(spec, layout, tokens, ACTIVATION_FACTOR * (moe + attention)) + compile_miss
        forward = max(ACTIVATION_FACTOR * (moe + attention), kept)
        transient, sampler = forward - kept, gqa_sampler_bytes(spec, min(seqs, tokens))
    collective = NON_TORCH_COLLECTIVE_BYTES if tp > 1 else 0.0
    stage_layers = max(pp_split(spec.layers, layout.pp))
    graphs, captures, further_graphs = graph_estimate(
        spec, serving, seqs, tokens, max_model_len, tp, layers=stage_layers
    )
    piecewise = capture_sizes(seqs, serving.max_capture_size) if not serving.enforce_eager else []
    return Reserve(
        cuda_hidden=gpu_memory_utilization * cuda_hidden_bytes(device),
        non_torch=NON_TORCH_BYTES + collective,
        activation=forward - transient + max(transient, sampler),
        cuda_graphs=graphs,
        tokens=tokens,
        forward=forward,
        transient=transient,
        sampler=sampler,
        graph_captures=captures,
        graph_further=further_graphs,
        graph_piecewise=len(piecewise),
        graph_spread=piecewise_spread(spec, piecewise, tp, stage_layers),
        compile_miss=compile_miss,
        compile_cache_hit=warm,
        max_num_seqs=seqs,
        real_first_start=real_first_start_bytes(spec, tokens),
    )


@dataclass(frozen=True)
class Serving:
    """The engine settings the reserve moves with; 0 means vLLM's default for the device."""

    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    enforce_eager: bool = False
    max_capture_size: int = 0  # compilation_config's max_cudagraph_capture_size; 0: vLLM's rule
    compile_cache_hit: bool = False  # a relaunch that loads its torch.compile artefacts profiles a smaller peak
    vllm_version: str = ""  # whose defaults fill the zeros (servebook.vllm_defaults); empty: the newest known
    # the layouts (by name) whose start will load torch.compile's artefacts: a launch or rehearsal with the same
    # compile key ran on this machine and its cache is still there (startplan.warm_layouts)
    warm_layouts: frozenset[str] = frozenset()

    def finds_compile_cache(self, layout: str) -> bool:
        return self.compile_cache_hit or layout in self.warm_layouts


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
    history: tuple[truth.Measured, ...] = ()  # earlier starts' figures (planner.truth), for a known signature
    prompt_ratio: float = 1.0  # prompt tokens per output token of the workload the forecast is for
    context_tokens: int | None = None  # the KV a stream of that workload holds on average; None: no workload

    def settings(self, layout: Layout, device: Device) -> dict[str, str]:
        """What moves the reserve besides the layout and the model, as the history keys a start."""
        s = self.serving
        seqs = s.max_num_seqs or default_max_num_seqs(device, vllm_version=s.vllm_version)
        return {
            "max_model_len": str(self.max_model_len),
            "max_num_seqs": str(seqs),
            "max_num_batched_tokens": str(s.max_num_batched_tokens or max_num_batched_tokens(device, s.vllm_version)),
            "kv_dtype_bytes": str(self.kv_dtype_bytes),
            "enforce_eager": str(s.enforce_eager),
            "compile_cache_hit": str(s.finds_compile_cache(layout.name)),
            "max_capture_size": str(s.max_capture_size),
        }


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
        "attention": stage_layers * ((weights.attention + weights.mla_absorbed) / tp + weights.attention_replicated),
        "experts": moe_stage * weights.experts * _expert_fraction(spec, layout),
        "shared_and_dense": moe_stage * (weights.shared / tp + weights.router) + dense_stage * weights.dense_mlp / tp,
        "embeddings": emb + weights.rope_cache,  # the positions' table beside the tokens'
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
        available += _learned(spec, layout, device, sizing, available)
    layout.available_kv_bytes_per_gpu = max(0.0, available)
    page = BLOCK_SIZE * per_layer
    blocks = int(layout.available_kv_bytes_per_gpu // page // stage_layers) if page and stage_layers else 0
    layout.max_kv_tokens = blocks * BLOCK_SIZE
    layout.max_concurrency = layout.dp * layout.max_kv_tokens / max_model_len if max_model_len else 0.0
    _bands(spec, layout, device)
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


def _reserve_terms(layout: Layout) -> dict[str, float]:
    reserve = layout.reserve
    if reserve is None:
        return {}
    if reserve.flat:
        return {"activation": reserve.activation}
    return {"activation": reserve.activation, "cuda_graphs": reserve.cuda_graphs, "non_torch": reserve.non_torch}


def _term_bands(spec: ModelSpec, layout: Layout, prov: truth.Provenance) -> dict[str, float]:
    """Each reserve term's relative band for this layout (its CUDA graphs' from their captures)."""
    reserve = layout.reserve
    if reserve is None:
        return truth.term_bands(prov, kind=(truth.attention_kind(spec), spec.quant.method))
    bands = truth.term_bands(
        prov,
        reserve.cuda_graphs,
        reserve.graph_piecewise,
        (truth.attention_kind(spec), spec.quant.method),
        further=reserve.graph_further,
        spread=reserve.graph_spread,
    )
    sampler_peak = prov == "calibrated" and not spec.mla and reserve.sampler >= reserve.transient
    bound = _varies_between_starts(spec, layout)
    if bound and (sampler_peak or (spec.mla and prov != "measured")):
        spread = max(bound - reserve.compile_miss, reserve.compile_miss)
        share = GQA_CODE_READ_ACTIVATION_BAND if sampler_peak else bands["activation"]
        read = share * (reserve.activation - reserve.compile_miss)
        bands["activation"] = max(bands["activation"], (read + spread) / reserve.activation)
    elif sampler_peak and reserve.compile_cache_hit:
        # nothing left for the collector: the terms read off vLLM's code are the peak (the six GLM-4.5-shaped
        # minis, warm or collected, within 8 MiB: docs/examples/h200-vllm/run-profile-peak)
        bands["activation"] = GQA_CODE_READ_ACTIVATION_BAND
    if layout.graphs_measured_by is not None:
        bands["cuda_graphs"] = truth.TERM_BANDS["measured"]["cuda_graphs"]
    return bands


def _varies_between_starts(spec: ModelSpec, layout: Layout) -> float:
    """Bytes of the profile peak no earlier start of the same command fixes: what a cold compile leaves for Python's
    collector (none to compile_garbage_bound), under GQA where the sampler sets the peak, and under block-FP8 MLA at
    depth. On the H100 the GLM-4.5-Air mini at 8 layers left none on a dummy-weight rehearsal and 1.42 GiB on the
    real launch after it, both cold (2.8 % of its KV: docs/examples/h200-vllm/run-warm-launch)."""
    reserve = layout.reserve
    if reserve is None or not reserve.compile_miss:
        return 0.0
    if not spec.mla and reserve.sampler < reserve.transient:
        return 0.0
    return compile_garbage_bound(spec, layout, reserve.tokens)


def _learned(spec: ModelSpec, layout: Layout, device: Device, sizing: Sizing, available: float) -> float:
    """The bytes the history says this plan's KV memory misses by: what the closest earlier start of the same
    signature, GPU and vLLM version missed by, where that makes the figure surer than the calibration (a start
    at settings that moved the reserve a lot teaches less); 0 otherwise. Sets the layout's provenance."""
    vllm = sizing.serving.vllm_version
    layout.signature, layout.settings = truth.signature(spec), sizing.settings(layout, device)
    layout.provenance = truth.provenance(spec, device.name)
    terms, weights = _reserve_terms(layout), layout.weight_bytes_per_gpu
    entry, same = truth.measured_entry(
        list(sizing.history), layout.signature, device.name, vllm, layout.name, layout.settings, terms=terms
    )
    if entry is None:
        return 0.0
    how = "the same command" if same else f"{entry.layout} at other settings"
    reserve = layout.reserve
    if (
        reserve
        and reserve.compile_cache_hit
        and entry.compiled_cold
        and compile_garbage_bound(spec, layout, reserve.tokens)
    ):
        # its rest holds what its compile left for Python's collector (none to 1.5 GiB on the same command), which
        # this start, loading the compile cache, will not keep
        layout.learned_bytes = entry.measured_terms_gap(weights, terms)
        layout.graphs_measured_by = entry if entry.same_graphs(terms) else None
        layout.kv_basis = (
            f"as first planned for a start that finds its compile cache, but for the weights"
            f"{' and CUDA graphs' if layout.graphs_measured_by else ''} the {entry.source} of {how} on "
            f"{entry.at[:10]} logged ({layout.learned_bytes / GiB:+.2f} GiB); the rest of its figure set aside: it "
            "compiled cold, and what a cold compile leaves for Python's collector varies from start to start"
        )
        return layout.learned_bytes
    first = truth.kv_band(
        weights, terms, available, layout.provenance, bands=_term_bands(spec, layout, layout.provenance)
    )
    varies = _varies_between_starts(spec, layout)
    learned_band = truth.kv_band(weights, terms, available, "measured", entry, same, varies_bytes=varies)
    if learned_band > truth.LEARN_WHEN_BAND_SHRINKS_TO * first:
        if not entry.same_graphs(terms):
            layout.kv_basis = (
                f"as first planned: the {entry.source} of {how} on {entry.at[:10]} set aside, the reserve moved "
                f"too much since for it to be surer than the calibration (±{100 * first:.1f} %)"
            )
            return 0.0
        layout.graphs_measured_by, layout.learned_bytes = entry, entry.measured_terms_gap(weights, terms)
        layout.kv_basis = (
            f"as first planned but for the CUDA graphs ({entry.graph_gib:.2f} GiB) and weights the {entry.source} "
            f"of {how} on {entry.at[:10]} logged at the same captures ({layout.learned_bytes / GiB:+.2f} GiB); its "
            f"rest set aside, the reserve moved too much since for it to be surer than the calibration"
        )
        return layout.learned_bytes
    layout.provenance, layout.learned_from, layout.same_command_measured = "measured", entry, same
    layout.learned_bytes = entry.gap_for(weights, terms)
    dummy = (
        f"; on dummy weights, less the {entry.real_first_start / GiB:.2f} GiB a real first start keeps beyond them"
        if entry.real_first_start else ""
    )  # fmt: skip
    layout.kv_basis = (
        f"moved by {layout.learned_bytes / GiB:+.2f} GiB: what the {entry.source} of {how} on {entry.at[:10]} "
        f"showed ({entry.kv_cache_tokens:,} KV tokens against {entry.predicted_kv_tokens:,} planned{dummy})"
    )
    return layout.learned_bytes


def _bands(spec: ModelSpec, layout: Layout, device: Device) -> None:
    """Every predicted figure of the layout with its band (planner.truth)."""
    if device.kind == "cpu":  # no reserve to model: weights from the files, a KV space of fixed size
        layout.provenance = "calibrated"
    prov = layout.provenance or truth.provenance(spec, device.name)
    weights = layout.weight_bytes_per_gpu
    bands = _term_bands(spec, layout, prov)
    layout.bands = {"weights_gib": truth.Band(value=weights / GiB, band=bands["weights"], provenance=prov)}
    if device.kind == "cpu":
        layout.bands["kv_tokens"] = truth.Band(
            value=layout.max_kv_tokens, band=truth.CPU_KV_BAND, provenance="calibrated", basis="a fixed KV space"
        )
        return
    terms = _reserve_terms(layout)
    measured_graphs = layout.graphs_measured_by
    if measured_graphs is not None and measured_graphs.graph_gib is not None:
        terms["cuda_graphs"] = measured_graphs.graph_gib * GiB
    for name, size_bytes in terms.items():
        layout.bands[f"{name}_gib"] = truth.Band(
            value=size_bytes / GiB,
            band=round(bands[name], 4),
            provenance="measured" if name == "cuda_graphs" and measured_graphs is not None else prov,
        )
    kv = truth.kv_band(
        weights,
        terms,
        layout.available_kv_bytes_per_gpu,
        prov,
        layout.learned_from,
        layout.same_command_measured,
        bands=bands,
        varies_bytes=_varies_between_starts(spec, layout),
    )
    layout.bands["kv_tokens"] = truth.Band(
        value=layout.max_kv_tokens, band=round(min(kv, 9.99), 4), provenance=prov, basis=layout.kv_basis
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
    long_context = min(sizing.max_model_len, 2048)
    network = _network_seconds(spec, layout, device, stage_layers, moe_stage)

    def step_seconds(b: float, context: int = long_context) -> float:
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
        # Charged a long request's KV, the ceiling is no bound on a workload of short ones: the 40-layer H100
        # rehearsal (128 in / 128 out, about 192 tokens a stream) passed it by 5 % at 256 streams (run-reach-h100)
        if sizing.context_tokens:
            workload = min(sizing.context_tokens, sizing.max_model_len)
            layout.workload_ceiling = {
                b: b / (pp * step_seconds(max(b / (dp * pp), 1), workload)) for b in layout.decode_ceiling
            }
        _forecast(spec, layout, device, sizing)


# The throughput forecast: each engine step costs a fixed part, a share of the bandwidth ceiling's time, and a
# compute part per token of prompt and output (prefills ride in the same steps), spread over the layout's GPUs:
#   tok/s(b) = b / (FORECAST_STEP_S + FORECAST_CEILING_SHARE x b / ceiling(b) + FORECAST_TOKEN_S x b x (1 + in/out) / GPUs)
# fitted (relative least squares) on two H200 sweeps with vLLM 0.25: the Qwen3-30B-shaped BF16 mini at TP=1
# (128 in / 128 out) and the Kimi-shaped INT4 mini at TP=1 (256 / 128), docs/examples/h200-vllm; within 14 % and
# 12 % of every level of those, 8 % of a second Kimi sweep, 19 % of the held-out FP8 TP=2+EP sweep, and 39 % of the
# held-out MiniMax-shaped FP8 sweep at 64 streams (2026-12-04: its 2 layers activate 0.3 B parameters per token, a
# constant compute part per token charges it like the fit's; benchmarks/forecast_fit.py tries two refits, neither
# holds all five sweeps within 20 %). The extrapolated band is the worst held-out miss. The calibrated band is the
# worst miss on the fit's own shape at other layer counts (the Qwen3-30B-shaped bf16 mini at 4 and 16 layers,
# 2026-12-04, docs/examples/h200-vllm/run-layers: +21 % and -16 %): the same command measured on different
# H200s differs by up to a quarter at one level (MiniMax TP=1 at 64 streams: 9,817, 12,227, 12,282 tok/s), so no
# constant fits closer than that noise. On one H100 (2026-12-05, docs/examples/h200-vllm/run-forecast-h100) the
# 8-layer sweep made twice, 15 minutes apart, differed by up to 19 % at one level and 11 % at 64 and 128 streams;
# the forecast missed those sweeps by up to 24 % (4 layers -24 %, 16 layers +12 %), so the calibrated band is
# ±25 %. There the layers did move the step (4, 8, 16 layers: 17,201, 13,850, 7,729 tok/s at 64 streams, about
# the ceiling's time plus 2 ms), where on the H200s a floor of about 5 ms per step at 64 streams hid them: the
# host's part, which differs between machines and which no figure of the plan knows.
FORECAST_STEP_S = 1.669e-3
FORECAST_CEILING_SHARE = 0.552
FORECAST_TOKEN_S = 16.2e-6
FORECAST_BANDS = {"calibrated": 0.25, "extrapolated": 0.40}
FORECAST_FITTED = {("none", 1), ("int4", 1)}  # (quantization, GPUs) of the sweeps fitted on, on Hopper
# The compute part was fitted where the GEMMs run in BF16 (BF16 weights; INT4 W4A16 dequantizes to BF16). FP8
# weights with FP8 activations (vLLM's W8A8 block and per-tensor kernels) run on tensor cores of twice BF16's peak
# on Ada, Hopper and Blackwell (NVIDIA's H100 and L40S datasheets); an A100 has none and serves FP8 as W8A16 in
# BF16. Halving FP8's compute part, no constant refitted, takes the held-out FP8 sweeps' worst miss from 39 % to 17 %
# (MiniMax TP=1); TP=2+EP stays at 19 % (at 32 and 64 streams -4 % and 0 % where it was -14 % and -16 %, at 128
# +18 % where it was -10 %); GLM-4.5-Air goes from -20 % and -21 % to -2 % and +6 % at 64 and 128 streams (its 1 and
# 2 streams stay 25-31 % short: the fixed step, the host's part). All 94 levels: 73 % within 15 %, now 79 %.
FORECAST_FP8_MATH_SPEEDUP = 2.0
# No step reads its bytes at the HBM's datasheet pace. The most of the bandwidth ceiling any committed sweep reached
# is 0.887 (the 16-layer bf16 mini on one H100 at 32 streams, run-forecast-h100; the H200's best, 0.80, at 64
# streams of the same shape): where the weights take the whole step (a full-size model), the step model passes the
# ceiling and the forecast is this share of it, not the ceiling itself. Rehearsed where the weights do take the step
# (one H100, 2026-12-07, run-reach-h100: the same shape at 40 and 24 layers), a step reached 0.94 of it at 128
# streams and passed it at 256 (the ceiling charges each stream min(max_model_len, 2048) tokens of KV, where that
# workload holds about 192); a cap of 0.94 worsens their levels under 64 streams more than it helps above, so 0.89
# stays.
FORECAST_CEILING_REACH = 0.89
# Nor can a step be shorter than the GPU's own work: its bytes at the datasheet's pace (the ceiling's time) and a
# floor per layer for the layer's kernels. The model above adds a fixed step to a share of the ceiling's time, which
# the minis it was fitted on allow (at 4 to 16 layers their steps are the host's: 1.6-2.0 ms at one stream on one
# H100 whatever the layers, run-forecast-h100). At 24 and 40 layers (run-reach-h100, 2026-12-07) the GPU's part
# is longer: 2.39 and 3.88 ms at one stream, where the model said 2.14 and 2.45 (+10 % and +56 % in tok/s, and
# up to +65 % at 2 streams). The 40-layer step at one stream, 3.88 ms, less its ceiling's time, 1.42 ms, over 40
# layers gives the floor: 61.5 us per layer. With it the 24-layer sweep (held out of that figure) is forecast
# within 9 % at every level, the 40-layer one within 11 %; of the other twelve sweeps only the two at 16 layers
# move, closer (the H100's worst 11 % -> 9 %), the rest are the host's: 82 % of the 110 replayed levels within
# 15 %, where 73 % were, median miss 8.0 % -> 7.0 % (benchmarks/forecast_fit.py).
# Measured on Qwen3-MoE layers (GQA, BF16); a layer with more kernels (MLA, INT4's dequantizing GEMMs) has a higher
# floor, so elsewhere it is a lower bound on the step and the forecast stays an upper one.
FORECAST_LAYER_FLOOR_S = 61.5e-6
FP8_TENSOR_CORE_GPUS = ("H100", "H200", "H20", "B200", "B300", "GB200", "L40S", "L4", "RTX-PRO-6000")


def forecast_compute_scale(spec: ModelSpec, device: Device) -> float:
    """The forecast's compute part per token relative to BF16's: half where FP8 GEMMs run at FP8's peak."""
    fp8_math = spec.quant.method == "fp8" and not spec.quant.experts_only
    on_fp8_cores = any(device.name.upper().startswith(g) for g in FP8_TENSOR_CORE_GPUS)
    return 1 / FORECAST_FP8_MATH_SPEEDUP if fp8_math and on_fp8_cores else 1.0


def forecast_tok_s(
    batch: float,
    ceiling_tok_s: float,
    prompt_ratio: float,
    gpus: int,
    *,
    capped: bool = True,
    compute_scale: float = 1.0,
    layers: int = 0,
) -> float:
    """Output tokens/s the layout is forecast to deliver with ``batch`` sequences (see the constants above;
    ``compute_scale``: :func:`forecast_compute_scale`; ``layers``: the model's, whose kernels floor a step)."""
    if ceiling_tok_s <= 0:
        return 0.0
    step = max(
        FORECAST_STEP_S
        + FORECAST_CEILING_SHARE * batch / ceiling_tok_s
        + compute_scale * FORECAST_TOKEN_S * batch * (1 + prompt_ratio) / max(gpus, 1),
        gpu_step_floor(batch, ceiling_tok_s, layers),
    )
    # never above the share of the bandwidth ceiling a measured step has reached
    return min(batch / step, FORECAST_CEILING_REACH * ceiling_tok_s) if capped else batch / step


def gpu_step_floor(batch: float, ceiling_tok_s: float, layers: int) -> float:
    """Seconds a step takes the GPU at least: every layer's kernels (:data:`FORECAST_LAYER_FLOOR_S`) and the
    bandwidth ceiling's time for ``batch`` sequences (a pipeline's stages in turn, as the ceiling has them)."""
    return FORECAST_LAYER_FLOOR_S * layers + batch / ceiling_tok_s


def _forecast(spec: ModelSpec, layout: Layout, device: Device, sizing: Sizing) -> None:
    """The forecast at every ceiling's batch and at the batch the layout is ranked at, with its band."""
    gpus = layout.tp * layout.pp * layout.dp
    scale = forecast_compute_scale(spec, device)
    layers = spec.layers
    layout.forecast = {
        b: forecast_tok_s(b, ceiling, sizing.prompt_ratio, gpus, compute_scale=scale, layers=layers)
        for b, ceiling in layout.decode_ceiling.items()
    }
    layout.forecast_tok_s_batch = forecast_tok_s(
        layout.batch_fit, layout.decode_tok_s_batch, sizing.prompt_ratio, gpus, compute_scale=scale, layers=layers
    )
    tokens = "token" if sizing.prompt_ratio == 1 else "tokens"
    basis = f"at {layout.batch_fit} sequences, {sizing.prompt_ratio:g} prompt {tokens} per output token"
    if scale != 1.0:
        basis += ", FP8 GEMMs at twice BF16's pace"
    if _measured_forecast(layout, device, sizing, basis):
        return
    model = forecast_tok_s(
        layout.batch_fit, layout.decode_tok_s_batch, sizing.prompt_ratio, gpus, capped=False, compute_scale=scale,
        layers=layers,
    )  # fmt: skip
    floor = gpu_step_floor(layout.batch_fit, layout.decode_tok_s_batch, layers)
    if layout.forecast_tok_s_batch > 0 and layout.batch_fit / layout.forecast_tok_s_batch <= floor * 1.0001:
        basis += (
            f"; the GPU's own step: {layers} layers' kernels ({FORECAST_LAYER_FLOOR_S * 1e6:.1f} us each, measured on "
            f"Qwen3-MoE layers) and the bytes at the bandwidth ceiling's pace"
        )
    elif model > layout.forecast_tok_s_batch:
        # the minis it was fitted on spend most of a step off the weights; where the weights take the step, the
        # model's figure passes the ceiling and only the ceiling's reachable share is left to say
        basis += (
            f"; {FORECAST_CEILING_REACH:.0%} of the bandwidth ceiling, the most a measured sweep reached: the step "
            f"model's own figure, {model:,.0f} tok/s, is above it"
        )
    hopper = any(g in device.name.upper() for g in truth.CALIBRATED_GPUS)
    fitted = hopper and (spec.quant.method, gpus) in FORECAST_FITTED
    prov: truth.Provenance = "calibrated" if fitted else "extrapolated"
    layout.bands["forecast_tok_s"] = truth.Band(
        value=layout.forecast_tok_s_batch, band=FORECAST_BANDS[prov], provenance=prov, basis=basis
    )


def _measured_forecast(layout: Layout, device: Device, sizing: Sizing, basis: str) -> bool:
    """The forecast from the history, where this command was measured with this workload before: the measured
    levels stand in for the model's (the ceilings stay, as upper bounds), and carry it beyond the highest one
    (:func:`truth.tok_s_beyond`). Whether one was found."""
    workload = truth.workload_key(sizing.prompt_ratio)
    entry = truth.throughput_entry(list(sizing.history), layout, device.name, sizing.serving.vllm_version, workload)
    if entry is None or not layout.signature:
        return False
    model = dict(layout.forecast)  # the step model's, which carries a sweep that ended still rising beyond its top
    layout.forecast = {b: truth.tok_s_beyond(entry.throughput, b, model)[0] for b in layout.forecast}
    value, within = truth.tok_s_beyond(entry.throughput, layout.batch_fit, model)
    layout.forecast_tok_s_batch = value
    top = max(int(c) for c in entry.throughput)
    if entry.source == "rehearsal":
        band, how = truth.REHEARSED_FORECAST_BAND, "rehearsed on dummy weights"
    elif within:
        band, how = truth.MEASURED_FORECAST_BAND, "measured"
    else:
        band, how = truth.BEYOND_MEASURED_FORECAST_BAND, f"measured up to {top} streams, its highest level"
    layout.bands["forecast_tok_s"] = truth.Band(
        value=value, band=band, provenance="measured", basis=f"{basis}: {how} by the {entry.source} of {entry.at[:10]}"
    )
    return True


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
