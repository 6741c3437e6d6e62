"""Launch, watch, reuse and stop vLLM servers, leaving nothing behind.

Every server runs in its own session (process group) with its log in the run
folder, and is recorded in a registry under the servebook cache so that
``servebook status`` and ``servebook stop`` find it from any shell.  What a server
is made of lives in :mod:`servebook.server_config`; how its processes are found
and stopped, in :mod:`servebook.processes`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil
from pydantic import BaseModel

from servebook import client, files, hardware, models, multinode, remote, serving, startup, vllm_compat
from servebook.client import health
from servebook.errors import CleanupError, LaunchError, PreflightError
from servebook.processes import (
    STARTING_STOP_GRACE_S,
    STOP_GRACE_S,
    Terminated,
    describe,
    group_members,
    port_holder,
    terminate,
    vllm_orphans,
)
from servebook.secrets import mask, mask_env
from servebook.server_config import BASE_BUDGET_S, ServerConfig, load_budget_s
from servebook.vllm_log import ANSI_ESCAPE, LoadProgress, LogValues, root_cause, tail

__all__ = ["BASE_BUDGET_S", "STOP_GRACE_S", "ServerConfig", "Terminated", "describe", "group_members", "load_budget_s"]

# ---------------------------------------------------------------- registry


def registry_dir() -> Path:
    path = models.cache_root() / "servers"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _registry_path(port: int) -> Path:
    return registry_dir() / f"{port}.json"


class Registration(BaseModel):
    """A server servebook started, as ``servebook status`` and ``stop`` find it from any shell."""

    pid: int
    pgid: int
    port: int
    host: str
    url: str
    fingerprint: str
    command: list[str]
    log_path: str
    model: str
    served_model_name: str
    device: str
    gpu_ids: list[int]
    started_at: str
    values: LogValues = LogValues()
    workers: list[remote.WorkerRecord] = []  # the other nodes' processes of a multi-node server
    run_dir: str = ""  # the folder it was launched for: a run stops what it started, whatever interrupted it
    # a replica on another machine (replica_hosts): its vLLM is workers[0] there, nothing of it runs here
    node: str = ""
    # False until a start servebook watches serves (a stop then gives it STARTING_STOP_GRACE_S); None: not tracked
    ready: bool | None = None


def _read(path: Path) -> Registration | None:
    """A registry entry, or None when it is unreadable (a full disk cut it): :func:`corrupt_entries` names it."""
    try:
        return Registration.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def registered(port: int) -> Registration | None:
    path = _registry_path(port)
    return _read(path) if path.is_file() else None


def all_registered() -> list[Registration]:
    return [r for r in (_read(p) for p in sorted(registry_dir().glob("*.json"))) if r]


def corrupt_entries() -> list[str]:
    """Registry files that cannot be read, each with the fix; never fatal to ``status`` or ``stop``."""
    return [
        f"{p}: not a readable registration (a full disk may have cut it); check the port with `servebook "
        f"gpu-check --port {p.stem}`, stop what holds it, then delete the file"
        for p in sorted(registry_dir().glob("*.json"))
        if _read(p) is None
    ]


@contextlib.contextmanager
def launch_lock(cfg: ServerConfig) -> Iterator[None]:
    """One launch at a time per port and per GPU: held from before the preflight until the launch is ready or
    gone, so two launches seconds apart cannot both pass the preflight and start two servers on one port."""
    names = [f"port-{cfg.port}", *(f"gpu-{i}" for i in cfg.target_gpus)]
    folder = registry_dir() / "locks"
    folder.mkdir(exist_ok=True)
    held: list[int] = []
    try:
        for name in names:
            fd = os.open(folder / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                what = f"port {cfg.port}" if name.startswith("port") else f"GPU {name.split('-')[1]}"
                raise PreflightError(
                    f"another servebook launch is starting a server on {what} ({holder}); wait for it, or stop it "
                    f"with `servebook stop --port {cfg.port}`, before launching again"
                ) from None
            held.append(fd)
            with contextlib.suppress(OSError):  # the note is for people; the lock is the flock, full disk or not
                os.ftruncate(fd, 0)
                note = f"pid {os.getpid()}, since {datetime.now(timezone.utc).isoformat(timespec='seconds')}"
                os.pwrite(fd, note.encode(), 0)
        yield
    finally:
        for fd in held:
            os.close(fd)  # closing releases the lock


def register(record: Registration) -> None:
    files.write_text(_registry_path(record.port), record.model_dump_json(indent=2))


def unregister(port: int) -> None:
    _registry_path(port).unlink(missing_ok=True)


# ---------------------------------------------------------------- preflight


class Preflight(BaseModel):
    """What the checks before a launch found; ``reuse`` is set when a matching healthy server already runs."""

    reuse: Registration | None = None
    stopped: list[StopOutcome | Terminated] = []
    parse_seconds: float = 0.0
    gpu_holders: list[str] = []
    seconds: float = 0.0


def check_command(cfg: ServerConfig) -> float:
    """What vLLM's own parser says of the command and its environment, before anything starts (seconds it took);
    a refusal raises :class:`PreflightError` with vLLM's message and the fix."""
    if conflicts := cfg.conflicts():
        raise PreflightError("nothing started:\n  - " + "\n  - ".join(conflicts))
    parsed = vllm_compat.parse_serve_args(cfg.model_path, cfg.serve_args())
    if not parsed.ok:
        raise PreflightError(
            f"vLLM {vllm_compat.vllm_version()} rejects the serving command (found in {parsed.seconds:.1f} s, nothing started):\n"
            f"{parsed.message}\nfix extra_args (or the parameter that produced the flag) and launch again"
        )
    env_problems = vllm_compat.unknown_vllm_env(list(cfg.extra_env), parsed.known_env)
    if env_problems:
        raise PreflightError("unknown vLLM environment variables, nothing started:\n  - " + "\n  - ".join(env_problems))
    return round(parsed.seconds, 2)


def preflight(cfg: ServerConfig, stop_leftovers: bool = False, log: Callable[[str], None] = print) -> Preflight:
    """Checks before any process starts, each refusing with the holder named and the fix."""
    report = Preflight()
    start = time.monotonic()
    report.parse_seconds = check_command(cfg)
    _check_port(cfg, stop_leftovers, report, log)
    if report.reuse:
        return report

    orphans = vllm_orphans()
    if orphans:
        names = "; ".join(describe(p) for p in orphans)
        if not stop_leftovers:
            raise PreflightError(
                f"orphaned vLLM processes from an earlier server are still running: {names}. "
                "They hold memory the new server needs; run `servebook stop --orphans` or set stop_leftovers: true"
            )
        log(f"stopping orphaned vLLM processes: {names}")
        report.stopped.append(terminate(None, extra=orphans))

    if cfg.device == "cuda":
        report.gpu_holders = _check_gpus(cfg, stop_leftovers, log)
    report.seconds = round(time.monotonic() - start, 2)
    return report


def _check_port(cfg: ServerConfig, stop_leftovers: bool, report: Preflight, log: Callable[[str], None]) -> None:
    """The port: free; or held by servebook's healthy server of the same configuration (``report.reuse``); or by
    one of servebook's to stop (with ``stop_leftovers``); anything else is refused with its holder named."""
    record = registered(cfg.port)
    holder = port_holder(cfg.host, cfg.port)
    ours = record is not None and isinstance(holder, psutil.Process) and _same_group(holder, record.pgid)
    if holder is None and record is not None:
        _earlier_server_not_listening(record, stop_leftovers, report, log)
    if holder is not None:
        changes = serving.flag_changes(record.command, [mask(a) for a in cfg.command()]) if record else []
        why = "a different configuration" + (f": {', '.join(changes)}" if changes else "")
        if ours and record and record.fingerprint == cfg.fingerprint() and health(record.url) == "ready":
            why = hung(record, cfg)
            if not why:
                log(
                    f"reusing the healthy server on port {cfg.port} (pid {record.pid}) launched with the same "
                    "configuration"
                )
                report.reuse = record
                return
            why = f"a hung engine: {why}"
        if ours and stop_leftovers:
            log(f"stopping our earlier server on port {cfg.port} ({why})")
            report.stopped.append(stop(port=cfg.port))
        elif ours and record:
            raise PreflightError(
                f"port {cfg.port} is held by a servebook server with {why} (pid {record.pid}); "
                f"stop it with `servebook stop --port {cfg.port}` or set stop_leftovers: true"
            )
        else:
            who = (
                describe(holder)
                if isinstance(holder, psutil.Process)
                else "an unidentified process (run as root to see it)"
            )
            raise PreflightError(
                f"port {cfg.port} on {cfg.host} is held by {who}; choose another port or stop that process"
            )


def _earlier_server_not_listening(
    record: Registration, stop_leftovers: bool, report: Preflight, log: Callable[[str], None]
) -> None:
    """A registered server that does not listen yet is still loading (or hung): a second server on its port
    would take the port, or its GPUs, from under it. One whose processes are all gone is forgotten."""
    if not group_members(record.pgid):
        unregister(record.port)
        return
    if not stop_leftovers:
        raise PreflightError(
            f"port {record.port}: the server servebook started at {record.started_at} (pid {record.pid}) is still "
            f"loading there; wait for it (servebook wait-ready --url {record.url}) or stop it (servebook stop --port "
            f"{record.port}), or set stop_leftovers: true"
        )
    log(f"stopping the server still loading on port {record.port} (pid {record.pid})")
    report.stopped.append(stop(port=record.port))


def hung(record: Registration, cfg: ServerConfig) -> str:
    """Why a server whose ``/health`` answers 200 will serve no token ('' when one comes back): a process of its
    group stopped (SIGSTOP, a debugger), or no one-token completion within the first window's stall bound."""
    stopped = stopped_members(record.pgid) if record.pgid else []
    if stopped:
        return f"{'; '.join(describe(m) for m in stopped)} stopped (SIGSTOP or a debugger)"
    return client.first_token(cfg.target(timeout_s=FIRST_TOKEN_S))


def _same_group(proc: psutil.Process, pgid: int | None) -> bool:
    try:
        return pgid is not None and os.getpgid(proc.pid) == pgid
    except ProcessLookupError:
        return False


def _check_gpus(cfg: ServerConfig, stop_leftovers: bool, log: Callable[[str], None]) -> list[str]:
    inv = hardware.inventory()
    if not inv.available:
        raise PreflightError(f"device is cuda but {inv.error}")
    found = hardware.blockers(inv, cfg.target_gpus)
    lines = [b.describe() for b in found]
    leftovers = [b for b in found if b.is_vllm]
    if any(b.process is not None and not b.is_vllm for b in found):
        raise PreflightError(
            "target GPUs are held by processes that are not vLLM's; servebook will not touch them:\n  "
            + "\n  ".join(lines)
            + "\nstop them yourself or choose other gpu_ids"
        )
    if leftovers and not stop_leftovers:
        raise PreflightError(
            "target GPUs are held by leftover vLLM processes:\n  "
            + "\n  ".join(lines)
            + "\nrun `servebook stop --orphans` or set stop_leftovers: true"
        )
    for b in leftovers:
        assert b.process is not None
        log(f"stopping leftover vLLM process: {b.describe()}")
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(b.process.pid).terminate()
    if any(b.process is None for b in found):
        raise PreflightError(
            "target GPUs hold memory no visible process accounts for; another container or user holds them:\n  "
            + "\n  ".join(b.describe() for b in found if b.process is None)
        )
    return lines


# ---------------------------------------------------------------- launch


@dataclass
class Launch:
    """A server that is ready: how it was started, what its log said, and what the preflight found."""

    config: ServerConfig
    pid: int
    pgid: int
    url: str
    log_path: str
    reused: bool
    started_by_this_run: bool
    command: list[str]
    environment: dict[str, str]  # what differs from the launching shell, secrets masked
    seconds_to_ready: float
    phases: dict[str, float]  # milestone -> seconds since the process started
    values: LogValues
    preflight: Preflight
    timeline: startup.Timeline | None = None  # where the start's time went (None for a reused server)


def environment_record(cfg: ServerConfig, env: dict[str, str]) -> dict[str, str]:
    """The variables that differ from the launching shell (what a unit file would need), secrets masked."""
    changed = {k: v for k, v in env.items() if os.environ.get(k) != v or k in cfg.extra_env}
    return mask_env(changed)


def launch(
    cfg: ServerConfig,
    log_dir: str | Path,
    *,
    stop_leftovers: bool = False,
    on_progress: Callable[[str, float], None] | None = None,
    log: Callable[[str], None] = print,
    workers: Sequence[remote.WorkerRecord] = (),
) -> Launch:
    """Preflight, start, and wait for ``/health``; raise :class:`LaunchError` with the root cause on failure.

    ``workers`` are the other nodes of a multi-node server (``multinode.workers``): started once the head is,
    watched while it loads (one that exits fails the launch with its own log's root cause), stopped with it."""
    with launch_lock(cfg):
        pre = preflight(cfg, stop_leftovers=stop_leftovers, log=log)
        return start(cfg, Path(log_dir), pre, on_progress=on_progress, log=log, workers=workers)


def start(
    cfg: ServerConfig,
    log_dir: Path,
    pre: Preflight,
    *,
    on_progress: Callable[[str, float], None] | None,
    log: Callable[[str], None],
    workers: Sequence[remote.WorkerRecord] = (),
    members: Sequence[remote.WorkerRecord] = (),
) -> Launch:
    """Start the server a passed :func:`preflight` cleared (or hand back the one it found to reuse), under
    :func:`launch_lock`. ``members``: processes already running on other nodes that belong to this server from
    its start (a Ray cluster's nodes), registered with it, watched while it loads and stopped with it."""
    env = cfg.environment()
    if pre.reuse:
        rec = pre.reuse
        if on_progress:  # a view that waits for phases learns there will be none: the server was already up
            on_progress(f"ready: reusing the healthy server on port {rec.port} (pid {rec.pid}), nothing to load", 0.0)
        return Launch(
            config=cfg, pid=rec.pid, pgid=rec.pgid, url=rec.url, log_path=rec.log_path, reused=True,
            started_by_this_run=False, command=rec.command, environment=environment_record(cfg, env),
            seconds_to_ready=0.0, phases={}, values=rec.values, preflight=pre,
        )  # fmt: skip
    log_path = _new_log_path(log_dir)
    command = cfg.command()
    budget = cfg.load_budget_s()
    log(f"starting vLLM ({' '.join(command[:3])}), load budget {budget:.0f} s, log {log_path}")
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    record = _registration(cfg, proc.pid, command, log_path)
    record.run_dir = str(log_dir.resolve())
    record.workers = list(members)
    try:
        register(record)
    except BaseException:  # a server nobody could find must not outlive this call
        terminate(proc.pid)
        raise
    try:

        def started(worker: remote.WorkerRecord) -> None:  # registered as it starts, so a stop reaches it
            record.workers.append(worker)
            register(record)

        # the API key goes (over SSH's stdin) only to the nodes that serve an API: the head, and hybrid's others
        multinode.Workers(list(workers)).start(
            cfg.environment(base={}, with_secrets=False), started, log, cfg.secret_env()
        )
        phases, values, seconds = _wait_ready(proc, cfg, log_path, budget, on_progress, record.workers)
    except BaseException:
        outcome = stop(port=cfg.port)
        if outcome.stopped:
            log(f"stopped the server that was still starting: {outcome.summary}")
        raise
    record.values, record.ready = values, True
    register(record)
    size, _ = models.checkpoint_bytes(cfg.model_path)
    tl = startup.timeline(phases, values, seconds, bytes_per_rank=size if cfg.load_format != "dummy" else None)
    return Launch(
        config=cfg, pid=proc.pid, pgid=record.pgid, url=cfg.url, log_path=str(log_path), reused=False,
        started_by_this_run=True, command=command, environment=environment_record(cfg, env),
        seconds_to_ready=seconds, phases=phases, values=values, preflight=pre, timeline=tl,
    )  # fmt: skip


def _new_log_path(log_dir: Path) -> Path:
    """``server.log`` in the folder, or a timestamped name beside it: an earlier server's log is never overwritten."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "server.log"
    return path if not path.exists() else log_dir / f"server-{datetime.now().strftime('%H%M%S')}.log"


def _registration(cfg: ServerConfig, pid: int, command: list[str], log_path: Path) -> Registration:
    """The registry entry of a server just started (``start_new_session`` made it its group's leader)."""
    return Registration(
        pid=pid,
        pgid=pid,
        port=cfg.port,
        host=cfg.host,
        url=cfg.url,
        fingerprint=cfg.fingerprint(),
        command=[mask(a) for a in command],
        log_path=str(log_path),
        model=cfg.model,
        served_model_name=cfg.served_model_name,
        device=cfg.device,
        gpu_ids=cfg.target_gpus,
        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        ready=False,
    )


def _wait_ready(
    proc: subprocess.Popen[bytes],
    cfg: ServerConfig,
    log_path: Path,
    budget: float,
    on_progress: Callable[[str, float], None] | None,
    workers: Sequence[remote.WorkerRecord] = (),
) -> tuple[dict[str, float], LogValues, float]:
    start = time.monotonic()
    progress = LoadProgress()
    offset = 0
    pending = ""
    checked_workers = start
    told: set[str] = set()
    stopped_for = _StoppedWatch()

    def read_log(elapsed: float) -> None:
        nonlocal offset, pending
        with open(log_path, errors="replace") as fh:
            fh.seek(offset)
            chunk = fh.read()
            offset = fh.tell()
        pending += chunk.replace("\r", "\n")
        *complete, pending = pending.split("\n")
        for line in complete:
            said = progress.feed(ANSI_ESCAPE.sub("", line), elapsed)
            if said and on_progress:
                on_progress(said, elapsed)
            for message, at in startup.phase_messages(progress.seen):
                if message.split()[0] not in told and on_progress:
                    told.add(message.split()[0])
                    on_progress(f"phase {message}", at)

    while True:
        elapsed = time.monotonic() - start
        if workers and time.monotonic() - checked_workers > WORKER_CHECK_S:
            checked_workers = time.monotonic()
            multinode.Workers(list(workers)).check(elapsed)
        read_log(elapsed)
        _raise_if_gone(proc, log_path, elapsed, stopped_for)
        state = health(cfg.url)
        if state == "ready":
            # what vLLM logged between the last read and /health's answer ("Application startup complete") was
            # written before that answer: read it now, at the answer's time, so no milestone is lost to the race
            read_log(time.monotonic() - start)
            _check_answers(cfg, proc, log_path)
            progress.seen["ready"] = round(time.monotonic() - start, 2)
            if on_progress:
                on_progress("ready: /health answers 200 and the engine produced a token", elapsed)
            return progress.seen, progress.values, progress.seen["ready"]
        if state == "dead":
            raise LaunchError(
                "vLLM's /health reports the engine dead", cause=mask(root_cause(log_path.read_text(errors="replace"))),
                log_tail=tail(log_path), log_path=str(log_path),
            )  # fmt: skip
        if elapsed > budget:
            raise LaunchError(
                f"vLLM was not ready within the load budget of {budget:.0f} s; raise load_timeout_s if the load is "
                "simply slow",
                cause="timeout",
                log_tail=tail(log_path),
                log_path=str(log_path),
            )
        time.sleep(0.5)


def _raise_if_gone(proc: subprocess.Popen[bytes], log_path: Path, elapsed: float, stopped_for: _StoppedWatch) -> None:
    """A loading server that exited, or whose process stays stopped, will never be ready: say why now."""
    code = proc.poll()
    if code is not None:
        raise LaunchError(
            f"vLLM exited with code {code} after {elapsed:.1f} s, before it was ready",
            cause=mask(root_cause(log_path.read_text(errors="replace"))), log_tail=tail(log_path),
            log_path=str(log_path),
        )  # fmt: skip
    if frozen := stopped_for.check(proc.pid):
        raise LaunchError(
            f"vLLM stopped loading after {elapsed:.1f} s: {frozen}; it will not go on by itself",
            cause=f"hung: {frozen}", log_tail=tail(log_path), log_path=str(log_path),
        )  # fmt: skip


WORKER_CHECK_S = 3.0


class _StoppedWatch:
    """Names a loading server's process that has stayed stopped (SIGSTOP, a debugger) for ``STOPPED_S``: a load
    that will never finish, however long its budget."""

    def __init__(self) -> None:
        self.since: dict[int, float] = {}

    def check(self, pid: int) -> str:
        now = time.monotonic()
        stopped = stopped_members(pid)  # the server's process leads its group
        self.since = {m.pid: self.since.get(m.pid, now) for m in stopped}
        long_stopped = [m for m in stopped if now - self.since[m.pid] >= STOPPED_S]
        if not long_stopped:
            return ""
        return f"{'; '.join(describe(m) for m in long_stopped)} stopped (SIGSTOP or a debugger)"


# a loaded engine answers one token in well under a second; a hung one never does: named as fast as a window is
FIRST_TOKEN_S = client.STALL.min_s
STOPPED_S = 5.0  # a server process stopped this long (SIGSTOP, a debugger) is named, not waited for


def _check_answers(cfg: ServerConfig, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Ready means this server answers: the process on the port is the one started here (not a second launch's
    server on the same port), and a one-token completion comes back (``/health`` answers 200 while the engine
    hangs, vllm-project/vllm#39863)."""
    holder = port_holder(cfg.host, cfg.port)
    if isinstance(holder, psutil.Process) and not _same_group(holder, proc.pid):
        raise LaunchError(
            f"port {cfg.port} answers, but from {describe(holder)}, not the server started here; another server "
            "took the port while this one loaded: stop it (servebook status lists servebook's) and launch again",
            log_path=str(log_path),
        )
    fault = client.first_token(cfg.target(timeout_s=FIRST_TOKEN_S))
    if fault:
        raise LaunchError(
            f"/health answers 200 but the engine does not produce a token: {fault}", cause=fault,
            log_tail=tail(log_path), log_path=str(log_path),
        )  # fmt: skip


# ---------------------------------------------------------------- stop and status


class StopOutcome(BaseModel):
    servers: list[Terminated] = []
    orphans: Terminated | None = None
    remaining: list[str] = []
    gpu_holders: list[str] = []
    summary: str = ""

    @property
    def stopped(self) -> int:
        return sum(len(s.signalled) for s in self.servers) + (len(self.orphans.signalled) if self.orphans else 0)


def stop(
    port: int | None = None, host: str = "127.0.0.1", orphans: bool = False, grace_s: float = STOP_GRACE_S
) -> StopOutcome:
    """Stop the registered server on a port (or every registered one), and with ``orphans`` also every
    orphaned ``VLLM::`` process on the host; then verify nothing of theirs is left."""
    records = [r for r in ([registered(port)] if port is not None else all_registered()) if r]
    outcome = StopOutcome()
    for rec in records:
        result = terminate(rec.pgid, grace_s=min(grace_s, STARTING_STOP_GRACE_S) if rec.ready is False else grace_s)
        result.port = rec.port
        result.remaining += multinode.Workers(rec.workers).stop(grace_s)  # after the head, which would wait on them
        result.signalled += [f"{w.node}: its {w.role} session {w.pid}" for w in rec.workers]
        outcome.servers.append(result)
        outcome.remaining += result.remaining
        if not result.remaining:
            unregister(rec.port)
    if orphans:
        found = vllm_orphans()
        if found:
            outcome.orphans = terminate(None, extra=found, grace_s=grace_s)
            outcome.remaining += outcome.orphans.remaining
        outcome.remaining += [describe(p) for p in vllm_orphans() if describe(p) not in outcome.remaining]
    outcome.gpu_holders = _gpu_leftovers(records)
    left = outcome.remaining + outcome.gpu_holders
    if left:
        outcome.summary = f"left behind: {left}"
        raise CleanupError(f"processes survived the stop: {left}")
    if not records and not outcome.orphans:
        outcome.summary = (
            "nothing to stop: no servebook server"
            + (f" on port {port}" if port is not None else "")
            + (" and no orphaned vLLM process" if orphans else "")
        )
    else:
        outcome.summary = f"{outcome.stopped} process(es) stopped, nothing left"
        for t in [*outcome.servers, *filter(None, [outcome.orphans])]:
            if t.killed_after_grace:
                outcome.summary += f" ({len(t.killed_after_grace)} ignored SIGTERM for {t.grace_s:g} s and were killed)"
    outcome.summary += _still_there(port, host)
    return outcome


def _still_there(port: int | None, host: str) -> str:
    """What a stop leaves that is not servebook's to stop: a listener on the port, unreadable registry entries."""
    notes = corrupt_entries()
    holder = port_holder(host, port) if port is not None else None
    if holder is not None:
        who = describe(holder) if isinstance(holder, psutil.Process) else "an unidentified process"
        notes.insert(0, f"port {port} is still held by {who}, which servebook did not start")
    return "".join(f"; {note}" for note in notes)


def _gpu_leftovers(records: list[Registration]) -> list[str]:
    """vLLM processes still on the GPUs the stopped servers used here (none on CPU hosts): a replica's stop looks
    at its own GPUs, not at its neighbours' that still serve; another machine's replica is asked there."""
    here = [r for r in records if r.device == "cuda" and not r.node]
    if not here:
        return []
    inv = hardware.inventory()
    if not inv.available:
        return []
    gpus = None if any(not r.gpu_ids for r in here) else sorted({g for r in here for g in r.gpu_ids})
    return [b.describe() for b in hardware.blockers(inv, gpus) if b.is_vllm]


class ServerStatus(BaseModel):
    port: int | None
    pid: int
    model: str
    url: str
    processes: int
    health: str  # ready, loading, busy, dead, stopped, orphaned, or "API server gone"
    log: str
    started_at: str
    detail: str = ""


def _server_state(rec: Registration, members: list[psutil.Process]) -> tuple[str, str]:
    """A registered server's state from its processes first, then its ``/health``: a stopped engine process
    (SIGSTOP, a debugger) hangs the server while ``/health`` still answers 200."""
    if not members:
        return "stopped", ""
    if not any(m.pid == rec.pid for m in members):
        return "API server gone", (
            f"{len(members)} engine process(es) orphaned, still holding memory: "
            f"{'; '.join(describe(m) for m in members[:4])}; run `servebook stop --port {rec.port}`"
        )
    stopped = [m for m in members if _status_of(m) == psutil.STATUS_STOPPED]  # the members already listed
    if stopped:
        return "hung", (
            f"{'; '.join(describe(m) for m in stopped)} stopped (SIGSTOP or a debugger): /health answers 200, but no "
            f"token will come; `kill -CONT {stopped[0].pid}` or `servebook stop --port {rec.port}`"
        )
    return health(rec.url), ""


def stopped_members(pgid: int) -> list[psutil.Process]:
    """The group's processes that are stopped (SIGSTOP, a debugger): a server that will serve no token."""
    return [m for m in group_members(pgid) if _status_of(m) == psutil.STATUS_STOPPED]


def _status_of(proc: psutil.Process) -> str:
    try:
        return str(proc.status())
    except psutil.Error:
        return ""


def _workers_gone(rec: Registration) -> list[str]:
    try:
        return multinode.Workers(rec.workers).gone()
    except remote.RemoteError as exc:
        return [str(exc)]


def status() -> list[ServerStatus]:
    """Every registered server with its liveness and health, plus orphaned vLLM processes.

    A SIGKILLed API server leaves its engine alive and holding the GPUs: that is reported as such, not as
    "loading", since nothing will ever answer on the port.
    """
    rows = [
        ServerStatus(port=None, pid=0, model="?", url="", processes=0, health="corrupt entry", log="", started_at="",
                     detail=entry)
        for entry in corrupt_entries()
    ]  # fmt: skip
    for rec in all_registered():
        members = group_members(rec.pgid) if rec.pgid else []
        state, detail = _server_state(rec, members) if not rec.node else (health(rec.url), f"a replica on {rec.node}")
        gone = _workers_gone(rec) if rec.workers else []  # the other nodes' processes, asked over SSH
        if rec.node:
            state = "dead" if gone else state
            detail += f"; gone: {'; '.join(gone)}" if gone else ", running there"
        elif rec.workers:  # a multi-node server
            count = len(rec.workers) + (0 if any(w.role == "ray" for w in rec.workers) else 1)  # Ray's: head's too
            nodes = f"{count} nodes" + (f"; gone: {'; '.join(gone)}" if gone else ", every worker running")
            detail = f"{detail}; {nodes}" if detail else nodes
        rows.append(
            ServerStatus(
                port=rec.port,
                pid=rec.pid,
                model=rec.model,
                url=rec.url,
                processes=len(members),
                health=state,
                log=rec.log_path,
                started_at=rec.started_at,
                detail=detail,
            )
        )
    registered_groups = {rec.pgid for rec in all_registered()}
    for proc in vllm_orphans():
        try:
            if os.getpgid(proc.pid) in registered_groups:
                continue  # already reported with its server
        except ProcessLookupError:
            continue
        rows.append(
            ServerStatus(
                port=None,
                pid=proc.pid,
                model="?",
                url="",
                processes=1,
                health="orphaned",
                log="",
                started_at="",
                detail=describe(proc),
            )
        )
    return rows


# ---------------------------------------------------------------- checks for a service manager


def resources_held(port: int, host: str = "127.0.0.1", gpu_ids: list[int] | None = None) -> list[str]:
    """Everything that would stop a new server from starting: a port holder, orphaned vLLM processes,
    processes or unattributed memory on the GPUs."""
    problems = []
    holder = port_holder(host, port)
    if holder is not None:
        problems.append(
            f"port {port} is held by {describe(holder) if isinstance(holder, psutil.Process) else 'an unidentified process'}"
        )
    problems += [f"orphaned vLLM process {describe(p)}" for p in vllm_orphans()]
    if gpu_ids:
        inv = hardware.inventory()
        if not inv.available:
            problems.append(f"GPUs {gpu_ids} requested but {inv.error}")
        else:
            problems += [b.describe() for b in hardware.blockers(inv, gpu_ids)]
    return problems


def wait_ready(url: str, timeout_s: float, poll_s: float = 2.0) -> tuple[bool, str, float]:
    """Poll ``/health`` until 200 (ready), 503 (engine dead) or the timeout; (ok, what happened, seconds)."""
    start = time.monotonic()
    while True:
        elapsed = time.monotonic() - start
        state = health(url)
        if state == "ready":
            return True, f"{url} ready after {elapsed:.1f} s", elapsed
        if state == "dead":
            return False, f"{url}/health answers 503: the engine died", elapsed
        if elapsed >= timeout_s:
            return False, f"{url} not ready within {timeout_s:.0f} s (last state: {state})", elapsed
        time.sleep(min(poll_s, max(0.1, timeout_s - elapsed)))


Preflight.model_rebuild()
