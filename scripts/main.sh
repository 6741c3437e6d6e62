#!/usr/bin/env bash
# README's main job: set up, then run the whole pipeline on the embedded default.
# Extra arguments go to `servebook run` (e.g. --set port=8001, --stages reconnaissance).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/servebook run params/default.yaml "$@"
