import json

import nbformat
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import pytest

from servebook import environment, report, results, runner, server
from servebook.errors import MissingRecord
from servebook.records import BenchmarkRecord, LaunchRecord
from servebook.results import Manifest, StageRun

from ..support import report_check


def executed_notebook(path, secret=""):
    nb = nbformat.v4.new_notebook()
    fig = go.Figure(go.Scatter(x=[1, 2, 4], y=[10, 20, 25], name="tok/s"))
    cell = nbformat.v4.new_code_cell("show()")
    cell.outputs = [
        nbformat.v4.new_output("display_data", data={report.PLOTLY_MIME: fig.to_plotly_json(), "text/plain": "fig"}),
        nbformat.v4.new_output("stream", text=f"token {secret}\n"),
    ]
    nb.cells = [nbformat.v4.new_markdown_cell("# Stage"), cell]
    nbformat.write(nb, path)


def test_report_draws_plots_offline_with_one_plotly_js(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_supersecretvalue")
    for name in ("00_a", "01_b"):
        executed_notebook(tmp_path / f"{name}.ipynb", secret="hf_supersecretvalue")
    manifest = Manifest(
        run_name="t",
        run_dir=str(tmp_path),
        params_file="p.yaml",
        overrides=[],
        params={},
        command="",
        started_at="",
        host=environment.host(),
        versions={},
        git_commit=None,
        status="failed",
        stages=[
            StageRun(name="00_a", status="ok", seconds=1.0, summary="the answer | with a bar"),
            StageRun(name="01_b", status="failed", seconds=2.0, error="LaunchError: boom <here>"),
        ],
    )
    html = report.build(tmp_path, manifest).read_text()
    assert html.count("Plotly.newPlot") == 2
    assert html.count("plotly.js v") == 1  # the library's banner, embedded once
    assert "cdn.plot.ly" not in html.split("<body", 1)[1].split("Plotly.newPlot")[0]
    assert "Run failed at stage 01_b" in html and "LaunchError: boom &lt;here&gt;" in html
    assert "hf_supersecretvalue" not in html
    assert 'src="http' not in html  # no require.js, MathJax or mermaid from a CDN: it opens air-gapped
    assert "the answer \\| with a bar" in html.replace("&#124;", "\\|") or "the answer | with a bar" in html


def test_run_folders_are_never_reused(tmp_path):
    a = runner.new_run_dir("same", tmp_path)
    b = runner.new_run_dir("same", tmp_path)
    assert a != b and a.is_dir() and b.is_dir()


def test_results_round_trip_and_mask_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_API_KEY", "sk-verysecret")
    cfg = server.ServerConfig(model="m", model_path="/m", served_model_name="m", extra_args=["--x", "sk-verysecret"])
    path = results.write(tmp_path, LaunchRecord.planned(cfg))
    assert path.name == "03_launch.json"
    assert "sk-verysecret" not in path.read_text()
    back = results.read(tmp_path, LaunchRecord)
    assert back.command[-1] == "***" and back.layout.name == "TP=1" and back.config.served_model_name == "m"
    assert results.read(tmp_path, BenchmarkRecord) is None
    assert json.loads(path.read_text())["schema_version"] == results.SCHEMA_VERSION
    with pytest.raises(MissingRecord, match="run the launch stage first"):
        results.require(tmp_path / "elsewhere", LaunchRecord, "benchmark")


def _figure_notebook(path, fig):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("show()")
    cell.outputs = [nbformat.v4.new_output("display_data", data={report.PLOTLY_MIME: fig.to_plotly_json()})]
    nb.cells = [cell]
    nbformat.write(nb, path)


@pytest.mark.skipif(report_check.find_browser() is None, reason="no Chromium on this machine")
def test_the_browser_check_finds_requests_and_stretched_axes(tmp_path):
    """The checker itself: a request to the network, and an annotation at x=64 in data units on a log axis
    (plotly reads it as 10^64), are found; a readable log-axis plot, bars from zero and points drawn on axes from
    zero and facets sharing one range pass, but not an axis that runs far past its points."""
    readable = go.Figure(go.Scatter(x=[1, 2, 4, 8], y=[10, 20, 25, 26]), layout={"title": "readable"})
    readable.update_xaxes(type="log")
    stretched = go.Figure(go.Scatter(x=[1, 2, 4, 8], y=[10, 20, 25, 26]), layout={"title": "stretched"})
    stretched.update_xaxes(type="log")
    stretched.add_annotation(x=64, y=20, text="plateau")
    bars = go.Figure(go.Bar(x=["baseline", "variant"], y=[500, 520]), layout={"title": "bars"})
    from_zero = go.Figure(go.Scatter(x=[141.2, 182.5], y=[179.5, 153.6]), layout={"title": "from zero"})
    from_zero.update_xaxes(rangemode="tozero").update_yaxes(rangemode="tozero")
    past_points = go.Figure(go.Scatter(x=[141.2, 182.5], y=[179.5, 153.6]), layout={"title": "past its points"})
    past_points.update_yaxes(range=[0, 2000])
    facets = px.line(
        pd.DataFrame({"bytes": [1, 2, 1, 2], "us": [1261.0, 3030.0, 1500.0, 9000.0], "op": ["a", "a", "b", "b"]}),
        x="bytes", y="us", facet_col="op", title="facets",
    )  # fmt: skip
    figures = (readable, stretched, bars, from_zero, past_points, facets)
    for i, fig in enumerate(figures):
        _figure_notebook(tmp_path / f"0{i}_s.ipynb", fig)
    manifest = Manifest(
        run_name="t", run_dir=str(tmp_path), params_file="p.yaml", overrides=[], params={}, command="",
        started_at="", host=environment.host(), versions={}, git_commit=None, status="ok",
        stages=[StageRun(name=f"0{i}_s", status="ok", seconds=1.0, summary="s") for i in range(len(figures))],
    )  # fmt: skip
    page = report.build(tmp_path, manifest)
    page.write_text(page.read_text().replace("</body>", '<img src="http://example.com/pixel.png"></body>'))
    found = report_check.check(page)
    titles = ["readable", "stretched", "bars", "from zero", "past its points", "facets"]
    assert [f.title for f in found.figures] == titles
    assert all(f.drawn for f in found.figures)
    # facets share one y range: each is judged with the data of all (1261..9000), not alone (1261..3030)
    assert [f.problems for f in found.figures if f.index in (0, 2, 3, 5)] == [[], [], [], []]
    assert "stretched" in found.figures[1].problems[0] and "xaxis" in found.figures[1].problems[0]
    assert len(found.figures[4].problems) == 1 and "yaxis range 0..2000 is stretched" in found.figures[4].problems[0]
    assert found.requests == ["http://example.com/pixel.png"] and not found.ok
