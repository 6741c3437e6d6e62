"""vLLM's CUDA-graph estimate against the layer count, beside the plan's (issue #40, 2026-12-07).

    .venv/bin/python benchmarks/graph_estimate_layers.py [RUN_FOLDER]

RUN_FOLDER (default docs/examples/h200-vllm/run-graphs) holds what on-h200-graphs.sh brought back: per start
NAME.log.gz (vLLM's log less its DEBUG lines), NAME.log.graphs.gz (its graph lines, DEBUG included) and
configs/NAME.json (NAME-again: the same folder started again, its compile cache warm; NAME-eager: with
--enforce-eager). For each start: each mode's first capture and per-graph charge as vLLM logged them, its total,
the plan's total, the profile's torch peak (vLLM's DEBUG line, the activation) against the plan's, weights and
KV memory as vLLM logged them / as planned (GiB), and the plan's KV tokens against
vLLM's with the plan's band and whether it holds vLLM's figure.
"""

from __future__ import annotations

import gzip
import re
import sys
from pathlib import Path

from servebook import gpus, modelspec, planner
from servebook.vllm_log import read_values

ROOT = Path(__file__).resolve().parents[1]
MODE = re.compile(r"Estimated (FULL|PIECEWISE) CUDA graph memory: ([\d.]+) MiB first-capture \+ \((\d+)-1\) × ([\d.]+)")
PEAK = re.compile(r"torch peak memory increase: ([\d.]+)GiB")
MiB = 2**20


def device_of(folder: Path) -> planner.Device:
    """The GPU the starts ran on, from nvidia-smi's "name, memory.total [MiB]" line in gpu.txt."""
    name, memory = (part.strip() for part in (folder / "gpu.txt").read_text().splitlines()[0].split(","))
    return planner.Device.for_gpu(gpus.lookup(name), 1, memory_bytes=int(memory.split()[0]) * MiB)


def main(folder: Path) -> None:
    device = device_of(folder)
    print(f"on {device.name}, vLLM 0.25 at its defaults, max_model_len 4096")
    print(f"{'start':<10} {'layers':>6} {'FULL first':>10} {'PW first':>9} {'PW each':>8} {'logged GiB':>10} "
          f"{'plan GiB':>8} {'peak GiB':>11} {'weights':>13} {'KV GiB':>13} {'KV vLLM':>11} {'KV plan':>11} {'error':>7} "
          f"{'band':>7} held")  # fmt: skip
    for graphs in sorted(folder.glob("*.log.graphs.gz"), key=lambda p: (p.name.split("-")[0], len(p.name), p.name)):
        name = graphs.name.removesuffix(".log.graphs.gz")
        lines = gzip.open(graphs, "rt").read()
        modes = {m[0]: (float(m[1]), int(m[2]), float(m[3])) for m in MODE.findall(lines)}
        peak = PEAK.search(lines)
        log = gzip.open(folder / f"{name}.log.gz", "rt").read()
        values = read_values(log)
        spec = modelspec.load(str(folder / "configs" / f"{name.removesuffix('-again').removesuffix('-eager')}.json"))
        serving = planner.Serving(
            vllm_version="0.25.0", enforce_eager=name.endswith("-eager"), compile_cache_hit=name.endswith("-again")
        )
        planned = planner.plan(spec, device, max_model_len=4096, serving=serving)
        layout = planned.layouts[0]
        full, pw = modes.get("FULL", (0, 0, 0)), modes.get("PIECEWISE", (0, 0, 0))
        kv = values.kv_cache_tokens
        error = f"{100 * (layout.max_kv_tokens / kv - 1):+6.2f}%" if kv else ""
        band = layout.bands["kv_tokens"]
        weights = f"{values.model_memory_gib or 0:.2f}/{layout.weight_bytes_per_gpu / 2**30:.2f}"
        kv_gib = f"{values.kv_cache_memory_gib or 0:.2f}/{layout.available_kv_bytes_per_gpu / 2**30:.2f}"
        peaks = f"{float(peak[1]) if peak else float('nan'):.2f}/{layout.reserve.activation / 2**30:.2f}"
        print(f"{name:<10} {spec.layers:>6} {full[0]:>10.0f} {pw[0]:>9.0f} {pw[2]:>8.0f} "
              f"{values.graph_estimate_gib or 0:>10.2f} {layout.reserve.cuda_graphs / 2**30:>8.2f} {peaks:>11} "
              f"{weights:>13} {kv_gib:>13} {kv or 0:>11,} {layout.max_kv_tokens:>11,} {error:>7} "
              f"{100 * band.band:>6.2f}% {'yes' if kv and band.contains(kv) else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "examples" / "h200-vllm" / "run-graphs")
