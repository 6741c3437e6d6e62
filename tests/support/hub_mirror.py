"""A Hugging Face-compatible hub on 127.0.0.1 for the download tests and benchmarks: olah, offline, serving git
repositories committed under a local mirrors folder. olah pins a FastAPI that conflicts with vLLM's, so it lives in
its own virtualenv (``.venv-olah``), created the first time it is needed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OLAH_VENV = REPO / ".venv-olah"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def olah_cli() -> Path:
    cli = OLAH_VENV / "bin" / "olah-cli"
    if not cli.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(OLAH_VENV)], check=True)
        pip = [str(OLAH_VENV / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check", "olah"]
        subprocess.run(pip, check=True)
    return cli


def commit_mirror(root: Path, repo_id: str) -> Path:
    """The folder ``root/mirrors/models/<repo_id>`` (filled by the caller first) committed as the hub's ``main``."""
    mirror = root / "mirrors" / "models" / repo_id
    git = ["git", "-c", "user.email=ci@servebook", "-c", "user.name=servebook", "-c", "core.compression=0"]
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", repo_id]):
        subprocess.run([*git, *cmd], cwd=mirror, check=True)
    return mirror


@contextmanager
def serving(root: Path, start_timeout_s: float = 30.0) -> Iterator[str]:
    """olah serving the mirrors under ``root`` until the block ends; yields its endpoint (``HF_ENDPOINT``)."""
    cli = olah_cli()
    port = free_port()
    (root / "olah.toml").write_text(
        f'[basic]\nhost = "127.0.0.1"\nport = {port}\nrepos-path = "{root / "repos"}"\n'
        f'mirrors-path = ["{root / "mirrors"}"]\n[accessibility]\noffline = true\n'
    )
    log = root / "olah.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(cli), "-c", str(root / "olah.toml")], cwd=root, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("olah did not start: " + log.read_text()[-2000:])
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
