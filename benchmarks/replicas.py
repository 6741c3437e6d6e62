"""One server against several replicas behind vllm-router, and the router's policies on conversations.

    python benchmarks/replicas.py PARAMS.yaml [--replicas 2] [--policies round_robin,cache_aware,consistent_hash]
                                  [--set KEY=VALUE ...] [--out DIR]

1. The params' server alone (replicas: 1): a closed-loop sweep.
2. ``--replicas`` of it behind the router (round_robin): the same sweep through the router, with each replica's
   share of the requests.
3. The same replicas (reused, only the router restarts) under each policy with multi-turn chats (``bench_turns``
   4): the prefix-cache hit rate each replica reports, and TTFT, per policy.

Prints one line per measurement and writes ``replicas.json`` under ``--out``.  Everything it starts it stops.
On the CPU default: ``.venv/bin/python benchmarks/replicas.py params/ci.yaml``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from servebook import params, server
from servebook.runner import stop_started_servers
from servebook.stages import benchmark
from servebook.stages import launch as launch_stage


def sweep(p: params.Params, run_dir: Path, label: str) -> dict:
    launched = launch_stage.run(p, run_dir)
    swept = benchmark.run(p, run_dir)
    best = max(swept.levels, key=lambda level: level.output_throughput)
    hits = [r for level in swept.levels for r in level.replica_prefix_hit_rates.values() if r is not None]
    row = {
        "run": label,
        "replicas": len(launched.replicas) or 1,
        "policy": launched.router.policy if launched.router else "",
        "best_concurrency": best.concurrency,
        "output_tok_s": round(best.output_throughput, 1),
        "ttft_p50_ms": best.ttft_p50_ms,
        "tpot_p50_ms": best.tpot_p50_ms,
        "shares_at_best": best.replica_shares,
        "prefix_hit_rate_by_replica_at_best": best.replica_prefix_hit_rates,
        "prefix_hit_rate_median": round(statistics.median(hits), 4) if hits else None,
        "failed": sum(level.failed for level in swept.levels),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--policies", default="round_robin,cache_aware,consistent_hash")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="servebook-replicas-"))
    out.mkdir(parents=True, exist_ok=True)
    base = [*a.overrides, "ab_variants=[]", "bench_request_rates=[]"]
    rows = []
    try:
        one = params.load(a.params, [*base, "replicas=1"])
        rows.append(sweep(one, out / "one", "one server"))
        stop_started_servers((out / "one").resolve(), print)
        policies = a.policies.split(",")
        closed = params.load(a.params, [*base, f"replicas={a.replicas}", f"router_policy={policies[0]}"])
        rows.append(sweep(closed, out / "replicas", f"{a.replicas} replicas, {policies[0]}"))
        server.stop(port=closed.port)  # the router; the replicas stay for the policies below
        for policy in policies:
            chats = ["bench_turns=4", "bench_endpoint=chat", f"replicas={a.replicas}", f"router_policy={policy}"]
            p = params.load(a.params, [*base, *chats])
            rows.append(sweep(p, out / "replicas", f"{a.replicas} replicas, {policy}, 4-turn chats"))
            server.stop(port=p.port)
    finally:
        for folder in ("one", "replicas"):
            if (out / folder).is_dir():
                stop_started_servers((out / folder).resolve(), print)
    (out / "replicas.json").write_text(json.dumps(rows, indent=1))
    print(f"wrote {out / 'replicas.json'}")


if __name__ == "__main__":
    main()
