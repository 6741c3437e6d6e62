#!/bin/bash
# Issue 40 item 6: the CUDA-graph estimate's first PIECEWISE capture against the layer count. vLLM 0.25's estimate
# (gpu_model_runner.py, profile_cudagraph_memory) is the larger first capture of the two modes plus each further
# graph's charge. The plan holds the PIECEWISE one constant per hidden size; the Qwen3-30B-shaped bf16 mini logged
# 0.40, 0.35, 0.49, 0.50 and 0.64 GiB in all at 4, 8, 16, 24 and 40 layers (INFO lines only), where the plan says
# 0.35 at every count (the 40-layer start's KV 1.15 % over), and the GLM-4.5-Air mini's first PIECEWISE capture
# was 136, 150, 152 and 152 MiB at 2, 4, 8 and 16 layers: which part grows, and when, needs each mode's first
# capture and per-graph charge, which vLLM logs at DEBUG only. Each shape below is started on dummy
# weights (a config and a tokenizer are the checkpoint) at two or three layer counts with VLLM_LOGGING_LEVEL=DEBUG,
# stopped once its KV cache is sized, and its graph lines kept. Steps as on-h200-reach.sh (kit0 kit1 kit2 go wait).
# THEN="ds-24l:again ds-24l:eager ds-12l:first" starts a folder already built once more (its compile cache now
# warm) or with --enforce-eager (no compile, no graphs), logged as NAME-again and NAME-eager, or for the first time.
# Read the results with benchmarks/graph_estimate_layers.py. Run on 2026-12-07 on one H100 (run-graphs/, README:
# the further PIECEWISE graphs grow with the layers, the first captures do not).
source "$(dirname "$0")/kit-steps.sh" "$1" graphs
CONFIGS=tests/fixtures/configs
SHAPES=${SHAPES:-"q3:q3moe-30b-a3b-shapes-4l-bf16.json:4,40 mm:minimax-m2.5-shapes-2l-fp8.json:2,12"}
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
  python3 /tmp/kit/mkckpt.py $MODELS/q3-1l --tokenizer /tmp/tok --layers 1 2>&1 | tail -1
  for shape in $SHAPES; do
    IFS=: read -r name config counts <<< "$shape"
    for n in ${counts//,/ }; do
      dir=$MODELS/$name-${n}l && mkdir -p $dir && cp $(ls -d $MODELS/q3-1l/* | grep -v safetensors) $dir/
      python3 - $CONFIGS/$config $dir/config.json $n <<'PY'
import json, sys
source, path, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = json.load(open(source))
config["num_hidden_layers"] = layers
if "max_window_layers" in config:
    config["max_window_layers"] = layers
json.dump(config, open(path, "w"), indent=1)
PY
      mkdir -p $R/configs && cp $dir/config.json $R/configs/$name-${n}l.json
    done
  done
  ls $MODELS; df -h /tmp | tail -1 ;;
kit2) ls $STAGE ;;
go)
  start_run <<SCRIPT
probe() {
  local model=\$1 log=$R/\${2:-\$1}.log; shift; shift 2>/dev/null
  echo "=== \$model \$(basename \$log .log) \$* \$(date +%T)"
  VLLM_LOGGING_LEVEL=DEBUG setsid vllm serve $MODELS/\$model --load-format dummy --max-model-len 4096 \\
    --host 127.0.0.1 --port 8011 "\$@" > \$log 2>&1 < /dev/null &
  local pid=\$!
  for i in \$(seq 1 200); do grep -q "GPU KV cache size\|Traceback\|EngineCore failed" \$log && break; sleep 2; done
  kill -- -\$pid 2>/dev/null; sleep 5; kill -9 -- -\$pid 2>/dev/null
  for i in \$(seq 1 60); do nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -q . || break; sleep 2; done
  grep -h "Estimated\|Profiling CUDA graph\|Model loading took\|Available KV\|GPU KV cache size\|Error" \$log | cut -c1-240
  grep -v "DEBUG" \$log | gzip > \$log.gz; grep "Estimated\|CUDA graph\|torch peak memory increase" \$log | gzip > \$log.graphs.gz; rm \$log
}
for shape in $SHAPES; do
  IFS=: read -r name config counts <<< "\$shape"
  for n in \${counts//,/ }; do probe \$name-\${n}l; done
done
for then in ${THEN:-}; do
  IFS=: read -r model how <<< "\$then"
  case \$how in
  first) probe \$model ;;
  again) probe \$model \$model-again ;;
  eager) probe \$model \$model-eager --enforce-eager ;;
  esac
done
SCRIPT
  ;;
wait) finish ;;
esac
