"""A launch that finds its rehearsal's torch.compile cache, against the plan (issue #40, 2026-12-06).

    .venv/bin/python benchmarks/warm_launch_kv.py

For each pair of starts on one H100 with vLLM 0.25 at its defaults: a cold start (a dummy-weight rehearsal, as
servebook's stage 02 runs it, in docs/examples/h200-vllm/run-warm-launch; or the real weights, run-profile-peak)
and the same command on the real weights after it, which loads the compile cache. Prints vLLM's KV tokens and
activation peak for each, and the plan's KV figure against the warm start three ways: planned as a cold start
(what the plan said before it knew of the cache), planned as a start that finds its cache (first contact), and
that plan with the cold start in its history (what stage 03 plans after the rehearsal).

Then servebook's own plan, rehearsal and launch of the 8-layer Air (run-warm-launch/servebook-run-*): each start's
compile key, compile cache, compile and ready seconds and KV tokens from the start history, what the priming start
cost the rehearsal, and the launch's plan check.
"""

from __future__ import annotations

import json
from pathlib import Path

from servebook import gpus, modelspec, planner
from servebook.planner import truth
from servebook.vllm_log import read_values

RUNS = Path(__file__).resolve().parents[1] / "docs" / "examples" / "h200-vllm"
H100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81559 * 2**20)
PAIRS = [  # (cold start's folder, warm start's folder, model, how the cold one ran)
    (RUNS / "run-profile-peak", RUNS / "run-profile-peak" / "warm", "glm45-4l-fp8", "real weights"),
    *(
        (RUNS / "run-warm-launch" / f"warm-{m}-1-dummy", RUNS / "run-warm-launch" / f"warm-{m}-2-real", m, "dummy")
        for m in ("glm45-air-16l-fp8", "glm45-air-8l-fp8")
    ),
]


def layout(shape: modelspec.ModelSpec, warm: bool, history: tuple[truth.Measured, ...] = ()) -> planner.Layout:
    serving = planner.Serving(vllm_version="0.25.0", warm_layouts=frozenset({"TP=1"}) if warm else frozenset())
    return planner.plan(shape, H100, max_model_len=4096, serving=serving, history=history).layouts[0]


def error(planned: planner.Layout, kv: int) -> str:
    band = planned.bands["kv_tokens"]
    inside = "in" if band.contains(kv) else "OUT"
    return f"{100 * (planned.max_kv_tokens / kv - 1):+6.2f} % ±{100 * band.band:.2f} {inside:<3}"


def main() -> None:
    print(f"{'model':<20} {'cold start':<12} {'KV':>10} {'act GiB':>7} | {'warm start':<10} {'KV':>10} {'act GiB':>7} | "
          f"{'planned cold':>20} {'planned warm':>20} {'warm, history':>20}")  # fmt: skip
    for cold_dir, warm_dir, model, how in PAIRS:
        logs = {d: next(d.glob(f"{model}-defaults.log"), None) for d in (cold_dir, warm_dir)}
        if None in logs.values():
            print(f"{model:<20} not run ({', '.join(str(d) for d, log in logs.items() if log is None)})")
            continue
        cold_log, warm_log = (read_values(log.read_text()) for log in logs.values())
        config = next(
            p for p in (cold_dir / f"{model}-config.json", cold_dir.parent / f"{model}-config.json") if p.is_file()
        )
        shape = modelspec.load(str(config))
        cold, warm = layout(shape, warm=False), layout(shape, warm=True)
        entry = truth.learned(cold, H100.name, "0.25.0", "rehearsal" if how == "dummy" else "launch",
                              cold_log.kv_cache_tokens, weight_gib=cold_log.model_memory_gib,
                              graph_gib=cold_log.graph_estimate_gib)  # fmt: skip
        learned = layout(shape, warm=True, history=(entry,))
        kv = warm_log.kv_cache_tokens
        print(f"{model:<20} {how + ' ' + str(cold_log.compile_cache):<12} {cold_log.kv_cache_tokens:>10,} "
              f"{cold_log.activation_peak_gib or 0:>7.2f} | {'real ' + str(warm_log.compile_cache):<10} {kv:>10,} "
              f"{warm_log.activation_peak_gib or 0:>7.2f} | {error(cold, kv):>20} {error(warm, kv):>20} "
              f"{error(learned, kv):>20}")  # fmt: skip
        print(
            f"{'':<20} the warm start sized {100 * (kv / cold_log.kv_cache_tokens - 1):+.2f} % the cold one's KV; "
            f"plan's warm activation {warm.reserve.activation / 2**30 if warm.reserve else 0:.2f} GiB"
        )

    for run in sorted((RUNS / "run-warm-launch").glob("servebook-run-*")):
        servebook_run(run)


def servebook_run(run: Path) -> None:
    """One of servebook's own runs: its starts in order, the priming start's cost, the launch against the plan."""
    rehearsed = json.loads((run / "02_rehearse.json").read_text())
    check = json.loads((run / "03_launch.json").read_text())["plan_check"]
    print(f"\n{run.name}: rehearsal routing {rehearsed['routing'] or 'none'}, {rehearsed['seconds']:.0f} s in all")
    for line in (run / "starts.jsonl").read_text().splitlines():
        start = json.loads(line)
        print(f"  {start['load_strategy']:<8} key {start['compile_key']}  compile cache {start['compile_cache']:<5} "
              f"compile {start['phases'].get('compile', 0):5.1f} s  ready {start['total_s']:6.1f} s")  # fmt: skip
    primed = rehearsed.get("primed")
    if primed and not primed["skipped"]:
        print(f"  priming start: {primed['seconds']:.0f} s of the rehearsal, KV {primed['kv_cache_tokens']:,}")
    band = check["bands"]["KV tokens"]["band"]
    print(f"  launch: KV {check['reported_kv_tokens']:,}, plan {check['predicted_kv_tokens']:,} "
          f"({check['kv_tokens_error_pct']:+.2f} % ±{100 * band:.1f}), planned for {check['planned_for']}")  # fmt: skip


if __name__ == "__main__":
    main()
