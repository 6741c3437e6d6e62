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
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from pydantic import BaseModel

from servebook import client, gpu_evidence, loadgen, metrics, tables
from servebook.client import Target
from servebook.datasets import Cursor
from servebook.loadgen import Workload

if TYPE_CHECKING:
    from servebook.params import Params


from servebook.levels import (
    Level,
    RouterCounts,
    RunRow,
    ServerCounters,
    SweepConfig,
    aggregate,
    clock_disagreements,
    replica_shares,
    spread_pct,
)
from servebook.limits import (
    Stop,
    StopReason,
    doubling_gain,
    failover_text,
    label_limits,
    not_saturated,
    plateau_level,
    stop_rule,
)

CLIENT_SPLIT_PCT = 50.0  # a client process past half a core: the next levels share the streams among twice as many
MAX_CLIENT_PROCESSES = max((os.cpu_count() or 2) // 2, 1)  # the other half of the cores stay the server's


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


class HostCpu:
    """The host's CPU seconds over a window, split: this process and its children (the client), the server's
    process group (from servebook's registry, by the target's port), and everything else."""

    def __init__(self, url: str):
        from urllib.parse import urlparse

        from servebook import server

        port = urlparse(url).port
        record = server.registered(port) if port else None
        self.pgid = record.pgid if record else None
        self.busy, self.server, self.client = self._busy_s(), self._server_s(), _client_cpu_s()

    @staticmethod
    def _busy_s() -> float:
        times = psutil.cpu_times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0)

    def _server_s(self) -> float:
        total = 0.0
        for proc in psutil.process_iter():
            try:
                if self.pgid is not None and os.getpgid(proc.pid) == self.pgid:
                    cpu = proc.cpu_times()
                    total += cpu.user + cpu.system + cpu.children_user + cpu.children_system
            except (psutil.Error, ProcessLookupError, PermissionError):
                continue
        return total

    def others_pct(self, wall_s: float) -> float | None:
        """% of all the host's CPUs that neither the client nor the server used over the window."""
        if self.pgid is None or wall_s <= 0:
            return None
        others = (self._busy_s() - self.busy) - (self._server_s() - self.server) - (_client_cpu_s() - self.client)
        return round(max(0.0, 100 * others / wall_s / (psutil.cpu_count() or 1)), 1)


def _client_cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the client processes of a level)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


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
        self.drop_when: Callable[[list[Level]], str | None] = lambda _levels: None

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
        host = HostCpu(self.target.url)
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
            host_others_cpu_pct=host.others_pct(wall),
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
        if stalled:
            return client.hung_engine(self.target.url, stalled, f"concurrency {row.concurrency}")
        health = client.health(self.target.url)
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
            if c < self.cfg.reach:
                continue
            if stop := stop_rule(self.levels, self.cfg):
                return stop
            if dropped := self.drop_when(self.levels):
                return Stop("dropped", dropped)
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
    drop_when: Callable[[list[Level]], str | None] | None = None,
) -> SweepResult:
    """Run the sweep; write per-request, per-run and per-level tables named ``<table_prefix>_*``; return the
    result (also on a fault). After each level the tables are written and ``on_level`` gets the sweep so far,
    marked interrupted, so an interrupt or a crash keeps every level measured before it. ``drop_when`` may end
    the sweep after any level with its reason (a rehearsal's candidate behind the leader)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = _Sweep(target, model_path, cfg, log)
    state.drop_when = drop_when or (lambda _levels: None)
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
        last_gain=doubling_gain([lv.output_throughput for lv in state.levels]),
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


HOST_BUSY_PCT = 25.0  # of all the host's CPUs, used by neither the client nor the server over a window


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
    if busy := [lv for lv in levels if (lv.host_others_cpu_pct or 0) >= HOST_BUSY_PCT]:
        warnings.append(
            "the host was busy: other processes used "
            + ", ".join(f"{lv.host_others_cpu_pct:.0f} % of its CPUs at c={lv.concurrency}" for lv in busy)
            + "; the client and the server shared the machine with them, so these levels may read low"
        )
    return warnings
