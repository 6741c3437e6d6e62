"""The pipeline: validate params, execute the stage notebooks with papermill, record, report.

A run gets a fresh ``outputs/<timestamp>-<run_name>/`` that is never reused; it
holds each executed notebook, each stage's results JSON, a manifest and one
HTML report, also when a stage fails.
"""

from __future__ import annotations

import ast
import os
import socket
import sys
import time
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import nbformat
import papermill as pm

from servebook import environment, report
from servebook import params as params_mod
from servebook.errors import ParamsError
from servebook.results import mask, outputs_root, read, repo_root, secret_values, stage_of

RUNNER_PARAMS = {"run_dir"}  # set by the runner, never by a params file


def notebooks_dir() -> Path:
    return Path(os.environ.get("SERVEBOOK_NOTEBOOKS", repo_root() / "notebooks"))


def stage_notebooks() -> list[Path]:
    return sorted(p for p in notebooks_dir().glob("[0-9][0-9]_*.ipynb"))


def declared_parameters(notebook: Path) -> dict[str, dict[str, Any]]:
    """The parameters a notebook declares, read without starting a kernel."""
    return pm.inspect_notebook(str(notebook))


def select_stages(wanted: str | None) -> list[Path]:
    """Notebooks for ``--stages`` (names like ``launch`` or numbers like ``03``), in pipeline order."""
    available = stage_notebooks()
    if not wanted:
        return available
    picked = []
    known = {stage_of(p): p for p in available} | {p.stem[:2]: p for p in available} | {p.stem: p for p in available}
    unknown = []
    for item in (w.strip() for w in wanted.split(",") if w.strip()):
        if item in known:
            picked.append(known[item])
        else:
            unknown.append(item)
    if unknown:
        names = ", ".join(stage_of(p) for p in available)
        raise ParamsError("--stages", [f"unknown stage '{u}'; known stages: {names}" for u in unknown])
    return sorted(set(picked))


def new_run_dir(run_name: str, root: Path | None = None) -> Path:
    """Create a run folder that did not exist before (a suffix is added on a clash)."""
    root = root or outputs_root()
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = root / (f"{stamp}-{run_name}" if n == 1 else f"{stamp}-{run_name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {root}")


def _scrub_notebook(path: Path, secrets: list[str]) -> None:
    """Belt and braces: no secret value from the environment survives in an executed notebook."""
    if not secrets or not path.is_file():
        return
    text = path.read_text()
    masked = mask(text, secrets)
    if masked != text:
        path.write_text(masked)


def _stage_error(exc: BaseException) -> str:
    if isinstance(exc, pm.PapermillExecutionError):
        return f"{exc.ename}: {exc.evalue}"
    return f"{type(exc).__name__}: {exc}"


def stop_started_server(run_dir: Path, log: Callable[[str], None]) -> dict[str, Any] | None:
    """Stop the server this run launched (not one it reused), verifying nothing is left."""
    launch = read(run_dir, "launch")
    if not launch or not launch.get("started_by_this_run"):
        return None
    from servebook import server

    outcome = server.stop(port=launch["port"], host=launch["host"])
    log(f"stopped the server this run started on port {launch['port']}: {outcome['summary']}")
    return outcome


def run(
    params_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    stages: str | None = None,
    log: Callable[[str], None] = print,
) -> tuple[Path, int]:
    """Execute the pipeline; returns (run folder, exit code)."""
    params = params_mod.load(params_path, overrides)  # raises before anything exists
    notebooks = select_stages(stages)
    declared = {nb: declared_parameters(nb) for nb in notebooks}
    run_dir = new_run_dir(params.run_name)
    secrets = secret_values()
    manifest: dict[str, Any] = {
        "run_name": params.run_name,
        "run_dir": str(run_dir),
        "params_file": str(params_path),
        "overrides": list(overrides),
        "params": params.model_dump(),
        "command": " ".join(sys.argv),
        "started_at": datetime.now(timezone.utc).isoformat(),
        "host": {"hostname": socket.gethostname(), **environment.host(params.model_store)},
        "versions": environment.versions(),
        "git_commit": environment.git_commit(repo_root()),
        "stages": [],
        "status": "running",
    }
    exit_code = 0
    total = len(notebooks)
    for n, nb in enumerate(notebooks, 1):
        name = nb.stem
        values = params_mod.notebook_values(params, set(declared[nb]))
        if "run_dir" in declared[nb]:
            values["run_dir"] = str(run_dir)
        out = run_dir / nb.name
        log(f"[{n}/{total}] {name} ...")
        start = time.monotonic()
        entry: dict[str, Any] = {"name": name, "notebook": str(out), "results": f"{name}.json"}
        try:
            pm.execute_notebook(
                str(nb), str(out), parameters=values, kernel_name="python3", cwd=str(nb.parent),
                progress_bar=False, log_output=False, report_mode=False,
            )
            entry["status"] = "ok"
        except Exception as exc:  # papermill has saved the notebook with the failing cell marked
            entry["status"] = "failed"
            entry["error"] = mask(_stage_error(exc), secrets)
            exit_code = 1
        entry["seconds"] = round(time.monotonic() - start, 2)
        _scrub_notebook(out, secrets)
        manifest["stages"].append(entry)
        log(f"[{n}/{total}] {name} {entry['status']} in {entry['seconds']:.1f} s"
            + (f": {entry['error'].splitlines()[0] if entry['error'] else ''}" if entry["status"] == "failed" else ""))
        if exit_code:
            for rest in notebooks[n:]:
                manifest["stages"].append({"name": rest.stem, "status": "skipped", "seconds": 0})
            break
    if not params.keep_server:
        try:
            manifest["server_stop"] = stop_started_server(run_dir, log)
        except Exception as exc:
            manifest["server_stop"] = {"error": str(exc)}
            log(f"could not stop the server this run started: {exc}")
            exit_code = exit_code or 1
    manifest["status"] = "ok" if exit_code == 0 else "failed"
    manifest["ended_at"] = datetime.now(timezone.utc).isoformat()
    manifest["seconds"] = round(sum(s.get("seconds", 0) for s in manifest["stages"]), 2)
    (run_dir / "manifest.json").write_text(mask(json.dumps(manifest, indent=2, default=str), secrets))
    report_path = report.build(run_dir, manifest)
    log(f"report: {report_path} ({report_path.stat().st_size / 1e6:.1f} MB)")
    return run_dir, exit_code


def _check_declaration(nb_name: str, name: str, spec: dict[str, Any]) -> list[str]:
    """A declared parameter must be annotated, documented, and default to the vocabulary's default."""
    problems = []
    if spec.get("inferred_type_name") in (None, "None"):
        problems.append(f"{nb_name}: parameter '{name}' has no type annotation")
    if not spec.get("help"):
        problems.append(f"{nb_name}: parameter '{name}' has no trailing # help comment")
    if name in params_mod.FIELDS:
        try:
            default = ast.literal_eval(spec["default"])
        except (ValueError, SyntaxError):
            return problems + [f"{nb_name}: parameter '{name}' default {spec['default']} is not a literal"]
        expected = params_mod.Params.model_fields[name].get_default(call_default_factory=True)
        if default != expected:
            problems.append(f"{nb_name}: parameter '{name}' defaults to {default!r}, the vocabulary says {expected!r}")
    return problems


def prepare(params_path: str | Path, out_dir: str | Path, overrides: list[str] | tuple[str, ...] = (),
            run_dir: str | Path | None = None) -> list[Path]:
    """Write parameterized, unexecuted copies of the stage notebooks (for nbval or a later run)."""
    params = params_mod.load(params_path, overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for nb in stage_notebooks():
        declared = declared_parameters(nb)
        values = params_mod.notebook_values(params, set(declared))
        if run_dir is not None and "run_dir" in declared:
            values["run_dir"] = str(run_dir)
        target = out_dir / nb.name
        pm.execute_notebook(str(nb), str(target), parameters=values, prepare_only=True, kernel_name="python3")
        written.append(target)
    return written


def check_params_against_notebooks(params_files: list[Path], notebooks: list[Path]) -> list[str]:
    """Problems where a params file or the vocabulary disagrees with what notebooks declare."""
    problems = []
    declared_any: set[str] = set()
    for nb in notebooks:
        decl = declared_parameters(nb)
        declared_any |= set(decl)
        for name, spec in decl.items():
            if name not in params_mod.FIELDS and name not in RUNNER_PARAMS:
                problems.append(f"{nb.name} declares '{name}', which is not in servebook.params.Params")
            else:
                problems.extend(_check_declaration(nb.name, name, spec))
        nb_node = nbformat.read(nb, as_version=4)
        tagged = [c for c in nb_node.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        if len(tagged) != 1:
            problems.append(f"{nb.name} has {len(tagged)} cells tagged 'parameters'; it needs exactly one")
    for pf in params_files:
        try:
            values = params_mod.load(pf).model_dump(exclude_unset=True)
        except ParamsError as exc:
            problems.append(str(exc))
            continue
        for key in values:
            if key not in declared_any and key not in params_mod.RUN_LEVEL:
                problems.append(f"{pf.name} sets '{key}', which no notebook declares")
    unused = set(params_mod.FIELDS) - declared_any - params_mod.RUN_LEVEL
    for name in sorted(unused):
        problems.append(f"'{name}' is in the vocabulary but no notebook declares it")
    return problems
