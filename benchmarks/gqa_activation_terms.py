"""The GQA activation peak term by term against every GLM-4.5-shaped start vLLM logged at DEBUG (issue #40).

    .venv/bin/python benchmarks/gqa_activation_terms.py

For each start (docs/examples/h200-vllm: run-truth-h100 and run-truth-glm for GLM-4.5 at 2 layers, run-truth-air
for the Air at 4, run-profile-peak for GLM-4.5 at 4 layers and the Air at 2, 8 and 16; one H100, vLLM 0.25) prints vLLM's
torch peak, the plan's code-read terms for a warm start (the sampler, fused_moe's Triton workspaces, what the
forward keeps), what the cold start kept beyond them (the compile's garbage, freed by gc.collect()), and the
plan's first-contact KV tokens against vLLM's with its band; then the garbage's spread against the point the plan
charges (sizing.GQA_COMPILE_MISS_HIDDEN_TENSORS) in hidden-sized bf16 tensors per batched token.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from servebook import gpus, modelspec, planner
from servebook.planner import sizing
from servebook.vllm_log import read_values

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "docs" / "examples" / "h200-vllm"
GiB = 2**30
H100 = planner.Device.for_gpu(gpus.lookup("NVIDIA H100 80GB HBM3"), 1, memory_bytes=81559 * 2**20)
SETTINGS = {"defaults": (4096, 0, 0), "max_num_seqs 128": (4096, 128, 0), "batched 2048, 8k context": (8192, 0, 2048),
            "max_num_seqs 512": (4096, 512, 0), "batched 4096": (4096, 0, 4096)}  # fmt: skip
GLM_2L = REPO / "tests" / "fixtures" / "configs" / "glm45-shapes-2l-mtp1-fp8.json"
STARTS = [  # (folder, model, config, settings)
    ("run-truth-h100", "glm45-fp8-mtp", GLM_2L, ("defaults", "max_num_seqs 128", "batched 2048, 8k context")),
    ("run-truth-glm", "glm45-fp8-mtp", GLM_2L, ("max_num_seqs 512", "batched 4096")),
    ("run-profile-peak", "glm45-4l-fp8", None, ("defaults",)),
    ("run-truth-air", "glm45-air-fp8-mtp", None, ("defaults", "max_num_seqs 128", "batched 2048, 8k context")),
    ("run-profile-peak", "glm45-air-2l-fp8", None, ("defaults",)),
    ("run-profile-peak", "glm45-air-8l-fp8", None, ("defaults",)),
    ("run-profile-peak", "glm45-air-16l-fp8", None, ("defaults",)),
]


def plan(shape: modelspec.ModelSpec, setting: str, warm: bool) -> planner.Layout:
    max_model_len, seqs, batched = SETTINGS[setting]
    serving = planner.Serving(seqs, batched, vllm_version="0.25.0", compile_cache_hit=warm)
    return planner.plan(shape, H100, max_model_len=max_model_len, serving=serving).layouts[0]


def main() -> None:
    print(f"{'start':<58} {'vLLM':>6} {'warm plan':>9} {'sampler':>7} {'kept':>6} {'left':>6} {'KV first contact':>17}")
    left_per_token = []
    for folder, model, config, settings in STARTS:
        shape = modelspec.load(str(config or RUNS / folder / f"{model}-config.json"))
        for setting in settings:
            log = RUNS / folder / f"{model}-{setting.replace(' ', '-').replace(',', '')}.log"
            logged = read_values(log.read_text())
            warm, cold = plan(shape, setting, warm=True), plan(shape, setting, warm=False)
            assert warm.reserve is not None and cold.reserve is not None
            r = warm.reserve
            left = logged.activation_peak_gib - r.activation / GiB
            if r.sampler >= r.transient:  # where the sampler sets the peak, what is left is the compile's garbage
                left_per_token.append(left * GiB / (r.tokens * shape.hidden * 2))
            kv = cold.max_kv_tokens / logged.kv_cache_tokens - 1
            band = cold.bands["kv_tokens"]
            print(f"{folder + ' ' + model + ', ' + setting:<58} {logged.activation_peak_gib:6.2f} "
                  f"{r.activation / GiB:9.2f} {r.sampler / GiB:7.2f} {(r.forward - r.transient) / GiB:6.2f} "
                  f"{left:+6.2f} {100 * kv:+7.2f} % ±{100 * band.band:.2f} {'in' if band.contains(logged.kv_cache_tokens) else 'OUT'}")  # fmt: skip
    print(f"\nleft by a cold compile, hidden-sized bf16 tensors per batched token, where the sampler sets the peak:"
          f" {', '.join(f'{x:.1f}' for x in sorted(left_per_token))}; median {statistics.median(left_per_token):.1f}"
          f" (the plan charges {sizing.GQA_COMPILE_MISS_HIDDEN_TENSORS}; its band reaches none and"
          f" sizing.gqa_compile_garbage_bound)")  # fmt: skip


if __name__ == "__main__":
    main()
