"""servebook's client against ``vllm bench serve`` on one running server, in alternating rounds.

    python client_vs_vllm.py URL MODEL TOKENIZER --concurrency 16 64 --rounds 5 --seconds 20 --out DIR

Each round measures the same server at each concurrency with every client, the order rotated every round so
that none always runs on a warmer server (servebook's first, to size vLLM's). Two more clients isolate one
choice each: servebook asking for token counts on every chunk (its request body before 2026-12-01), and
servebook on Python's own asyncio loop instead of uvloop (its loop until uvloop came in). All send random prompts of exactly --input-len tokens and
ask for exactly --output-len tokens (ignore_eos). vLLM's benchmark runs in this process (its own code,
``vllm.benchmarks.serve``), sized from servebook's request rate so that its window lasts as long.
Writes one JSON row per measurement to DIR/rounds.jsonl (with each client's CPU seconds per 1,000 output
tokens, the share of its prompt tokens vLLM's prefix cache held, and the server's own mean TTFT and TPOT over
the measurement from its /metrics histograms, the referee between the clients), every request's timeline (servebook-*.parquet, vLLM's --save-detailed vllm-*.json), and prints a
table of medians.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from servebook import client, loadgen, metrics, tables
from servebook.datasets import Prompt
from servebook.loadgen import Workload

CLIENTS = {
    "servebook": "servebook",  # token counts once, at the end, as vLLM's benchmark asks for them
    "servebook-usage-each-chunk": "servebook, usage on every chunk",  # servebook's request body before 2026-12-01
    "servebook-asyncio": "servebook on asyncio's loop",  # servebook's event loop until uvloop came in
    # servebook's client sending the very prompts `vllm bench serve` sends (its RandomDataset, the round's seed):
    # separates what the client measures from what the prompts make the server do
    "servebook-vllm-prompts": "servebook, vLLM's prompts",
    "vllm": "vllm bench serve",
}


def hit_rate(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The share of one measurement's prompt tokens vLLM found cached (warm-ups included): a client whose prompts
    repeat each other's blocks gets cheaper prefills, and the comparison of first-token times is off."""
    queried = after.get("vllm:prefix_cache_queries_total", 0.0) - before.get("vllm:prefix_cache_queries_total", 0.0)
    found = after.get("vllm:prefix_cache_hits_total", 0.0) - before.get("vllm:prefix_cache_hits_total", 0.0)
    return found / queried if queried > 0 else None


def engine_clock(before: dict[str, float], after: dict[str, float]) -> dict:
    """The server's own mean TTFT and TPOT over the measurement (warm-ups included; metrics.EngineClock says
    where vLLM starts and stops its clocks): the referee when two clients read one server differently."""
    count, ttft = metrics.histogram_mean_ms("vllm:time_to_first_token_seconds", before, after)
    _, tpot = metrics.histogram_mean_ms("vllm:request_time_per_output_token_seconds", before, after)
    return {"vllm_requests": count, "vllm_ttft_mean_ms": ttft, "vllm_tpot_mean_ms": tpot}


def servebook_prompts(a: argparse.Namespace, maker: loadgen.PromptMaker, c: int, rate: float | None) -> list[str]:
    count = max(max(4 * c, 32), math.ceil(1.5 * a.seconds * rate)) if rate else max(4 * c, 32) * 20
    return maker.prompts(count + c, a.input_len)


def vllm_prompts(a: argparse.Namespace, count: int, seed: int) -> list[Prompt]:
    """The prompts `vllm bench serve --dataset-name random --seed SEED` draws, with the lengths they encode to."""
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import RandomDataset

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    drawn = RandomDataset(random_seed=seed).sample(
        tokenizer=tok, num_requests=count, input_len=a.input_len, output_len=a.output_len, range_ratio=0.0
    )
    return [Prompt(r.prompt, len(tok.encode(r.prompt)), a.output_len) for r in drawn]


def servebook_run(a: argparse.Namespace, prompts: list[str] | list[Prompt], c: int, tag: str, name: str) -> dict:
    least = max(4 * c, 32)
    each_chunk = name == "servebook-usage-each-chunk"
    if name == "servebook-asyncio":
        import asyncio

        loadgen._run_loop = asyncio.run  # this process only: it was spawned for this one measurement
    cpu = time.process_time()
    recs = loadgen.run_level(
        client.Target(a.url, a.model),
        Workload(a.input_len, a.output_len, usage_each_chunk=each_chunk),
        prompts,
        concurrency=c,
        warmup=c,
        min_requests=least,
        min_seconds=a.seconds,
    ).records
    cpu = time.process_time() - cpu
    tables.write_requests(recs, a.out / f"{name}-{tag}")  # every request's timeline, to study TTFT
    s = metrics.summarize(recs)
    return {
        "client": CLIENTS[name],
        "concurrency": c,
        "requests": s.requests,
        "failed": s.failed,
        "duration_s": s.duration_s,
        "output_throughput": s.output_throughput,
        "request_throughput": s.request_throughput,
        "ttft_p50_ms": s.ttft_ms.p50,
        "tpot_p50_ms": s.tpot_ms.p50,
        "itl_p50_ms": s.itl_ms.p50,
        "e2el_p50_ms": s.e2el_ms.p50,
        "ttft_mean_ms": s.ttft_ms.mean,
        "tpot_mean_ms": s.tpot_ms.mean,
        "errors": s.errors,
        "new_connections": sum(r.new_connection for r in recs),
        "client_cpu_s": cpu,
        "client_cpu_s_per_1k_tokens": 1000 * cpu / max(s.output_tokens, 1),
    }


def vllm_run(a: argparse.Namespace, c: int, rate: float, seed: int, tag: str) -> dict:
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    n = max(4 * c, math.ceil(a.seconds * rate * 1.05))
    args = parser.parse_args(
        [
            "--backend",
            "vllm",
            "--base-url",
            a.url,
            "--model",
            a.model,
            "--tokenizer",
            a.tokenizer,
            "--dataset-name",
            "random",
            "--random-input-len",
            str(a.input_len),
            "--random-output-len",
            str(a.output_len),
            "--random-range-ratio",
            "0",
            "--ignore-eos",
            "--temperature",
            "0",
            "--max-concurrency",
            str(c),
            "--num-prompts",
            str(n),
            "--num-warmups",
            str(c),
            "--seed",
            str(seed),
            "--disable-tqdm",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,90,99",
            "--save-result",
            "--save-detailed",
            "--result-dir",
            str(a.out),
            "--result-filename",
            f"vllm-{tag}.json",
        ]
    )
    cpu = time.process_time()
    r = serve.main(args)
    cpu = time.process_time() - cpu
    return {
        "client": "vllm bench serve",
        "concurrency": c,
        "requests": r.get("num_prompts", n),
        "failed": r.get("failed", n - r.get("completed", 0)),
        "completed": r.get("completed"),
        "duration_s": r.get("duration"),
        "output_throughput": r.get("output_throughput"),
        "request_throughput": r.get("request_throughput"),
        "ttft_p50_ms": r.get("median_ttft_ms"),
        "tpot_p50_ms": r.get("median_tpot_ms"),
        "itl_p50_ms": r.get("median_itl_ms"),
        "e2el_p50_ms": r.get("median_e2el_ms"),
        "ttft_mean_ms": r.get("mean_ttft_ms"),
        "tpot_mean_ms": r.get("mean_tpot_ms"),
        # includes vLLM's dataset sampling before the run: an upper bound
        "client_cpu_s": cpu,
        "client_cpu_s_per_1k_tokens": 1000 * cpu / max(r.get("total_output_tokens") or 1, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url")
    ap.add_argument("model", help="the served model name")
    ap.add_argument("tokenizer", help="folder of the served model's tokenizer")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=20.0, help="least window per measurement")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    maker = loadgen.PromptMaker(loadgen.load_tokenizer(a.tokenizer), seed=1)
    rows_path = a.out / "rounds.jsonl"
    rows: list[dict] = []
    for c in a.concurrency:
        rate: float | None = None
        for rnd in range(a.rounds):
            # rotate the order, so that no client always runs first (vLLM's needs a rate: never first in round 1)
            order = a.clients[rnd % len(a.clients) :] + a.clients[: rnd % len(a.clients)]
            for who in order:
                t0 = time.monotonic()
                tag = f"c{c}-r{rnd + 1}"
                before, wall_start = client.metrics(a.url), time.time()
                # each measurement in a fresh process: no client's threads or heap outlive its window
                with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                    if who == "vllm":
                        row = pool.submit(vllm_run, a, c, rate or 1.0, rnd, tag).result()
                    else:
                        prompts: list[str] | list[Prompt] = servebook_prompts(a, maker, c, rate)
                        if who == "servebook-vllm-prompts":
                            prompts = vllm_prompts(a, len(prompts), rnd)
                        row = pool.submit(servebook_run, a, prompts, c, tag, who).result()
                after = client.metrics(a.url)
                row["round"], row["wall_s"] = rnd + 1, round(time.monotonic() - t0, 1)
                # wall-clock bounds, to find the server log's 10-s lines that fall inside this measurement
                row["wall_start"], row["wall_end"] = wall_start, time.time()
                row["prefix_cache_hit_rate"] = hit_rate(before, after)
                row.update(engine_clock(before, after))
                if who != "vllm":
                    rate = row["request_throughput"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                with rows_path.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
    print(
        f"\n{'c':>4} {'client':<32} {'n':>3} {'out tok/s':>10} {'TTFT p50':>9} {'TPOT p50':>9} {'failed':>6} "
        f"{'CPU s/1k tok':>12} {'TPOT mean: client':>17} {'vLLM':>7}"
    )
    for c in a.concurrency:
        for who in CLIENTS.values():
            mine = [r for r in rows if r["concurrency"] == c and r["client"] == who]
            if not mine:
                continue
            keys = ("output_throughput", "ttft_p50_ms", "tpot_p50_ms", "client_cpu_s_per_1k_tokens")
            med = {k: statistics.median(r[k] for r in mine if r[k] is not None) for k in keys}
            clocks = {
                k: statistics.median(vals) if (vals := [r[k] for r in mine if r.get(k) is not None]) else math.nan
                for k in ("tpot_mean_ms", "vllm_tpot_mean_ms")
            }
            print(
                f"{c:>4} {who:<32} {len(mine):>3} {med['output_throughput']:>10.1f} {med['ttft_p50_ms']:>8.2f}ms "
                f"{med['tpot_p50_ms']:>8.3f}ms {sum(r['failed'] or 0 for r in mine):>6} "
                f"{med['client_cpu_s_per_1k_tokens']:>12.4f} {clocks['tpot_mean_ms']:>15.3f}ms "
                f"{clocks['vllm_tpot_mean_ms']:>5.3f}ms"
            )


if __name__ == "__main__":
    main()
