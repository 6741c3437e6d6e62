"""What the GPUs did during a benchmark level, sampled through NVML, and what it says about the limit.

A sampler thread reads each serving GPU every half second while a level runs: SM utilisation, power against its
enforced limit, the SM clock against its maximum and the reasons NVML gives for holding it down, and PCIe
traffic in both directions against what the link's generation and width can carry, and NVLink data traffic
(NVML's throughput counters summed over every link) against the active links' common speed.  :func:`summarize`
turns the samples into one record per level; :func:`verdict` names a GPU-side wall when the evidence shows one
(power cap, thermal slowdown, a saturated PCIe link or NVLink) — "PCIe at 90 % of Gen5 x16" is the wall the
story's PCIe box hit.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pynvml
from pydantic import BaseModel

from servebook import nvml

# GB/s one way per lane after encoding, by PCIe generation
PCIE_GBS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# nvmlClocksEventReason* bits (NVIDIA's nvml.h) that mean the clock is held below what the load asks for
SLOWDOWNS = {
    pynvml.nvmlClocksEventReasonSwPowerCap: "power cap",
    pynvml.nvmlClocksEventReasonHwSlowdown: "hardware slowdown",
    pynvml.nvmlClocksEventReasonSwThermalSlowdown: "thermal (software)",
    pynvml.nvmlClocksEventReasonHwThermalSlowdown: "thermal (hardware)",
    pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown: "power brake",
}
NVLINK_ALL_LINKS = 0xFFFFFFFF  # a field value's scope: the sum over every link
# nvmlFieldValue_t.valueType -> the member of its value union that holds it
FIELD_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}
POWER_CAPPED = 0.97  # power at this share of the enforced limit counts as capped
PCIE_SATURATED = 0.85  # PCIe traffic at this share of the link's bandwidth counts as the wall
NVLINK_SATURATED = 0.85  # NVLink data traffic at this share of the active links' bandwidth, likewise


@dataclass
class Sample:
    gpu: int
    sm_util_pct: float | None
    power_w: float | None
    power_limit_w: float | None
    sm_clock_mhz: float | None
    sm_clock_max_mhz: float | None
    slowdown_mask: int
    pcie_tx_gbs: float | None
    pcie_rx_gbs: float | None
    pcie_gen: int | None
    pcie_width: int | None
    nvlink_tx_kib: float | None = None  # NVML's data counters, every link summed, since the driver loaded
    nvlink_rx_kib: float | None = None
    nvlink_us: float | None = None  # when NVML read those counters (microseconds)
    nvlink_gbs: float | None = None  # one-way bandwidth of the active links; None without NVLink


class GpuEvidence(BaseModel):
    """One level's GPU evidence, over every serving GPU and sample."""

    samples: int
    sm_util_mean_pct: float | None = None
    power_peak_pct: float | None = None  # of the enforced power limit
    power_peak_w: float | None = None
    sm_clock_min_pct: float | None = None  # of the maximum SM clock
    slowdowns: list[str] = []  # NVML's reasons for a held-down clock, as seen in any sample
    pcie_peak_pct: float | None = None  # of the link's one-way bandwidth, the busier direction
    pcie_peak_direction: str = ""
    pcie_link: str = ""  # e.g. "Gen5 x16"
    nvlink_peak_pct: float | None = None  # of the active links' one-way bandwidth, the busier direction
    nvlink_peak_gbs: float | None = None
    nvlink_peak_direction: str = ""
    nvlink_capacity_gbs: float | None = None


def field_values(backend: Any, h: Any, fields: list[tuple[int, int]]) -> list[tuple[float, int] | None]:
    """NVML field values (``(field id, scope)`` pairs), each as (value, NVML's timestamp in microseconds); a field
    the GPU does not report reads as None."""
    values = nvml.optional(backend.nvmlDeviceGetFieldValues, h, fields)
    if values is None:
        return [None] * len(fields)
    return [
        (float(getattr(v.value, FIELD_VALUE_MEMBER.get(v.valueType, "ullVal"))), v.timestamp)
        if v.nvmlReturn == pynvml.NVML_SUCCESS
        else None
        for v in values
    ]


def nvlink_capacity_gbs(backend: Any, h: Any) -> float | None:
    """One-way bandwidth of a GPU's active NVLinks: how many are up, times the common speed NVML gives them."""
    active = 0
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = nvml.optional(backend.nvmlDeviceGetNvLinkState, h, link)
        if state is None:  # past the GPU's last link, or no NVLink at all
            break
        active += state == pynvml.NVML_FEATURE_ENABLED
    if not active:
        return None
    (speed,) = field_values(backend, h, [(pynvml.NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON, 0)])
    return active * speed[0] / 1000 if speed and speed[0] else None


def read(backend: Any, indices: list[int], nvlink_gbs: dict[int, float | None] | None = None) -> list[Sample]:
    """One sample of each GPU; a query a GPU does not support reads as None.  ``nvlink_gbs`` caches each GPU's
    NVLink bandwidth between samples (links do not come and go during a level)."""
    nvlink_gbs = {} if nvlink_gbs is None else nvlink_gbs
    out = []
    for i in indices:
        h = backend.nvmlDeviceGetHandleByIndex(i)
        if i not in nvlink_gbs:
            nvlink_gbs[i] = nvlink_capacity_gbs(backend, h)
        sent = received = None
        if nvlink_gbs[i]:
            sent, received = field_values(
                backend,
                h,
                [
                    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVLINK_ALL_LINKS),
                    (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVLINK_ALL_LINKS),
                ],
            )
        nvlink = (sent[0], received[0], sent[1]) if sent and received else (None, None, None)
        util = nvml.optional(backend.nvmlDeviceGetUtilizationRates, h)
        power = nvml.optional(backend.nvmlDeviceGetPowerUsage, h)
        limit = nvml.optional(backend.nvmlDeviceGetEnforcedPowerLimit, h)
        clock = nvml.optional(backend.nvmlDeviceGetClockInfo, h, pynvml.NVML_CLOCK_SM)
        clock_max = nvml.optional(backend.nvmlDeviceGetMaxClockInfo, h, pynvml.NVML_CLOCK_SM)
        reasons = nvml.optional(backend.nvmlDeviceGetCurrentClocksEventReasons, h) or 0
        # KB/s over NVML's last 20 ms window
        tx = nvml.optional(backend.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        rx = nvml.optional(backend.nvmlDeviceGetPcieThroughput, h, pynvml.NVML_PCIE_UTIL_RX_BYTES)
        out.append(
            Sample(
                gpu=i,
                sm_util_pct=float(util.gpu) if util is not None else None,
                power_w=power / 1000 if power is not None else None,
                power_limit_w=limit / 1000 if limit is not None else None,
                sm_clock_mhz=float(clock) if clock is not None else None,
                sm_clock_max_mhz=float(clock_max) if clock_max is not None else None,
                slowdown_mask=int(reasons),
                pcie_tx_gbs=tx * 1000 / 1e9 if tx is not None else None,
                pcie_rx_gbs=rx * 1000 / 1e9 if rx is not None else None,
                pcie_gen=nvml.optional(backend.nvmlDeviceGetCurrPcieLinkGeneration, h),
                pcie_width=nvml.optional(backend.nvmlDeviceGetCurrPcieLinkWidth, h),
                nvlink_tx_kib=nvlink[0],
                nvlink_rx_kib=nvlink[1],
                nvlink_us=nvlink[2],
                nvlink_gbs=nvlink_gbs[i],
            )
        )
    return out


def summarize(samples: list[Sample]) -> GpuEvidence:
    def values(name: str) -> list[float]:
        return [v for s in samples if (v := getattr(s, name)) is not None]

    util = values("sm_util_pct")
    power = [(s.power_w / s.power_limit_w, s.power_w) for s in samples if s.power_w and s.power_limit_w]
    clocks = [s.sm_clock_mhz / s.sm_clock_max_mhz for s in samples if s.sm_clock_mhz and s.sm_clock_max_mhz]
    slowdowns = sorted({name for s in samples for bit, name in SLOWDOWNS.items() if s.slowdown_mask & bit})
    pcie: list[tuple[float, str, str]] = []
    for s in samples:
        if s.pcie_gen in PCIE_GBS_PER_LANE and s.pcie_width:
            link = PCIE_GBS_PER_LANE[s.pcie_gen] * s.pcie_width
            for direction, gbs in (("to the GPU", s.pcie_rx_gbs), ("from the GPU", s.pcie_tx_gbs)):
                if gbs is not None:
                    pcie.append((gbs / link, direction, f"Gen{s.pcie_gen} x{s.pcie_width}"))
    top = max(pcie) if pcie else None
    nvlink = nvlink_rates(samples)
    busiest = max(nvlink) if nvlink else None
    return GpuEvidence(
        samples=len(samples),
        sm_util_mean_pct=sum(util) / len(util) if util else None,
        power_peak_pct=100 * max(p for p, _ in power) if power else None,
        power_peak_w=max(w for _, w in power) if power else None,
        sm_clock_min_pct=100 * min(clocks) if clocks else None,
        slowdowns=slowdowns,
        pcie_peak_pct=100 * top[0] if top else None,
        pcie_peak_direction=top[1] if top else "",
        pcie_link=top[2] if top else "",
        nvlink_peak_pct=100 * busiest[0] if busiest else None,
        nvlink_peak_gbs=busiest[1] if busiest else None,
        nvlink_peak_direction=busiest[2] if busiest else "",
        nvlink_capacity_gbs=busiest[3] if busiest else None,
    )


def nvlink_rates(samples: list[Sample]) -> list[tuple[float, float, str, float]]:
    """NVLink data rates between each GPU's consecutive samples: (share of its bandwidth, GB/s, direction,
    bandwidth GB/s); NVML's counters are cumulative KiB, so a rate needs two readings."""
    by_gpu: dict[int, list[Sample]] = {}
    for s in samples:
        if s.nvlink_us is not None and s.nvlink_gbs:
            by_gpu.setdefault(s.gpu, []).append(s)
    rates = []
    for series in by_gpu.values():
        for a, b in zip(series, series[1:]):
            seconds = ((b.nvlink_us or 0) - (a.nvlink_us or 0)) / 1e6
            if seconds <= 0 or not b.nvlink_gbs:
                continue
            for direction, before, after in (
                ("sent", a.nvlink_tx_kib, b.nvlink_tx_kib),
                ("received", a.nvlink_rx_kib, b.nvlink_rx_kib),
            ):
                if before is not None and after is not None:
                    gbs = (after - before) * 1024 / 1e9 / seconds
                    rates.append((gbs / b.nvlink_gbs, gbs, direction, b.nvlink_gbs))
    return rates


def verdict(e: GpuEvidence) -> tuple[str, str] | None:
    """A GPU-side wall the evidence shows, as (kind, words); None when it shows none."""
    if e.pcie_peak_pct is not None and e.pcie_peak_pct >= 100 * PCIE_SATURATED:
        return "pcie", f"PCIe at {e.pcie_peak_pct:.0f} % of {e.pcie_link} ({e.pcie_peak_direction})"
    if e.nvlink_peak_pct is not None and e.nvlink_peak_pct >= 100 * NVLINK_SATURATED:
        return "nvlink", (
            f"NVLink at {e.nvlink_peak_pct:.0f} % of {e.nvlink_capacity_gbs or 0:.0f} GB/s "
            f"({e.nvlink_peak_gbs or 0:.0f} GB/s {e.nvlink_peak_direction})"
        )
    thermal = [s for s in e.slowdowns if s.startswith("thermal")]
    if thermal:
        return (
            "thermal",
            f"thermal slowdown ({', '.join(thermal)}): SM clock down to {e.sm_clock_min_pct or 0:.0f} % of max",
        )
    if "power cap" in e.slowdowns or (e.power_peak_pct is not None and e.power_peak_pct >= 100 * POWER_CAPPED):
        clock = f", SM clock down to {e.sm_clock_min_pct:.0f} % of max" if e.sm_clock_min_pct is not None else ""
        return "power", f"power-capped: {e.power_peak_w or 0:.0f} W, {e.power_peak_pct or 0:.0f} % of the limit{clock}"
    return None


class GpuSampler:
    """Samples the serving GPUs in a thread while a level runs; :attr:`evidence` afterwards.  Without NVML (a CPU
    server, no driver) it samples nothing and says why in :attr:`absent`."""

    def __init__(self, indices: list[int], every_s: float = 0.5):
        self.indices, self.every_s = indices, every_s
        self.samples: list[Sample] = []
        self._nvlink_gbs: dict[int, float | None] = {}
        self.absent = "" if indices else "no GPU serves this model"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            with nvml.session() as backend:
                while True:
                    self.samples += read(backend, self.indices, self._nvlink_gbs)
                    if self._stop.wait(self.every_s):
                        return
        except Exception as exc:  # a sampler never breaks a measurement; the record says what was missing
            self.absent = f"NVML unavailable: {exc}"

    def __enter__(self) -> GpuSampler:
        if self.indices:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self.indices:
            self._thread.join(timeout=5)

    @property
    def evidence(self) -> GpuEvidence | None:
        return summarize(self.samples) if self.samples else None
