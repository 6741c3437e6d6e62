"""Commands on the other nodes of a multi-node server, over the user's own SSH (no password, key or host in
params: ``BatchMode`` refuses to ask for one), or on this machine when a node's SSH destination is empty.

A worker is started in a session of its own (``setsid``), so its session id is its pid: stopping it signals that
session, and what is left of it, or any orphaned ``VLLM::`` process, is listed by node.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Sequence

from pydantic import BaseModel

from servebook.errors import RemoteError

__all__ = ["RemoteError", "WorkerRecord"]

SSH_TIMEOUT_S = 20.0


class WorkerRecord(BaseModel):
    """One worker node's vLLM process, as ``servebook stop`` finds it from the head's registry."""

    node: str
    ssh: str = ""  # SSH destination; empty: this machine
    ssh_config: str = ""
    address: str = ""
    pid: int
    log_path: str
    command: list[str]
    role: str = "vllm"  # "ray": the node's `ray start` (raycluster.py), whose Ray processes must be gone after a stop
    stop_command: list[str] = []  # run on the node before its session is signalled (`ray stop`)


def ssh_prefix(ssh: str, ssh_config: str = "") -> list[str]:
    if not ssh:
        return []
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5"]
    if ssh_config:
        argv += ["-F", ssh_config]
    return [*argv, ssh, "--"]


def run(
    ssh: str, script: str, ssh_config: str = "", timeout_s: float = SSH_TIMEOUT_S, input_text: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``bash -c SCRIPT`` on a node (``input_text`` on its stdin); RemoteError when SSH itself fails (exit 255)
    or the time runs out."""
    argv = [*ssh_prefix(ssh, ssh_config), "bash", "-c", shlex.quote(script) if ssh else script]
    where = f"over SSH to {ssh}" if ssh else "on this machine"
    try:
        proc = subprocess.run(
            argv,
            input=input_text,
            stdin=None if input_text is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise RemoteError(f"no answer {where} within {timeout_s:.0f} s") from None
    if ssh and proc.returncode == 255:
        said = proc.stderr.strip().splitlines()[-1:] or ["no message"]
        raise RemoteError(f"cannot reach {ssh} over SSH: {said[0]}")
    return proc


def pid_file(log_path: str) -> str:
    """Where :func:`start` leaves the worker's pid on its node, for a start whose answer never came back."""
    return f"{log_path}.pid"


def start(
    ssh: str,
    argv: Sequence[str],
    env: dict[str, str],
    log_path: str,
    ssh_config: str = "",
    secrets: dict[str, str] | None = None,
) -> int:
    """Start ``argv`` detached on a node, in a session of its own, writing ``log_path`` there; its pid (also
    written to :func:`pid_file` there, before it is printed). ``secrets`` (an API server's key) travel on SSH's
    stdin and are exported there, so they are in no command line on either machine."""
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted(env.items()))
    folder = shlex.quote(log_path.rsplit("/", 1)[0] or "/")
    secrets = secrets or {}
    if any("\n" in value for value in secrets.values()):
        raise RemoteError("a secret holds a newline; it cannot be passed on one line of stdin")
    reads = "".join(f"IFS= read -r {name} && export {name}; " for name in sorted(secrets))
    script = (
        f"{reads}mkdir -p {folder} || exit 1; cd /; "  # statements, not an && list: that would background a subshell
        f"setsid env {assignments} {shlex.join(argv)} > {shlex.quote(log_path)} 2>&1 < /dev/null & "
        f"echo $! > {shlex.quote(pid_file(log_path))}; echo $!"
    )
    given = "".join(f"{secrets[name]}\n" for name in sorted(secrets)) if secrets else None
    proc = run(ssh, script, ssh_config, input_text=given)
    try:
        return int(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RemoteError(f"could not start the worker: {proc.stderr.strip() or proc.stdout.strip()}") from None


def stop_unanswered(ssh: str, log_path: str, ssh_config: str = "", grace_s: float = 15.0) -> str:
    """Stop a worker whose :func:`start` raised (an SSH answer lost or late: the process may run all the same),
    found by its pid file; what was done, or the command to run on the node when it cannot be reached."""
    try:
        proc = run(ssh, f"cat {shlex.quote(pid_file(log_path))} 2>/dev/null", ssh_config)
    except RemoteError as exc:
        where = f"on {ssh}" if ssh else "here"
        return f"could not check: {exc}; run `kill -TERM -- -$(cat {pid_file(log_path)})` {where}"
    if not proc.stdout.strip().isdigit():
        return "no worker had started (no pid file)"
    pid = int(proc.stdout.strip())
    left = stop(WorkerRecord(node=ssh or "local", ssh=ssh, ssh_config=ssh_config, pid=pid, log_path=log_path,
                             command=[]), grace_s)  # fmt: skip
    return f"stopped the worker's session {pid}" + (f"; still there: {', '.join(left)}" if left else "")


def alive(worker: WorkerRecord) -> bool:
    """The worker's process runs (a zombie that its new parent has not reaped yet does not count)."""
    script = f"test -d /proc/{worker.pid} && ! grep -q '^State:[[:space:]]*Z' /proc/{worker.pid}/status"
    return run(worker.ssh, script, worker.ssh_config).returncode == 0


def log_text(worker: WorkerRecord, lines: int = 400) -> str:
    """The end of the worker's log on its node."""
    proc = run(worker.ssh, f"tail -n {lines} {shlex.quote(worker.log_path)}", worker.ssh_config)
    return proc.stdout


# What is left on a node: the session's processes, orphaned VLLM:: processes, GPU holders. One JSON line.
_LEFT = r"""
import json, os, subprocess, sys
sid = int(sys.argv[1])
ray = len(sys.argv) > 2 and sys.argv[2] == "ray"
left = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        ppid, session = int(fields[1]), int(fields[3])
    except (OSError, ValueError, IndexError):
        continue
    if session == sid or (comm.startswith("VLLM::") and ppid == 1):
        left.append(f"pid {pid} {comm}")
    elif ray and (comm in ("raylet", "gcs_server") or comm.startswith("ray::")):
        left.append(f"pid {pid} {comm} (Ray)")
    elif ray:  # Ray's Python processes: its scripts (dashboard, log monitor, autoscaler) or its CLI
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "ray.scripts.scripts" in args[:3] or any(a.endswith(".py") and "/ray/" in a for a in args[:3]):
            left.append(f"pid {pid} {comm} (Ray: {' '.join(args)[:80]})")
try:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout
    left += [f"GPU holder {line.strip()}" for line in out.splitlines() if "VLLM" in line or "python" in line]
except (OSError, subprocess.SubprocessError):
    pass
print(json.dumps(left))
"""


def leftovers(worker: WorkerRecord, python: str = "python3") -> list[str]:
    """What of this worker (and any orphaned vLLM process) is still running on its node."""
    script = f"{shlex.quote(python)} -c {shlex.quote(_LEFT)} {worker.pid} {worker.role}"
    proc = run(worker.ssh, script, worker.ssh_config)
    try:
        return [f"{worker.node}: {item}" for item in json.loads(proc.stdout.strip().splitlines()[-1])]
    except (ValueError, IndexError):
        return [f"{worker.node}: could not list processes ({proc.stderr.strip()[-200:]})"]


def stop(worker: WorkerRecord, grace_s: float = 15.0) -> list[str]:
    """Run its ``stop_command`` (``ray stop``), TERM the worker's session, KILL what outlives ``grace_s``, then list
    what is left on its node."""
    pid = worker.pid
    if worker.stop_command:
        try:
            run(worker.ssh, shlex.join(worker.stop_command), worker.ssh_config, timeout_s=grace_s + SSH_TIMEOUT_S)
        except RemoteError:
            pass  # the session's signals below still stop it; what is left is listed
    rounds = max(1, int(grace_s / 0.5))
    script = (
        f"kill -TERM -- -{pid} 2>/dev/null; "
        f"for i in $(seq {rounds}); do pgrep -s {pid} >/dev/null || break; sleep 0.5; done; "
        f"pkill -KILL -s {pid} 2>/dev/null; sleep 0.5; true"
    )
    run(worker.ssh, script, worker.ssh_config, timeout_s=grace_s + SSH_TIMEOUT_S)
    left = leftovers(worker)
    deadline = time.monotonic() + grace_s
    while left and worker.role == "ray" and time.monotonic() < deadline:  # Ray's agents exit seconds after raylet
        time.sleep(1.0)
        left = leftovers(worker)
    return left
