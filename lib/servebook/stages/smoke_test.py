"""Stage 04: does the launched server answer, correctly and deterministically, and how fast is one stream?"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from servebook import client, results
from servebook.params import Params
from servebook.records import LaunchRecord, SmokeTestRecord


def run(p: Params, run_dir: str | Path) -> SmokeTestRecord:
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, SmokeTestRecord)  # a rerun never leaves the last attempt's record looking current
    launch = results.require(run_dir, LaunchRecord, "smoke_test")
    launch.require_answering("smoke_test")
    found = client.smoke_test(launch.target(timeout_s=120), p.smoke_max_tokens)
    record = SmokeTestRecord(**dict(found))
    results.write(run_dir, record)
    return record


def check(record: SmokeTestRecord, p: Params) -> None:
    client.raise_on_failure(record)


def stream_text(s: client.StreamTiming) -> str:
    """One stream's figures for a person: the engine's decode speed, and the client's beside it where they
    differ (the API server delivered the answer in bursts)."""
    engine = f"{s.decode_tok_s:.1f} tok/s" if s.decode_tok_s else "n/a"
    source = "by vLLM's own clock" if s.vllm_tpot_ms else "as the client saw it (vLLM's clock not read)"
    burst = (
        f"; delivered in bursts: {s.client_decode_tok_s:,.0f} tok/s as the client saw it, so the client's speed "
        "is the API server's delivery, not the engine's"
        if s.delivery_bound and s.client_decode_tok_s
        else ""
    )
    return (
        f"time to first token {s.ttft_ms:.0f} ms; decode {engine} {source}{burst}; {s.completion_tokens} tokens in "
        f"{s.e2el_ms / 1000:.2f} s end to end ({s.end_to_end_tok_s:.1f} tok/s, {s.chunks} chunks)"
    )


def summary(record: SmokeTestRecord) -> str:
    s = record.stream
    decode = f", decode {s.decode_tok_s:.0f} tok/s" if s.decode_tok_s else ""
    if s.delivery_bound:
        decode += f" by vLLM's clock (delivered in bursts: {s.client_decode_tok_s:,.0f} tok/s as the client saw it)"
    verdict = "passed" if record.passed else f"**failed**: {record.failed()[0].check}"
    if warned := record.warnings():
        verdict += f", with a warning: {warned[0].check} — no ({warned[0].detail})"
    return f"{verdict}; one stream: TTFT {s.ttft_ms:.0f} ms{decode}"


def checks_table(record: SmokeTestRecord) -> pd.DataFrame:
    """Each check with its result in words (passed, a warning, failed) and what it saw."""
    rows = [
        {"check": c.check, "result": "passed" if c.ok else ("warning" if c.warning else "failed"), "detail": c.detail}
        for c in record.checks
    ]
    return pd.DataFrame(rows).set_index("check") if rows else pd.DataFrame()


def gauges_table(record: SmokeTestRecord) -> pd.DataFrame:
    """vLLM's gauges and counters after the test, counts as whole numbers."""
    shown = {name: int(v) if isinstance(v, float) and v.is_integer() else v for name, v in record.metrics.items()}
    return pd.DataFrame({"value": list(shown.values())}, index=pd.Index(list(shown), name="metric"), dtype=object)
