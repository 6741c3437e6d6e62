"""Stage 06 glue: the collective micro-benchmark, the server A/B, and the environment to deploy with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servebook import ab, loadgen, nccl, results
from servebook.params import Params

NCCL_PREFIX = ("NCCL_", "CUDA_DEVICE_MAX_CONNECTIONS")


def micro(p: Params, log=print) -> dict[str, Any]:
    sets = p.nccl_sets or list(nccl.DEFAULT_SETS)
    return nccl.run_all("auto", p.nccl_world, p.nccl_min_bytes, p.nccl_max_bytes, p.nccl_iters, p.nccl_warmup, sets, log=log)


def recommend(ab_result: dict[str, Any] | None) -> tuple[dict[str, str], str, list[str]]:
    """The environment to deploy with: the default unless an NCCL-only variant wins at every concurrency."""
    if not ab_result:
        return {}, "no server A/B ran: deploy with the default environment", []
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for row in ab_result["rows"]:
        by_variant.setdefault(row["variant"], []).append(row)
    winners = [v for v, rows in by_variant.items() if rows and all(r["verdict"] == "better" for r in rows)]
    other = [f"{v}: better at every concurrency, but it changes serving flags; apply it to the launch parameters if wanted"
             for v in winners if any(k != "extra_env" for k in ab_result.get("variant_keys", {}).get(v, []))]
    env_winners = [v for v in winners if set(ab_result.get("variant_keys", {}).get(v, [])) <= {"extra_env"}]
    if not env_winners:
        return {}, "no environment set beat run-to-run noise at every concurrency: deploy with the default environment", other
    best = max(env_winners, key=lambda v: min(r["change"] for r in by_variant[v]))
    env = {k: v for k, v in ab_result["variant_env"][best].items() if k.startswith(NCCL_PREFIX)}
    return env, f"{best} beat the baseline beyond its noise band at every concurrency", other


def run(p: Params, run_dir: str | Path, log=print) -> dict[str, Any]:
    run_dir = results.run_folder(str(run_dir))
    data: dict[str, Any] = {"micro": micro(p, log)}
    data["gpu"] = data["micro"]["backend"] == "nccl"
    ab_result = None
    if p.ab_variants:
        from servebook import launch_stage

        base = launch_stage.config_for(p, run_dir)
        workload = loadgen.Workload(p.bench_input_len, p.bench_output_len)
        ab_result = ab.run(base, p.ab_variants, run_dir, workload, sorted({1, p.ab_concurrency}), p.ab_requests,
                           p.ab_repeats, log=log)
        ab_result["variant_keys"] = {v["name"]: [k for k in v if k != "name"] for v in p.ab_variants}
        ab_result["variant_env"] = {v["name"]: v.get("extra_env", {}) for v in p.ab_variants}
    data["ab"] = ab_result
    env, why, notes = recommend(ab_result)
    data["recommended_env"] = env
    data["recommendation"] = why
    data["notes"] = notes
    results.write(run_dir, "nccl_tuning", data)
    return data


def bandwidth_table(data: dict[str, Any]):
    import pandas as pd

    rows = [{"set": s["name"], **row} for s in data["micro"]["sets"] for row in s["rows"]]
    return pd.DataFrame(rows)
