"""What the project's JupyterLab serves: the workbook's notebooks open unmodified on whatever Python the
virtualenv has.

JupyterLab writes the kernel's ``language_info`` into a notebook's metadata when the kernel starts, and marks the
document modified when that differs from the file's; a committed file can only carry one Python version. The
notebooks carry none (``nbstripout --extra-keys metadata.language_info``); this contents manager adds the running
interpreter's when it serves one that names the project's kernel, and drops it again when the notebook is saved,
so the files stay as committed. ``scripts/setup.sh`` names it in the virtualenv's Jupyter configuration; jupytext's
server extension derives its paired-notebook manager from it.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ipykernel.ipkernel import IPythonKernel
from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

from servebook.json_types import JsonObject

KERNEL = "servebook"  # the kernel setup.sh registers for the project's virtualenv


def _ours(notebook: Any) -> bool:
    return (notebook.get("metadata", {}).get("kernelspec") or {}).get("name") == KERNEL


class WorkbookContentsManager(AsyncLargeFileManager):
    """The default file manager, with the kernel's own ``language_info`` on the workbook's notebooks."""

    async def get(
        self,
        path: str,
        content: bool = True,
        type: str | None = None,
        format: str | None = None,
        require_hash: bool = False,
    ) -> Any:
        model = await super().get(path, content=content, type=type, format=format, require_hash=require_hash)
        notebook = model.get("content") if model.get("type") == "notebook" else None
        if notebook is not None and _ours(notebook) and "language_info" not in notebook.metadata:
            notebook.metadata["language_info"] = copy.deepcopy(IPythonKernel.language_info)
        return model

    async def save(self, model: JsonObject, path: str = "") -> Any:
        notebook = model.get("content") if model.get("type") == "notebook" else None
        if isinstance(notebook, dict) and _ours(notebook):
            model = {**model, "content": {**notebook, "metadata": dict(notebook.get("metadata", {}))}}
            model["content"]["metadata"].pop("language_info", None)
        return await super().save(model, path)


# ---------------------------------------------------------------- a person's working copy


def workbook_folder() -> Path:
    """Where a person's notebooks live: ``workbook/`` beside ``notebooks/`` (ignored by git), or
    ``SERVEBOOK_WORKBOOK``. The same depth as ``notebooks/``, so ``../params/...`` resolves alike."""
    from servebook.results import repo_root

    return Path(os.environ.get("SERVEBOOK_WORKBOOK", repo_root() / "workbook"))


def prepare_workbook() -> tuple[Path, list[str], list[str]]:
    """Copy every stage notebook that is not in the working copy yet (a copy there is the person's: it is never
    overwritten); (the folder, the notebooks copied now, those whose template changed since the copy was made)."""
    from servebook.results import repo_root

    here, work = repo_root() / "notebooks", workbook_folder()
    work.mkdir(parents=True, exist_ok=True)
    copied, newer = [], []
    for template in sorted(here.glob("*.ipynb")):
        mine = work / template.name
        if not mine.exists():
            shutil.copy2(template, mine)
            copied.append(template.name)
        elif template.stat().st_mtime > mine.stat().st_mtime and template.read_bytes() != mine.read_bytes():
            newer.append(template.name)
    return work, copied, newer


def lab_command(work: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """JupyterLab on the working copy, reachable on this machine only (an SSH tunnel reaches it from afar)."""
    return [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={work}", "--no-browser",
            f"--port={port}", f"--ip={host}"]  # fmt: skip
