"""The interactive workbook's parts that need no browser: a notebook's params file, the plan's what-if and its
choice, the sweep's controls, compare's picker, the live views headless, and the contents manager that keeps
the notebooks unmodified on any Python."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from servebook import lab, live, params, planner, results, runner, ui, workbook
from servebook.errors import LayoutRejected, ParamsError
from servebook.records import PlanRecord
from servebook.stages import plan as plan_stage

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples" / "h200-vllm"


def cell_defaults(*names: str) -> dict:
    return {name: params.notebook_default(name) for name in names}


def test_a_params_file_fills_the_cells_defaults_and_an_edit_wins(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("port: 8200\nbench_max_concurrency: 8\nmax_model_len: 2048\n")
    namespace = {
        **cell_defaults("port", "bench_max_concurrency", "max_model_len", "interactive"),
        "params_file": str(path),
    }
    namespace["max_model_len"] = 1024  # edited in the cell
    found = params.notebook_params(namespace)
    assert (found.params.port, found.params.bench_max_concurrency, found.params.max_model_len) == (8200, 8, 1024)
    assert found.edited == ["max_model_len"] and "port" in found.from_file and "max_model_len" not in found.from_file
    assert found.params.interactive is True  # a person's notebook: the cell's own default
    assert "edited in this notebook: max_model_len" in found.describe()


def test_a_notebook_opened_from_notebooks_reads_the_default_params_file(monkeypatch):
    monkeypatch.chdir(REPO / "notebooks")
    namespace = {**cell_defaults("port", "device"), "params_file": params.notebook_default("params_file")}
    found = params.notebook_params(namespace)
    assert found.params_file == "../params/default.yaml" and found.params == params.load(
        REPO / "params" / "default.yaml"
    )


def test_a_missing_params_file_names_the_parameter_and_the_files_there_are():
    with pytest.raises(ParamsError) as caught:
        params.notebook_params({"params_file": "../params/nope.yaml"})
    text = str(caught.value)
    assert "params_file" in text and "nope.yaml" in text and "../params/default.yaml" in text


def test_papermill_gets_every_value_and_no_params_file():
    p = params.load(REPO / "params" / "default.yaml")
    values = runner.injected_values(p, {"params_file", "interactive", "port", "run_dir"}, "/runs/x")
    assert values == {"params_file": "", "interactive": False, "port": p.port, "run_dir": "/runs/x"}


def test_every_notebook_starts_interactive_from_the_default_params_file():
    for nb in runner.stage_notebooks():
        declared = runner.declared_parameters(nb)
        assert "params_file" in declared and "interactive" in declared, nb.name
        source = nbformat.read(nb, as_version=4).cells
        first = next(c for c in source if c.cell_type == "markdown").source
        assert "**Answers:**" in first and "**Needs:**" in first, nb.name
        assert "language_info" not in nbformat.read(nb, as_version=4).metadata, nb.name


# ---------------------------------------------------------------- 01: the what-if and the choice


def cpu_plan(tmp_path, **changes) -> tuple[PlanRecord, params.Params]:
    p = params.load(REPO / "params" / "default.yaml").model_copy(update=changes)
    return plan_stage.run(p, tmp_path), p


def test_a_layout_of_the_wrong_size_says_the_product_and_the_fix(tmp_path):
    record, p = cpu_plan(tmp_path, tensor_parallel_size=4)
    why = plan_stage.refusal(record, p)
    assert why and "uses 4 GPUs (TP × PP × DP)" in why and "plan_gpu_count: 4" in why and "layout_from_plan" in why
    assert "Stage 03 would not start this" in plan_stage.verdict(record, p)  # said, not raised
    assert "which stage 03 would not start" in plan_stage.summary(record)  # the answer line never hides it
    assert plan_stage.commands_or_why(record, p).startswith("no command: the params' layout TP=4 uses 4 GPUs")
    with pytest.raises(LayoutRejected):
        plan_stage.check(record, p)


def test_the_explorer_replans_and_never_raises(tmp_path):
    record, p = cpu_plan(tmp_path)
    as_planned = workbook.explore(record, p, planner.Parallelism(), p.max_model_len, 0.9, "auto")
    fp8 = workbook.explore(record, p, planner.Parallelism(), p.max_model_len, 0.9, "fp8")
    assert fp8.kv_tokens == pytest.approx(2 * as_planned.kv_tokens, rel=0.01)
    assert "--kv-cache-dtype fp8" in fp8.command_text() and "--kv-cache-dtype" not in as_planned.command_text()
    too_long = workbook.explore(record, p, planner.Parallelism(), 10**7, 0.9, "auto")
    assert too_long.layout is None and "max_model_len" in too_long.problem
    assert too_long.facts() == {"verdict": too_long.problem} and too_long.figure() is not None
    assert as_planned.figure().data  # the bars of the layout shown


def test_use_this_layout_writes_what_stage_03_launches(tmp_path):
    record, p = cpu_plan(tmp_path)
    shown = workbook.explore(record, p, planner.Parallelism(), 2048, 0.85, "fp8")
    written = workbook.choose(shown, tmp_path)
    again = results.read(tmp_path, PlanRecord)
    assert again and again.launch_layout == "chosen" and again.chosen == written.chosen
    launched = again.params_for_launch(p)
    assert (launched.max_model_len, launched.gpu_memory_utilization, launched.kv_cache_dtype) == (2048, 0.85, "fp8")
    assert "Chosen in the explorer: TP=1" in workbook.choice_text(tmp_path)
    assert plan_stage.refusal(again, p) is None


# ---------------------------------------------------------------- 05: controls and views headless


def test_a_control_sets_a_validated_value_and_the_estimate_follows():
    p = params.load(REPO / "params" / "default.yaml")
    changed = workbook.with_setting(p, "bench_max_concurrency", 4)
    assert changed.bench_max_concurrency == 4 and p.bench_max_concurrency != 4
    assert "up to 3 levels (1 to 4 streams)" in workbook.sweep_estimate(changed)
    with pytest.raises(ValueError):
        workbook.with_setting(p, "bench_plateau_gain", 0.0)


def test_headless_the_live_views_are_no_ops():
    assert live.live_sweep(False) is None
    with live.resource_panel(False, [0]):
        pass
    assert "CPU busy" in live.host_rows()[0] and "<table" in live.panel_html(live.host_rows())


def test_the_launch_progress_prints_phases_headless(capsys):
    show = ui.load_progress(False)
    show("phase imports took 3.0 s", 3.0)
    assert "phase imports took 3.0 s" in capsys.readouterr().out


# ---------------------------------------------------------------- compare


def test_the_picker_finds_runs_and_not_their_own_files(tmp_path):
    for run in ("run-bf16-tp1", "run-kimi-tp1"):
        shutil.copytree(EXAMPLES / run, tmp_path / run)
    bench = tmp_path / "bench-files"
    bench.mkdir()
    shutil.copy(next((EXAMPLES / "run-bf16-tp1" / "05_benchmark_vllm").glob("*.json")), bench / "c1.json")
    found = workbook.comparable_runs([tmp_path])
    assert found == sorted([str(tmp_path / "run-bf16-tp1"), str(tmp_path / "run-kimi-tp1"), str(bench / "c1.json")])


def test_compare_says_what_is_wrong_instead_of_raising(tmp_path):
    assert "two or more" in workbook.compare_runs([str(EXAMPLES / "run-kimi-tp1")]).problem
    assert "holds no" in workbook.compare_runs([str(tmp_path), str(EXAMPLES / "run-kimi-tp1")]).problem
    both = workbook.compare_runs([str(EXAMPLES / "run-bf16-tp1"), str(EXAMPLES / "run-kimi-tp1")])
    assert both.figure is not None and len(both.crossings) == 1 and not both.problem


# ---------------------------------------------------------------- JupyterLab's view of the files


def test_the_contents_manager_adds_the_kernels_language_info_and_saves_without_it(tmp_path):
    shutil.copy(REPO / "notebooks" / "04_smoke_test.ipynb", tmp_path / "nb.ipynb")
    manager = lab.WorkbookContentsManager(root_dir=str(tmp_path))
    model = asyncio.run(manager.get("nb.ipynb"))
    info = model["content"]["metadata"]["language_info"]
    from ipykernel.ipkernel import IPythonKernel

    assert info == IPythonKernel.language_info  # what the kernel will report: nothing for JupyterLab to change
    asyncio.run(
        manager.save(
            {"type": "notebook", "format": "json", "content": json.loads(json.dumps(model["content"]))}, "nb.ipynb"
        )
    )
    assert "language_info" not in json.loads((tmp_path / "nb.ipynb").read_text())["metadata"]


def test_an_interrupted_cell_leaves_no_panel_thread(monkeypatch):
    """The panel's sampling thread belongs to the ``with`` block: Ctrl-C inside it stops the thread too."""
    import threading

    monkeypatch.setattr(live, "PANEL_PERIOD_S", 0.05)
    with pytest.raises(KeyboardInterrupt):
        with live.resource_panel(True, []):
            assert any(t.name == "servebook-panel" for t in threading.enumerate())
            raise KeyboardInterrupt
    assert not any(t.name == "servebook-panel" for t in threading.enumerate())


def test_a_value_typed_in_the_launch_notebook_wins_over_the_layout_chosen_in_01(tmp_path, capsys):
    """Issue #41 point 1: one precedence, the notebook's cell over the plan's choice over the params file."""
    record, p = cpu_plan(tmp_path)
    workbook.choose(workbook.explore(record, p, planner.Parallelism(), 2048, 0.85, "fp8"), tmp_path)
    chosen = results.read(tmp_path, PlanRecord)
    cell = {"params_file": "../params/default.yaml", "interactive": True, "max_model_len": 8192}
    typed = params.notebook_params(cell).params
    assert typed.typed_in_notebook == {"max_model_len"}
    launched = chosen.params_for_launch(typed)
    assert (launched.max_model_len, launched.kv_cache_dtype) == (8192, "fp8")  # typed wins; the rest is the choice
    assert "max_model_len = 8192 typed in this notebook wins over the layout chosen in 01_plan (2048)" in (
        capsys.readouterr().out
    )
    # papermill's runs fill the cell from a params file: nothing there is typed, the choice applies
    headless = params.notebook_params({**cell, "interactive": False}).params
    assert headless.typed_in_notebook == frozenset() and chosen.params_for_launch(headless).max_model_len == 2048
