"""Units, defined once: every byte count is converted and printed through these."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def gib(n_bytes: float | None) -> str:
    """A byte count as GiB for people, e.g. ``'12.3 GiB'``; ``'?'`` when unknown."""
    return "?" if n_bytes is None else f"{n_bytes / GiB:.1f} GiB"


def size(n_bytes: float | None) -> str:
    """A byte count in decimal units sized to it, as disks and downloads are quoted: ``'25.3 GB'``, ``'8.4 MB'``."""
    if n_bytes is None:
        return "?"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes:.0f} B"
