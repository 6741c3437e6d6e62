"""Stage 02: the checkpoint on local disk, fetched (or built) and verified file by file."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from servebook import download, loadpath, models, results, startup, ui
from servebook.errors import VerificationFailed
from servebook.params import Params
from servebook.records import DownloadRecord, PageCacheWarmup


def run(p: Params, run_dir: str | Path) -> DownloadRecord:
    run_dir = results.run_folder(run_dir)
    results.retire(run_dir, DownloadRecord)  # a rerun never leaves the last attempt's record looking current
    if models.is_builtin(p.model):
        path = models.build_tiny_model()
        build = json.loads((path / "servebook-build.json").read_text())
        record = DownloadRecord(
            source="builtin",
            model=p.model,
            local_path=str(path),
            revision=f"v{build['version']}",
            fetch=download.Fetched(
                fetched_files=[], skipped_files=sorted(build["sha256"]), bytes_fetched=0, seconds=0.0, rate_bytes_s=None
            ),
            bytes=sum((path / f).stat().st_size for f in build["sha256"]),
            verification=download.verify(path, expected_sha256=build["sha256"]),
        )
    elif Path(p.model).expanduser().is_dir():
        path = Path(p.model).expanduser().resolve()
        record = DownloadRecord(
            source="local",
            model=p.model,
            local_path=str(path),
            bytes=download.dir_bytes(path),
            verification=download.verify(path),
        )
    else:
        listing = download.list_files(p.model, p.download_revision, p.download_allow, p.download_ignore)
        target = download.local_dir_for(p.model_store, p.model)
        pre = download.preflight(listing, target, p.download_disk_margin)
        print(
            f"{listing.repo}@{listing.revision} (commit {listing.commit[:12]}): {len(listing.files)} files, "
            f"{listing.total_bytes / 1e9:,.2f} GB; {pre.files_present} already complete; "
            f"{pre.bytes_to_fetch / 1e9:,.2f} GB to fetch, {pre.bytes_free / 1e9:,.0f} GB free"
        )
        fetched = download.fetch(listing, target, p.download_workers, ui.download_progress(p.interactive))
        record = DownloadRecord(
            source="hub",
            model=p.model,
            local_path=str(target),
            revision=p.download_revision,
            commit=listing.commit,
            listing=download.listing_info(listing),
            preflight=pre,
            fetch=fetched,
            bytes=listing.total_bytes,
            verification=download.verify(target, listing),
        )
    if record.verification.ok:
        record.page_cache = warm_page_cache(Path(record.local_path), p.page_cache_warmup, p.load_format)
    results.write(run_dir, record)
    return record


def warm_page_cache(path: Path, wanted: bool, load_format: str = "auto") -> PageCacheWarmup:
    """Read what verification left out of the page cache, when RAM holds the checkpoint with room to spare, so
    the first start reads from memory."""
    shards = loadpath.shard_files(path)
    size = sum(f.stat().st_size for f in shards)
    if not wanted:
        return PageCacheWarmup(done=False, why_not="page_cache_warmup is false")
    if load_format in startup.DIRECT_IO_LOADERS:
        return PageCacheWarmup(
            done=False, why_not=f"load_format {load_format} reads the disk with O_DIRECT, past the page cache"
        )
    if not shards:
        return PageCacheWarmup(done=False, why_not="no .safetensors files")
    available = loadpath.mem_available()
    cached = sum(loadpath.cached_bytes(f) for f in shards)
    if available + cached < 1.1 * size:
        return PageCacheWarmup(
            done=False,
            why_not=f"RAM ({available / 1e9:.0f} GB available) cannot hold the checkpoint ({size / 1e9:.0f} GB) "
            "beside the server: every start reads the disk",
        )
    read, seconds = loadpath.warm_up(shards)
    after = sum(loadpath.cached_bytes(f) for f in shards)
    return PageCacheWarmup(
        done=True,
        bytes_read=read,
        seconds=round(seconds, 2),
        cached_after_pct=round(100 * after / size, 1) if size else None,
    )


def check(record: DownloadRecord, p: Params) -> None:
    if not record.verification.ok:
        raise VerificationFailed(
            "the checkpoint failed verification:\n  - " + "\n  - ".join(record.verification.problems)
        )


def summary(record: DownloadRecord) -> str:
    verdict = (
        "verified"
        if record.verification.ok
        else f"**verification failed** ({len(record.verification.problems)} problems)"
    )
    fetched = ""
    if record.fetch and record.fetch.fetched_files:
        fetched = f", fetched {record.fetch.bytes_fetched / 1e9:,.2f} GB in {record.fetch.seconds:.0f} s"
    return f"`{record.local_path}` ({record.bytes / 1e9:,.3f} GB, {record.source}){fetched}; {verdict}"


def file_table(record: DownloadRecord) -> pd.DataFrame:
    return pd.DataFrame(sorted(record.verification.files.items()), columns=["file", "check"])
