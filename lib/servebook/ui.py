"""The notebooks' interactive face: widgets in JupyterLab, plain lines in batch runs.

Widgets only set values that plain cells then read (a params file, a chosen layout, the sweep's settings), so a
papermill run and an interactive one leave the same records.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from IPython.display import display

from servebook import params as params_mod
from servebook.errors import ParamsError, ServebookError


def errors_as_one_line() -> None:
    """In a notebook, a :class:`ServebookError` shows as the CLI prints it: its message (what went wrong and the
    fix) on top, servebook's own traceback folded below it; the cell still fails, so papermill and nbval see the
    error. Other exceptions keep IPython's full traceback (they are servebook's bugs, or the user's code)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or getattr(shell, "_servebook_errors_as_one_line", False):
        return

    def one_line(
        shell: Any, etype: type[BaseException], value: BaseException, tb: Any, tb_offset: Any = None
    ) -> list[str]:
        import traceback

        from IPython.display import HTML, display

        short = [f"{etype.__name__}: {value}"]
        shell._showtraceback(etype, value, short)  # the cell's error output (papermill's and nbval's), one line
        folded = html.escape("".join(traceback.format_exception(etype, value, tb)))
        display(
            HTML(f"<details><summary>servebook's traceback (for a bug report)</summary><pre>{folded}</pre></details>")
        )
        return short

    shell.set_custom_exc((ServebookError,), one_line)
    shell._servebook_errors_as_one_line = True


def frame_html(frame: Any) -> str:
    """A DataFrame as a notebook shows it, without the column of row numbers (0, 1, 2, …) pandas adds when the
    rows have no index of their own: a reader takes it for data. An index that names something is kept."""
    import pandas as pd

    numbered = isinstance(frame.index, pd.RangeIndex) and frame.index.name is None
    if not numbered:
        return str(frame._repr_html_())
    return str(
        frame.to_html(
            index=False, max_rows=pd.get_option("display.max_rows"), max_cols=pd.get_option("display.max_columns"),
            show_dimensions=False, notebook=True,
        )
    )  # fmt: skip


def tables_without_row_numbers() -> None:
    """Every DataFrame a notebook displays goes through :func:`frame_html`."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    import pandas as pd

    shell.display_formatter.formatters["text/html"].for_type(pd.DataFrame, frame_html)


def notebook_params(namespace: dict[str, Any], target: str = "p") -> params_mod.Params:
    """A notebook's parameters (its cell, filled from ``params_file``); with ``interactive``, a picker over the
    params files that sets ``params_file`` and ``target`` in the notebook for the cells below. Every notebook
    calls it first: from here on servebook's errors read as one line (:func:`errors_as_one_line`) and tables show
    no row numbers (:func:`tables_without_row_numbers`)."""
    errors_as_one_line()
    tables_without_row_numbers()
    found = params_mod.notebook_params(namespace)
    if not found.params.interactive:
        if found.params_file:  # under `servebook run` the runner fills the cell from its params file: nothing to add
            print(found.describe())
        return found.params

    import ipywidgets as widgets

    current = str(namespace.get("params_file") or "")
    names = params_mod.params_files()
    names += [current] if current and current not in names else []
    picker = widgets.Dropdown(
        options=[("(none: this notebook's cell)", ""), *((n, n) for n in names)],
        value=current,
        description="params_file",
        style={"description_width": "initial"},
        layout=widgets.Layout(width="28em"),
    )
    note = widgets.HTML(html.escape(found.describe()))

    def picked(change: dict[str, Any]) -> None:
        namespace["params_file"] = change["new"]
        try:
            again = params_mod.notebook_params(namespace)
        except ParamsError as exc:
            note.value = f"<b>{html.escape(str(exc))}</b>"
            return
        namespace[target] = again.params
        note.value = html.escape(again.describe()) + " &mdash; <b>run the cells below to use it</b>"

    picker.observe(picked, names="value")
    display(widgets.VBox([picker, note]))
    return found.params


# the start's milestones as vLLM's log and the launch name them (vllm_log.PHASES), in the order they come
LOAD_STEPS = [
    "vLLM",
    "loading model",
    "checkpoint shards",
    "weights read",
    "model loaded",
    "torch.compile",
    "KV cache",
    "graphs captured",
    "engine initialised",
    "API server up",
    "ready",
]


def load_step(message: str) -> int:
    """How far a start is, in :data:`LOAD_STEPS`, by one of its progress messages (0: no milestone)."""
    reached = [i for i, step in enumerate(LOAD_STEPS, 1) if message.startswith(step) or step in message]
    if message.startswith("ready"):
        return len(LOAD_STEPS)
    return max(reached, default=0)


def load_progress(interactive: bool, title: str = "launch") -> Callable[[str, float], None]:
    """A callback for :func:`servebook.server.launch` progress messages."""
    if not interactive:

        def show(message: str, elapsed: float) -> None:
            print(f"[{elapsed:7.1f} s] {message}", flush=True)

        return show

    import ipywidgets as widgets
    import plotly.graph_objects as go

    bar = widgets.IntProgress(min=0, max=len(LOAD_STEPS), description=title)
    label = widgets.Label("starting")
    timeline = go.FigureWidget()
    timeline.add_bar(x=[], y=[], base=[], orientation="h", text=[], textposition="outside", cliponaxis=False,
                     name="phases")  # fmt: skip
    timeline.update_layout(
        title=f"{title}: phases so far", height=300, width=720, xaxis_title="seconds since the start",
        yaxis={"autorange": "reversed"}, margin={"t": 40, "l": 130, "r": 60},
    )  # fmt: skip
    display(widgets.VBox([widgets.HBox([bar, label]), timeline]))

    def update(message: str, elapsed: float) -> None:
        bar.value = max(bar.value, load_step(message))
        label.value = f"{elapsed:.0f} s: {message}"
        if message.startswith("phase ") and " took " in message:
            name, seconds = message.removeprefix("phase ").split(" took ")
            took = float(seconds.removesuffix(" s"))
            with timeline.batch_update():
                trace = timeline.data[0]
                trace.y = (*trace.y, name)
                trace.x = (*trace.x, took)
                trace.base = (*trace.base, elapsed - took)
                trace.text = (*trace.text, f"{took:.1f} s")

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
