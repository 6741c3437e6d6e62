"""Progress that works in JupyterLab (a widget) and in batch runs (plain lines)."""

from __future__ import annotations

from typing import Callable

from IPython.display import display

LOAD_STEPS = ["vLLM", "loading model", "checkpoint shards", "weights loaded", "KV cache", "engine initialised",
              "API server up", "ready"]


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
