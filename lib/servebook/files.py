"""Files written whole or not at all: a record, the manifest, the registry, a table, the report.

Each is written to a temporary file beside its target, flushed to disk and renamed over it, so a reader (a later
stage, ``servebook status``, a person opening the report) sees the old file or the new one, never half of one; a
full disk is named with the path and the space the write needed, and leaves the old file as it was.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from servebook.errors import DiskFull

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
T = TypeVar("T")


def write_text(path: str | Path, text: str) -> Path:
    """``text`` into ``path``, atomically."""
    data = text.encode()
    with replacing(path, len(data)) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    return Path(path)


def write_with(path: str | Path, writer: Callable[[Path], None], expected_bytes: int = 0) -> Path:
    """Let ``writer`` write a temporary file (pandas' ``to_parquet``, say), then put it in ``path``'s place."""
    with replacing(path, expected_bytes) as tmp:
        writer(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    return Path(path)


@contextmanager
def replacing(path: str | Path, expected_bytes: int = 0) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to write; renamed over ``path`` when the block ends."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, target)
    except OSError as exc:
        needed = expected_bytes or _size(tmp)
        tmp.unlink(missing_ok=True)
        if exc.errno in NO_SPACE:
            raise DiskFull(str(target), needed, free_bytes(target.parent)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def append_line(path: Path, line: str, keep: int) -> None:
    """Append one line to a JSON-lines history, keeping its last ``keep`` lines; the file is written whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = path.read_text().splitlines()[-(keep - 1) :] if path.exists() else []
    write_text(path, "\n".join([*lines, line]) + "\n")


def read_lines(path: Path, parse: Callable[[str], T]) -> list[T]:
    """A JSON-lines history's entries; a line that does not parse (another version's) is skipped, never fatal."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(parse(line))
        except ValueError:
            continue
    return out
