"""Stage records on disk: the API between stages, tests, the report and ``servebook compare``.

Each stage writes one :class:`Record` subclass to ``<run folder>/<FILE>.json``; a later stage
reads it back through the same type, never an earlier notebook's variables.  Writing masks every
secret value found in the environment.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator

from servebook import files
from servebook.environment import Host
from servebook.errors import MissingRecord
from servebook.secrets import mask

SCHEMA_VERSION = 3  # 1: the untyped dicts of servebook 0.1; 2: a server's layout as four fields
INTERACTIVE_RUN = "interactive"


class Record(BaseModel):
    """A stage's results file. Subclasses set ``FILE`` (``NN_<stage>``) and declare their fields."""

    model_config = ConfigDict(extra="forbid")

    FILE: ClassVar[str] = ""
    schema_version: int = SCHEMA_VERSION
    written_at: str = ""

    @model_validator(mode="before")
    @classmethod
    def _drop_computed(cls, data: Any) -> Any:
        """Computed fields are written for readers of the JSON; reading them back would count as unknown keys."""
        if isinstance(data, dict) and cls.model_computed_fields:
            return {k: v for k, v in data.items() if k not in cls.model_computed_fields}
        return data


R = TypeVar("R", bound=Record)


def repo_root() -> Path:
    """The checkout holding notebooks/ and params/ (servebook is installed in editable mode)."""
    env = os.environ.get("SERVEBOOK_HOME")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2]


def outputs_root() -> Path:
    return Path(os.environ.get("SERVEBOOK_OUTPUTS", repo_root() / "outputs"))


def run_folder(run_dir: str | Path = "") -> Path:
    """The run folder a notebook writes into; interactive sessions share outputs/interactive."""
    path = Path(run_dir) if run_dir else outputs_root() / INTERACTIVE_RUN
    path.mkdir(parents=True, exist_ok=True)
    return path


def path_of(run_dir: str | Path, record_type: type[Record]) -> Path:
    return Path(run_dir) / f"{record_type.FILE}.json"


def write(run_dir: str | Path, record: Record) -> Path:
    """Write a record (secrets masked) atomically and return the file's path."""
    record.written_at = datetime.now(timezone.utc).isoformat()
    return files.write_text(path_of(run_dir, type(record)), mask(record.model_dump_json(indent=2)))


def retire(run_dir: str | Path, record_type: type[Record]) -> None:
    """A stage starting over: its earlier record becomes ``NN_<stage>.previous.json``, so nothing reads the last
    attempt's results as this one's while it runs (or after it is interrupted)."""
    path = path_of(run_dir, record_type)
    if path.is_file():
        path.replace(path.with_suffix(".previous.json"))


def read(run_dir: str | Path, record_type: type[R]) -> R | None:
    path = path_of(run_dir, record_type)
    return record_type.model_validate_json(path.read_text()) if path.is_file() else None


def require(run_dir: str | Path, record_type: type[R], needed_by: str) -> R:
    record = read(run_dir, record_type)
    if record is None:
        stage = record_type.FILE.split("_", 1)[1]
        raise MissingRecord(
            f"{needed_by} needs {record_type.FILE}.json in {run_dir}; run the {stage} stage first "
            f"(servebook run PARAMS --stages {stage},{needed_by})"
        )
    return record


class StageRun(BaseModel):
    """One stage of a run as the runner saw it."""

    name: str  # the stage's file stem, NN_<stage>
    status: Literal["ok", "failed", "skipped", "interrupted"]
    seconds: float = 0.0
    started_s: float | None = None  # when it began, seconds after the run's first stage did
    error: str = ""
    summary: str = ""  # the stage's one-line answer, from its record


class Manifest(BaseModel):
    """``manifest.json``: what ran, where, with what, and how each stage ended."""

    run_name: str
    run_dir: str
    params_file: str
    overrides: list[str]
    params: dict[str, Any]  # Params as JSON (its own validation ran before the run)
    command: str
    started_at: str
    ended_at: str = ""
    host: Host
    versions: dict[str, str | None]
    git_commit: str | None
    stages: list[StageRun] = []
    status: Literal["running", "ok", "failed", "interrupted"] = "running"
    interrupted: str = ""  # the signal that stopped the run, and at which stage
    server_stop: str = ""
    seconds: float = 0.0

    def write(self) -> Path:
        return files.write_text(Path(self.run_dir) / "manifest.json", mask(self.model_dump_json(indent=2)))
