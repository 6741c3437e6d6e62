"""The block-FP8 MLA activation peak's five constants (``sizing.MLA_FP8_*``), refitted from vLLM's own logs.

    .venv/bin/python benchmarks/mla_fp8_activation_fit.py

Reads every start of docs/examples/h200-vllm/run-truth-heads (DeepSeek-V3-shaped minis at 16, 32, 64 and 128
heads, vLLM 0.25 at DEBUG on an H100) and fits the peak as ``kept + max(transient, sampler)`` in two linear steps:
where the sampler sets the peak (64 heads or fewer at 1,024 requests), what the forward keeps is the logged peak
less the sampler's 16 bytes per logit, a line in fused_moe's workspace; where the forward sets it (128 heads, or
128 requests), its transient part is the peak less that, a line in the GPU's own batched tokens and in requests
times the fourth power of heads per GPU. Prints the constants beside the ones servebook uses, then the plan's
peak against vLLM's for those starts and for the starts the fit did not see (run-truth-h100's DeepSeek-V3,
Kimi-K2 and 64-head minis, and run-truth-small's Moonlight-like mini at hidden 2048, where the plan scales the
transient part by the hidden size: every fitted start has DeepSeek-V3's 7,168).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from servebook import gpus, modelspec, planner
from servebook.planner import sizing
from servebook.vllm_log import read_values

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "examples" / "h200-vllm"
CONFIGS = REPO / "tests" / "fixtures" / "configs"
GiB = 2**30
SETTINGS = {"defaults": (4096, 0, 0), "batched 2048": (4096, 0, 2048), "8k context": (8192, 0, 0),
            "max_num_seqs 128": (4096, 128, 0), "batched 2048, 8k context": (8192, 0, 2048)}  # fmt: skip
HELD_OUT_CONFIGS = {"dsv3-fp8": "dsv3-shapes-2l-fp8", "kimi-k2-fp8": "kimi-k2-shapes-2l-fp8",
                    "dsv3-64h-fp8": "dsv3-64h-shapes-2l-fp8"}  # fmt: skip
H100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81559 * 2**20)


def starts(folder: Path, config_of, models=None) -> list[tuple[str, modelspec.ModelSpec, tuple, float]]:
    """(name, spec, setting, vLLM's logged peak in GiB) of every start in a truth_run.py folder (of ``models``)."""
    out = []
    for row in json.loads((folder / "truth.json").read_text()):
        model, setting = row["start"].split(", ", 1)
        if models is not None and model not in models:
            continue
        log = (folder / f"{model}-{setting.replace(' ', '-').replace(',', '')}.log").read_text()
        peak = read_values(log).activation_peak_gib
        if peak is not None:
            out.append((row["start"], modelspec.load(str(config_of(folder, model))), SETTINGS[setting], peak))
    return out


def workspace(spec: modelspec.ModelSpec, tokens: int) -> float:
    """fused_moe's workspaces at ``tokens`` in GiB on one GPU, as the plan counts them."""
    return sizing.moe_workspace_bytes(spec, planner.plan(spec, H100).layouts[0], tokens) / GiB


def main() -> None:
    fit = [s for d in sorted((RUNS / "run-truth-heads").iterdir()) if d.is_dir()
           for s in starts(d, lambda f, m: f / f"{m}-config.json")]  # fmt: skip
    held = starts(RUNS / "run-truth-h100", lambda f, m: CONFIGS / f"{HELD_OUT_CONFIGS[m]}.json", HELD_OUT_CONFIGS)
    held += starts(RUNS / "run-truth-small", lambda f, m: f / f"{m}-config.json")
    tokens = {n: (b or 8192) for n, _, (_, _, b), _ in fit}
    requests = {n: min(s or 1024, tokens[n]) for n, _, (_, s, _), _ in fit}
    sampler = {n: 16 * requests[n] * spec.vocab / GiB for n, spec, _, _ in fit}
    by_sampler = [f for f in fit if f[1].heads <= 64 and requests[f[0]] == 1024]
    a = np.array([[1, workspace(spec, tokens[n])] for n, spec, _, _ in by_sampler])
    kept_bytes, kept_per_moe = np.linalg.lstsq(a, [p - sampler[n] for n, _, _, p in by_sampler], rcond=None)[0]
    by_forward = [f for f in fit if f not in by_sampler]
    rows = [[1, tokens[n] * 1e3 / GiB, requests[n] * (spec.heads / 128) ** 4 * 1e6 / GiB]
            for n, spec, _, _ in by_forward]  # fmt: skip
    left = [p - kept_bytes - kept_per_moe * workspace(spec, tokens[n]) for n, spec, _, p in by_forward]
    t_bytes, t_per_token, t_per_request = np.linalg.lstsq(np.array(rows), left, rcond=None)[0]
    print(f"{len(by_sampler)} starts where the sampler sets the peak, {len(by_forward)} where the forward does")
    for name, refit, used in (
        ("kept, GiB", kept_bytes, sizing.MLA_FP8_KEPT_BYTES / GiB),
        ("kept per workspace", kept_per_moe, sizing.MLA_FP8_KEPT_PER_MOE),
        ("transient, GiB", t_bytes, sizing.MLA_FP8_TRANSIENT_BYTES / GiB),
        ("transient per batched token, bytes", t_per_token * 1e3, sizing.MLA_FP8_TRANSIENT_BYTES_PER_TOKEN),
        ("transient per request at 128 heads, bytes", t_per_request * 1e6, sizing.MLA_FP8_TRANSIENT_BYTES_PER_REQUEST_AT_128_HEADS),
    ):  # fmt: skip
        print(f"  {name:44} refit {refit:10.4g}   servebook {used:10.4g}")
    for title, group in (("fitted on", fit), ("held out", held)):
        print(f"\n{title}: vLLM's peak → the plan's (GiB)")
        for name, spec, (max_model_len, seqs, batched), peak in group:
            serving = planner.Serving(seqs, batched, vllm_version="0.25.0")
            layout = planner.plan(spec, H100, max_model_len=max_model_len, serving=serving).layouts[0]
            assert layout.reserve is not None
            print(f"  {name:42} {peak:5.2f} → {layout.reserve.activation / GiB:5.2f} "
                  f"({layout.reserve.activation / GiB - peak:+.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
