"""A stage that runs beside the pipeline in a process of its own: the download while the rehearsal runs.

``servebook run`` starts the download stage's notebook here (``python -m servebook.beside``), then runs the
rehearsal, then waits for the download before the launch. The process has its own session, so the runner can
stop it (and, through papermill, its kernel) when the run is interrupted; it writes how the stage ended as JSON
beside its output, which the runner puts into the manifest in pipeline order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from servebook.results import StageRun

STOP_GRACE_S = 20.0  # SIGINT lets papermill shut its kernel down; then SIGKILL


@dataclass
class Beside:
    """One stage running in its own process."""

    name: str  # the stage's file stem, NN_<stage>
    process: subprocess.Popen[bytes]
    ended_file: Path
    log_path: Path
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def start(cls, stage_name: str, file_stem: str, run_dir: Path, params_path: str, overrides: list[str]) -> Beside:
        ended = run_dir / f".{file_stem}.ended.json"
        log_path = run_dir / f"{file_stem}.log"
        command = [sys.executable, "-m", "servebook.beside", str(run_dir), stage_name, str(params_path), *overrides]
        with log_path.open("wb") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return cls(file_stem, process, ended, log_path)

    def running(self) -> bool:
        return self.process.poll() is None

    def wait(self) -> tuple[StageRun, int]:
        """How the stage ended, and its exit code, once its process has."""
        code = self.process.wait()
        if self.ended_file.is_file():
            entry = StageRun.model_validate_json(self.ended_file.read_text())
            self.ended_file.unlink()
            return entry, code
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] if self.log_path.is_file() else []
        error = f"its process ended with {code} before recording how the stage went" + (f": {tail[0]}" if tail else "")
        return StageRun(name=self.name, status="failed", error=error), code or 1

    def stop(self) -> None:
        """Interrupt it as Ctrl-C would (papermill stops the kernel), then kill what is left."""
        if not self.running():
            return
        with _gone_ok():
            os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with _gone_ok():
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class _gone_ok:  # noqa: N801  (a context manager used like a statement)
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is ProcessLookupError


def main(argv: list[str]) -> int:
    """Run one stage of a run folder's pipeline and write how it ended; the exit code is the stage's."""
    from servebook import params as params_mod
    from servebook import runner, stages
    from servebook.secrets import secret_values

    run_dir, stage_name, params_path, *overrides = argv
    params = params_mod.load(params_path, overrides)
    (stage,) = stages.select(stage_name)
    declared = {stage.name: runner.declared_parameters(runner.notebook_of(stage))}
    pipeline = runner.Pipeline(params, Path(run_dir), [stage], declared, secret_values(), print, True)
    try:
        entry, code = pipeline.run_stage(1, stage)
    except KeyboardInterrupt:
        entry, code = StageRun(name=stage.record.FILE, status="interrupted", error="interrupted with the run"), 130
    Path(run_dir, f".{stage.record.FILE}.ended.json").write_text(json.dumps(entry.model_dump()))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
