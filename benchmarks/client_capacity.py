"""How many output tokens per second one load-generator process can take in, servebook's and vLLM's.

    .venv/bin/python benchmarks/client_capacity.py [--concurrency 64] [--requests 512] [--tokens 256]

Against a real server the client is rarely the limit and its capacity stays hidden; here both clients read
from a minimal local token-stream emitter written for this script only (it never stands in for vLLM in a
test or the pipeline): an aiohttp endpoint that answers /v1/completions with ``--tokens`` pre-built chunks in
vLLM's compact JSON, a usage chunk and ``[DONE]``, as fast as the socket takes them.  Each client runs in its
own process; the script prints output tok/s, the client's CPU share of one core, and tokens per CPU-second
(its capacity at a full core), for servebook's client and for ``vllm bench serve``'s.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time

from servebook import models

EMITTER = r"""
import asyncio, json, sys
from aiohttp import web
tokens, gap = int(sys.argv[2]), float(sys.argv[3]) / 1000
def chunk(text, finish=None):
    return ("data: " + json.dumps({"id": "cmpl-emitter", "object": "text_completion", "created": 0, "model": "emitter",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": None},
            separators=(",", ":")) + "\n\n").encode()
body = [chunk(" tok") for _ in range(tokens - 1)]
last = chunk(" end", "length")
async def completions(request):
    payload = await request.json()
    n = min(int(payload.get("max_tokens") or tokens), tokens)
    usage = {"prompt_tokens": 128, "completion_tokens": n, "total_tokens": 128 + n}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for piece in body[: n - 1]:
        await resp.write(piece)
        if gap:
            await asyncio.sleep(gap)
    await resp.write(last)
    await resp.write(("data: " + json.dumps({"id": "cmpl-emitter", "object": "text_completion", "created": 0,
                      "model": "emitter", "choices": [], "usage": usage}, separators=(",", ":")) + "\n\n").encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "emitter", "object": "model"}]})
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""

SERVEBOOK = r"""
import json, resource, sys, time
from servebook import loadgen, metrics
from servebook.client import Target
url, n, c, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompts = [f"prompt {i}" for i in range(n + c)]
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
window = loadgen.run_level(Target(url, "emitter"), loadgen.Workload(128, tokens), prompts, concurrency=c, warmup=c)
recs, start, end = window.records, window.start, window.end
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
s = metrics.summarize(recs)
print("RESULT " + json.dumps({"tokens": s.output_tokens, "seconds": end - start, "failed": s.failed,
      "cpu_s": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime}))
"""

VLLM = r"""
import json, resource, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
r = main(args)
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT " + json.dumps({"tokens": r["total_output_tokens"], "seconds": r["duration"],
      "failed": r.get("failed", 0), "cpu_s": cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def result(cmd: list[str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError((proc.stdout + proc.stderr)[-3000:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="pause between one stream's chunks (0: back to back, so many arrive in one read; a GPU server's "
        "decode step of a few ms sends each chunk alone, and the client pays its per-read cost for every token)",
    )
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    emitter = subprocess.Popen([sys.executable, "-c", EMITTER, str(port), str(a.tokens), str(a.gap_ms)])
    tokenizer = str(models.build_tiny_model())
    vllm_args = [
        "--backend", "vllm", "--base-url", url, "--model", "emitter", "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", str(a.tokens),
        "--num-prompts", str(a.requests), "--max-concurrency", str(a.concurrency), "--ignore-eos",
        "--num-warmups", str(a.concurrency), "--disable-tqdm",
    ]  # fmt: skip
    rows: dict[str, list[dict]] = {"servebook": [], "vllm bench serve": []}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        for rnd in range(a.rounds):
            order = ["servebook", "vllm bench serve"][:: 1 if rnd % 2 == 0 else -1]
            for who in order:
                if who == "servebook":
                    cmd = [sys.executable, "-c", SERVEBOOK, url, str(a.requests), str(a.concurrency), str(a.tokens)]
                else:
                    cmd = [sys.executable, "-W", "ignore", "-c", VLLM, *vllm_args]
                r = result(cmd)
                rows[who].append(r)
                print(
                    f"round {rnd + 1} {who:17} {r['tokens'] / r['seconds']:9.0f} tok/s, client CPU "
                    f"{100 * r['cpu_s'] / r['seconds']:4.0f} % of a core, {r['failed']} failed",
                    flush=True,
                )
    finally:
        emitter.terminate()
        emitter.wait(timeout=10)
    print(
        f"\nemitter: {a.tokens} tokens per request in vLLM's compact JSON, {a.gap_ms:g} ms apart, {a.requests} "
        f"requests at {a.concurrency} streams; median of {a.rounds} rounds"
    )
    print(f"{'client':17} {'output tok/s':>12} {'CPU % of a core':>16} {'tokens per CPU-second':>22}")
    for who, rs in rows.items():
        rs.sort(key=lambda r: r["tokens"] / r["cpu_s"])
        mid = rs[len(rs) // 2]
        print(
            f"{who:17} {mid['tokens'] / mid['seconds']:12.0f} {100 * mid['cpu_s'] / mid['seconds']:16.0f} "
            f"{mid['tokens'] / mid['cpu_s']:22.0f}"
        )


if __name__ == "__main__":
    main()
