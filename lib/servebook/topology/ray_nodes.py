"""One server across nodes on Ray (``distributed_backend: ray``): servebook starts a Ray cluster (the head here,
every other node joining over SSH), then the head's ``vllm serve`` places its workers on it; the cluster's nodes
are registered as the server's own processes, watched while it loads and stopped with it
(:mod:`servebook.raycluster` has each node's ``ray start``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from servebook import k8s, multinode, planner, raycluster, remote, server, ui
from servebook.multinode import NodeProbe
from servebook.params import Params
from servebook.server_config import ServerConfig
from servebook.topology import Shape, Started, Topology


class RayServer(Topology):
    shape: ClassVar[Shape] = "ray"
    cluster: raycluster.RayCluster

    def _preflight(self) -> list[NodeProbe]:
        section = self.section.nodes
        self.cluster = raycluster.RayCluster.for_nodes(section)
        probes = multinode.preflight(
            multinode.NodeSet.for_nodes(section), self.cfg.model_path, [section.ray_port], backend="ray"
        )
        self.cfg = raycluster.head_config(self.cfg, self.cluster, section.per_node)
        return probes

    @classmethod
    def manifests(cls, p: Params, plan: planner.Plan, layout: planner.Layout) -> k8s.Manifests:
        """The same server in a cluster on vLLM's own multi-node launch: the LeaderWorkerSet's pods find each other
        through LWS, so no Ray cluster is started (Ray in Kubernetes is KubeRay's to run), and the README says so."""
        mp = p.updated({"distributed_backend": "mp"}, source="the cluster's launch")
        return k8s.render(mp, plan, layout, shape_notes=(
            "distributed_backend: ray is how servebook starts this server across machines itself; in the cluster "
            "the pods run vLLM's own multi-node launch (mp) with the same layout, which LWS wires up",
        ))  # fmt: skip

    def _start(self) -> Started:
        launch = launch_on(
            self.cluster, self.cfg, self.run_dir, stop_leftovers=self.section.stop_leftovers,
            on_progress=ui.load_progress(self.section.interactive),
        )  # fmt: skip
        return Started(launch, probes=self.preflight())


def launch_on(
    cluster: raycluster.RayCluster,
    cfg: ServerConfig,
    log_dir: Path,
    *,
    stop_leftovers: bool = False,
    on_progress: Callable[[str, float], None] | None = None,
    log: Callable[[str], None] = print,
) -> server.Launch:
    """The server's preflight here, then the cluster (vLLM's head needs every node alive before it starts), then
    the head's vLLM with the cluster's nodes as its own processes. A server to reuse needs no cluster. When
    anything fails before vLLM was registered, the cluster is stopped here (after that, the server's stop does)."""
    with server.launch_lock(cfg):
        pre = server.preflight(cfg, stop_leftovers=stop_leftovers, log=log)
        if pre.reuse:
            return server.start(cfg, log_dir, pre, on_progress=on_progress, log=log)
        ray_nodes: list[remote.WorkerRecord] = []
        try:
            cluster.start(cfg.environment(base={}, with_secrets=False), log_dir, ray_nodes.append, log)
            return server.start(cfg, log_dir, pre, on_progress=on_progress, log=log, members=ray_nodes)
        except BaseException:
            if not server.registered(cfg.port):
                if left := multinode.Workers(ray_nodes).stop(server.STOP_GRACE_S):
                    log(f"the Ray cluster's stop left: {'; '.join(left)}")
            raise
