"""Stage 04: does the launched server answer, correctly and deterministically, and how fast is one stream?"""

from __future__ import annotations

from pathlib import Path

from servebook import client, results
from servebook.params import Params
from servebook.records import LaunchRecord, SmokeTestRecord


def run(p: Params, run_dir: str | Path) -> SmokeTestRecord:
    run_dir = results.run_folder(run_dir)
    launch = results.require(run_dir, LaunchRecord, "smoke_test")
    found = client.smoke_test(launch.config.target(timeout_s=120), p.smoke_max_tokens)
    record = SmokeTestRecord(**dict(found))
    results.write(run_dir, record)
    return record


def check(record: SmokeTestRecord, p: Params) -> None:
    client.raise_on_failure(record)


def summary(record: SmokeTestRecord) -> str:
    s = record.stream
    decode = f", decode {s.decode_tok_s:.0f} tok/s" if s.decode_tok_s else ""
    verdict = "passed" if record.passed else f"**failed**: {record.failed()[0].check}"
    return f"{verdict}; one stream: TTFT {s.ttft_ms:.0f} ms{decode}"
