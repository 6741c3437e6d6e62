"""One server on this machine: one vLLM process group, on this machine's GPUs (or CPU cores)."""

from __future__ import annotations

from typing import ClassVar

from servebook.topology import Shape, Started, Topology


class SingleServer(Topology):
    shape: ClassVar[Shape] = "single"

    def _start(self) -> Started:
        return Started(self._launch())
