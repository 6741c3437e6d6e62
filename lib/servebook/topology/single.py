"""One server on this machine: one vLLM process group, on this machine's GPUs (or CPU cores)."""

from __future__ import annotations

from typing import ClassVar

from servebook import server, ui
from servebook.topology import Shape, Started, Topology


class SingleServer(Topology):
    shape: ClassVar[Shape] = "single"

    def _start(self) -> Started:
        launch = server.launch(
            self.cfg,
            self.run_dir,
            stop_leftovers=self.p.stop_leftovers,
            on_progress=ui.load_progress(self.p.interactive),
        )
        return Started(launch)
