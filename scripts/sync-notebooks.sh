#!/usr/bin/env bash
# After editing a notebook's py:percent twin (or the .ipynb in JupyterLab): make the pair equal again,
# re-render every parameters cell from the parameter vocabulary (servebook.params), and strip outputs,
# so what is committed is reviewable, output-free and agrees with `servebook params`.
set -euo pipefail
cd "$(dirname "$0")/.."
pair() {
  for src in notebooks/[0-9][0-9]_*.py notebooks/compare.py; do
    nb="${src%.py}.ipynb"
    if [ -f "$nb" ]; then .venv/bin/jupytext --sync --quiet "$nb"; else .venv/bin/jupytext --quiet --to ipynb "$src"; fi
  done
}
pair
.venv/bin/servebook sync-notebooks
pair
.venv/bin/nbstripout --extra-keys "metadata.language_info" notebooks/*.ipynb
