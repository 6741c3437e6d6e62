"""Wall time of README's main job, per stage: runs `servebook run PARAMS` and prints the manifest's timings,
then one bare start of the same server (launch to /health, then stop) and the job's time in such starts.

.venv/bin/python benchmarks/main_job_times.py [params/default.yaml] [--set KEY=VALUE ...]
.venv/bin/python benchmarks/main_job_times.py --run-dir outputs/<run>   # the figures of a run already made
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from servebook.results import Manifest


def bare_start_s(params_path: str, sets: list[str]) -> float:
    """Seconds from launch to a ready server for the params' own server, alone; stopped after."""
    import tempfile

    from servebook import hardware, params, server

    p = params.load(params_path, sets)
    cfg = server.ServerConfig.from_params(p, hardware.resolve_device(p.device, hardware.inventory()))
    with tempfile.TemporaryDirectory() as logs:
        started = time.monotonic()
        server.launch(cfg, logs, log=lambda _line: None)
        ready = time.monotonic() - started
        server.stop(port=cfg.port)
    return ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("params", nargs="?", default="params/default.yaml")
    ap.add_argument("--set", action="append", default=[], help="override one parameter, KEY=VALUE")
    ap.add_argument("--run-dir", type=Path, help="report on this run folder instead of running the job")
    args = ap.parse_args()
    wall = None
    run_dir = args.run_dir
    if run_dir is None:
        started = time.monotonic()
        sets = [x for s in args.set for x in ("--set", s)]
        proc = subprocess.run(
            [sys.executable, "-m", "servebook.cli", "run", args.params, *sets], stdout=subprocess.PIPE, text=True
        )
        wall = time.monotonic() - started
        run_dir = Path(proc.stdout.strip().splitlines()[-1])
    manifest = Manifest.model_validate_json((run_dir / "manifest.json").read_text())
    print(f"{'stage':20} {'status':8} {'seconds':>8}")
    for stage in manifest.stages:
        print(f"{stage.name:20} {stage.status:8} {stage.seconds:8.1f}")
    print(f"{'stages together':29} {manifest.seconds:8.1f}")
    if wall is not None:
        print(f"{'whole command':29} {wall:8.1f}  (with Python start-up, validation and the report)")
    if wall is not None:
        bare = bare_start_s(args.params, args.set)
        print(f"{'one bare vLLM start':29} {bare:8.1f}  (the same server, launched and stopped alone)")
        print(f"{'the job in bare starts':29} {wall / bare:8.1f}")
    report = run_dir / "report.html"
    if report.is_file():
        print(f"report: {report} ({report.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
