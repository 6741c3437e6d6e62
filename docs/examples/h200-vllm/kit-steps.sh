# The steps every on-h200-*.sh shares, sourced as `source "$(dirname "$0")/kit-steps.sh" STEP NAME`:
#   kit0   copy .gpu/c0 (bins.part0) to /tmp/stage and end the call
#   kit1   unpack .gpu/c1 (the Python tree, this kit); any later step only sets the environment
# and `finish`, the wait step: keep the machine until the run writes "=== done" (WAIT_S, default 560 s), show the
# console's tail and the GPU's memory, bring $R back as $OUT/NAME.tgz.
set -uo pipefail
STEP=$1; KIT_NAME=$2; EX=docs/examples/h200-vllm; R=/tmp/results
case $STEP in
kit0) mkdir -p /tmp/stage && cp .gpu/c0/* /tmp/stage/ && ls -la /tmp/stage; exit 0 ;;
kit1) source .gpu/c1/kit/unpack.sh ;;
*) source /tmp/kit/unpack.sh ;;
esac
mkdir -p $R

pack() { tar czf "$OUT/$KIT_NAME.tgz" -C $R . 2>/dev/null; ls -la "$OUT"; }

finish() {
  local end=$((SECONDS + ${WAIT_S:-560}))
  while [ $SECONDS -lt $end ] && ! grep -q "=== done" $R/console.log; do sleep 5; done
  grep -v "^    \[" $R/console.log | tail -40 | cut -c1-300
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  pack
}

# go's common part: the run's own lines (read from stdin) written to /tmp/run-all.sh between the kit's environment
# and "=== done", and started in a session of its own so that it outlives the call. Inside, `stages OUT ARGS...`
# runs `servebook run ARGS` with its outputs under OUT, keeps the server logs there and stops what it started.
start_run() {
  servebook stop >/dev/null 2>&1
  {
    echo "set -u; cd $PWD; source /tmp/kit/unpack.sh >/dev/null 2>&1"
    echo 'stages() { local out=$1; shift; SERVEBOOK_OUTPUTS=$out servebook run "$@" 2>&1 | cut -c1-400;'
    echo '  cp outputs/servers/*.log "$out"/ 2>/dev/null; servebook stop 2>&1 | tail -1; }'
    cat
    echo 'nvidia-smi --query-gpu=memory.used --format=csv,noheader'
    echo 'echo "=== done $(date +%T)"'
  } > /tmp/run-all.sh
  setsid bash /tmp/run-all.sh > $R/console.log 2>&1 < /dev/null &
  sleep 20; tail -5 $R/console.log
}
