#!/bin/bash
# Issue 40's GPU run: held-out shapes started by a plain `vllm serve` at vLLM's defaults and two other settings,
# the plan's bands against vLLM's log. One step per device call, from the project root there:
#   bash docs/examples/h200-vllm/on-h200-truth.sh STEP
#   kit0   carry .gpu/c0 (bins.part0): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; build a DeepSeek-V3-shaped block-FP8 mini with its MTP layer (2 layers
#          + 1) and a Kimi-K2-shaped block-FP8 MLA mini (2 layers, 64 heads, 384 experts: 2026-12-05, as the
#          Qwen3-235B-shaped one of 2026-12-04 calibrates the sampler term now); SHAPES=q235 builds that one again
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then truth_run.py in a session of its own (it outlives the call)
#   wait   keep the machine while it runs (WAIT_S, default 560 s), then bring back what is done
source "$(dirname "$0")/kit-steps.sh" "$1" truth
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 $EX/mkdsv3.py $MODELS/dsv3-fp8-mtp --tokenizer /tmp/tok --layers 2 --mtp 1 2>&1 | tail -1
  if [ "${SHAPES:-}" = q235 ]; then
    python3 $EX/../h200x8/mkckpt.py $MODELS/q235-fp8 --tokenizer /tmp/tok --shape qwen3-235b-a22b --layers 4 --fp8 \
      --vocab 151936 2>&1 | tail -1
  else
    python3 $EX/mkdsv3.py $MODELS/kimi-k2-fp8 --tokenizer /tmp/tok --shape kimi-k2 --layers 2 --mtp 0 2>&1 | tail -1
  fi
  du -sh $MODELS/*; sync ;;
kit2) ls $STAGE ;;
go)
  pkill -f "vllm serve" ; sleep 1
  setsid bash -c "cd $PWD && source /tmp/kit/unpack.sh >/dev/null 2>&1 && python3 $EX/truth_run.py $R \
    $(ls -d $MODELS/dsv3-fp8-mtp $MODELS/kimi-k2-fp8 $MODELS/q235-fp8 2>/dev/null); echo '=== done'" \
    > $R/console.log 2>&1 < /dev/null &
  sleep 30; tail -5 $R/console.log ;;
wait) finish ;;
esac
