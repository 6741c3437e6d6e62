"""Downloads against a real Hugging Face-compatible server (olah, offline mirror of a local git repository)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from servebook import models

from ..support import hub_mirror

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
HUB_REPO = "servebook/tiny-qwen3-moe"


@pytest.fixture(scope="session")
def hub(tmp_path_factory):
    """olah on 127.0.0.1 serving the tiny checkpoint from a local git repository, offline."""
    root = tmp_path_factory.mktemp("hub")
    shutil.copytree(models.build_tiny_model(), root / "mirrors" / "models" / HUB_REPO)
    mirror = hub_mirror.commit_mirror(root, HUB_REPO)
    with hub_mirror.serving(root) as endpoint:
        yield {"endpoint": endpoint, "source": mirror}


def run_download(hub, tmp_path, *sets):
    params = tmp_path / "params.yaml"
    params.write_text(f"run_name: dl\nmodel: {HUB_REPO}\nmodel_store: {tmp_path / 'store'}\ndownload_workers: 4\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(
        HF_ENDPOINT=hub["endpoint"],
        HF_HOME=str(tmp_path / "hf-home"),
        SERVEBOOK_OUTPUTS=str(tmp_path / "outputs"),
        HF_HUB_DISABLE_XET="1",
    )
    args = [x for s in sets for x in ("--set", s)]
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "download", str(params), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    result = None
    if proc.returncode in (0, 1):
        runs = sorted((tmp_path / "outputs").glob("*-dl-download"))
        if runs and (runs[-1] / "02_download.json").is_file():
            result = json.loads((runs[-1] / "02_download.json").read_text())
    return proc, result


def target(tmp_path) -> Path:
    return tmp_path / "store" / HUB_REPO


def test_full_download_is_verified_byte_for_byte(hub, tmp_path):
    proc, result = run_download(hub, tmp_path)
    assert proc.returncode == 0
    assert result["verification"]["ok"] and result["commit"] and len(result["commit"]) == 40
    assert sorted(result["fetch"]["fetched_files"]) == sorted(p.name for p in hub["source"].iterdir() if p.is_file())
    for src in hub["source"].iterdir():
        if src.is_file():
            assert (target(tmp_path) / src.name).read_bytes() == src.read_bytes()
    assert result["verification"]["tensor_bytes"] > 2_000_000


def test_an_interrupted_download_fetches_only_what_is_missing(hub, tmp_path):
    assert run_download(hub, tmp_path)[0].returncode == 0
    (target(tmp_path) / "tokenizer.json").unlink()  # never arrived
    shard = target(tmp_path) / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:1_000_000])  # cut off mid-file
    untouched = (target(tmp_path) / "config.json").stat().st_mtime_ns
    proc, result = run_download(hub, tmp_path)
    assert proc.returncode == 0 and result["verification"]["ok"]
    assert sorted(result["fetch"]["fetched_files"]) == ["model.safetensors", "tokenizer.json"]
    assert "config.json" in result["fetch"]["skipped_files"]
    assert (target(tmp_path) / "config.json").stat().st_mtime_ns == untouched


def test_a_corrupted_file_is_caught_by_its_checksum(hub, tmp_path):
    assert run_download(hub, tmp_path)[0].returncode == 0
    shard = target(tmp_path) / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, one byte flipped
    shard.write_bytes(bytes(data))
    proc, result = run_download(hub, tmp_path)
    assert proc.returncode == 1
    assert not result["verification"]["ok"]
    assert "model.safetensors: git blob" in proc.stderr and "delete it and run the download again" in proc.stderr


def test_preflight_refuses_when_the_disk_cannot_hold_it(hub, tmp_path):
    proc, _ = run_download(hub, tmp_path, "download_disk_margin=1000000")
    assert proc.returncode == 3
    assert "GB free but the download needs" in proc.stderr and "model_store" in proc.stderr
    assert not target(tmp_path).exists()  # nothing fetched


def test_wrong_repository_or_revision_is_a_clear_error(hub, tmp_path):
    proc, _ = run_download(hub, tmp_path, "download_revision=no-such-branch")
    assert proc.returncode == 1 and "revision 'no-such-branch'" in proc.stderr
    proc, _ = run_download(hub, tmp_path, "model=servebook/no-such-model")
    assert proc.returncode == 1 and "servebook/no-such-model" in proc.stderr
