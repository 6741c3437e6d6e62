"""The interactive workbook in a real JupyterLab (the project's, from .venv), driven in Debian's headless Chromium.

Each step leaves a screenshot in build/workbook-shots/<test>/ (the test's folder keeps a copy): what a person
sees, to look at, not only to assert on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from servebook import params, results, server
from servebook.records import PlanRecord
from tests.support import lab as lab_mod

pytestmark = [pytest.mark.integration, pytest.mark.skipif(bool(lab_mod.available()), reason=lab_mod.available())]

SHOTS = lab_mod.REPO / "build" / "workbook-shots"
LIVE_PORT = 8137


@pytest.fixture
def lab(request, tmp_path):
    outputs = tmp_path / "outputs"
    shots = SHOTS / request.node.name
    shutil.rmtree(shots, ignore_errors=True)
    running = lab_mod.Lab(tmp_path / "lab", shots, env={"SERVEBOOK_OUTPUTS": str(outputs)})
    running.outputs = outputs  # type: ignore[attr-defined]
    yield running
    running.close()
    shutil.copytree(shots, tmp_path / "shots", dirs_exist_ok=True)


def fact(lab, name: str) -> str:
    return lab.text_of(f"td.sb-fact[data-fact='{name}']")


def test_every_notebook_opens_unmodified(lab):
    """No dirty marker once the kernel is up: the files carry no language_info for JupyterLab to rewrite."""
    dirty = {}
    for nb in sorted(p.name for p in (lab.root / "notebooks").glob("*.ipynb")):
        lab.open(nb)
        dirty[nb] = lab.dirty()
    lab.shot("last-opened")
    assert dirty and not any(dirty.values()), dirty


def test_the_plan_explorer_changes_the_layout_and_stage_03_reads_the_choice(lab):
    lab.open("01_plan.ipynb")
    lab.run_all(timeout=240)
    assert lab.errors() == []
    lab.wait_for(lambda: lab.find(".sb-explorer-facts"), 30, "the layout explorer")
    lab.scroll_to(".sb-explorer-facts")
    lab.shot("explorer-as-planned")
    kv_before, command_before = fact(lab, "KV tokens per engine"), lab.text_of("pre.sb-command")
    assert kv_before and "vllm" in command_before and "--kv-cache-dtype" not in command_before

    from selenium.webdriver.support.ui import Select

    dtype = next(s for s in lab.find(".widget-dropdown select") if "fp8" in s.text)
    Select(dtype).select_by_visible_text("fp8")
    lab.wait_for(lambda: fact(lab, "KV tokens per engine") != kv_before, 30, "the KV figure to change")
    lab.shot("explorer-fp8")
    kv_after = fact(lab, "KV tokens per engine")
    assert int(kv_after.replace(",", "")) > int(kv_before.replace(",", ""))  # fp8 halves the bytes per token
    assert "--kv-cache-dtype fp8" in lab.text_of("pre.sb-command")

    assert "Stage 03 launches" in lab.text_of(".sb-verdict")  # the plan's verdict, under the explorer
    next(b for b in lab.find("button") if b.text.strip() == "use this layout").click()
    lab.wait_for(lambda: lab.find(".sb-chosen"), 30, "the choice to be written")
    # the verdict gives way to the choice: never the new choice beside the stale "Stage 03 launches ..."
    lab.wait_for(lambda: "Chosen in the explorer" in lab.text_of(".sb-verdict"), 30, "the verdict to follow")
    said = lab.cell_text(lab.cell_count() - 2)
    assert said.count("Stage 03 launches") == 1 and "(the params)" not in said, said[-600:]
    lab.scroll_to(".sb-verdict")
    lab.shot("verdict-follows-the-choice")
    record = results.read(lab.outputs / results.INTERACTIVE_RUN, PlanRecord)
    assert record and record.launch_layout == "chosen" and record.chosen and record.chosen.kv_cache_dtype == "fp8"
    lab.run_cell(lab.cell_count() - 1)
    assert "Chosen in the explorer" in lab.cell_text(lab.cell_count() - 1)
    lab.shot("next-cell-reads-the-choice")
    chosen = record.params_for_launch(params.load(lab_mod.REPO / "params" / "default.yaml"))
    assert chosen.kv_cache_dtype == "fp8"  # what stage 03 launches with

    # the params picker under the parameters cell: another file, and the notebook's `p` follows it
    picker = next(s for s in lab.find(".widget-dropdown select") if "../params/ci.yaml" in s.text)
    Select(picker).select_by_visible_text("../params/ci.yaml")
    lab.wait_for(lambda: "from ../params/ci.yaml" in lab.text_of(".widget-vbox .widget-html"), 30, "the picker's note")
    lab.js("document.querySelector('.widget-dropdown select').scrollIntoView({block: 'center'});")
    lab.shot("params-picker")


SMALL = {
    "model": "builtin:tiny-qwen3-moe", "port": LIVE_PORT, "max_model_len": 1024, "enforce_eager": True,
    "cpu_kv_cache_gib": 1, "device": "cpu", "stop_leftovers": True,
    "bench_max_concurrency": 4, "bench_prompts_per_level": 8, "bench_min_level_s": 2.0, "bench_repeats": 1,
    # a wide gain: one 2-second window per level on two busy cores can dip 10 % at 2 streams, which a narrow gain
    # calls a decline and ends the sweep before the chart has three points to show (seen in a fresh-clone run)
    "bench_max_repeats": 1, "bench_input_len": 32, "bench_output_len": 16, "bench_plateau_gain": 0.3,
}  # fmt: skip


def use_params_file(lab, notebook: str, name: str) -> None:
    """Point a notebook's params_file at another file, in both twins, as a person editing the cell does."""
    for twin in (f"{notebook}.ipynb", f"{notebook}.py"):
        path = lab.root / "notebooks" / twin
        path.write_text(path.read_text().replace("../params/default.yaml", f"../params/{name}"))


@pytest.fixture
def small_server_params(lab):
    (lab.root / "params" / "browser-small.yaml").write_text(json.dumps(SMALL))
    for notebook in ("03_launch", "05_benchmark"):
        use_params_file(lab, notebook, "browser-small.yaml")
    yield SMALL
    server.stop(port=LIVE_PORT)  # whatever the notebooks started


def plot_points(lab, title: str, layer: str) -> int:
    """Points (markers or bars) of the first trace of the plot whose title starts with ``title``, read in the page."""
    return int(
        lab.js(
            "const plots = [...document.querySelectorAll('.js-plotly-plot')].filter(p =>"
            " (p.querySelector('.gtitle') || {}).textContent?.startsWith(arguments[0]));"
            "if (!plots.length) return 0;"
            "const t = plots[plots.length - 1].querySelector(arguments[1] + ' .trace');"
            "return t ? t.querySelectorAll('.point').length : 0;",
            title,
            layer,
        )
    )


def watch_growing(lab, count, timeout: float, shot_as) -> list[int]:
    """Run every cell and note each new value of ``count()`` (read in the page) until the cells finish: what a
    person watching sees arrive, with a screenshot where ``shot_as(n, seen)`` names one."""
    lab.command("notebook:run-all-cells")
    seen: list[int] = []
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        n = count()
        if n and (not seen or n > seen[-1]):
            seen.append(n)
            if name := shot_as(n, seen):
                lab.shot(name)
        if (seen or time.monotonic() - started > 15) and lab.js(lab_mod.BUSY_JS) == "idle":
            break  # done, or a cell failed before anything grew (the assertions below say which)
        time.sleep(0.3)
    lab.wait_idle(120)
    return seen


# every value the sweep's live status line takes, noted by the page as it renders it
RECORD_LEVELS_JS = """
window.sbLevelsRendered = [];
new MutationObserver(() => {
  const e = document.querySelector('.sb-live-levels');
  const n = e ? +e.dataset.levels : 0, seen = window.sbLevelsRendered;
  if (n && (!seen.length || n > seen[seen.length - 1])) seen.push(n);
}).observe(document.body, {subtree: true, childList: true, attributes: true, attributeFilter: ['data-levels']});
"""

PROGRESS_JS = """
const bar = document.querySelector('.widget-hprogress .progress-bar');
const labels = bar ? [...bar.closest('.widget-hbox').querySelectorAll('.widget-label')] : [];
return bar ? [parseFloat(bar.style.width) || 0, labels.length ? labels[labels.length - 1].innerText : ''] : [-1, ''];
"""


CELLS = "return window.jupyterapp.shell.currentWidget.content.widgets"


def show_cell(lab, index: int) -> None:
    lab.js(f"{CELLS.removeprefix('return ')}[{index}].node.scrollIntoView({{block: 'start'}});")


def set_cell(lab, index: int, source: str) -> None:
    """Replace a cell's text, as a person typing into it does (the document is marked modified)."""
    lab.js(f"{CELLS}[{index}].model.sharedModel.setSource(arguments[0]);", source)


def test_the_launch_draws_its_phases_and_the_sweep_gains_a_point_per_level(lab, small_server_params):
    """03 then 05 in JupyterLab on the CPU: the start-up phases drawn as they end (the progress bar moving with
    them), then the sweep's chart growing level by level while it runs, beside the host panel; then 03 again: the
    running server reused with a full bar, and, with max_model_len typed into 03's cell, relaunched with the
    difference named."""
    lab.open("03_launch.ipynb")
    progress_seen: list[float] = []

    def phases_drawn() -> int:
        progress_seen.append(lab.js(PROGRESS_JS)[0])
        return plot_points(lab, "launch: phases so far", ".barlayer")

    phases_seen = watch_growing(
        lab, phases_drawn, 400, lambda n, seen: f"launch-{n}-phases" if len(seen) in (1, 3) else "",
    )  # fmt: skip
    assert lab.errors() == []
    assert len(phases_seen) >= 2 and phases_seen[-1] >= 5, phases_seen  # drawn as they ended, not all at once
    # the bar moves with the start's milestones, not from empty to full at the end
    assert any(0 < width < 100 for width in progress_seen), sorted(set(progress_seen))
    assert lab.js(PROGRESS_JS)[0] == 100
    lab.shot("launch-ready")

    def levels_now() -> int:  # read in the page: the status line is re-rendered at every level
        return int(lab.js("const e = document.querySelector('.sb-live-levels'); return e ? +e.dataset.levels : 0;"))

    def level_shot(n: int, seen: list[int]) -> str:
        # one shot mid-sweep: a screenshot on two busy cores can outlast a 2-second level, which the watch would
        # then miss (a fresh-clone run once saw levels 1 and 3 only, with a shot at every level)
        if n != 2:
            return ""
        lab.scroll_to(".sb-live-levels")
        return f"live-{n}-levels"

    lab.open("05_benchmark.ipynb")
    lab.js(RECORD_LEVELS_JS)
    seen = watch_growing(lab, levels_now, 300, level_shot)
    assert lab.errors() == []
    # 1, 2, 4 streams: one point per level, each drawn as it arrived (recorded by the page at every render: a poll
    # from two busy cores once read levels 1 and 3 only)
    rendered = lab.js("return window.sbLevelsRendered || [];")
    assert rendered[:3] == [1, 2, 3], (rendered, seen)
    assert seen[-1] == rendered[-1]
    assert plot_points(lab, "Sweep so far", ".scatterlayer") == seen[-1]
    assert lab.find("table.sb-gpu-panel")  # the host panel on the CPU, refreshed while it ran
    lab.scroll_to(".sb-live-levels")
    lab.shot("sweep-done")
    explorer = lab.find(".widget-dropdown select")
    assert explorer, "the level explorer"
    lab.js("arguments[0].scrollIntoView({block: 'center'});", explorer[-1])
    lab.shot("level-explorer")

    lab.open("03_launch.ipynb")
    lab.run_all(timeout=120)
    width, label = lab.js(PROGRESS_JS)
    assert width == 100 and "reusing the healthy server" in label, (width, label)  # never "starting" for good
    assert "reused" in lab.cell_text(4)
    show_cell(lab, 2)
    lab.shot("launch-reused")

    # a value typed in 03's cell wins over the params file, and the running server is not reused for it
    source = str(lab.js(f"{CELLS}[1].model.sharedModel.getSource();"))
    assert "\nmax_model_len" in source
    set_cell(lab, 1, re.sub(r"\nmax_model_len: int = \d+", "\nmax_model_len: int = 2048", source))
    lab.run_all(timeout=400)
    assert lab.errors() == []
    said = lab.cell_text(2)
    assert "--max-model-len 1024 → 2048" in said, said[-2000:]
    assert "max_model_len" in said and "edited in this notebook" in said
    running = server.registered(LIVE_PORT)
    assert running and "2048" in running.command
    show_cell(lab, 2)
    lab.shot("launch-typed-value-wins")


def test_compare_overlays_two_picked_runs(lab):
    examples = lab.root / "docs" / "examples"
    for run in ("run-bf16-tp1", "run-fp8-tp2ep"):
        shutil.copytree(lab_mod.REPO / "docs" / "examples" / "h200-vllm" / run, examples / run)
    lab.open("compare.ipynb")
    lab.run_all(timeout=120)
    picker = lab.find(".widget-select-multiple select")[0]
    lab.js(
        "const s = arguments[0]; for (const o of s.options) o.selected = true;"
        "s.dispatchEvent(new Event('change', {bubbles: true}));",
        picker,
    )
    lab.wait_for(lambda: lab.find(".sb-picked"), 30, "the picker to take the runs")
    lab.shot("picked")
    lab.run_cell(lab.cell_count() - 1)
    lab.wait_for(lambda: lab.find(".js-plotly-plot .legend .traces"), 60, "the comparison figure")
    lab.scroll_to(".js-plotly-plot")
    lab.shot("compared")
    assert len(lab.find(".js-plotly-plot .legend .traces")) == 2
    assert "never cross" in lab.cell_text(lab.cell_count() - 1) or "cross over" in lab.cell_text(lab.cell_count() - 1)


def test_a_session_in_the_working_copy_leaves_the_checkout_as_it_was(tmp_path):
    """Issue #41 point 2: JupyterLab as `servebook lab` starts it, a notebook edited, run and saved there; the
    project's notebooks and params stay byte for byte, and git sees no change the session made."""
    from servebook import lab as workbook_copy

    tracked = ("notebooks", "params")

    def checkout() -> tuple[str, dict[str, bytes]]:
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", *tracked],
            cwd=lab_mod.REPO, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        files = {str(p): p.read_bytes() for t in tracked for p in sorted((lab_mod.REPO / t).rglob("*")) if p.is_file()}
        return status, files

    before = checkout()
    work = tmp_path / "wb"
    env = {"SERVEBOOK_WORKBOOK": str(work), "SERVEBOOK_OUTPUTS": str(tmp_path / "outputs")}
    made = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "lab", "--prepare-only"],
        capture_output=True, text=True, env={**os.environ, **env}, timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    shots = SHOTS / "working-copy"
    shutil.rmtree(shots, ignore_errors=True)
    lab = lab_mod.Lab(work, shots, env=env, command=lambda port: workbook_copy.lab_command(work, port))
    try:
        lab.open("00_reconnaissance.ipynb")
        source = str(lab.js(f"{CELLS}[1].model.sharedModel.getSource();"))
        set_cell(lab, 1, source.replace("tensor_parallel_size: int = 1", "tensor_parallel_size: int = 4"))
        lab.run_all(timeout=240)
        lab.command("docmanager:save")
        lab.wait_for(lambda: not lab.dirty(), 30, "the save")
        lab.shot("edited-run-saved")
    finally:
        lab.close()
    mine = (work / "00_reconnaissance.ipynb").read_text()
    assert "tensor_parallel_size: int = 4" in mine and '"outputs": [\n' in mine  # the session was saved: here
    assert checkout() == before  # and only here
