#!/bin/bash
# Issue 39's GPU run: the rehearsal stage on one H200, one step per device call, from the project root there:
#   bash docs/examples/h200-vllm/on-h200-rehearse.sh STEP
#   kit0   carry .gpu/c0 (bins.part0, which no longer fits beside the tree in c1's call): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; build the Kimi mini (3 layers) and the MiniMax FP8 checkpoint (2 layers)
#          (MODELS_TO_RUN=minimax, in every step's environment: that model alone)
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then the whole run in a session of its own (it outlives the call):
#          for each model, stages plan, rehearse, launch (the winner, real weights) and benchmark
#          (RUN_SETS: more `--set` arguments for every model's run; STAGES: other stages)
#   wait   keep the machine while the run goes on (WAIT_S, default 560 s), then bring back what is done
# Results go to $OUT (tarred); README.md beside this script has the tables.
source "$(dirname "$0")/kit-steps.sh" "$1" rehearse
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  case " ${MODELS_TO_RUN:-kimi minimax} " in *" kimi "*)
    python3 /tmp/kit/mkkimi.py $MODELS/kimi-mini --tokenizer /tmp/tok --layers 3 2>&1 | tail -1 ;; esac
  case " ${MODELS_TO_RUN:-kimi minimax} " in *" minimax "*)
    python3 $EX/../h200x8/mkckpt.py $MODELS/minimax-fp8 --tokenizer /tmp/tok --shape minimax-m2.5 --layers 2 --fp8 2>&1 | tail -1 ;; esac
  du -sh $MODELS/*; sync ;;
kit2) ls $STAGE ;;
go)
  start_run <<SCRIPT
for m in ${MODELS_TO_RUN:-kimi minimax}; do
  echo "=== \$m \$(date +%T)"
  stages $R/\$m $EX/params-\$m-rehearse.yaml --stages ${STAGES:-plan,rehearse,launch,benchmark} ${RUN_SETS:-}
done
SCRIPT
  ;;
wait) finish ;;
esac
