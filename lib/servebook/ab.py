"""End-to-end A/B of server variants, with a winner called only above run-to-run noise.

Each variant (environment variables and/or serving parameters) is launched through the
launch stage's code, measured at one stream and at a high concurrency with the benchmark
stage's load generator, and compared with the baseline, which is measured before and after
the variants (across a relaunch) so its own spread is the noise band.  A variant is
"better" or "worse" only when its median differs from the baseline's by more than that
band; otherwise "no effect".  A variant whose server fails to start is reported with the
root cause, and the sweep goes on.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from servebook import loadgen, metrics, server
from servebook.errors import ServebookError

MIN_NOISE = 0.02  # never call a difference under 2 % a win, however quiet the baseline was
CONFIG_KEYS = {"extra_env", "extra_args", "enforce_eager", "max_num_seqs", "kv_cache_dtype", "gpu_memory_utilization",
               "max_model_len", "cpu_kv_cache_gib", "tensor_parallel_size", "pipeline_parallel_size",
               "data_parallel_size", "enable_expert_parallel"}


def validate_variants(variants: list[dict[str, Any]]) -> list[str]:
    problems = []
    names = set()
    for i, v in enumerate(variants):
        name = v.get("name")
        if not name:
            problems.append(f"ab_variants[{i}] has no 'name'")
        elif name in names or name == "baseline":
            problems.append(f"ab_variants[{i}]: name '{name}' is used twice (or is 'baseline')")
        names.add(name)
        unknown = set(v) - CONFIG_KEYS - {"name"}
        if unknown:
            problems.append(f"ab_variants[{i}] ({name}): unknown keys {sorted(unknown)}; allowed: {sorted(CONFIG_KEYS)}")
    return problems


def variant_config(base: server.ServerConfig, variant: dict[str, Any]) -> server.ServerConfig:
    changes = {k: v for k, v in variant.items() if k in CONFIG_KEYS}
    if "extra_env" in changes:
        changes["extra_env"] = {**base.extra_env, **changes["extra_env"]}
    if "extra_args" in changes:
        changes["extra_args"] = [*base.extra_args, *changes["extra_args"]]
    return replace(base, **changes)


def verdict(base: list[float], variant: list[float], noise: float) -> tuple[str, float]:
    """('better' | 'worse' | 'no effect', relative change of the medians)."""
    b, v = statistics.median(base), statistics.median(variant)
    change = (v - b) / b if b else 0.0
    if abs(change) <= noise:
        return "no effect", change
    return ("better" if change > 0 else "worse"), change


def noise_band(samples: list[float]) -> float:
    """The baseline's own spread relative to its median: (max − min) / median, at least MIN_NOISE."""
    if len(samples) < 2:
        return max(MIN_NOISE, 0.05)
    med = statistics.median(samples)
    return max(MIN_NOISE, (max(samples) - min(samples)) / med if med else 0.0)


def measure(cfg: server.ServerConfig, maker: loadgen.PromptMaker, workload: loadgen.Workload, concurrencies: list[int],
            requests: int, repeats: int) -> dict[int, list[float]]:
    """Output tok/s per concurrency, ``repeats`` times, on a ready server."""
    out: dict[int, list[float]] = {c: [] for c in concurrencies}
    for _ in range(repeats):
        for c in concurrencies:
            prompts = maker.prompts(max(requests, 4 * c) + c, workload.input_len)
            recs, _, _ = loadgen.run_level(cfg.url, cfg.served_model_name, workload, prompts, c, warmup=c)
            s = metrics.summarize(recs)
            if s["failed"]:
                raise ServebookError(f"{s['failed']} requests failed at concurrency {c}: {s['errors']}")
            out[c].append(s["output_throughput"])
    return out


def run(base: server.ServerConfig, variants: list[dict[str, Any]], log_dir: Path, workload: loadgen.Workload,
        concurrencies: list[int], requests: int = 32, repeats: int = 2, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Baseline, each variant, baseline again; return samples, noise bands and verdicts. Leaves the baseline running."""
    problems = validate_variants(variants)
    if problems:
        raise ServebookError("ab_variants:\n  - " + "\n  - ".join(problems))
    maker = loadgen.PromptMaker(loadgen.load_tokenizer(base.model_path), seed=7)
    samples: dict[str, dict[int, list[float]]] = {}
    failures: dict[str, str] = {}
    plan = [("baseline", base)] + [(v["name"], variant_config(base, v)) for v in variants] + [("baseline", base)]
    for i, (name, cfg) in enumerate(plan):
        log(f"A/B {name}: launching" + ("" if i else " (or reusing the running server)"))
        try:
            if i:  # one server at a time on the port: stop whatever holds it first
                server.stop(port=base.port)
            server.launch(cfg, log_dir / f"ab-{i:02d}-{name}", log=lambda _m: None)
            got = measure(cfg, maker, workload, concurrencies, requests, repeats)
        except ServebookError as exc:
            failures[name] = " ".join(str(exc).split())[:600] if not getattr(exc, "cause", "") else exc.cause
            log(f"A/B {name}: failed: {failures[name]}")
            continue
        for c, values in got.items():
            samples.setdefault(name, {}).setdefault(c, []).extend(values)
        log(f"A/B {name}: " + ", ".join(f"c={c} {statistics.median(v):.1f} tok/s" for c, v in got.items()))
    rows = []
    base_samples = samples.get("baseline", {})
    for c in concurrencies:
        noise = noise_band(base_samples.get(c, []))
        for v in variants:
            name = v["name"]
            if name in failures:
                rows.append({"variant": name, "concurrency": c, "verdict": "failed to start", "change": None,
                             "noise": noise, "cause": failures[name]})
                continue
            if not base_samples.get(c) or not samples.get(name, {}).get(c):
                continue
            call, change = verdict(base_samples[c], samples[name][c], noise)
            rows.append({"variant": name, "concurrency": c, "verdict": call, "change": change, "noise": noise,
                         "baseline_median": statistics.median(base_samples[c]),
                         "variant_median": statistics.median(samples[name][c]), "cause": ""})
    return {"samples": {n: {str(c): v for c, v in s.items()} for n, s in samples.items()}, "rows": rows,
            "failures": failures, "concurrencies": concurrencies, "workload": workload.__dict__}
