"""Stage 03: from parameters and earlier stages' records to a ready server, recorded in ``03_launch.json``."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import psutil

from servebook import client, hardware, multinode, remote, results, server, ui
from servebook.errors import LaunchError
from servebook.params import Params
from servebook.records import (
    DownloadRecord,
    GpuMemory,
    LaunchRecord,
    MemoryAfterLoad,
    PlanCheck,
    PlanRecord,
    ProcessMemory,
    ReconRecord,
)


def config_for(p: Params, run_dir: Path) -> server.ServerConfig:
    """The server this run launches: the params, with the plan's layout and the download's folder where they ran."""
    found = results.read(run_dir, ReconRecord)
    device = found.device if found and p.device == "auto" else hardware.resolve_device(p.device, hardware.inventory())
    plan = results.read(run_dir, PlanRecord)
    downloaded = results.read(run_dir, DownloadRecord)
    return server.ServerConfig.from_params(
        p, device, plan.layout_for_launch if plan else None, model_path=downloaded.local_path if downloaded else None
    )


def memory_after_load(launch: server.Launch) -> MemoryAfterLoad:
    """Per-GPU memory in use (cuda), or the server processes' resident memory (cpu)."""
    if launch.config.device == "cuda":
        wanted = launch.config.target_gpus
        return MemoryAfterLoad(
            per_gpu=[
                GpuMemory(gpu=g.index, used_bytes=g.memory_used, total_bytes=g.memory_total)
                for g in hardware.inventory().gpus
                if g.index in wanted
            ]
        )
    procs = []
    for proc in server.group_members(launch.pgid):
        try:
            procs.append(ProcessMemory(pid=proc.pid, title=hardware.title(proc)[:60], rss_bytes=proc.memory_info().rss))
        except psutil.NoSuchProcess:
            continue
    return MemoryAfterLoad(processes=procs, rss_total_bytes=sum(p.rss_bytes for p in procs))


def run(p: Params, run_dir: str | Path) -> LaunchRecord:
    """Launch (or reuse) the server the parameters describe; write and return the record."""
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, LaunchRecord)  # a rerun never leaves the last attempt's record looking current
    cfg = config_for(p, run_dir)
    probes: list[multinode.NodeProbe] = []
    workers: list[remote.WorkerRecord] = []
    if p.nodes > 1:
        nodes = multinode.NodeSet.from_params(p)
        probes = multinode.preflight(nodes, cfg.model_path, [nodes.master_port])  # server.launch checks the API port
        cfg, workers = multinode.prepare(cfg, nodes, run_dir)
    launch = server.launch(
        cfg, run_dir, stop_leftovers=p.stop_leftovers, on_progress=ui.load_progress(p.interactive), workers=workers
    )
    plan = results.read(run_dir, PlanRecord)
    predicted = plan.find(cfg.parallelism) if plan else None
    registered = server.registered(cfg.port)
    record = LaunchRecord.of(
        launch,
        layout_source="plan" if plan and plan.layout_for_launch else "params",
        memory_after_load=memory_after_load(launch),
        plan_check=PlanCheck.of(predicted, launch.values) if predicted else None,
        nodes=probes,
        workers=registered.workers if registered else [],
    )
    results.write(run_dir, record)
    return record


def check(record: LaunchRecord, p: Params) -> None:
    """The server the record names still answers: a later stage can rely on it."""
    state = client.health(record.url)
    if state != "ready":
        raise LaunchError(
            f"the server at {record.url} is not ready after its launch (/health: {state})", log_path=record.log_path
        )


def summary(record: LaunchRecord) -> str:
    how = "reused a running server" if record.reused else f"ready in {record.seconds_to_ready:.0f} s"
    kv = record.vllm_reported.kv_cache_tokens
    predicted = f" (plan: {record.plan_check.predicted_kv_tokens:,})" if record.plan_check else ""
    kv_text = f"; KV cache {kv:,} tokens{predicted}" if kv else ""
    across = f" across {len(record.workers) + 1} nodes" if record.workers else ""
    return (
        f"`{record.config.served_model_name}` at {record.layout.name} on {record.config.device}{across}, {how}{kv_text}"
    )


def phase_table(record: LaunchRecord) -> pd.DataFrame:
    """Seconds from process start to each load phase vLLM logged."""
    return pd.DataFrame(sorted(record.phases.items(), key=lambda kv: kv[1]), columns=["phase", "seconds since start"])
