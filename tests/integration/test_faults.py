"""servebook under the faults an operator meets: interrupts, two launches on one port, full disks,
a unit whose user cannot start it. Each against real vLLM on the CPU, each ending with nothing left running."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from servebook import server

from .conftest import vllm_titles

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


class Run:
    """``servebook run`` (or another stage command) in a session of its own, as a terminal runs a foreground job,
    read line by line."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None, command: str = "run"):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "servebook.cli", command, str(REPO / "params" / "ci.yaml"), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**os.environ, "SERVEBOOK_OUTPUTS": str(tmp_path / "outputs"), **(env or {})},
            start_new_session=True,
            # a terminal's foreground job has SIGINT's default action; a test runner's child may inherit SIG_IGN
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_for(self, text: str, timeout_s: float = 300) -> None:
        end = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines[-40:])
            assert time.monotonic() < end, f"no {text!r} within {timeout_s} s:\n" + "\n".join(self.lines[-40:])
            time.sleep(0.2)

    def finish(self, timeout_s: float = 180) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self.reader.join(timeout=10)
        print("\n".join(self.lines[-60:]))
        return code

    @property
    def run_dir(self) -> Path:
        return Path(next(line for line in reversed(self.lines) if line.startswith("/")))


INTERRUPTS = pytest.mark.parametrize(
    ("sig", "to_group", "code"),
    [(signal.SIGTERM, False, 143), (signal.SIGINT, True, 130)],
    ids=["SIGTERM to servebook (timeout)", "Ctrl-C to the terminal's job"],
)


def manifest_of(run: Run) -> dict:
    return json.loads((run.run_dir / "manifest.json").read_text())


def nothing_left(port: int, before: set[str]) -> None:
    assert server.registered(port) is None
    assert server.port_holder("127.0.0.1", port) is None
    assert set(vllm_titles()) <= before, set(vllm_titles()) - before


@INTERRUPTS
def test_an_interrupted_launch_stops_the_loading_server_and_says_so(tmp_path, sig, to_group, code):
    before = set(vllm_titles())
    port = 8171 if sig == signal.SIGTERM else 8172
    run = Run(tmp_path, "--set", f"port={port}", "--stages", "launch")
    run.wait_for("starting vLLM")
    time.sleep(3)  # the server's processes exist and are loading
    os.killpg(run.proc.pid, sig) if to_group else run.proc.send_signal(sig)
    assert run.finish() == code
    manifest = manifest_of(run)
    assert manifest["status"] == "interrupted" and "03_launch" in manifest["interrupted"], manifest
    assert [s["status"] for s in manifest["stages"]] == ["interrupted"]
    assert manifest["stages"][0]["started_s"] is not None  # the report's "began at" for the interrupted stage
    assert any("interrupted: " in line and "03_launch" in line for line in run.lines)
    # stopped where it was starting, with the grace of a start that never served
    assert any("stopped the server that was still starting: " in line and "nothing left" in line for line in run.lines)
    assert "Run interrupted" in (run.run_dir / "report.html").read_text()
    nothing_left(port, before)


@pytest.mark.parametrize(
    ("sig", "to_group", "code", "replicas"),
    [(signal.SIGTERM, False, 143, 2), (signal.SIGINT, True, 130, 1)],
    ids=["SIGTERM to servebook, two keyed replicas behind the router", "Ctrl-C to the terminal's job, one server"],
)
def test_an_interrupted_benchmark_keeps_its_levels_and_leaves_nothing(tmp_path, sig, to_group, code, replicas):
    """Interrupted mid-sweep, the levels measured so far are kept and nothing is left. SIGTERM goes to servebook
    alone, so servebook must stop everything itself: here two replicas behind vllm-router on a keyed server (its
    own variable name), each level with each replica's share; Ctrl-C goes to the whole job, one server, through
    the same handler (the interrupted launches above take each signal to one server)."""
    before = set(vllm_titles())
    port = 8195 if sig == signal.SIGTERM else 8174  # the replicas take the two ports above the router's
    key = "sk-faults-replicas-42"
    shape = ["--set", f"replicas={replicas}", "--set", "ab_variants=[]", "--set", "router_policy=round_robin",
             "--set", "api_key_env=SERVEBOOK_FAULTS_KEY"] if replicas > 1 else []  # fmt: skip
    # a 2-core machine's noise can make level 2 look like a decline that ends the sweep before the signal lands
    run = Run(tmp_path, "--set", f"port={port}", "--set", "bench_min_level_s=2", "--set", "bench_plateau_gain=0.9",
              *shape, "--stages", "launch,benchmark", env={"SERVEBOOK_FAULTS_KEY": key})  # fmt: skip
    run.wait_for("concurrency    2 repeat 2")
    router_pid = server.registered(port).pid
    os.killpg(run.proc.pid, sig) if to_group else run.proc.send_signal(sig)
    assert run.finish() == code
    manifest = manifest_of(run)
    assert manifest["status"] == "interrupted" and "05_benchmark" in manifest["interrupted"]
    assert [s["status"] for s in manifest["stages"]] == ["ok", "interrupted"]
    sweep = json.loads((run.run_dir / "05_benchmark.json").read_text())
    assert [lv["concurrency"] for lv in sweep["levels"]][:2] == [1, 2], sweep["levels"]
    assert sweep["stopped_by"] == "interrupted" and (run.run_dir / "05_benchmark_levels.parquet").is_file()
    # one line per thing it stopped, no stray traceback (on an H200 a zmq one once came through the clean-up)
    said = "\n".join(run.lines)
    assert "Traceback" not in said and "zmq" not in said, said[-3000:]
    nothing_left(port, before)
    if replicas > 1:
        assert sorted(sweep["levels"][0]["replica_shares"]) == [f"http://127.0.0.1:{port + i}" for i in (1, 2)]
        for each in (port + 1, port + 2):
            nothing_left(each, before)
        assert not psutil.pid_exists(router_pid) or psutil.Process(router_pid).status() == psutil.STATUS_ZOMBIE
        assert key not in (run.run_dir / "03_launch.json").read_text()


def test_two_launches_on_one_port_start_one_server(tmp_path):
    before = set(vllm_titles())
    port = 8176
    env = {**os.environ, "SERVEBOOK_OUTPUTS": str(tmp_path / "outputs")}

    def launch() -> subprocess.Popen:
        args = [
            sys.executable,
            "-m",
            "servebook.cli",
            "launch",
            str(REPO / "params" / "ci.yaml"),
            "--set",
            f"port={port}",
        ]
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)

    first = launch()
    time.sleep(0.5)
    second = launch()
    try:
        outs = [p.communicate(timeout=300)[0] for p in (first, second)]
        codes = sorted(p.returncode for p in (first, second))
        print(outs)
        assert codes == [0, 3], outs
        refused = next(o for o, p in zip(outs, (first, second)) if p.returncode == 3)
        assert f"another servebook launch is starting a server on port {port}" in refused
        holder = server.port_holder("127.0.0.1", port)
        record = server.registered(port)
        assert isinstance(holder, psutil.Process) and os.getpgid(holder.pid) == record.pgid  # the one registered
    finally:
        server.stop(port=port)
    nothing_left(port, before)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MB tmpfs the test mounts (mounting needs root; the tests run as root here)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def fill(mount: Path, leave_bytes: int) -> None:
    """Fill the filesystem until ``leave_bytes`` are free (0: to its last byte)."""
    import shutil

    with open(mount / "filler", "wb") as fh:
        try:
            while shutil.disk_usage(mount).free > leave_bytes:
                fh.write(b"\0" * min(65536, max(shutil.disk_usage(mount).free - leave_bytes, 1)))
                fh.flush()
        except OSError:
            pass


def test_a_full_outputs_disk_is_named_and_the_manifest_survives(tmp_path, small_tmpfs):
    """Room for the stages' notebooks and records (about 90 KB), none for the 5-MB report."""
    fill(small_tmpfs, 400 * 1024)
    env = {**os.environ, "SERVEBOOK_OUTPUTS": str(small_tmpfs / "outputs")}
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "run", str(REPO / "params" / "ci.yaml"), "--stages",
         "reconnaissance,plan"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=300,
    )  # fmt: skip
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 6, proc.stderr[-2000:]
    assert "no space left for" in proc.stderr and "report.html" in proc.stderr and "Traceback" not in proc.stderr
    (run_dir,) = (small_tmpfs / "outputs").iterdir()
    manifest = json.loads((run_dir / "manifest.json").read_text())  # whole: the previous version, not 0 bytes
    assert [s["name"] for s in manifest["stages"]] == ["00_reconnaissance", "01_plan"]
    assert not (run_dir / "report.html").exists() and not list(run_dir.glob(".*.tmp"))


def test_a_full_registry_disk_starts_nothing_that_outlives_the_launch(tmp_path, small_tmpfs):
    """The registry on a full disk: the server just started is stopped, the launch says why, and a corrupt entry
    beside it does not break status or stop."""
    from servebook import models

    before = set(vllm_titles())
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(models.cache_root() / "models")
    (cache / "servers").symlink_to(small_tmpfs)
    (small_tmpfs / "locks").mkdir()
    (small_tmpfs / "8177.json").write_text("")  # a registration a full disk cut: 0 bytes
    fill(small_tmpfs, 0)
    env = {**os.environ, "SERVEBOOK_CACHE": str(cache), "SERVEBOOK_OUTPUTS": str(tmp_path / "outputs")}
    args = [sys.executable, "-m", "servebook.cli", "launch", str(REPO / "params" / "ci.yaml"), "--set", "port=8178"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.returncode == 6 and "no space left for" in proc.stderr and "8178.json" in proc.stderr
    assert "Traceback" not in proc.stderr
    status = subprocess.run([sys.executable, "-m", "servebook.cli", "status"], capture_output=True, text=True, env=env)
    assert status.returncode == 0 and "corrupt entry" in status.stdout and "8177.json" in status.stdout
    stop = subprocess.run([sys.executable, "-m", "servebook.cli", "stop"], capture_output=True, text=True, env=env)
    assert stop.returncode == 0 and "8177.json: not a readable registration" in stop.stdout, stop.stdout + stop.stderr
    assert server.port_holder("127.0.0.1", 8178) is None and set(vllm_titles()) <= before


def test_a_unit_whose_user_cannot_reach_its_python_fails_deploy_by_path(tmp_path):
    """The story's deploy: the unit runs as its own user, the virtualenv and the model under root's home (mode 700).
    The dry run is checked as that user, and the stage names what blocks it instead of "verified"."""
    user = "servebook-probe"
    if subprocess.run(["id", "-u", user], capture_output=True).returncode:
        made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user])
        if made.returncode:
            pytest.skip("cannot create a user here")
    run = Run(tmp_path, "--set", "port=8179", "--set", f"deploy_user={user}", "--stages", "launch,deploy")
    code = run.finish(timeout_s=300)
    deploy = json.loads((run.run_dir / "07_deploy.json").read_text())
    assert code != 0 and deploy["run_as"] == user and deploy["access_problems"], deploy
    assert all(f"user {user} cannot" in p and "under /opt or /data" in p for p in deploy["access_problems"])
    assert deploy["dry_run"] is None and "cannot reach what the unit runs" in deploy["dry_run_skipped"]
    assert "VLLM_SERVER_DEV_MODE left out of the unit" in " ".join(deploy["warnings"])
    assert "VLLM_SERVER_DEV_MODE" not in Path(deploy["unit_file"]).read_text()
    assert server.registered(8179) is None
