"""A level of the concurrency sweep: what one window at one concurrency measured (a run row: the client's
summary, vLLM's counters and gauges around it, the GPUs during it), its repeats aggregated into one
:class:`Level`, and the configuration a sweep measures levels with (:class:`SweepConfig`). What limits a level,
and when a sweep stops, is :mod:`servebook.limits`; the sweep itself is :mod:`servebook.bench`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from servebook import metrics
from servebook.datasets import Prompt
from servebook.gpu_evidence import GpuEvidence
from servebook.loadgen import Workload

if TYPE_CHECKING:
    pass


LimitKind = Literal[
    "client",
    "batch",
    "kv_cache",
    "api_server",
    "pcie",
    "nvlink",
    "power",
    "thermal",
    "server",
    "decline",
    "rising",
    "noise",
]
TableRow = dict[str, float | int | str | None]  # one row of a parquet/CSV table: only at that boundary


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
    reach: int = 0  # no stop rule ends the sweep below this concurrency (another stage reuses its windows)

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
    # what neither the client nor the server used of the host's CPUs over the window, % of all of them (None where
    # the server's processes are not servebook's to find): a busy host slows both sides
    host_others_cpu_pct: float | None = None
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
    host_others_cpu_pct: float | None = None  # the host's CPUs other processes used, % of all of them
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
            "host_others_cpu_pct": self.host_others_cpu_pct,
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
