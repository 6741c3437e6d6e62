"""Stage results files: the API between stages, tests and reports.

Each stage writes ``NN_<stage>.json`` into the run folder; a later stage reads an
earlier stage's file, never an earlier notebook's variables.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from servebook.params import SECRET_NAME

STAGES = {
    "reconnaissance": "00_reconnaissance",
    "plan": "01_plan",
    "download": "02_download",
    "launch": "03_launch",
    "smoke_test": "04_smoke_test",
    "benchmark": "05_benchmark",
    "nccl_tuning": "06_nccl_tuning",
    "deploy": "07_deploy",
}
INTERACTIVE_RUN = "interactive"
MASK = "***"


def repo_root() -> Path:
    """The checkout holding notebooks/ and params/ (servebook is installed in editable mode)."""
    env = os.environ.get("SERVEBOOK_HOME")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2]


def outputs_root() -> Path:
    return Path(os.environ.get("SERVEBOOK_OUTPUTS", repo_root() / "outputs"))


def run_folder(run_dir: str = "") -> Path:
    """The run folder a notebook writes into; interactive sessions share outputs/interactive."""
    path = Path(run_dir) if run_dir else outputs_root() / INTERACTIVE_RUN
    path.mkdir(parents=True, exist_ok=True)
    return path


def secret_values() -> list[str]:
    """Values of environment variables whose names look secret, longest first."""
    values = {v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 6}
    return sorted(values, key=len, reverse=True)


def mask(text: str, secrets: list[str] | None = None) -> str:
    for value in secrets if secrets is not None else secret_values():
        text = text.replace(value, MASK)
    return text


def mask_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (MASK if SECRET_NAME.search(k) else v) for k, v in env.items()}


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, datetime):
        return obj.isoformat()
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in a results file")


def write(run_dir: str | Path, stage: str, data: dict[str, Any]) -> Path:
    """Write a stage's results (secrets masked) and return the file's path."""
    name = STAGES.get(stage, stage)
    path = Path(run_dir) / f"{name}.json"
    payload = {"stage": name, "written_at": datetime.now(timezone.utc).isoformat(), **data}
    text = mask(json.dumps(payload, indent=2, default=_json_default))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def read(run_dir: str | Path, stage: str) -> dict[str, Any] | None:
    path = Path(run_dir) / f"{STAGES.get(stage, stage)}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def require(run_dir: str | Path, stage: str, needed_by: str) -> dict[str, Any]:
    data = read(run_dir, stage)
    if data is None:
        from servebook.errors import ServebookError

        raise ServebookError(
            f"{needed_by} needs {STAGES.get(stage, stage)}.json in {run_dir}; run the {stage} stage first "
            f"(servebook run PARAMS --stages {stage},{needed_by})"
        )
    return data


def stage_of(notebook: Path) -> str:
    return re.sub(r"^\d+_", "", notebook.stem)
