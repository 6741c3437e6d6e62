"""A service's systemd units, the parts every serving shape shares: a unit from a launch record (its exact command,
environment and measured load time), the unit files beside the records, the pre-start check, the dry run as systemd
would start it, the worker units of a server across nodes, and the deploy record's common fields. What units a
shape needs, and how they depend on each other, its :class:`servebook.topology.Topology` says (``service``)."""

from __future__ import annotations

import dataclasses
import getpass
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from servebook import client, models, remote, server, server_config, systemd
from servebook.errors import DeployFailed
from servebook.params import DeploySection
from servebook.records import Command, DeployRecord, DryRun, LaunchRecord, NodeUnitRecord
from servebook.secrets import MASK


def servebook_command() -> list[str]:
    """How the unit runs servebook's CLI: the console script beside this Python (a virtual environment), the one
    on PATH, or this Python running the module (a tree on PYTHONPATH; the H200 run found no script beside it)."""
    beside = Path(sys.executable).with_name("servebook")
    if beside.exists():
        return [str(beside)]
    on_path = shutil.which("servebook")
    return [on_path] if on_path else [sys.executable, "-m", "servebook.cli"]


def unit_spec(
    name: str,
    launch: LaunchRecord,
    nccl_env: dict[str, str] | None = None,
    predicted_load_s: float | None = None,
    user: str = "vllm",
) -> systemd.UnitSpec:
    """A unit from the launch record: its exact command, its environment, its measured load time."""
    measured = launch.started_by_this_run and launch.seconds_to_ready > 0
    load = launch.seconds_to_ready if measured else float(predicted_load_s or server_config.BASE_BUDGET_S)
    env = unit_environment(launch.environment, nccl_env)
    cfg = launch.config
    unit = systemd.UnitSpec(
        name=name,
        description=f"vLLM serving {cfg.served_model_name} (servebook)",
        command=list(launch.command),
        environment=env,
        secret_sources={server_config.SERVER_KEY_VAR: cfg.api_key_env} if cfg.api_key_env else {},
        url=cfg.url,
        port=cfg.port,
        gpu_ids=cfg.target_gpus,
        device=cfg.device,
        load_seconds=load,
        load_source="measured" if measured else "predicted",
        servebook=servebook_command(),
        user=user,
    )
    # vLLM's own engine-ready timeout must not cut the load shorter than the unit allows
    unit.environment["VLLM_ENGINE_READY_TIMEOUT_S"] = str(unit.timeout_start_s)
    return unit


def unit_environment(environment: dict[str, str], nccl_env: dict[str, str] | None = None) -> dict[str, str]:
    """A launch's environment as a unit's: no secrets (they go in the environment file), nothing development-only."""
    env = {
        k: v
        for k, v in environment.items()
        if v != MASK and k not in systemd.SECRET_VARS and k not in systemd.DEVELOPMENT_ONLY
    }
    return env | (nccl_env or {})


def run_command(args: list[str], timeout: float) -> Command:
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    return Command(
        command=systemd.shell_line(args),
        returncode=proc.returncode,
        output=(proc.stdout + proc.stderr).strip(),
        seconds=round(time.monotonic() - started, 1),
    )


def pre_start_check(unit: systemd.UnitSpec, as_user: bool = False) -> Command:
    args = [*unit.servebook, "gpu-check", "--port", str(unit.port)]
    if unit.gpu_ids and unit.device == "cuda":
        args += ["--gpus", ",".join(map(str, unit.gpu_ids))]
    return run_command(systemd.as_user(unit.user, args) if as_user else args, timeout=120)


def unit_paths(launch: LaunchRecord, unit: systemd.UnitSpec) -> dict[str, str]:
    """What the unit's process must reach: the program it runs, the model, servebook's command for its checks."""
    paths = {"the serving program": unit.command[0], "the model": launch.model_path, "servebook": unit.servebook[0]}
    return {what: path for what, path in paths.items() if path.startswith("/")}


def run_as(user: str) -> tuple[bool, str]:
    """Whether the dry run can run as the unit's user here (root, and the user exists), and who it runs as."""
    if os.geteuid() != 0:
        return False, f"{getpass.getuser()} (not root: the unit's user {user} cannot be taken on here)"
    if not systemd.user_exists(user):
        return False, f"root (the unit's user {user} does not exist here; installing creates it)"
    return True, user


def dry_run_start(unit: systemd.UnitSpec, run_dir: Path, target: client.Target, as_user: bool = False) -> DryRun:
    """Do what systemd would: the pre-start check, the exact ExecStart in its own group with the unit's
    environment and its environment file's secrets (no other), the post-start wait, a smoke test against it with
    the key the unit carries, then a stop of the whole group."""
    out = DryRun(pre_start=pre_start_check(unit, as_user))
    if out.pre_start.returncode != 0:
        out.skipped = "the pre-start check refused, as systemd would"
        return out
    log = run_dir / "service-dry-run.log"
    env = process_environment(unit, run_dir / "service-state", unit.user if as_user else "")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            systemd.as_user(unit.user, unit.command) if as_user else unit.command,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait = [*unit.servebook, "wait-ready", "--url", unit.url, "--timeout", str(unit.timeout_start_s)]
        wait = systemd.as_user(unit.user, wait) if as_user else wait
        out.post_start = run_command(wait, timeout=unit.timeout_start_s + 60)
        if out.post_start.returncode == 0:
            out.smoke_test = client.smoke_test(target, max_tokens=8)
            if unit.secret_sources:  # the key reached the service through its environment file, as install writes it
                out.keyless_status = client.keyless_status(unit.url)
    finally:
        out.stop = server.terminate(proc.pid)
        proc.wait(timeout=30)
    out.log = str(log)
    return out


def process_environment(unit: systemd.UnitSpec, state: Path, user: str) -> dict[str, str]:
    """The process environment the unit gives: this shell's, with no secret of its own, the unit's variables, a
    state folder of its own for HOME and the caches (as StateDirectory= gives it, owned by the unit's user), and
    the environment file's values as install would write them."""
    state.mkdir(parents=True, exist_ok=True)
    if user:
        shutil.chown(state, user, user)
    base = {k: v for k, v in os.environ.items() if k not in systemd.SECRET_VARS}
    own = {"HOME": str(state), "HF_HOME": str(state / "hf"), "VLLM_CACHE_ROOT": str(state / "vllm")}
    return {**base, **unit.environment, **own, **systemd.secret_values(unit)}


def worker_units(unit: systemd.UnitSpec, launch: LaunchRecord, run_dir: Path) -> list[NodeUnitRecord]:
    """A multi-node server's worker units, one per other node, written and verified beside the head's; the head's
    unit learns to start and stop them."""
    records = []
    ray = launch.topology == "ray"  # every node's `ray start`, the head's too, before its vLLM
    if ray:
        unit.ray_address, unit.ray_nodes = launch.config.extra_env.get("RAY_ADDRESS", ""), len(launch.workers)
        unit.ray = True
    count = len(launch.workers) + (0 if ray else 1)
    for rank, worker in enumerate(launch.workers, start=0 if ray else 1):
        own = {"VLLM_HOST_IP": worker.address} | ({"RAY_NODE_IP_ADDRESS": worker.address} if ray else {})
        spec = dataclasses.replace(
            unit,
            name=f"{unit.name}-{'ray' if ray else 'node'}{rank}",
            description=f"{unit.description}, {'Ray on ' if ray else ''}node {rank} of {count}",
            command=list(worker.command),
            environment={**unit.environment, **own} if worker.address else unit.environment,
            secret_sources={},
            role="worker",
            worker_units=[],
        )
        path = run_dir / spec.unit_name
        path.write_text(systemd.render_unit(spec))
        unit.worker_units.append(systemd.NodeUnit(node=worker.node, ssh=worker.ssh, unit_name=spec.unit_name))
        unit.ssh_config = worker.ssh_config
        records.append(
            NodeUnitRecord(node=worker.node, unit_name=spec.unit_name, unit_file=str(path), verify=systemd.verify(path))
        )
    return records


def record_of(unit: systemd.UnitSpec, paths: tuple[Path, Path, list[Path]], **fields: object) -> DeployRecord:
    """The deploy record's fields every kind of service fills the same way from its front unit's files."""
    unit_path, env_path, watchdog = paths
    return DeployRecord(
        unit_name=unit.unit_name,
        unit_file=str(unit_path),
        env_file=str(env_path),
        timeout_start_s=unit.timeout_start_s,
        start_limit_interval_s=unit.start_limit_interval_s,
        verify=systemd.verify(unit_path),
        systemd_running=systemd.systemd_running(),
        # the ad hoc server this run started holds the port: the check must say so
        pre_start_with_ad_hoc_server=pre_start_check(unit),
        watchdog_files=[str(w) for w in watchdog],
        watchdog_verify=systemd.verify(watchdog[0]),
        **fields,
    )


def write_unit_files(unit: systemd.UnitSpec, run_dir: Path) -> tuple[str, Path, Path, list[Path]]:
    """The unit, its environment file (secrets left to the install) and its watchdog, written beside the records."""
    unit_text = systemd.render_unit(unit)
    unit_path = run_dir / unit.unit_name
    unit_path.write_text(unit_text)
    env_path = run_dir / f"{unit.name}.env"
    env_path.write_text(systemd.render_env_file(unit))
    watchdog = [run_dir / n for n in systemd.watchdog_names(unit)]
    for path, text in zip(watchdog, systemd.render_watchdog(unit), strict=True):
        path.write_text(text)
    return unit_text, unit_path, env_path, watchdog


def install_node_units(launch: LaunchRecord, node_units: list[NodeUnitRecord]) -> None:
    """The other nodes' units, each put in place on its node over SSH (the head's unit starts them there)."""
    for worker, node_unit in zip(launch.workers, node_units, strict=True):
        text = Path(node_unit.unit_file).read_text()
        target = f"/etc/systemd/system/{node_unit.unit_name}"
        done = remote.run(worker.ssh, f"cat > {target} && systemctl daemon-reload", worker.ssh_config, input_text=text)
        if done.returncode:
            raise DeployFailed(f"{worker.node}: could not install {target}: {done.stderr.strip()[-300:]}")


def dry_run(record: DeployRecord, unit: systemd.UnitSpec, launch: LaunchRecord, run_dir: Path) -> None:
    """The dry run as the unit's user where it can be taken on here, after checking that user reaches what the
    unit runs; as this user otherwise, saying so."""
    as_unit_user = check_reach(record, unit, launch)
    if record.access_problems:
        record.dry_run_skipped = f"user {unit.user} cannot reach what the unit runs: the service would not start"
        return
    record.dry_run = dry_run_start(unit, run_dir, launch.config.target(timeout_s=120), as_user=as_unit_user)


def check_reach(record: DeployRecord, unit: systemd.UnitSpec, launch: LaunchRecord) -> bool:
    """Whether the unit's user can be taken on here; if so, what of the unit's program and model it cannot reach
    goes to the record's access problems."""
    as_unit_user, record.run_as = run_as(unit.user)
    if as_unit_user:
        record.access_problems = systemd.access_problems(unit.user, unit_paths(launch, unit))
    return as_unit_user


def install_front(record: DeployRecord, unit: systemd.UnitSpec, unit_text: str, target: client.Target) -> None:
    """The unit clients reach (the server's, or the router's), installed and started after the units it
    requires, then proven as a client sees it: ready within its start timeout, and a smoke test."""
    record.installed = systemd.install(unit, unit_text)
    ok, message, _ = server.wait_ready(unit.url, unit.timeout_start_s)
    record.service_ready = message
    if ok:
        record.smoke_test = client.smoke_test(target, 8)


def replace_ad_hoc(record: DeployRecord, launch: LaunchRecord, ports: list[int]) -> None:
    """Stop what this run started by hand on the units' ports, where the pre-start check found it: the units
    replace it (the router and every server behind it)."""
    if record.pre_start_with_ad_hoc_server.returncode != 0 and launch.started_by_this_run:
        record.ad_hoc_server_stopped = "; ".join(f"port {port}: {server.stop(port=port).summary}" for port in ports)


def one_server(
    deploy: DeploySection, run_dir: Path, launch: LaunchRecord, name: str, nccl_env: dict[str, str] | None
) -> DeployRecord:
    """One server's unit (a server across nodes: with a worker unit per other node, which it starts and stops over
    SSH): rendered, verified, proven by a dry run as systemd would start it, installed only when asked."""
    size, _ = models.checkpoint_bytes(launch.model_path)
    unit = unit_spec(name, launch, nccl_env, server_config.load_budget_s(size), deploy.user)
    node_units = worker_units(unit, launch, run_dir)
    unit_text, unit_path, env_path, watchdog = write_unit_files(unit, run_dir)
    dropped = [
        f"{k} left out of the unit: {why}" for k, why in systemd.DEVELOPMENT_ONLY.items() if k in launch.environment
    ]
    record = record_of(
        unit,
        (unit_path, env_path, watchdog),
        warnings=dropped,
        load_seconds=unit.load_seconds,
        load_source="measured" if unit.load_source == "measured" else "predicted",
        node_units=node_units,
    )
    if not deploy.install and not deploy.dry_run:
        check_reach(record, unit, launch)
        record.dry_run_skipped = (
            "deploy_dry_run is false: the unit is rendered and verified, not started; the launched server keeps serving"
        )
        return record
    if record.pre_start_with_ad_hoc_server.returncode != 0 and launch.started_by_this_run:
        record.ad_hoc_server_stopped = server.stop(port=unit.port).summary  # the service replaces it
    if deploy.install:
        install_node_units(launch, node_units)
        install_front(record, unit, unit_text, launch.config.target(timeout_s=120))
    elif node_units:
        record.dry_run_skipped = (
            "the dry run starts one process as systemd would; a multi-node server's units start each other over "
            "SSH, so they are rendered and verified here and proven by installing them (deploy_install: true)"
        )
    else:
        dry_run(record, unit, launch, run_dir)
    return record
