"""Download rate over loopback from a real hub-compatible server, and verification cost per GB.

    .venv/bin/python benchmarks/download_rate.py [--gb 1.0] [--shards 4]

Builds a checkpoint of random bf16 tensors (safetensors shards, an index, the tiny model's
config and tokenizer) as a git repository, serves it with olah offline on 127.0.0.1 (from
.venv-olah, created by the download tests or here), runs `servebook download` against it,
and prints bytes, seconds, MB/s and the verification's seconds per GB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the hub mirror the download tests use
from tests.support import hub_mirror  # noqa: E402


def build_checkpoint(folder: Path, gb: float, shards: int) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from servebook import models

    tiny = models.build_tiny_model()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, folder / name)
    per_shard = int(gb * 1e9 / shards)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensor = rng.integers(0, 2**16, size=per_shard // 2, dtype=np.uint16)
        save_file({f"layer{i}.weight": tensor}, str(folder / name))
        weight_map[f"layer{i}.weight"] = name
        total += tensor.nbytes
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--shards", type=int, default=4)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="servebook-dl-"))
    try:
        mirror = root / "mirrors" / "models" / "bench" / "random-ckpt"
        mirror.mkdir(parents=True)
        t = time.monotonic()
        build_checkpoint(mirror, args.gb, args.shards)
        hub_mirror.commit_mirror(root, "bench/random-ckpt")
        print(f"built and committed {args.gb:.2f} GB in {time.monotonic() - t:.1f} s")
        with hub_mirror.serving(root) as endpoint:
            params = root / "p.yaml"
            params.write_text(f"run_name: bench\nmodel: bench/random-ckpt\nmodel_store: {root / 'store'}\n")
            env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
            env.update(
                HF_ENDPOINT=endpoint,
                HF_HOME=str(root / "hf"),
                SERVEBOOK_OUTPUTS=str(root / "out"),
                HF_HUB_DISABLE_XET="1",
            )
            t = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "servebook.cli", "download", str(params)],
                env=env,
                capture_output=True,
                text=True,
            )
            wall = time.monotonic() - t
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])
            run_dir = Path(proc.stdout.strip().splitlines()[-1])
            got = json.loads((run_dir / "02_download.json").read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    f, v = got["fetch"], got["verification"]
    print(
        f"downloaded {f['bytes_fetched'] / 1e9:.2f} GB in {f['seconds']:.1f} s: {f['rate_bytes_s'] / 1e6:.0f} MB/s "
        f"({wall:.1f} s for the whole command)"
    )
    print(
        f"verified {v['checked_bytes'] / 1e9:.2f} GB in {v['seconds']:.1f} s: {v['seconds_per_gb']:.2f} s per GB "
        f"(git blob SHA-1 of every file, safetensors headers, index)"
    )


if __name__ == "__main__":
    main()
