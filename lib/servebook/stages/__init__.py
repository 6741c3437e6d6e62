"""The pipeline, declared once: every stage, its notebook, its record, what it reads, its gate, its summary.

A stage is one module here with the same small interface, one notebook ``notebooks/NN_<name>.ipynb``
and one row of :data:`STAGES`.  ``servebook run``, ``--stages``, the CLI's single-stage commands, the
report and the tests read this table; nothing else lists stages.

Arrows point one way: ``cli``/``runner`` → ``stages`` → the core modules.  A stage reads an upstream
stage's *record* (``results.read(run, LaunchRecord)``), never its code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Protocol, cast

from servebook.errors import ParamsError
from servebook.params import Params
from servebook.results import Record


class StageModule(Protocol):
    """What every module in this package provides."""

    def run(self, p: Params, run_dir: str | Path) -> Record:
        """Do the stage's work, write its record into the run folder and return it (also when the gate will fail)."""
        ...

    def check(self, record: Record, p: Params) -> None:
        """The go/no-go gate: raise a :class:`~servebook.errors.ServebookError` that says what to do, or return."""
        ...

    def summary(self, record: Record) -> str:
        """One line of Markdown with the stage's answer, for the report's first screen and the CLI."""
        ...


@dataclass(frozen=True)
class Stage:
    record: type[Record]  # its FILE, NN_<name>, numbers and names the stage
    module: ModuleType
    needs: tuple[str, ...] = ()  # stages whose records it reads when present
    requires: tuple[str, ...] = ()  # stages whose records it cannot run without
    serves: bool = False  # starts vLLM or talks to it, so it needs the server's key where api_key_env names one

    @property
    def number(self) -> int:
        return int(self.record.FILE[:2])

    @property
    def name(self) -> str:
        return self.record.FILE[3:]

    @property
    def notebook(self) -> str:
        return f"{self.record.FILE}.ipynb"

    @property
    def api(self) -> StageModule:
        return cast(StageModule, self.module)


def _table() -> list[Stage]:
    from servebook import records
    from servebook.stages import (
        benchmark,
        deploy,
        download,
        launch,
        nccl_tuning,
        plan,
        reconnaissance,
        rehearse,
        smoke_test,
    )

    return [
        Stage(records.ReconRecord, reconnaissance),
        Stage(records.PlanRecord, plan, needs=("reconnaissance",)),
        Stage(records.DownloadRecord, download),
        # beside the download where servebook run can (rehearse_during_download); it reads the download's
        # folder when the download has finished, else the checkpoint's config and tokenizer
        Stage(records.RehearsalRecord, rehearse, needs=("reconnaissance", "plan", "download"), serves=True),
        Stage(records.LaunchRecord, launch, needs=("reconnaissance", "plan", "download", "rehearse"), serves=True),
        Stage(records.SmokeTestRecord, smoke_test, requires=("launch",), serves=True),
        Stage(records.BenchmarkRecord, benchmark, requires=("launch",), serves=True),
        Stage(records.NcclTuningRecord, nccl_tuning, needs=("reconnaissance",), requires=("launch",), serves=True),
        Stage(records.DeployRecord, deploy, needs=("nccl_tuning",), requires=("launch",), serves=True),
    ]


STAGES: list[Stage] = _table()


def select(wanted: str | None) -> list[Stage]:
    """Stages for ``--stages`` (names like ``launch`` or numbers like ``03``; ``02`` is the download and the
    rehearsal), in pipeline order."""
    if not wanted:
        return list(STAGES)
    known: dict[str, list[Stage]] = {}
    for stage in STAGES:
        for key in {stage.name, f"{stage.number:02d}", stage.record.FILE}:
            known.setdefault(key, []).append(stage)
    items = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [item for item in items if item not in known]
    if unknown:
        names = ", ".join(stage.name for stage in STAGES)
        raise ParamsError("--stages", [f"unknown stage '{u}'; known stages: {names}" for u in unknown])
    picked = {stage.name for item in items for stage in known[item]}
    return [stage for stage in STAGES if stage.name in picked]


def require_upstream(selected: list[Stage]) -> None:
    """Refuse a selection with a stage whose required stage is not in it: every run starts in a folder of its own, so
    such a stage would start only to find no record to read. The fix names the whole selection, in pipeline order."""
    names = {stage.name for stage in selected}
    missing = {needed for stage in selected for needed in stage.requires if needed not in names}
    if not missing:
        return
    lacking = [stage.name for stage in selected if set(stage.requires) & missing]
    whole = ",".join(stage.name for stage in STAGES if stage.name in names | missing)
    said = " and ".join(sorted(missing))
    raise ParamsError(
        "--stages",
        [
            f"{', '.join(lacking)} need{'s' if len(lacking) == 1 else ''} the {said} stage in the same run (each run "
            f"starts in an empty folder): --stages {whole} ({said} reuses a server already serving on the port)"
        ],
    )
