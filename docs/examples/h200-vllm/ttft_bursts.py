"""Time to first token against how many requests left together, for every client of a client_vs_vllm.py run.

    python ttft_bursts.py DIR [--requests requests.csv.gz]

At a fixed concurrency with requests of one length, requests finish and start again in step, so they reach the
server in bursts; a request's TTFT then depends on how many others arrived with it. This groups every measured
request by the size of its burst (requests sent less than 2 ms apart) and prints the median TTFT per client and
burst size: where the clients agree within a burst size, they time the same thing and differ in how bursty
their traffic became. Reads servebook-*.parquet and vllm-*.json (``--save-detailed``) from DIR; --requests
writes the per-request table (client, round, burst size, TTFT) it was made from.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

BURST_GAP_S = 0.002
BUCKETS = [0, 1, 2, 4, 8, 10_000]
BUCKET_NAMES = ["1", "2", "3-4", "5-8", "9+"]


def burst_sizes(starts: np.ndarray) -> np.ndarray:
    """For each request, how many were sent with it (a chain of sends each less than BURST_GAP_S apart)."""
    order = np.argsort(starts)
    label = np.concatenate([[0], np.cumsum(np.diff(starts[order]) >= BURST_GAP_S)])
    sizes = np.bincount(label)[label]
    out = np.empty(len(starts), dtype=int)
    out[order] = sizes
    return out


def requests(folder: Path) -> pd.DataFrame:
    clients = {"servebook": "servebook", "servebook-usage-each-chunk": "servebook, usage on every chunk"}
    frames = []
    for path in sorted(folder.glob("servebook*.parquet")):
        m = re.fullmatch(r"(servebook(?:-usage-each-chunk)?)-c(\d+)-r(\d+)", path.stem)
        if not m:
            continue
        f = pd.read_parquet(path, columns=["warmup", "send", "first_chunk", "error"])
        f = f[~f.warmup & (f.error == "")]
        frames.append(
            pd.DataFrame(
                {
                    "client": clients[m[1]],
                    "concurrency": int(m[2]),
                    "round": int(m[3]),
                    "burst": burst_sizes(f.send.to_numpy()),
                    "ttft_ms": (f.first_chunk - f.send).to_numpy() * 1000,
                }
            )
        )
    for path in sorted(folder.glob("vllm-*.json")):
        m = re.fullmatch(r"vllm-c(\d+)-r(\d+)", path.stem)
        if not m:
            continue
        d = json.loads(path.read_text())
        ok = np.array([not e for e in d["errors"]])
        frames.append(
            pd.DataFrame(
                {
                    "client": "vllm bench serve",
                    "concurrency": int(m[1]),
                    "round": int(m[2]),
                    "burst": burst_sizes(np.array(d["start_times"])[ok]),
                    "ttft_ms": np.array(d["ttfts"])[ok] * 1000,
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(size=pd.cut(df.burst, BUCKETS, labels=BUCKET_NAMES))
    by = df.groupby(["size", "client"], observed=True).ttft_ms
    out = pd.concat({"TTFT p50 ms": by.median().round(1), "requests": by.size()}, axis=1).unstack("client")
    out.loc["all"] = pd.concat(
        {
            "TTFT p50 ms": df.groupby("client").ttft_ms.median().round(1),
            "requests": df.groupby("client").size(),
        }
    )
    out.loc["mean burst"] = pd.concat(
        {
            "TTFT p50 ms": df.groupby("client").burst.mean().round(1),
            "requests": df.groupby("client").size() * np.nan,
        }
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--requests", type=Path, help="write the per-request table here (csv, .gz compresses)")
    a = ap.parse_args()
    df = requests(a.folder)
    if a.requests:
        df.round({"ttft_ms": 2}).to_csv(a.requests, index=False)
    for c, part in df.groupby("concurrency"):
        print(f"concurrency {c}: median TTFT (ms) by burst size, and requests per burst size")
        print(table(part).to_string())


if __name__ == "__main__":
    main()
