#!/bin/bash
# Issue 39's overlap on one H200: the rehearsal beside a download, one step per device call, from the project root:
#   bash docs/examples/h200-vllm/on-h200-overlap.sh STEP
#   kit0   carry .gpu/c0 (bins.part0, and olahw.tar: olah's wheels for the local hub mirror): staged under /tmp
#   kit1   carry .gpu/c1: the Python tree; build the MiniMax-shaped FP8 checkpoint (2 layers, 7.4 GB); install olah
#   kit2   carry .gpu/c2: the second kernel part
#   go     carry .gpu/c3: kernels in place, then in a session of its own (it outlives the call):
#          benchmarks/rehearse_beside_download.py serving that checkpoint through olah behind a link of KBPS kB/s
#          (default 11,000: about 670 s for the 7.4 GB, longer than four candidates) to `servebook run` with stages
#          plan, download, rehearse, launch on params-minimax-overlap.yaml
#   wait   keep the machine while the run goes on (WAIT_S, default 560 s), then bring back what is done
# Here, to make olahw.tar (olah pins a FastAPI that conflicts with vLLM's, so it gets a tree of its own there):
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d olahw olah
#   tar cf .gpu/c0/olahw.tar olahw
source "$(dirname "$0")/kit-steps.sh" "$1" overlap
case $STEP in
kit1)
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  python3 $EX/../h200x8/mkckpt.py $MODELS/minimax-fp8 --tokenizer /tmp/tok --shape minimax-m2.5 --layers 2 --fp8 2>&1 | tail -1
  tar xf $STAGE/olahw.tar -C /tmp && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/olah-site \
    /tmp/olahw/*.whl 2>&1 | grep -v WARNING | tail -3
  PYTHONPATH=/tmp/olah-site python3 -c "import olah.server; print('olah', olah.server.__file__)"
  git --version; du -sh $MODELS/*; df -h /tmp | tail -1; sync ;;
kit2) ls $STAGE ;;
go)
  # the hub mirror's olah, as tests/support/hub_mirror.py looks for it, from the tree kit1 installed
  mkdir -p .venv-olah/bin
  printf '#!/bin/sh\nPYTHONPATH=/tmp/olah-site exec python3 -c "import sys; from olah.server import cli; sys.exit(cli())" "$@"\n' \
    > .venv-olah/bin/olah-cli && chmod +x .venv-olah/bin/olah-cli
  start_run <<SCRIPT
echo "=== overlap \$(date +%T)"
TMPDIR=/tmp python3 benchmarks/rehearse_beside_download.py --checkpoint $MODELS/minimax-fp8 \
  --params $EX/params-minimax-overlap.yaml --kb-per-s ${KBPS:-11000} --keep $R/overlap
cp outputs/servers/*.log $R/overlap/ 2>/dev/null; servebook stop 2>&1 | tail -1
SCRIPT
  ;;
wait) finish ;;
esac
