"""One server across nodes on Ray (``distributed_backend: ray``): servebook starts a Ray cluster (the head here,
every other node joining over SSH), then the head's ``vllm serve`` places its workers on it; the cluster's nodes
are registered as the server's workers, watched and stopped with it (:mod:`servebook.raycluster`)."""

from __future__ import annotations

from typing import ClassVar

from servebook import multinode, raycluster, server, ui
from servebook.multinode import NodeProbe
from servebook.topology import Shape, Started, Topology


class RayServer(Topology):
    shape: ClassVar[Shape] = "ray"
    cluster: raycluster.RayCluster

    def _preflight(self) -> list[NodeProbe]:
        self.cluster = raycluster.RayCluster.from_params(self.p)
        nodes = multinode.NodeSet.from_params(self.p)
        probes = multinode.preflight(nodes, self.cfg.model_path, [self.p.ray_port], backend="ray")
        self.cfg = raycluster.head_config(self.cfg, self.cluster, self.p.per_node)
        return probes

    def _start(self) -> Started:
        launch = server.launch(
            self.cfg, self.run_dir, stop_leftovers=self.p.stop_leftovers, on_progress=ui.load_progress(self.p.interactive),
            cluster=self.cluster,
        )  # fmt: skip
        return Started(launch, probes=self.preflight())
