"""Serving metrics, defined once, named as vLLM names them.

Timelines are client-side, in seconds on the client's monotonic clock, measured from when
a request left the client (``send``), after any wait for a concurrency slot; that wait is
reported separately as ``client_queue``.  Summaries report every latency in milliseconds and
say so in the name (``ttft_ms.p50``, ``ttft_p50_ms`` in tables), as vLLM's benchmark does;
throughputs are tokens (or requests) per second.

=================  ==========================================================================
TTFT               first chunk carrying ``choices`` − send (its text may be empty: a special token, or
                   bytes held back until a UTF-8 character is whole), exactly as vLLM's benchmark
E2EL               last chunk carrying ``choices`` − send (usage-only chunks and ``[DONE]`` ignored)
TPOT               (E2EL − TTFT) / (output tokens − 1), per request; requests with ≤ 1 token have none
ITL (per chunk)    the gap between consecutive token chunks, one value per gap (vLLM's ITL)
ITL (per token)    each gap divided by the tokens its chunk carried, one value per token; differs from
                   the per-chunk ITL when the server bundles tokens (speculative decoding, MTP)
client queue       send − arrival: time the client held a ready request back (open loop: past its scheduled
                   arrival, for a free slot; closed loop: a request is ready when its slot frees, so only
                   the client's own delay)
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
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel

from servebook.client import histogram_mean_ms
from servebook.loadgen import RequestRecord

PERCENTILES = (50, 90, 95, 99)


@dataclass
class Objectives:
    """Latency objectives in milliseconds; 0 means none."""

    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    e2el_ms: float = 0.0

    def __bool__(self) -> bool:
        """Whether any objective is set."""
        return bool(self.ttft_ms or self.tpot_ms or self.e2el_ms)

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        checks = [(self.ttft_ms, ttft(r)), (self.tpot_ms, tpot(r) or 0.0), (self.e2el_ms, e2el(r))]
        return all(limit <= 0 or value * 1000 <= limit for limit, value in checks)

    @property
    def any(self) -> bool:
        return any(v > 0 for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))


def ttft(r: RequestRecord) -> float:
    if r.first_chunk is None:
        raise ValueError(f"request {r.index} has no first chunk: only successful requests have a TTFT")
    return r.first_chunk - r.send


def e2el(r: RequestRecord) -> float:
    if r.end is None:
        raise ValueError(f"request {r.index} never ended: only successful requests have an E2EL")
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


class Percentiles(BaseModel):
    """Mean and percentiles of one latency, in milliseconds; ``*_all`` count failed requests as infinitely slow."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    p50_all: float | None = None
    p90_all: float | None = None
    p95_all: float | None = None
    p99_all: float | None = None


class LengthMismatches(BaseModel):
    input: int = 0
    output: int = 0
    checked: int = 0


LATENCIES = ("ttft", "tpot", "itl", "itl_token", "e2el", "client_queue")


class RunSummary(BaseModel):
    """Every metric above for the measured (non-warm-up) requests of one run."""

    requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # error kind -> count
    duration_s: float
    output_tokens: int
    input_tokens: int
    output_throughput: float  # tok/s
    total_throughput: float  # tok/s
    request_throughput: float  # requests/s
    length_mismatches: LengthMismatches
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    itl_token_ms: Percentiles
    e2el_ms: Percentiles
    client_queue_ms: Percentiles
    per_user_tok_s: float | None  # 1 / median TPOT
    goodput: float | None = None  # requests/s meeting every objective
    goodput_share: float | None = None

    def flat(self) -> dict[str, float | int | str | None]:
        """One table row: scalar fields as they are, latencies as ``ttft_p50_ms``, errors as text."""
        row: dict[str, float | int | str | None] = {
            k: v for k, v in self.model_dump().items() if not isinstance(v, dict)
        }
        row["errors"] = ", ".join(f"{k}: {v}" for k, v in self.errors.items())
        row["input_len_mismatches"] = self.length_mismatches.input
        row["output_len_mismatches"] = self.length_mismatches.output
        for name in LATENCIES:
            stats: Percentiles = getattr(self, f"{name}_ms")
            for stat, value in stats.model_dump().items():
                row[f"{name}_{stat}_ms"] = value
        return row


def percentiles(values: Iterable[float], failed: int = 0) -> Percentiles:
    """p50..p99 and the mean of latencies in seconds, returned in ms; with ``failed`` > 0 also ``*_all``."""
    arr = 1000 * np.asarray(list(values), dtype=float)
    out: dict[str, float | None] = {"mean": float(arr.mean()) if arr.size else None}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p)) if arr.size else None
    if failed:
        full = np.concatenate([arr, np.full(failed, np.inf)])
        for p in PERCENTILES:
            value = float(np.percentile(full, p, method="higher"))
            out[f"p{p}_all"] = None if math.isinf(value) else value
    return Percentiles(**out)


def error_kinds(records: list[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error.split(":", 1)[0] for r in records if r.error))


def length_mismatches(records: list[RequestRecord]) -> LengthMismatches:
    """Successful requests whose server-counted lengths differ from what was asked."""
    ok = [r for r in records if r.ok]
    return LengthMismatches(
        input=sum(
            1 for r in ok if r.prompt_tokens is not None and r.expected_input and r.prompt_tokens != r.expected_input
        ),
        output=sum(1 for r in ok if output_tokens(r) != r.expected_output),
        checked=len(ok),
    )


def summarize(records: list[RequestRecord], objectives: Objectives | None = None) -> RunSummary:
    """Every metric above for the measured (non-warm-up) requests of one run."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    failed = len(measured) - len(ok)
    duration = max(r.end for r in ok if r.end is not None) - min(r.send for r in measured) if ok else 0.0

    def per_second(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    out_tokens = sum(output_tokens(r) for r in ok)
    in_tokens = sum(r.prompt_tokens or r.expected_input for r in ok)
    tpot_ms = percentiles([t for r in ok if (t := tpot(r)) is not None], failed)
    good = sum(1 for r in measured if objectives.met_by(r)) if objectives and objectives.any else None
    return RunSummary(
        requests=len(measured),
        completed=len(ok),
        failed=failed,
        errors=error_kinds(measured),
        duration_s=duration,
        output_tokens=out_tokens,
        input_tokens=in_tokens,
        output_throughput=per_second(out_tokens),
        total_throughput=per_second(out_tokens + in_tokens),
        request_throughput=per_second(len(ok)),
        length_mismatches=length_mismatches(measured),
        ttft_ms=percentiles([ttft(r) for r in ok], failed),
        tpot_ms=tpot_ms,
        itl_ms=percentiles([g for r in ok for g in itl_per_chunk(r)]),
        itl_token_ms=percentiles([g for r in ok for g in itl_per_token(r)]),
        e2el_ms=percentiles([e2el(r) for r in ok], failed),
        client_queue_ms=percentiles([r.send - r.arrival for r in measured]),
        per_user_tok_s=1000.0 / tpot_ms.p50 if tpot_ms.p50 else None,
        goodput=per_second(good) if good is not None else None,
        goodput_share=(good / len(measured) if measured else 0.0) if good is not None else None,
    )


class EngineClock(BaseModel):
    """One window's mean TTFT and TPOT by vLLM's own clocks beside the client's, over the same requests.

    vLLM's come from its /metrics histograms, read before and after the window (``vllm/v1/metrics/stats.py``):
    its TTFT runs from when its engine client took the request in (after the API server parsed and rendered
    it) to when the API process handled the first token, so the client's TTFT is longer by the HTTP request,
    the stream's first write and the client's own reading; its TPOT divides the time between the engine
    core's first and last token of a request by the tokens after the first, counting a one-token request as 0
    ms. The client's means here are taken the same way over every request the window sent, warm-ups included,
    since vLLM's histograms cannot tell them apart; ``requests`` against ``vllm_requests`` says whether the
    server served anyone else meanwhile.
    """

    requests: int  # the client's successful requests in the window, warm-ups included
    vllm_requests: int  # requests vLLM's TTFT histogram counted in the window
    client_ttft_mean_ms: float | None
    vllm_ttft_mean_ms: float | None
    client_tpot_mean_ms: float | None
    vllm_tpot_mean_ms: float | None

    @property
    def same_requests(self) -> bool:
        return self.requests == self.vllm_requests

    @property
    def tpot_gap_pct(self) -> float | None:
        """How far the client's mean TPOT is from the engine's, in % of the engine's."""
        if self.client_tpot_mean_ms is None or not self.vllm_tpot_mean_ms:
            return None
        return 100 * (self.client_tpot_mean_ms / self.vllm_tpot_mean_ms - 1)


def engine_clock(records: list[RequestRecord], before: dict[str, float], after: dict[str, float]) -> EngineClock:
    """The window's means by vLLM's clocks (/metrics ``before`` and ``after`` it) and by the client's."""
    ok = [r for r in records if r.ok]
    vllm_requests, vllm_ttft = histogram_mean_ms("vllm:time_to_first_token_seconds", before, after)
    _, vllm_tpot = histogram_mean_ms("vllm:request_time_per_output_token_seconds", before, after)
    return EngineClock(
        requests=len(ok),
        vllm_requests=vllm_requests,
        client_ttft_mean_ms=1000 * float(np.mean([ttft(r) for r in ok])) if ok else None,
        vllm_ttft_mean_ms=vllm_ttft,
        client_tpot_mean_ms=1000 * float(np.mean([tpot(r) or 0.0 for r in ok])) if ok else None,
        vllm_tpot_mean_ms=vllm_tpot,
    )
