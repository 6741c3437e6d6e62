"""A Ray cluster for one vLLM server across nodes, where the params choose ``distributed_backend: ray``.

vLLM's Ray path (vllm-project/vllm ``examples/online_serving/run_cluster.sh``; ``docs/serving/parallelism_scaling.md``):
``ray start --head --block`` on the head, ``ray start --block --address HEAD:PORT`` on every other node, then one
``vllm serve … --distributed-executor-backend ray`` on the head, which places its workers on the cluster's GPUs.
servebook starts that cluster over the user's own SSH (the same :mod:`servebook.remote` sessions as the mp
workers), joins the nodes one after another (vLLM's placement groups fail when every node joins at once:
ray#59778), waits until Ray counts every node alive (what the LWS helper ``ray_init.sh`` waits for), and stops
what it started: ``ray stop`` on every node, then the session of each ``ray start``, then a check that no Ray
process is left there.

Each node registers the address ``node_addresses`` gives it (``--node-ip-address``, and ``VLLM_HOST_IP`` for the
workers vLLM starts there): Ray otherwise picks the interface of the default route, which on a multi-NIC node is
not the one the nodes share (vllm#7815).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from servebook import remote
from servebook.errors import LaunchError, RemoteError
from servebook.multinode import NodeSet, start_on_node
from servebook.params import NodesSection
from servebook.secrets import mask
from servebook.server_config import ServerConfig

RAY_CLI = ["-m", "ray.scripts.scripts"]  # Ray's console script, run by the node's own Python
JOIN_POLL_S = 2.0

# how many nodes Ray counts alive, asked on the head the way the LWS helper asks (ray.nodes())
_ALIVE = (
    "import sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False, include_dashboard=False)\n"
    "print(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))\n"
)


@dataclass(frozen=True)
class RayNode:
    name: str
    ssh: str  # empty: this machine
    address: str
    python: str


@dataclass
class RayCluster:
    """The nodes of one Ray cluster, head first, and how each one's ``ray start`` runs."""

    nodes: list[RayNode]
    port: int = 6379
    start_args: list[str] = dataclasses.field(default_factory=list)
    ssh_config: str = ""
    join_timeout_s: float = 300.0

    @classmethod
    def for_nodes(cls, section: NodesSection) -> RayCluster:
        nodes = NodeSet.for_nodes(section)
        return cls(
            nodes=[
                RayNode(n.name, n.ssh, n.address, sys.executable if not n.ssh else nodes.node_python)
                for n in nodes.nodes
            ],
            port=section.ray_port,
            start_args=list(section.ray_start_args),
            ssh_config=section.ssh_config,
            join_timeout_s=section.ray_join_timeout_s,
        )

    @property
    def head(self) -> RayNode:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.address}:{self.port}"

    def start_command(self, node: RayNode) -> list[str]:
        """One node's ``ray start``, blocking (its session is the node's Ray, stopped as one)."""
        argv = [node.python, *RAY_CLI, "start", "--block", "--disable-usage-stats", "--node-ip-address", node.address]
        if node is self.head:
            argv += ["--head", "--port", str(self.port), "--include-dashboard=false"]
        else:
            argv += ["--address", self.address]
        return argv + list(self.start_args)

    def commands(self) -> list[list[str]]:
        """Every node's ``ray start``, head first, as the launch runs them (the plan prints these)."""
        return [self.start_command(n) for n in self.nodes]

    def stop_command(self, node: RayNode) -> list[str]:
        return [node.python, *RAY_CLI, "stop", "--force"]

    def records(self, log_dir: str | Path) -> list[remote.WorkerRecord]:
        """Each node's ``ray start`` as a worker of the server (pid filled in once started)."""
        folder = Path(log_dir).resolve()
        return [
            remote.WorkerRecord(
                node=node.name, ssh=node.ssh, ssh_config=self.ssh_config, address=node.address, pid=0,
                log_path=str(folder / f"ray-node{rank}.log"), command=self.start_command(node),
                stop_command=self.stop_command(node), role="ray",
            )
            for rank, node in enumerate(self.nodes)
        ]  # fmt: skip

    def alive(self) -> list[str]:
        """The addresses Ray counts alive, asked on the head; empty while its GCS does not answer."""
        return alive_addresses(self.address, self.head.python, self.head.ssh, self.ssh_config)

    def start(
        self,
        env: dict[str, str],
        log_dir: str | Path,
        on_started: Callable[[remote.WorkerRecord], None],
        log: Callable[[str], None] = print,
    ) -> list[remote.WorkerRecord]:
        """Start the head, then each node in turn, each one waited for until Ray counts it alive; every
        ``ray start`` is handed to ``on_started`` as it starts (so a stop reaches it). LaunchError names the node
        that did not join, with its log's last lines."""
        started: list[remote.WorkerRecord] = []
        began = time.monotonic()
        for record, node in zip(self.records(log_dir), self.nodes, strict=True):
            own = {"VLLM_HOST_IP": node.address, "RAY_NODE_IP_ADDRESS": node.address}
            shared = {k: v for k, v in env.items() if k != "RAY_ADDRESS"}  # the head's vLLM's, not `ray start`'s
            record = start_on_node(record, shared | own, "Ray")
            started.append(record)
            on_started(record)
            log(f"started Ray on {node.name} (pid {record.pid} there, {'head' if node is self.head else 'joining'} "
                f"{self.address}), log {record.log_path} there")  # fmt: skip
            self._wait_joined(record, node, len(started), began)
        log(f"Ray counts {len(started)} nodes alive after {time.monotonic() - began:.1f} s")
        return started

    def _wait_joined(self, record: remote.WorkerRecord, node: RayNode, count: int, began: float) -> None:
        deadline = began + self.join_timeout_s
        while True:
            alive = self.alive()
            if node.address in alive and len(alive) >= count:
                return
            if not remote.alive(record):
                text = remote.log_text(record)
                raise LaunchError(
                    f"Ray on {node.name} exited before it joined the cluster at {self.address}",
                    cause=mask(ray_root_cause(text)),
                    log_tail="\n".join(text.splitlines()[-30:]),
                    log_path=f"{node.name}:{record.log_path}",
                )
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"{node.name} did not join the Ray cluster at {self.address} within {self.join_timeout_s:.0f} s "
                    f"(Ray counts {len(alive)} alive: {', '.join(alive) or 'none'}); check that {node.address} "
                    f"reaches {self.address} and the head reaches {node.address} (Ray's ports in "
                    "docs.ray.io …/configure.html), or raise ray_join_timeout_s",
                    log_tail="\n".join(remote.log_text(record).splitlines()[-30:]),
                    log_path=f"{node.name}:{record.log_path}",
                )
            time.sleep(JOIN_POLL_S)


def alive_addresses(address: str, python: str = sys.executable, ssh: str = "", ssh_config: str = "") -> list[str]:
    """The node addresses the Ray cluster at ``address`` counts alive, asked with ``python`` where ``ssh`` leads
    (here when empty); empty while its GCS does not answer."""
    argv = [python, "-c", _ALIVE, address]
    try:
        proc = remote.run(ssh, shlex.join(argv), ssh_config, timeout_s=60)
    except RemoteError:
        return []
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines or not lines[-1].startswith("["):
        return []
    return [a.strip(" '\"") for a in lines[-1].strip("[]").split(",") if a.strip()]


def wait_alive(address: str, count: int, timeout_s: float, poll_s: float = JOIN_POLL_S) -> tuple[bool, str]:
    """Wait until the cluster at ``address`` counts ``count`` nodes alive (a unit's ExecStartPre)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = alive_addresses(address)
        if len(alive) >= count:
            return True, f"Ray at {address} counts {len(alive)} nodes alive: {', '.join(alive)}"
        if time.monotonic() > deadline:
            return False, (
                f"Ray at {address} counts {len(alive)} of {count} nodes alive after {timeout_s:.0f} s "
                f"({', '.join(alive) or 'none'}); see each node's Ray unit (journalctl -u)"
            )
        time.sleep(poll_s)


def ray_root_cause(text: str) -> str:
    """The line of a ``ray start`` log that says why it stopped (a version mismatch, an unreachable GCS)."""
    for marker in ("Version mismatch", "RuntimeError", "ConnectionError", "Unable to connect", "Error", "error"):
        found = [line.strip() for line in text.splitlines() if marker in line]
        if found:
            return found[-1][:400]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:400] if lines else "its log is empty"


def head_config(cfg: ServerConfig, cluster: RayCluster, gpus_per_node: int) -> ServerConfig:
    """The head's ``vllm serve`` on the cluster servebook started: ``RAY_ADDRESS`` makes vLLM join it instead of
    starting one of its own; a data-parallel replica wider than a node needs Ray's ``span`` packing
    (docs/serving/data_parallel_deployment.md)."""
    env = {"RAY_ADDRESS": cluster.address, "VLLM_HOST_IP": cluster.head.address}
    layout = cfg.layout
    if layout.dp > 1 and layout.tp * layout.pp > gpus_per_node:
        env["VLLM_RAY_DP_PACK_STRATEGY"] = "span"
    return dataclasses.replace(cfg, nodes=len(cluster.nodes), extra_env={**cfg.extra_env, **env})
