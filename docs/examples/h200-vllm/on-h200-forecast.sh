#!/bin/bash
# Issue 40 item 5 on one machine: the forecast's misses between sweeps made on different H200s and days (up to a
# fifth at one level) are noise or model, and only sweeps made back to back on one GPU can tell. The
# Qwen3-30B-A3B-shaped bf16 mini at 8, 16 and 4 layers and at 8 again (the run-bf16-tp1 workload: 128 in / 128 out,
# 1 to 128 streams), then the Moonlight-like block-FP8 MLA mini (hidden 2048, held out of the FP8-MLA activation
# fit) started by a plain `vllm serve` at vLLM's defaults and at 128 requests. One step per device call, from the
# project root there:
#   bash docs/examples/h200-vllm/on-h200-forecast.sh STEP
#   kit0   carry .gpu/c0 (bins.part0): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; build the four checkpoints (about 37 GB)
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then the run in a session of its own (it outlives the call)
#   wait   keep the machine while the run goes on (WAIT_S, default 560 s), then bring back what is done
source "$(dirname "$0")/kit-steps.sh" "$1" forecast
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  for n in 8 16 4; do
    python3 /tmp/kit/mkckpt.py $MODELS/q3moe-bf16-${n}l --tokenizer /tmp/tok --layers $n 2>&1 | tail -1
    mkdir -p $R/configs && cp $MODELS/q3moe-bf16-${n}l/config.json $R/configs/q3moe-bf16-${n}l.json
  done
  python3 $EX/mkdsv3.py $MODELS/dsv3-small-fp8 --tokenizer /tmp/tok --shape small --layers 2 --mtp 0 2>&1 | tail -1
  du -sh $MODELS/*; df -h /tmp | tail -1; sync ;;
kit2) ls $STAGE ;;
go)
  start_run <<SCRIPT
for n in 8 16 4 8; do
  name=q3-\${n}l; [ -d $R/\$name ] && name=q3-\${n}l-again
  echo "=== \$name \$(date +%T)"
  stages $R/\$name $EX/params-bf16-tp1.yaml --stages plan,launch,benchmark --set model=$MODELS/q3moe-bf16-\${n}l \\
    --set run_name=bf16-tp1-\$name --set bench_max_concurrency=128 --set extra_env={}
done
echo "=== small \$(date +%T)"
TRUTH_SETTINGS='defaults;max_num_seqs 128' python3 $EX/truth_run.py $R/small $MODELS/dsv3-small-fp8 2>&1 | tail -20
SCRIPT
  ;;
wait) finish ;;
esac
