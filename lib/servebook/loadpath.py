"""What a start will read and how fast this machine reads it, and the load path vLLM should take.

Before a launch: the checkpoint's bytes, shards and tensors (from the safetensors headers), the filesystem
under it (vLLM's own rule: the longest ``/proc/mounts`` prefix), MemAvailable, how much of it is already in
the page cache (``mincore``, what ``fincore`` reports) and the disk's sequential read rate measured on the
checkpoint's own files, cold (their pages evicted with ``posix_fadvise(DONTNEED)`` first), bounded in bytes
and seconds.  From that evidence :func:`recommend` chooses vLLM's load options; :func:`option_problems`
refuses the ones the installed vLLM cannot take, before anything starts.

Facts behind the rules are in ``docs/architecture.md`` (load path) with vLLM's source paths: the default
loader has every rank read every tensor (vllm/model_executor/model_loader/weight_utils.py); vLLM prefetches
by itself only on nfs/nfs4/lustre with the checkpoint under 90 % of RAM; the EP weight filter
(``--enable-ep-weight-filter``) skips only names ending in ``.weight`` before vLLM 0.28 (#49558).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib.util
import json
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from servebook import units, vllm_compat

GB = 1e9
# vLLM's auto-prefetch covers these (weight_utils.py); the others are network or virtual filesystems where
# mmap's random page faults are slow and vLLM does not prefetch by itself (#47412, #52931, #51339)
VLLM_PREFETCH_FS = {"nfs", "nfs4", "lustre"}
NETWORK_FS = VLLM_PREFETCH_FS | {"ceph", "cifs", "smb3", "9p", "virtiofs", "fuse.sshfs", "glusterfs", "beegfs", "gpfs"}
STRATEGIES = ("auto", "default", "lazy", "eager", "prefetch")
# load format -> the package it needs beside vLLM (None: vLLM's own)
FORMATS: dict[str, str | None] = {
    "auto": None,
    "safetensors": None,
    "dummy": None,
    "fastsafetensors": "fastsafetensors",
    "instanttensor": "instanttensor",
    "runai_streamer": "runai_model_streamer",
}
EP_FILTER_PACKED_SINCE = (0, 28)  # the EP filter skips INT4 ``.weight_packed`` experts from vLLM 0.28 on
PREFETCH_SINCE = (0, 18)  # --safetensors-load-strategy prefetch (PR #36012); 0.25 has it
PROBE_BLOCK = 16 * 1024 * 1024


class ReadProbe(BaseModel):
    """A sequential read of the checkpoint's own files, after evicting their pages (cold) and again (warm)."""

    bytes_read: int = 0
    seconds: float = 0.0
    gb_per_s: float | None = None  # the disk's rate (cold)
    cold: bool = False  # the pages were out of the page cache when the read began
    cached_before_pct: float | None = None  # of the probed bytes, after the eviction
    warm_gb_per_s: float | None = None  # the same bytes again, from the page cache
    error: str = ""


class CheckpointEvidence(BaseModel):
    """What the load will read and what this machine offers it."""

    path: str
    bytes: int = 0
    shards: int = 0
    tensors: int = 0
    expert_tensors: int = 0
    packed_expert_tensors: int = 0  # INT4 ``.weight_packed`` (and friends) the pre-0.28 EP filter keeps reading
    filesystem: str = ""
    mount_point: str = ""
    mem_available_bytes: int = 0
    cached_bytes: int | None = None  # in the page cache now (mincore)
    probe: ReadProbe | None = None
    error: str = ""

    @property
    def network_filesystem(self) -> bool:
        return self.filesystem.lower() in NETWORK_FS

    @property
    def cached_share(self) -> float:
        return (self.cached_bytes or 0) / self.bytes if self.bytes else 0.0

    @property
    def fits_in_ram(self) -> bool:
        return self.mem_available_bytes >= 1.1 * self.bytes

    def describe(self) -> str:
        rate = f"{self.probe.gb_per_s:.2f} GB/s" if self.probe and self.probe.gb_per_s else "not measured"
        return (
            f"{units.size(self.bytes)} in {self.shards} shard{'s' if self.shards != 1 else ''} ({self.tensors:,} tensors) "
            f"on {self.filesystem or '?'}; {self.cached_share:.0%} in the page cache; "
            f"MemAvailable {units.size(self.mem_available_bytes)}; "
            f"disk read {rate}"
        )


def shard_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def safetensors_names(file: Path) -> list[str]:
    """The tensor names in one shard's header: 8 bytes of length, then JSON."""
    with open(file, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return [name for name in header if name != "__metadata__"]


def filesystem_of(path: str | Path) -> tuple[str, str]:
    """(type, mount point) of the longest /proc/mounts prefix of the real path, as vLLM reads it."""
    real = os.path.realpath(path)
    best = ("", "")
    with contextlib.suppress(OSError), open("/proc/mounts") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1].replace("\\040", " ")
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[1]):
                best = (parts[2], mount)
    return best


def mem_available() -> int:
    with contextlib.suppress(OSError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_bytes(file: Path, length: int | None = None) -> int:
    """Bytes of the file (its first ``length``) resident in the page cache, from mincore over a shared mapping."""
    size = file.stat().st_size if length is None else min(length, file.stat().st_size)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(file, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {file} failed")
        try:
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore on {file} failed")
            resident = sum(b & 1 for b in vec.raw)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * page)


def evict(files: list[Path]) -> None:
    """Drop the files' clean pages from the page cache (what a cold start finds)."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read(files: list[Path], max_bytes: int, max_s: float) -> tuple[int, float]:
    done, start = 0, time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as fh:
            while done < max_bytes and time.perf_counter() - start < max_s:
                chunk = fh.read(min(PROBE_BLOCK, max_bytes - done))
                if not chunk:
                    break
                done += len(chunk)
        if done >= max_bytes or time.perf_counter() - start >= max_s:
            break
    return done, time.perf_counter() - start


def probe_read(files: list[Path], max_bytes: int = 2 * 10**9, max_s: float = 10.0) -> ReadProbe:
    """The disk's sequential rate on these files, cold, then the same bytes warm; bounded in bytes and time.

    Reading leaves the probed bytes in the page cache, as any read does: a cold benchmark evicts again."""
    if not files:
        return ReadProbe(error="no .safetensors files to read")
    try:
        evict(files)
        cached = sum(cached_bytes(f, max_bytes) for f in files[:4])
        probed = sum(min(f.stat().st_size, max_bytes) for f in files[:4])
        done, seconds = _read(files, max_bytes, max_s)
        warm_done, warm_s = _read(files, done, max_s)
    except OSError as exc:
        return ReadProbe(error=f"the read probe could not read the checkpoint: {exc}")
    share = cached / probed if probed else 0.0
    return ReadProbe(
        bytes_read=done,
        seconds=round(seconds, 3),
        gb_per_s=round(done / seconds / GB, 3) if seconds > 0 and done else None,
        cold=share < 0.05,
        cached_before_pct=round(100 * share, 1),
        warm_gb_per_s=round(warm_done / warm_s / GB, 3) if warm_s > 0 and warm_done else None,
    )


def gather(path: str | Path, probe: bool = True, max_bytes: int = 2 * 10**9, max_s: float = 10.0) -> CheckpointEvidence:
    """Everything above for a local checkpoint folder; a folder that cannot be read says so and the run goes on."""
    files = shard_files(path)
    evidence = CheckpointEvidence(path=str(path), mem_available_bytes=mem_available())
    evidence.filesystem, evidence.mount_point = filesystem_of(path)
    if not files:
        evidence.error = f"no .safetensors files in {path}"
        return evidence
    try:
        names = [n for f in files for n in safetensors_names(f)]
        evidence.bytes = sum(f.stat().st_size for f in files)
        evidence.cached_bytes = sum(cached_bytes(f) for f in files)
    except (OSError, ValueError, struct.error) as exc:
        evidence.error = f"the checkpoint's headers could not be read: {exc}"
        return evidence
    evidence.shards, evidence.tensors = len(files), len(names)
    experts = [n for n in names if ".experts." in n]
    evidence.expert_tensors = len(experts)
    evidence.packed_expert_tensors = sum(1 for n in experts if not n.endswith(".weight"))
    if probe:
        before = evidence.cached_bytes
        evidence.probe = probe_read(files, max_bytes, max_s)
        if before:  # the probe evicted what was cached; restore the warm state it found for the probed files
            warm_up(files, limit_bytes=min(before, max_bytes))
    return evidence


def warm_up(files: list[Path], limit_bytes: int | None = None, budget_s: float = 600.0) -> tuple[int, float]:
    """Read the files into the page cache (after a download's verification, when RAM allows)."""
    return _read(files, limit_bytes if limit_bytes is not None else sum(f.stat().st_size for f in files), budget_s)


# ---------------------------------------------------------------- the load path


class LoadChoice(BaseModel):
    """vLLM's load options for one launch, with the evidence that chose them."""

    load_strategy: Literal["default", "lazy", "eager", "prefetch"] = "default"
    load_format: str = "auto"
    ep_weight_filter: bool = False
    reasons: list[str] = []

    def flags(self) -> list[str]:
        out = []
        if self.load_format != "auto":
            out += ["--load-format", self.load_format]
        if self.load_strategy != "default":
            out += ["--safetensors-load-strategy", self.load_strategy]
        if self.ep_weight_filter:
            out.append("--enable-ep-weight-filter")
        return out


def _version(text: str | None) -> tuple[int, int]:
    try:
        major, minor = (text or "0.0").split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


def ep_filter_skips(evidence: CheckpointEvidence | None, vllm_version: str | None) -> bool:
    """Whether the installed vLLM's EP filter skips this checkpoint's expert tensors (before 0.28 it skips only
    ``.weight`` names, so INT4 ``.weight_packed`` experts are read by every rank anyway)."""
    if evidence is None or not evidence.expert_tensors:
        return False
    return not evidence.packed_expert_tensors or _version(vllm_version) >= EP_FILTER_PACKED_SINCE


def recommend(
    evidence: CheckpointEvidence | None,
    *,
    expert_parallel: bool,
    vllm_version: str | None,
    disk_floor_share: float = 0.5,
) -> LoadChoice:
    """The rule table: network or virtual filesystem -> prefetch; RAM below the checkpoint -> a loader that reads
    each byte once (fastsafetensors or instanttensor where installed, else prefetch); EP -> the weight filter where
    it skips this checkpoint's expert tensors.  Without evidence, vLLM's defaults."""
    choice = LoadChoice()
    if evidence is None or evidence.error or not evidence.bytes:
        choice.reasons.append("no checkpoint evidence: vLLM's default load path")
        return choice
    if evidence.network_filesystem and evidence.filesystem.lower() not in VLLM_PREFETCH_FS:
        choice.load_strategy = "prefetch"
        choice.reasons.append(
            f"{evidence.filesystem} is a network or virtual filesystem vLLM does not prefetch on: mmap page faults "
            "there read far below the link's rate; prefetch reads each file once, in large blocks"
        )
    elif evidence.network_filesystem:
        choice.load_strategy = "prefetch"
        choice.reasons.append(
            f"{evidence.filesystem}: vLLM would prefetch only while the checkpoint fits 90 % of RAM; say so always"
        )
    if not evidence.fits_in_ram:
        # fastsafetensors first: it read the H200's disk at 1.1-1.9 x the probe's rate, instanttensor at 1.03 x
        once = next((f for f in ("fastsafetensors", "instanttensor") if format_installed(f)), None)
        if once:
            choice.load_format = once
            choice.reasons.append(
                f"RAM ({evidence.mem_available_bytes / GB:.0f} GB available) is below the checkpoint "
                f"({evidence.bytes / GB:.0f} GB): every start reads the disk; {once} reads each byte once, with "
                "many reads in flight, past the page cache"
            )
        else:
            choice.load_strategy = "prefetch"
            choice.reasons.append(
                f"RAM ({evidence.mem_available_bytes / GB:.0f} GB available) is below the checkpoint "
                f"({evidence.bytes / GB:.0f} GB) and no single-read loader is installed: prefetch spreads the files "
                "over the ranks so the disk is read once in total"
            )
    probe = evidence.probe
    slow = probe and probe.gb_per_s and probe.warm_gb_per_s and probe.gb_per_s < disk_floor_share * probe.warm_gb_per_s
    if choice.load_strategy == "default" and slow and evidence.network_filesystem:
        choice.load_strategy = "prefetch"
    if expert_parallel:
        if ep_filter_skips(evidence, vllm_version):
            choice.ep_weight_filter = True
            choice.reasons.append("expert parallel: the EP weight filter skips the experts of other ranks unread")
        elif evidence.expert_tensors:
            choice.reasons.append(
                f"expert parallel, but vLLM {vllm_version}'s EP filter skips only '.weight' names and "
                f"{evidence.packed_expert_tensors:,} expert tensors are packed INT4: every rank reads them (0.28+ skips)"
            )
    if not choice.reasons:
        choice.reasons.append(
            f"local {evidence.filesystem or 'disk'} with RAM above the checkpoint: vLLM's default mmap loader, and "
            "a relaunch reads from the page cache (fastsafetensors and instanttensor read past it, with O_DIRECT: "
            "their relaunches read the disk again)"
        )
    return choice


def format_installed(load_format: str) -> bool:
    package = FORMATS.get(load_format)
    return package is None or importlib.util.find_spec(package) is not None


def option_problems(load_strategy: str, load_format: str, ep_weight_filter: str, *, expert_parallel: bool) -> list[str]:
    """Load options the installed vLLM cannot take, each naming the parameter, the version and the fix."""
    version = vllm_compat.vllm_version()
    problems = []
    if load_format not in FORMATS:
        problems.append(
            f"load_format '{load_format}' is not one servebook knows for vLLM {version}; use one of "
            f"{', '.join(FORMATS)}"
        )
    elif not format_installed(load_format):
        problems.append(
            f"load_format '{load_format}' needs the package {FORMATS[load_format]}, which is not installed beside "
            f"vLLM {version}; pip install {FORMATS[load_format]} or set load_format: auto"
        )
    if load_strategy not in STRATEGIES:
        problems.append(f"load_strategy '{load_strategy}' is not one of {', '.join(STRATEGIES)}")
    elif load_strategy == "prefetch" and _version(version) < PREFETCH_SINCE:
        problems.append(
            f"load_strategy prefetch needs vLLM 0.18 or later; vLLM {version} is installed: set load_strategy: eager"
        )
    if load_strategy not in ("auto", "default") and load_format not in ("auto", "safetensors"):
        problems.append(
            f"load_strategy {load_strategy} applies to vLLM's safetensors loader, not load_format {load_format}; "
            "set one of them to auto"
        )
    if ep_weight_filter == "on" and not expert_parallel:
        problems.append("ep_weight_filter: on needs enable_expert_parallel: true (vLLM filters only under EP)")
    return problems
