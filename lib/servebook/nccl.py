"""Collective micro-benchmark: all-reduce and all-gather per environment set, as nccl-tests measures them.

One process per GPU through torch.distributed with the NCCL backend (the NCCL that torch,
and so vLLM, loads), or CPU processes with gloo where there are no GPUs, so the path is
exercised anywhere; gloo figures say nothing about NCCL.  Each environment set runs in a
fresh group of processes with ``NCCL_DEBUG=INFO`` captured, so the log shows whether the
setting took effect.

Bandwidth as nccl-tests defines it (doc/PERFORMANCE.md): for a message of S bytes taking
t seconds, algbw = S / t; busbw = algbw x 2(n-1)/n for all-reduce and algbw x (n-1)/n for
all-gather (S being the gathered total), where n is the number of ranks.  GB = 1e9 bytes.

    python -m servebook.nccl --world 2 --min-bytes 8K --max-bytes 256M --out results.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from servebook.errors import ServebookError

# The sets tried by default. Each is a fresh process group; "baseline" sets nothing.
DEFAULT_SETS: dict[str, dict[str, str]] = {
    "baseline": {},
    "p2p_disable": {"NCCL_P2P_DISABLE": "1"},
    "p2p_level_sys": {"NCCL_P2P_LEVEL": "SYS"},
    "proto_ll": {"NCCL_PROTO": "LL"},
    "proto_simple": {"NCCL_PROTO": "Simple"},
    "algo_ring": {"NCCL_ALGO": "Ring"},
    "algo_tree": {"NCCL_ALGO": "Tree"},
    "channels_16": {"NCCL_MIN_NCHANNELS": "16"},
    "buffsize_16m": {"NCCL_BUFFSIZE": "16777216"},
    "nthreads_512": {"NCCL_NTHREADS": "512"},
}
# NVLink multicast (NVLS) stays off: on shared hosts it can take GPUs out of service.
ALWAYS = {"NCCL_NVLS_ENABLE": "0"}
COLLECTIVES = ("all_reduce", "all_gather")
SMALL_BYTES = 1 << 20  # up to 1 MiB, latency matters more than bandwidth (decode all-reduces are ~14 KB)
HARMFUL_BW = 0.8  # a set delivering under 80 % of the baseline's large-message busbw is flagged
HARMFUL_LATENCY = 1.25  # or over 125 % of its small-message latency


def bus_factor(collective: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if collective == "all_reduce" else (n - 1) / n


def algbw(size_bytes: int, seconds: float) -> float:
    """GB/s, as nccl-tests prints it."""
    return size_bytes / 1e9 / seconds if seconds > 0 else 0.0


def busbw(collective: str, size_bytes: int, seconds: float, n: int) -> float:
    return algbw(size_bytes, seconds) * bus_factor(collective, n)


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 2
    return out


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m:
        raise ValueError(f"size '{text}' is not like 8K, 256M or 1G")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)]


# ---------------------------------------------------------------- one rank


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = args.rank, args.world
    use_cuda = args.backend == "nccl"
    if use_cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    dtype = torch.bfloat16 if use_cuda else torch.float32  # gloo has no bf16 sum on every build
    elem = torch.tensor([], dtype=dtype).element_size()

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize()

    rows = []
    for collective in args.collectives.split(","):
        for size in sizes(args.min_bytes, args.max_bytes):
            count = max(1, size // elem)
            if collective == "all_reduce":
                op = functools.partial(dist.all_reduce, torch.ones(count, dtype=dtype, device=device))
            else:
                per = max(1, count // world)
                send = torch.ones(per, dtype=dtype, device=device)
                op = functools.partial(
                    dist.all_gather_into_tensor, torch.empty(per * world, dtype=dtype, device=device), send
                )
            for _ in range(args.warmup):
                op()
            sync()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                op()
            sync()
            elapsed = (time.perf_counter() - start) / args.iters
            t = torch.tensor([elapsed], dtype=torch.float64, device=device)
            dist.all_reduce(t)  # nccl-tests averages the per-op time across ranks
            avg = t.item() / world
            nbytes = count * elem
            rows.append(
                {
                    "collective": collective,
                    "bytes": nbytes,
                    "time_us": avg * 1e6,
                    "algbw_gbs": algbw(nbytes, avg),
                    "busbw_gbs": busbw(collective, nbytes, avg, world),
                }
            )
    if rank == 0:
        info = {
            "torch": torch.__version__,
            "backend": args.backend,
            "world": world,
            "dtype": str(dtype).replace("torch.", ""),
        }
        if use_cuda:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
            info["gpu"] = torch.cuda.get_device_name(0)
        print("SERVEBOOK-NCCL " + json.dumps({"info": info, "rows": rows}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------- one environment set


class Measurement(BaseModel):
    """One collective at one message size, averaged over iterations and ranks as nccl-tests does."""

    collective: str
    bytes: int
    time_us: float
    algbw_gbs: float
    busbw_gbs: float


class SetResult(BaseModel):
    name: str
    env: dict[str, str]
    ok: bool
    rows: list[Measurement]
    info: dict[str, str | int]  # torch, backend, world, dtype; nccl and gpu on GPUs
    error: str
    confirmations: list[str]  # NCCL's own log lines saying the variables were read
    seconds: float


class SetSummary(BaseModel):
    """One set and collective: the figures that decide, and why a set is harmful."""

    set: str
    collective: str
    env: str
    ok: bool
    harmful: str = ""
    peak_busbw_gbs: float | None = None
    busbw_at_max_gbs: float | None = None
    max_bytes: int | None = None
    small_latency_us: float | None = None


class MicroResult(BaseModel):
    backend: str
    world: int
    info: dict[str, str | int]
    sets: list[SetResult]
    summary: list[SetSummary]
    min_bytes: int
    max_bytes: int
    iters: int
    warmup: int

    @property
    def on_gpus(self) -> bool:
        return self.backend == "nccl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def confirmations(log: str, env: dict[str, str]) -> list[str]:
    """NCCL's INFO lines that mention each variable of the set (e.g. 'NCCL_PROTO set by environment to LL')."""
    found = []
    for name in env:
        lines = [
            line.strip()
            for line in log.splitlines()
            if name in line and ("set by environment" in line or "NCCL INFO" in line)
        ]
        found.append(lines[0][-200:] if lines else f"{name}: no NCCL log line mentions it")
    return found


@dataclass(frozen=True)
class Sweep:
    """What each set measures: the backend and ranks, the message sizes, the repetitions, the collectives."""

    backend: str
    world: int
    min_bytes: int
    max_bytes: int
    iters: int
    warmup: int
    collectives: tuple[str, ...] = COLLECTIVES

    def rank_command(self, rank: int, port: int) -> list[str]:
        """One rank's process: this module with the sweep's flags."""
        return [
            sys.executable, "-m", "servebook.nccl", "--rank", str(rank), "--world", str(self.world),
            "--port", str(port), "--backend", self.backend, "--min-bytes", str(self.min_bytes),
            "--max-bytes", str(self.max_bytes), "--iters", str(self.iters), "--warmup", str(self.warmup),
            "--collectives", ",".join(self.collectives),
        ]  # fmt: skip


def run_set(name: str, env: dict[str, str], sweep: Sweep, timeout_s: float = 600) -> SetResult:
    """Run one set in a fresh group of ``sweep.world`` processes; never raises for a failing set."""
    port = _free_port()
    child_env = {**os.environ, **ALWAYS, **env}
    if sweep.backend == "nccl":
        child_env.setdefault("NCCL_DEBUG", "INFO")
        child_env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,ENV,TUNING")
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            sweep.rank_command(rank, port),
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for rank in range(sweep.world)
    ]
    outputs, error = _collect(procs, started, timeout_s)
    log = "\n".join(o + e for _, o, e in outputs)
    result = next(
        (
            json.loads(line[len("SERVEBOOK-NCCL ") :])
            for _, o, _ in outputs
            for line in o.splitlines()
            if line.startswith("SERVEBOOK-NCCL ")
        ),
        None,
    )
    if result is None and not error:
        code = next((c for c, _, _ in outputs if c), None)
        said = [line.strip() for line in log.splitlines() if re.search(r"\b\w*(Error|error)\b:", line)]
        error = f"ranks exited with code {code}: " + (said[-1][-400:] if said else log.strip()[-400:])
    return SetResult(
        name=name,
        env=env,
        ok=result is not None and not error,
        rows=(result or {}).get("rows", []),
        info=(result or {}).get("info", {}),
        error=error,
        confirmations=confirmations(log, env) if sweep.backend == "nccl" else [],
        seconds=round(time.monotonic() - started, 2),
    )


def _collect(
    procs: list[subprocess.Popen[str]], started: float, timeout_s: float
) -> tuple[list[tuple[int | None, str, str]], str]:
    """Every rank's exit code and output; all are killed when one outlives the set's timeout (a hang), or when
    servebook is interrupted: each rank is in a session of its own, which no Ctrl-C reaches."""
    outputs, error = [], ""
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, err = p.communicate()
                error = f"timed out after {timeout_s:.0f} s (a hang: the set may be unsafe on this topology)"
            outputs.append((p.returncode, out, err))
    except KeyboardInterrupt:
        for q in procs:
            q.kill()
            q.wait()
        raise
    return outputs, error


def summarize(results: list[SetResult]) -> list[SetSummary]:
    """Per set and collective: peak busbw, busbw at the largest size, median small-message latency; harmful flags."""
    import statistics

    base = {r.name: r for r in results}.get("baseline")
    out = []
    for r in results:
        env = " ".join(f"{k}={v}" for k, v in r.env.items()) or "(none)"
        for coll in sorted({row.collective for row in r.rows}):
            rows = [x for x in r.rows if x.collective == coll]
            small = [x.time_us for x in rows if x.bytes <= SMALL_BYTES]
            entry = SetSummary(
                set=r.name,
                collective=coll,
                env=env,
                ok=r.ok,
                peak_busbw_gbs=max(x.busbw_gbs for x in rows),
                busbw_at_max_gbs=rows[-1].busbw_gbs,
                max_bytes=rows[-1].bytes,
                small_latency_us=statistics.median(small) if small else None,
            )
            if base and base.rows and r.name != "baseline":
                b = [x for x in base.rows if x.collective == coll]
                b_small = [x.time_us for x in b if x.bytes <= SMALL_BYTES]
                reasons = []
                if b and rows[-1].busbw_gbs < HARMFUL_BW * b[-1].busbw_gbs:
                    reasons.append(f"busbw {rows[-1].busbw_gbs:.1f} vs {b[-1].busbw_gbs:.1f} GB/s")
                if small and b_small and statistics.median(small) > HARMFUL_LATENCY * statistics.median(b_small):
                    reasons.append(
                        f"small-message latency {statistics.median(small):.0f} vs {statistics.median(b_small):.0f} us"
                    )
                entry.harmful = "; ".join(reasons)
            out.append(entry)
        if not r.ok:
            out.append(SetSummary(set=r.name, collective="-", env=env, ok=False, harmful=f"failed: {r.error[:200]}"))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=0, help="processes (GPUs); 0 means every GPU, or 2 on the CPU")
    ap.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    ap.add_argument("--min-bytes", type=parse_size, default=parse_size("8K"))
    ap.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--sets", default=",".join(DEFAULT_SETS), help="names from: " + ", ".join(DEFAULT_SETS))
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args(argv)
    if args.rank >= 0:
        _rank_main(args)
        return
    sweep = Sweep(
        args.backend, args.world, args.min_bytes, args.max_bytes, args.iters, args.warmup,
        tuple(args.collectives.split(",")),
    )  # fmt: skip
    result = run_all(sweep, [s for s in args.sets.split(",") if s], log=print)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(result.model_dump_json(indent=2))
    for row in result.summary:
        print(row.model_dump_json())


def detect_backend(backend: str, world: int) -> tuple[str, int]:
    if backend == "auto" or (backend == "nccl" and not world):
        try:
            import torch

            gpus = torch.cuda.device_count()
        except Exception:
            gpus = 0
        if backend == "auto":
            backend = "nccl" if gpus >= 2 else "gloo"
        world = world or (gpus if backend == "nccl" else 2)
    return backend, world or 2


def run_all(
    sweep: Sweep,
    set_names: list[str],
    *,
    extra_sets: dict[str, dict[str, str]] | None = None,
    log: Callable[[str], None] = print,
) -> MicroResult:
    """Every named set (the baseline first), each in its own group of processes; ``sweep.backend`` ``auto`` is
    NCCL on two GPUs or more, else gloo on the CPU."""
    sets = {**DEFAULT_SETS, **(extra_sets or {})}
    unknown = [s for s in set_names if s not in sets]
    if unknown:
        raise ServebookError(f"nccl_sets: unknown NCCL set(s) {unknown}; known: {', '.join(sets)}")
    backend, world = detect_backend(sweep.backend, sweep.world)
    sweep = dataclasses.replace(sweep, backend=backend, world=world)
    if "baseline" not in set_names:
        set_names = ["baseline", *set_names]
    if backend == "gloo":
        set_names = ["baseline"]  # NCCL variables change nothing on gloo: one run exercises the path
    results = []
    for name in set_names:
        r = run_set(name, sets[name], sweep)
        log(f"{name:14} {'ok' if r.ok else 'FAILED'} in {r.seconds:.1f} s" + (f": {r.error[:200]}" if r.error else ""))
        results.append(r)
    info = next((r.info for r in results if r.info), {})
    return MicroResult(
        backend=backend,
        world=world,
        info=info,
        sets=results,
        summary=summarize(results),
        min_bytes=sweep.min_bytes,
        max_bytes=sweep.max_bytes,
        iters=sweep.iters,
        warmup=sweep.warmup,
    )


if __name__ == "__main__":
    main()
