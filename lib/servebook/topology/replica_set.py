"""Independent replicas behind vllm-router (``replicas`` > 1): each replica an ordinary server on its own port and
slice of the GPUs (or CPU cores), those on other machines (``replica_hosts``) started there over SSH first so they
load while this machine's start one after another, then the router in front (:mod:`servebook.replicas` places
them and starts the ones elsewhere)."""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path
from typing import ClassVar

from servebook import hardware, replicas, router, server, service, systemd, ui
from servebook.errors import DeployFailed, PreflightError
from servebook.multinode import NodeProbe
from servebook.params import DeploySection
from servebook.records import DeployRecord, LaunchRecord, NodeUnitRecord
from servebook.replicas import Placement, ReplicaRecord
from servebook.topology import Shape, Started, Topology

Elsewhere = dict[int, tuple[server.Registration, bool, float]]  # a replica's registration, reused, when it started


class ReplicaSet(Topology):
    shape: ClassVar[Shape] = "replicas"

    @functools.cached_property
    def placed(self) -> list[Placement]:
        return replicas.placements(self.section.replicas, self.cfg)

    def ports(self) -> list[int]:
        return [self.section.replicas.router_port] + [pl.config.port for pl in self.placed]  # the router's first

    def _preflight(self) -> list[NodeProbe]:
        placed = self.placed
        if self.cfg.device == "cuda":
            have = len(hardware.inventory().gpus)
            need = max(g for pl in placed if not pl.elsewhere for g in pl.config.gpu_ids) + 1
            if need > have:
                raise PreflightError(
                    f"replicas {self.section.replicas.count} x {self.cfg.layout.name} need GPUs up to index {need - 1}; this "
                    f"machine has {have}: lower replicas, or the layout, or list gpu_ids"
                )
        router.binary()  # refused before any replica starts when vllm-router is missing
        return replicas.preflight(self.section.replicas, self.cfg, placed)

    def _start(self) -> Started:
        placed, nodes = self.placed, replicas.machines(self.section.replicas)
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
                replicas.router_config(self.section.replicas, urls),
                first.config.target(timeout_s=120), self.run_dir / "router", run_dir=str(self.run_dir),
            )  # fmt: skip
        except BaseException:  # a failed or interrupted launch: the replicas started so far, here and elsewhere
            for port in ports:
                outcome = server.stop(port=port)
                if outcome.stopped:
                    print(f"stopped the replica this launch started on port {port}: {outcome.summary}")
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
            rcfg, self.run_dir / f"replica-{pl.index}", stop_leftovers=self.section.stop_leftovers,
            on_progress=ui.load_progress(self.section.interactive, f"replica {pl.index}"),
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

    @classmethod
    def deploy_units(
        cls, deploy: DeploySection, run_dir: Path, launch: LaunchRecord, name: str, nccl_env: dict[str, str] | None
    ) -> DeployRecord:
        """A router and its replicas: a unit each, verified, the replicas' reach checked as the unit's user; installed
        (replicas first) only when asked. No dry run: it would start every replica as its unit; installing proves them."""
        front, replicas = router_units(name, launch, nccl_env, deploy.user)
        replica_records: list[NodeUnitRecord] = []
        for spec, rep in zip(replicas, launch.replicas, strict=True):
            path = run_dir / spec.unit_name
            path.write_text(systemd.render_unit(spec))
            (run_dir / f"{spec.name}.env").write_text(systemd.render_env_file(spec))
            where = f" on {rep.node}" if rep.node else ""
            replica_records.append(
                NodeUnitRecord(node=f"replica {rep.index} on port {spec.port}{where}",
                               unit_name=spec.unit_name, unit_file=str(path), verify=systemd.verify(path))
            )  # fmt: skip
        unit_text, unit_path, env_path, watchdog = service.write_unit_files(front, run_dir)
        as_unit_user, run_as_user = service.run_as(front.user)
        reach = {"the router": front.command[0], **service.unit_paths(launch, replicas[0])}
        record = service.record_of(
            front,
            (unit_path, env_path, watchdog),
            load_seconds=max(r.load_seconds for r in replicas),
            load_source="measured" if all(r.load_source == "measured" for r in replicas) else "predicted",
            replica_units=replica_records,
            run_as=run_as_user,
            access_problems=systemd.access_problems(front.user, reach) if as_unit_user else [],
            dry_run_skipped=(
                "a router and its replicas start as several units (the router's requires the replicas'); they are "
                "rendered, verified and checked for what their user must reach here, and proven by installing them "
                "(deploy_install: true)"
            ),
        )
        service.replace_ad_hoc(record, launch, [front.port, *(r.port for r in replicas)])
        if deploy.install and not record.access_problems:
            for spec, rep in zip(replicas, launch.replicas, strict=True):
                if not rep.ssh:
                    systemd.install(spec, systemd.render_unit(spec))
                    continue
                done = systemd.install_remote(spec, systemd.render_unit(spec), rep.ssh, rep.ssh_config)
                if not done.enabled:
                    raise DeployFailed(
                        f"replica {rep.index} on {rep.node}: could not install {spec.unit_name}: {done.output}"
                    )
            service.install_front(record, front, unit_text, launch.target(timeout_s=120))
        return record


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


def router_units(
    name: str, launch: LaunchRecord, nccl_env: dict[str, str] | None, user: str
) -> tuple[systemd.UnitSpec, list[systemd.UnitSpec]]:
    """The router's unit and one per replica, each replica with exactly the command and cores it ran with here;
    the router's requires them all, so `systemctl start` of the router brings them up first."""
    assert launch.router is not None
    base = service.unit_spec(name, launch, nccl_env, user=user)
    replicas = []
    elsewhere = []  # the router's unit starts and stops these over SSH (systemd's dependencies end at the machine)
    for rep in launch.replicas:
        spec = dataclasses.replace(
            base,
            name=f"{name}-replica{rep.index}",
            description=f"vLLM serving {launch.config.served_model_name}, replica {rep.index} (servebook)",
            command=list(rep.command),
            environment=service.unit_environment(rep.environment, nccl_env),
            url=rep.url,
            port=rep.port,
            gpu_ids=list(rep.gpu_ids),
            load_seconds=rep.seconds_to_ready or base.load_seconds,
            part_of="" if rep.ssh else f"servebook-{name}.service",
        )
        spec.environment["VLLM_ENGINE_READY_TIMEOUT_S"] = str(spec.timeout_start_s)
        replicas.append(spec)
        if rep.ssh:
            elsewhere.append((systemd.NodeUnit(node=rep.node, ssh=rep.ssh, unit_name=spec.unit_name), rep))
    routed = launch.router
    front = systemd.UnitSpec(
        name=name,
        description=f"vllm-router ({routed.policy}) in front of {len(replicas)} vLLM replicas (servebook)",
        command=list(routed.command),
        environment={},
        secret_sources={},  # it forwards each client's key to the replicas and holds none
        url=routed.url,
        port=routed.port,
        gpu_ids=[],
        device="cpu",
        # its ExecStartPre starts the other machines' replicas one after another, inside its own start timeout
        load_seconds=routed.seconds_to_ready + sum(r.load_seconds for r in replicas if not r.part_of),
        load_source="measured" if all(r.load_source == "measured" for r in replicas if not r.part_of) else "predicted",
        servebook=base.servebook,
        user=user,
        requires=[r.unit_name for r, rep in zip(replicas, launch.replicas, strict=True) if not rep.ssh],
        remote_units=[unit for unit, _ in elsewhere],
        ssh_config=next((rep.ssh_config for _, rep in elsewhere), ""),
    )
    return front, replicas
