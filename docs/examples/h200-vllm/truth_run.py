"""Issue #40 on one H200: two checkpoint shapes no fit of the reserve has seen, each started by a plain
``vllm serve`` (vLLM's own defaults, no servebook flag) at its defaults and at two other settings; for every start
the plan's first-contact figures with their bands against what vLLM logged, then the figures once the history
holds the default start of that signature.

    python3 truth_run.py OUT_DIR MODEL_DIR...        (on the H200, with the kit's environment)

Writes OUT_DIR/truth.json (every figure) and OUT_DIR/truth.md (the table) and each start's log."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pynvml

from servebook import gpus, modelspec, planner, vllm_defaults
from servebook.planner import truth
from servebook.vllm_log import read_values

VLLM = "0.25.0"
SETTINGS = [  # (name, max_model_len, max_num_seqs, max_num_batched_tokens): 0 leaves vLLM's default
    ("defaults", 4096, 0, 0),
    ("max_num_seqs 128", 4096, 128, 0),
    ("batched 2048, 8k context", 8192, 0, 2048),
    # the FP8-MLA activation's tokens and context apart (issue #40, 2026-12-05)
    ("batched 2048", 4096, 0, 2048),
    ("8k context", 8192, 0, 0),
    # GLM-4.5's activation at vLLM's defaults apart: half the requests, half the tokens (2026-12-05)
    ("max_num_seqs 512", 4096, 512, 0),
    ("batched 4096", 4096, 0, 4096),
]


# TRUTH_SETTINGS="defaults;batched 2048, 8k context" runs those alone (names as above, separated by ";"); unset,
# the first three
CHOSEN = [
    s for s in SETTINGS if s[0] in os.environ.get("TRUTH_SETTINGS", ";".join(n for n, *_ in SETTINGS[:3])).split(";")
]


def this_gpu() -> planner.Device:
    """The card this runs on, by NVML's name (an H200, or the H100 a call for one may get)."""
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
    return planner.Device.for_gpu(gpus.lookup(pynvml.nvmlDeviceGetName(handle)), 1, memory_bytes=total)


def start(model: str, log: Path, max_model_len: int, seqs: int, batched: int) -> float:
    """A plain ``vllm serve`` until its API is up (or it dies); stopped, its whole group, before returning."""
    cmd = ["vllm", "serve", model, "--host", "127.0.0.1", "--port", "8011", "--max-model-len", str(max_model_len)]
    cmd += ["--max-num-seqs", str(seqs)] if seqs else []
    cmd += ["--max-num-batched-tokens", str(batched)] if batched else []
    # TRUTH_LOAD_FORMAT=dummy starts as servebook's rehearsal does: random weights, the same compile key
    cmd += ["--load-format", os.environ["TRUTH_LOAD_FORMAT"]] if os.environ.get("TRUTH_LOAD_FORMAT") else []
    began = time.monotonic()
    # DEBUG logs vLLM's memory profile term by term (activation peak, non-torch) and each graph mode's estimate
    env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("TRUTH_LOG_LEVEL", "DEBUG"))
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        while time.monotonic() - began < 480 and proc.poll() is None:
            if "Application startup complete" in log.read_text(errors="replace"):
                break
            time.sleep(2)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a start that failed has taken its group with it
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        time.sleep(3)
    return time.monotonic() - began


def planned(
    spec: modelspec.ModelSpec, device: planner.Device, setting: tuple, history=(), compile_cache_hit: bool = False
) -> planner.Layout:
    _, max_model_len, seqs, batched = setting
    serving = planner.Serving(seqs, batched, compile_cache_hit=compile_cache_hit, vllm_version=VLLM)
    return planner.plan(spec, device, max_model_len=max_model_len, serving=serving, history=history).layouts[0]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    device = this_gpu()
    rows = []
    for model in sys.argv[2:]:
        spec = modelspec.load(model)
        # the config the replay tests plan from, as the checkpoint on the GPU machine had it
        (out / f"{Path(model).name}-config.json").write_text((Path(model) / "config.json").read_text())
        history: list[truth.Measured] = []
        for setting in CHOSEN:
            name = f"{Path(model).name}, {setting[0]}"
            log = out / f"{Path(model).name}-{setting[0].replace(' ', '-').replace(',', '')}.log"
            seconds = start(model, log, *setting[1:])
            v = read_values(log.read_text(errors="replace"))
            first = planned(spec, device, setting)
            learned = planned(spec, device, setting, history) if history else None
            warm = planned(spec, device, setting, compile_cache_hit=True)
            row = {
                "start": name, "seconds": round(seconds, 1), "signature": first.signature,
                "gpu": device.name, "gpu_memory_bytes": device.memory_bytes,
                "provenance": first.provenance, "logged_kv": v.kv_cache_tokens, "logged_weights_gib": v.model_memory_gib,
                "logged_activation_gib": v.activation_peak_gib, "logged_graphs_gib": v.graph_estimate_gib,
                "logged_non_torch_gib": v.non_torch_gib,
                "plan_terms_gib": {k: round(b.value, 3) for k, b in first.bands.items() if k.endswith("_gib")},
                "logged_share": v.gpu_memory_utilization, "planned_share": vllm_defaults.for_version(VLLM).gpu_memory_utilization,
                "plan_kv": first.max_kv_tokens, "kv_band": first.bands["kv_tokens"].band,
                "compile_cache": v.compile_cache, "load_format": os.environ.get("TRUTH_LOAD_FORMAT", "auto"),
                "plan_kv_warm": warm.max_kv_tokens, "kv_band_warm": warm.bands["kv_tokens"].band,
                "plan_weights_gib": first.weight_bytes_per_gpu / 2**30, "weights_band": first.bands["weights_gib"].band,
                "files_gb": (spec.checkpoint_bytes or 0) / 1e9, "mtp_skipped_gb": (spec.skipped_bytes or 0) / 1e9,
                "learned_kv": learned.max_kv_tokens if learned else None,
                "learned_band": learned.bands["kv_tokens"].band if learned else None,
                "learned_provenance": learned.provenance if learned else None,
                "learned_basis": learned.kv_basis if learned else None,
                "error": "" if v.kv_cache_tokens else log.read_text(errors="replace")[-1500:],
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row)[:600], flush=True)
            if v.kv_cache_tokens and not history:
                history.append(truth.learned(first, device.name, VLLM, "launch", v.kv_cache_tokens,
                                             weight_gib=v.model_memory_gib, graph_gib=v.graph_estimate_gib))  # fmt: skip
            (out / "truth.json").write_text(json.dumps(rows, indent=2))
    lines = ["| start | KV: vLLM | plan (first contact) | error | band | inside | with history | error | band | "
             "weights: vLLM → plan GiB | error |", "|" + "---|" * 11]  # fmt: skip
    for r in rows:
        if not r["logged_kv"]:
            lines.append(f"| {r['start']} | did not start | | | | | | | | | |")
            continue
        err = 100 * (r["plan_kv"] / r["logged_kv"] - 1)
        inside = abs(err) <= 100 * r["kv_band"]
        learned = (f"{r['learned_kv']:,} | {100 * (r['learned_kv'] / r['logged_kv'] - 1):+.2f} % | "
                   f"±{100 * r['learned_band']:.2f} % ({r['learned_provenance']})") if r["learned_kv"] else "— | | "  # fmt: skip
        werr = 100 * (r["plan_weights_gib"] / r["logged_weights_gib"] - 1) if r["logged_weights_gib"] else 0
        lines.append(
            f"| {r['start']} | {r['logged_kv']:,} | {r['plan_kv']:,} | {err:+.2f} % | ±{100 * r['kv_band']:.2f} % "
            f"({r['provenance']}) | {'yes' if inside else '**no**'} | {learned} | "
            f"{r['logged_weights_gib']} → {r['plan_weights_gib']:.2f} | {werr:+.2f} % |"
        )
    (out / "truth.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
