"""Live views while work runs in JupyterLab: the sweep's chart growing level by level, and the GPUs' (or, on
the CPU default, the host's) memory, utilisation, power and clocks in a small panel.

Each view is fed by the work itself (a callback of the sweep) or by one sampling thread that a ``with`` block
owns: the block's end, an exception or an interrupted cell stops the thread before the cell returns. Headless
(``interactive`` false) they are no-ops, so nothing waits and nothing is left running.
"""

from __future__ import annotations

import contextlib
import html
import threading
from collections.abc import Callable, Iterator
from typing import Any

import plotly.graph_objects as go
import psutil
from IPython.display import display

from servebook import bench, nvml
from servebook.errors import NvmlUnavailable
from servebook.units import GiB

PANEL_PERIOD_S = 1.0


def sweep_figure() -> go.Figure:
    """The chart the sweep fills: output tok/s and TTFT p50 against concurrent streams."""
    fig = go.Figure()
    fig.add_scatter(x=[], y=[], mode="lines+markers", name="output tok/s", marker={"size": 9})
    fig.add_scatter(x=[], y=[], mode="lines+markers", name="TTFT p50 (ms)", yaxis="y2", line={"dash": "dot"})
    fig.update_layout(
        title="Sweep so far", height=380, width=720, xaxis={"title": "concurrent streams", "type": "log"},
        yaxis={"title": "output tok/s", "rangemode": "tozero"},
        yaxis2={"title": "TTFT p50 (ms)", "overlaying": "y", "side": "right", "rangemode": "tozero"},
        legend={"orientation": "h", "y": -0.25}, margin={"t": 50},
    )  # fmt: skip
    return fig


def sweep_points(so_far: bench.SweepResult) -> tuple[list[int], list[float], list[float | None]]:
    levels = so_far.levels
    return [lv.concurrency for lv in levels], [lv.output_throughput for lv in levels], [lv.ttft_p50_ms for lv in levels]


def live_sweep(interactive: bool) -> Callable[[bench.SweepResult], None] | None:
    """A FigureWidget shown now, and the callback that adds each measured level to it; None headless."""
    if not interactive:
        return None
    chart = go.FigureWidget(sweep_figure())
    status = _html("waiting for the first level")
    import ipywidgets as widgets

    display(widgets.VBox([chart, status]))

    def add(so_far: bench.SweepResult) -> None:
        x, throughput, ttft = sweep_points(so_far)
        with chart.batch_update():
            chart.layout.xaxis.tickvals = x  # the levels themselves, not a log axis's 1.5 and 2.5
            chart.data[0].x, chart.data[0].y = x, throughput
            chart.data[1].x, chart.data[1].y = x, ttft
        last = so_far.levels[-1] if so_far.levels else None
        if last:
            status.value = (
                f"<span class='sb-live-levels' data-levels='{len(so_far.levels)}'>{len(so_far.levels)} levels; "
                f"last: {last.concurrency} streams, {last.output_throughput:,.0f} tok/s</span>"
            )

    return add


def _html(text: str) -> Any:
    import ipywidgets as widgets

    return widgets.HTML(html.escape(text))


def gpu_rows(indices: list[int]) -> list[dict[str, str]]:
    """One row per GPU from NVML: memory, SM utilisation, power against its limit, SM clock against its maximum."""
    from servebook import gpu_evidence

    rows = []
    with nvml.session() as backend:
        samples = gpu_evidence.read(backend, indices)
        for s in samples:
            memory = nvml.optional(backend.nvmlDeviceGetMemoryInfo, backend.nvmlDeviceGetHandleByIndex(s.gpu))
            rows.append(
                {
                    "GPU": str(s.gpu),
                    "memory": f"{memory.used / GiB:.1f} / {memory.total / GiB:.0f} GiB" if memory else "?",
                    "SM util": f"{s.sm_util_pct:.0f} %" if s.sm_util_pct is not None else "?",
                    "power": f"{s.power_w:.0f} / {s.power_limit_w:.0f} W" if s.power_w and s.power_limit_w else "?",
                    "SM clock": f"{s.sm_clock_mhz:.0f} / {s.sm_clock_max_mhz:.0f} MHz"
                    if s.sm_clock_mhz and s.sm_clock_max_mhz
                    else "?",
                }
            )
    return rows


def host_rows() -> list[dict[str, str]]:
    """Without a GPU (the CPU default): the host's CPU and memory, which the CPU server uses instead."""
    memory = psutil.virtual_memory()
    return [
        {
            "host": "CPU",
            "CPU busy": f"{psutil.cpu_percent(interval=None):.0f} % of {psutil.cpu_count()} cores",
            "memory": f"{memory.used / GiB:.1f} / {memory.total / GiB:.0f} GiB",
        }
    ]


def panel_html(rows: list[dict[str, str]], note: str = "") -> str:
    if not rows:
        return html.escape(note)
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r.values()) + "</tr>" for r in rows)
    return f"<table class='sb-gpu-panel'><tr>{head}</tr>{body}</table><small>{html.escape(note)}</small>"


@contextlib.contextmanager
def resource_panel(interactive: bool, gpu_ids: list[int], title: str = "while it runs") -> Iterator[None]:
    """A panel refreshed every second while the block runs: the GPUs through NVML, else the host. The thread
    stops when the block ends, however it ends (an interrupted cell included)."""
    if not interactive:
        yield
        return
    import ipywidgets as widgets

    box = widgets.HTML("starting")
    display(widgets.VBox([widgets.HTML(f"<b>{html.escape(title)}</b>"), box]))
    stop = threading.Event()
    samples = [0]

    def sample() -> None:
        psutil.cpu_percent(interval=None)  # the first reading has no interval to measure over
        while not stop.wait(PANEL_PERIOD_S):
            try:
                rows = gpu_rows(gpu_ids) if gpu_ids else host_rows()
                source = "NVML" if gpu_ids else "no GPU in this layout: the host"
            except NvmlUnavailable as exc:
                rows, source = host_rows(), str(exc)
            samples[0] += 1
            box.value = panel_html(rows, f"{source}; sample {samples[0]}, every {PANEL_PERIOD_S:g} s")

    thread = threading.Thread(target=sample, name="servebook-panel", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)
        box.value += "<br><small>stopped</small>"
