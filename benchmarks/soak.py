"""Hold one level at saturation for a long time and print what drifts: errors, throughput, server memory.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--concurrency 16] [--window-s 30] [--port 8162]

Launches the embedded default (or ``--params FILE``), then sends back-to-back windows of ``--concurrency``
streams for ``--minutes``. Each window prints its output tok/s, its failed requests and the server's resident
memory (every process of its group; on a GPU server, NVML's used memory as well). The summary compares the last
three windows with the first three: throughput drift in percent, memory growth in MB, errors in all. The server is
stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from servebook import hardware, loadgen, metrics, params, runner, server


def resident_mb(pgid: int) -> float:
    total = 0
    for proc in server.group_members(pgid):
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total / 1e6


def gpu_used_mb(gpu_ids: list[int]) -> float | None:
    if not gpu_ids:
        return None
    inv = hardware.inventory()
    return sum(g.memory_used for g in inv.gpus if g.index in gpu_ids) / 1e6 if inv.available else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=str(Path(__file__).resolve().parents[1] / "params" / "ci.yaml"))
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16, help="the level to hold (at or past the plateau)")
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--port", type=int, default=8162)
    args = ap.parse_args()
    p = params.load(args.params, [f"port={args.port}"])
    cfg = server.ServerConfig.from_params(p, p.device if p.device != "auto" else "cpu")
    rows: list[tuple[float, int, float, float | None]] = []
    with runner.interrupt_on_signals():  # SIGTERM too stops the server this script started
        launched = server.launch(cfg, Path(tempfile.mkdtemp(prefix="servebook-soak-")), log=lambda _: None)
        try:
            _soak(args, p, launched, rows)
        finally:
            server.stop(port=cfg.port)
    _summary(rows)


def _soak(args: argparse.Namespace, p: params.Params, launched: server.Launch, rows: list) -> None:
    """Back-to-back windows at one concurrency until the minutes are up, one row of figures each."""
    cfg = launched.config
    target = cfg.target(timeout_s=120)
    workload = loadgen.Workload(p.bench_input_len, p.bench_output_len)
    maker = loadgen.PromptMaker(loadgen.load_tokenizer(cfg.model_path), seed=11)
    c, end = args.concurrency, time.monotonic() + 60 * args.minutes
    print(f"soak: {c} streams of {workload.input_len}+{workload.output_len} tokens for {args.minutes:g} min")
    rate = 0.0  # requests/s of the last window: the next one gets twice the prompts its seconds need
    while time.monotonic() < end:
        count = max(4 * c, int(2 * rate * args.window_s)) if rate else 4 * c
        window = loadgen.run_level(
            target, workload, maker.prompts(c + count, workload.input_len), concurrency=c, min_requests=4 * c,
            min_seconds=args.window_s, stall_s=60,
        )  # fmt: skip
        s = metrics.summarize(window.records)
        first, rate = not rate, s.request_throughput or rate
        if first:  # the first window only sizes the ones after it
            continue
        rss, gpu = resident_mb(launched.pgid), gpu_used_mb(cfg.target_gpus)
        rows.append((s.output_throughput, s.failed, rss, gpu))
        print(
            f"  window {len(rows):3d}: {s.output_throughput:8.1f} output tok/s, {s.failed} failed of "
            f"{s.requests}, server RSS {rss:8.1f} MB" + (f", GPU {gpu:,.0f} MB" if gpu is not None else "")
            + (f"; stalled: {window.stalled}" if window.stalled else "")
        )  # fmt: skip
        if window.stalled:
            break


def _summary(rows: list[tuple[float, int, float, float | None]]) -> None:
    if not rows:
        print("no window measured")
        return
    head, tail = rows[:3], rows[-3:]
    first, last = statistics.mean(r[0] for r in head), statistics.mean(r[0] for r in tail)
    print(f"windows: {len(rows)}; errors: {sum(r[1] for r in rows)}")
    print(
        f"throughput: first three {first:,.1f} tok/s, last three {last:,.1f} tok/s, drift {100 * (last / first - 1):+.1f} %"
    )
    print(
        f"server memory: {head[0][2]:,.1f} MB at the start, {tail[-1][2]:,.1f} MB at the end, growth {tail[-1][2] - head[0][2]:+,.1f} MB"
    )
    if head[0][3] is not None and tail[-1][3] is not None:
        print(f"GPU memory: growth {tail[-1][3] - head[0][3]:+,.0f} MB")


if __name__ == "__main__":
    main()
