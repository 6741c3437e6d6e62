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


def downloaded_path(run_dir: Path) -> str | None:
    """The local folder the download stage verified, when it ran in this run."""
    found = results.read(run_dir, "download")
    return found["local_path"] if found else None


def planned_layout(run_dir: Path) -> dict[str, Any] | None:
    """The layout the plan stage handed over (only when layout_from_plan was set)."""
    plan = results.read(run_dir, "plan")
    return ((plan or {}).get("recommended") or {}).get("launch")


def plan_check(run_dir: Path, reported: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any] | None:
    """The plan's predictions for the layout that launched, beside what vLLM reported."""
    plan = results.read(run_dir, "plan")
    if not plan:
        return None
    match = next((l for l in plan["layouts"] if (l["tp"], l["pp"], l["dp"], l["ep"]) == (
        layout["tensor_parallel_size"], layout["pipeline_parallel_size"], layout["data_parallel_size"],
        layout["enable_expert_parallel"])), None)
    if not match:
        return None
    out = {"layout": match["name"], "predicted_kv_tokens": match["max_kv_tokens"],
           "reported_kv_tokens": reported.get("kv_cache_tokens"),
           "predicted_weight_gib": match["weight_bytes_per_gpu"] / 2**30,
           "reported_weight_gib": reported.get("model_memory_gib")}
    if out["reported_kv_tokens"]:
        out["kv_tokens_error_pct"] = 100 * (out["predicted_kv_tokens"] - out["reported_kv_tokens"]) / out["reported_kv_tokens"]
    if out["reported_weight_gib"]:
        out["weight_error_pct"] = 100 * (out["predicted_weight_gib"] - out["reported_weight_gib"]) / out["reported_weight_gib"]
    return out


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


def config_for(params: Params, run_dir: Path) -> server.ServerConfig:
    """The server configuration this run launches: the params, the plan's layout and the download's folder."""
    return server.ServerConfig.from_params(params.model_dump(), device_for(params, run_dir), planned_layout(run_dir),
                                           model_path=downloaded_path(run_dir))


def run(params: Params, run_dir: str | Path) -> dict[str, Any]:
    """Launch (or reuse) the server the parameters describe; write and return the stage's results."""
    run_dir = results.run_folder(str(run_dir))
    layout = planned_layout(run_dir)
    cfg = config_for(params, run_dir)
    launch = server.launch(cfg, run_dir, stop_leftovers=params.stop_leftovers,
                           on_progress=ui.load_progress(params.interactive))
    data = launch.results()
    data["layout_source"] = "plan" if layout else "params"
    data["memory_after_load"] = memory_after_load(launch)
    data["plan_check"] = plan_check(run_dir, data["vllm_reported"], {
        "tensor_parallel_size": cfg.tensor_parallel_size, "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "data_parallel_size": cfg.data_parallel_size, "enable_expert_parallel": cfg.enable_expert_parallel})
    results.write(run_dir, "launch", data)
    return data


def phase_table(data: dict[str, Any]):
    """Seconds from process start to each load phase vLLM logged."""
    import pandas as pd

    phases = sorted(data["phases"].items(), key=lambda kv: kv[1])
    return pd.DataFrame(phases, columns=["phase", "seconds since start"])
