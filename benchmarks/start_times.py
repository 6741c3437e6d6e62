"""Cold and warm starts of one checkpoint, per load strategy, phase by phase, beside the disk's own rate.

    python benchmarks/start_times.py PARAMS.yaml [--strategies default,prefetch,eager] [--out DIR] [--dry]

For each strategy: a cold start (the checkpoint's pages evicted with posix_fadvise, every compile cache empty:
a fresh VLLM_CACHE_ROOT for torch.compile's graphs and a fresh TRITON_CACHE_DIR for the kernels JIT-compiled
outside them, as on a machine that never ran vLLM; ``--keep-kernels`` keeps Triton's cache as this machine has
it), then a warm relaunch (page cache and compile caches as the cold start left them).  Before each start the plan's prediction is computed from what servebook knows at that moment (the
read probe, the page cache, its start history), so the prediction error is honest.  Prints one line per
start and writes ``start-times.json`` and every server log under ``--out``.  ``--dry`` adds a dry start
(``--load-format dummy``) with a warm compile cache.  On the CPU default it runs as is:
``.venv/bin/python benchmarks/start_times.py params/default.yaml --strategies default``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from servebook import hardware, loadpath, models, params, server, startup, vllm_compat
from servebook.errors import PreflightError
from servebook.loadpath import GB
from servebook.stages import launch as launch_stage


def one_start(cfg: server.ServerConfig, log_dir: Path, evidence: loadpath.CheckpointEvidence, label: str) -> dict:
    version = vllm_compat.vllm_version()
    key = startup.compile_key(cfg, version)
    now = loadpath.gather(cfg.model_path, probe=False)
    now.probe = evidence.probe  # the disk's rate, measured once; the page cache as it is now
    choice = loadpath.LoadChoice(load_strategy=cfg.load_strategy if cfg.load_strategy != "auto" else "default")
    loader = startup.loader_of(choice.load_strategy, list(cfg.extra_args), cfg.load_format)  # or the format's
    kernels = startup.kernels_warm()  # the machine has run vLLM since it booted, or Triton holds kernels
    predicted = startup.predict(
        now,
        startup.StartQuery(
            device=cfg.device, world_size=cfg.world_size, ep_ranks=1, choice=choice, vllm_version=version, key=key,
            model_path=cfg.model_path, enforce_eager=cfg.enforce_eager, kernels_cached=kernels, loader=loader,
        ),
    )  # fmt: skip
    started = time.monotonic()
    launch = server.launch(cfg, log_dir, stop_leftovers=True, log=lambda _: None)
    wall = time.monotonic() - started
    server.stop(port=cfg.port)
    tl = launch.timeline
    assert tl is not None
    if cfg.load_format != "dummy":
        entry = startup.entry_of(cfg, tl, version, float(now.bytes), now.cached_share, loader)
        startup.remember(entry.model_copy(update={"kernels_cached": kernels}))
    read_s = launch.values.weights_load_s
    row = {
        "start": label,
        "strategy": loader,
        "cached_before_pct": round(100 * now.cached_share, 1),
        "kernels_cached_before": kernels,
        "ready_s": tl.total_s,
        "launch_call_s": round(wall, 1),
        "phases": {p.name: p.seconds for p in tl.phases},
        "unaccounted_s": tl.unaccounted_s,
        "accounted_pct": round(100 * tl.accounted_share, 1),
        "compile_cache": tl.compile_cache,
        "weights_read_s": read_s,
        "read_gb_per_s": round(now.bytes / read_s / GB, 3) if read_s else None,
        "disk_gb_per_s": evidence.probe.gb_per_s if evidence.probe else None,
        "predicted_s": predicted.total_s,
        "prediction_error_pct": round(100 * (predicted.total_s - tl.total_s) / tl.total_s, 1),
        "prediction_limit": predicted.limit,
        "kv_cache_tokens": launch.values.kv_cache_tokens,
        "log": launch.log_path,
    }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params_file")
    ap.add_argument("--set", dest="set_", action="append", default=[], help="KEY=VALUE over the params")
    ap.add_argument("--strategies", default="default,prefetch")
    ap.add_argument("--out", default="outputs/start-times")
    ap.add_argument("--dry", action="store_true", help="also a dry start (--load-format dummy)")
    ap.add_argument("--probe-gb", type=float, default=4.0)
    ap.add_argument(
        "--keep-kernels", action="store_true", help="cold starts keep Triton's kernel cache (only vLLM's is emptied)"
    )
    args = ap.parse_args()
    p = params.load(Path(args.params_file), args.set_)
    device = hardware.resolve_device(p.device, hardware.inventory())
    base = server.ServerConfig.from_params(p, device)
    for strategy in args.strategies.split(","):  # what the launch stage refuses, refused before any start
        try:
            launch_stage.check_load_options(dataclasses.replace(base, load_strategy=strategy))
        except PreflightError as refused:
            raise SystemExit(f"start_times: {refused}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = loadpath.shard_files(base.model_path)
    evidence = loadpath.gather(base.model_path, probe=True, max_bytes=int(args.probe_gb * GB), max_s=20.0)
    print(f"checkpoint: {evidence.describe()}", flush=True)
    if evidence.probe:
        print(f"read probe: {evidence.probe.model_dump()}", flush=True)
    rows: list[dict] = []
    history = startup.history_path()
    saved_history = history.read_text() if history.exists() else None

    def save() -> None:
        (out / "start-times.json").write_text(
            json.dumps({"evidence": evidence.model_dump(), "starts": rows}, indent=2, default=str)
        )

    try:
        for strategy in args.strategies.split(","):
            cache = Path(tempfile.mkdtemp(prefix=f"vllm-cache-{strategy}-"))
            os.environ["VLLM_CACHE_ROOT"] = str(cache)  # empty: the cold start compiles
            if not args.keep_kernels:  # and JIT-compiles the kernels torch.compile does not own (custom MoE, MLA)
                os.environ["TRITON_CACHE_DIR"] = str(cache / "triton-kernels")
            cfg = dataclasses.replace(base, load_strategy=strategy)
            loader = startup.loader_of(strategy, list(cfg.extra_args), cfg.load_format)  # a format's, if set
            for temperature in ("cold", "warm"):
                if temperature == "cold":
                    loadpath.evict(files)
                label = f"{loader} {temperature}"
                row = one_start(cfg, out / label.replace(" ", "-"), evidence, label)
                rows.append(row)
                save()
                print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
            if args.dry and strategy == args.strategies.split(",")[0]:
                row = one_start(cfg.dry(), out / "dry", evidence, "dry (dummy weights, warm compile cache)")
                rows.append(row)
                save()
                print(json.dumps({k: v for k, v in row.items() if k != "log"}), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    finally:
        save()
        if saved_history is None:
            history.unlink(missing_ok=True)
        else:  # the benchmark's starts do not stay in the history a real run predicts from
            history.write_text(saved_history)
    print(
        f"{'start':<42}{'ready s':>9}{'pred s':>8}{'err %':>7}{'read s':>8}{'GB/s':>7}{'disk':>7}{'acct %':>7} compile"
    )
    for r in rows:
        print(
            f"{r['start']:<42}{r['ready_s']:>9.1f}{r['predicted_s']:>8.1f}{r['prediction_error_pct']:>7.1f}"
            f"{(r['weights_read_s'] or 0):>8.1f}{(r['read_gb_per_s'] or 0):>7.2f}{(r['disk_gb_per_s'] or 0):>7.2f}"
            f"{r['accounted_pct']:>7.1f} {r['compile_cache']}"
        )
    print(f"checkpoint {models.checkpoint_bytes(base.model_path)[0] / GB:.2f} GB")


if __name__ == "__main__":
    main()
