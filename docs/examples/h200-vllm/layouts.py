"""Start vLLM once per layout, read what it logged about memory, and stop it.

    python layouts.py PARAMS NAME=MODEL:TP:PP:DP:EP ... --out DIR

Each layout starts from PARAMS with its model folder and parallel sizes (EP: 1 or 0), with vLLM's DEBUG log
(for its memory profile), and is stopped once vLLM has logged its KV cache size: weights, activation peak,
non-torch memory, CUDA-graph share and KV tokens are all known by then. A layout vLLM refuses is recorded
with vLLM's own root cause. Writes DIR/layouts.json (one object per layout) and keeps every server log.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from servebook import server
from servebook.errors import LaunchError
from servebook.params import Params
from servebook.server import ServerConfig
from servebook.vllm_log import read_values


class Sized(Exception):
    """vLLM has logged its KV cache size: enough for this probe."""


def probe(p: Params, out: Path, name: str) -> dict:
    cfg = ServerConfig.from_params(p, "cuda" if p.device == "cuda" else "cpu")
    folder = out / name
    t0 = time.monotonic()

    def on_progress(said: str, elapsed: float) -> None:
        print(f"  [{elapsed:6.1f} s] {said}", flush=True)
        if said.startswith("KV cache:") or "; KV cache:" in said:
            raise Sized

    row: dict = {"layout": name, "model": p.model, "flags": cfg.layout.flags()}
    try:
        server.launch(cfg, folder, stop_leftovers=True, on_progress=on_progress, log=lambda m: print(" ", m))
        row["outcome"] = "ready"
        server.stop(port=cfg.port)
    except Sized:
        row["outcome"] = "sized"
    except LaunchError as exc:
        row["outcome"] = "refused"
        row["cause"] = exc.cause
    row["seconds"] = round(time.monotonic() - t0, 1)
    logs = sorted(folder.glob("server*.log"))
    if logs:
        row["logged"] = read_values(logs[-1].read_text(errors="replace")).model_dump(exclude_none=True)
        row["log"] = str(logs[-1])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("params", type=Path)
    ap.add_argument("layouts", nargs="+", help="NAME=MODEL:TP:PP:DP:EP")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    base = yaml.safe_load(a.params.read_text())
    base["extra_env"] = {**base.get("extra_env", {}), "VLLM_LOGGING_LEVEL": "DEBUG"}
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in a.layouts:
        name, rest = spec.split("=", 1)
        model, tp, pp, dp, ep = rest.rsplit(":", 4)
        p = Params(
            **{
                **base,
                "model": model,
                "tensor_parallel_size": int(tp),
                "pipeline_parallel_size": int(pp),
                "data_parallel_size": int(dp),
                "enable_expert_parallel": ep == "1",
                "run_name": name,
            }
        )
        print(f"{name}: {model} TP={tp} PP={pp} DP={dp} EP={ep}", flush=True)
        rows.append(probe(p, a.out, name))
        print(json.dumps(rows[-1]), flush=True)
        (a.out / "layouts.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
