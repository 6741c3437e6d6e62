"""Issue #41 point 2: a person works in a copy of the notebooks (`servebook lab`), so the tracked notebooks stay
as committed; a copy once made is theirs and never overwritten."""

import os
import subprocess
import sys
from pathlib import Path

from servebook import lab, params

REPO = Path(__file__).resolve().parents[2]


def test_the_working_copy_is_made_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVEBOOK_WORKBOOK", str(tmp_path / "workbook"))
    work, copied, newer = lab.prepare_workbook()
    templates = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    assert copied == templates and newer == [] and sorted(p.name for p in work.glob("*.ipynb")) == templates
    mine = work / "03_launch.ipynb"
    mine.write_text(mine.read_text().replace("tensor_parallel_size: int = 1", "tensor_parallel_size: int = 4"))
    os.utime(mine, (1, 1))  # older than its template
    _, copied, newer = lab.prepare_workbook()
    assert copied == [] and newer == ["03_launch.ipynb"]
    assert "tensor_parallel_size: int = 4" in mine.read_text()  # the person's edit stays
    assert "tensor_parallel_size: int = 4" not in (REPO / "notebooks" / "03_launch.ipynb").read_text()


def test_the_copy_finds_the_params_file_as_the_template_does(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVEBOOK_WORKBOOK", str(tmp_path / "elsewhere" / "deeper"))
    work, _, _ = lab.prepare_workbook()
    monkeypatch.chdir(work)  # the kernel's working directory is the notebook's folder
    assert params.resolve_params_file("../params/default.yaml").resolve() == REPO / "params" / "default.yaml"


def test_servebook_lab_serves_the_copy_on_localhost_without_a_browser(tmp_path):
    before = {p.name: p.read_bytes() for p in (REPO / "notebooks").iterdir() if p.is_file()}
    env = {**os.environ, "SERVEBOOK_WORKBOOK": str(tmp_path / "wb")}
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "lab", "--prepare-only", "--port", "8899"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"--ServerApp.root_dir={tmp_path / 'wb'}" in proc.stdout and "--no-browser" in proc.stdout
    assert "--ip=127.0.0.1" in proc.stdout and "ssh -N -L 8899:127.0.0.1:8899" in proc.stdout
    assert {p.name: p.read_bytes() for p in (REPO / "notebooks").iterdir() if p.is_file()} == before
