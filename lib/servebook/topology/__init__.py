"""The server's shape, one owner per shape: a single server, one server across nodes on vLLM's own launcher (mp)
or on Ray, hybrid data parallelism (an API server per node behind vllm-router), and independent replicas behind
vllm-router (some of them on other machines).

:func:`shape_of` is the one place that reads the shape from the params; :func:`of` builds the shape's
:class:`Topology`, which owns its whole life: the checks on every machine before anything starts
(:meth:`Topology.preflight`), the start of everything it needs in order, each part ready (:meth:`Topology.start`;
what it started is stopped again when a later part fails), the ports it holds, :meth:`Topology.stop` (verified
gone), :meth:`Topology.running` (a context manager whose exit stops everything), and the shape of its launch record
and its systemd units (:meth:`Topology.deploy_units`, which ``stages/deploy.py`` calls for the shape a launch
record names, :func:`kind`). One file per shape: ``single.py``,
``mp_nodes.py``, ``ray_nodes.py``, ``hybrid.py``, ``replica_set.py``.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from servebook import remote, server, ui
from servebook.errors import CleanupError, ParamsError
from servebook.multinode import NodeProbe, NodeSet
from servebook.params import DeploySection, Params, TopologySection
from servebook.replicas import ReplicaRecord
from servebook.router import RouterRecord
from servebook.server_config import ServerConfig

if TYPE_CHECKING:  # the records name the shape: they import this module
    from servebook import planner
    from servebook.k8s import Manifests
    from servebook.records import DeployRecord, LaunchRecord

Shape = Literal["single", "nodes", "ray", "hybrid", "replicas"]
SHAPES: dict[Shape, str] = {
    "single": "one server on this machine",
    "nodes": "one server across nodes, on vLLM's own multi-node launch (mp)",
    "ray": "one server across nodes, on a Ray cluster servebook starts",
    "hybrid": "hybrid data parallelism: an API server per node, vllm-router in front on this machine",
    "replicas": "independent replicas behind vllm-router, on this machine or also on others (replica_hosts)",
}


def shape_of(p: Params, source: str = "params") -> Shape:
    """The serving shape the params describe; :class:`ParamsError` for one servebook's own launch cannot start
    (replicas of a multi-node server, which ``servebook export k8s`` renders as LeaderWorkerSet groups)."""
    if p.replicas > 1 and p.nodes > 1:
        raise ParamsError(
            source,
            [
                f"replicas {p.replicas} with nodes {p.nodes}: servebook's own launch runs each replica on one machine; "
                "set nodes: 1 and list the machines in replica_hosts to spread the replicas over them, or replicas: 1 "
                "for one server across nodes (`servebook export k8s` renders replicas of a multi-node server as "
                "LeaderWorkerSet groups)"
            ],
        )
    if p.replicas > 1:
        return "replicas"
    if p.nodes > 1 and p.distributed_backend == "ray":
        return "ray"
    if p.nodes > 1 and p.data_parallel_lb == "hybrid":
        return "hybrid"
    return "nodes" if p.nodes > 1 else "single"


def spans_machines(p: Params) -> bool:
    """Whether the shape uses machines besides this one (nodes of one server, or replica_hosts)."""
    return p.nodes > 1 or bool(p.replica_hosts)


def machines(p: Params) -> NodeSet | None:
    """The machines the shape uses besides this one, as reconnaissance and the preflight probe them: the nodes
    of a server across nodes, the machines ``replica_hosts`` lists; None when everything runs here."""
    if p.nodes > 1:
        return NodeSet.for_nodes(p.nodes_section)
    return NodeSet.for_replicas(p.replica_section) if p.replica_hosts else None


def shape_of_launch(has_router: bool, workers: list[str]) -> Shape:
    """The shape a launch record describes, from what it started: a router with other nodes' API servers is
    hybrid, a router alone replicas, Ray's nodes ray, other nodes' vLLM nodes; else one server."""
    if has_router:
        return "hybrid" if workers else "replicas"
    if "ray" in workers:
        return "ray"
    return "nodes" if workers else "single"


@dataclass
class Started:
    """What a topology started: the server clients reach first (the head, or the first replica here), the
    servers behind a router with the router, and what each machine's preflight found."""

    launch: server.Launch
    replicas: list[ReplicaRecord] = field(default_factory=list)
    router: RouterRecord | None = None
    probes: list[NodeProbe] = field(default_factory=list)


class Topology(abc.ABC):
    """One serving shape's life. ``cfg`` is the server's configuration (the params with the plan's layout and the
    download's folder); :meth:`preflight` may turn it into the head's own part (its node flags, its address).
    ``section`` is the rest the shape needs: its nodes, its replicas, how its starts behave."""

    shape: ClassVar[Shape]

    def __init__(self, section: TopologySection, cfg: ServerConfig, run_dir: Path):
        self.section, self.cfg, self.run_dir = section, cfg, run_dir
        self.probes: list[NodeProbe] | None = None

    def preflight(self) -> list[NodeProbe]:
        """Every check that needs no start, on every machine the shape uses (this one's own checks run in
        :func:`servebook.server.preflight` as each server starts); nothing is started. Runs once."""
        if self.probes is None:
            self.probes = self._preflight()
        return self.probes

    def _preflight(self) -> list[NodeProbe]:
        return []

    def start(self) -> Started:
        """Preflight, then everything up and ready; on any failure what it started is stopped before the error
        surfaces."""
        self.preflight()
        return self._start()

    @abc.abstractmethod
    def _start(self) -> Started: ...

    def _launch(self, workers: list[remote.WorkerRecord] | None = None) -> server.Launch:
        """The server here (the head, on several nodes, with the other nodes' ``workers``), its load shown as it
        goes."""
        return server.launch(
            self.cfg, self.run_dir, stop_leftovers=self.section.stop_leftovers,
            on_progress=ui.load_progress(self.section.interactive), workers=workers or [],
        )  # fmt: skip

    def ports(self) -> list[int]:
        """The ports of everything this shape registers on this machine (a router's, each server's)."""
        return [self.cfg.port]

    def stop(self) -> list[str]:
        """Stop everything the shape started (other machines' parts through their registration here) and say
        what is left: nothing, when all is verified gone."""
        left: list[str] = []
        for port in self.ports():
            left += server.stop(port=port).remaining
        return left

    @contextlib.contextmanager
    def running(self) -> Iterator[Started]:
        """Start, yield what started, and stop it all on the way out, however the block ends."""
        started = self.start()
        try:
            yield started
        finally:
            if left := self.stop():
                raise CleanupError(f"{self.shape}: still running after the stop: {'; '.join(left)}")

    def status(self) -> list[server.ServerStatus]:
        """The registry's view of this shape's servers (and the router), each with its health."""
        mine = set(self.ports())
        return [row for row in server.status() if row.port in mine]

    def describe(self) -> str:
        return SHAPES[self.shape]

    @classmethod
    def deploy_units(
        cls, deploy: DeploySection, run_dir: Path, launch: LaunchRecord, name: str, nccl_env: dict[str, str] | None
    ) -> DeployRecord:
        """This shape's service, from what its launch started: the units rendered beside the records, verified,
        proven where one process can be started as systemd would, installed only when ``deploy_install`` asks.
        One server (and one across nodes, whose head unit starts and stops each other node's) by default."""
        from servebook import service

        return service.one_server(deploy, run_dir, launch, name, nccl_env)

    @classmethod
    def manifests(cls, p: Params, plan: planner.Plan, layout: planner.Layout) -> Manifests:
        """This shape in a Kubernetes cluster (``servebook export k8s``): a LeaderWorkerSet whose group is one
        server (a pod per node, the leader serving the API), as many groups as replicas, vllm-router in front of
        several."""
        from servebook import k8s

        return k8s.render(p, plan, layout)


def export_k8s(p: Params, model_config: str = "") -> Manifests:
    """`servebook export k8s`: the cluster's plan, rendered by the params' shape. As here, except that replicas may
    each span nodes (LWS groups of several pods), which servebook's own launch refuses."""
    from servebook import k8s

    shape: Shape = "replicas" if p.replicas > 1 else shape_of(p)
    return kind(shape).manifests(p, *k8s.cluster_plan(p, model_config))


def kind(shape: Shape) -> type[Topology]:
    """The topology class of a shape (a launch record's ``topology``, or :func:`shape_of`'s answer)."""
    from servebook.topology import hybrid, mp_nodes, ray_nodes, replica_set, single

    shapes: dict[Shape, type[Topology]] = {
        "single": single.SingleServer,
        "nodes": mp_nodes.MultiNodeServer,
        "ray": ray_nodes.RayServer,
        "hybrid": hybrid.HybridServer,
        "replicas": replica_set.ReplicaSet,
    }
    return shapes[shape]


def of(p: Params, cfg: ServerConfig, run_dir: Path) -> Topology:
    """The topology the params describe, for this server configuration."""
    return kind(shape_of(p))(p.topology_section, cfg, run_dir)
