"""Serving metrics, defined once, named as vLLM names them.

All times are client-side, in seconds, measured from when a request left the client
(``send``), after any wait for a concurrency slot; that wait is reported separately
as ``client_queue``.

=================  ==========================================================================
TTFT               first content chunk − send
E2EL               last content chunk − send (the trailing usage chunk and ``[DONE]`` ignored)
TPOT               (E2EL − TTFT) / (output tokens − 1), per request; requests with ≤ 1 token have none
ITL (per chunk)    the gap between consecutive content chunks, one value per gap (vLLM's ITL)
ITL (per token)    each gap divided by the tokens its chunk carried, one value per token; differs from
                   the per-chunk ITL when the server bundles tokens (speculative decoding, MTP)
client queue       send − arrival: time the client held a ready request back for a free slot
output throughput  Σ output tokens of successful requests / duration
total throughput   Σ (input + output) tokens of successful requests / duration
request throughput successful requests / duration
duration           last response − first send, over the measured (non-warm-up) requests
goodput            requests meeting every objective (TTFT, TPOT, E2EL ≤ limits) / duration
percentiles        p50, p90, p95, p99 with linear interpolation (numpy's default, as vLLM);
                   the ``*_all`` variants count each failed request as infinitely slow
=================  ==========================================================================

Peer naming traps: GuideLLM's and AIPerf's "ITL" is this TPOT; GuideLLM's "TPOT" includes TTFT.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from servebook.loadgen import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass
class Objectives:
    """Latency objectives in milliseconds; 0 means none."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2el_ms: float = 0.0

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = [(self.ttft_ms, ttft(r)), (self.tpot_ms, tpot(r) or 0.0), (self.e2el_ms, e2el(r))]
        return all(limit <= 0 or value * 1000 <= limit for limit, value in checks)

    @property
    def any(self) -> bool:
        return any(v > 0 for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def ttft(r: RequestRecord) -> float:
    return r.first_chunk - r.send


def e2el(r: RequestRecord) -> float:
    return r.end - r.send


def output_tokens(r: RequestRecord) -> int:
    return r.completion_tokens if r.completion_tokens is not None else sum(r.chunk_tokens)


def tpot(r: RequestRecord) -> float | None:
    n = output_tokens(r)
    return (e2el(r) - ttft(r)) / (n - 1) if n > 1 else None


def itl_per_chunk(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def itl_per_token(r: RequestRecord) -> list[float]:
    out: list[float] = []
    for gap, tokens in zip(itl_per_chunk(r), r.chunk_tokens[1:]):
        out.extend([gap / tokens] * tokens if tokens > 0 else [])
    return out


def percentiles(values: Iterable[float], failed: int = 0, prefix: str = "") -> dict[str, float | None]:
    """p50..p99 and the mean; with ``failed`` > 0, also ``*_all`` counting failures as +inf."""
    arr = np.asarray(list(values), dtype=float)
    out: dict[str, float | None] = {}
    out[f"{prefix}mean"] = float(arr.mean()) if arr.size else None
    for p in PERCENTILES:
        out[f"{prefix}p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    if failed:
        full = np.concatenate([arr, np.full(failed, np.inf)])
        for p in PERCENTILES:
            value = float(np.percentile(full, p, method="higher"))
            out[f"{prefix}p{p}_all"] = None if math.isinf(value) else value
    return out


def error_kinds(records: list[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error.split(":", 1)[0] for r in records if r.error))


def length_mismatches(records: list[RequestRecord]) -> dict[str, int]:
    """Successful requests whose server-counted lengths differ from what was asked."""
    ok = [r for r in records if r.ok]
    return {
        "input": sum(1 for r in ok if r.prompt_tokens is not None and r.prompt_tokens != r.expected_input),
        "output": sum(1 for r in ok if output_tokens(r) != r.expected_output),
        "checked": len(ok),
    }


def summarize(records: list[RequestRecord], objectives: Objectives | None = None) -> dict[str, float | int | None | dict]:
    """Every metric above for the measured (non-warm-up) requests of one run."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    failed = len(measured) - len(ok)
    if ok:
        start = min(r.send for r in measured)
        duration = max(r.end for r in ok) - start
    else:
        duration = 0.0
    out_tokens = sum(output_tokens(r) for r in ok)
    in_tokens = sum(r.prompt_tokens or r.expected_input for r in ok)
    per = lambda x: x / duration if duration > 0 else 0.0  # noqa: E731
    summary: dict = {
        "requests": len(measured),
        "completed": len(ok),
        "failed": failed,
        "errors": error_kinds(measured),
        "duration_s": duration,
        "output_tokens": out_tokens,
        "input_tokens": in_tokens,
        "output_throughput": per(out_tokens),
        "total_throughput": per(out_tokens + in_tokens),
        "request_throughput": per(len(ok)),
        "length_mismatches": length_mismatches(measured),
    }
    summary.update(percentiles([ttft(r) for r in ok], failed, "ttft_"))
    summary.update(percentiles([t for r in ok if (t := tpot(r)) is not None], failed, "tpot_"))
    summary.update(percentiles([g for r in ok for g in itl_per_chunk(r)], 0, "itl_"))
    summary.update(percentiles([g for r in ok for g in itl_per_token(r)], 0, "itl_token_"))
    summary.update(percentiles([e2el(r) for r in ok], failed, "e2el_"))
    summary.update(percentiles([r.send - r.arrival for r in measured], 0, "client_queue_"))
    tpot_p50 = summary.get("tpot_p50")
    summary["per_user_tok_s"] = 1.0 / tpot_p50 if tpot_p50 else None
    if objectives and objectives.any:
        good = sum(1 for r in measured if objectives.met_by(r))
        summary["goodput"] = per(good)
        summary["goodput_share"] = good / len(measured) if measured else 0.0
    return summary
