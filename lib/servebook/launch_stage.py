"""Stage 03 glue: from parameters (and earlier stages' results) to a ready server and ``03_launch.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil

from servebook import hardware, recon, results, server, ui
from servebook.params import Params


def device_for(params: Params, run_dir: Path) -> str:
    """The device reconnaissance resolved, or resolve it now."""
    found = results.read(run_dir, "reconnaissance")
    if found and params.device == "auto":
        return found["device"]
    return recon.resolve_device(params.device, hardware.inventory())


def planned_layout(run_dir: Path) -> dict[str, Any] | None:
    """The layout the plan stage recommended, when it ran in this run."""
    plan = results.read(run_dir, "plan")
    return (plan or {}).get("recommended", {}).get("launch") if plan else None


def memory_after_load(launch: server.Launch) -> dict[str, Any]:
    """Per-GPU memory in use (cuda), or the server processes' resident memory (cpu)."""
    if launch.config.device == "cuda":
        inv = hardware.inventory()
        wanted = launch.config.gpu_ids or list(range(launch.config.world_size))
        return {"per_gpu": [{"gpu": g.index, "used_bytes": g.memory_used, "total_bytes": g.memory_total}
                            for g in inv.gpus if g.index in wanted]}
    procs = []
    for proc in server.group_members(launch.pgid):
        try:
            procs.append({"pid": proc.pid, "title": server._title(proc)[:60], "rss_bytes": proc.memory_info().rss})
        except psutil.NoSuchProcess:
            continue
    return {"processes": procs, "rss_total_bytes": sum(p["rss_bytes"] for p in procs)}


def run(params: Params, run_dir: str | Path) -> dict[str, Any]:
    """Launch (or reuse) the server the parameters describe; write and return the stage's results."""
    run_dir = results.run_folder(str(run_dir))
    device = device_for(params, run_dir)
    layout = planned_layout(run_dir)
    cfg = server.ServerConfig.from_params(params.model_dump(), device, layout)
    launch = server.launch(cfg, run_dir, stop_leftovers=params.stop_leftovers,
                           on_progress=ui.load_progress(params.interactive))
    data = launch.results()
    data["layout_source"] = "plan" if layout else "params"
    data["memory_after_load"] = memory_after_load(launch)
    results.write(run_dir, "launch", data)
    return data


def phase_table(data: dict[str, Any]):
    """Seconds from process start to each load phase vLLM logged."""
    import pandas as pd

    phases = sorted(data["phases"].items(), key=lambda kv: kv[1])
    return pd.DataFrame(phases, columns=["phase", "seconds since start"])
