"""vLLM's hybrid data-parallel load balancing (``data_parallel_lb: hybrid``) across nodes: every node's ``vllm
serve`` serves its own ranks' API (the head's here, the others' on their own address), and vllm-router in front
of all of them here; ready when every node's API answers and the router lists them healthy."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from servebook import k8s, models, planner, replicas, router, server, server_config, service, systemd
from servebook.errors import DeployFailed, LaunchError
from servebook.multinode import NodeProbe
from servebook.params import DeploySection, Params
from servebook.records import DeployRecord, LaunchRecord, NodeUnitRecord
from servebook.replicas import ReplicaRecord
from servebook.topology import Shape, Started
from servebook.topology.mp_nodes import MultiNodeServer


class HybridServer(MultiNodeServer):
    shape: ClassVar[Shape] = "hybrid"

    @classmethod
    def manifests(cls, p: Params, plan: planner.Plan, layout: planner.Layout) -> k8s.Manifests:
        """Every pod its own API server for its node's data-parallel ranks (--data-parallel-hybrid-lb) and one
        Service over all of them: the cluster's load balancing stands where vllm-router stands here."""
        return k8s.render(p, plan, layout, hybrid=True, shape_notes=(
            "hybrid data parallelism: every pod serves the API for its own data-parallel ranks; the Service "
            "spreads requests over all of them (where servebook launches it, vllm-router does)",
        ))  # fmt: skip

    def api_port(self) -> int:
        return self.section.replicas.first_port

    def ports(self) -> list[int]:
        # the router's first: it forwards to the nodes' API servers
        return [self.section.replicas.router_port, self.api_port()]

    def _preflight(self) -> list[NodeProbe]:
        router.binary()  # refused before any node starts when vllm-router is missing
        return super()._preflight()

    def _start(self) -> Started:
        cfg = self.cfg
        launch = self._launch(self.workers)
        started = server.registered(cfg.port)
        nodes = started.workers if started else []
        urls = [launch.url] + [f"http://{w.address}:{cfg.port}" for w in nodes]
        ready_s = [launch.seconds_to_ready]
        try:
            for worker, url in zip(nodes, urls[1:], strict=True):
                ok, message, seconds = server.wait_ready(url, cfg.load_budget_s())
                if not ok:
                    raise LaunchError(
                        f"{worker.node}'s API server at {url} did not answer /health: {message}; its log is "
                        f"{worker.log_path} there"
                    )
                ready_s.append(launch.seconds_to_ready + seconds)
            routed = router.start(
                replicas.router_config(self.section.replicas, urls),
                launch.config.target(timeout_s=120), self.run_dir / "router", run_dir=str(self.run_dir),
            )  # fmt: skip
        except BaseException:
            server.stop(port=cfg.port)
            raise
        print(
            f"router {routed.policy} on {routed.url} in front of {len(urls)} nodes' API servers (hybrid data parallel)"
        )
        served = [
            ReplicaRecord(index=0, url=launch.url, port=cfg.port, pid=launch.pid, pgid=launch.pgid,
                          gpu_ids=cfg.target_gpus, log_path=launch.log_path, seconds_to_ready=launch.seconds_to_ready,
                          reused=launch.reused, command=launch.command, environment=launch.environment)
        ] + [
            ReplicaRecord(index=i, url=url, port=cfg.port, pid=w.pid, pgid=0, gpu_ids=cfg.target_gpus,
                          log_path=f"{w.node}:{w.log_path}", seconds_to_ready=round(s, 2), command=w.command)
            for i, (w, url, s) in enumerate(zip(nodes, urls[1:], ready_s[1:], strict=True), start=1)
        ]  # fmt: skip
        return Started(launch, served, routed, self.preflight())

    @classmethod
    def deploy_units(
        cls, deploy: DeploySection, run_dir: Path, launch: LaunchRecord, name: str, nccl_env: dict[str, str] | None
    ) -> DeployRecord:
        """vLLM's hybrid data parallelism as a service: the head node's ``vllm serve`` (one unit, which starts and
        stops every other node's over SSH, as a multi-node server's does), and vllm-router's unit in front, requiring
        the head's, so the router starts once every node's API server answers. Installed (the other nodes' units
        first) only when asked; no dry run across nodes."""
        size, _ = models.checkpoint_bytes(launch.model_path)
        head = service.unit_spec(f"{name}-dp", launch, nccl_env, server_config.load_budget_s(size), deploy.user)
        head.description = f"vLLM serving {launch.served_model_name}, hybrid data parallel (servebook)"
        head.part_of = f"servebook-{name}.service"
        node_units = service.worker_units(head, launch, run_dir)
        head_text, head_path, _, _ = service.write_unit_files(head, run_dir)
        routed = launch.router
        assert routed is not None
        front = systemd.UnitSpec(
            name=name,
            description=f"vllm-router ({routed.policy}) in front of {len(launch.replicas)} nodes' API servers (servebook)",
            command=list(routed.command),
            environment={},
            secret_sources={},  # it forwards each client's key to the API servers and holds none
            url=routed.url,
            port=routed.port,
            gpu_ids=[],
            device="cpu",
            load_seconds=routed.seconds_to_ready,
            load_source=head.load_source,
            servebook=head.servebook,
            user=deploy.user,
            requires=[head.unit_name],
            wait_urls=[rep.url for rep in launch.replicas[1:]],
        )
        unit_text, unit_path, env_path, watchdog = service.write_unit_files(front, run_dir)
        as_unit_user, run_as_user = service.run_as(front.user)
        reach = {"the router": front.command[0], **service.unit_paths(launch, head)}
        record = service.record_of(
            front,
            (unit_path, env_path, watchdog),
            load_seconds=head.load_seconds,
            load_source="measured" if head.load_source == "measured" else "predicted",
            replica_units=[
                NodeUnitRecord(
                    node=f"node 0's API server on port {head.port}",
                    unit_name=head.unit_name,
                    unit_file=str(head_path),
                    verify=systemd.verify(head_path),
                )
            ],  # fmt: skip
            node_units=node_units,
            run_as=run_as_user,
            access_problems=systemd.access_problems(front.user, reach) if as_unit_user else [],
            dry_run_skipped=(
                "a hybrid data-parallel server runs a unit per node behind the router's; they are rendered, verified "
                "and checked for what their user must reach here, and proven by installing them (deploy_install: true)"
            ),
        )
        service.replace_ad_hoc(record, launch, [front.port, head.port])  # the head's stop reaches every node's vLLM
        if deploy.install and not record.access_problems:
            service.install_node_units(launch, node_units)
            started = systemd.install(head, head_text)
            if not started.enabled:
                raise DeployFailed(f"{head.unit_name} did not start: {started.output[-300:]}")
            service.install_front(record, front, unit_text, launch.target(timeout_s=120))
        return record
