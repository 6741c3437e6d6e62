"""Launch, reject and stop times on the embedded default; prints one line per figure.

    .venv/bin/python benchmarks/launch_times.py [--port 8161]

Measures: launch to ready with torch.compile from a cold and a warm compile cache and
with --enforce-eager; the time to reject a misspelled flag with and without servebook's
cached copy of vLLM's option list; the time to stop a server and verify nothing is left.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from servebook import params, server, vllm_compat
from servebook.errors import PreflightError


def cfg(port: int, **kw) -> server.ServerConfig:
    values = dict(
        model="builtin:tiny-qwen3-moe", served_model_name="", port=port, max_model_len=2048, cpu_kv_cache_gib=1
    )
    values.update(kw)
    return server.ServerConfig.from_params(params.Params(**values), "cpu")


def timed_launch(c: server.ServerConfig, log_dir: Path) -> tuple[float, float, float]:
    """(seconds from launch() to ready, of which preflight, seconds to stop and verify)."""
    start = time.monotonic()
    launched = server.launch(c, log_dir, log=lambda _: None)
    ready = time.monotonic() - start
    t = time.monotonic()
    outcome = server.stop(port=c.port)
    stop_s = time.monotonic() - t
    assert not outcome.remaining, outcome
    return ready, launched.preflight.seconds, stop_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8161)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="servebook-launch-"))
    rows = []
    cache_root = work / "vllm-cache"
    os.environ["VLLM_CACHE_ROOT"] = str(cache_root)  # a cold torch.compile cache, then warm
    for label, kw in (
        ("compiled, cold compile cache", {}),
        ("compiled, warm compile cache", {}),
        ("--enforce-eager", {"enforce_eager": True}),
    ):
        ready, pre, stop_s = timed_launch(cfg(args.port, **kw), work / label.replace(" ", "_").replace(",", ""))
        rows.append((f"launch to ready, {label}", ready, f"preflight {pre:.1f} s"))
        rows.append((f"stop and verify, {label}", stop_s, ""))
    cache = vllm_compat._cache_file()
    saved = cache.read_text() if cache.is_file() else None
    bad = cfg(args.port, extra_args=["--enable-pcie-oneshot-allreduce"])
    for label in ("no cached option list", "cached option list"):
        if label.startswith("no") and cache.is_file():
            cache.unlink()
        t = time.monotonic()
        try:
            server.launch(bad, work / "bad", log=lambda _: None)
        except PreflightError:
            pass
        rows.append((f"misspelled flag rejected, {label}", time.monotonic() - t, ""))
    if saved is not None and not cache.is_file():
        cache.write_text(saved)
    shutil.rmtree(work, ignore_errors=True)
    print(f"{'figure':55} {'seconds':>8}")
    for name, seconds, note in rows:
        print(f"{name:55} {seconds:8.1f}  {note}")


if __name__ == "__main__":
    main()
