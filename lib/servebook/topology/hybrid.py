"""vLLM's hybrid data-parallel load balancing (``data_parallel_lb: hybrid``) across nodes: every node's ``vllm
serve`` serves its own ranks' API (the head's here, the others' on their own address), and vllm-router in front
of all of them here; ready when every node's API answers and the router lists them healthy."""

from __future__ import annotations

from typing import ClassVar

from servebook import router, server
from servebook.errors import LaunchError
from servebook.multinode import NodeProbe
from servebook.replicas import ReplicaRecord
from servebook.topology import Shape, Started
from servebook.topology.mp_nodes import MultiNodeServer


class HybridServer(MultiNodeServer):
    shape: ClassVar[Shape] = "hybrid"

    def api_port(self) -> int:
        return self.p.replica_base_port or self.p.port + 1

    def ports(self) -> list[int]:
        return [self.p.port, self.api_port()]  # the router's first: it forwards to the nodes' API servers

    def _preflight(self) -> list[NodeProbe]:
        router.binary()  # refused before any node starts when vllm-router is missing
        return super()._preflight()

    def _start(self) -> Started:
        p, cfg = self.p, self.cfg
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
                router.RouterConfig(port=p.port, worker_urls=urls, policy=p.router_policy, host=p.host),
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
