"""servebook's load generator against vLLM's own serving benchmark, on one server and one workload.

    .venv/bin/python benchmarks/client_vs_vllm_bench.py [--rounds 5] [--port 8162]

Starts the embedded server once (prefix caching off, so no client gains from prompts that repeat each
other's blocks), then alternates the two clients on the
same workload (random 128 in / 128 out, 64 prompts, concurrency 16, ignore_eos, temperature 0), each in
its own process so its CPU time can be read, the order swapped every round. Prints, for both, the median
over the rounds of output tok/s, TTFT, TPOT and client CPU seconds per 1,000 output tokens, and each round's
mean TPOT by the client's clock beside vLLM's own (its /metrics histogram, the referee between the two). With
--stress-concurrency N it then runs servebook's client alone at N streams and prints its CPU share.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from servebook import client, metrics, params, server

SERVEBOOK_CLIENT = r"""
import json, sys
from servebook import loadgen, metrics
from servebook.client import Target
url, model, path, n, c, inp, out = sys.argv[1:8]
n, c, inp, out = int(n), int(c), int(inp), int(out)
maker = loadgen.PromptMaker(loadgen.load_tokenizer(path), seed=int(sys.argv[8]))
prompts = maker.prompts(n + c, inp)
import resource, time
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
recs = loadgen.run_level(Target(url, model), loadgen.Workload(inp, out), prompts, concurrency=c, warmup=c).records
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
s = metrics.summarize(recs).flat()
s["client_cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
print("RESULT " + json.dumps(s))
"""

VLLM_CLIENT = r"""
import json, resource, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
import time
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
result = main(args)
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
result["client_cpu_s"] = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
print("RESULT " + json.dumps({k: result.get(k) for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms",
      "total_output_tokens", "completed", "client_cpu_s", "mean_tpot_ms")}))
"""


def parse(out: str) -> dict:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(out[-3000:])


def run_servebook(url, model, path, n, c, *, inp, out, seed) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SERVEBOOK_CLIENT, url, model, path, str(n), str(c), str(inp), str(out), str(seed)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    r = parse(proc.stdout + proc.stderr)
    return {
        "output_tok_s": r["output_throughput"],
        "ttft_ms": r["ttft_p50_ms"],
        "tpot_ms": r["tpot_p50_ms"],
        "tpot_mean_ms": r["tpot_mean_ms"],
        "cpu_s": r["client_cpu_s"],
        "tokens": r["output_tokens"],
        "failed": r["failed"],
        "errors": r["errors"],
        "duration_s": r["duration_s"],
    }


def run_vllm(url, model, path, n, c, *, inp, out, seed) -> dict:
    host, port = url.removeprefix("http://").split(":")
    args = [
        "--backend",
        "vllm",
        "--host",
        host,
        "--port",
        port,
        "--model",
        model,
        "--tokenizer",
        path,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(inp),
        "--random-output-len",
        str(out),
        "--num-prompts",
        str(n),
        "--max-concurrency",
        str(c),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--num-warmups",
        str(c),
        "--disable-tqdm",
    ]
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", VLLM_CLIENT, *args], capture_output=True, text=True, timeout=3600
    )
    r = parse(proc.stdout + proc.stderr)
    return {
        "output_tok_s": r["output_throughput"],
        "ttft_ms": r["median_ttft_ms"],
        "tpot_ms": r["median_tpot_ms"],
        "tpot_mean_ms": r["mean_tpot_ms"],
        "cpu_s": r["client_cpu_s"],
        "tokens": r["total_output_tokens"],
        "failed": n - r["completed"],
        "errors": {},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=8162)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--no-warmup-pass", dest="warmup_pass", action="store_false", help="skip the uncounted pass")
    ap.add_argument("--stress-concurrency", type=int, default=0, help="then servebook alone at this many; 0: skip")
    args = ap.parse_args()
    # prefix caching off: vLLM's random prompts on the tiny model's 2,048-token vocabulary repeat each other's
    # blocks (23 % of their tokens in one run of 700, 88 % by the fifth), and cached prefills would flatter its TTFT
    values = dict(
        model="builtin:tiny-qwen3-moe",
        port=args.port,
        max_model_len=2048,
        enforce_eager=True,
        extra_args=["--no-enable-prefix-caching"],
    )
    cfg = server.ServerConfig.from_params(params.Params(**values), "cpu")
    launched = server.launch(cfg, Path(tempfile.mkdtemp(prefix="servebook-cmp-")), log=lambda _: None)
    url, model, path = launched.url, cfg.served_model_name, cfg.model_path
    results = {"servebook": [], "vllm bench serve": []}
    try:
        # A fresh CPU server stalls for seconds the first times it meets a batch shape; one uncounted pass of each
        # client lets it meet them all before the rounds (the first round otherwise carries the stalls alone)
        for fn in (run_servebook, run_vllm)[: 2 if args.warmup_pass else 0]:
            fn(url, model, path, args.prompts, args.concurrency, inp=128, out=128, seed=999)
        for rnd in range(args.rounds):
            pair = (("vllm bench serve", run_vllm), ("servebook", run_servebook))
            for name, fn in pair if rnd % 2 else pair[::-1]:  # the order alternates: neither always runs first
                before = client.metrics(url)
                r = fn(url, model, path, args.prompts, args.concurrency, inp=128, out=128, seed=1000 + rnd)
                # the referee: vLLM's own mean TPOT over the measurement (warm-ups included)
                r["vllm_tpot_mean_ms"] = metrics.histogram_mean_ms(
                    "vllm:request_time_per_output_token_seconds", before, client.metrics(url)
                )[1]
                results[name].append(r)
                print(
                    f"round {rnd + 1} {name:17} {r['output_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_ms']:6.1f} ms  "
                    f"TPOT p50 {r['tpot_ms']:5.1f} ms  TPOT mean {r['tpot_mean_ms']:5.2f} ms (vLLM's own "
                    f"{r['vllm_tpot_mean_ms'] or 0:5.2f})  client CPU {r['cpu_s']:5.1f} s",
                    flush=True,
                )
        stress_n = max(args.prompts, 2 * args.stress_concurrency)
        t0 = time.monotonic()
        stress = (
            run_servebook(url, model, path, stress_n, args.stress_concurrency, inp=128, out=128, seed=99)
            if args.stress_concurrency
            else None
        )
        wall = time.monotonic() - t0
    finally:
        server.stop(port=args.port)
    print(
        f"\nrandom 128 in / 128 out, {args.prompts} prompts, concurrency {args.concurrency}, ignore_eos; "
        f"median of {args.rounds} alternating rounds"
    )
    print(f"{'client':17} {'output tok/s':>12} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'CPU s/1k tok':>13}")
    med = {}
    for name, rs in results.items():
        m = {k: statistics.median(r[k] for r in rs) for k in ("output_tok_s", "ttft_ms", "tpot_ms")}
        m["cpu_per_1k"] = statistics.median(1000 * r["cpu_s"] / r["tokens"] for r in rs)
        med[name] = m
        print(f"{name:17} {m['output_tok_s']:12.1f} {m['ttft_ms']:12.1f} {m['tpot_ms']:12.2f} {m['cpu_per_1k']:13.3f}")
    a, b = med["servebook"], med["vllm bench serve"]
    for k in ("output_tok_s", "ttft_ms", "tpot_ms"):
        print(f"difference in {k}: {100 * (a[k] - b[k]) / b[k]:+.1f}%")
    print(f"client CPU per 1,000 output tokens: servebook {a['cpu_per_1k'] / b['cpu_per_1k']:.2f} x vLLM's")
    if stress is None:
        return
    print(
        f"\nservebook client alone at {args.stress_concurrency} streams: {stress_n} requests, {stress['failed']} failed "
        f"{stress['errors'] or ''}, {stress['output_tok_s']:.0f} output tok/s, client CPU {stress['cpu_s']:.1f} s "
        f"over {stress['duration_s']:.1f} s measured ({100 * stress['cpu_s'] / stress['duration_s']:.0f}% of one core; "
        f"{wall:.0f} s wall including prompt building)"
    )


if __name__ == "__main__":
    main()
