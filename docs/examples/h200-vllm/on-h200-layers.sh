#!/bin/bash
# Issue 40 item 5 and issue 39's skewed routing on one H200: the Qwen3-30B-A3B-shaped bf16 mini at 4 and 16 layers
# (8 layers is run-bf16-tp1), launched with real weights and swept with run-bf16-tp1's workload, so that the
# forecast's fixed cost per engine step and its cost per layer can be told apart; then the MiniMax-shaped FP8
# mini's rehearsal winner (max_num_batched_tokens 2048) rehearsed with uniform and skewed routing.
# One step per device call, from the project root there:
#   bash docs/examples/h200-vllm/on-h200-layers.sh STEP
#   kit0   carry .gpu/c0 (bins.part0): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; build the checkpoints
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then the run in a session of its own (it outlives the call)
#   wait   keep the machine while the run goes on (WAIT_S, default 560 s), then bring back what is done
source "$(dirname "$0")/kit-steps.sh" "$1" layers
LAYERS=${LAYERS:-4 16}
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  for n in $LAYERS; do
    python3 /tmp/kit/mkckpt.py $MODELS/q3moe-bf16-${n}l --tokenizer /tmp/tok --layers $n 2>&1 | tail -1
    mkdir -p $R/configs && cp $MODELS/q3moe-bf16-${n}l/config.json $R/configs/q3moe-bf16-${n}l.json
  done
  python3 $EX/../h200x8/mkckpt.py $MODELS/minimax-fp8 --tokenizer /tmp/tok --shape minimax-m2.5 --layers 2 --fp8 2>&1 | tail -1
  du -sh $MODELS/*; df -h /tmp | tail -1; sync ;;
kit2) ls $STAGE ;;
go)
  start_run <<SCRIPT
for n in $LAYERS; do
  echo "=== q3moe-bf16-\${n}l \$(date +%T)"
  stages $R/q3-\${n}l $EX/params-bf16-tp1.yaml --stages plan,launch,benchmark --set model=$MODELS/q3moe-bf16-\${n}l \\
    --set run_name=h200-bf16-tp1-\${n}l --set bench_max_concurrency=128 --set extra_env={}
done
echo "=== minimax skewed \$(date +%T)"
stages $R/minimax $EX/params-minimax-rehearse.yaml --stages plan,rehearse \\
  --set max_num_batched_tokens=2048 --set rehearse_variants=[] --set rehearse_min_level_s=3
SCRIPT
  ;;
wait) finish ;;
esac
