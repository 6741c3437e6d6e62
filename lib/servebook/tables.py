"""Every table a measurement writes, one way: parquet for code, CSV beside it for people, and each run also as
``vllm bench serve``'s result JSON, so its tools read servebook's runs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from servebook import files, vllm_format
from servebook.loadgen import RequestRecord, records_frame
from servebook.metrics import Objectives


def write(rows: Sequence[Mapping[str, Any]], path: Path) -> str:
    """``path``.parquet and ``path``.csv from rows of scalars; returns the parquet file's name."""
    import pandas as pd

    return _write_frame(pd.DataFrame(list(rows)), path)


def write_requests(records: list[RequestRecord], path: Path) -> str:
    """Every request's timeline, one row each (its chunk times relative to its send)."""
    return _write_frame(records_frame(records), path)


def _write_frame(frame: Any, path: Path) -> str:
    """A frame as parquet and CSV, each whole or not at all."""
    files.write_with(path.with_suffix(".parquet"), lambda tmp: frame.to_parquet(tmp, index=False))
    files.write_with(path.with_suffix(".csv"), lambda tmp: frame.to_csv(tmp, index=False))
    return path.with_suffix(".parquet").name


class RunShape(NamedTuple):
    """What a run was, as ``vllm bench serve`` records it."""

    max_concurrency: int | None
    request_rate: float | None = None  # None: as fast as the concurrency allows
    burstiness: float = 1.0


def write_vllm_results(
    runs: Mapping[str, tuple[list[RequestRecord], RunShape]],
    folder: Path,
    *,
    model: str,
    tokenizer: str,
    endpoint: str,
    objectives: Objectives,
) -> str:
    """One ``vllm bench serve --save-result`` file per run: label -> (its records, what the run was)."""
    for label, (records, shape) in runs.items():
        result = vllm_format.result_json(
            records, model=model, tokenizer=tokenizer, endpoint=endpoint, label=label, objectives=objectives,
            **shape._asdict(),
        )  # fmt: skip
        vllm_format.write(result, folder / f"{label}.json")
    return folder.name
