"""How much of ``vllm bench serve``'s random prompts an earlier prompt already sent, on the tiny model's vocabulary.

    python vllm_prompt_repeats.py [--counts 684 684 810 810 964] [--warmups 16]

vLLM's random dataset builds each prompt from consecutive token ids starting at a random offset; on a
2,048-token vocabulary two prompts that start near the same id share whole 16-token blocks, which vLLM's prefix
cache then serves without a prefill. This replays the sampler (vLLM's own ``RandomDataset``) for rounds seeded
0, 1, ... with the given request counts (the one-H200 comparison's, warm-ups added) and prints, per round, the
share of prompt tokens in full blocks whose whole prefix an earlier prompt of any round already sent (the
server's cache was never cleared between rounds and held millions of tokens, so nothing was evicted).
"""

from __future__ import annotations

import argparse

from transformers import AutoTokenizer
from vllm.benchmarks.datasets import RandomDataset

from servebook import models

BLOCK = 16  # vLLM's KV-cache block, the unit its prefix cache matches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[684, 684, 810, 810, 964])
    ap.add_argument("--warmups", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(models.build_tiny_model()))
    seen: set[tuple[int, ...]] = set()
    for seed, n in enumerate(a.counts):
        requests = RandomDataset(random_seed=seed).sample(
            tokenizer=tok, num_requests=n + a.warmups, input_len=a.input_len, output_len=128, range_ratio=0.0
        )
        cached = tokens = 0
        for r in requests:
            ids = tok.encode(r.prompt)
            prefixes = [tuple(ids[: (b + 1) * BLOCK]) for b in range(len(ids) // BLOCK)]
            cached += BLOCK * sum(p in seen for p in prefixes)
            seen.update(prefixes)
            tokens += len(ids)
        print(f"round {seed + 1}: {len(requests)} prompts, {100 * cached / tokens:.0f} % of their tokens already sent")


if __name__ == "__main__":
    main()
