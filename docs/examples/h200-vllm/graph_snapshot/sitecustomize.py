"""Issue #40's lead on GLM-4.5's CUDA-graph estimate: vLLM 0.25 multiplies the device memory one second capture
took (12 MiB per PIECEWISE graph for GLM-4.5, 1 MiB for the MLA minis) by the number of graphs. This hook records
PyTorch's allocator during vLLM's profiling captures (the first four calls of ``_warmup_and_capture``, two per
graph mode) and writes, per capture, which segments it obtained from the driver and which allocations, from which
Python frames, filled them: the answer to "what does a second graph keep that the first one's pool cannot serve".

It moves what it measures: the GLM-4.5-Air mini's start at vLLM's defaults logged a torch peak of 4.63 GiB with
the hook and 3.21 GiB on four starts without it (2026-12-06, run-truth-air/repeat; its start at 2,048 batched
tokens logged the same with and without), so a start it records is kept out of every replay where another exists.

Used only by on-h200-truth.sh (SHAPES=air): ``PYTHONPATH=<this folder>:$PYTHONPATH SB_GRAPH_SNAPSHOT=DIR`` on the
truth run, one ``DIR/captures-PID.txt`` per start. Python imports ``sitecustomize`` in every process, vLLM's engine included; the hook patches
``GPUModelRunner`` when vLLM imports it and does nothing else."""

from __future__ import annotations

import os
import sys

OUT = os.environ.get("SB_GRAPH_SNAPSHOT")
TARGET = "vllm.v1.worker.gpu_model_runner"
MiB = 1 << 20


def frames(entry: dict) -> str:
    """The innermost vLLM/servebook frames of an allocation, short."""
    picked = [f for f in entry.get("frames", []) if "vllm" in f.get("filename", "")][:4]
    return " < ".join(f"{f['filename'].rsplit('vllm/', 1)[-1]}:{f['line']} {f['name']}" for f in picked)


def summarize(label: str, freed_mib: float, before: dict, after: dict) -> list[str]:
    old = {s["address"] for s in before["segments"]}
    new = [s for s in after["segments"] if s["address"] not in old]
    lines = [f"== {label}: device memory taken {freed_mib:.2f} MiB; {len(new)} new segments, "
             f"{sum(s['total_size'] for s in new) / MiB:.2f} MiB"]  # fmt: skip
    for s in new:
        lines.append(f"  segment {s['total_size'] / MiB:.2f} MiB pool {s.get('segment_pool_id')}")
        for b in s["blocks"]:
            lines.append(f"    {b['state']:>16} {b['size'] / MiB:9.3f} MiB  {frames(b)}")
    trace = after.get("device_traces", [[]])[0]
    big = [e for e in trace if e.get("action") in ("alloc", "segment_alloc") and e.get("size", 0) >= MiB]
    lines.append(f"  {len(big)} allocations of 1 MiB or more during the capture:")
    for e in big[:80]:
        lines.append(f"    {e['action']:>13} {e['size'] / MiB:9.3f} MiB  {frames(e)}")
    return lines


def patch(module) -> None:
    import torch

    runner = module.GPUModelRunner
    original = runner._warmup_and_capture
    calls = {"n": 0}

    def recorded(self, desc, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 4:  # the profiling captures only; the real ones follow
            return original(self, desc, *args, **kwargs)
        mode = kwargs.get("cudagraph_runtime_mode")
        label = f"capture {calls['n']} {getattr(mode, 'name', mode)} {desc.num_tokens} tokens"
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        before = torch.cuda.memory._snapshot()
        try:
            return original(self, desc, *args, **kwargs)
        finally:
            torch.cuda.synchronize()
            freed = (free_before - torch.cuda.mem_get_info()[0]) / MiB
            after = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            try:
                lines = summarize(label, freed, before, after)
            except Exception as e:  # a snapshot format this reading did not expect must not stop vLLM's start
                lines = [f"== {label}: device memory taken {freed:.2f} MiB; summary failed: {e!r}"]
            with open(os.path.join(OUT, f"captures-{os.getpid()}.txt"), "a") as fh:
                fh.write("\n".join(lines) + "\n")

    runner._warmup_and_capture = recorded


if OUT:
    os.makedirs(OUT, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from patch_on_import import install

    install(TARGET, patch)
