#!/bin/bash
# Issue 39 item 5 / issue 40 item 4 on one H200: the MiniMax-shaped FP8 mini launched and benchmarked, stage 06's
# A/B rehearsed on dummy weights (the winner alone confirmed on the real weights), then the plan made again from
# the history the benchmark wrote. One step per device call, from the project root there:
#   bash docs/examples/h200-vllm/on-h200-ab.sh STEP
#   kit0   carry .gpu/c0 (bins.part0): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; build the MiniMax FP8 checkpoint (2 layers)
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then the run in a session of its own (it outlives the call)
#   wait   keep the machine while the run goes on (WAIT_S, default 560 s), then bring back what is done
source "$(dirname "$0")/kit-steps.sh" "$1" ab
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 $EX/../h200x8/mkckpt.py $MODELS/minimax-fp8 --tokenizer /tmp/tok --shape minimax-m2.5 --layers 2 --fp8 2>&1 | tail -1
  du -sh $MODELS/*; sync ;;
kit2) ls $STAGE ;;
go)
  start_run <<SCRIPT
echo "=== run \$(date +%T)"
stages $R/run $EX/params-minimax-ab.yaml --stages plan,launch,benchmark,nccl_tuning
echo "=== plan again \$(date +%T)"
SERVEBOOK_OUTPUTS=$R/again servebook run $EX/params-minimax-ab.yaml --stages plan 2>&1 | cut -c1-400
cp \$(python3 -c "from servebook.planner import truth; print(truth.history_path())") $R/plans.jsonl
SCRIPT
  ;;
wait) finish ;;
esac
