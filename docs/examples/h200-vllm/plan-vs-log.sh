#!/bin/bash
# The plan-against-log table of README.md ("The story's architectures on one H200"), re-made from the fixtures
# with the planner of this checkout:   bash docs/examples/h200-vllm/plan-vs-log.sh
set -euo pipefail
cd "$(dirname "$0")"
C=../../../tests/fixtures/configs; L=../../../tests/fixtures/vllm-logs/gpu-0.25.0-h200
Q=$C/q3moe-30b-a3b-shapes-8l; K=$C/kimi-k2.5-shapes-3l-int4.json
exec ../../../.venv/bin/python plan_vs_log.py \
  bf16-tp1=$Q-bf16.json:1:1:1:0:$L-bf16-tp1.log \
  bf16-tp2=$Q-bf16.json:2:1:1:0:$L-bf16-tp2.log \
  bf16-tp2ep=$Q-bf16.json:2:1:1:1:$L-bf16-tp2ep.log \
  bf16-tp1dp2=$Q-bf16.json:1:1:2:0:$L-bf16-tp1dp2.log \
  bf16-tp1pp2=$Q-bf16.json:1:2:1:0:$L-bf16-tp1pp2.log \
  fp8-tp2ep=$Q-fp8.json:2:1:1:1:$L-fp8-tp2ep.log \
  fp8-tp1dp2ep=$Q-fp8.json:1:1:2:1:$L-fp8-tp1dp2ep.log \
  "kimi-int4-tp1 cold (defaults)=$K:1:1:1:0:$L-kimi-int4-tp1-cold.log:8192:0:0:0" \
  "kimi-int4-tp1 prefetch cold=$K:1:1:1:0:$L-kimi-int4-tp1-prefetch-cold.log:8192:0:0:0" \
  "kimi-int4-tp1 warm (compile hit)=$K:1:1:1:0:$L-kimi-int4-tp1-warm.log:8192:0:0:1" \
  "kimi-int4-tp1 dummy weights (hit)=$K:1:1:1:0:$L-kimi-int4-tp1-dummy.log:8192:0:0:1" \
  "kimi-int4-tp1 max_num_seqs 128=$K:1:1:1:0:$L-kimi-int4-tp1-seqs128.log:8192:128:0:0" \
  "kimi-int4-tp1 32k, seqs 256, mnbt 4096=$K:1:1:1:0:$L-kimi-int4-tp1-32k-seqs256-mnbt4096.log:32768:256:4096:0" \
  "held out: kimi-int4-tp1 seqs 512, mnbt 16384=$K:1:1:1:0:$L-kimi-int4-tp1-seqs512-mnbt16384.log:8192:512:16384:0" \
  "held out: kimi-int4-tp1 64k, seqs 64=$K:1:1:1:0:$L-kimi-int4-tp1-64k-seqs64.log:65536:64:0:0" \
  "held out: kimi-int4-tp1 eager cold=$K:1:1:1:0:$L-kimi-int4-tp1-eager-cold.log:8192:0:0:0" \
  "held out: kimi-int4-tp1 eager warm (hit)=$K:1:1:1:0:$L-kimi-int4-tp1-eager-warm.log:8192:0:0:1" \
  "minimax-fp8-tp1 (2 layers)=$C/minimax-m2.5-shapes-2l-fp8.json:1:1:1:0:$L-minimax-fp8-tp1.log:8192:0:0:0"
