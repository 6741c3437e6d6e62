"""One server across nodes on vLLM's own multi-node launch (``distributed_backend: mp``): the head's ``vllm
serve`` here, each other node's started over the user's SSH (``--headless``, or its own data-parallel ranks),
watched while the head loads and stopped with it (:mod:`servebook.multinode` has the mechanics)."""

from __future__ import annotations

from typing import ClassVar

from servebook import multinode, remote
from servebook.multinode import NodeProbe
from servebook.topology import Shape, Started, Topology


class MultiNodeServer(Topology):
    shape: ClassVar[Shape] = "nodes"
    workers: list[remote.WorkerRecord]

    def api_port(self) -> int:
        """Where each node serves its own API (hybrid only); 0: the head alone serves it."""
        return 0

    def _preflight(self) -> list[NodeProbe]:
        """Every node probed (software, checkpoint, ports, GPUs, clock), then the head's and each other node's
        command. ``server.launch`` checks the head's API port here, ``router.start`` the router's."""
        nodes = multinode.NodeSet.for_nodes(self.section.nodes)
        api = self.api_port()
        probes = multinode.preflight(nodes, self.cfg.model_path, [nodes.master_port], node_ports=[api] if api else [])
        self.cfg, self.workers = multinode.prepare(self.cfg, nodes, self.run_dir, api)
        return probes

    def _start(self) -> Started:
        return Started(self._launch(self.workers), probes=self.preflight())
