"""Benchmark results in the layout of ``vllm bench serve --save-result``, both ways.

Every measured run of a sweep is also written as the JSON ``vllm bench serve`` saves (its field names and
units: vllm/benchmarks/serve.py, ``benchmark()``'s result dict and ``calculate_metrics``), so that tools
built for vLLM's results read servebook's; and ``servebook compare`` reads vLLM's files beside servebook runs.
Metrics follow vLLM's definitions: TTFT to the first chunk carrying choices, TPOT per request as
(E2EL - TTFT) / (output tokens - 1), ITL as the gaps between chunks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd

from servebook import files, metrics
from servebook.errors import ServebookError
from servebook.json_types import JsonObject
from servebook.loadgen import RequestRecord

PERCENTILES = (50, 90, 99)  # vllm bench serve's default --metric-percentiles are "99"; these three cover it
REQUIRED = ("completed", "duration", "output_throughput", "median_ttft_ms", "median_tpot_ms")


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds, dtype=float) * 1000 if seconds else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    out.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def _peaks(ok: list[RequestRecord]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s (tokens per whole second of the run) and max_concurrent_requests."""
    if not ok:
        return 0.0, 0
    start = min(r.send for r in ok)
    seconds = np.concatenate([np.floor(np.asarray(r.chunk_times) - start) for r in ok if r.chunk_times])
    tokens = np.concatenate([np.asarray(r.chunk_tokens, dtype=float) for r in ok if r.chunk_times])
    per_second = np.bincount(seconds.astype(int), weights=tokens) if seconds.size else np.zeros(1)
    events = sorted([(r.send, 1) for r in ok] + [(r.end or r.send, -1) for r in ok])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return float(per_second.max()), peak


def result_json(
    records: list[RequestRecord],
    *,
    model: str,
    tokenizer: str,
    endpoint: str,
    max_concurrency: int | None,
    request_rate: float | None = None,
    burstiness: float = 1.0,
    label: str = "",
    objectives: metrics.Objectives | None = None,
) -> JsonObject:
    """One run's measured requests as ``vllm bench serve --save-result`` writes them."""
    measured = [r for r in records if not r.warmup]
    ok = [r for r in measured if r.ok]
    s = metrics.summarize(measured, objectives)
    max_tokens_per_s, max_concurrent = _peaks(ok)
    out: JsonObject = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if endpoint == "chat" else "openai",
        "backend": "servebook",
        "label": label,
        "model_id": model,
        "tokenizer_id": tokenizer,
        "num_prompts": len(measured),
        "request_rate": request_rate if request_rate is not None else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration": s.duration_s,
        "completed": s.completed,
        "failed": s.failed,
        "total_input_tokens": s.input_tokens,
        "total_output_tokens": s.output_tokens,
        "request_throughput": s.request_throughput,
        "request_goodput": s.goodput,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_throughput,
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
    }
    out.update(_stats("ttft", [metrics.ttft(r) for r in ok]))
    out.update(_stats("tpot", [t for r in ok if (t := metrics.tpot(r)) is not None]))
    out.update(_stats("itl", [g for r in ok for g in metrics.itl_per_chunk(r)]))
    out.update(_stats("e2el", [metrics.e2el(r) for r in ok]))
    return out


def write(result: JsonObject, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, json.dumps(result, indent=1))


def read(path: Path) -> JsonObject:
    """A result file of ``vllm bench serve --save-result`` (or servebook's copy), checked for what compare needs."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ServebookError(
            f"{path}: not a readable JSON file ({exc}); pass a file `vllm bench serve --save-result` wrote"
        ) from exc
    missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
    if missing:
        raise ServebookError(
            f"{path}: not a `vllm bench serve --save-result` file (no {', '.join(missing)}); pass such a file, a "
            "folder of them, or a servebook run folder"
        )
    return data


def levels(results: list[JsonObject]) -> pd.DataFrame:
    """vLLM results as servebook's per-level table (the columns compare plots), one row per concurrency."""
    rows = []
    for r in results:
        concurrency = r.get("max_concurrency") or r["completed"]  # without a cap every request ran at once
        tpot = r["median_tpot_ms"]
        rows.append(
            {
                "concurrency": int(concurrency),
                "output_throughput": float(r["output_throughput"]),
                "per_user_tok_s": 1000.0 / tpot if tpot else None,
                "ttft_p50_ms": float(r["median_ttft_ms"]),
                "tpot_p50_ms": float(tpot),
            }
        )
    frame = pd.DataFrame(rows)
    # several files at one concurrency (repeats): their median, as servebook's levels are
    return frame.groupby("concurrency", as_index=False).median().sort_values("concurrency")
