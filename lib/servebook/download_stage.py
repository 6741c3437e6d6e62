"""Stage 02 glue: fetch (or build) the checkpoint, verify it, and record ``02_download.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from servebook import download, models, results, ui
from servebook.params import Params


def run(p: Params, run_dir: str | Path) -> dict[str, Any]:
    run_dir = results.run_folder(str(run_dir))
    if models.is_builtin(p.model):
        path = models.build_tiny_model()
        build = json.loads((path / "servebook-build.json").read_text())
        check = download.verify(path, expected_sha256=build["sha256"])
        data = {"source": "builtin", "model": p.model, "local_path": str(path), "revision": f"v{build['version']}",
                "commit": None, "fetch": {"fetched_files": [], "skipped_files": sorted(build["sha256"]), "bytes_fetched": 0,
                                          "seconds": 0.0, "rate_bytes_s": None},
                "bytes": sum((path / f).stat().st_size for f in build["sha256"]), "verification": check}
    elif Path(p.model).expanduser().is_dir():
        path = Path(p.model).expanduser().resolve()
        data = {"source": "local", "model": p.model, "local_path": str(path), "commit": None, "fetch": None,
                "bytes": download.dir_bytes(path), "verification": download.verify(path)}
    else:
        listing = download.list_files(p.model, p.download_revision, p.download_allow, p.download_ignore)
        target = download.local_dir_for(p.model_store, p.model)
        pre = download.preflight(listing, target, p.download_disk_margin)
        print(f"{listing.repo}@{listing.revision} (commit {listing.commit[:12]}): {len(listing.files)} files, "
              f"{listing.total_bytes / 1e9:,.2f} GB; {pre['files_present']} already complete; "
              f"{pre['bytes_to_fetch'] / 1e9:,.2f} GB to fetch, {pre['bytes_free'] / 1e9:,.0f} GB free")
        fetched = download.fetch(listing, target, p.download_workers, ui.download_progress(p.interactive))
        data = {"source": "hub", "model": p.model, "local_path": str(target), "revision": p.download_revision,
                "commit": listing.commit, "listing": download.listing_dict(listing), "preflight": pre, "fetch": fetched,
                "bytes": listing.total_bytes, "verification": download.verify(target, listing)}
    results.write(run_dir, "download", data)
    return data


def raise_on_failure(data: dict[str, Any]) -> None:
    if not data["verification"]["ok"]:
        raise download.VerificationFailed("the checkpoint failed verification:\n  - " + "\n  - ".join(data["verification"]["problems"]))
