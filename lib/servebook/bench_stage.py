"""Stage 05 glue: parameters and the launch results to a sweep and ``05_benchmark.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from servebook import bench, client, metrics, results
from servebook.loadgen import Workload
from servebook.params import Params


def sweep_config(p: Params) -> bench.SweepConfig:
    return bench.SweepConfig(
        workload=Workload(p.bench_input_len, p.bench_output_len, p.bench_endpoint, p.bench_shared_prefix_len),
        max_concurrency=p.bench_max_concurrency,
        repeats=p.bench_repeats,
        prompts_per_level=p.bench_prompts_per_level,
        plateau_gain=p.bench_plateau_gain,
        objectives=metrics.Objectives(p.bench_ttft_slo_ms, p.bench_tpot_slo_ms, p.bench_e2el_slo_ms),
        request_timeout_s=p.bench_request_timeout_s,
    )


def run(p: Params, run_dir: str | Path) -> dict[str, Any]:
    """Sweep the server the launch stage recorded; always write the results, then raise on a fault."""
    run_dir = results.run_folder(str(run_dir))
    launch = results.require(run_dir, "launch", "benchmark")
    cfg = sweep_config(p)
    data = bench.sweep(launch["url"], launch["served_model_name"], launch["model_path"], cfg, run_dir,
                       client.headers(launch.get("api_key_env", "")))
    results.write(run_dir, "benchmark", data)
    return data


def raise_on_fault(data: dict[str, Any]) -> None:
    if data["fault"]:
        raise bench.SweepAborted(f"benchmark stopped: {data['fault']}; the levels measured before it are saved")
