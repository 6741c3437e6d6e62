#!/usr/bin/env bash
# After editing a notebook's py:percent twin (or the .ipynb in JupyterLab): make the pair equal
# again and strip outputs, so what is committed is reviewable and output-free.
set -euo pipefail
cd "$(dirname "$0")/.."
for src in notebooks/[0-9][0-9]_*.py; do
  nb="${src%.py}.ipynb"
  if [ -f "$nb" ]; then .venv/bin/jupytext --sync --quiet "$nb"; else .venv/bin/jupytext --quiet --to ipynb "$src"; fi
done
.venv/bin/nbstripout notebooks/[0-9][0-9]_*.ipynb
