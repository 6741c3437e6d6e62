"""Independent replicas behind vllm-router (``replicas`` > 1): each replica an ordinary server on its own port and
slice of the GPUs (or CPU cores), those on other machines (``replica_hosts``) started there over SSH first so they
load while this machine's start one after another, then the router in front (:mod:`servebook.replicas` places
them and starts the ones elsewhere)."""

from __future__ import annotations

import functools
import time
from typing import ClassVar

from servebook import hardware, replicas, router, server, ui
from servebook.errors import PreflightError
from servebook.multinode import NodeProbe
from servebook.replicas import Placement, ReplicaRecord
from servebook.topology import Shape, Started, Topology

Elsewhere = dict[int, tuple[server.Registration, bool, float]]  # a replica's registration, reused, when it started


class ReplicaSet(Topology):
    shape: ClassVar[Shape] = "replicas"

    @functools.cached_property
    def placed(self) -> list[Placement]:
        return replicas.placements(self.p, self.cfg)

    def ports(self) -> list[int]:
        return [self.p.port] + [pl.config.port for pl in self.placed]  # the router's first

    def _preflight(self) -> list[NodeProbe]:
        placed = self.placed
        if self.cfg.device == "cuda":
            have = len(hardware.inventory().gpus)
            need = max(g for pl in placed if not pl.elsewhere for g in pl.config.gpu_ids) + 1
            if need > have:
                raise PreflightError(
                    f"replicas {self.p.replicas} x {self.cfg.layout.name} need GPUs up to index {need - 1}; this "
                    f"machine has {have}: lower replicas, or the layout, or list gpu_ids"
                )
        router.binary()  # refused before any replica starts when vllm-router is missing
        return replicas.preflight(self.p, self.cfg, placed)

    def _start(self) -> Started:
        placed, nodes = self.placed, replicas.machines(self.p)
        ports: list[int] = []  # every replica started or reused so far, stopped again if the launch fails
        elsewhere: Elsewhere = {}
        launches: dict[int, server.Launch] = {}
        try:
            for pl in placed:
                if pl.elsewhere and nodes:
                    since = time.monotonic()
                    reg, reused = replicas.start_elsewhere(
                        pl, nodes, self.run_dir / f"replica-{pl.index}", self.run_dir
                    )
                    ports.append(pl.config.port)
                    elsewhere[pl.index] = (reg, reused, since)
            for pl in placed:
                if not pl.elsewhere:
                    launches[pl.index] = self._start_here(pl, len(placed))
                    ports.append(pl.config.port)
            ready_s = self._wait_elsewhere(placed, elsewhere)
            urls = [launches[pl.index].url if pl.index in launches else elsewhere[pl.index][0].url for pl in placed]
            first = launches[min(launches)]
            routed = router.start(
                router.RouterConfig(port=self.p.port, worker_urls=urls, policy=self.p.router_policy, host=self.p.host),
                first.config.target(timeout_s=120), self.run_dir / "router", run_dir=str(self.run_dir),
            )  # fmt: skip
        except BaseException:
            for port in ports:
                server.stop(port=port)
            raise
        where = f" on {len(nodes.nodes)} machines" if nodes else ""
        print(
            f"router {routed.policy} on {routed.url} in front of {len(placed)} replicas{where}, ready in "
            f"{routed.seconds_to_ready:.1f} s"
        )
        return Started(first, _records(placed, launches, elsewhere, ready_s), routed, self.preflight())

    def _start_here(self, pl: Placement, count: int) -> server.Launch:
        rcfg = pl.config
        print(
            f"replica {pl.index + 1} of {count} on port {rcfg.port}"
            + (f", GPUs {rcfg.gpu_ids}" if rcfg.gpu_ids else "")
        )
        return server.launch(
            rcfg, self.run_dir / f"replica-{pl.index}", stop_leftovers=self.p.stop_leftovers,
            on_progress=ui.load_progress(self.p.interactive, f"replica {pl.index}"),
        )  # fmt: skip

    def _wait_elsewhere(self, placed: list[Placement], elsewhere: Elsewhere) -> dict[int, float]:
        """Each replica on another machine ready (it loaded while this machine's started), with its ready time."""
        ready_s = {
            i: 0.0 if reused else replicas.wait_elsewhere(reg, placed[i].config.load_budget_s(), since)
            for i, (reg, reused, since) in elsewhere.items()
        }
        for i, seconds in ready_s.items():
            print(f"replica {i + 1} of {len(placed)} on {placed[i].node.name} ready at {placed[i].config.url} "
                  f"after {seconds:.1f} s")  # fmt: skip
        return ready_s


def _records(
    placed: list[Placement], launches: dict[int, server.Launch], elsewhere: Elsewhere, ready_s: dict[int, float]
) -> list[ReplicaRecord]:
    """Each replica as the launch record keeps it: this machine's from its launch, another's from its
    registration here."""
    records = []
    for pl in placed:
        if pl.index in launches:
            x = launches[pl.index]
            records.append(
                ReplicaRecord(index=pl.index, url=x.url, port=x.config.port, pid=x.pid, pgid=x.pgid,
                              gpu_ids=x.config.target_gpus, log_path=x.log_path, seconds_to_ready=x.seconds_to_ready,
                              reused=x.reused, command=x.command, environment=x.environment)
            )  # fmt: skip
            continue
        reg, reused, _ = elsewhere[pl.index]
        worker = reg.workers[0]
        env = server.environment_record(pl.config, pl.config.environment(base={}, with_secrets=False))
        records.append(
            ReplicaRecord(index=pl.index, url=reg.url, port=reg.port, pid=worker.pid, pgid=0, gpu_ids=reg.gpu_ids,
                          log_path=reg.log_path, seconds_to_ready=ready_s[pl.index], reused=reused,
                          command=reg.command, environment=env | {"VLLM_HOST_IP": pl.node.address},
                          node=pl.node.name, ssh=pl.node.ssh, ssh_config=worker.ssh_config)
        )  # fmt: skip
    return records
