#!/bin/bash
# Issue 16 on 8 x H200 (kind nvidia-h200-x8), one step per device call, from the project root there:
#   bash docs/examples/h200x8/on-h200x8.sh STEP
# Steps, in order (the first three carry .gpu/c1, c2, c3 and must follow each other within 30 s):
#   kit1     unpack the Python tree; build the MiniMax-shaped FP8 checkpoint on the GPU (8 layers, about 29 GB)
#   kit2     stage the second kernel part
#   plan     put the kernels in place; `servebook plan` for the checkpoint on 8 GPUs, and TP=8 forced on vLLM
#            (its refusal, word for word, beside the plan's)
#   bench    LAYOUTS (default "TP=8+EP TP=4+PP=2"): for each, launch, the benchmark sweep, stop; one run folder
#            per layout (a device call holds about two of them)
#   nccl     the NCCL micro-benchmark on 8 GPUs with every set, and the A/B of ab_variants
# Then, here: `servebook compare` over the run folders that came back.
set -uo pipefail
STEP=$1; EX=docs/examples/h200x8; R=/tmp/results; P=$EX/params-minimax-shapes.yaml
if [ "$STEP" = kit1 ]; then source .gpu/c1/kit/unpack.sh; else source /tmp/kit/unpack.sh; fi
mkdir -p $R
pack() { tar czf "$OUT/$1.tgz" -C $R "$1" 2>/dev/null; ls -la "$OUT"; }
flags() {  # TP=2+DP=4+EP -> --set tensor_parallel_size=2 --set ... (sizes left out are 1)
  local tp=1 pp=1 dp=1 ep=false part
  for part in ${1//+/ }; do
    case $part in TP=*) tp=${part#TP=};; PP=*) pp=${part#PP=};; DP=*) dp=${part#DP=};; EP) ep=true;; esac
  done
  echo "--set tensor_parallel_size=$tp --set pipeline_parallel_size=$pp --set data_parallel_size=$dp --set enable_expert_parallel=$ep"
}
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  mkdir -p $R/kit1
  python3 $EX/mkckpt.py $MODELS/minimax-shapes-fp8 --tokenizer /tmp/tok --shape minimax-m2.5 --layers 8 --fp8 2>&1 | tail -2
  cp $MODELS/minimax-shapes-fp8/config.json $R/kit1/; du -sh $MODELS/*; pack kit1 ;;
kit2) ls $STAGE ;;
plan)
  mkdir -p $R/plan
  servebook plan $MODELS/minimax-shapes-fp8 --gpu H200 --gpus 8 --json > $R/plan/plan.json
  servebook plan $MODELS/minimax-shapes-fp8 --gpu H200 --gpus 8 | cut -c1-250
  echo "--- TP=8 without EP forced on vLLM"
  servebook launch $P $(flags TP=8) --log-dir $R/plan 2>&1 | tail -6
  servebook stop; pack plan ;;
bench)
  for layout in ${LAYOUTS:-TP=8+EP TP=4+PP=2}; do
    name=${layout//+/_}; name=${name//=/}
    echo "=== $layout"
    SERVEBOOK_OUTPUTS=$R/bench-$name servebook run $P --stages launch,benchmark $(flags $layout) --set run_name=$name \
      2>&1 | grep -v "^    concurrency" | cut -c1-250
    servebook stop
  done
  (cd $R && tar czf $OUT/bench.tgz bench-*); ls -la $OUT ;;
nccl)
  mkdir -p $R/nccl
  SERVEBOOK_OUTPUTS=$R/nccl servebook run $P --stages launch,nccl_tuning 2>&1 | cut -c1-250
  servebook stop; pack nccl ;;
esac
