"""Issue #40's lead on the GQA activation: what vLLM 0.25's profile run holds at its torch peak. The GLM-4.5 mini
kept 239 kB per batched token beside its sampler, the GLM-4.5-Air and Qwen3-235B minis 137 kB (run-truth-h100,
run-truth-air, run-truth); fused_moe's Triton workspaces alone are 164 and 131 kB. This hook records PyTorch's
allocator through ``GPUModelRunner.profile_run`` and writes, at the peak of the whole run and at the forward's own
peak, which allocations were alive, from which Python frames: the answer to "what is the rest" (run-profile-peak,
2026-12-06): the output hidden states, and on a start that compiles, forward tensors the compile's run left in
reference cycles until profile_run's gc.collect() (SB_PROFILE_GC=collect runs the collector first; none are left).

Used only by on-h200-truth.sh (PEAK=1): ``PYTHONPATH=<this folder>:$PYTHONPATH SB_PROFILE_PEAK=DIR`` on the truth
run, one ``DIR/peak-PID.txt`` per start. Python imports ``sitecustomize`` in every process, vLLM's engine included;
the hook patches ``GPUModelRunner`` when vLLM imports it and does nothing else. It never resets torch's peak
counters, which vLLM's own figure is read from."""

from __future__ import annotations

import collections
import os
import sys

OUT = os.environ.get("SB_PROFILE_PEAK")
# SB_PROFILE_GC=collect runs Python's garbage collector before the sampler; =off keeps it off through the profile
# run: whether what the forward leaves alive is garbage in reference cycles awaiting the collector
GC = os.environ.get("SB_PROFILE_GC", "")
TARGET = "vllm.v1.worker.gpu_model_runner"
MiB = 1 << 20


def where(entry: dict) -> str:
    """The innermost frames of an allocation that say what asked for it: vLLM's own, or compiled code's."""
    keep = [
        f for f in entry.get("frames", []) if any(k in f.get("filename", "") for k in ("vllm", "inductor", "/tmp/"))
    ]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in keep[:5]) or "?"


def replay(trace: list[dict], base: int, stop: int | None = None) -> tuple[int, int, dict, int]:
    """(peak bytes, index of the peak, live allocations and bytes allocated at ``stop``) from the allocator's trace."""
    live: dict[int, dict] = {}
    current = peak = base
    at = -1
    for i, event in enumerate(trace if stop is None else trace[: stop + 1]):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
            current -= event["size"]
        if current > peak:
            peak, at = current, i
    return peak, at, live, current


def describe(label: str, peak: int, base: int, live: dict) -> list[str]:
    by_site: dict[str, list[int]] = collections.defaultdict(list)
    for event in live.values():
        by_site[where(event)].append(event["size"])
    rows = sorted(by_site.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"== {label}: {(peak - base) / MiB:.1f} MiB above the start; {sum(map(sum, by_site.values())) / MiB:.1f}"
             f" MiB in {len(live)} allocations made during the run"]  # fmt: skip
    for site, sizes in rows[:40]:
        shown = ", ".join(f"{s / MiB:.2f}" for s in sorted(sizes, reverse=True)[:6])
        lines.append(f"  {sum(sizes) / MiB:9.2f} MiB  x{len(sizes):<4} [{shown}]  {site}")
    return lines


def patch(module) -> None:
    import gc

    import torch

    runner = module.GPUModelRunner
    original = runner.profile_run
    sampler_run = runner._dummy_sampler_run

    def collected_first(self, *args, **kwargs):
        if GC == "collect":
            gc.collect()
        return sampler_run(self, *args, **kwargs)

    runner._dummy_sampler_run = collected_first

    def recorded(self, *args, **kwargs):
        torch.cuda.synchronize()
        base, peak_before = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=3_000_000, stacks="python")
        if GC == "off":
            gc.disable()
        try:
            return original(self, *args, **kwargs)
        finally:
            gc.enable()
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            lines = [f"profile_run (SB_PROFILE_GC={GC or 'unset'}): allocated {base / MiB:.1f} MiB at its start; torch's peak {peak_before / MiB:.1f}"
                     f" MiB before it, {torch.cuda.max_memory_allocated() / MiB:.1f} after"]  # fmt: skip
            try:
                trace = snapshot.get("device_traces", [[]])[torch.cuda.current_device()]
                lines.append(f"  {len(trace)} allocator events")
                peak, at, *_ = replay(trace, base)
                lines += describe("whole run's peak", peak, base, replay(trace, base, at)[2])
                sampler = next((i for i, e in enumerate(trace) if "_dummy_sampler_run" in str(e.get("frames"))), None)
                if sampler is not None:
                    forward_peak, forward_at, *_ = replay(trace[:sampler], base)
                    lines += describe("forward's peak", forward_peak, base, replay(trace, base, forward_at)[2])
                    _, _, kept, now = replay(trace, base, sampler - 1)
                    lines += describe("kept when the sampler starts", now, base, kept)
            except Exception as e:  # a snapshot format this reading did not expect must not stop vLLM's start
                lines.append(f"  reading failed: {e!r}")
            with open(os.path.join(OUT, f"peak-{os.getpid()}.txt"), "a") as fh:
                fh.write("\n".join(lines) + "\n")

    runner.profile_run = recorded


if OUT:
    os.makedirs(OUT, exist_ok=True)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from patch_on_import import install

    install(TARGET, patch)
