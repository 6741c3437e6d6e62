"""Benchmark figures (plotly) and the comparison of several runs on shared axes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots


def _levels(data: dict[str, Any] | pd.DataFrame) -> pd.DataFrame:
    return data if isinstance(data, pd.DataFrame) else pd.DataFrame(data["levels"])


def throughput(bench: dict[str, Any], name: str = "") -> go.Figure:
    """Output tok/s against concurrency, with each repeat's spread and the plateau marked."""
    lv = _levels(bench)
    fig = go.Figure(go.Scatter(
        x=lv["concurrency"], y=lv["output_throughput"], mode="lines+markers", name=name or "output tok/s",
        error_y=dict(type="data", symmetric=False, array=lv["output_throughput_max"] - lv["output_throughput"],
                     arrayminus=lv["output_throughput"] - lv["output_throughput_min"])))
    plateau = bench.get("plateau_concurrency")
    if plateau:
        fig.add_vline(x=plateau, line_dash="dash", annotation_text=f"plateau from c={plateau}")
    fig.update_xaxes(type="log", title="concurrent streams", tickvals=list(lv["concurrency"]))
    fig.update_yaxes(title="output tokens/s", rangemode="tozero")
    fig.update_layout(title="Throughput against concurrency", height=420)
    return fig


def pareto(bench: dict[str, Any]) -> go.Figure:
    """Per-user speed against total throughput: what each user gets for the server's total."""
    lv = _levels(bench)
    fig = go.Figure(go.Scatter(x=lv["output_throughput"], y=lv["per_user_tok_s"], mode="lines+markers+text",
                               text=[f"c={c}" for c in lv["concurrency"]], textposition="top center"))
    fig.update_xaxes(title="total output tokens/s", rangemode="tozero")
    fig.update_yaxes(title="per-user tokens/s (1 / median TPOT)", rangemode="tozero")
    fig.update_layout(title="Per-user speed against total throughput", height=420)
    return fig


def latency(bench: dict[str, Any]) -> go.Figure:
    """TTFT and TPOT percentiles against concurrency."""
    lv = _levels(bench)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token", "time per output token"))
    for col, metric in ((1, "ttft"), (2, "tpot")):
        for p, dash in (("p50", "solid"), ("p90", "dot"), ("p99", "dash")):
            key = f"{metric}_{p}"
            if key in lv:
                fig.add_trace(go.Scatter(x=lv["concurrency"], y=lv[key] * 1000, name=f"{metric.upper()} {p}",
                                         line=dict(dash=dash)), row=1, col=col)
        fig.update_xaxes(type="log", title="concurrent streams", tickvals=list(lv["concurrency"]), row=1, col=col)
        fig.update_yaxes(title="ms", rangemode="tozero", row=1, col=col)
    fig.update_layout(title="Latency percentiles against concurrency", height=420)
    return fig


def load_run(run_dir: str | Path) -> tuple[str, pd.DataFrame]:
    """A run's per-level table and a label naming its layout."""
    run_dir = Path(run_dir)
    levels = pd.read_parquet(run_dir / "05_benchmark_levels.parquet")
    label = run_dir.name
    launch = run_dir / "03_launch.json"
    if launch.is_file():
        cmd = json.loads(launch.read_text()).get("command", [])
        parts = []
        for flag, short in (("--tensor-parallel-size", "TP"), ("--pipeline-parallel-size", "PP"), ("--data-parallel-size", "DP")):
            if flag in cmd:
                parts.append(f"{short}={cmd[cmd.index(flag) + 1]}")
        if "--enable-expert-parallel" in cmd:
            parts.append("EP")
        label = f"{'+'.join(parts) or 'TP=1'} ({run_dir.name})"
    return label, levels


def crossover(a: pd.DataFrame, b: pd.DataFrame, metric: str = "output_throughput") -> int | None:
    """The lowest shared concurrency from which the run that was behind is ahead; None if order never flips."""
    merged = a[["concurrency", metric]].merge(b[["concurrency", metric]], on="concurrency", suffixes=("_a", "_b"))
    merged = merged.sort_values("concurrency")
    sign = (merged[f"{metric}_a"] - merged[f"{metric}_b"]).apply(lambda d: (d > 0) - (d < 0)).tolist()
    for i in range(1, len(sign)):
        if sign[i] != 0 and sign[i] != sign[0] and sign[0] != 0:
            return int(merged["concurrency"].iloc[i])
    return None


def compare(run_dirs: list[str | Path]) -> tuple[go.Figure, list[dict[str, Any]]]:
    """Throughput, per-user speed and TTFT of several runs on shared axes, and every pairwise crossover."""
    runs = [load_run(d) for d in run_dirs]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("output tok/s", "per-user tok/s", "TTFT p50 (ms)"))
    for label, lv in runs:
        for col, key, scale in ((1, "output_throughput", 1), (2, "per_user_tok_s", 1), (3, "ttft_p50", 1000)):
            fig.add_trace(go.Scatter(x=lv["concurrency"], y=lv[key] * scale, name=label, legendgroup=label,
                                     showlegend=col == 1), row=1, col=col)
    for col in (1, 2, 3):
        fig.update_xaxes(type="log", title="concurrent streams", row=1, col=col)
    crossings = []
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            c = crossover(runs[i][1], runs[j][1])
            crossings.append({"a": runs[i][0], "b": runs[j][0], "crossover_concurrency": c})
            if c:
                fig.add_vline(x=c, line_dash="dot", row=1, col=1, annotation_text=f"crossover c={c}")
    fig.update_layout(title="Runs compared", height=450)
    return fig, crossings
