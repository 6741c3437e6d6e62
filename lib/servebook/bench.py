"""The concurrency sweep: double the streams until throughput stops rising, honestly.

Each level sends fresh, unique prompts (no prefix-cache reuse across levels), warms
up with as many requests as its concurrency, is repeated to show its spread, and
reads the server's ``/metrics`` around and during it.  The sweep stops when output
throughput gains less than ``plateau_gain`` over two doublings, when a latency
objective breaks, at ``max_concurrency``, or when the server fails; whatever was
measured is saved either way.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from servebook import client, loadgen, metrics
from servebook.errors import ServebookError
from servebook.loadgen import Workload


class SweepAborted(ServebookError):
    """The server failed or stalled during the sweep; results so far are saved."""


@dataclass
class SweepConfig:
    workload: Workload = field(default_factory=Workload)
    max_concurrency: int = 256
    start_concurrency: int = 1
    repeats: int = 2
    prompts_per_level: int = 64  # measured requests per repeat (at least 4 x the concurrency)
    warmup: int = 0  # 0: as many as the concurrency
    plateau_gain: float = 0.05
    objectives: metrics.Objectives = field(default_factory=metrics.Objectives)
    request_timeout_s: float = 600.0
    reset_prefix_cache: bool = True

    def levels(self) -> list[int]:
        out, c = [], self.start_concurrency
        while c <= self.max_concurrency:
            out.append(c)
            c *= 2
        return out

    def measured_requests(self, concurrency: int) -> int:
        return max(self.prompts_per_level, 4 * concurrency)


class MetricsSampler:
    """Polls ``/metrics`` during a level for peaks of KV-cache usage, running and waiting requests."""

    def __init__(self, url: str, every_s: float = 0.5):
        self.url, self.every_s = url, every_s
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=2.0) as http:
            while not self._stop.wait(self.every_s):
                try:
                    values = client.parse_metrics(http.get(f"{self.url}/metrics").text)
                except httpx.HTTPError:
                    continue
                for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "vllm:num_requests_running",
                             "vllm:num_requests_waiting"):
                    if name in values:
                        key = name.removeprefix("vllm:").replace("gpu_cache", "kv_cache")
                        self.peaks[key] = max(self.peaks.get(key, 0.0), values[name])

    def __enter__(self) -> "MetricsSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _scrape(url: str) -> dict[str, float]:
    try:
        return client.metrics(url)
    except httpx.HTTPError:
        return {}


def reset_prefix_cache(url: str, headers: dict[str, str]) -> str:
    """'reset', or why not: vLLM serves the endpoint only with VLLM_SERVER_DEV_MODE=1."""
    try:
        r = httpx.post(f"{url}/reset_prefix_cache", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        return f"failed: {exc}"
    if r.status_code == 200:
        return "reset"
    if r.status_code == 404:
        return "unavailable (start the server with VLLM_SERVER_DEV_MODE=1 to allow it)"
    return f"failed: http {r.status_code}"


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


def objective_broken(level: dict[str, Any], objectives: metrics.Objectives) -> str:
    """Which objective the level's median request misses, if any."""
    checks = [("TTFT", objectives.ttft_ms, level.get("ttft_p50")), ("TPOT", objectives.tpot_ms, level.get("tpot_p50")),
              ("E2EL", objectives.e2el_ms, level.get("e2el_p50"))]
    for name, limit, value in checks:
        if limit > 0 and value is not None and value * 1000 > limit:
            return f"median {name} {value * 1000:.0f} ms exceeds the {limit:.0f} ms objective"
    return ""


def _level_row(concurrency: int, repeat: int, summary: dict[str, Any], before: dict[str, float],
               after: dict[str, float], peaks: dict[str, float], reset: str) -> dict[str, Any]:
    row = {"concurrency": concurrency, "repeat": repeat, **{k: v for k, v in summary.items() if not isinstance(v, dict)}}
    row["errors"] = ", ".join(f"{k}: {v}" for k, v in summary["errors"].items())
    row["input_len_mismatches"] = summary["length_mismatches"]["input"]
    row["output_len_mismatches"] = summary["length_mismatches"]["output"]
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    row["preemptions"] = delta("vllm:num_preemptions_total")
    row["prefix_cache_hits"] = delta("vllm:prefix_cache_hits_total")
    row["kv_cache_usage_peak"] = peaks.get("kv_cache_usage_perc")
    row["running_peak"] = peaks.get("num_requests_running")
    row["waiting_peak"] = peaks.get("num_requests_waiting")
    row["prefix_cache_reset"] = reset
    return row


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per concurrency: medians over repeats, and the spread of output throughput."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        reps = [r for r in rows if r["concurrency"] == c]
        tps = [r["output_throughput"] for r in reps]
        med = statistics.median(tps)
        level: dict[str, Any] = {"concurrency": c, "repeats": len(reps), "output_throughput": med,
                                 "output_throughput_min": min(tps), "output_throughput_max": max(tps),
                                 "spread_pct": 100 * (max(tps) - min(tps)) / med if med else None}
        for key in ("total_throughput", "request_throughput", "per_user_tok_s", "goodput", "ttft_p50", "ttft_p90",
                    "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "itl_p50", "itl_p99", "e2el_p50", "e2el_p99",
                    "client_queue_p50", "kv_cache_usage_peak", "running_peak", "waiting_peak"):
            values = [r[key] for r in reps if r.get(key) is not None]
            level[key] = statistics.median(values) if values else None
        level["failed"] = sum(r["failed"] for r in reps)
        level["preemptions"] = sum(r["preemptions"] for r in reps)
        out.append(level)
    return out


def sweep(url: str, model: str, model_path: str, cfg: SweepConfig, out_dir: Path,
          headers: dict[str, str] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the sweep; write per-request and per-level tables; return the summary (also on failure)."""
    headers = headers or {}
    out_dir.mkdir(parents=True, exist_ok=True)
    maker = loadgen.PromptMaker(loadgen.load_tokenizer(model_path), cfg.workload.seed)
    records: list[loadgen.RequestRecord] = []
    rows: list[dict[str, Any]] = []
    stop_reason, fault = "max_concurrency reached", ""
    throughputs: list[float] = []
    done_levels: list[int] = []
    content_len = cfg.workload.input_len
    if cfg.workload.endpoint == "chat":  # the template's tokens count towards the prompt
        content_len -= maker.chat_overhead()
    for c in cfg.levels():
        for rep in range(cfg.repeats):
            warm = cfg.warmup or c
            prompts = maker.prompts(cfg.measured_requests(c) + warm, content_len, cfg.workload.shared_prefix_len)
            reset = reset_prefix_cache(url, headers) if cfg.reset_prefix_cache else "not requested"
            before = _scrape(url)
            with MetricsSampler(url) as sampler:
                recs, _, _ = loadgen.run_level(url, model, cfg.workload, prompts, c, f"c{c}r{rep}", warm,
                                               cfg.request_timeout_s, headers)
            after = _scrape(url)
            for r in recs:
                r.level = f"c{c}r{rep}"
            records += recs
            summary = metrics.summarize(recs, cfg.objectives)
            row = _level_row(c, rep, summary, before, after, sampler.peaks, reset)
            rows.append(row)
            log(f"concurrency {c:4d} repeat {rep + 1}: {row['output_throughput']:8.1f} output tok/s, "
                f"TTFT p50 {1000 * (row['ttft_p50'] or 0):7.1f} ms, TPOT p50 {1000 * (row['tpot_p50'] or 0):6.1f} ms"
                + (f", {row['failed']} failed ({row['errors']})" if row["failed"] else ""))
            if row["failed"]:
                health = client_health(url)
                if health != "ready" or row["failed"] == row["requests"]:
                    fault = (f"the server {'stopped answering' if health != 'ready' else 'failed every request'} at "
                             f"concurrency {c} ({row['errors']}); /health: {health}")
                    break
        if fault:
            stop_reason = "server fault"
            break
        level = aggregate([r for r in rows if r["concurrency"] == c])[0]
        done_levels.append(c)
        throughputs.append(level["output_throughput"])
        broken = objective_broken(level, cfg.objectives)
        if broken:
            stop_reason = f"latency objective broken at concurrency {c}: {broken}"
            break
        if plateau_reached(throughputs, cfg.plateau_gain):
            stop_reason = f"plateau: under {cfg.plateau_gain:.0%} gain over the last two doublings"
            break
    per_level = aggregate(rows)
    loadgen.save_records(records, out_dir / "05_benchmark_requests")
    import pandas as pd

    for name, table in (("05_benchmark_runs", rows), ("05_benchmark_levels", per_level)):
        frame = pd.DataFrame(table)
        frame.to_parquet(out_dir / f"{name}.parquet", index=False)
        frame.to_csv(out_dir / f"{name}.csv", index=False)
    best = max(per_level, key=lambda l: l["output_throughput"]) if per_level else None
    single = next((l for l in per_level if l["concurrency"] == 1), None)
    mismatches = {"input": sum(r["input_len_mismatches"] for r in rows), "output": sum(r["output_len_mismatches"] for r in rows)}
    return {
        "url": url,
        "model": model,
        "config": asdict(cfg),
        "levels": per_level,
        "runs": rows,
        "stop_reason": stop_reason,
        "fault": fault,
        "plateau_concurrency": plateau_level(done_levels, throughputs, cfg.plateau_gain) if done_levels else None,
        "best": {"concurrency": best["concurrency"], "output_throughput": best["output_throughput"]} if best else None,
        "single_stream": {"output_throughput": single["output_throughput"], "per_user_tok_s": single["per_user_tok_s"],
                          "ttft_p50": single["ttft_p50"], "tpot_p50": single["tpot_p50"]} if single else None,
        "length_mismatches": mismatches,
        "warnings": ([f"{mismatches['output']} requests returned a different number of tokens than asked "
                      "(the server ignored ignore_eos or max_tokens)"] if mismatches["output"] else [])
                    + ([f"{mismatches['input']} prompts were counted differently by the server than by the tokenizer"]
                       if mismatches["input"] else []),
        "files": {"requests": "05_benchmark_requests.parquet", "runs": "05_benchmark_runs.parquet",
                  "levels": "05_benchmark_levels.parquet"},
    }


def client_health(url: str) -> str:
    from servebook.server import health

    return health(url)
