"""Open-loop load at rising request rates: how much of the offered rate the server completes, the latencies on
the way, goodput, and the highest rate that still meets the latency objectives.

Closed-loop concurrency (:mod:`servebook.bench`) asks how much a server can do; a rate sweep asks what users
arriving on their own schedule get.  Requests are due at times drawn as ``vllm bench serve`` draws them
(:func:`servebook.loadgen.arrival_offsets`) and leave then, finished or not the ones before.  A rate the server
cannot keep up with is a finding, recorded as such, and ends the sweep: higher rates would only lengthen the
queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from servebook import client, loadgen, metrics, tables
from servebook.client import Target
from servebook.datasets import Cursor, Prompt
from servebook.levels import CLOCK_TOLERANCE_PCT
from servebook.loadgen import Arrival, RequestRecord, Workload

KEEP_UP = 0.9  # completions at under 90 % of the offered rate: requests pile up, the server is past its capacity


@dataclass
class RateSweepConfig:
    rates: list[float]
    arrival: Arrival = "poisson"
    burstiness: float = 1.0
    workload: Workload = field(default_factory=Workload)
    min_requests: int = 16  # measured requests per rate ...
    min_seconds: float = 0.0  # ... and at least this many seconds of arrivals
    max_concurrency: int = 0  # 0: as many in flight as arrive
    warmup: int = 2
    objectives: metrics.Objectives = field(default_factory=metrics.Objectives)
    goodput_target: float = 0.9  # share of requests that must meet every objective
    request_timeout_s: float = 600.0
    reset_prefix_cache: bool = True
    seed: int = 0
    dataset: list[Prompt] | None = None  # requests with their own lengths, instead of the workload's synthetic ones

    def requests_for(self, rate: float) -> int:
        return max(self.min_requests, math.ceil(rate * self.min_seconds))


class RateLevel(BaseModel):
    rate: float  # requests/s asked for
    requests: int
    failed: int
    offered_rate: float  # requests/s of this draw's due times
    achieved_rate: float  # requests/s the server completed, first to last completion
    kept_up: bool
    output_throughput: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2el_p50_ms: float | None
    e2el_p99_ms: float | None
    client_lag_p99_ms: float | None  # how late the client sent requests against their due time
    goodput: float | None  # requests/s meeting every objective
    goodput_share: float | None
    meets_objectives: bool | None  # None without objectives
    running_peak: float | None
    waiting_peak: float | None
    kv_cache_usage_peak: float | None
    # mean TPOT by the client's clock and by vLLM's own, over the same requests (metrics.EngineClock)
    client_tpot_mean_ms: float | None = None
    vllm_tpot_mean_ms: float | None = None
    tpot_clock_gap_pct: float | None = None
    verdict: str


class RateSweepResult(BaseModel):
    arrival: Arrival
    burstiness: float
    objectives: metrics.Objectives
    goodput_target: float
    levels: list[RateLevel]
    best_rate: float | None  # the highest rate kept up with (and meeting the objectives, where there are any)
    stop_reason: str
    tables: dict[str, str]
    fault: str = ""  # the engine stopped producing tokens in a window (its stall bound): the sweep stopped there


def achieved_rate(records: list[RequestRecord]) -> float:
    """Requests/s the server completed: the first 95 % of completions over the time they took to come back, or
    over the time they took to be sent where that is longer (a server cannot complete requests faster than they
    arrive). While the server keeps up the completions are spread as the arrivals are; once requests queue they
    come back slower than they went out. Leaving the last 5 % out keeps one slow straggler from reading as a
    queue; judging by end times, not latencies, keeps a server that answered every request of the window in one
    late batch (a 2-core CPU server at 200 requests/s) from reading as one that kept up."""
    measured = sorted((r for r in records if not r.warmup), key=lambda r: r.send)
    ends = sorted(r.end for r in measured if r.ok and r.end is not None)
    if len(ends) < 2:
        return 0.0
    k = max(2, math.ceil(0.95 * len(ends)))
    sends = [r.send for r in measured[:k]]
    window = max(ends[k - 1] - ends[0], sends[-1] - sends[0])
    return (k - 1) / window if window > 0 else 0.0


def offered_rate(offsets: list[float]) -> float:
    return (len(offsets) - 1) / offsets[-1] if len(offsets) >= 2 and offsets[-1] > 0 else 0.0


CLIENT_LAG_S = 0.05  # requests sent later than this (and than one mean gap) after they were due: the client lags


def judge(level: RateLevel, cfg: RateSweepConfig) -> str:
    """The level's verdict in words; a client that sent requests late says so, since it then offered less."""
    lag = level.client_lag_p99_ms or 0.0
    late = (
        f"; the client sent 1 % of requests over {lag:.0f} ms late (its own limit is near)"
        if lag / 1000 > max(CLIENT_LAG_S, 1 / level.rate)
        else ""
    )
    gap = level.tpot_clock_gap_pct
    clock = (
        f"; the client's mean TPOT ({level.client_tpot_mean_ms or 0:.1f} ms) is {gap:+.0f} % off vLLM's own "
        f"({level.vllm_tpot_mean_ms or 0:.1f} ms): the API server delivered tokens late or in bursts"
        if gap is not None and abs(gap) > CLOCK_TOLERANCE_PCT
        else ""
    )
    if not level.kept_up:
        return (
            f"the server could not keep up: it completed {level.achieved_rate:.2f} requests/s of "
            f"{level.offered_rate:.2f} offered ({level.achieved_rate / level.offered_rate:.0%}); requests queue"
            + (f" (waiting in vLLM: up to {level.waiting_peak:.0f})" if level.waiting_peak else "")
            + late
            + clock
        )
    if level.meets_objectives is False:
        return (
            f"kept up, but only {level.goodput_share:.0%} of requests met every objective "
            f"(target {cfg.goodput_target:.0%})" + clock
        )
    met = f", {level.goodput_share:.0%} met every objective" if level.goodput_share is not None else ""
    if level.achieved_rate >= level.offered_rate:  # a short draw's completions can bunch: never "7 of 6 completed"
        return f"kept up: every request completed as offered ({level.offered_rate:.2f} requests/s){met}{late}{clock}"
    return f"kept up: {level.achieved_rate:.2f} of {level.offered_rate:.2f} requests/s completed{met}{late}{clock}"


def _level(
    rate: float,
    offsets: list[float],
    s: metrics.RunSummary,
    recs: list[RequestRecord],
    peaks: dict[str, float],
    cfg: RateSweepConfig,
    *,
    clock: metrics.EngineClock | None = None,
) -> RateLevel:
    offered, achieved = offered_rate(offsets), achieved_rate(recs)
    measured = [r for r in recs if not r.warmup]
    lag = metrics.percentiles([max(r.send - r.arrival, 0.0) for r in measured if r.send])
    meets = None if s.goodput_share is None else s.goodput_share >= cfg.goodput_target
    level = RateLevel(
        rate=rate,
        requests=s.requests,
        failed=s.failed,
        offered_rate=offered,
        achieved_rate=achieved,
        kept_up=s.failed < s.requests and achieved >= KEEP_UP * offered,
        output_throughput=s.output_throughput,
        ttft_p50_ms=s.ttft_ms.p50,
        ttft_p99_ms=s.ttft_ms.p99,
        tpot_p50_ms=s.tpot_ms.p50,
        tpot_p99_ms=s.tpot_ms.p99,
        e2el_p50_ms=s.e2el_ms.p50,
        e2el_p99_ms=s.e2el_ms.p99,
        client_lag_p99_ms=lag.p99,
        goodput=s.goodput,
        goodput_share=s.goodput_share,
        meets_objectives=meets,
        running_peak=peaks.get("num_requests_running"),
        waiting_peak=peaks.get("num_requests_waiting"),
        kv_cache_usage_peak=peaks.get("kv_cache_usage_perc"),
        client_tpot_mean_ms=clock.client_tpot_mean_ms if clock else None,
        vllm_tpot_mean_ms=clock.vllm_tpot_mean_ms if clock else None,
        tpot_clock_gap_pct=clock.tpot_gap_pct if clock and clock.same_requests else None,
        verdict="",
    )
    level.verdict = judge(level, cfg)
    return level


def sweep_rates(
    target: Target,
    model_path: str,
    cfg: RateSweepConfig,
    out_dir: Path,
    *,
    log: Callable[[str], None] = print,
    table_prefix: str = "rates",
) -> RateSweepResult:
    """Each rate in turn, lowest first, until one the server cannot keep up with or that breaks the objectives;
    writes ``<table_prefix>_requests`` and ``<table_prefix>_levels`` tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    maker = loadgen.PromptMaker(loadgen.load_tokenizer(model_path), cfg.workload.seed)
    overhead = maker.chat_overhead() if cfg.workload.endpoint == "chat" else 0
    levels: list[RateLevel] = []
    runs: dict[str, tuple[list[RequestRecord], tables.RunShape]] = {}
    dataset = Cursor(cfg.dataset) if cfg.dataset else None
    stop_reason = f"every rate up to {max(cfg.rates):g} requests/s measured"
    fault = ""
    for i, rate in enumerate(sorted(cfg.rates)):
        offsets = loadgen.arrival_offsets(cfg.requests_for(rate), rate, cfg.arrival, cfg.burstiness, cfg.seed + i)
        count = cfg.warmup + len(offsets)
        prompts: list[loadgen.PromptLike] = (
            list(dataset.take(count)) if dataset else loadgen.synthetic_prompts(maker, count, cfg.workload, overhead)
        )
        stall_s = client.STALL.after(levels[-1].ttft_p99_ms, levels[-1].tpot_p99_ms) if levels else client.STALL.min_s
        level, recs, stalled = measure_rate(target, prompts, offsets, rate, cfg, stall_s=stall_s)
        if stalled:  # what it completed is the fault's, not the server's capacity
            level.kept_up, level.verdict = False, f"cut short, the engine stalled: {stalled}"
        levels.append(level)
        burstiness = cfg.burstiness if cfg.arrival == "gamma" else 1.0
        runs[f"r{rate:g}"] = (recs, tables.RunShape(cfg.max_concurrency or None, level.rate, burstiness))
        log(
            f"rate {rate:7.2f}/s: offered {level.offered_rate:6.2f}/s, achieved {level.achieved_rate:6.2f}/s, "
            f"{level.output_throughput:8.1f} output tok/s, TTFT p50 {level.ttft_p50_ms or 0:7.1f} ms "
            f"p99 {level.ttft_p99_ms or 0:7.1f} ms, {level.requests} requests; {level.verdict}"
        )
        if stalled:
            fault = client.hung_engine(target.url, stalled, f"{rate:g} requests/s")
            stop_reason = f"server fault at {rate:g} requests/s"
            log(f"rate {rate:7.2f}/s: {fault}")
            break
        if not level.kept_up:
            stop_reason = f"the server could not keep up with {rate:g} requests/s"
            break
        if level.meets_objectives is False:
            stop_reason = f"objectives broken at {rate:g} requests/s"
            break
    good = [lv for lv in levels if lv.kept_up and lv.meets_objectives is not False]
    tables_written = {
        "requests": tables.write_requests([r for recs, _ in runs.values() for r in recs], out_dir / f"{table_prefix}_requests"),
        "levels": tables.write([lv.model_dump() for lv in levels], out_dir / f"{table_prefix}_levels"),
        "vllm_format": tables.write_vllm_results(
            runs, out_dir / f"{table_prefix}_vllm", model=target.model, tokenizer=model_path,
            endpoint=cfg.workload.endpoint, objectives=cfg.objectives,
        ),
    }  # fmt: skip
    return RateSweepResult(
        arrival=cfg.arrival,
        burstiness=cfg.burstiness if cfg.arrival == "gamma" else 1.0,
        objectives=cfg.objectives,
        goodput_target=cfg.goodput_target,
        levels=levels,
        best_rate=max(lv.rate for lv in good) if good else None,
        stop_reason=stop_reason,
        tables=tables_written,
        fault=fault,
    )


def measure_rate(
    target: Target,
    prompts: list[loadgen.PromptLike],
    offsets: list[float],
    rate: float,
    cfg: RateSweepConfig,
    *,
    stall_s: float = client.STALL.min_s,
) -> tuple[RateLevel, list[RequestRecord], str]:
    """One rate's window, with vLLM's counters and gauges around it; the third value says why the window was cut
    short as stalled ('' when it was not)."""
    if cfg.reset_prefix_cache:
        client.reset_prefix_cache(target)
    before = client.summed(client.scrape_engines(target))
    with client.MetricsSampler(target.engine_urls) as sampler:
        window = loadgen.run_open_level(
            target, cfg.workload, prompts, offsets=offsets, level=f"r{rate:g}", warmup=cfg.warmup,
            max_concurrency=cfg.max_concurrency, stall_s=stall_s,
        )  # fmt: skip
    summary = metrics.summarize(window.records, cfg.objectives)
    clock = metrics.engine_clock(window.records, before, client.summed(client.scrape_engines(target)))
    level = _level(rate, offsets, summary, window.records, sampler.peaks, cfg, clock=clock)
    return level, window.records, window.stalled
