"""Checkpoint downloads through huggingface_hub: disk preflight, progress, resume, verification.

The token comes only from the environment (``HF_TOKEN``, read by huggingface_hub itself)
and never appears in parameters, logs or results.  Files already complete on disk (size
and checksum match the hub's metadata) are skipped; partial files are resumed by
huggingface_hub.  Every file is then verified: its size, its SHA-256 for LFS files or its
git blob id otherwise, safetensors headers against their data and the index, and the
presence of ``config.json`` and a tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from servebook.errors import DownloadError, InsufficientDisk
from servebook.json_types import JsonObject

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


@dataclass
class RemoteFile:
    path: str
    size: int
    blob_id: str | None = None  # git blob sha1 (non-LFS files)
    sha256: str | None = None  # LFS files


@dataclass
class Listing:
    repo: str
    revision: str
    commit: str
    files: list[RemoteFile]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _api():
    from huggingface_hub import HfApi

    return HfApi()  # HF_ENDPOINT and HF_TOKEN come from the environment


def list_files(
    repo: str, revision: str = "main", allow: list[str] | None = None, ignore: list[str] | None = None
) -> Listing:
    """The files a download would fetch, with sizes and checksums, and the commit the revision resolves to."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    from servebook import hub

    hub.require(f"listing {repo}@{revision}")
    api = _api()
    try:
        info = api.model_info(repo, revision=revision)
        tree = list(api.list_repo_tree(repo, revision=revision, recursive=True, expand=True))
    except RevisionNotFoundError:
        raise DownloadError(
            f"revision '{revision}' does not exist in {repo}; set download_revision to a branch, tag or commit "
            "that exists"
        ) from None
    except RepositoryNotFoundError:
        if revision != "main" and _exists(api, repo):  # some mirrors answer an unknown revision as an unknown repo
            raise DownloadError(
                f"revision '{revision}' does not exist in {repo}; set download_revision to a branch, tag "
                "or commit that exists"
            ) from None
        raise DownloadError(
            f"repository '{repo}' was not found (or is gated and HF_TOKEN is not set); check model"
        ) from None
    except Exception as exc:
        raise DownloadError(f"could not list {repo}@{revision}: {type(exc).__name__}: {exc}") from None
    files = []
    for item in tree:
        if (
            not hasattr(item, "size")
            or getattr(item, "type", "file") == "directory"
            or item.__class__.__name__ == "RepoFolder"
        ):
            continue
        lfs = getattr(item, "lfs", None)
        files.append(
            RemoteFile(
                item.path, int(item.size), getattr(item, "blob_id", None), getattr(lfs, "sha256", None) if lfs else None
            )
        )
    keep = set(
        filter_repo_objects([f.path for f in files], allow_patterns=allow or None, ignore_patterns=ignore or None)
    )
    return Listing(repo, revision, info.sha or revision, [f for f in files if f.path in keep])


def _exists(api, repo: str) -> bool:
    try:
        api.model_info(repo, revision="main")
        return True
    except Exception:
        return False


def git_blob_id(path: Path) -> str:
    h = hashlib.sha1()
    h.update(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(8 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_ok(local: Path, remote: RemoteFile, checksum: bool = True) -> str:
    """'' when the local file matches the hub's metadata, else what is wrong."""
    if not local.is_file():
        return "missing"
    size = local.stat().st_size
    if size != remote.size:
        return f"size {size:,} B, expected {remote.size:,} B ({'truncated' if size < remote.size else 'too long'})"
    if not checksum:
        return ""
    if remote.sha256:
        got = sha256(local)
        return "" if got == remote.sha256 else f"SHA-256 {got[:12]}…, expected {remote.sha256[:12]}…"
    if remote.blob_id:
        got = git_blob_id(local)
        return "" if got == remote.blob_id else f"git blob {got[:12]}…, expected {remote.blob_id[:12]}…"
    return ""


class Preflight(BaseModel):
    files: int
    bytes_total: int
    files_present: int
    bytes_to_fetch: int
    bytes_required_with_margin: int
    bytes_free: int
    margin: float


class Fetched(BaseModel):
    fetched_files: list[str]
    skipped_files: list[str]
    bytes_fetched: int
    seconds: float
    rate_bytes_s: float | None


class Verification(BaseModel):
    ok: bool
    problems: list[str]
    files: dict[str, str]  # file -> "ok" or what is wrong
    tensor_bytes: int
    checked_bytes: int
    seconds: float
    seconds_per_gb: float | None


class ListingInfo(BaseModel):
    repo: str
    revision: str
    commit: str
    files: list[RemoteFile]
    bytes: int


def preflight(listing: Listing, target: Path, margin: float = 0.05) -> Preflight:
    """Bytes still to fetch against free space at the target; raises before any byte is fetched."""
    from servebook.environment import existing_parent

    present = [f for f in listing.files if (target / f.path).is_file() and (target / f.path).stat().st_size == f.size]
    todo = [f for f in listing.files if f not in present]
    need = sum(f.size for f in todo)
    free = shutil.disk_usage(existing_parent(target)).free
    required = int(need * (1 + margin))
    result = Preflight(
        files=len(listing.files),
        bytes_total=listing.total_bytes,
        files_present=len(present),
        bytes_to_fetch=need,
        bytes_required_with_margin=required,
        bytes_free=free,
        margin=margin,
    )
    if required > free:
        raise InsufficientDisk(
            f"{target} has {free / 1e9:,.2f} GB free but the download needs {need / 1e9:,.2f} GB "
            f"({required / 1e9:,.2f} GB with a {margin:.0%} margin); free space or set model_store to a larger disk"
        )
    return result


def dir_bytes(path: Path) -> int:
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(root, n))
            except OSError:
                pass
    return total


class Progress:
    """Bytes done, rate and time left, read from the disk every ``every_s`` seconds."""

    def __init__(self, target: Path, total: int, report: Callable[[dict[str, float]], None], every_s: float = 5.0):
        self.target, self.total, self.report, self.every_s = target, total, report, every_s
        self.start_bytes = dir_bytes(target) if target.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.started = time.monotonic()

    def snapshot(self) -> dict[str, float]:
        done = max(0, dir_bytes(self.target) - self.start_bytes) if self.target.exists() else 0
        elapsed = time.monotonic() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        left = max(0.0, self.total - done) / rate if rate > 0 else float("inf")
        return {
            "bytes_done": done,
            "bytes_total": self.total,
            "elapsed_s": elapsed,
            "rate_bytes_s": rate,
            "eta_s": left,
        }

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.report(self.snapshot())

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def fetch(
    listing: Listing,
    target: Path,
    workers: int = 8,
    on_progress: Callable[[dict[str, float]], None] | None = None,
    progress_every_s: float = 5.0,
) -> Fetched:
    """Fetch every file not already complete (resuming partial ones); returns what was fetched and how fast."""
    from huggingface_hub import hf_hub_download

    target.mkdir(parents=True, exist_ok=True)
    todo = [f for f in listing.files if file_ok(target / f.path, f, checksum=False)]
    skipped = [f.path for f in listing.files if f not in todo]
    need = sum(f.size for f in todo)
    started = time.monotonic()
    report = on_progress or (lambda s: None)
    with Progress(target, need, report, progress_every_s) as progress:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers))
        try:
            # A file on disk with the wrong size is refetched whole; a missing one may resume from a partial download.
            futures = {
                pool.submit(
                    hf_hub_download,
                    listing.repo,
                    f.path,
                    revision=listing.commit,
                    local_dir=str(target),
                    force_download=(target / f.path).exists(),
                ): f
                for f in todo
            }
            errors = []
            for fut in concurrent.futures.as_completed(futures):
                try:
                    fut.result()
                except Exception as exc:
                    errors.append(f"{futures[fut].path}: {type(exc).__name__}: {exc}")
        except KeyboardInterrupt:
            # an interrupt must not wait for the files in flight (hours of a large checkpoint): they resume next run
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        final = progress.snapshot()
    report(final)
    if errors:
        raise DownloadError("some files failed to download (rerun to resume):\n  - " + "\n  - ".join(errors))
    seconds = time.monotonic() - started
    return Fetched(
        fetched_files=[f.path for f in todo],
        skipped_files=skipped,
        bytes_fetched=need,
        seconds=seconds,
        rate_bytes_s=need / seconds if seconds > 0 else None,
    )


def safetensors_tensor_bytes(path: Path) -> tuple[int, JsonObject]:
    """Tensor bytes a safetensors file declares; raises ValueError when the header and the data disagree."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"header length {n:,} exceeds the file")
        header = json.loads(fh.read(n))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + n + end != size:
        raise ValueError(f"tensors end at byte {8 + n + end:,} but the file has {size:,}")
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for v in tensors.values()), tensors


def _check_shards(target: Path, problems: list[str]) -> int:
    """The tensor bytes of every safetensors shard, each shard's header and the index checked (problems added)."""
    tensor_bytes = 0
    for st in sorted(target.glob("*.safetensors")):
        try:
            n, _ = safetensors_tensor_bytes(st)
            tensor_bytes += n
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            problems.append(f"{st.name}: unreadable safetensors ({exc}); delete it and download again")
    index = target / "model.safetensors.index.json"
    if not index.is_file():
        return tensor_bytes
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        data = {}
        problems.append(f"model.safetensors.index.json: not readable JSON ({exc}); download it again")
    missing = sorted({f for f in data.get("weight_map", {}).values() if not (target / f).is_file()})
    if missing:
        problems.append(f"model.safetensors.index.json names missing shards {missing[:5]}; download them")
    declared = data.get("metadata", {}).get("total_size")
    if declared and not missing and abs(declared - tensor_bytes) > 0:
        problems.append(f"the index declares {declared:,} B of tensors but the shards hold {tensor_bytes:,} B")
    return tensor_bytes


def verify(target: Path, listing: Listing | None = None, expected_sha256: dict[str, str] | None = None) -> Verification:
    """Check every file; returns per-file outcomes and problems (each naming the file and the fix)."""
    started = time.monotonic()
    problems: list[str] = []
    checked_bytes = 0
    files = {}
    if listing:
        for f in listing.files:
            issue = file_ok(target / f.path, f)
            checked_bytes += f.size if (target / f.path).is_file() else 0
            files[f.path] = issue or "ok"
            if issue:
                problems.append(f"{f.path}: {issue}; delete it and run the download again (complete files are kept)")
    for name, digest in (expected_sha256 or {}).items():
        path = target / name
        got = sha256(path) if path.is_file() else None
        checked_bytes += path.stat().st_size if path.is_file() else 0
        files[name] = "ok" if got == digest else ("missing" if got is None else "checksum mismatch")
        if got != digest:
            problems.append(f"{name}: {files[name]}; rebuild with `servebook build-model --force`")
    tensor_bytes = _check_shards(target, problems)
    if not (target / "config.json").is_file():
        problems.append("config.json is missing; vLLM cannot load the model without it")
    if not any((target / t).is_file() for t in TOKENIZER_FILES):
        problems.append(f"no tokenizer ({', '.join(TOKENIZER_FILES)}); include it in download_allow")
    seconds = time.monotonic() - started
    return Verification(
        ok=not problems,
        problems=problems,
        files=files,
        tensor_bytes=tensor_bytes,
        checked_bytes=checked_bytes,
        seconds=seconds,
        seconds_per_gb=seconds / (checked_bytes / 1e9) if checked_bytes else None,
    )


def local_dir_for(model_store: str, repo: str) -> Path:
    return Path(model_store).expanduser() / repo


def listing_info(listing: Listing) -> ListingInfo:
    return ListingInfo(
        repo=listing.repo,
        revision=listing.revision,
        commit=listing.commit,
        files=listing.files,
        bytes=listing.total_bytes,
    )
