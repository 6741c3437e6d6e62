#!/bin/bash
# Issue 40 item 5: where the weights take the whole step, how much of the bandwidth ceiling does a step reach? The
# plan caps its forecast at sizing.FORECAST_CEILING_REACH (0.89, the most any committed sweep reached, on minis of
# 4 to 16 layers whose steps are mostly off the weights). The Qwen3-30B-A3B-shaped bf16 mini at 40 and 24 layers
# (50 and 30 GB of weights on one 80 GB H100) is rehearsed on dummy weights with uniform routing (no weights to
# write: a config and a tokenizer are the checkpoint), 1 to 128 streams of run-bf16-tp1's workload, and the plan's
# forecast is read against each level. One step per device call, from the project root there:
#   bash docs/examples/h200-vllm/on-h200-reach.sh STEP
#   kit0   carry .gpu/c0 (bins.part0): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; the config-only checkpoints
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then the run in a session of its own (it outlives the call)
#   wait   keep the machine while the run goes on (WAIT_S, default 560 s), then bring back what is done
source "$(dirname "$0")/kit-steps.sh" "$1" reach
LAYERS=${LAYERS:-40 24}
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 /tmp/kit/mkckpt.py $MODELS/q3-1l --tokenizer /tmp/tok --layers 1 2>&1 | tail -1
  for n in $LAYERS; do
    mkdir -p $MODELS/q3-${n}l-config && cp $(ls -d $MODELS/q3-1l/* | grep -v safetensors) $MODELS/q3-${n}l-config/
    python3 - $MODELS/q3-${n}l-config/config.json $n <<'PY'
import json, sys
path, layers = sys.argv[1], int(sys.argv[2])
config = json.load(open(path))
config.update(num_hidden_layers=layers, max_window_layers=layers)
json.dump(config, open(path, "w"), indent=1)
PY
    mkdir -p $R/configs && cp $MODELS/q3-${n}l-config/config.json $R/configs/q3moe-bf16-${n}l.json
  done
  ls $MODELS/*; df -h /tmp | tail -1 ;;
kit2) ls $STAGE ;;
go)
  start_run <<SCRIPT
for n in $LAYERS; do
  echo "=== q3-\${n}l \$(date +%T)"
  stages $R/q3-\${n}l $EX/params-bf16-tp1.yaml --stages plan,rehearse --set model=$MODELS/q3-\${n}l-config \\
    --set run_name=reach-\${n}l --set rehearse_layouts=1 --set rehearse_variants=[] --set rehearse_max_concurrency=128 \\
    --set rehearse_min_level_s=5 --set rehearse_skewed_routing=none --set rehearse_primes_compile_cache=false \\
    --set extra_env={}
done
SCRIPT
  ;;
wait) finish ;;
esac
