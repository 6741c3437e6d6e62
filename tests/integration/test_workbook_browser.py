"""The interactive workbook in a real JupyterLab (the project's, from .venv), driven in Debian's headless Chromium.

Each step leaves a screenshot in build/workbook-shots/<test>/ (the test's folder keeps a copy): what a person
sees, to look at, not only to assert on.
"""

from __future__ import annotations

import json
import shutil
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

    next(b for b in lab.find("button") if b.text.strip() == "use this layout").click()
    lab.wait_for(lambda: lab.find(".sb-chosen"), 30, "the choice to be written")
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


def test_the_launch_draws_its_phases_and_the_sweep_gains_a_point_per_level(lab, small_server_params):
    """03 then 05 in JupyterLab on the CPU: the start-up phases drawn as they end, then the sweep's chart growing
    level by level while it runs, beside the host panel."""
    lab.open("03_launch.ipynb")
    phases_seen = watch_growing(
        lab, lambda: plot_points(lab, "launch: phases so far", ".barlayer"), 400,
        lambda n, seen: f"launch-{n}-phases" if len(seen) in (1, 3) else "",
    )  # fmt: skip
    assert lab.errors() == []
    assert len(phases_seen) >= 2 and phases_seen[-1] >= 5, phases_seen  # drawn as they ended, not all at once
    lab.shot("launch-ready")

    def levels_now() -> int:  # read in the page: the status line is re-rendered at every level
        return int(lab.js("const e = document.querySelector('.sb-live-levels'); return e ? +e.dataset.levels : 0;"))

    def level_shot(n: int, seen: list[int]) -> str:
        lab.scroll_to(".sb-live-levels")
        return f"live-{n}-levels"

    lab.open("05_benchmark.ipynb")
    seen = watch_growing(lab, levels_now, 300, level_shot)
    assert lab.errors() == []
    assert seen[:3] == [1, 2, 3], seen  # 1, 2, 4 streams: one point per level, each seen as it arrived
    assert plot_points(lab, "Sweep so far", ".scatterlayer") == seen[-1]
    assert lab.find("table.sb-gpu-panel")  # the host panel on the CPU, refreshed while it ran
    lab.scroll_to(".sb-live-levels")
    lab.shot("sweep-done")
    explorer = lab.find(".widget-dropdown select")
    assert explorer, "the level explorer"
    lab.js("arguments[0].scrollIntoView({block: 'center'});", explorer[-1])
    lab.shot("level-explorer")


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
