"""GPU inventory through NVML: memory, processes, links, topology, and who holds what.

NVML reports host PIDs and ignores ``CUDA_VISIBLE_DEVICES``, so GPUs are named by
physical index, UUID and PCI bus id, and memory that no visible process accounts
for (a process in another PID namespace, a container) is reported separately.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import combinations
from typing import Any

import psutil
import pynvml

from servebook import nvml
from servebook.errors import NvmlUnavailable
from servebook.json_types import JsonObject
from servebook.units import MiB, gib

VLLM_TITLE_PREFIX = "VLLM::"
# Memory (v2 "used", which excludes the driver's reservation) above this with no
# visible process means someone we cannot see holds the GPU.
UNATTRIBUTED_THRESHOLD = 512 * MiB
P2P_STATUS = {
    0: "OK",
    1: "CHIPSET_NOT_SUPPORTED",
    2: "GPU_NOT_SUPPORTED",
    3: "IOH_TOPOLOGY_NOT_SUPPORTED",
    4: "DISABLED_BY_REGKEY",
    5: "NOT_SUPPORTED",
    6: "UNKNOWN",
}


@dataclass
class GpuProcess:
    pid: int
    used_bytes: int | None
    title: str
    visible: bool  # the pid exists in this PID namespace
    is_vllm: bool
    orphan: bool  # a vLLM process whose parent is gone (re-parented to init or a subreaper)


@dataclass
class Gpu:
    index: int
    name: str
    uuid: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    memory_reserved: int
    memory_free: int
    processes: list[GpuProcess] = field(default_factory=list)
    unattributed_bytes: int = 0
    mig_enabled: bool | None = None
    pcie_gen_current: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_current: int | None = None
    pcie_width_max: int | None = None
    nvlink_active: int = 0


@dataclass
class GpuPair:
    a: int
    b: int
    topology: str | None
    p2p_read: str | None
    p2p_write: str | None
    p2p_nvlink: str | None


@dataclass
class Inventory:
    available: bool
    error: str = ""
    driver_version: str = ""
    cuda_driver_version: str = ""
    gpus: list[Gpu] = field(default_factory=list)
    pairs: list[GpuPair] = field(default_factory=list)

    def to_dict(self) -> JsonObject:
        return asdict(self)

    @property
    def nvlink_everywhere(self) -> bool:
        return bool(self.pairs) and all(p.p2p_nvlink == "OK" for p in self.pairs)


def title(proc: psutil.Process) -> str:
    """The title a process shows: vLLM renames its processes ``VLLM::EngineCore``, ``VLLM::Worker_TP1``..."""
    try:
        return " ".join(proc.cmdline()).strip() or proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"


def process_title(pid: int, backend: Any) -> tuple[str, bool]:
    """A GPU process's title and whether it is visible from here (NVML may list pids of other namespaces)."""
    try:
        proc = psutil.Process(pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return nvml.optional(backend.nvmlSystemGetProcessName, pid) or "?", False
    return title(proc), True


def resolve_device(device: str, inv: Inventory) -> str:
    """``auto`` becomes ``cuda`` when NVML sees GPUs, else ``cpu``; an explicit choice stands."""
    if device != "auto":
        return device
    return "cuda" if inv.available and inv.gpus else "cpu"


def target_gpus(gpu_ids: list[int], world_size: int) -> list[int]:
    """The physical GPUs a server uses: ``gpu_ids`` when given, else the first ``world_size`` indices.

    servebook exports ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` to every server, so CUDA's device N is NVML's index N.
    """
    return list(gpu_ids) if gpu_ids else list(range(world_size))


def is_orphan(pid: int) -> bool:
    """A process whose launcher is gone: it was re-parented to init."""
    try:
        parent = psutil.Process(pid).parent()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    # vLLM titles only its children (EngineCore, workers); their parent is the API server
    # while it lives, and init once it is gone.
    return parent is None or parent.pid == 1


def _link_width_gen(backend: Any, h: Any) -> dict[str, int | None]:
    return {
        "pcie_gen_current": nvml.optional(backend.nvmlDeviceGetCurrPcieLinkGeneration, h),
        "pcie_gen_max": nvml.optional(backend.nvmlDeviceGetMaxPcieLinkGeneration, h),
        "pcie_width_current": nvml.optional(backend.nvmlDeviceGetCurrPcieLinkWidth, h),
        "pcie_width_max": nvml.optional(backend.nvmlDeviceGetMaxPcieLinkWidth, h),
    }


def _active_nvlinks(backend: Any, h: Any) -> int:
    active = 0
    for link in range(nvml.NVLINK_MAX_LINKS):
        try:
            active += int(backend.nvmlDeviceGetNvLinkState(h, link) == 1)
        except pynvml.NVMLError:
            break  # not supported (PCIe board) or past the last link
    return active


def _gpu(backend: Any, index: int) -> tuple[Gpu, Any]:
    h = backend.nvmlDeviceGetHandleByIndex(index)
    mem = backend.nvmlDeviceGetMemoryInfo(h, version=backend.nvmlMemory_v2)
    procs = []
    for p in nvml.optional(backend.nvmlDeviceGetComputeRunningProcesses, h) or []:
        title, visible = process_title(p.pid, backend)
        vllm = title.startswith(VLLM_TITLE_PREFIX)
        procs.append(GpuProcess(p.pid, p.usedGpuMemory, title, visible, vllm, vllm and visible and is_orphan(p.pid)))
    accounted = sum(p.used_bytes or 0 for p in procs)
    unattributed = max(0, mem.used - accounted) if not any(p.used_bytes is None for p in procs) else 0
    mig = nvml.optional(backend.nvmlDeviceGetMigMode, h)
    gpu = Gpu(
        index=index,
        name=backend.nvmlDeviceGetName(h),
        uuid=backend.nvmlDeviceGetUUID(h),
        pci_bus_id=backend.nvmlDeviceGetPciInfo_v3(h).busId,
        memory_total=mem.total,
        memory_used=mem.used,
        memory_reserved=getattr(mem, "reserved", 0),
        memory_free=mem.free,
        processes=procs,
        unattributed_bytes=unattributed if unattributed >= UNATTRIBUTED_THRESHOLD else 0,
        mig_enabled=bool(mig[0]) if mig is not None else None,
        nvlink_active=_active_nvlinks(backend, h),
        **_link_width_gen(backend, h),
    )
    return gpu, h


def _status(backend: Any, a: Any, b: Any, cap: nvml.P2PCap) -> str | None:
    code = nvml.optional(backend.nvmlDeviceGetP2PStatus, a, b, int(cap))
    return None if code is None else P2P_STATUS.get(code, str(code))


def inventory() -> Inventory:
    """Everything NVML can tell about this host's GPUs; ``available=False`` without a driver."""
    try:
        with nvml.session() as backend:
            cuda = backend.nvmlSystemGetCudaDriverVersion_v2()
            inv = Inventory(
                available=True,
                driver_version=backend.nvmlSystemGetDriverVersion(),
                cuda_driver_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            )
            handles = []
            for i in range(backend.nvmlDeviceGetCount()):
                gpu, h = _gpu(backend, i)
                inv.gpus.append(gpu)
                handles.append(h)
            for (i, ha), (j, hb) in combinations(enumerate(handles), 2):
                level = nvml.optional(backend.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
                inv.pairs.append(
                    GpuPair(
                        a=i,
                        b=j,
                        topology=None if level is None else nvml.TOPOLOGY_LEVELS.get(level, str(level)),
                        p2p_read=_status(backend, ha, hb, nvml.P2PCap.READ),
                        p2p_write=_status(backend, ha, hb, nvml.P2PCap.WRITE),
                        p2p_nvlink=_status(backend, ha, hb, nvml.P2PCap.NVLINK),
                    )
                )
            return inv
    except NvmlUnavailable as exc:
        return Inventory(available=False, error=str(exc))


def holders(inv: Inventory, gpu_indices: list[int] | None = None) -> list[tuple[int, GpuProcess]]:
    """(gpu index, process) for every process on the given GPUs (all GPUs when None)."""
    wanted = set(gpu_indices) if gpu_indices is not None else None
    return [(g.index, p) for g in inv.gpus if wanted is None or g.index in wanted for p in g.processes]


@dataclass
class Blocker:
    """Something on a GPU a new server would collide with: a process (vLLM's or another's), or memory in use
    that no process NVML lists accounts for."""

    gpu: int
    used_bytes: int | None
    process: GpuProcess | None = None  # None: memory no visible process accounts for

    @property
    def is_vllm(self) -> bool:
        return self.process is not None and self.process.is_vllm

    def describe(self) -> str:
        p = self.process
        if p is None:
            return (
                f"GPU {self.gpu} has {gib(self.used_bytes)} in use by no process NVML can list (a container without "
                "--pid=host, or another user); find it with nvidia-smi on the host"
            )
        who = p.title if p.visible else f"{p.title} (not visible from here: another PID namespace or user)"
        kind = "an orphaned " if p.orphan else ("a leftover " if p.is_vllm else "")
        return f"GPU {self.gpu} holds {gib(p.used_bytes)} for {kind}{who} (pid {p.pid})"


def blockers(inv: Inventory, gpu_indices: list[int] | None = None) -> list[Blocker]:
    """Everything on the given GPUs (all when None) that would stop a new server: the one GPU-holder rule that
    reconnaissance, the launch's preflight, a unit's pre-start check and a stop's verification share."""
    wanted = set(gpu_indices) if gpu_indices is not None else None
    found = []
    for g in inv.gpus:
        if wanted is not None and g.index not in wanted:
            continue
        found += [Blocker(gpu=g.index, used_bytes=p.used_bytes, process=p) for p in g.processes]
        if g.unattributed_bytes:
            found.append(Blocker(gpu=g.index, used_bytes=g.unattributed_bytes))
    return found
