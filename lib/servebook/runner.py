"""The pipeline: validate params, execute the stage notebooks of :data:`servebook.stages.STAGES` with papermill,
record, report.

A run gets a fresh ``outputs/<timestamp>-<run_name>/`` that is never reused; it holds each executed notebook,
each stage's record, a manifest and one HTML report, also when a stage fails.
"""

from __future__ import annotations

import ast
import asyncio
import atexit
import contextlib
import gc
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import nbformat
import papermill as pm
from jupyter_client.manager import AsyncKernelManager

from servebook import beside, environment, errors, models, report, results, server, stages, topology
from servebook import params as params_mod
from servebook.errors import ParamsError, ServebookError
from servebook.records import LaunchRecord, PlanRecord, RehearsalRecord
from servebook.results import Manifest, StageRun, outputs_root, repo_root
from servebook.secrets import declare as declare_secret
from servebook.secrets import mask, secret_values
from servebook.stages import Stage


class IpcKernelManager(AsyncKernelManager):
    """Stage kernels over IPC sockets in a private folder: no TCP port opened, no "running over TCP without
    encryption" warning in every batch run."""

    socket_dir: Path | None = None  # one private folder per process, removed at exit
    running: AsyncKernelManager | None = None  # the stage kernel now executing, which an interrupt goes to first
    # where a kernel process's own stderr goes (the cells' output travels over its sockets, not there): an
    # interrupted run closes the sockets under a kernel still answering, and its zmq traceback belongs in a log
    log_path: Path | None = None

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if IpcKernelManager.socket_dir is None:
            IpcKernelManager.socket_dir = Path(tempfile.mkdtemp(prefix="servebook-kernels-"))
            atexit.register(shutil.rmtree, IpcKernelManager.socket_dir, True)
        self.transport = "ipc"
        self.ip = str(IpcKernelManager.socket_dir / "kernel")

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        if IpcKernelManager.log_path is None:
            await super()._async_launch_kernel(kernel_cmd, **kw)
            IpcKernelManager.running = self
            return
        with open(IpcKernelManager.log_path, "ab") as log:  # the kernel keeps its own copy of the descriptor
            kw.setdefault("stderr", log)
            await super()._async_launch_kernel(kernel_cmd, **kw)
        IpcKernelManager.running = self

    @classmethod
    def running_pid(cls) -> int | None:
        pid = getattr(cls.running.provisioner, "pid", None) if cls.running else None
        return pid if isinstance(pid, int) else None


RUNNER_PARAMS = set(params_mod.RUNNER_PARAMETERS)  # set by the runner, never by a params file


def notebooks_dir() -> Path:
    return Path(os.environ.get("SERVEBOOK_NOTEBOOKS", repo_root() / "notebooks"))


def notebook_of(stage: Stage) -> Path:
    return notebooks_dir() / stage.notebook


def stage_notebooks() -> list[Path]:
    return [notebook_of(stage) for stage in stages.STAGES]


def declared_parameters(notebook: Path) -> dict[str, dict[str, Any]]:
    """The parameters a notebook declares, read without starting a kernel."""
    return pm.inspect_notebook(str(notebook))


def new_run_dir(run_name: str, root: Path | None = None) -> Path:
    """Create a run folder that did not exist before (a suffix is added on a clash)."""
    root = root or outputs_root()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 1000):
        path = root / (f"{stamp}-{run_name}" if n == 1 else f"{stamp}-{run_name}-{n}")
        try:
            root.mkdir(parents=True, exist_ok=True)
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as exc:  # read-only, full, or not ours: nothing has started
            raise ServebookError(
                f"cannot create a run folder under {root} ({exc.strerror}); point SERVEBOOK_OUTPUTS at a folder this "
                "user can write, nothing was started"
            ) from None
    raise ServebookError(f"could not create a new run folder under {root}: 999 runs this second; try again")


def _scrub_notebook(path: Path, secrets: list[str]) -> None:
    """Belt and braces: no secret value from the environment survives in an executed notebook."""
    if not secrets or not path.is_file():
        return
    text = path.read_text()
    masked = mask(text, secrets)
    if masked != text:
        path.write_text(masked)


def _stage_error(exc: BaseException) -> tuple[str, int]:
    """The failure as ``Name: message``, and the exit code its servebook exception class carries (1 otherwise)."""
    if isinstance(exc, pm.PapermillExecutionError):
        known = getattr(errors, exc.ename, None)
        code = known.exit_code if isinstance(known, type) and issubclass(known, errors.ServebookError) else 1
        return f"{exc.ename}: {exc.evalue}", code
    return f"{type(exc).__name__}: {exc}", exc.exit_code if isinstance(exc, errors.ServebookError) else 1


class _Indented:
    """A text stream that indents every line written to it: a stage's own output under the runner's line."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.at_line_start = True

    def write(self, text: str) -> int:
        for piece in text.splitlines(keepends=True):
            self.target.write(("    " if self.at_line_start else "") + piece)
            self.at_line_start = piece.endswith("\n")
        self.target.flush()
        return len(text)

    def flush(self) -> None:
        self.target.flush()


NOTHING_KEPT = "no record: interrupted before the stage had a result to keep"


def stage_summary(stage: Stage, run_dir: Path) -> str:
    """The stage's one-line answer from its record; empty when it wrote none."""
    try:
        record = results.read(run_dir, stage.record)
        return stage.api.summary(record) if record is not None else ""
    except Exception as exc:  # a summary must never turn a finished stage into a failed run
        return f"(no summary: {type(exc).__name__}: {exc})"


def stop_started_servers(run_dir: Path, log: Callable[[str], None]) -> str:
    """Stop every server this run started (the launch's, an A/B variant's, one still loading when the run was
    interrupted: each registry entry whose run folder is this one), verifying nothing is left; a server it reused
    is another run's and stays."""
    mine = [r for r in server.all_registered() if r.run_dir and Path(r.run_dir).is_relative_to(run_dir.resolve())]
    if not mine:
        return "already stopped" if results.read(run_dir, LaunchRecord) else ""
    said = []
    for record in mine:
        outcome = server.stop(port=record.port, host=record.host)
        log(f"stopped the server this run started on port {record.port}: {outcome.summary}")
        said.append(f"port {record.port}: {outcome.summary}")
    return "; ".join(said)


SIGNALS = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}
# how long a stage's kernel has to act on an interrupt: stop its server (a server that served gets 20 s to
# finish its requests) and write "interrupted" into its record, before the run stops the kernel and the servers
KERNEL_INTERRUPT_GRACE_S = 25.0


class _Interrupt:
    """The signal that ends the run, passed to the stage's kernel first.

    The kernel runs in a session of its own (jupyter_client starts it so), so neither a terminal's Ctrl-C nor a
    SIGTERM to servebook reaches it. Ended from outside instead, by papermill's shutdown of the kernel, the stage
    lost its ``except``: its record kept no "interrupted" note. So the first signal interrupts the kernel as a
    Ctrl-C would; the run is interrupted when the stage's cell fails with it, when the kernel has not done so
    within :data:`KERNEL_INTERRUPT_GRACE_S`, or at a second signal.
    """

    pending: errors.Interrupted | None = None

    @classmethod
    def received(cls, signum: int, _frame: object) -> None:
        now = errors.Interrupted(SIGNALS.get(signal.Signals(signum), f"signal {signum}"), 128 + signum)
        kernel = IpcKernelManager.running_pid()
        if cls.pending is not None or kernel is None:
            cls.disarm()
            raise cls.pending or now
        cls.pending = now
        # os.write, not print: the handler may run inside a print of the stage's output
        said = f"servebook: {now.how}: the running stage is stopping what it started (a second signal ends the run at once)"
        os.write(2, (said + "\n").encode())
        try:
            os.kill(kernel, signal.SIGINT)
        except OSError:  # the kernel is gone already
            cls.disarm()
            raise now from None
        signal.signal(signal.SIGALRM, cls.expired)
        signal.setitimer(signal.ITIMER_REAL, KERNEL_INTERRUPT_GRACE_S)

    @classmethod
    def expired(cls, _signum: int, _frame: object) -> None:
        raise cls.disarm() or errors.Interrupted("an interrupt", 130)

    @classmethod
    def disarm(cls) -> errors.Interrupted | None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return cls.pending

    @classmethod
    def of_kernel(cls) -> errors.Interrupted:
        """What ended a cell that failed with KeyboardInterrupt: the signal servebook passed on, or one the
        kernel got by itself (a person's interrupt in JupyterLab on the same kernel, ``kill -INT``)."""
        return cls.disarm() or errors.Interrupted("Ctrl-C (SIGINT)", 130)


@contextlib.contextmanager
def interrupt_on_signals() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP (``timeout``, a closed terminal, a service manager) end the run as
    :class:`~servebook.errors.Interrupted`, so what the run started is stopped and what it measured kept; a stage
    running gets the interrupt first (:class:`_Interrupt`)."""
    _Interrupt.pending = None
    before = {sig: signal.signal(sig, _Interrupt.received) for sig in SIGNALS}
    alarm = signal.getsignal(signal.SIGALRM)
    try:
        yield
    finally:
        _Interrupt.disarm()
        _Interrupt.pending = None
        for sig, handler in before.items():
            signal.signal(sig, handler)
        signal.signal(signal.SIGALRM, alarm)


@contextlib.contextmanager
def kernel_clients_logged_to(path: Path) -> Iterator[None]:
    """papermill's kernel client and asyncio speak of the kernels' own life (a kernel that died because an interrupt
    stopped it, its abandoned task's "exception was never retrieved"): that goes to the run's kernels.log beside
    the kernels' stderr, not to the terminal, where the run's own lines say what happened."""
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("papermill", "asyncio")]
    before = [(lg.handlers[:], lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers, lg.propagate = [handler], False
    try:
        yield
    finally:
        _settle_abandoned_tasks()
        gc.collect()  # an abandoned task reports its exception when it is collected: while the handler listens
        for lg, (handlers, propagate) in zip(loggers, before, strict=True):
            lg.handlers, lg.propagate = handlers, propagate
        handler.close()


SETTLE_TASKS_S = 5.0  # a cancelled nbclient task ends at once; the bound keeps a stuck one from holding the exit


def _settle_abandoned_tasks() -> None:
    """A run interrupted from outside a cell (a second signal, the grace run out) leaves papermill's tasks for that
    cell pending in this thread's event loop: its poll of the kernel's life, the cell's execution. They would fail
    the next time that loop runs, with nothing left to talk to, and be reported when collected, long after the run
    (in a test process, after pytest's summary). Cancelled and awaited now, they end while kernels.log listens."""
    from jupyter_core.utils import ensure_event_loop

    loop = ensure_event_loop()
    if loop.is_running() or loop.is_closed():
        return
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    ended, _ = loop.run_until_complete(asyncio.wait(pending, timeout=SETTLE_TASKS_S))
    for task in ended:  # retrieved: their errors are the interrupt's, said already
        _ = task.cancelled() or task.exception()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """A second Ctrl-C or SIGTERM must not cut the clean-up short: signals wait until it is done."""
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@dataclass
class Pipeline:
    """One run in progress: its params, folder, what each notebook declares, and how it reports."""

    params: params_mod.Params
    run_dir: Path
    selected: list[Stage]
    declared: dict[str, dict[str, Any]]
    secrets: list[str]
    log: Callable[[str], None]
    stream_output: bool
    current_start: float = 0.0  # when the stage now running began (an interrupted stage's seconds)
    run_start: float = field(default_factory=time.monotonic)  # when the run's first stage began

    def run_stage(self, n: int, stage: Stage) -> tuple[StageRun, int]:
        """Execute one stage's notebook; (how it ended, its exit code). A stage that finished without writing
        its record failed: nothing later could read what it found."""
        values = injected_values(self.params, set(self.declared[stage.name]), self.run_dir)
        out = self.run_dir / stage.notebook
        total = len(self.selected)
        self.log(f"[{n}/{total}] {stage.record.FILE} ...")
        start = self.current_start = time.monotonic()
        entry = StageRun(name=stage.record.FILE, status="ok", started_s=round(start - self.run_start, 1))
        exit_code = 0
        IpcKernelManager.log_path, IpcKernelManager.running = self.run_dir / "kernels.log", None
        try:
            pm.execute_notebook(
                str(notebook_of(stage)), str(out), parameters=values, kernel_name="python3",
                cwd=str(notebooks_dir()), progress_bar=False, log_output=False, report_mode=False,
                kernel_manager_class=IpcKernelManager,
                stdout_file=_Indented(sys.stdout) if self.stream_output else None,
            )  # fmt: skip
            if _Interrupt.pending:  # the stage took the interrupt as the end of its work and finished
                raise _Interrupt.of_kernel()
            if not results.path_of(self.run_dir, stage.record).is_file():
                raise errors.MissingRecord(
                    f"stage {stage.name} finished without writing {stage.record.FILE}.json; its notebook must call "
                    f"servebook.stages.{stage.name}.run(), which writes the record later stages read"
                )
            self.gate(stage)
        except Exception as exc:  # papermill has saved the notebook with the failing cell marked
            if isinstance(exc, pm.PapermillExecutionError) and exc.ename == "KeyboardInterrupt":
                raise _Interrupt.of_kernel() from None  # the stage acted on the interrupt: its record says so
            entry.status = "failed"
            error, exit_code = _stage_error(exc)
            entry.error = mask(error, self.secrets)
            print(f"servebook: stage {stage.name} failed: {entry.error}", file=sys.stderr)
        finally:
            IpcKernelManager.running = None
        entry.seconds = round(time.monotonic() - start, 2)
        entry.summary = mask(stage_summary(stage, self.run_dir), self.secrets)
        _scrub_notebook(out, self.secrets)
        first_line = entry.error.splitlines()[0] if entry.error else ""
        plain = entry.summary.replace("**", "")  # the report renders the summary's Markdown; a terminal would not
        said = f": {first_line}" if entry.status == "failed" else (f": {plain}" if plain else "")
        self.log(f"[{n}/{total}] {stage.record.FILE} {entry.status} in {entry.seconds:.1f} s{said}")
        return entry, exit_code

    def gate(self, stage: Stage) -> None:
        """A plan whose launch vLLM would refuse stops the run before the download and the launch (the plan's
        notebook itself only says so, so that a what-if there never raises)."""
        if stage.name != "plan" or not any(s.name == "launch" for s in self.selected):
            return
        from servebook.stages import plan as plan_stage

        record = results.read(self.run_dir, PlanRecord)
        if record and (why := plan_stage.refusal(record, self.params)):
            raise errors.LayoutRejected(why)


class _Side:
    """The download running beside the rehearsal (``rehearse_during_download``): started in its own process where
    the rehearsal comes next and the checkpoint comes from the hub, waited for once the rehearsal ends."""

    def __init__(self, pipeline: Pipeline, params_path: str, overrides: list[str]) -> None:
        self.pipeline, self.params_path, self.overrides = pipeline, params_path, overrides
        self.running: beside.Beside | None = None
        self.started_s = 0.0

    def starts(self, n: int, stage: Stage) -> bool:
        p, selected = self.pipeline.params, self.pipeline.selected
        hub = not models.is_builtin(p.model) and not Path(p.model).expanduser().is_dir()
        if not (stage.name == "download" and n < len(selected) and selected[n].name == "rehearse"):
            return False
        if not (p.rehearse_during_download and hub):
            return False
        self.started_s = round(time.monotonic() - self.pipeline.run_start, 1)
        self.running = beside.Beside.start(
            stage.name, stage.record.FILE, self.pipeline.run_dir, self.params_path, self.overrides
        )
        self.pipeline.log(
            f"[{n}/{len(selected)}] {stage.record.FILE} ... beside the rehearsal (its output in "
            f"{self.running.log_path.name})"
        )
        return True

    def joins(self, stage: Stage, entry: StageRun, manifest: Manifest) -> int:
        """After the rehearsal: wait for the download, then both go into the manifest in pipeline order."""
        if self.running is None or stage.name != "rehearse":
            manifest.stages.append(entry)
            return 0
        if self.running.running():
            self.pipeline.log(f"waiting for {self.running.name}, still running beside")
        done, code = self.running.wait()
        done.started_s = self.started_s
        self.running = None
        manifest.stages += [done, entry]
        self.pipeline.log(
            f"{done.name} {done.status} in {done.seconds:.1f} s" + (f": {done.error}" if done.error else "")
        )
        _note_overlap(self.pipeline.run_dir, done, entry)
        return code

    def stop(self, manifest: Manifest) -> None:
        """An interrupted run stops the download too; it resumes on the next run."""
        if self.running is None:
            return
        self.running.stop()
        done, _ = self.running.wait()
        done.started_s = self.started_s
        manifest.stages.append(done.model_copy(update={"status": "interrupted"}) if done.status == "ok" else done)
        self.running = None


def _note_overlap(run_dir: Path, download_run: StageRun, rehearse_run: StageRun) -> None:
    """How long the rehearsal ran while the download did, into the rehearsal's record."""
    if download_run.started_s is None or rehearse_run.started_s is None:
        return
    both = min(download_run.started_s + download_run.seconds, rehearse_run.started_s + rehearse_run.seconds) - max(
        download_run.started_s, rehearse_run.started_s
    )
    record = results.read(run_dir, RehearsalRecord)
    if record is not None:
        record.download_overlap_s = round(max(both, 0.0), 1)
        results.write(run_dir, record)


def _manifest(
    params: params_mod.Params, params_path: str | Path, overrides: list[str] | tuple[str, ...], run_dir: Path
) -> Manifest:
    return Manifest(
        run_name=params.run_name,
        run_dir=str(run_dir),
        params_file=str(params_path),
        overrides=list(overrides),
        params=params.model_dump(mode="json"),
        command=" ".join(sys.argv),
        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        host=environment.host(params.model_store).model_copy(update={"hostname": socket.gethostname()}),
        versions=environment.versions(),
        git_commit=environment.git_commit(repo_root()),
    )


def require_key(params: params_mod.Params, selected: list[Stage]) -> None:
    """A run whose stages start or reach a keyed server needs the key before its first stage, not minutes in when
    the first of them asks for it; a plan-only run does not."""
    serving = [stage.name for stage in selected if stage.serves]
    if params.api_key_env and params.api_key_env not in os.environ and serving:
        raise ParamsError(
            "api_key_env",
            [
                f"api_key_env names {params.api_key_env}, which is not set, and the server's key is needed by "
                f"{', '.join(serving)}; export {params.api_key_env} before running, or set api_key_env: '' for a "
                "keyless server"
            ],
        )


def run(
    params_path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    wanted: str | None = None,
    log: Callable[[str], None] = print,
    suffix: str = "",
    stream_output: bool = True,
) -> tuple[Path, int]:
    """Execute the selected stages (all by default); returns (run folder, exit code).

    ``suffix`` names single-stage runs (``<run_name>-bench``) apart from whole pipelines; with ``stream_output``
    what a stage prints (load phases, benchmark levels, NCCL sets) appears as it happens, indented under the stage.
    """
    params = params_mod.load(params_path, overrides)  # raises before anything exists
    declare_secret(params.api_key_env)  # its value is masked in every notebook, record and report, as the key it is
    selected = stages.select(wanted)
    require_key(params, selected)
    stages.require_upstream(selected)
    if any(stage.record.FILE == "03_launch" for stage in selected):
        topology.shape_of(params, str(params_path))  # a shape servebook's own launch cannot start is refused now
    declared = {stage.name: declared_parameters(notebook_of(stage)) for stage in selected}
    run_dir = new_run_dir(f"{params.run_name}-{suffix}" if suffix else params.run_name)
    pipeline = Pipeline(params, run_dir, selected, declared, secret_values(), log, stream_output)
    manifest = _manifest(params, params_path, overrides, run_dir)
    manifest.write()  # a run that dies at once still says what it was
    exit_code, n = 0, 0
    side = _Side(pipeline, str(params_path), list(overrides))
    with kernel_clients_logged_to(run_dir / "kernels.log"):
        try:
            with interrupt_on_signals():
                for n, stage in enumerate(selected, 1):
                    if side.starts(n, stage):
                        continue
                    entry, exit_code = pipeline.run_stage(n, stage)
                    exit_code = side.joins(stage, entry, manifest) or exit_code
                    if exit_code:
                        manifest.stages += [StageRun(name=rest.record.FILE, status="skipped") for rest in selected[n:]]
                        break
        except KeyboardInterrupt as exc:
            side.stop(manifest)
            how, exit_code = (
                (exc.how, exc.exit_code) if isinstance(exc, errors.Interrupted) else ("Ctrl-C (SIGINT)", 130)
            )
            current = selected[n - 1].record.FILE if n else "the start"
            manifest.interrupted = f"{how} during {current}"
            log(f"interrupted: {manifest.interrupted}; stopping what this run started")
            seconds = round(time.monotonic() - pipeline.current_start, 2) if n else 0.0
            answer = mask(stage_summary(selected[n - 1], run_dir), pipeline.secrets) if n else ""  # what it kept
            answer = answer or (NOTHING_KEPT if n else "")
            began = round(pipeline.current_start - pipeline.run_start, 1) if n else None
            manifest.stages.append(
                StageRun(
                    name=current, status="interrupted", error=manifest.interrupted, seconds=seconds, summary=answer,
                    started_s=began,
                )
            )  # fmt: skip
            manifest.stages += [StageRun(name=rest.record.FILE, status="skipped") for rest in selected[n:]]
        finally:  # whatever happened, the servers this run started do not outlive it
            with signals_deferred():
                exit_code = _finish(pipeline, manifest, exit_code)
    return run_dir, exit_code


def _finish(pipeline: Pipeline, manifest: Manifest, exit_code: int) -> int:
    """Stop this run's servers (all of them, unless keep_server and the run ended by itself), then write the
    manifest and the report; each step runs even when the one before failed."""
    run_dir, log = pipeline.run_dir, pipeline.log
    if not pipeline.params.keep_server or manifest.interrupted:
        try:
            manifest.server_stop = stop_started_servers(run_dir, log)
        except ServebookError as exc:
            manifest.server_stop = f"error: {exc}"
            log(f"could not stop the server this run started: {exc}")
            exit_code = exit_code or exc.exit_code
    manifest.status = "interrupted" if manifest.interrupted else ("ok" if exit_code == 0 else "failed")
    manifest.ended_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # stages side by side (the download beside the rehearsal) count once: the run's span, not the sum
    ends = [s.started_s + s.seconds for s in manifest.stages if s.started_s is not None]
    manifest.seconds = round(max(ends) if ends else sum(s.seconds for s in manifest.stages), 2)
    try:
        manifest.write()
        report_path = report.build(run_dir, manifest)
        log(f"report: {report_path} ({report_path.stat().st_size / 1e6:.1f} MB)")
    except ServebookError as exc:  # a full disk: the records written before it are kept
        print(f"servebook: {exc}", file=sys.stderr)
        exit_code = exit_code or exc.exit_code
    return exit_code


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
        expected = params_mod.notebook_default(name)  # the vocabulary's, or a person's notebook's own
        if default != expected:
            problems.append(f"{nb_name}: parameter '{name}' defaults to {default!r}, the vocabulary says {expected!r}")
    return problems


def injected_values(params: params_mod.Params, declared: set[str], run_dir: str | Path | None) -> dict[str, Any]:
    """What papermill puts in a notebook: every value it declares, its run folder, and no params file (the values
    are all there already)."""
    values = params_mod.notebook_values(params, declared)
    if run_dir is not None and "run_dir" in declared:
        values["run_dir"] = str(run_dir)
    if "params_file" in declared:
        values["params_file"] = ""
    return values


def prepare(
    params_path: str | Path,
    out_dir: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    run_dir: str | Path | None = None,
) -> list[Path]:
    """Write parameterized, unexecuted copies of the stage notebooks (for nbval or a later run)."""
    params = params_mod.load(params_path, overrides)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for nb in stage_notebooks():
        values = injected_values(params, set(declared_parameters(nb)), run_dir)
        target = out_dir / nb.name
        pm.execute_notebook(str(nb), str(target), parameters=values, prepare_only=True, kernel_name="python3")
        written.append(target)
    return written


PARAMETERS_CELL = re.compile(r'(# %% tags=\["parameters"\]\n)(.*?)(\n\n# %%)', re.S)


def sync_parameter_cells(twins: list[Path]) -> list[Path]:
    """Re-render the parameters cell of each py:percent twin from :class:`Params`, keeping the names it declares.

    Returns the twins that changed; ``scripts/sync-notebooks.sh`` then pairs them with their .ipynb.
    """
    changed = []
    for twin in twins:
        text = twin.read_text()
        match = PARAMETERS_CELL.search(text)
        if not match:
            raise ServebookError(f"{twin} has no cell tagged parameters")
        names = re.findall(r"^(\w+)\s*:", match.group(2), re.M)
        fresh = text[: match.start(2)] + params_mod.parameters_cell(names) + text[match.end(2) :]
        if fresh != text:
            twin.write_text(fresh)
            changed.append(twin)
    return changed


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
        elif set(decl) <= set(params_mod.FIELDS) | RUNNER_PARAMS:
            expected = params_mod.parameters_cell(list(decl))
            if tagged[0].source.strip() != expected:
                problems.append(
                    f"{nb.name}: the parameters cell differs from what servebook.params renders "
                    "(names, types, defaults or help); run `bash scripts/sync-notebooks.sh`"
                )
    for pf in params_files:
        try:
            values = params_mod.load(pf).model_dump(exclude_unset=True)
        except ParamsError as exc:
            problems.append(str(exc))
            continue
        for key in values:
            if key not in declared_any and key not in params_mod.RUN_LEVEL | params_mod.COMMAND_ONLY:
                problems.append(f"{pf.name} sets '{key}', which no notebook declares")
    unused = set(params_mod.FIELDS) - declared_any - params_mod.RUN_LEVEL - params_mod.COMMAND_ONLY
    for name in sorted(unused):
        problems.append(f"'{name}' is in the vocabulary but no notebook declares it")
    return problems
