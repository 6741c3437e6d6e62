"""The plan's weights and KV tokens per GPU against what vLLM logged, one row per launched layout.

    python plan_vs_log.py --gpu-memory-mib 143771 NAME=CONFIG:TP:PP:DP:EP:SERVER_LOG[:MAX_MODEL_LEN:SEQS:TOKENS:HIT] ...

CONFIG is the checkpoint's config.json; MAX_MODEL_LEN (default 4096), SEQS (max_num_seqs), TOKENS
(max_num_batched_tokens; 0: vLLM's default) and HIT (1: the start loaded its torch.compile artefacts) are the
serving settings the reserve moves with. The plan is made here,
for as many H200s as the layout uses (NVML's memory), with servebook's planner as it stands, so the table can be re-made after the planner changes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from servebook import gpus, modelspec, planner
from servebook.planner import Parallelism
from servebook.units import GiB
from servebook.vllm_log import read_values


def logged(path: Path) -> dict:
    return read_values(path.read_text(errors="replace")).model_dump(exclude_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--gpu-memory-mib", type=int, default=143771)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    out = []
    print(
        "| launch | weights/GPU plan → vLLM | KV tokens plan → vLLM | error | activation peak | non-torch "
        "| CUDA-graph estimate | reserve plan → vLLM (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in a.rows:
        name, rest = row.split("=", 1)
        config, tp, pp, dp, ep, log, *serving = rest.split(":")
        mml, seqs, tokens, hit = [int(v) for v in serving] if serving else [4096, 0, 0, 0]
        spec = modelspec.from_config(json.loads(Path(config).read_text()), source=config)
        world = int(tp) * int(pp) * int(dp)
        device = planner.Device.for_gpu(gpus.lookup("H200"), world, memory_bytes=a.gpu_memory_mib * 2**20)
        settings = planner.Serving(max_num_seqs=seqs, max_num_batched_tokens=tokens, compile_cache_hit=hit == 1)
        plan = planner.plan(spec, device, max_model_len=mml, serving=settings)
        layout = plan.find(Parallelism(tp=int(tp), pp=int(pp), dp=int(dp), ep=ep == "1"))
        assert layout is not None and layout.reserve is not None
        got = logged(Path(log))
        kv, weights = got.get("kv_cache_tokens"), got.get("model_memory_gib")
        # what vLLM kept beside weights and KV, in the plan's terms (a share of NVML's total)
        kept = None
        if kv and weights:
            kept = (a.gpu_memory_mib * 2**20 * 0.9 - kv * layout.kv_bytes_per_token_per_gpu) / GiB - weights
        error = (layout.max_kv_tokens / kv - 1) if kv else None
        out.append(
            {
                "layout": name,
                "plan_weights_gib": layout.weight_bytes_per_gpu / GiB,
                "vllm_weights_gib": weights,
                "plan_kv_tokens": layout.max_kv_tokens,
                "vllm_kv_tokens": kv,
                "kv_error": error,
                "plan_reserve_gib": layout.reserve.total / GiB,
                "vllm_reserve_gib": kept,
                "logged": got,
            }
        )
        terms = layout.reserve.terms()

        def term(name: str, key: str) -> str:
            return f"{terms[name]:.2f} → {got[key]:.2f}" if key in got else f"{terms[name]:.2f} → —"

        print(
            f"| {name} | {layout.weight_bytes_per_gpu / GiB:.2f} → {weights} GiB | {layout.max_kv_tokens:,} → "
            f"{kv:,} | {error:+.2%} | {term('activation peak', 'activation_peak_gib')} | "
            f"{term('non-torch', 'non_torch_gib')} | {term('CUDA-graph estimate', 'graph_estimate_gib')} | "
            f"{layout.reserve.total / GiB:.2f} → {kept:.2f} |"
        )
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
