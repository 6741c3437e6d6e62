"""The concurrency sweep: double the streams until throughput stops rising, honestly.

Each level sends fresh, unique prompts (no prefix-cache reuse across levels), warms
up with as many requests as its concurrency, is repeated to show its spread, and
reads the server's ``/metrics`` around and during it.  The sweep stops when output
throughput gains less than ``plateau_gain`` over two doublings, when a latency
objective breaks, at ``max_concurrency``, or when the server fails; whatever was
measured is saved either way.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from servebook import client, gpu_evidence, loadgen, metrics, tables
from servebook.client import Target
from servebook.datasets import Cursor, Prompt
from servebook.gpu_evidence import GpuEvidence
from servebook.loadgen import Workload

if TYPE_CHECKING:
    from servebook.params import Params

StopReason = Literal["plateau", "decline", "max_concurrency", "objective", "fault", "interrupted"]
LimitKind = Literal[
    "client", "batch", "kv_cache", "api_server", "pcie", "nvlink", "power", "thermal", "server", "decline", "rising"
]
CLIENT_BOUND_PCT = 90.0  # one asyncio process near a full core paces the server instead of measuring it
CLIENT_SPLIT_PCT = 50.0  # a client process past half a core: the next levels share the streams among twice as many
MAX_CLIENT_PROCESSES = max((os.cpu_count() or 2) // 2, 1)  # the other half of the cores stay the server's
KV_FULL = 0.95
TableRow = dict[str, float | int | str | None]  # one row of a parquet/CSV table: only at that boundary


def workload_for(p: Params) -> Workload:
    """The requests the params describe; the benchmark, the rate sweep and the A/B all send these."""
    return Workload(
        p.bench_input_len,
        p.bench_output_len,
        p.bench_endpoint,
        p.bench_shared_prefix_len,
        turns=p.bench_turns,
        long_input_len=p.bench_long_input_len,
        long_share=p.bench_long_share,
    )


def objectives_for(p: Params) -> metrics.Objectives:
    return metrics.Objectives(p.bench_ttft_slo_ms, p.bench_tpot_slo_ms, p.bench_e2el_slo_ms)


@dataclass
class SweepConfig:
    workload: Workload = field(default_factory=Workload)
    max_concurrency: int = 256
    start_concurrency: int = 1
    repeats: int = 2  # at least this many runs per level
    prompts_per_level: int = 64  # measured requests per repeat (at least 4 x the concurrency)
    min_level_s: float = 0.0  # and each repeat's window lasts at least this long
    max_spread_pct: float = 10.0  # a level whose repeats spread wider is measured again ...
    max_repeats: int = 4  # ... up to this many runs
    warmup: int = 0  # 0: as many as the concurrency
    plateau_gain: float = 0.05
    objectives: metrics.Objectives = field(default_factory=metrics.Objectives)
    request_timeout_s: float = 600.0
    reset_prefix_cache: bool = True
    max_num_seqs: int = 0  # sequences the server runs at once, all engines together; 0: unknown
    gpu_ids: list[int] = field(default_factory=list)  # GPUs serving the model, sampled through NVML; empty: none
    decode_ceiling: dict[int, float] = field(default_factory=dict)  # the plan's bandwidth ceiling by batch size
    client_processes: int = 0  # 0: start with one, double past CLIENT_SPLIT_PCT of a core; else exactly this many
    dataset: list[Prompt] | None = None  # requests with their own lengths, instead of the workload's synthetic ones

    def levels(self) -> list[int]:
        out, c = [], self.start_concurrency
        while c <= self.max_concurrency:
            out.append(c)
            c *= 2
        return out

    def measured_requests(self, concurrency: int) -> int:
        return max(self.prompts_per_level, 4 * concurrency)

    def prompts_for(self, concurrency: int, requests_per_s: float | None) -> int:
        return prompts_for_window(self.measured_requests(concurrency), self.min_level_s, requests_per_s)


def prompts_for_window(least: int, min_seconds: float, requests_per_s: float | None) -> int:
    """Measured prompts to prepare: the minimum count, or enough for ``min_seconds`` at twice the expected rate
    (the window stops sending once both minimums are met; the rest are spare)."""
    if not min_seconds or not requests_per_s:
        return least
    return max(least, min(math.ceil(2 * min_seconds * requests_per_s), 50 * least))


def spread_pct(throughputs: list[float]) -> float | None:
    """(max - min) / median of a level's repeats, in percent."""
    med = statistics.median(throughputs) if throughputs else 0.0
    return 100 * (max(throughputs) - min(throughputs)) / med if med and len(throughputs) > 1 else None


class Level(BaseModel):
    """One concurrency level: medians over its repeats, and the spread of output throughput."""

    model_config = ConfigDict(extra="forbid")

    concurrency: int
    repeats: int
    output_throughput: float  # tok/s, median of repeats
    output_throughput_min: float
    output_throughput_max: float
    spread_pct: float | None
    total_throughput: float | None = None  # tok/s
    request_throughput: float | None = None  # requests/s
    per_user_tok_s: float | None = None
    goodput: float | None = None  # requests/s meeting every objective
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p90_ms: float | None = None
    tpot_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2el_p50_ms: float | None = None
    e2el_p99_ms: float | None = None
    client_queue_p50_ms: float | None = None
    kv_cache_usage_peak: float | None = None  # 0-1
    running_peak: float | None = None
    waiting_peak: float | None = None
    # mean time a request of the window spent in vLLM's queue, from its own histogram: no sampling gaps
    server_queue_ms: float | None = None
    # mean TTFT and TPOT by vLLM's own clocks beside the client's, over the same requests (metrics.EngineClock)
    client_ttft_mean_ms: float | None = None
    vllm_ttft_mean_ms: float | None = None
    client_tpot_mean_ms: float | None = None
    vllm_tpot_mean_ms: float | None = None
    window_requests: float | None = None  # the client's requests in the window, warm-ups included
    vllm_requests: float | None = None  # the requests vLLM counted meanwhile
    # behind a router: each replica's share of the finished requests and its prefix-cache hit rate (medians)
    replica_shares: dict[str, float] = {}
    replica_prefix_hit_rates: dict[str, float | None] = {}
    dead_replicas: list[str] = []  # replicas whose /metrics stopped answering during the level
    # the router's own counts over the level's windows (sums): requests it retried on another replica, requests
    # whose retries ran out, and requests it answered with an error
    router_retries: float | None = None
    router_retries_exhausted: float | None = None
    router_errors: float | None = None
    tpot_clock_gap_pct: float | None = None  # client's mean TPOT against vLLM's, % (same requests only)
    client_cpu_pct: float | None = None  # the load generator's CPU time over the window, % of one core per process
    client_processes: float | None = None  # client processes that shared the streams
    prefix_cache_hit_rate: float | None = None  # 0-1: prompt tokens vLLM found in its prefix cache
    # what NVML saw on the serving GPUs during the level: medians over its repeats; gpu_note says why there is none
    gpu: GpuEvidence | None = None
    gpu_samples: list[int] = []  # NVML samples of each repeat
    gpu_note: str = ""
    plan_ceiling_tok_s: float | None = None  # the plan's decode bandwidth ceiling at this many streams
    plan_ceiling_pct: float | None = None  # measured output tok/s as a share of it
    failed: int = 0
    preemptions: float = 0.0
    limit: str = ""  # what limits this level, from the evidence above (limit_of)
    limit_kind: LimitKind | None = None

    def flat(self) -> TableRow:
        """The levels table's row: the GPU evidence as ``gpu_*`` columns."""
        exclude = {"gpu", "gpu_samples", "replica_shares", "replica_prefix_hit_rates", "dead_replicas"}
        row: TableRow = {k: v for k, v in self.model_dump(exclude=exclude).items()}
        row["gpu_samples"] = ", ".join(map(str, self.gpu_samples))
        row["dead_replicas"] = ", ".join(self.dead_replicas)
        for i, url in enumerate(sorted(self.replica_shares)):
            row |= {f"replica{i}_url": url, f"replica{i}_share": self.replica_shares[url],
                    f"replica{i}_prefix_hit_rate": self.replica_prefix_hit_rates.get(url)}  # fmt: skip
        return row | gpu_columns(self.gpu)


def gpu_columns(e: GpuEvidence | None) -> TableRow:
    """GPU evidence as table columns (empty where there is none)."""
    if e is None:
        return {}
    return {
        "gpu_sm_util_pct": e.sm_util_mean_pct,
        "gpu_power_pct": e.power_peak_pct,
        "gpu_power_w": e.power_peak_w,
        "gpu_sm_clock_min_pct": e.sm_clock_min_pct,
        "gpu_pcie_pct": e.pcie_peak_pct,
        "gpu_pcie_link": e.pcie_link,
        "gpu_pcie_direction": e.pcie_peak_direction,
        "gpu_nvlink_pct": e.nvlink_peak_pct,
        "gpu_nvlink_gbs": e.nvlink_peak_gbs,
        "gpu_nvlink_capacity_gbs": e.nvlink_capacity_gbs,
        "gpu_nvlink_direction": e.nvlink_peak_direction,
        "gpu_slowdowns": "; ".join(e.slowdowns),
    }


def median_evidence(found: list[GpuEvidence]) -> GpuEvidence | None:
    """One level's GPU evidence from its repeats': numbers as medians, words joined, every slowdown seen."""
    if not found:
        return None
    values: dict[str, Any] = {"samples": sum(e.samples for e in found)}
    for name, info in GpuEvidence.model_fields.items():
        if name == "samples":
            continue
        seen = [getattr(e, name) for e in found]
        if name == "slowdowns":
            values[name] = list(dict.fromkeys(x for e in found for x in e.slowdowns))
        elif info.annotation in (str, "str"):
            values[name] = "; ".join(dict.fromkeys(x for x in seen if x))
        else:
            numbers = [x for x in seen if x is not None]
            values[name] = statistics.median(numbers) if numbers else None
    return GpuEvidence(**values)


class ServerCounters(BaseModel):
    """What vLLM's /metrics said over one window: its counters' deltas and its gauges' peaks."""

    preemptions: float = 0.0
    prefix_cache_hits: float = 0.0
    prefix_cache_hit_rate: float | None = None  # 0-1
    kv_cache_usage_peak: float | None = None  # 0-1
    running_peak: float | None = None
    waiting_peak: float | None = None
    server_queue_ms: float | None = None  # mean wait in vLLM's queue, from its histogram

    @classmethod
    def of(cls, before: dict[str, float], after: dict[str, float], peaks: dict[str, float]) -> ServerCounters:
        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
        queued = delta("vllm:request_queue_time_seconds_count")
        return cls(
            preemptions=delta("vllm:num_preemptions_total"),
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=hits / queries if queries > 0 else None,
            kv_cache_usage_peak=peaks.get("kv_cache_usage_perc"),
            running_peak=peaks.get("num_requests_running"),
            waiting_peak=peaks.get("num_requests_waiting"),
            server_queue_ms=1000 * delta("vllm:request_queue_time_seconds_sum") / queued if queued > 0 else None,
        )


class ReplicaShare(BaseModel):
    """One replica behind a router over one window, from its own /metrics: what the router sent it."""

    requests: float  # requests it finished (vllm:request_success_total)
    share: float  # of all replicas' finished requests, 0-1
    prefix_cache_hit_rate: float | None = None  # 0-1
    answered: bool = True  # its /metrics answered after the window (False: it went away during it)


def replica_shares(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, ReplicaShare]:
    """Each engine's part of a window; {} for a single server."""
    if len(before) < 2:
        return {}

    def delta(url: str, name: str) -> float:
        return after.get(url, {}).get(name, 0.0) - before.get(url, {}).get(name, 0.0)

    done = {url: max(0.0, delta(url, "vllm:request_success_total")) for url in before}
    total = sum(done.values())
    out = {}
    for url in before:
        queries = delta(url, "vllm:prefix_cache_queries_total")
        out[url] = ReplicaShare(
            requests=done[url],
            share=done[url] / total if total else 0.0,
            prefix_cache_hit_rate=delta(url, "vllm:prefix_cache_hits_total") / queries if queries > 0 else None,
            answered=bool(after.get(url)),
        )
    return out


ROUTER_COUNTERS = {
    "retries": "vllm_router_retries_total",
    "retries_exhausted": "vllm_router_retries_exhausted_total",
    "errors": "vllm_router_request_errors_total",
}


class RouterCounts(BaseModel):
    """What vllm-router counted over one window (its Prometheus counters, summed over their labels)."""

    retries: float = 0.0
    retries_exhausted: float = 0.0
    errors: float = 0.0

    @classmethod
    def of(cls, before: dict[str, float], after: dict[str, float]) -> RouterCounts | None:
        if not after:
            return None
        return cls(**{k: max(0.0, after.get(n, 0.0) - before.get(n, 0.0)) for k, n in ROUTER_COUNTERS.items()})


class RunRow(BaseModel):
    """One measured window of a level: the client's numbers, the server's, both clocks, the GPUs'."""

    concurrency: int
    repeat: int
    summary: metrics.RunSummary
    server: ServerCounters
    clock: metrics.EngineClock
    prefix_cache_reset: str  # 'reset', or why not
    client_cpu_pct: float  # the load generator's CPU over the window, % of one core per process
    client_processes: int
    gpu: GpuEvidence | None = None
    gpu_note: str = ""  # why there is no GPU evidence
    replicas: dict[str, ReplicaShare] = {}  # behind a router: each replica's part, by its URL
    router: RouterCounts | None = None

    def flat(self) -> TableRow:
        """The runs table's row (and the scalars a level takes medians of)."""
        row: TableRow = {"concurrency": self.concurrency, "repeat": self.repeat, **self.summary.flat()}
        row |= self.server.model_dump() | clock_fields(self.clock)
        row |= {
            "prefix_cache_reset": self.prefix_cache_reset,
            "client_cpu_pct": self.client_cpu_pct,
            "client_processes": self.client_processes,
            "gpu_samples": self.gpu.samples if self.gpu else 0,
            "gpu_note": self.gpu_note,
        }
        for i, (url, part) in enumerate(sorted(self.replicas.items())):
            row |= {f"replica{i}_url": url, f"replica{i}_share": round(part.share, 4),
                    f"replica{i}_prefix_hit_rate": part.prefix_cache_hit_rate}  # fmt: skip
        return row | gpu_columns(self.gpu)


# what a level holds as the median of its repeats' values
MEDIAN_FIELDS = [
    name
    for name in Level.model_fields
    if name
    not in {
        "concurrency",
        "repeats",
        "output_throughput",
        "output_throughput_min",
        "output_throughput_max",
        "spread_pct",
        "failed",
        "preemptions",
        "limit",
        "limit_kind",
        "plan_ceiling_tok_s",
        "plan_ceiling_pct",
        "gpu",
        "gpu_samples",
        "gpu_note",
        "replica_shares",
        "replica_prefix_hit_rates",
        "dead_replicas",
        "router_retries",
        "router_retries_exhausted",
        "router_errors",
    }
]


class SingleStream(BaseModel):
    output_throughput: float
    per_user_tok_s: float | None
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None


class Best(BaseModel):
    concurrency: int
    output_throughput: float


class SweepResult(BaseModel):
    """The whole sweep; written also when it stopped on a fault."""

    url: str
    model: str
    workload: Workload
    max_concurrency: int
    repeats: int
    plateau_gain: float
    objectives: metrics.Objectives
    levels: list[Level]
    runs: list[RunRow]  # one per level and repeat
    stopped_by: StopReason
    stop_reason: str  # the same, said for a person, with the figure that decided it
    fault: str
    plateau_concurrency: int | None  # where throughput levels off; only when saturated (plateau or decline)
    last_gain: float | None  # output throughput gain of the last doubling
    best: Best | None
    single_stream: SingleStream | None
    length_mismatches: metrics.LengthMismatches
    warnings: list[str]
    tables: dict[str, str]  # table -> file name (parquet; a CSV beside each)

    @property
    def saturated(self) -> bool:
        return self.stopped_by in ("plateau", "decline")


def plateau_reached(throughputs: list[float], gain: float) -> bool:
    """True when the last two doublings together raised throughput by less than ``gain``."""
    if len(throughputs) < 3:
        return False
    base = throughputs[-3]
    return base > 0 and max(throughputs[-2:]) < base * (1 + gain)


def plateau_level(levels: list[int], throughputs: list[float], gain: float) -> int | None:
    """The lowest concurrency already within ``gain`` of the best throughput."""
    if not throughputs:
        return None
    best = max(throughputs)
    return next(c for c, t in zip(levels, throughputs) if t >= best * (1 - gain))


def failover_text(level: Level) -> str:
    """Behind a router: the replicas that stopped answering during the level, what the router retried and what was
    lost; '' when every replica answered and nothing was retried."""
    if not level.dead_replicas and not level.router_retries and not level.failed:
        return ""
    dead = f"{', '.join(level.dead_replicas)} stopped answering; " if level.dead_replicas else ""
    retried = (
        f"the router retried {level.router_retries:.0f} request(s) on another replica"
        f" ({level.router_retries_exhausted:.0f} ran out of retries), "
        if level.router_retries is not None
        else ""
    )
    return f"{dead}{retried}{level.failed} request(s) lost" if dead or retried else ""


def limit_of(level: Level, gain: float | None, cfg: SweepConfig) -> tuple[LimitKind, str]:
    """What limits a level, from what was gathered during it; ``gain`` is its throughput over the previous
    level's. The client is checked first: it must never silently be the limit."""
    waiting = level.waiting_peak or 0.0
    running = level.running_peak or 0.0
    if level.client_cpu_pct is not None and level.client_cpu_pct >= CLIENT_BOUND_PCT:
        n = int(level.client_processes or 1)
        return "client", (
            f"client-bound: {'each of ' + str(n) + ' client processes' if n > 1 else 'the load generator'} used "
            f"{level.client_cpu_pct:.0f} % of a core, so the server may have had more to give (raise "
            "bench_client_processes, on a machine with cores to spare)"
        )
    # More streams than max_num_seqs: the rest wait in vLLM's queue by arithmetic, whatever was sampled. vLLM's
    # gauges can read 0 between samples, or miss a level altogether (an API server starved of CPU answers
    # /metrics late); the queue-time histogram, counted over the whole window, shows the wait all the same.
    if cfg.max_num_seqs and level.concurrency > cfg.max_num_seqs:
        queued = max(waiting, level.concurrency - running)
        held = (
            f"{running:.0f} running, {queued:.0f} waiting"
            if running >= cfg.max_num_seqs
            else f"{level.concurrency} streams for {cfg.max_num_seqs} slots"
        )
        wait = (
            f"; requests waited {level.server_queue_ms:.0f} ms on average in vLLM's queue"
            if level.server_queue_ms is not None
            else ""
        )
        return "batch", f"batch limit max_num_seqs={cfg.max_num_seqs}: {held}{wait}"
    usage = level.kv_cache_usage_peak or 0.0
    if usage >= KV_FULL or (level.preemptions and waiting > 0):
        return "kv_cache", (
            f"KV cache full: {usage:.0%} used, {waiting:.0f} waiting, {level.preemptions:.0f} preemptions"
        )
    if off_clock(level) and (gain is None or gain < cfg.plateau_gain):  # binds, as a wall, once the gain stops
        return "api_server", (
            f"API-server-bound: vLLM's engine had the first token after {level.vllm_ttft_mean_ms or 0:.0f} ms and "
            f"the rest {level.vllm_tpot_mean_ms or 0:.1f} ms apart, but they reached the client after "
            f"{level.client_ttft_mean_ms or 0:.0f} ms and {level.client_tpot_mean_ms or 0:.1f} ms apart (means): "
            "the API server process (HTTP, detokenising, streaming) fell behind the engine; give the server more "
            "CPU cores, or keep this client off them"
        )
    wall = gpu_evidence.verdict(level.gpu) if level.gpu else None
    if wall and (gain is None or gain < cfg.plateau_gain):  # a wall binds once throughput stops rising
        kind, words = wall
        return kind, words + (f"; throughput {gain:+.0%} over the level before" if gain is not None else "")  # type: ignore[return-value]
    if gain is None:
        return "rising", "the first level: nothing limits it yet"
    if gain >= cfg.plateau_gain:
        return "rising", f"still rising: not saturated ({gain:+.0%} over the level before)"
    client = (
        "the client's CPU was not measured, so it is a suspect"
        if level.client_cpu_pct is None
        else f"the client used {level.client_cpu_pct:.0f} % of a core"
    )
    # the waiting gauge peaks while new streams' prefills queue for the token budget, below any batch limit
    waits = "nothing waits" if not waiting else f"at most {waiting:.0f} waited in vLLM's queue"
    if gain < -cfg.plateau_gain:
        return "decline", (
            f"declined {gain:+.0%} with {running:.0f} of {level.concurrency} streams running and {waits}; {client}"
        )
    util = level.gpu.sm_util_mean_pct if level.gpu else None
    sm = f"SM busy {util:.0f} %, " if util is not None else ""
    return "server", (
        f"server-bound: {running:.0f} of {level.concurrency} streams run together, {waits}, and doubling "
        f"the streams gained {gain:+.0%}; the batch's compute or memory bandwidth is the wall ({sm}{client})"
    )


def objective_broken(level: Level, objectives: metrics.Objectives) -> str:
    """Which objective the level's median request misses, if any."""
    checks = [
        ("TTFT", objectives.ttft_ms, level.ttft_p50_ms),
        ("TPOT", objectives.tpot_ms, level.tpot_p50_ms),
        ("E2EL", objectives.e2el_ms, level.e2el_p50_ms),
    ]
    for name, limit, value in checks:
        if limit > 0 and value is not None and value > limit:
            return f"median {name} {value:.0f} ms exceeds the {limit:.0f} ms objective"
    return ""


def clock_fields(clock: metrics.EngineClock) -> dict[str, float | int | None]:
    """A window's clocks as the level fields that hold them; no gap where vLLM also served other requests."""
    return {
        "client_ttft_mean_ms": clock.client_ttft_mean_ms,
        "vllm_ttft_mean_ms": clock.vllm_ttft_mean_ms,
        "client_tpot_mean_ms": clock.client_tpot_mean_ms,
        "vllm_tpot_mean_ms": clock.vllm_tpot_mean_ms,
        "window_requests": clock.requests,
        "vllm_requests": clock.vllm_requests,
        "tpot_clock_gap_pct": clock.tpot_gap_pct if clock.same_requests else None,
    }


# beyond this the client's TPOT is not the engine's pace: tokens reached the client late or in bursts
CLOCK_TOLERANCE_PCT = 25.0


def off_clock(level: Level) -> bool:
    """Whether the client's mean TPOT at this level is off vLLM's own by more than CLOCK_TOLERANCE_PCT."""
    return level.tpot_clock_gap_pct is not None and abs(level.tpot_clock_gap_pct) > CLOCK_TOLERANCE_PCT


def clock_disagreements(levels: list[Level]) -> str:
    """A warning naming the levels whose mean TPOT by the client's clock is off vLLM's own by more than
    CLOCK_TOLERANCE_PCT, over the same requests; '' when none is."""
    off = [
        f"c={lv.concurrency} ({lv.client_tpot_mean_ms or 0:.1f} against {lv.vllm_tpot_mean_ms or 0:.1f} ms, "
        f"{lv.tpot_clock_gap_pct:+.0f} %)"
        for lv in levels
        if off_clock(lv)
    ]
    if not off:
        return ""
    return (
        "the client's mean TPOT is off vLLM's own clock at "
        + ", ".join(off)
        + ": tokens left the API server late or in bursts (it, or this client, was short of CPU), so latencies "
        "at those levels describe the delivery, not the engine's pace; throughput still counts every token"
    )


def aggregate(rows: list[RunRow]) -> list[Level]:
    """One level per concurrency: medians over repeats, and the spread of output throughput."""
    out = []
    for c in sorted({r.concurrency for r in rows}):
        reps = [r for r in rows if r.concurrency == c]
        flat = [r.flat() for r in reps]
        tps = [r.summary.output_throughput for r in reps]
        medians = {}
        for key in MEDIAN_FIELDS:
            values = [float(v) for row in flat if isinstance(v := row.get(key), (int, float))]
            medians[key] = statistics.median(values) if values else None
        out.append(
            Level(
                concurrency=c,
                repeats=len(reps),
                output_throughput=statistics.median(tps),
                output_throughput_min=min(tps),
                output_throughput_max=max(tps),
                spread_pct=spread_pct(tps),
                failed=sum(r.summary.failed for r in reps),
                preemptions=sum(r.server.preemptions for r in reps),
                gpu=median_evidence([r.gpu for r in reps if r.gpu]),
                gpu_samples=[r.gpu.samples for r in reps if r.gpu],
                gpu_note="; ".join(dict.fromkeys(r.gpu_note for r in reps if r.gpu_note)),
                **medians,
            )
        )
        out[-1].per_user_tok_s = per_user_speed(out[-1])
        for url in sorted({u for r in reps for u in r.replicas}):
            parts = [r.replicas[url] for r in reps if url in r.replicas]
            rates = [x.prefix_cache_hit_rate for x in parts if x.prefix_cache_hit_rate is not None]
            out[-1].replica_shares[url] = round(statistics.median(x.share for x in parts), 4)
            out[-1].replica_prefix_hit_rates[url] = round(statistics.median(rates), 4) if rates else None
            if not all(x.answered for x in parts):
                out[-1].dead_replicas.append(url)
        counted = [r.router for r in reps if r.router]
        if counted:
            out[-1].router_retries = sum(x.retries for x in counted)
            out[-1].router_retries_exhausted = sum(x.retries_exhausted for x in counted)
            out[-1].router_errors = sum(x.errors for x in counted)
    return out


def per_user_speed(level: Level) -> float | None:
    """What one user of the level gets, in tok/s: 1 / the level's median TPOT, or 1 / vLLM's own mean TPOT where the
    client's clock is off the engine's (tokens delivered in bursts make the client's TPOT near 0, and its
    reciprocal absurd: 11,762 tok/s per user at 8 streams that made 711 in all)."""
    if off_clock(level) and level.vllm_tpot_mean_ms:
        return 1000 / level.vllm_tpot_mean_ms
    return 1000 / level.tpot_p50_ms if level.tpot_p50_ms else None


def label_limits(levels: list[Level], cfg: SweepConfig) -> list[Level]:
    """Set each level's limit, judging its gain against the level before it."""
    for i, level in enumerate(levels):
        previous = levels[i - 1].output_throughput if i else 0.0
        gain = level.output_throughput / previous - 1 if previous > 0 else None
        level.limit_kind, level.limit = limit_of(level, gain, cfg)
        ceiling = cfg.decode_ceiling.get(level.concurrency)
        if ceiling:
            level.plan_ceiling_tok_s, level.plan_ceiling_pct = ceiling, 100 * level.output_throughput / ceiling
    return levels


def declined(levels: list[Level], gain: float) -> Level | None:
    """The best level, when the newest one fell past it by more than ``gain`` in every repeat: past saturation."""
    if len(levels) < 2:
        return None
    best = max(levels[:-1], key=lambda lv: lv.output_throughput)
    newest = levels[-1]
    return best if newest.output_throughput_max < best.output_throughput * (1 - gain) else None


def _client_cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the client processes of a level)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _gain(throughputs: list[float]) -> float | None:
    return throughputs[-1] / throughputs[-2] - 1 if len(throughputs) >= 2 and throughputs[-2] > 0 else None


class Stop(NamedTuple):
    by: StopReason
    reason: str  # said for a person, with the figure that decided it


def stop_rule(measured: list[Level], cfg: SweepConfig) -> Stop | None:
    """Whether the sweep stops after its newest level: a broken objective, a decline past the best level, or a
    plateau over two doublings."""
    level = measured[-1]
    if broken := objective_broken(level, cfg.objectives):
        return Stop("objective", f"latency objective broken at concurrency {level.concurrency}: {broken}")
    if peak := declined(measured, cfg.plateau_gain):
        return Stop(
            "decline",
            f"past saturation: throughput fell to {level.output_throughput:,.0f} tok/s at concurrency "
            f"{level.concurrency}, {1 - level.output_throughput / peak.output_throughput:.0%} below its best "
            f"({peak.output_throughput:,.0f} tok/s at {peak.concurrency}) in every repeat",
        )
    if plateau_reached([lv.output_throughput for lv in measured], cfg.plateau_gain):
        return Stop(
            "plateau",
            f"plateau: under {cfg.plateau_gain:.0%} gain over the last two doublings "
            f"(concurrency {measured[-3].concurrency} to {level.concurrency})",
        )
    return None


def not_saturated(throughputs: list[float], cfg: SweepConfig) -> str:
    """Why a sweep that reached max_concurrency is not a plateau, with the last doubling's gain."""
    last_gain = _gain(throughputs)
    if last_gain is None:
        trend = ""
    elif last_gain >= cfg.plateau_gain:
        trend = f", throughput still rising ({last_gain:+.0%} over the last doubling)"
    else:
        trend = (
            f", throughput flat over the last doubling ({last_gain:+.0%}); a plateau needs two such doublings: "
            "raise bench_max_concurrency"
        )
    return f"reached bench_max_concurrency {cfg.max_concurrency} before a plateau{trend}: not saturated"


class _Sweep:
    """The sweep's state as it goes: every window measured, the levels done, how the next window is sized."""

    def __init__(self, target: Target, model_path: str, cfg: SweepConfig, log: Callable[[str], None]):
        self.target, self.cfg, self.log = target, cfg, log
        self.maker = loadgen.PromptMaker(loadgen.load_tokenizer(model_path), cfg.workload.seed)
        # the chat template's tokens count towards the prompt
        self.overhead = self.maker.chat_overhead() if cfg.workload.endpoint == "chat" else 0
        self.dataset = Cursor(cfg.dataset) if cfg.dataset else None
        self.records: list[loadgen.RequestRecord] = []
        self.rows: list[RunRow] = []
        self.levels: list[Level] = []
        self.short_windows: list[str] = []
        self.fault = ""
        self.rate: float | None = None  # requests/s of the last window, to size the next
        self.rate_at = 0  # the concurrency that rate was measured at
        self.processes = cfg.client_processes or 1
        self.on_level: Callable[[], None] = lambda: None  # after each level: the sweep so far is written

    def stall_s(self) -> float:
        """How long a window may go without a token: from the level before's slowest first token and gap."""
        if not self.levels:
            return client.STALL.min_s
        return client.STALL.after(self.levels[-1].ttft_p99_ms, self.levels[-1].tpot_p99_ms)

    def prompts(self, c: int, expected: float | None) -> list[loadgen.PromptLike]:
        cfg = self.cfg
        count = cfg.prompts_for(c, expected) + (cfg.warmup or c)
        if cfg.workload.turns > 1:  # whole conversations, at least one per stream, no warm-up requests
            count = max(math.ceil(cfg.prompts_for(c, expected) / cfg.workload.turns), c) * cfg.workload.turns
        if self.dataset:
            return list(self.dataset.take(count))
        return loadgen.synthetic_prompts(self.maker, count, cfg.workload, self.overhead)

    def send(self, c: int, prompts: list[loadgen.PromptLike]) -> loadgen.Window:
        cfg = self.cfg
        if cfg.workload.turns > 1:
            turns = cfg.workload.turns
            texts = [str(t) for t in prompts]
            chats = [texts[i : i + turns] for i in range(0, len(texts) - turns + 1, turns)]
            return loadgen.run_conversations(self.target, cfg.workload, chats, concurrency=c, stall_s=self.stall_s())
        return loadgen.run_level(
            self.target, cfg.workload, prompts, concurrency=c, warmup=cfg.warmup or c,
            min_requests=cfg.measured_requests(c), min_seconds=cfg.min_level_s, processes=self.processes,
            stall_s=self.stall_s(),
        )  # fmt: skip

    def window(self, c: int, rep: int, expected: float | None) -> tuple[RunRow, loadgen.Window]:
        """Measure one window at ``c`` streams, with the server's counters and the GPUs around it."""
        prompts = self.prompts(c, expected)
        reset = client.reset_prefix_cache(self.target) if self.cfg.reset_prefix_cache else "not requested"
        engines_before = client.scrape_engines(self.target)
        router_before = client.router_metrics(self.target.router_metrics) if self.target.router_metrics else {}
        cpu_before, wall_before = _client_cpu_s(), time.monotonic()
        with (
            client.MetricsSampler(self.target.engine_urls) as sampler,
            gpu_evidence.GpuSampler(self.cfg.gpu_ids) as gpus,
        ):
            window = self.send(c, prompts)
        wall = max(time.monotonic() - wall_before, 1e-9)
        engines_after = client.scrape_engines(self.target)
        router_after = client.router_metrics(self.target.router_metrics) if self.target.router_metrics else {}
        before, after = client.summed(engines_before), client.summed(engines_after)
        for r in window.records:
            r.level, r.repeat = f"c{c}r{rep}", rep
        return RunRow(
            concurrency=c,
            repeat=rep,
            summary=metrics.summarize(window.records, self.cfg.objectives),
            server=ServerCounters.of(before, after, sampler.peaks),
            clock=metrics.engine_clock(window.records, before, after),
            prefix_cache_reset=reset,
            # per client process: one near a full core paces the server instead of measuring it
            client_cpu_pct=round(100 * (_client_cpu_s() - cpu_before) / wall / self.processes, 1),
            client_processes=self.processes,
            gpu=gpus.evidence,
            gpu_note="" if gpus.evidence else f"no GPU evidence: {gpus.absent or 'no sample within the window'}",
            replicas=replica_shares(engines_before, engines_after),
            router=RouterCounts.of(router_before, router_after),
        ), window

    def level(self, c: int) -> Level | None:
        """Every repeat of one concurrency, until the spread settles; None when the server faulted."""
        cfg, rep = self.cfg, 0
        while True:
            expected = self.rate * c / self.rate_at if self.rate and self.rate_at else self.rate
            row, window = self.window(c, rep, expected)
            s = row.summary
            if s.request_throughput:
                self.rate, self.rate_at = s.request_throughput, c
            if expected is None and cfg.min_level_s and s.duration_s < cfg.min_level_s and not s.failed:
                self.log(
                    f"concurrency {c:4d}: a first window of {s.duration_s:.1f} s sized the next "
                    f"({s.request_throughput:.1f} requests/s); not counted"
                )
                continue
            self.records += window.records  # a faulted window's requests stay in the requests table, as evidence
            self._say(row)
            if (s.failed or window.stalled) and (fault := self._fault(row, window.stalled)):
                self.fault = fault  # and it is no level: its throughput is the fault's, not the server's
                self.log(f"concurrency {c:4d}: {fault}")
                return None
            self.rows.append(row)
            rep += 1
            spread = spread_pct([r.summary.output_throughput for r in self.rows if r.concurrency == c])
            if rep >= cfg.max_repeats or (rep >= cfg.repeats and (spread is None or spread <= cfg.max_spread_pct)):
                return aggregate([r for r in self.rows if r.concurrency == c])[0]
            if rep >= cfg.repeats:
                self.log(
                    f"concurrency {c:4d}: repeats spread {spread:.0f} % > {cfg.max_spread_pct:.0f} %, measuring again"
                )

    def _say(self, row: RunRow) -> None:
        s = row.summary
        self.log(
            f"concurrency {row.concurrency:4d} repeat {row.repeat + 1}: {s.output_throughput:8.1f} output tok/s, "
            f"TTFT p50 {s.ttft_ms.p50 or 0:7.1f} ms, TPOT p50 {s.tpot_ms.p50 or 0:6.1f} ms, "
            f"{s.requests} requests in {s.duration_s:.1f} s"
            + (f", {s.failed} failed ({row.flat()['errors']})" if s.failed else "")
        )
        if s.duration_s < self.cfg.min_level_s and not s.failed:
            self.short_windows.append(f"c{row.concurrency} repeat {row.repeat + 1}: {s.duration_s:.1f} s")

    def _fault(self, row: RunRow, stalled: str = "") -> str:
        """The server's fault, when failed requests mean it stopped answering, failed them all, or stopped
        producing tokens; '' otherwise."""
        health = client.health(self.target.url)
        if stalled:
            return (
                f"the engine stopped producing tokens while /health answered {health} ({stalled}, at concurrency "
                f"{row.concurrency}); `servebook status` names a stopped engine process"
            )
        if health == "ready" and row.summary.failed < row.summary.requests:
            return ""
        what = "stopped answering" if health != "ready" else "failed every request"
        return f"the server {what} at concurrency {row.concurrency} ({row.flat()['errors']}); /health: {health}"

    def run(self) -> Stop:
        for c in self.cfg.levels():
            level = self.level(c)
            if level is None:
                return Stop("fault", f"server fault at concurrency {c}")
            label_limits([*self.levels, level], self.cfg)
            self.log(f"concurrency {c:4d}: {level.limit}")
            if said := failover_text(level):
                self.log(f"concurrency {c:4d}: {said}")
            self.levels.append(level)
            self.on_level()
            if not self.cfg.client_processes and (level.client_cpu_pct or 0) >= CLIENT_SPLIT_PCT:
                self.processes = min(2 * self.processes, MAX_CLIENT_PROCESSES)
            if stop := stop_rule(self.levels, self.cfg):
                return stop
        return Stop("max_concurrency", not_saturated([lv.output_throughput for lv in self.levels], self.cfg))


def sweep(
    target: Target,
    model_path: str,
    cfg: SweepConfig,
    out_dir: Path,
    *,
    log: Callable[[str], None] = print,
    table_prefix: str = "sweep",
    on_level: Callable[[SweepResult], None] | None = None,
) -> SweepResult:
    """Run the sweep; write per-request, per-run and per-level tables named ``<table_prefix>_*``; return the
    result (also on a fault). After each level the tables are written and ``on_level`` gets the sweep so far,
    marked interrupted, so an interrupt or a crash keeps every level measured before it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = _Sweep(target, model_path, cfg, log)
    so_far = Stop(
        "interrupted", "the sweep did not finish (interrupted, or servebook crashed); the levels before are kept"
    )
    if on_level is not None:
        state.on_level = lambda: on_level(_result(state, so_far, model_path, out_dir, table_prefix))
    return _result(state, state.run(), model_path, out_dir, table_prefix)


def _result(state: _Sweep, stop: Stop, model_path: str, out_dir: Path, table_prefix: str) -> SweepResult:
    """The sweep as far as it went, its tables written."""
    target, cfg = state.target, state.cfg
    per_level = label_limits(aggregate(state.rows), cfg)
    runs: dict[str, tuple[list[loadgen.RequestRecord], tables.RunShape]] = {}
    for r in state.records:
        runs.setdefault(r.level, ([], tables.RunShape(r.concurrency)))[0].append(r)
    tables_written = {
        "requests": tables.write_requests(state.records, out_dir / f"{table_prefix}_requests"),
        "runs": tables.write([r.flat() for r in state.rows], out_dir / f"{table_prefix}_runs"),
        "levels": tables.write([lv.flat() for lv in per_level], out_dir / f"{table_prefix}_levels"),
        "vllm_format": tables.write_vllm_results(
            runs, out_dir / f"{table_prefix}_vllm", model=target.model, tokenizer=model_path,
            endpoint=cfg.workload.endpoint, objectives=cfg.objectives,
        ),
    }  # fmt: skip
    mismatches = metrics.LengthMismatches(
        input=sum(r.summary.length_mismatches.input for r in state.rows),
        output=sum(r.summary.length_mismatches.output for r in state.rows),
        checked=sum(r.summary.completed for r in state.rows),
    )
    return SweepResult(
        url=target.url,
        model=target.model,
        workload=cfg.workload,
        max_concurrency=cfg.max_concurrency,
        repeats=cfg.repeats,
        plateau_gain=cfg.plateau_gain,
        objectives=cfg.objectives,
        levels=per_level,
        runs=state.rows,
        stopped_by=stop.by,
        stop_reason=stop.reason,
        fault=state.fault,
        plateau_concurrency=_plateau_of(state.levels, cfg) if stop.by in ("plateau", "decline") else None,
        last_gain=_gain([lv.output_throughput for lv in state.levels]),
        best=_best(per_level),
        single_stream=_single_stream(per_level),
        length_mismatches=mismatches,
        warnings=sweep_warnings(per_level, mismatches, state.short_windows, cfg),
        tables=tables_written,
    )


def _plateau_of(levels: list[Level], cfg: SweepConfig) -> int | None:
    return plateau_level([lv.concurrency for lv in levels], [lv.output_throughput for lv in levels], cfg.plateau_gain)


def _best(levels: list[Level]) -> Best | None:
    best = max(levels, key=lambda lv: lv.output_throughput) if levels else None
    return Best(concurrency=best.concurrency, output_throughput=best.output_throughput) if best else None


def _single_stream(levels: list[Level]) -> SingleStream | None:
    single = next((lv for lv in levels if lv.concurrency == 1), None)
    if single is None:
        return None
    return SingleStream(
        output_throughput=single.output_throughput,
        per_user_tok_s=single.per_user_tok_s,
        ttft_p50_ms=single.ttft_p50_ms,
        tpot_p50_ms=single.tpot_p50_ms,
    )


def sweep_warnings(
    levels: list[Level], mismatches: metrics.LengthMismatches, short_windows: list[str], cfg: SweepConfig
) -> list[str]:
    """What a reader of the sweep must know before trusting its numbers."""
    warnings = []
    if mismatches.output:
        warnings.append(
            f"{mismatches.output} requests returned a different number of tokens than asked "
            "(the server ignored ignore_eos or max_tokens)"
        )
    if short_windows:
        warnings.append(
            f"{len(short_windows)} windows ended before bench_min_level_s ({cfg.min_level_s:.0f} s) for want of "
            f"prompts: {'; '.join(short_windows[:5])}"
        )
    wide = [lv for lv in levels if lv.spread_pct is not None and lv.spread_pct > cfg.max_spread_pct]
    if wide:
        warnings.append(
            "spread still above bench_max_spread_pct after "
            f"{cfg.max_repeats} runs at "
            + ", ".join(f"c={lv.concurrency} ({lv.spread_pct:.0f} %)" for lv in wide)
            + ": lengthen bench_min_level_s or read these levels as noisy"
        )
    if mismatches.input:
        warnings.append(f"{mismatches.input} prompts were counted differently by the server than by the tokenizer")
    if off := clock_disagreements(levels):
        warnings.append(off)
    return warnings
