"""Every NVML call servebook makes, through one seam.

The backend is NVIDIA's ``nvidia-ml-py`` (imported as ``pynvml``).  Tests put a stand-in with the same functions
in its place with :func:`use_backend` (theirs answers from scenario files under ``tests/support``), so they
exercise exactly the code paths that run on a GPU server; NVML is the one thing servebook's tests fake.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from enum import IntEnum
from typing import Any

import pynvml

from servebook.errors import NvmlUnavailable

NVLINK_MAX_LINKS = 36


class P2PCap(IntEnum):
    # nvidia-ml-py 13.615.71 defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,); keep our own integers.
    READ = 0
    WRITE = 1
    NVLINK = 2


TOPOLOGY_LEVELS = {0: "INTERNAL", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_CODES = {name: code for code, name in TOPOLOGY_LEVELS.items()}


_backend: Callable[[], Any] | None = None  # None: NVIDIA's pynvml


def use_backend(factory: Callable[[], Any] | None) -> None:
    """Answer NVML calls with what ``factory()`` returns (an object with pynvml's functions) until it is reset
    with None; each :func:`session` calls it afresh."""
    global _backend
    _backend = factory


@contextlib.contextmanager
def session() -> Iterator[Any]:
    """Yield an initialised NVML; raise :class:`NvmlUnavailable` without a driver."""
    backend: Any = _backend() if _backend else pynvml
    try:
        backend.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable(
            f"NVML is not available ({exc}): no NVIDIA driver is loaded on this host, "
            "or libnvidia-ml.so.1 is not on the library path"
        ) from None
    try:
        yield backend
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            backend.nvmlShutdown()


def optional(fn, *args, **kwargs):
    """Call an NVML query that some GPUs or drivers do not support; None when unsupported."""
    try:
        return fn(*args, **kwargs)
    except pynvml.NVMLError:
        return None
