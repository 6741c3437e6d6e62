"""A stand-in for NVIDIA's pynvml, answered from a YAML scenario: the one fake servebook's tests use.

``nvml.use_backend(lambda: FakeNvml(load_scenario("h200x8-nvlink")))`` puts it in pynvml's place for the code
under test (the ``fake_nvml`` fixture does that), so reconnaissance, the preflight's GPU checks and the GPU
sampler run exactly the code paths they run on a GPU server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import yaml

from servebook.nvml import TOPOLOGY_CODES, P2PCap
from servebook.units import MiB

SCENARIOS = Path(__file__).parent / "nvml_scenarios"  # fake NVML hosts


def _nvml_error(name: str) -> pynvml.NVMLError:
    return pynvml.NVMLError(getattr(pynvml, f"NVML_ERROR_{name}"))


@dataclass
class _FakeHandle:
    index: int
    spec: dict[str, Any]


class FakeNvml:
    """The subset of ``pynvml`` that servebook calls, answered from a scenario."""

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, scenario: dict[str, Any]):
        self.scenario = scenario
        template = scenario.get("gpu", {})
        count = scenario.get("count", 0)
        overrides = scenario.get("overrides", {}) or {}
        self.gpus = []
        for i in range(count):
            spec = {**template, **overrides.get(i, {})}
            spec.setdefault("uuid", f"GPU-{i:08d}-fake-{scenario.get('name', 'scenario')}")
            spec.setdefault("pci_bus_id", f"00000000:{0x18 + i * 0x10:02X}:00.0")
            self.gpus.append(_FakeHandle(i, spec))
        self.processes = {int(k): v for k, v in (scenario.get("processes") or {}).items()}
        self.started_us = time.monotonic() * 1e6

    def nvmlInit(self) -> None:
        if "init_error" in self.scenario:
            raise _nvml_error(self.scenario["init_error"])

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.scenario["driver_version"]

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return self.scenario["cuda_driver_version"]

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _FakeHandle:
        return self.gpus[index]

    def nvmlDeviceGetName(self, h: _FakeHandle) -> str:
        return h.spec["name"]

    def nvmlDeviceGetUUID(self, h: _FakeHandle) -> str:
        return h.spec["uuid"]

    def nvmlDeviceGetPciInfo_v3(self, h: _FakeHandle) -> SimpleNamespace:
        return SimpleNamespace(busId=h.spec["pci_bus_id"])

    def nvmlDeviceGetMemoryInfo(self, h: _FakeHandle, version: Any = None) -> SimpleNamespace:
        total = int(h.spec["memory_total_mib"] * MiB)
        reserved = int(h.spec.get("memory_reserved_mib", 500) * MiB)
        used = int(h.spec.get("memory_used_mib", 1) * MiB)
        used += sum(int(p.get("used_mib", 0) * MiB) for p in self.processes.get(h.index, []))
        return SimpleNamespace(total=total, reserved=reserved, used=used, free=total - reserved - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h: _FakeHandle) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(pid=p["pid"], usedGpuMemory=int(p["used_mib"] * MiB))
            for p in self.processes.get(h.index, [])
            if not p.get("invisible")
        ]

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        for procs in self.processes.values():
            for p in procs:
                if p["pid"] == pid:
                    return p["name"]
        raise _nvml_error("NOT_FOUND")

    def nvmlDeviceGetMigMode(self, h: _FakeHandle) -> list[int]:
        if h.spec.get("mig") is None:
            raise _nvml_error("NOT_SUPPORTED")
        return [int(h.spec["mig"]), int(h.spec["mig"])]

    def _pcie(self, h: _FakeHandle, key: str) -> int:
        if key not in h.spec:
            raise _nvml_error("NOT_SUPPORTED")
        return h.spec[key]

    def _load(self, h: _FakeHandle, key: str) -> Any:
        """What a GPU reports under load, from the scenario's ``load`` values; unsupported when absent."""
        value = (h.spec.get("load") or {}).get(key)
        if value is None:
            raise _nvml_error("NOT_SUPPORTED")
        return value

    def nvmlDeviceGetUtilizationRates(self, h: _FakeHandle) -> SimpleNamespace:
        return SimpleNamespace(gpu=self._load(h, "sm_util_pct"), memory=self._load(h, "memory_util_pct"))

    def nvmlDeviceGetPowerUsage(self, h: _FakeHandle) -> int:
        return int(self._load(h, "power_w") * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, h: _FakeHandle) -> int:
        return int(self._load(h, "power_limit_w") * 1000)

    def nvmlDeviceGetClockInfo(self, h: _FakeHandle, clock: int) -> int:
        return self._load(h, "sm_clock_mhz")

    def nvmlDeviceGetMaxClockInfo(self, h: _FakeHandle, clock: int) -> int:
        return self._load(h, "sm_clock_max_mhz")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: _FakeHandle) -> int:
        return self._load(h, "clock_event_reasons")

    def nvmlDeviceGetPcieThroughput(self, h: _FakeHandle, counter: int) -> int:
        return self._load(h, "pcie_tx_kbs" if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else "pcie_rx_kbs")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: _FakeHandle) -> int:
        return self._pcie(h, "pcie_gen_current")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: _FakeHandle) -> int:
        return self._pcie(h, "pcie_gen_max")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: _FakeHandle) -> int:
        return self._pcie(h, "pcie_width_current")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: _FakeHandle) -> int:
        return self._pcie(h, "pcie_width_max")

    def nvmlDeviceGetNvLinkState(self, h: _FakeHandle, link: int) -> int:
        links = h.spec.get("nvlink_links", 0)
        if not links:
            raise _nvml_error("NOT_SUPPORTED")
        if link >= links:
            raise _nvml_error("INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetFieldValues(self, h: _FakeHandle, fields: list[tuple[int, int]]) -> list[SimpleNamespace]:
        """NVLink's common link speed (``nvlink_speed_mbps``) and data counters that grow at the scenario's
        ``load`` rates (``nvlink_tx_kbs``, ``nvlink_rx_kbs``) from the moment the fake was made."""
        now_us = time.monotonic() * 1e6
        values = []
        for field_id, _scope in fields:
            if field_id == pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON:
                value = h.spec.get("nvlink_speed_mbps")
            else:
                key = {
                    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: "nvlink_tx_kbs",
                    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: "nvlink_rx_kbs",
                }.get(field_id, "")
                rate = (h.spec.get("load") or {}).get(key)
                value = None if rate is None else int(rate * (now_us - self.started_us) / 1e6)
            ok = value is not None
            values.append(
                SimpleNamespace(
                    fieldId=field_id,
                    nvmlReturn=pynvml.NVML_SUCCESS if ok else pynvml.NVML_ERROR_NOT_SUPPORTED,
                    valueType=3,
                    value=SimpleNamespace(ullVal=value or 0),
                    timestamp=int(now_us),
                )
            )
        return values

    def _group(self, index: int) -> int:
        for n, group in enumerate(self.scenario.get("numa_groups", [list(range(len(self.gpus)))])):
            if index in group:
                return n
        return -1

    def nvmlDeviceGetTopologyCommonAncestor(self, a: _FakeHandle, b: _FakeHandle) -> int:
        topo = self.scenario.get("topology", {})
        same = self._group(a.index) == self._group(b.index)
        return TOPOLOGY_CODES[topo.get("same_group" if same else "cross_group", "SYS")]

    def nvmlDeviceGetP2PStatus(self, a: _FakeHandle, b: _FakeHandle, index: int) -> int:
        p2p = self.scenario.get("p2p", {})
        if index == P2PCap.NVLINK:
            return 0 if a.spec.get("nvlink_links") and b.spec.get("nvlink_links") else 5
        same = self._group(a.index) == self._group(b.index)
        return 0 if p2p.get("same_group" if same else "cross_group", True) else 3


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIOS.glob("*.yaml"))


def load_scenario(name_or_path: str) -> dict[str, Any]:
    path = Path(name_or_path)
    if not path.is_file():
        candidate = SCENARIOS / f"{name_or_path}.yaml"
        if not candidate.is_file():
            raise FileNotFoundError(f"fake NVML {name_or_path}: no such scenario; known: {', '.join(scenario_names())}")
        return yaml.safe_load(candidate.read_text())
    return yaml.safe_load(path.read_text())
