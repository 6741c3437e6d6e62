"""The service's pre-start and post-start commands against the real embedded server."""

import socket
import subprocess
import sys
import time

import pytest

from .conftest import SHARED_PORT

pytestmark = pytest.mark.integration


def cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "servebook.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_pre_start_check_refuses_while_our_server_holds_the_port(shared_server):
    proc = cli("gpu-check", "--port", str(SHARED_PORT))
    assert proc.returncode == 1
    assert f"port {SHARED_PORT} is held by pid {shared_server.pid}" in proc.stderr


def test_pre_start_check_passes_on_a_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = cli("gpu-check", "--port", str(port))
    assert proc.returncode == 0 and f"free: port {port}" in proc.stdout


def test_post_start_wait_succeeds_against_a_ready_server(shared_server):
    proc = cli("wait-ready", "--url", shared_server.url, "--timeout", "30")
    assert proc.returncode == 0 and "ready after" in proc.stdout


def test_post_start_wait_times_out_when_nothing_answers():
    started = time.monotonic()
    proc = cli("wait-ready", "--url", "http://127.0.0.1:9", "--timeout", "3", "--poll", "0.5")
    took = time.monotonic() - started
    assert proc.returncode == 1 and "not ready within 3 s (last state: loading)" in proc.stderr
    assert 3 <= took < 30
