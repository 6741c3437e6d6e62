"""Benchmark requests from a dataset file, each with its own prompt and output length.

Two layouts, as ``vllm bench serve`` reads them (vllm/benchmarks/datasets.py):

- **ShareGPT** (``--dataset-name sharegpt``): a JSON list of records whose ``conversations`` alternate
  ``{"from": "human", "value": ...}`` and ``{"from": "gpt", "value": ...}``; the first turn is the prompt and
  the answer's length in tokens is the request's output length.  Records with fewer than two turns are skipped,
  as vLLM skips them.
- **custom JSONL** (``--dataset-name custom``): one JSON object per line with a ``prompt``; an ``output_tokens``
  field, where present, sets that request's output length (else ``bench_output_len``).

Everything is checked before a request is sent: the file must exist and parse, every record must have the
fields its layout needs, and no prompt with its output may exceed ``max_model_len``; the first bad record is
named.  Output lengths above ``bench_output_len`` are capped to it, and the cap is counted and reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from servebook.errors import DatasetError

Format = Literal["auto", "sharegpt", "jsonl"]
__all__ = ["DatasetError", "Dataset", "Prompt", "check", "load"]


@dataclass
class Prompt:
    text: str
    input_len: int  # tokens the server will count (with special tokens; with the chat template on chat)
    output_len: int


@dataclass
class Dataset:
    path: str
    format: str
    prompts: list[Prompt]
    skipped: int = 0  # ShareGPT records without an answer
    capped: int = 0  # output lengths cut to the cap
    output_cap: int = 0
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        ins = [p.input_len for p in self.prompts]
        outs = [p.output_len for p in self.prompts]
        text = (
            f"{len(self.prompts)} requests from {Path(self.path).name} ({self.format}): prompts {min(ins)}-{max(ins)} "
            f"tokens (mean {sum(ins) / len(ins):.0f}), outputs {min(outs)}-{max(outs)} (mean {sum(outs) / len(outs):.0f})"
        )
        if self.capped:
            text += f"; {self.capped} outputs capped at {self.output_cap} tokens"
        if self.skipped:
            text += f"; {self.skipped} records without an answer skipped"
        return text


def _records(path: Path, fmt: Format) -> tuple[str, list[tuple[str, Any]]]:
    """(layout, [(where, record)]) with ``where`` naming each record for messages."""
    if not path.is_file():
        raise DatasetError(f"bench_dataset: no file {path}; give the path of a ShareGPT JSON or a JSONL file")
    text = path.read_text(errors="replace")
    if fmt == "auto":
        fmt = "sharegpt" if text.lstrip().startswith("[") else "jsonl"
    if fmt == "sharegpt":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"bench_dataset {path}: not valid JSON ({exc}); a ShareGPT file is one JSON list"
            ) from exc
        if not isinstance(data, list):
            raise DatasetError(
                f"bench_dataset {path}: a ShareGPT file is a JSON list of records, this is a {type(data).__name__}"
            )
        return fmt, [(f"record {i}", rec) for i, rec in enumerate(data)]
    out = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((f"line {n}", json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DatasetError(
                f"bench_dataset {path}, line {n}: not a JSON object ({exc}); JSONL holds one per line"
            ) from exc
    return fmt, out


def _check_fields(path: Path, layout: str, where: str, rec: Any) -> None:
    if layout == "sharegpt":
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list) or not all(
            isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns
        ):
            raise DatasetError(
                f"bench_dataset {path}, {where}: no 'conversations' list of {{'from', 'value'}} turns; "
                "fix that record or remove it"
            )
        return
    if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
        raise DatasetError(f"bench_dataset {path}, {where}: no 'prompt' string; every line needs one")
    wanted = rec.get("output_tokens", 1)
    if not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1:
        raise DatasetError(f"bench_dataset {path}, {where}: output_tokens must be a positive integer, not {wanted!r}")


def check(path: str | Path, fmt: Format = "auto") -> None:
    """The checks that need no tokenizer (the file, its layout, every record's fields): for params validation,
    before a server starts."""
    path = Path(path).expanduser()
    layout, records = _records(path, fmt)
    for where, rec in records:
        _check_fields(path, layout, where, rec)
    if not records:
        raise DatasetError(f"bench_dataset {path}: the file holds no records")


def load(
    path: str | Path,
    tokenizer: Any,
    *,
    max_model_len: int,
    output_len: int,
    fmt: Format = "auto",
    chat_overhead: int = 0,
    limit: int = 0,
) -> Dataset:
    """Every usable request of the file (the first ``limit`` when > 0), checked as the module says."""
    path = Path(path).expanduser()
    layout, records = _records(path, fmt)
    prompts: list[Prompt] = []
    skipped = capped = 0
    for where, rec in records:
        _check_fields(path, layout, where, rec)
        if layout == "sharegpt":
            turns = rec["conversations"]
            if len(turns) < 2:
                skipped += 1
                continue
            text, wanted = turns[0]["value"], len(tokenizer.encode(turns[1]["value"], add_special_tokens=False))
        else:
            text, wanted = rec["prompt"], rec.get("output_tokens", output_len)
        out = max(min(wanted, output_len), 1)
        capped += wanted > output_len
        n_in = len(tokenizer.encode(text)) + chat_overhead
        if n_in + out > max_model_len:
            raise DatasetError(
                f"bench_dataset {path}, {where}: its prompt ({n_in} tokens) and output ({out}) exceed max_model_len "
                f"{max_model_len}; raise max_model_len, lower bench_output_len, or drop the record"
            )
        prompts.append(Prompt(text, n_in, out))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise DatasetError(f"bench_dataset {path}: no usable request in {len(records)} records")
    return Dataset(str(path), layout, prompts, skipped, capped, output_len)


class Cursor:
    """Hands out a dataset's requests in order, from the start again once all have been sent."""

    def __init__(self, prompts: list[Prompt]):
        self.prompts, self.position = prompts, 0

    def take(self, count: int) -> list[Prompt]:
        out = [self.prompts[(self.position + i) % len(self.prompts)] for i in range(count)]
        self.position += count
        return out
