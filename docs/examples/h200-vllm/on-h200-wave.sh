#!/bin/bash
# The GPU runs of issues 26 (time to ready) and 27 (the reserve on MLA and INT4), one step per device call,
# from the project root there:   bash docs/examples/h200-vllm/on-h200-wave.sh STEP
#   kit1     unpack the Python tree; build the Kimi-K2.5-shaped mini (3 layers) and a MiniMax-M2.5-shaped FP8
#            checkpoint (2 layers) on the GPU
#   kit2     stage the second kernel part
#   starts1  kernels in place; benchmarks/start_times.py on the Kimi mini: default strategy cold and warm, and
#            a dry start (--load-format dummy)
#   starts2  the same for prefetch and eager
#            (STRATEGIES=a,b picks others, DRY=0 drops the dry start, KEEP_KERNELS=1 keeps Triton's kernel cache
#            for the cold starts, which otherwise start from an empty one as well as an empty vLLM cache)
#   reserve  the Kimi mini with other max_num_seqs / max_num_batched_tokens / max_model_len, and the MiniMax FP8
#            checkpoint at TP=1: each launched until ready, its DEBUG log kept, stopped
#   heldout  what the next device session owes issues 26 and 27: Kimi launches at settings no calibration used
#            (max_num_seqs 512 with 16,384 batched tokens; 64k context with 64 sequences), then eager cold and warm
#   loader   the default loader cold and warm, then vLLM's multi-thread loader (params-kimi-tp1-multithread.yaml)
#            cold and warm, then where a warm start's Python imports go (python -X importtime)
#   formats  the loaders the kit leaves out, from their wheels (carried in .gpu/wheels with the third kit call):
#            --load-format fastsafetensors cold and warm, then instanttensor cold and warm
#   pipeline stages 00-07 on the Kimi mini
# Results go to $OUT (tarred).
set -uo pipefail
STEP=$1; EX=docs/examples/h200-vllm; R=/tmp/results; P=$EX/params-kimi-tp1.yaml
if [ "$STEP" = kit1 ]; then source .gpu/c1/kit/unpack.sh; else source /tmp/kit/unpack.sh; fi
mkdir -p $R
pack() { tar czf "$OUT/$1.tgz" -C $R "$1" 2>/dev/null; ls -la "$OUT"; }
gpu_mem() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ' '; echo; }
# a fresh results folder for the step, with a partial tarball before the call's limit
begin() { mkdir -p $R/$STEP; servebook stop >/dev/null 2>&1
  ( sleep ${PARTIAL_S:-560}; tar czf $OUT/$STEP-partial.tgz -C $R $STEP ) </dev/null >/dev/null 2>&1 & }
# one launch until ready (its DEBUG log kept under the step's folder), then stopped
launch_once() { name=$1; shift; log "launch $name: $*"
  timeout ${LAUNCH_S:-240} servebook launch "$@" --log-dir $R/$STEP/$name 2>&1 | grep -v "^\[" | tail -4
  servebook stop 2>&1 | tail -1; }
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  df -hT /tmp | tail -1; grep MemAvailable /proc/meminfo; nproc
  python3 /tmp/kit/mkkimi.py $MODELS/kimi-mini --tokenizer /tmp/tok --layers 3 2>&1 | tail -2
  [ "${MINIMAX:-1}" = 1 ] && python3 $EX/../h200x8/mkckpt.py $MODELS/minimax-fp8 --tokenizer /tmp/tok --shape minimax-m2.5 --layers 2 --fp8 2>&1 | tail -2
  du -sh $MODELS/*; sync ;;
kit2) ls $STAGE ;;
starts1|starts2)
  begin
  if [ $STEP = starts1 ]; then S=default; D=--dry; else S=prefetch,eager; D=; fi
  [ "${DRY:-1}" = 0 ] && D=; S=${STRATEGIES:-$S}
  timeout ${RUN_S:-570} python3 benchmarks/start_times.py $P --strategies $S $D ${KEEP_KERNELS:+--keep-kernels} --out $R/$STEP 2>&1 | cut -c1-600
  gpu_mem; find $R/$STEP -name '*.log' | head; pack $STEP ;;
reserve)
  begin
  launch_once kimi-seqs128 $P --set max_num_seqs=128
  launch_once kimi-32k-seqs256-mnbt4096 $P --set max_model_len=32768 --set max_num_seqs=256 --set max_num_batched_tokens=4096
  launch_once minimax-fp8-tp1 $P --set model=$MODELS/minimax-fp8 --set served_model_name=minimax-fp8
  gpu_mem; pack reserve ;;
heldout)
  begin; LAUNCH_S=200
  launch_once kimi-seqs512-mnbt16384 $P --set max_num_seqs=512 --set max_num_batched_tokens=16384
  launch_once kimi-64k-seqs64 $P --set max_model_len=65536 --set max_num_seqs=64
  timeout ${RUN_S:-300} python3 benchmarks/start_times.py $P --strategies eager --out $R/heldout/starts 2>&1 | cut -c1-600
  gpu_mem; pack heldout ;;
loader)
  begin
  timeout ${RUN_S:-300} python3 benchmarks/start_times.py $P --strategies default --out $R/$STEP/default 2>&1 | cut -c1-600
  timeout 230 python3 benchmarks/start_times.py $EX/params-kimi-tp1-multithread.yaml --strategies default --out $R/$STEP/multithread 2>&1 | cut -c1-600
  timeout 40 python3 -X importtime -c "import vllm.entrypoints.openai.api_server" 2>$R/$STEP/importtime.txt
  sort -t'|' -k2 -n -r $R/$STEP/importtime.txt | head -25 | cut -c1-160
  gpu_mem; pack $STEP ;;
formats)
  begin
  for w in .gpu/wheels/*.whl; do python3 -m zipfile -e $w /tmp/site; done
  python3 -c "import importlib.metadata as m; print('fastsafetensors', m.version('fastsafetensors'), 'instanttensor', m.version('instanttensor'))"
  timeout ${RUN_S:-290} python3 benchmarks/start_times.py $P --strategies default --set load_format=fastsafetensors --out $R/$STEP/fastsafetensors 2>&1 | cut -c1-600
  timeout ${RUN2_S:-220} python3 benchmarks/start_times.py $P --strategies default --set load_format=instanttensor --out $R/$STEP/instanttensor 2>&1 | cut -c1-600
  gpu_mem; pack $STEP ;;
pipeline)
  begin
  SERVEBOOK_OUTPUTS=$R/pipeline timeout ${RUN_S:-565} servebook run $P ${STAGES:+--stages $STAGES} 2>&1 | tee $R/pipeline/console.log | cut -c1-300
  gpu_mem; pack pipeline ;;
esac
