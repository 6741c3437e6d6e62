"""Progress that works in JupyterLab (a widget) and in batch runs (plain lines)."""

from __future__ import annotations

from collections.abc import Callable

from IPython.display import display

LOAD_STEPS = [
    "vLLM",
    "loading model",
    "checkpoint shards",
    "weights loaded",
    "KV cache",
    "engine initialised",
    "API server up",
    "ready",
]


def load_progress(interactive: bool, title: str = "launch") -> Callable[[str, float], None]:
    """A callback for :func:`servebook.server.launch` progress messages."""
    if not interactive:

        def show(message: str, elapsed: float) -> None:
            print(f"[{elapsed:7.1f} s] {message}", flush=True)

        return show

    import ipywidgets as widgets

    bar = widgets.IntProgress(min=0, max=len(LOAD_STEPS), description=title)
    label = widgets.Label("starting")
    display(widgets.HBox([bar, label]))

    def update(message: str, elapsed: float) -> None:
        for i, step in enumerate(LOAD_STEPS, 1):
            if message.startswith(step) or step in message:
                bar.value = max(bar.value, i)
        label.value = f"{elapsed:.0f} s: {message}"

    return update


def download_progress(interactive: bool) -> Callable[[dict[str, float]], None]:
    """A callback for :func:`servebook.download.fetch` snapshots."""

    def line(s: dict[str, float]) -> str:
        eta = "?" if s["eta_s"] == float("inf") else f"{s['eta_s'] / 60:.1f} min"
        return (
            f"{s['bytes_done'] / 1e9:8.2f} of {s['bytes_total'] / 1e9:.2f} GB, "
            f"{s['rate_bytes_s'] / 1e6:7.1f} MB/s, {eta} left"
        )

    if not interactive:
        return lambda s: print(line(s), flush=True)

    import ipywidgets as widgets

    bar = widgets.FloatProgress(min=0, max=1, description="download")
    label = widgets.Label("")
    display(widgets.HBox([bar, label]))

    def update(s: dict[str, float]) -> None:
        bar.value = s["bytes_done"] / s["bytes_total"] if s["bytes_total"] else 1
        label.value = line(s)

    return update
