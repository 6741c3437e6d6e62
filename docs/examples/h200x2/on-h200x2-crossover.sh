#!/bin/bash
# Issue 42's GPU run on nvidia-h200-x2, one step per device call, from the project root there:
#   bash docs/examples/h200x2/on-h200x2-crossover.sh STEP
#   kit0     carry .gpu/c0 (bins.part0): staged under /tmp
#   kit1     carry .gpu/c1: the Python tree; build the MiniMax-shaped FP8 checkpoint (8 layers, 256 experts, 29 GB)
#   kit2     carry .gpu/c2: the second kernel part
#   go       carry .gpu/c3: kernels in place, then in a session of its own (it outlives the call): the plan, the
#            rehearsal of params-minimax-crossover.yaml (3 layouts x 2 settings on dummy weights), the winner
#            launched on the real weights and benchmarked
#   runnerup the rehearsal's runner-up launched on the real weights and benchmarked the same way (LAYOUT_SETS: its
#            `--set` arguments, as the rehearsal table names it, e.g. "tensor_parallel_size=1 data_parallel_size=2
#            enable_expert_parallel=true max_num_seqs=64")
#   wait     keep the machine while a run goes on (WAIT_S, default 560 s), then bring back what is done
# Here afterwards: `servebook compare` over the two run folders; README.md beside this script has the tables.
# Every process keeps NVLink multicast off (the kit's environment sets NCCL_NVLS_ENABLE=0).
source "$(dirname "$0")/../h200-vllm/kit-steps.sh" "$1" crossover
X2=docs/examples/h200x2
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 $EX/../h200x8/mkckpt.py $MODELS/minimax-fp8 --tokenizer /tmp/tok --shape minimax-m2.5 --layers 8 --fp8 2>&1 | tail -1
  du -sh $MODELS/*; sync ;;
kit2) ls $STAGE ;;
go)
  start_run <<SCRIPT
echo "=== plan, rehearse, launch, benchmark \$(date +%T)"
stages $R/winner $X2/params-minimax-crossover.yaml --stages reconnaissance,plan,rehearse,launch,benchmark ${RUN_SETS:-}
SCRIPT
  ;;
runnerup)
  sets=(); for s in ${LAYOUT_SETS:?name the runner-up\'s settings}; do sets+=(--set "$s"); done
  start_run <<SCRIPT
echo "=== runner-up \$(date +%T)"
stages $R/runnerup $X2/params-minimax-crossover.yaml --stages reconnaissance,plan,launch,benchmark \
  --set rehearse_picks_launch=false ${sets[*]}
SCRIPT
  ;;
wait) finish ;;
esac
