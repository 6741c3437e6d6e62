#!/bin/bash
# The GPU run of docs/examples/h200-vllm, one step per device call, from the project root there:
#   bash docs/examples/h200-vllm/on-h200.sh STEP
# Steps, in order (the first three carry .gpu/c1, c2, c3 and must follow each other within 30 s):
#   kit1     unpack the Python tree, build the checkpoints named in BUILD (default: bf16 fp8) on the GPU
#   kit2     stage the second kernel part
#   pipeline put the kernels in place; stop a server an earlier step left; what NVML says of the NVLinks;
#            stages 00-07 (or those of STAGES, e.g. 03,06,07) with PARAMS (default: the FP8 checkpoint at TP=2+EP)
#   compare  the server of SERVER (default: bf16 at TP=2; one already answering on port 8000 is reused and
#            kept running); the clients of CLIENTS against `vllm bench serve`, 5 rotating rounds
#   orphans  SIGKILL that server's API process: status, refusal, cleanup, GPUs back to 0 MiB
#   layouts  every other layout the plan judges for 2 GPUs, started until vLLM has sized its KV cache
# Results go to $OUT (tarred); see README.md beside this script.
set -uo pipefail
STEP=$1; CONC=${CONC:-16 64}; BUILD=${BUILD:-bf16 fp8}; PARAMS=${PARAMS:-params-fp8-tp2ep.yaml}
SERVER=${SERVER:-params-bf16-tp2.yaml}; CLIENTS=${CLIENTS:-servebook servebook-usage-each-chunk vllm}; EX=docs/examples/h200-vllm; R=/tmp/results
if [ "$STEP" = kit1 ]; then source .gpu/c1/kit/unpack.sh; else source /tmp/kit/unpack.sh; fi
mkdir -p $R
pack() { tar czf "$OUT/$1.tgz" -C $R "$1" 2>/dev/null; ls -la "$OUT"; }
gpu_mem() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ' '; echo; }
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  mkdir -p $R/kit1
  for m in $BUILD; do
    case $m in bf16) flags="";; fp8) flags="--fp8 --moe-inter 384";; esac
    python3 /tmp/kit/mkckpt.py $MODELS/q3moe-$m --tokenizer /tmp/tok --layers 8 $flags 2>&1 | tail -2
    cp $MODELS/q3moe-$m/config.json $R/kit1/config-$m.json
  done
  du -sh $MODELS/*; pack kit1 ;;
kit2) ls $STAGE ;;
pipeline)
  log "pipeline"; mkdir -p $R/pipeline; servebook stop 2>&1 | tail -1
  ( sleep ${PARTIAL_S:-570}; tar czf $OUT/pipeline-partial.tgz -C $R pipeline ) </dev/null >/dev/null 2>&1 &
  timeout 60 python3 -c "
import pynvml
from servebook import gpu_evidence
pynvml.nvmlInit()
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    cap = gpu_evidence.nvlink_capacity_gbs(pynvml, h)
    print(f'GPU {i}: NVLink one-way bandwidth {cap} GB/s;', gpu_evidence.read(pynvml, [i])[0])
" > $R/pipeline/nvml.txt 2>&1; log "NVML read: exit $?"
  SERVEBOOK_OUTPUTS=$R/pipeline timeout ${RUN_S:-560} servebook run $EX/$PARAMS ${STAGES:+--stages $STAGES} 2>&1 | tee $R/pipeline/console.log | cut -c1-300
  gpu_mem; cp outputs/servers/*.log $R/pipeline/ 2>/dev/null; pack pipeline ;;
compare)
  mkdir -p $R/compare
  ( sleep 575; tar czf $OUT/compare-partial.tgz -C $R compare ) </dev/null >/dev/null 2>&1 &
  if curl -sf -o /dev/null http://127.0.0.1:8000/health; then log "reusing the running server"
  # prefix caching off: vLLM's random prompts on this 2,048-token vocabulary repeat each other's blocks (the
  # comparison of 2026-12-01 saw its hit rate climb to 77 %), which would hand its client cheaper prefills
  else log "launch"; servebook launch $EX/$SERVER --set 'extra_args=["--no-enable-prefix-caching"]' \
    --log-dir $R/compare 2>&1 | tail -5; fi
  python3 $EX/client_vs_vllm.py http://127.0.0.1:8000 q3moe-bf16 $MODELS/q3moe-bf16 --clients $CLIENTS \
    --concurrency $CONC --rounds ${ROUNDS:-5} --seconds ${SECONDS_PER:-20} --out $R/compare 2>&1 \
    | grep -v "^Namespace\|^Starting\|^Traffic\|^Burstiness\|^Maximum request\|^Initial test" | cut -c1-400
  d=compare-c${CONC// /-}; mv $R/compare $R/$d
  # the server's own 10-s lines, also when it was launched by an earlier call (its log lives in that call's folder)
  for f in $R/compare*/server.log $R/compare*/server-[0-9]*.log; do [ -f "$f" ] && cp "$f" $R/$d/server-log-now.log; done
  # vLLM's per-request files are big at 64 streams: they travel apart, so neither archive passes 16 MiB
  tar czf $OUT/$d-vllm-detailed.tgz -C $R/$d $(cd $R/$d && ls vllm-*.json 2>/dev/null) 2>/dev/null
  tar czf $OUT/$d.tgz -C $R --exclude='vllm-*.json' $d; ls -la $OUT ;;
orphans)
  mkdir -p $R/orphans; exec > >(tee $R/orphans/console.log) 2>&1
  servebook launch $EX/params-bf16-tp2.yaml --log-dir $R/orphans 2>&1 | tail -2
  API=$(python3 -c "from servebook import server; print(server.registered(8000).pid)")
  echo "SIGKILL the API server, pid $API"; kill -9 $API; sleep 5
  echo "--- memory after the kill: $(gpu_mem)"
  echo "--- servebook status"; servebook status
  echo "--- launching again without stop_leftovers (must be refused)"
  servebook launch $EX/params-bf16-tp2.yaml --set stop_leftovers=false --log-dir $R/orphans; echo "exit $?"
  echo "--- servebook stop"; servebook stop; sleep 3
  echo "--- memory after stop: $(gpu_mem)"; echo "--- processes:"; ps -eo pid,comm,args | grep -i "vllm" | grep -v grep
  exec >&- 2>&-; pack orphans ;;
layouts)
  mkdir -p $R/layouts
  python3 $EX/layouts.py $EX/params-bf16-tp2.yaml ${LAYOUTS:-} --out $R/layouts 2>&1 | cut -c1-300
  gpu_mem; pack layouts ;;
esac
