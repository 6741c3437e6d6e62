"""Stage 07 glue: render, verify, prove and (only when asked) install the service."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from servebook import client, models, results, server, systemd
from servebook.params import Params

MASKED = results.MASK


def servebook_exe() -> str:
    return str(Path(sys.executable).with_name("servebook"))


def unit_spec(name: str, launch: dict[str, Any], nccl_env: dict[str, str] | None = None,
              predicted_load_s: float | None = None, user: str = "vllm") -> systemd.UnitSpec:
    """A unit from the launch stage's record: its exact command, its environment, its measured load time."""
    measured = launch.get("started_by_this_run") and launch.get("seconds_to_ready")
    load = float(launch["seconds_to_ready"]) if measured else float(predicted_load_s or server.BASE_BUDGET_S)
    env = {k: v for k, v in launch.get("environment", {}).items() if v != MASKED and k not in systemd.SECRET_VARS}
    env.update(nccl_env or {})
    unit = systemd.UnitSpec(
        name=name, description=f"vLLM serving {launch['served_model_name']} (servebook)",
        command=list(launch["command"]), environment=env,
        secret_vars=["VLLM_API_KEY"] if launch.get("api_key_env") else [],
        url=launch["url"], port=int(launch["port"]),
        gpu_ids=list(launch.get("gpu_ids") or range(launch.get("world_size", 1))) if launch.get("device") == "cuda" else [],
        device=launch.get("device", "cuda"), load_seconds=load, load_source="measured" if measured else "predicted",
        servebook=servebook_exe(), user=user,
    )
    # vLLM's own engine-ready timeout must not cut the load shorter than the unit allows
    unit.environment["VLLM_ENGINE_READY_TIMEOUT_S"] = str(unit.timeout_start_s)
    return unit


def launch_record(cfg: server.ServerConfig) -> dict[str, Any]:
    """What the launch stage would record for a configuration, for rendering units of hosts not at hand."""
    env = cfg.environment(base={}, with_secrets=False)
    return {"command": cfg.command(), "environment": results.mask_env(env), "served_model_name": cfg.served_model_name,
            "url": cfg.url, "port": cfg.port, "gpu_ids": cfg.gpu_ids, "world_size": cfg.world_size, "device": cfg.device,
            "model_path": cfg.model_path,
            "api_key_env": cfg.api_key_env, "started_by_this_run": False, "seconds_to_ready": 0}


def run_check(unit: systemd.UnitSpec) -> dict[str, Any]:
    args = [unit.servebook, "gpu-check", "--port", str(unit.port)]
    if unit.gpu_ids and unit.device == "cuda":
        args += ["--gpus", ",".join(map(str, unit.gpu_ids))]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    return {"command": systemd.shell_line(args), "returncode": proc.returncode, "output": (proc.stdout + proc.stderr).strip()}


def dry_run_start(unit: systemd.UnitSpec, run_dir: Path, model: str) -> dict[str, Any]:
    """Do what systemd would: the pre-start check, the exact ExecStart in its own group, the post-start wait,
    a smoke test against it, then a stop of the whole group."""
    out: dict[str, Any] = {"pre_start": run_check(unit)}
    if out["pre_start"]["returncode"] != 0:
        out["skipped"] = "the pre-start check refused, as systemd would"
        return out
    env = {**os.environ, **unit.environment}
    log = run_dir / "service-dry-run.log"
    started = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(unit.command, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        wait = [unit.servebook, "wait-ready", "--url", unit.url, "--timeout", str(unit.timeout_start_s)]
        done = subprocess.run(wait, capture_output=True, text=True, timeout=unit.timeout_start_s + 60)
        out["post_start"] = {"command": systemd.shell_line(wait), "returncode": done.returncode,
                             "output": (done.stdout + done.stderr).strip(), "seconds": round(time.monotonic() - started, 1)}
        if done.returncode == 0:
            smoke = client.smoke_test(unit.url, model, max_tokens=8)
            out["smoke_test"] = {"passed": smoke["passed"], "checks": smoke["checks"]}
    finally:
        out["stop"] = server.terminate(proc.pid)
        proc.wait(timeout=30)
    out["log"] = str(log)
    return out


def run(p: Params, run_dir: str | Path) -> dict[str, Any]:
    run_dir = results.run_folder(str(run_dir))
    launch = results.require(run_dir, "launch", "deploy")
    nccl = results.read(run_dir, "nccl_tuning") or {}
    name = p.deploy_name or launch["served_model_name"].replace("/", "-")
    size, _ = models.checkpoint_bytes(launch["model_path"])
    predicted = server.BASE_BUDGET_S + server.SECONDS_PER_GB * (size or 0) / 1e9
    unit = unit_spec(name, launch, nccl.get("recommended_env"), predicted, p.deploy_user)
    unit_text = systemd.render_unit(unit)
    unit_path = run_dir / unit.unit_name
    unit_path.write_text(unit_text)
    env_path = run_dir / f"{name}.env"
    env_path.write_text(systemd.render_env_file(unit))
    data: dict[str, Any] = {"unit_name": unit.unit_name, "unit_file": str(unit_path), "env_file": str(env_path),
                            "timeout_start_s": unit.timeout_start_s, "load_seconds": unit.load_seconds,
                            "load_source": unit.load_source, "start_limit_interval_s": unit.start_limit_interval_s,
                            "verify": systemd.verify(unit_path), "systemd_running": systemd.systemd_running(),
                            "installed": None}
    # The ad hoc server this run started holds the port: the check must say so, then the service replaces it.
    data["pre_start_with_ad_hoc_server"] = run_check(unit)
    if data["pre_start_with_ad_hoc_server"]["returncode"] != 0 and launch.get("started_by_this_run"):
        data["ad_hoc_server_stopped"] = server.stop(port=unit.port)["summary"]
    if p.deploy_install:
        data["installed"] = systemd.install(unit, unit_text)
        ok, message, _ = server.wait_ready(unit.url, unit.timeout_start_s)
        data["service_ready"] = message
        if ok:
            data["smoke_test"] = client.smoke_test(unit.url, launch["served_model_name"], 8, launch.get("api_key_env", ""))
    else:
        data["dry_run"] = dry_run_start(unit, run_dir, launch["served_model_name"])
    results.write(run_dir, "deploy", data)
    return data


def raise_on_failure(data: dict[str, Any]) -> None:
    from servebook.errors import ServebookError

    problems = []
    if not data["verify"]["ok"]:
        problems.append("systemd-analyze verify: " + "; ".join(data["verify"].get("blocking") or [data["verify"]["output"]]))
    dry = data.get("dry_run") or {}
    if dry.get("post_start", {}).get("returncode"):
        problems.append("the post-start wait failed: " + dry["post_start"]["output"])
    if dry.get("skipped"):
        problems.append("the pre-start check refused: " + dry["pre_start"]["output"])
    if dry.get("smoke_test") and not dry["smoke_test"]["passed"]:
        problems.append("the smoke test against the dry-run service failed")
    if problems:
        raise ServebookError("deploy: " + "\n  - ".join(["problems:"] + problems))
