"""Several replicas behind one address: vLLM's own router (vllm-project/router, ``pip install vllm-router``).

servebook starts the replicas (each an ordinary :func:`servebook.server.launch` on its own port and GPUs) and the
router in front of them, in its own process group, registered like a server so ``servebook stop`` and an
interrupted run stop it.  It is ready when it lists every replica healthy and a completion through it answers.
The router forwards the client's ``Authorization`` header to the replicas: it holds no key of its own.

Policies (vllm-router's ``--policy``): ``cache_aware`` (its default: an approximate prefix tree per replica, so a
conversation's next turn lands where its prefix is cached), ``consistent_hash`` (keyed by the ``X-Session-ID``
header: one agent session, one replica), ``round_robin``, ``power_of_two``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx
from pydantic import BaseModel

from servebook import client, loadgen, processes, server
from servebook.errors import LaunchError, PreflightError

POLICIES = ("cache_aware", "consistent_hash", "round_robin", "power_of_two")
SESSION_HEADER = loadgen.SESSION_HEADER  # what consistent_hash keys on, and what the benchmark's chats send


def binary() -> str:
    """The vllm-router executable beside this Python (the project's virtualenv), else on PATH."""
    beside = Path(sys.executable).parent / "vllm-router"
    found = str(beside) if beside.is_file() else shutil.which("vllm-router")
    if not found:
        raise PreflightError(
            "replicas > 1 needs vllm-router, which is not installed: pip install vllm-router "
            "(or pip install 'servebook[router]'), or set replicas: 1"
        )
    return found


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-router")
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class RouterConfig:
    port: int
    worker_urls: list[str]
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    health_interval_s: int = 5
    prometheus_port: int = 0  # 0: the router's port + 20000, clear of the replicas'
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def metrics_port(self) -> int:
        return self.prometheus_port or self.port + 20000

    def command(self) -> list[str]:
        return [
            binary(), "--host", self.host, "--port", str(self.port), "--worker-urls", *self.worker_urls,
            "--policy", self.policy, "--health-check-interval-secs", str(self.health_interval_s),
            "--health-check-endpoint", "/health", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(self.metrics_port), *self.extra_args,
        ]  # fmt: skip

    def fingerprint(self) -> str:
        text = " ".join([self.host, str(self.port), self.policy, *self.worker_urls, *self.extra_args])
        return "router-" + hashlib.sha256(text.encode()).hexdigest()[:10]


class WorkerState(BaseModel):
    url: str
    healthy: bool
    load: int = 0


class RouterRecord(BaseModel):
    """The router a launch started in front of its replicas."""

    url: str
    port: int
    policy: str
    worker_urls: list[str]
    command: list[str]
    pid: int
    pgid: int
    log_path: str
    seconds_to_ready: float
    workers: list[WorkerState] = []
    metrics_url: str = ""  # its Prometheus endpoint: requests, retries, errors


def workers(url: str, timeout_s: float = 5.0) -> list[WorkerState]:
    """The replicas the router lists, healthy or not; [] when it does not answer."""
    try:
        data = httpx.get(f"{url}/workers", timeout=timeout_s).json()
    except (httpx.HTTPError, ValueError):
        return []
    return [
        WorkerState(url=w.get("url", ""), healthy=bool(w.get("is_healthy")), load=int(w.get("load") or 0))
        for w in data.get("workers", [])
    ]


def start(
    cfg: RouterConfig, target: client.Target, log_dir: Path, run_dir: str = "", timeout_s: float = 60.0
) -> RouterRecord:
    """Start the router, wait until it lists every replica healthy and one completion through it answers."""
    if (holder := processes.port_holder(cfg.host, cfg.port)) is not None:
        who = processes.describe(holder) if not isinstance(holder, bool) else "an unidentified process"
        raise PreflightError(f"the router's port {cfg.port} is held by {who}; choose another port or stop it")
    command = cfg.command()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "router.log"
    started = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # fmt: skip
    server.register(
        server.Registration(
            pid=proc.pid, pgid=proc.pid, port=cfg.port, host=cfg.host, url=cfg.url, fingerprint=cfg.fingerprint(),
            command=command, log_path=str(log_path), model=f"router over {len(cfg.worker_urls)} replicas",
            served_model_name=target.model, device="router", gpu_ids=[],
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), run_dir=run_dir,
        )
    )  # fmt: skip
    try:
        listed = _wait_ready(cfg, target.with_url(cfg.url), proc, log_path, timeout_s)
    except BaseException:
        server.stop(port=cfg.port)
        raise
    return RouterRecord(
        url=cfg.url, port=cfg.port, policy=cfg.policy, worker_urls=cfg.worker_urls, command=command, pid=proc.pid,
        pgid=proc.pid, log_path=str(log_path), seconds_to_ready=round(time.monotonic() - started, 2), workers=listed,
        metrics_url=f"http://127.0.0.1:{cfg.metrics_port}",
    )  # fmt: skip


def _wait_ready(
    cfg: RouterConfig, target: client.Target, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float
) -> list[WorkerState]:
    deadline = time.monotonic() + timeout_s
    listed: list[WorkerState] = []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError(f"vllm-router exited with {proc.returncode} before it was ready", log_path=str(log_path))
        listed = workers(cfg.url)
        if len(listed) == len(cfg.worker_urls) and all(w.healthy for w in listed):
            problem = client.first_token(target)
            if not problem:
                return listed
        time.sleep(0.5)
    sick = [w.url for w in listed if not w.healthy] or [u for u in cfg.worker_urls if u not in {w.url for w in listed}]
    raise LaunchError(
        f"vllm-router on port {cfg.port} was not ready within {timeout_s:.0f} s: "
        + (f"replicas not healthy there: {', '.join(sick)}" if sick else "a completion through it did not answer"),
        log_path=str(log_path),
    )
