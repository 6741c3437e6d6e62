#!/bin/bash
# Issue 40's GPU run: held-out shapes started by a plain `vllm serve` at vLLM's defaults and two other settings,
# the plan's bands against vLLM's log. One step per device call, from the project root there:
#   bash docs/examples/h200-vllm/on-h200-truth.sh STEP
#   kit0   carry .gpu/c0 (bins.part0): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; build three block-FP8 minis no fit has seen (44 GB on a 64 GiB disk):
#          DeepSeek-V3-shaped (2 layers; its MTP layer was measured on 2026-12-04), Kimi-K2-shaped MLA (2 layers,
#          64 heads, 384 experts: the INT4 fit's shapes in FP8) and GLM-4.5-shaped GQA with its MTP layer (2 + 1:
#          biased q/k/v, half-rotary heads, vocabulary 151,552). SHAPES=q235 builds 2026-12-04's pair instead,
#          SHAPES=dsv3-64h DeepSeek-V3 at 64 heads alone (with TRUTH_SETTINGS, truth_run.py runs some settings only);
#          SHAPES=heads DeepSeek-V3 at 16, 32, 64 and 128 heads with 64 experts (7 GB each), for `go` with
#          SHAPES=heads: every head count at the defaults and 2,048 batched tokens, then 16 and 128 heads at 8k
#          context and 16 heads at 128 requests (the FP8-MLA activation's heads, tokens, context and sampler apart);
#          SHAPES=small (kit1 and go) a Moonlight-like DeepSeek-V3 at hidden 2048, held out of that fit;
#          SHAPES=glm (kit1 and go) GLM-4.5 alone at 512 requests and at 4,096 batched tokens (SYNC=1: the
#          defaults alone with graph_snapshot/, inside the go call);
#          SHAPES=glm+air (kit1) both GLM-4.5 shapes; PEAK=1 (go) each at vLLM's defaults with profile_peak/
#          recording what the profile run holds at its peak (PEAK_MODELS names others: SHAPES=peak-layers builds
#          GLM-4.5 at 4 layers and the Air at 2, glm45-4l-fp8 and glm45-air-2l-fp8; SHAPES=air-deep the Air at 8
#          and 16 layers, glm45-air-8l-fp8 and glm45-air-16l-fp8; PEAK_GC="collect off", one
#          SB_PROFILE_GC mode per model, in order);
#          SHAPES=air-deep WARM=1 PEAK_MODELS="..." (go) each model as servebook starts it: a cold dummy-weight
#          rehearsal at vLLM's defaults, then the real weights finding its compile cache;
#          SHAPES=air-8l (kit1) the 8-layer Air alone; SBWARM=1|routed [PEAK_MODELS=one] (go) servebook's own
#          plan, rehearsal (1: without the routing simulation; routed: with it, then the winner's priming start)
#          and launch of the 8-layer Air, inside the call: the launch loads a compile cache;
#          SBINT=1 (go, after SHAPES=air-8l) benchmarks/interrupted_start.py on the 8-layer Air: Ctrl-C while the priming start
#          compiles, SIGTERM while the launch loads; seconds to exit, GPU memory and vLLM processes left;
#          SHAPES=air REPEAT=1 (go) the Air at vLLM's defaults three times (cold DEBUG, INFO, DEBUG);
#          SHAPES=air PLAIN='batched 2048, 8k context' (go) the Air at those settings, no hook;
#          SHAPES=air (kit1 and go) GLM-4.5-Air (4 layers, the first dense, + MTP), held out of the GQA fit: the
#          three settings, graph_snapshot/ recording each start's profiling captures, then params-glm-air.yaml's
#          plan, launch and sweep (the forecast on a shape it was not fitted on)
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then truth_run.py in a session of its own (it outlives the call)
#   wait   keep the machine while it runs (WAIT_S, default 560 s), then bring back what is done
source "$(dirname "$0")/kit-steps.sh" "$1" truth
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  if [ "${SHAPES:-}" = air ]; then
    python3 $EX/mkglm.py $MODELS/glm45-air-fp8-mtp --tokenizer /tmp/tok --layers 4 --mtp 1 --shape glm-4.5-air \
      2>&1 | tail -1
  elif [ "${SHAPES:-}" = glm+air ]; then  # the two GQA shapes whose activations disagree, for PEAK=1
    python3 $EX/mkglm.py $MODELS/glm45-fp8-mtp --tokenizer /tmp/tok --layers 2 --mtp 1 2>&1 | tail -1
    python3 $EX/mkglm.py $MODELS/glm45-air-fp8-mtp --tokenizer /tmp/tok --layers 4 --mtp 1 --shape glm-4.5-air \
      2>&1 | tail -1
  elif [ "${SHAPES:-}" = peak-layers ]; then  # GLM-4.5 at 4 layers, the Air at 2: does the layer count keep tensors?
    python3 $EX/mkglm.py $MODELS/glm45-4l-fp8 --tokenizer /tmp/tok --layers 4 --mtp 0 2>&1 | tail -1
    python3 $EX/mkglm.py $MODELS/glm45-air-2l-fp8 --tokenizer /tmp/tok --layers 2 --mtp 0 --shape glm-4.5-air \
      2>&1 | tail -1
  elif [ "${SHAPES:-}" = air-8l ]; then  # the Air at 8 layers alone (SBWARM's model, 19 GB)
    python3 $EX/mkglm.py $MODELS/glm45-air-8l-fp8 --tokenizer /tmp/tok --layers 8 --mtp 0 --shape glm-4.5-air \
      2>&1 | tail -1
  elif [ "${SHAPES:-}" = air-deep ]; then  # the Air at 8 and 16 layers: does a deeper model leave more behind?
    for l in 8 16; do
      python3 $EX/mkglm.py $MODELS/glm45-air-${l}l-fp8 --tokenizer /tmp/tok --layers $l --mtp 0 --shape glm-4.5-air \
        2>&1 | tail -1
    done
  elif [ "${SHAPES:-}" = glm ]; then  # GLM-4.5 alone, for its activation at half the requests and half the tokens
    python3 $EX/mkglm.py $MODELS/glm45-fp8-mtp --tokenizer /tmp/tok --layers 2 --mtp 1 2>&1 | tail -1
  elif [ "${SHAPES:-}" = small ]; then  # held out of the FP8-MLA fit: hidden 2048, top-6 of 1,408-wide experts
    python3 $EX/mkdsv3.py $MODELS/dsv3-small-fp8 --tokenizer /tmp/tok --shape small --layers 2 --mtp 0 2>&1 | tail -1
  elif [ "${SHAPES:-}" = heads ]; then
    for h in 16 32 64 128; do
      python3 $EX/mkdsv3.py $MODELS/dsv3-h$h-e64 --tokenizer /tmp/tok --heads $h --experts 64 --layers 2 --mtp 0 \
        2>&1 | tail -1
    done
  elif [ "${SHAPES:-}" = dsv3-64h ]; then  # DeepSeek-V3 at 64 heads: the FP8-MLA activation's heads, alone
    python3 $EX/mkdsv3.py $MODELS/dsv3-64h-fp8 --tokenizer /tmp/tok --shape deepseek-v3-64h --layers 2 --mtp 0 \
      2>&1 | tail -1
  elif [ "${SHAPES:-}" = q235 ]; then
    python3 $EX/mkdsv3.py $MODELS/dsv3-fp8-mtp --tokenizer /tmp/tok --layers 2 --mtp 1 2>&1 | tail -1
    python3 $EX/../h200x8/mkckpt.py $MODELS/q235-fp8 --tokenizer /tmp/tok --shape qwen3-235b-a22b --layers 4 --fp8 \
      --vocab 151936 2>&1 | tail -1
  else  # 44 GB on a 64 GiB disk: the DeepSeek-V3 mini without the MTP layer it carried on 2026-12-04 (15.4 GB)
    python3 $EX/mkdsv3.py $MODELS/dsv3-fp8 --tokenizer /tmp/tok --layers 2 --mtp 0 2>&1 | tail -1
    python3 $EX/mkdsv3.py $MODELS/kimi-k2-fp8 --tokenizer /tmp/tok --shape kimi-k2 --layers 2 --mtp 0 2>&1 | tail -1
    python3 $EX/mkglm.py $MODELS/glm45-fp8-mtp --tokenizer /tmp/tok --layers 2 --mtp 1 2>&1 | tail -1
  fi
  du -sh $MODELS/*; sync ;;
kit2) ls $STAGE ;;
go)
  pkill -f "vllm serve" ; sleep 1
  if [ -n "${PLAIN:-}" ]; then  # the Air at the settings PLAIN names (truth_run.py's), without the snapshot hook
    TRUTH_SETTINGS="$PLAIN" timeout 200 python3 $EX/truth_run.py $R/air-plain $MODELS/glm45-air-fp8-mtp 2>&1 | tail -2
    pack; exit 0
  fi
  if [ -n "${PEAK:-}" ]; then  # GLM-4.5 and the Air at vLLM's defaults, profile_peak/ recording each profile run
    mkdir -p $R/peak
    for m in ${PEAK_MODELS:-glm45-fp8-mtp glm45-air-fp8-mtp}; do
      [ -n "${PEAK_GC:-}" ] && export SB_PROFILE_GC=${PEAK_GC%% *} PEAK_GC=${PEAK_GC#* }  # one mode per model
      PYTHONPATH=$PWD/$EX/profile_peak:$PYTHONPATH SB_PROFILE_PEAK=$R/peak TRUTH_SETTINGS=defaults timeout 240 \
        python3 $EX/truth_run.py $R/peak-$m $MODELS/$m 2>&1 | tail -1 | cut -c1-200
      grep -h "torch peak memory increase" $R/peak-$m/*.log | grep -o "torch peak.*GiB;" 
    done
    head -c 6000 $R/peak/peak-*.txt; pack; exit 0
  fi
  if [ -n "${WARM:-}" ]; then  # each of PEAK_MODELS at vLLM's defaults as servebook runs it: a dummy-weight
    # rehearsal that compiles cold, then the real weights, which find the rehearsal's compile cache (same key)
    rm -rf ~/.cache/vllm/torch_compile_cache ${VLLM_CACHE_ROOT:-/nonexistent}/torch_compile_cache
    for m in ${PEAK_MODELS:-glm45-air-16l-fp8}; do
      TRUTH_LOAD_FORMAT=dummy TRUTH_SETTINGS=defaults timeout 150 python3 $EX/truth_run.py $R/warm-$m-1-dummy \
        $MODELS/$m 2>&1 | tail -1 | cut -c1-700
      TRUTH_SETTINGS=defaults timeout 150 python3 $EX/truth_run.py $R/warm-$m-2-real $MODELS/$m 2>&1 | tail -1 \
        | cut -c1-700
    done
    pack; exit 0
  fi
  if [ -n "${SBWARM:-}" ]; then  # servebook's own plan, rehearsal and launch of one model (PEAK_MODELS): the
    # launch should load a compile cache and be planned as such a start. SBWARM=1: the rehearsal without the
    # routing simulation leaves it; SBWARM=routed: the routed rehearsal, then its priming start of the winner
    rm -rf ~/.cache/vllm/torch_compile_cache ~/.cache/servebook
    ROUTING="--set rehearse_routing=none"; OUTR=$R/sbwarm; [ "$SBWARM" = routed ] && ROUTING="" OUTR=$R/sbwarm-routed
    SERVEBOOK_OUTPUTS=$OUTR timeout 540 servebook run $EX/params-glm-air.yaml --stages plan,rehearse,launch \
      --set model=$MODELS/${PEAK_MODELS:-glm45-air-8l-fp8} $ROUTING \
      --set rehearse_skewed_routing=none --set rehearse_layouts=1 --set rehearse_max_concurrency=16 2>&1 \
      | tail -12 | cut -c1-300
    servebook stop 2>&1 | tail -1
    cp ~/.cache/servebook/*.jsonl $OUTR/ 2>/dev/null
    grep -rh "compile cache\|KV cache size\|torch.compile took" $OUTR --include=*.log | cut -c1-220
    pack; exit 0
  fi
  if [ -n "${SBINT:-}" ]; then  # interrupts where a start has not served (benchmarks/interrupted_start.py): Ctrl-C to the job
    # while the routed rehearsal's priming start compiles, SIGTERM to servebook while the launch loads real weights
    rm -rf ~/.cache/vllm/torch_compile_cache ~/.cache/servebook
    timeout 560 python3 benchmarks/interrupted_start.py $R/sbint $EX/params-glm-air.yaml $MODELS/${PEAK_MODELS:-glm45-air-8l-fp8} \
      2>&1 | tail -3 | cut -c1-900
    servebook stop 2>&1 | tail -1
    pack; exit 0
  fi
  if [ -n "${REPEAT:-}" ]; then  # the Air at vLLM's defaults three times: cold at DEBUG, warm at INFO, warm at DEBUG
    for run in 1-debug 2-info 3-debug; do
      TRUTH_SETTINGS=defaults TRUTH_LOG_LEVEL=$(echo ${run#*-} | tr a-z A-Z) timeout 170 python3 $EX/truth_run.py \
        $R/air-$run $MODELS/glm45-air-fp8-mtp 2>&1 | tail -1 | cut -c1-200
    done
    pack; exit 0
  fi
  if [ -n "${SYNC:-}" ]; then  # device time short: the defaults alone, inside this call, brought back by it
    ONE=$MODELS/glm45-air-fp8-mtp; [ "${SHAPES:-}" = glm ] && ONE=$MODELS/glm45-fp8-mtp
    mkdir -p $R/snapshot
    PYTHONPATH=$PWD/$EX/graph_snapshot:$PYTHONPATH SB_GRAPH_SNAPSHOT=$R/snapshot TRUTH_SETTINGS=defaults \
      timeout 300 python3 $EX/truth_run.py $R/${SHAPES:-air} $ONE 2>&1 | tail -4
    grep -h "^==" $R/snapshot/captures-*.txt; pack; exit 0
  fi
  if [ "${SHAPES:-}" = air ]; then
    AIR=$MODELS/glm45-air-fp8-mtp
    start_run <<SCRIPT
echo "=== truth \$(date +%T)"
mkdir -p $R/snapshot
PYTHONPATH=$PWD/$EX/graph_snapshot:\$PYTHONPATH SB_GRAPH_SNAPSHOT=$R/snapshot \\
  TRUTH_SETTINGS='${TRUTH_SETTINGS:-defaults;max_num_seqs 128;batched 2048, 8k context}' python3 $EX/truth_run.py \\
  $R/air $AIR 2>&1 | tail -6
grep -h "^==" $R/snapshot/captures-*.txt
echo "=== sweep \$(date +%T)"
stages $R/sweep $EX/params-glm-air.yaml --stages plan,launch,benchmark
SCRIPT
    exit 0
  fi
  if [ "${SHAPES:-}" = glm ]; then
    setsid bash -c "cd $PWD && source /tmp/kit/unpack.sh >/dev/null 2>&1 && \
      TRUTH_SETTINGS='max_num_seqs 512;batched 4096' python3 $EX/truth_run.py $R/glm $MODELS/glm45-fp8-mtp; \
      echo '=== done'" > $R/console.log 2>&1 < /dev/null &
    sleep 30; tail -5 $R/console.log; exit 0
  fi
  if [ "${SHAPES:-}" = small ]; then
    setsid bash -c "cd $PWD && source /tmp/kit/unpack.sh >/dev/null 2>&1 && \
      TRUTH_SETTINGS='${TRUTH_SETTINGS:-defaults;max_num_seqs 128}' python3 $EX/truth_run.py $R/small $MODELS/dsv3-small-fp8; \
      echo '=== done'" > $R/console.log 2>&1 < /dev/null &
    sleep 30; tail -5 $R/console.log; exit 0
  fi
  if [ "${SHAPES:-}" = heads ]; then
    H=$MODELS/dsv3-h
    setsid bash -c "cd $PWD && source /tmp/kit/unpack.sh >/dev/null 2>&1 && \
      TRUTH_SETTINGS='defaults;batched 2048' python3 $EX/truth_run.py $R/heads ${H}16-e64 ${H}32-e64 ${H}64-e64 ${H}128-e64; \
      TRUTH_SETTINGS='8k context' python3 $EX/truth_run.py $R/context ${H}16-e64 ${H}128-e64; \
      TRUTH_SETTINGS='max_num_seqs 128' python3 $EX/truth_run.py $R/requests ${H}16-e64; echo '=== done'" \
      > $R/console.log 2>&1 < /dev/null &
    sleep 30; tail -5 $R/console.log; exit 0
  fi
  setsid bash -c "cd $PWD && source /tmp/kit/unpack.sh >/dev/null 2>&1 && python3 $EX/truth_run.py $R \
    $(ls -d $MODELS/dsv3-fp8* $MODELS/dsv3-64h-fp8 $MODELS/kimi-k2-fp8 $MODELS/glm45-fp8-mtp $MODELS/q235-fp8 2>/dev/null | tr "\n" " "); \
    echo '=== done'" \
    > $R/console.log 2>&1 < /dev/null &
  sleep 30; tail -5 $R/console.log ;;
wait) finish ;;
esac
