"""Units, defined once: every byte count is converted and printed through these."""

from __future__ import annotations

KiB = 1024
MiB = 1024**2
GiB = 1024**3


def gib(n_bytes: float | None) -> str:
    """A byte count as GiB for people, e.g. ``'12.3 GiB'``; ``'?'`` when unknown."""
    return "?" if n_bytes is None else f"{n_bytes / GiB:.1f} GiB"
