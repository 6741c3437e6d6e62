"""What each measurement of a client comparison did to the server, from the clients' own request timelines.

    python compare_windows.py DIR [DIR ...] [--requests OUT.csv.gz]

DIR is a folder client_vs_vllm.py wrote (servebook-*.parquet and vLLM's --save-detailed vllm-*.json). For
every measurement it prints the requests in flight on average (summed request time over the window), how the
requests reached the server (the mean size of the groups sent within 1 ms of each other: one group shares one
prefill step), and, request by request, whether a request's TPOT grew with the groups that arrived while it
decoded (slope and correlation): a test of whether one client's arrivals slowed the server's decode steps.
With --requests it writes every measured request (warm-ups excluded) as one CSV row: client, concurrency,
round, send time from the window's first send, TTFT, TPOT and end-to-end latency in ms, output tokens.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

NAME = re.compile(r"^(?P<client>.+)-c(?P<c>\d+)-r(?P<r>\d+)$")


def servebook_window(path: Path) -> pd.DataFrame:
    d = pd.read_parquet(path)
    d = d[~d.warmup & (d.error == "")]
    return pd.DataFrame(
        {"send": d.send, "first": d.first_chunk, "end": d.end, "tokens": d.completion_tokens}
    ).reset_index(drop=True)


def vllm_window(path: Path) -> pd.DataFrame:
    d = json.loads(path.read_text())
    send = np.asarray(d["start_times"])
    first = send + np.asarray(d["ttfts"])
    end = first + np.asarray([sum(gaps) for gaps in d["itls"]])
    return pd.DataFrame({"send": send, "first": first, "end": end, "tokens": d["output_lens"]})


def arrival_groups(sends: np.ndarray, gap_s: float = 0.001) -> np.ndarray:
    """The send time of each group of requests sent within gap_s of the one before."""
    s = np.sort(sends)
    return s[np.concatenate([[True], np.diff(s) >= gap_s])]


def describe(w: pd.DataFrame) -> dict:
    span = w.end.max() - w.send.min()
    groups = arrival_groups(w.send.to_numpy())
    tpot = (w.end - w.first) / (w.tokens - 1)
    during = np.array(
        [bisect.bisect_left(groups, e) - bisect.bisect_right(groups, f) for f, e in zip(w["first"], w["end"])]
    )
    slope = np.polyfit(during, 1000 * tpot, 1)[0] if during.std() > 0 else float("nan")
    return {
        "requests": len(w),
        "in_flight": ((w.end - w.send).sum() / span),
        "mean_group": len(w) / len(groups),
        "groups_while_decoding": during.mean(),
        "tpot_ms_per_group": slope,
        "r": np.corrcoef(during, tpot)[0, 1] if during.std() > 0 else float("nan"),
        "tpot_p50_ms": 1000 * tpot.median(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--requests", type=Path, help="write every measured request here (.csv.gz)")
    a = ap.parse_args()
    rows, requests = [], []
    for folder in a.dirs:
        for path in sorted([*folder.glob("servebook*.parquet"), *folder.glob("vllm-*.json")]):
            m = NAME.match(path.stem)
            if not m:
                continue
            w = servebook_window(path) if path.suffix == ".parquet" else vllm_window(path)
            client, c, r = m["client"], int(m["c"]), int(m["r"])
            client = "vllm bench serve" if client == "vllm" else client
            rows.append({"folder": folder.name, "client": client, "concurrency": c, "round": r, **describe(w)})
            requests.append(
                pd.DataFrame(
                    {
                        "client": client,
                        "concurrency": c,
                        "round": r,
                        "send_s": (w.send - w.send.min()).round(4),
                        "ttft_ms": (1000 * (w["first"] - w.send)).round(3),
                        "tpot_ms": (1000 * (w.end - w["first"]) / (w.tokens - 1)).round(4),
                        "e2el_ms": (1000 * (w.end - w.send)).round(3),
                        "output_tokens": w.tokens,
                    }
                )
            )
    table = pd.DataFrame(rows).sort_values(["folder", "concurrency", "round", "client"])
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(table.round(3).to_string(index=False))
    if a.requests:
        pd.concat(requests).to_csv(a.requests, index=False)
        print(f"{sum(len(x) for x in requests)} requests written to {a.requests}")


if __name__ == "__main__":
    main()
