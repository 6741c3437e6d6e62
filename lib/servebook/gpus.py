"""Memory and memory bandwidth of the GPUs servebook plans for, with where each number comes from.

Memory is what NVML reports as total (MiB, converted to bytes) where a reading exists, else
the datasheet capacity; bandwidth is the datasheet's peak HBM/GDDR bandwidth. The datasheet
figures below come from secondary sources; confirm them against nvidia.com before quoting
them to a customer.
"""

from __future__ import annotations

from dataclasses import dataclass

from servebook.errors import PlanInputError
from servebook.units import GiB


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_bytes: int
    bandwidth_bytes_s: float
    interconnect: str
    source: str


GPUS: dict[str, GpuModel] = {
    g.name: g
    for g in [
        GpuModel(
            "H200",
            143_771 * 1024**2,
            4.8e12,
            "NVLink 4 (900 GB/s)",
            "141 GB HBM3e, 4.8 TB/s (NVIDIA H200 datasheet; aiminingco.com/gpu/h200/specs); NVML total 143,771 MiB",
        ),
        GpuModel(
            "H100-SXM",
            81_559 * 1024**2,
            3.35e12,
            "NVLink 4 (900 GB/s)",
            "80 GB HBM3, 3.35 TB/s (NVIDIA H100 datasheet; pingdo.net h100-vs-h200)",
        ),
        GpuModel(
            "H100-PCIe",
            81_559 * 1024**2,
            2.0e12,
            "PCIe Gen5 x16",
            "80 GB HBM2e, 2.0 TB/s (NVIDIA H100 PCIe datasheet; router-switch.com FAQ)",
        ),
        GpuModel(
            "B200",
            183 * GiB,
            8.0e12,
            "NVLink 5 (1.8 TB/s)",
            "180-192 GB HBM3e, up to 8 TB/s (docs.vultr.com hardware overview; glennklockwood.com B200)",
        ),
        GpuModel(
            "A100-80GB",
            81_920 * 1024**2,
            2.039e12,
            "NVLink 3 (600 GB/s)",
            "80 GB HBM2e, 2,039 GB/s (NVIDIA A100 datasheet, SXM4)",
        ),
        GpuModel("L40S", 46_068 * 1024**2, 0.864e12, "PCIe Gen4 x16", "48 GB GDDR6, 864 GB/s (NVIDIA L40S datasheet)"),
        GpuModel(
            "RTX-PRO-6000",
            97_887 * 1024**2,
            1.792e12,
            "PCIe Gen5 x16",
            "96 GB GDDR7, 512-bit, 1,792 GB/s (hardware-corner.net RTX 5090 vs RTX PRO 6000); NVML total 97,887 MiB",
        ),
    ]
}
ALIASES = {
    "h200": "H200",
    "h100": "H100-SXM",
    "h100-sxm": "H100-SXM",
    "h100-pcie": "H100-PCIe",
    "b200": "B200",
    "a100": "A100-80GB",
    "a100-80gb": "A100-80GB",
    "l40s": "L40S",
    "rtx-pro-6000": "RTX-PRO-6000",
    "rtx pro 6000": "RTX-PRO-6000",
    "rtx-pro-6000-blackwell": "RTX-PRO-6000",
    "rtxpro6000": "RTX-PRO-6000",
}


def lookup(name: str) -> GpuModel:
    key = name.strip().lower().removeprefix("nvidia ").replace("_", "-")
    if name in GPUS:
        return GPUS[name]
    if key in ALIASES:
        return GPUS[ALIASES[key]]
    for (
        alias,
        canonical,
    ) in ALIASES.items():  # NVML names: "NVIDIA H200", "NVIDIA RTX PRO 6000 Blackwell Server Edition"
        if alias in key.replace("-", " ") or alias.replace("-", " ") in key:
            return GPUS[canonical]
    raise PlanInputError(f"unknown GPU '{name}'; known: {', '.join(GPUS)}")
