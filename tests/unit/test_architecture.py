"""The design, checked: one stage table, modules that import alone, arrows that point one way, a stage
added with one module, one notebook and one table row."""

import ast
import concurrent.futures
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from servebook import params, results, runner, stages
from servebook.results import Record

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lib" / "servebook"
MODULES = sorted(
    ".".join(("servebook", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
    for p in PACKAGE.rglob("*.py")
)
# the floor above the core: what may know stages, their records and the pipeline (a topology owns its shape's
# launch record and systemd units, so it lives here, with the units' shared parts)
UPPER = {
    "servebook.stages",
    "servebook.records",
    "servebook.topology",
    "servebook.service",
    "servebook.runner",
    "servebook.beside",
    "servebook.workbook",
    "servebook.cli",
}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_every_module_imports_alone_in_a_fresh_interpreter():
    def load(module):
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=180)
        return module, proc.returncode, proc.stderr[-1500:]

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        failed = [(m, err) for m, code, err in pool.map(load, MODULES) if code != 0]
    assert failed == []


def test_the_core_never_imports_the_floor_above_it():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(("servebook", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
        if any(module == up or module.startswith(up + ".") for up in UPPER):
            continue
        wrong = {m for m in imported_modules(path) if any(m == up or m.startswith(up + ".") for up in UPPER)}
        offenders += [f"{path.name} imports {m}" for m in sorted(wrong)]
    assert offenders == []


def test_every_module_is_on_the_map_with_its_concern():
    """docs/architecture.md names every module of the package; a module it does not list fails here."""
    import re

    listed = set(re.findall(r"^\| `([a-z0-9_/]+(?:\.py)?)` \|", (REPO / "docs" / "architecture.md").read_text(), re.M))
    packages = {f"{p.parent.name}/" for p in PACKAGE.glob("*/__init__.py")}  # stages/, topology/
    on_disk = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"} | packages
    assert on_disk - listed == set(), f"add these to docs/architecture.md's module table: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"docs/architecture.md lists modules that are gone: {sorted(listed - on_disk)}"


def test_no_docstring_points_outside_the_repository():
    outside = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if "../shared" in p.read_text()]
    assert outside == []


def test_a_stage_reads_upstream_records_never_upstream_code():
    for path in (PACKAGE / "stages").glob("*.py"):
        if path.name == "__init__.py":
            continue
        siblings = {m for m in imported_modules(path) if m.startswith("servebook.stages")}
        assert siblings == set(), f"{path.name} imports another stage: {siblings}"


def test_the_stage_table_is_the_one_list_of_stages():
    numbers = [s.number for s in stages.STAGES]
    files = [s.record.FILE for s in stages.STAGES]
    # in pipeline order; a number may name two stages that can run side by side (02: download and rehearse)
    assert numbers == sorted(numbers) and len(set(files)) == len(files)
    names = [s.name for s in stages.STAGES]
    for stage in stages.STAGES:
        assert stage.record.FILE == f"{stage.number:02d}_{stage.name}" and issubclass(stage.record, Record)
        assert (REPO / "notebooks" / stage.notebook).is_file(), stage.notebook
        for function in ("run", "check", "summary"):
            assert callable(getattr(stage.module, function, None)), f"{stage.module.__name__}.{function}"
        assert set(stage.needs) | set(stage.requires) <= set(names[: names.index(stage.name)])
    on_disk = sorted(p.name for p in (REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert on_disk == sorted(s.notebook for s in stages.STAGES)
    assert [p.name for p in runner.stage_notebooks()] == [s.notebook for s in stages.STAGES]


def test_every_parameter_has_a_type_and_a_description():
    for name in params.FIELDS:
        line = params.parameter_line(name)
        assert ": " in line and "  # " in line and line.split("  # ")[1].strip(), line


KERNEL = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}


def test_a_drifted_parameters_cell_is_caught(tmp_path):
    nb = nbformat.v4.new_notebook(metadata=KERNEL)
    nb.cells.append(nbformat.v4.new_code_cell("port: int = 8000  # some port", metadata={"tags": ["parameters"]}))
    path = tmp_path / "00_x.ipynb"
    nbformat.write(nb, path)
    problems = runner.check_params_against_notebooks([], [path])
    assert any("parameters cell differs from what servebook.params renders" in p for p in problems)


TOY_MODULE = '''
"""A toy stage: counts the files in the run folder."""

from pathlib import Path

from servebook import results
from servebook.results import Record


class ToyRecord(Record):
    FILE = "08_toy"
    files: int


def run(p, run_dir):
    record = ToyRecord(files=len(list(Path(run_dir).iterdir())))
    results.write(run_dir, record)
    return record


def check(record, p):
    if record.files < 0:
        raise ValueError("impossible")


def summary(record):
    return f"the toy counted {record.files} files"
'''


def test_a_new_stage_is_one_module_one_notebook_and_one_table_row(tmp_path, monkeypatch):
    code = tmp_path / "code"
    code.mkdir()
    (code / "toy_stage.py").write_text(textwrap.dedent(TOY_MODULE))
    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    nb = nbformat.v4.new_notebook(metadata=KERNEL)
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 08 · Toy"),
        nbformat.v4.new_code_cell(params.parameters_cell(["run_dir"]), metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(
            "from servebook import params\nimport toy_stage as stage\n"
            "p = params.from_namespace(globals())\nrecord = stage.run(p, run_dir)\n"
            "stage.check(record, p)\nprint(stage.summary(record))"
        ),
    ]
    nbformat.write(nb, notebooks / "08_toy.ipynb")
    monkeypatch.syspath_prepend(str(code))
    monkeypatch.setenv("PYTHONPATH", str(code))  # the kernel imports the stage too
    monkeypatch.setenv("SERVEBOOK_NOTEBOOKS", str(notebooks))
    monkeypatch.setenv("SERVEBOOK_OUTPUTS", str(tmp_path / "outputs"))
    import toy_stage

    monkeypatch.setattr(stages, "STAGES", [*stages.STAGES, stages.Stage(toy_stage.ToyRecord, toy_stage)])

    run_dir, code_ = runner.run(REPO / "params" / "ci.yaml", wanted="toy", log=lambda _: None)
    assert code_ == 0
    record = results.read(run_dir, toy_stage.ToyRecord)
    assert record is not None and record.files >= 1
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"] == [
        {
            "name": "08_toy",
            "status": "ok",
            "seconds": pytest.approx(0, abs=600),
            "started_s": pytest.approx(0, abs=60),
            "error": "",
            "summary": f"the toy counted {record.files} files",
        }
    ]
    html = (run_dir / "report.html").read_text()
    assert "the toy counted" in html and "08_toy" in html


MAX_FUNCTION_LINES = 80


def test_no_function_of_the_library_is_longer_than_80_lines():
    """Ruff counts branches (C901) and arguments (PLR0913, PLR0917); this counts lines, decorators and docstring
    included, of every function and method in the package."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} {lines} lines")
    assert long == [], f"split these below {MAX_FUNCTION_LINES} lines: {long}"


def test_the_layout_and_loose_mappings_stay_in_few_places():
    """Issue #38's limits: the layout's field names spelled in at most 4 library files (the rest read
    ``serving.LAYOUT``), and at most 25 ``dict[str, Any]``."""
    from servebook import serving

    sources = {p: p.read_text() for p in (REPO / "lib" / "servebook").rglob("*.py")}
    spelled = sorted(p.name for p, text in sources.items() if any(name in text for name in serving.LAYOUT[:3]))
    assert len(spelled) <= 4, spelled
    assert sum(text.count("dict[str, Any]") for text in sources.values()) <= 25
