"""Notebooks against the vocabulary and the params files, without starting a kernel."""

import json
from pathlib import Path

import jupytext
import nbformat

from servebook import params, runner, stages

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_there_are_stage_notebooks():
    names = [nb.stem for nb in NOTEBOOKS]
    assert names[:1] == ["00_reconnaissance"] and "03_launch" in names and "04_smoke_test" in names


def test_params_files_and_notebooks_agree():
    problems = runner.check_params_against_notebooks(sorted((REPO / "params").glob("*.yaml")), NOTEBOOKS)
    assert problems == []


def test_the_check_catches_an_undeclared_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: builtin:tiny-qwen3-moe\n")
    nb = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )
    nb.cells.append(nbformat.v4.new_code_cell("port: int = 1234  # the port", metadata={"tags": ["parameters"]}))
    path = tmp_path / "00_x.ipynb"
    nbformat.write(nb, path)
    problems = runner.check_params_against_notebooks([bad], [path])
    assert any("sets 'model', which no notebook declares" in p for p in problems)
    assert any("'port' defaults to 1234, the vocabulary says 8000" in p for p in problems)


def test_notebooks_in_git_carry_no_outputs():
    for nb in NOTEBOOKS:
        data = json.loads(nb.read_text())
        for cell in data["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs") and not cell.get("execution_count"), f"{nb.name} has outputs; strip them"


def test_py_percent_twins_match_the_notebooks():
    for nb in NOTEBOOKS:
        twin = nb.with_suffix(".py")
        assert twin.is_file(), f"{twin.name} is missing; run jupytext --sync {nb}"
        a = [c.source for c in jupytext.read(nb).cells]
        b = [c.source for c in jupytext.read(twin).cells]
        assert a == b, f"{nb.name} and {twin.name} differ; run jupytext --sync {nb}"


def test_each_notebook_starts_with_a_description():
    for nb in NOTEBOOKS:
        first = nbformat.read(nb, as_version=4).cells[0]
        assert first.cell_type == "markdown" and first.source.startswith("# "), nb.name


def test_stage_selection():
    picked = stages.select("launch,00")
    assert [s.record.FILE for s in picked] == ["00_reconnaissance", "03_launch"]
    try:
        stages.select("lunch")
    except params.ParamsError as exc:
        assert "unknown stage 'lunch'" in str(exc)
    else:
        raise AssertionError("an unknown stage was accepted")
