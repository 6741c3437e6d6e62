"""The widgets of the interactive workbook: where a person chooses (the plan's layout explorer, the sweep's
controls, the level explorer, the run picker of compare).

Each explorer is a pure function (settings in, figures and text out) wrapped in ipywidgets. A widget only sets
values that plain cells read afterwards: "use this layout" writes the plan record stage 03 reads, the sweep's
controls set the notebook's parameters before the sweep cell runs. With ``interactive`` false the same cells
print and plot statically, and nothing waits for a widget.
"""

from __future__ import annotations

import html
import shlex
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, get_args

import plotly.graph_objects as go

from servebook import planner, results
from servebook.errors import ServebookError
from servebook.params import KV_CACHE_DTYPES, Params
from servebook.records import LayoutChoice, PlanRecord
from servebook.units import GiB

# ---------------------------------------------------------------- 01 plan: the layout explorer


@dataclass
class Exploration:
    """One setting of the explorer: the plan at it and the layout it shows, or why there is none."""

    params: Params
    plan: PlanRecord | None = None
    layout: planner.Layout | None = None
    problem: str = ""
    commands: list[list[str]] = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        return self.layout.max_kv_tokens if self.layout else 0

    def facts(self) -> dict[str, str]:
        """What changes as the settings do, by name (the explorer's figures, and the test's)."""
        lay = self.layout
        if lay is None:
            return {"verdict": self.problem}
        verdict = "fits" if lay.usable else ("vLLM refuses it: " if not lay.accepted else "does not fit: ")
        facts = {
            "verdict": verdict + "; ".join(lay.reasons),
            "weights per GPU": f"{lay.weight_bytes_per_gpu / GiB:.2f} GiB",
            "KV tokens per engine": f"{lay.max_kv_tokens:,}",
            "requests of max_model_len at once": f"{lay.max_concurrency:,.{0 if lay.max_concurrency >= 100 else 1}f}",
        }
        if lay.reserve:
            facts["vLLM's reserve per GPU"] = f"{lay.reserve.total / GiB:.2f} GiB"
        if lay.decode_tok_s_batch:
            facts[f"forecast at {lay.batch_fit} streams"] = (
                f"{lay.forecast_tok_s_batch:,.0f} tok/s (ceiling {lay.decode_tok_s_batch:,.0f})"
            )
        if lay.decode_tok_s_single:
            facts["decode ceiling, one stream"] = f"{lay.decode_tok_s_single:,.0f} tok/s"
        return facts

    def command_text(self) -> str:
        if not self.commands:
            return ""
        if len(self.commands) == 1:
            return shlex.join(self.commands[0])
        return "\n".join(f"# node {i}\n{shlex.join(argv)}" for i, argv in enumerate(self.commands))

    def figure(self) -> go.Figure:
        """Memory per GPU of the layout shown, part by part, against what vLLM may use."""
        fig = go.Figure()
        lay = self.layout
        if lay is None or not lay.accepted:
            fig.update_layout(title=self.problem or "vLLM refuses this layout: nothing to size")
            return fig
        parts = dict(lay.weight_breakdown)
        if lay.reserve:
            parts["vLLM's reserve"] = lay.reserve.total
        parts["KV cache"] = lay.available_kv_bytes_per_gpu
        for part, b in parts.items():
            fig.add_bar(x=[lay.name], y=[b / GiB], name=part, hovertemplate=f"{part}: %{{y:.2f}} GiB<extra></extra>")
        assert self.plan is not None
        dev = self.plan.device
        if dev.kind == "cuda":
            usable = dev.memory_bytes / GiB * self.plan.gpu_memory_utilization
            fig.add_hline(y=usable, line_dash="dash", annotation_text=f"usable: {usable:.1f} GiB")
        per = "GiB per GPU" if dev.kind == "cuda" else "GiB (fixed KV: cpu_kv_cache_gib)"
        fig.update_layout(
            barmode="stack", height=380, width=540, yaxis_title=per, margin={"t": 70, "r": 10, "l": 70},
            title={"text": f"{lay.name}, max_model_len {self.plan.max_model_len:,}", "x": 0.02, "y": 0.97},
        )  # fmt: skip
        return fig


def explore(
    record: PlanRecord,
    p: Params,
    layout: planner.Parallelism,
    max_model_len: int,
    gpu_memory_utilization: float,
    kv_cache_dtype: str,
) -> Exploration:
    """The plan at other settings, for one layout; a setting the plan cannot take is a problem, never a raise."""
    from servebook.stages import plan as plan_stage

    try:
        what_if = p.updated(
            {
                **layout.params(),
                "max_model_len": max_model_len,
                "gpu_memory_utilization": gpu_memory_utilization,
                "kv_cache_dtype": kv_cache_dtype,
                "layout_from_plan": False,
            },
            source=f"what if {layout.name}",
        )
        replanned = plan_stage.make_plan(what_if, record.device, record.load_evidence)
    except ServebookError as exc:
        return Exploration(params=p, problem=str(exc))
    shown = replanned.find(layout)
    if shown is None:
        return Exploration(params=what_if, plan=replanned, problem=f"{layout.name} is not a layout of these GPUs")
    return Exploration(params=what_if, plan=replanned, layout=shown, commands=replanned.node_commands)


def choose(exploration: Exploration, run_dir: str | Path) -> PlanRecord:
    """ "Use this layout": the explored plan becomes the plan record, with the choice stage 03 launches."""
    record, lay = exploration.plan, exploration.layout
    if record is None or lay is None or not lay.usable:
        raise ServebookError(exploration.problem or f"{lay.name if lay else 'this layout'} cannot be launched")
    p = exploration.params
    record.chosen = LayoutChoice(
        layout=lay.parallelism,
        max_model_len=p.max_model_len,
        gpu_memory_utilization=p.gpu_memory_utilization,
        kv_cache_dtype=p.kv_cache_dtype,
        kv_tokens=lay.max_kv_tokens,
        chosen_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    record.launch_layout = "chosen"
    results.write(results.run_folder(run_dir), record)
    return record


def choice_text(run_dir: str | Path) -> str:
    """What stage 03 will read from the plan record, in markdown."""
    record = results.read(results.run_folder(run_dir), PlanRecord)
    if record is None:
        return "No plan record in this run folder: run the plan cells above."
    if record.launch_layout == "chosen" and record.chosen:
        c = record.chosen
        return (
            f"**Chosen in the explorer: {c.layout.name}**, max_model_len {c.max_model_len:,}, "
            f"gpu_memory_utilization {c.gpu_memory_utilization}, kv_cache_dtype {c.kv_cache_dtype} "
            f"({c.kv_tokens:,} KV tokens per engine). Stage 03 launches this; re-running the plan cells forgets it."
        )
    layout = record.layout_for_launch
    source = "the plan's recommendation" if layout else "the params' layout"
    return f"No layout chosen in the explorer: stage 03 launches {source}" + (f" ({layout.name})." if layout else ".")


def _lengths(p: Params, record: PlanRecord) -> list[int]:
    """max_model_len choices: powers of two up to the model's limit, and the params' own."""
    top = record.model.max_position_embeddings or 1 << 20
    options = {1 << n for n in range(10, 21) if 1 << n <= top} | {p.max_model_len}
    return sorted(options)


def _redraw(widget: go.FigureWidget, fresh: go.Figure) -> None:
    """Show another figure in a FigureWidget already on the page (its traces may differ in number and kind)."""
    with widget.batch_update():
        widget.data = ()
        widget.add_traces(list(fresh.data))
        widget.layout = fresh.layout


def _explorer_controls(record: PlanRecord, p: Params, names: list[str], start: planner.Parallelism) -> tuple[Any, ...]:
    """The explorer's four inputs: layout, max_model_len, gpu_memory_utilization, KV-cache dtype."""
    import ipywidgets as widgets

    # the parameters' own names, whole (never "max_mod…"), and room left for the slider
    label = {"style": {"description_width": "13em"}, "layout": widgets.Layout(width="30em")}
    layout_box = widgets.Dropdown(
        options=names, value=start.name if start.name in names else (names[0] if names else None),
        description="layout", **label,
    )  # fmt: skip
    length_box = widgets.SelectionSlider(
        options=_lengths(p, record), value=p.max_model_len, description="max_model_len", continuous_update=False,
        **label,
    )  # fmt: skip
    memory_box = widgets.FloatSlider(
        value=p.gpu_memory_utilization, min=0.5, max=0.98, step=0.01, description="gpu_memory_utilization",
        continuous_update=False, readout_format=".2f", **label,
    )  # fmt: skip
    dtype_box = widgets.Dropdown(
        options=list(get_args(KV_CACHE_DTYPES)), value=p.kv_cache_dtype, description="kv_cache_dtype", **label
    )
    return layout_box, length_box, memory_box, dtype_box


def plan_explorer(record: PlanRecord, p: Params, run_dir: str | Path, verdict: str = "") -> Any:
    """The layout explorer (ipywidgets): layout, max_model_len, gpu_memory_utilization and KV-cache dtype in; the
    memory bars, KV tokens, concurrency at full context, decode ceilings and the exact command out.

    ``verdict`` (markdown: what stage 03 launches) is shown under it and replaced by the choice once "use this
    layout" writes one, so the page never shows the new choice beside the stale one."""
    import ipywidgets as widgets
    from IPython.display import Markdown, display

    accepted = [lay for lay in record.layouts if lay.accepted]
    start = record.layout_for_launch or planner.Parallelism.of(p)
    names = [lay.name for lay in accepted]
    layout_box, length_box, memory_box, dtype_box = _explorer_controls(record, p, names, start)
    figure = go.FigureWidget()
    facts = widgets.HTML()
    command = widgets.HTML()
    use = widgets.Button(description="use this layout", button_style="primary", icon="check")
    said = widgets.HTML()
    launches = widgets.Output()
    launches.add_class("sb-verdict")
    with launches:
        display(Markdown(verdict or choice_text(run_dir)))
    shown: dict[str, Exploration] = {}
    by_name = {lay.name: lay.parallelism for lay in accepted}

    def refresh(_: object = None) -> None:
        if layout_box.value is None:
            facts.value = "<b>vLLM accepts no layout here: nothing to explore.</b>"
            use.disabled = True
            return
        found = explore(
            record, p, by_name[layout_box.value], length_box.value, round(memory_box.value, 2), dtype_box.value
        )
        shown["now"] = found
        _redraw(figure, found.figure())
        rows = "".join(
            f"<tr><td>{html.escape(k)}</td><td class='sb-fact' data-fact='{html.escape(k)}'>"
            f"<b>{html.escape(v)}</b></td></tr>"
            for k, v in found.facts().items()
        )
        facts.value = f"<table class='sb-explorer-facts'>{rows}</table>"
        text = found.command_text()
        command.value = f"<pre class='sb-command'>{html.escape(text)}</pre>" if text else ""
        use.disabled = found.layout is None or not found.layout.usable
        said.value = ""

    def chosen(_: object) -> None:
        try:
            written = choose(shown["now"], run_dir)
        except ServebookError as exc:
            said.value = f"<b>{html.escape(str(exc))}</b>"
            return
        c = written.chosen
        assert c is not None
        said.value = f"<span class='sb-chosen'>written to 01_plan.json: stage 03 launches <b>{c.layout.name}</b></span>"
        launches.clear_output()
        with launches:
            display(Markdown(choice_text(run_dir)))

    for box in (layout_box, length_box, memory_box, dtype_box):
        box.observe(refresh, names="value")
    use.on_click(chosen)
    refresh()
    controls = widgets.VBox([layout_box, length_box, memory_box, dtype_box, facts, use, said])
    return widgets.VBox([widgets.HBox([controls, figure]), command, launches])


# ---------------------------------------------------------------- 05 benchmark: the sweep's controls and the level explorer

# the controls of the sweep, as the params name them: (label, widget kind, options)
SWEEP_CONTROLS: dict[str, tuple[str, str, Any]] = {
    "bench_max_concurrency": ("up to streams", "choice", [1 << n for n in range(11)]),
    "bench_input_len": ("prompt tokens", "int", None),
    "bench_output_len": ("output tokens", "int", None),
    "bench_endpoint": ("endpoint", "choice", ["completions", "chat"]),
    "bench_prompts_per_level": ("requests/repeat", "int", None),
    "bench_min_level_s": ("window ≥ s", "float", None),
    "bench_repeats": ("repeats", "choice", [1, 2, 3, 4, 5]),
    "bench_plateau_gain": ("plateau gain", "float", None),
    "bench_ttft_slo_ms": ("TTFT SLO, ms (0: none)", "float", None),
    "bench_tpot_slo_ms": ("TPOT SLO, ms (0: none)", "float", None),
}


def sweep_estimate(p: Params) -> str:
    """How long the sweep these settings describe takes at least: every doubling to the limit, each repeat at
    least its window (a plateau or a broken objective ends it sooner)."""
    levels = max(1, p.bench_max_concurrency.bit_length())
    seconds = levels * p.bench_repeats * p.bench_min_level_s
    return (
        f"up to {levels} levels (1 to {p.bench_max_concurrency} streams) × {p.bench_repeats} repeats × at least "
        f"{p.bench_min_level_s:g} s: at least {seconds / 60:.1f} min of windows if nothing saturates"
    )


def with_setting(p: Params, name: str, value: Any) -> Params:
    """The params with one setting changed, validated as the params file would be."""
    changed = p.model_copy()
    setattr(changed, name, value)  # validate_assignment: a bad value raises pydantic's error, named
    return changed


def sweep_controls(namespace: dict[str, Any], target: str = "p") -> Any:
    """Controls over the sweep's range, workload and objectives; each change replaces ``target`` in the notebook
    (validated), which the sweep cell below reads."""
    import ipywidgets as widgets
    from pydantic import ValidationError

    note = widgets.HTML(html.escape(sweep_estimate(namespace[target])))
    boxes = []
    for name, (label, kind, options) in SWEEP_CONTROLS.items():
        value = getattr(namespace[target], name)
        style = {"description_width": "13em"}
        box: Any
        if kind == "choice":
            box = widgets.Dropdown(options=options if value in options else [*options, value], value=value)
        elif kind == "int":
            box = widgets.BoundedIntText(value=value, min=0, max=1 << 20)
        else:
            box = widgets.BoundedFloatText(value=value, min=0, max=1e6)
        box.description, box.style, box.layout = label, style, widgets.Layout(width="25em")

        def changed(change: dict[str, Any], name: str = name) -> None:
            try:
                namespace[target] = with_setting(namespace[target], name, change["new"])
            except ValidationError as exc:
                note.value = f"<b>{name}: {html.escape(exc.errors()[0]['msg'])}</b>"
                return
            note.value = html.escape(sweep_estimate(namespace[target])) + " &mdash; <b>run the next cell to sweep</b>"

        box.observe(changed, names="value")
        boxes.append(box)
    half = (len(boxes) + 1) // 2
    return widgets.VBox([widgets.HBox([widgets.VBox(boxes[:half]), widgets.VBox(boxes[half:])]), note])


LEVEL_METRICS = {
    "output_throughput": "output tok/s",
    "per_user_tok_s": "per-user tok/s",
    "ttft_p50_ms": "TTFT p50 (ms)",
    "ttft_p99_ms": "TTFT p99 (ms)",
    "tpot_p50_ms": "TPOT p50 (ms)",
    "tpot_p99_ms": "TPOT p99 (ms)",
    "e2el_p50_ms": "E2EL p50 (ms)",
    "e2el_p99_ms": "E2EL p99 (ms)",
    "client_queue_p50_ms": "client queue p50 (ms)",
    "kv_cache_usage_peak": "KV-cache usage peak",
}


def level_figure(levels: Any, metric: str, concurrency: int | None) -> go.Figure:
    """One metric against concurrent streams, the chosen level marked."""
    fig = go.Figure()
    fig.add_scatter(x=levels["concurrency"], y=levels[metric], mode="lines+markers", name=LEVEL_METRICS[metric])
    if concurrency is not None and concurrency in set(levels["concurrency"]):
        row = levels[levels["concurrency"] == concurrency].iloc[0]
        fig.add_scatter(
            x=[concurrency], y=[row[metric]], mode="markers", name=f"{concurrency} streams",
            marker={"size": 16, "symbol": "circle-open", "line": {"width": 3}},
        )  # fmt: skip
    fig.update_layout(
        height=380, width=640, yaxis_title=LEVEL_METRICS[metric],
        xaxis={"title": "concurrent streams", "type": "log", "tickvals": list(levels["concurrency"])},
        title=f"{LEVEL_METRICS[metric]} by level", showlegend=False, margin={"t": 50},
    )  # fmt: skip
    return fig


def level_explorer(levels: Any, limits: Any) -> Any:
    """Over the run's own tables: a metric and a level in; the metric's curve with the level marked, and what
    limited that level (the limits table's row) out."""
    import ipywidgets as widgets

    metrics = [m for m in LEVEL_METRICS if m in levels and levels[m].notna().any()]
    streams = [int(c) for c in levels["concurrency"]]
    metric_box = widgets.Dropdown(
        options=[(LEVEL_METRICS[m], m) for m in metrics], value=metrics[0], description="metric"
    )
    level_box = widgets.SelectionSlider(options=streams, value=streams[-1], description="streams")
    chart = go.FigureWidget(level_figure(levels, metrics[0], streams[-1]))
    row = widgets.HTML()

    def refresh(_: object = None) -> None:
        _redraw(chart, level_figure(levels, metric_box.value, level_box.value))
        if limits is not None and not limits.empty:
            picked = limits.iloc[streams.index(level_box.value)] if len(limits) == len(streams) else None
            row.value = (
                "<table class='sb-level-row'>"
                + "".join(
                    f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in picked.items()
                )
                + "</table>"
                if picked is not None
                else ""
            )

    metric_box.observe(refresh, names="value")
    level_box.observe(refresh, names="value")
    refresh()
    return widgets.VBox([widgets.HBox([metric_box, level_box]), widgets.HBox([chart, row])])


# ---------------------------------------------------------------- compare: the run picker


def comparable_runs(roots: list[str | Path]) -> list[str]:
    """Run folders with a benchmark record, and `vllm bench serve --save-result` files, under these folders."""
    from servebook import vllm_format
    from servebook.records import BenchmarkRecord

    found: set[str] = set()
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        for record in root.rglob(f"{BenchmarkRecord.FILE}.json"):
            found.add(str(record.parent))
    runs = [Path(r) for r in found]
    for root in map(Path, roots):
        if not root.is_dir():
            continue
        for candidate in root.rglob("*.json"):
            if candidate.name.startswith(("0", "manifest")) or any(candidate.is_relative_to(r) for r in runs):
                continue  # a run's own files (its records, the vllm bench files of its levels) are the run
            try:
                if "output_throughput" in vllm_format.read(candidate):
                    found.add(str(candidate))
            except (ServebookError, ValueError, OSError):
                continue
    return sorted(found)


def run_picker(namespace: dict[str, Any], roots: list[str | Path], target: str = "runs") -> Any:
    """A multiple choice over the runs under ``roots``; the choice becomes ``target`` for the cells below."""
    import ipywidgets as widgets

    options = comparable_runs(roots)
    chosen = [r for r in namespace.get(target, []) if r in options]
    picker = widgets.SelectMultiple(
        options=options, value=chosen, rows=min(12, max(4, len(options))), description="runs",
        layout=widgets.Layout(width="60em"),
    )  # fmt: skip
    note = widgets.HTML(
        f"{len(options)} runs found under {', '.join(map(str, roots))}; pick two or more "
        "(Ctrl-click or Shift-click adds to the choice)"
    )

    def picked(change: dict[str, Any]) -> None:
        namespace[target] = list(change["new"])
        note.value = f"<span class='sb-picked'>{len(change['new'])} picked</span> &mdash; <b>run the next cell</b>"

    picker.observe(picked, names="value")
    return widgets.VBox([picker, note])


@dataclass
class Comparison:
    """Runs on shared axes: the figure, each pair's crossover, and a warning where the workloads differ."""

    figure: go.Figure | None
    crossings: list[Any]
    warning: str = ""
    problem: str = ""

    def text(self) -> str:
        if self.problem:
            return self.problem
        lines = [
            f"- {c.a} vs {c.b}: "
            + (f"cross over at {c.crossover_concurrency} streams" if c.crossover_concurrency else "never cross")
            for c in self.crossings
        ]
        return "\n".join(lines + ([f"\n⚠️ {self.warning}"] if self.warning else []))


def compare_runs(runs: list[str]) -> Comparison:
    """The comparison `servebook compare` draws, for a notebook: a problem is said, never raised."""
    from servebook import plots
    from servebook.stages.benchmark import load_run, workload_of

    if len(runs) < 2:
        return Comparison(None, [], problem=f"Pick two or more runs to compare ({len(runs)} picked).")
    try:
        loaded = [load_run(r) for r in runs]
    except ServebookError as exc:
        return Comparison(None, [], problem=str(exc))
    fig, crossings = plots.compare(loaded)
    warning = plots.workload_warning({label: workload_of(r) for (label, _), r in zip(loaded, runs)}) or ""
    return Comparison(fig, crossings, warning)


# ---------------------------------------------------------------- 02 rehearse: the live table and the picker


def live_rehearsal(interactive: bool) -> Any:
    """A table and chart shown now that fill in as each candidate finishes, and the callback that updates them;
    None headless (the cells below print the same)."""
    if not interactive:
        return None
    import ipywidgets as widgets
    from IPython.display import display

    from servebook import plots
    from servebook.stages import rehearse as stage

    chart = go.FigureWidget(plots.rehearsal(stage.points_of([])))
    table = widgets.HTML("<i>waiting for the first candidate</i>")
    display(widgets.VBox([chart, table]))

    def update(record: Any) -> None:
        _redraw(chart, plots.rehearsal(stage.points(record), record.winner, record.routing))
        table.value = stage.styled(record).to_html()

    return update


def rehearsal_picker(run_dir: str | Path) -> Any:
    """A candidate other than the measured winner, picked for stage 03 (written to the rehearsal record)."""
    import ipywidgets as widgets

    from servebook.records import RehearsalRecord
    from servebook.stages import rehearse as stage

    record = results.read(results.run_folder(run_dir), RehearsalRecord)
    measured = [c.name for c in record.candidates if c.status in ("measured", "dropped")] if record else []
    if not record or not measured:
        return widgets.HTML("No candidate was measured: nothing to pick.")
    box = widgets.Dropdown(options=measured, value=record.winner or measured[0], description="launch",
                           layout=widgets.Layout(width="32em"), style={"description_width": "initial"})  # fmt: skip
    button = widgets.Button(description="use this candidate", button_style="primary")
    said = widgets.HTML(html.escape(f"stage 03 launches {record.winner} ({record.picked_by})"))

    def picked(_button: Any) -> None:
        try:
            now = stage.pick(run_dir, box.value)
            said.value = html.escape(f"stage 03 launches {now.winner} (picked by a person)")
        except ServebookError as exc:
            said.value = html.escape(str(exc))

    button.on_click(picked)
    return widgets.VBox([widgets.HBox([box, button]), said])
