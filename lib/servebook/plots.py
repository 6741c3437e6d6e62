"""Benchmark figures (plotly) and several runs compared on shared axes.

Latencies are in milliseconds everywhere, as in the tables.  On a log x axis plotly places an
annotation's x in log10 units (a label at x=64 lands at 10^64 and squeezes every point into the left
edge), so every label on such an axis goes through :func:`_mark`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from servebook.bench import SweepResult
from servebook.levels import off_clock
from servebook.ratesweep import RateSweepResult
from servebook.startup import PHASES

LIMIT_LABELS = {
    "client": "client-bound",
    "batch": "batch limit",
    "kv_cache": "KV cache full",
    "api_server": "API-server-bound",
    "pcie": "PCIe-bound",
    "nvlink": "NVLink-bound",
    "power": "power-capped",
    "thermal": "thermal slowdown",
    "server": "server-bound",
    "decline": "declined",
    "noise": "within noise",
}


def _levels(result: SweepResult) -> pd.DataFrame:
    frame = pd.DataFrame([level.flat() for level in result.levels])
    frame["off_clock"] = [off_clock(level) for level in result.levels]
    return frame


def _mark(
    fig: go.Figure, x: float, text: str, row: int | None = None, col: int | None = None, low: bool = False
) -> None:
    """A dashed vertical line with a label at ``x`` on a log x axis; ``low`` puts the label at the foot of the
    plot, clear of a subplot's title."""
    fig.add_vline(x=x, line_dash="dash", line_color="grey", row=row, col=col)
    fig.add_annotation(
        x=math.log10(x),
        y=0.02 if low else 1,
        yref="y domain",
        text=text,
        showarrow=False,
        xanchor="left",
        yanchor="bottom",
        row=row,
        col=col,
    )


def throughput(result: SweepResult, name: str = "") -> go.Figure:
    """Output tok/s against concurrency, with each level's spread, and where it levels off (only a real plateau)."""
    lv = _levels(result)
    fig = go.Figure(
        go.Scatter(
            x=lv["concurrency"],
            y=lv["output_throughput"],
            mode="lines+markers+text",
            name=name or "output tok/s",
            # the limit's kind by each level it binds (a still-rising level needs no label)
            text=[LIMIT_LABELS.get(k, "") for k in lv["limit_kind"]] if "limit_kind" in lv else None,
            # left of each point, where the line comes from; the first point's label would leave the plot there
            textposition=["bottom right"] + ["top left"] * (len(lv) - 1),
            customdata=lv["limit"] if "limit" in lv else None,
            hovertemplate="%{x} streams: %{y:,.0f} tok/s<br>%{customdata}<extra></extra>" if "limit" in lv else None,
            error_y=dict(
                type="data",
                symmetric=False,
                array=lv["output_throughput_max"] - lv["output_throughput"],
                arrayminus=lv["output_throughput"] - lv["output_throughput_min"],
            ),
        )
    )
    if result.saturated and result.plateau_concurrency:
        _mark(fig, result.plateau_concurrency, f"levels off from {result.plateau_concurrency} streams")
        subtitle = result.stop_reason
    elif result.stopped_by == "max_concurrency":
        subtitle = f"not saturated at the {result.max_concurrency}-stream limit"
        if result.last_gain is not None:
            subtitle += f" ({result.last_gain:+.0%} over the last doubling)"
    else:
        subtitle = result.stop_reason
    fig.update_xaxes(type="log", title="concurrent streams", tickvals=list(lv["concurrency"]))
    fig.update_yaxes(title="output tokens/s", rangemode="tozero")
    fig.update_layout(title=dict(text=f"Throughput against concurrency<br><sup>{subtitle}</sup>"), height=420)
    return fig


def pareto(result: SweepResult) -> go.Figure:
    """Per-user speed against total throughput: what each user gets for the server's total."""
    lv = _levels(result)
    fig = go.Figure(
        go.Scatter(
            x=lv["output_throughput"],
            y=lv["per_user_tok_s"],
            mode="lines+markers+text",
            text=[f"c={c}" + (" (vLLM's clock)" if off else "") for c, off in zip(lv["concurrency"], lv["off_clock"])],
            textposition="top center",
        )
    )
    fig.update_xaxes(title="total output tokens/s", rangemode="tozero")
    top = max((v for v in lv["per_user_tok_s"] if v == v), default=0.0)  # NaN-safe: a level may lack its TPOT
    # room above the highest point for its label, which plotly would otherwise draw on the plot's top edge
    fig.update_yaxes(title="per-user tokens/s (1 / median TPOT)", range=[0, top * 1.18] if top > 0 else None)
    fig.update_layout(title="Per-user speed against total throughput", height=420)
    return fig


def latency(result: SweepResult) -> go.Figure:
    """TTFT and TPOT percentiles (ms) against concurrency."""
    lv = _levels(result)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("time to first token", "time per output token"))
    for col, metric in ((1, "ttft"), (2, "tpot")):
        for p, dash in (("p50", "solid"), ("p90", "dot"), ("p99", "dash")):
            key = f"{metric}_{p}_ms"
            if key in lv:
                fig.add_trace(
                    go.Scatter(x=lv["concurrency"], y=lv[key], name=f"{metric.upper()} {p}", line=dict(dash=dash)),
                    row=1,
                    col=col,
                )
        fig.update_xaxes(type="log", title="concurrent streams", tickvals=list(lv["concurrency"]), row=1, col=col)
        fig.update_yaxes(title="ms", rangemode="tozero", row=1, col=col)
    if "vllm_tpot_mean_ms" in lv and lv["vllm_tpot_mean_ms"].notna().any():
        fig.add_trace(
            go.Scatter(x=lv["concurrency"], y=lv["vllm_tpot_mean_ms"], name="TPOT mean, vLLM's own clock",
                       line=dict(color="black", dash="dashdot")),
            row=1, col=2,
        )  # fmt: skip
    off = lv[lv["off_clock"]]
    if not off.empty:  # where the client's TPOT is the delivery's, not the engine's, the points say so
        fig.add_trace(
            go.Scatter(x=off["concurrency"], y=off["tpot_p50_ms"], mode="markers", name="client clock off vLLM's",
                       marker=dict(symbol="x-open", size=14, color="red"),
                       hovertext=[f"client TPOT {g:+.0f} % off vLLM's: tokens came in bursts" for g in off["tpot_clock_gap_pct"]]),
            row=1, col=2,
        )  # fmt: skip
    fig.update_layout(title="Latency percentiles against concurrency", height=420)
    return fig


def crossover(a: pd.DataFrame, b: pd.DataFrame, metric: str = "output_throughput") -> int | None:
    """The lowest shared concurrency from which the run that was behind is ahead; None if order never flips."""
    merged = a[["concurrency", metric]].merge(b[["concurrency", metric]], on="concurrency", suffixes=("_a", "_b"))
    merged = merged.sort_values("concurrency")
    diff = (merged[f"{metric}_a"] - merged[f"{metric}_b"]).tolist()
    sign = [(d > 0) - (d < 0) for d in diff]
    for i in range(1, len(sign)):
        if sign[i] != 0 and sign[i] != sign[0] and sign[0] != 0:
            return int(merged["concurrency"].iloc[i])
    return None


RUN_COLOURS = px.colors.qualitative.Plotly


def workload_warning(workloads: dict[str, tuple[float, float] | None]) -> str:
    """A warning when the runs compared sent different requests (prompt and output tokens per request, more than
    10 % apart): their curves then compare workloads, not servers; '' when they agree or cannot be told."""
    known = {label: w for label, w in workloads.items() if w}
    if len(known) < 2:
        return ""
    (first_label, (inp, out)), *rest = known.items()
    differ = [label for label, (i, o) in rest if abs(i - inp) > 0.1 * max(inp, 1) or abs(o - out) > 0.1 * max(out, 1)]
    if not differ:
        return ""
    said = "; ".join(f"{label}: {i:.0f} in / {o:.0f} out" for label, (i, o) in known.items())
    return (
        f"the runs sent different requests (tokens per request: {said}): the curves compare workloads as much as "
        "servers; compare runs of the same bench_input_len and bench_output_len"
    )


class Crossing(NamedTuple):
    """Two runs compared: where the second's throughput overtakes the first's (None: never)."""

    a: str
    b: str
    crossover_concurrency: int | None


def compare(runs: list[tuple[str, pd.DataFrame]]) -> tuple[go.Figure, list[Crossing]]:
    """Throughput, per-user speed and TTFT of labelled runs on shared axes, and every pairwise crossover."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("output tok/s", "per-user tok/s", "TTFT p50 (ms)"))
    for i, (label, lv) in enumerate(runs):
        colour = RUN_COLOURS[i % len(RUN_COLOURS)]  # one colour per run in every panel, as its legend entry shows
        for col, key in ((1, "output_throughput"), (2, "per_user_tok_s"), (3, "ttft_p50_ms")):
            fig.add_trace(
                go.Scatter(
                    x=lv["concurrency"], y=lv[key], name=label, legendgroup=label, showlegend=col == 1,
                    line={"color": colour}, marker={"color": colour},
                ),
                row=1,
                col=col,
            )  # fmt: skip
    for col in (1, 2, 3):
        fig.update_xaxes(type="log", title="concurrent streams", row=1, col=col)
    crossings: list[Crossing] = []
    for i in range(len(runs)):
        for j in range(i + 1, len(runs)):
            c = crossover(runs[i][1], runs[j][1])
            crossings.append(Crossing(runs[i][0], runs[j][0], c))
            if c:
                _mark(fig, c, f"crossover c={c}", row=1, col=1, low=True)
    fig.update_layout(title="Runs compared", height=450)
    return fig, crossings


def rates(result: RateSweepResult) -> go.Figure:
    """Open-loop rates: completed against offered requests/s beside the line where they are equal, and TTFT
    p50/p99 against the offered rate; a rate the server could not keep up with is marked."""
    lv = pd.DataFrame([level.model_dump() for level in result.levels])
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("completed against offered", "time to first token"), horizontal_spacing=0.12
    )
    top = float(max(lv["offered_rate"].max(), lv["achieved_rate"].max()))
    fig.add_trace(
        go.Scatter(x=[0, top], y=[0, top], mode="lines", line=dict(dash="dot", color="grey"), name="keeping up"),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=lv["offered_rate"],
            y=lv["achieved_rate"],
            mode="lines+markers+text",
            name="completed requests/s",
            text=["" if kept else "falls behind" for kept in lv["kept_up"]],
            textposition="bottom right",
            customdata=lv["verdict"],
            hovertemplate="offered %{x:.2f}/s: completed %{y:.2f}/s<br>%{customdata}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    for stat, dash in (("p50", "solid"), ("p99", "dash")):
        fig.add_trace(
            go.Scatter(
                x=lv["offered_rate"],
                y=lv[f"ttft_{stat}_ms"],
                mode="lines+markers",
                name=f"TTFT {stat}",
                line=dict(dash=dash),
            ),
            row=1,
            col=2,
        )
    if result.objectives.ttft_ms:
        fig.add_hline(y=result.objectives.ttft_ms, line_dash="dot", line_color="red", row=1, col=2)
    fig.update_xaxes(title="offered requests/s", rangemode="tozero")
    fig.update_yaxes(title="completed requests/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title="ms", rangemode="tozero", row=1, col=2)
    arrival = result.arrival if result.arrival != "gamma" else f"gamma, burstiness {result.burstiness:g}"
    best = f"highest rate kept up with: {result.best_rate:g}/s" if result.best_rate else "no rate was kept up with"
    fig.update_layout(
        title=dict(text=f"Open-loop request rates ({arrival} arrivals)<br><sup>{best}; {result.stop_reason}</sup>"),
        height=420,
    )
    return fig


# one colour per start-up phase, in start-up order, the same in every start drawn
_PHASE_ORDER = [name for name, _label, _milestone in PHASES] + ["other", "unaccounted"]
_PHASE_COLOURS = dict(
    zip(
        _PHASE_ORDER,
        ["#4c72b0", "#8172b3", "#55a868", "#64b5cd", "#c44e52", "#dd8452", "#b5cf6b", "#da8bc3", "#ccb974",
         "#8c613c", "#1f3b73", "#7f7f7f", "#a6a6a6", "#e5e5e5"],
        strict=True,
    )
)  # fmt: skip


def start_timeline(starts: list[tuple[str, dict[str, float]]], title: str = "Where the start's time went") -> go.Figure:
    """Each start (measured, predicted, dry) as one bar of its phases in start-up order, seconds from launch;
    a phase gets its seconds written inside when it is wide enough to hold them."""
    longest = max((sum(phases.values()) for _, phases in starts), default=0.0) or 1.0
    names = [name for name, _ in starts]
    fig = go.Figure()
    for phase in _PHASE_ORDER:
        seconds = [phases.get(phase, 0.0) for _, phases in starts]
        if not any(s >= 0.05 for s in seconds):
            continue
        label = phase.replace("_", " ")
        fig.add_bar(
            y=names,
            x=seconds,
            name=label,
            orientation="h",
            marker_color=_PHASE_COLOURS.get(phase, "#888888"),
            text=[f"{s:.0f} s" if s >= 0.06 * longest else "" for s in seconds],
            textposition="inside",
            insidetextanchor="middle",
            hovertemplate=f"{label}: %{{x:.1f}} s<extra>%{{y}}</extra>",
        )
    totals = [sum(phases.values()) for _, phases in starts]
    # the totals as a text trace, so the axis ranges over them as data
    fig.add_scatter(
        x=totals, y=names, mode="text", text=[f"  {t:.0f} s" for t in totals], textposition="middle right",
        showlegend=False, hoverinfo="skip", cliponaxis=False,
    )  # fmt: skip
    fig.update_layout(
        title=title,
        barmode="stack",
        xaxis_title="seconds from launch",
        yaxis_autorange="reversed",
        height=200 + 50 * len(starts),
        legend={"orientation": "h", "y": -0.25, "yanchor": "top", "traceorder": "normal"},
        margin={"l": 140, "r": 70, "t": 60, "b": 40},
    )
    return fig


def rehearsal(points: pd.DataFrame, winner: str = "", routing: str = "") -> go.Figure:
    """Each rehearsed candidate's output tok/s against concurrency, with its repeats' range; the winner drawn
    thicker. ``points`` has one row per candidate and level (``stages.rehearse.points``)."""
    fig = go.Figure()
    if points.empty:
        fig.update_layout(title="Rehearsal: no candidate measured", height=420)
        return fig
    for name, rows in points.groupby("candidate", sort=False):
        fig.add_trace(
            go.Scatter(
                x=rows["concurrency"], y=rows["output_tok_s"], mode="lines+markers", name=str(name),
                line=dict(width=4 if name == winner else 1.5),
                error_y=dict(type="data", symmetric=False, array=rows["high"] - rows["output_tok_s"],
                             arrayminus=rows["output_tok_s"] - rows["low"]),
                hovertemplate=f"{name}<br>%{{x}} streams: %{{y:,.1f}} tok/s<extra></extra>",
            )
        )  # fmt: skip
    levels = sorted(points["concurrency"].unique())
    fig.update_xaxes(type="log", title="concurrent streams", tickvals=levels)
    fig.update_yaxes(title="output tokens/s (dummy weights)", rangemode="tozero")
    sub = f"winner: {winner}" + (f"; routing simulation {routing}" if routing else "")
    fig.update_layout(
        title=dict(text=f"Rehearsal: candidates on dummy weights<br><sup>{sub}</sup>"), height=460,
        legend=dict(orientation="h", yanchor="top", y=-0.18, x=0),
    )  # fmt: skip
    return fig
