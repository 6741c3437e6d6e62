#!/usr/bin/env bash
# README's test command: set up, then unit tests, integration tests against real vLLM
# on the CPU, and every stage notebook executed by nbval with CI parameters.
# Extra arguments go to pytest (e.g. -m "not integration" for the fast unit tests only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
started=$(date +%s)

nbval_port=8151
cleanup() { .venv/bin/servebook stop --port "$nbval_port" >/dev/null 2>&1 || true; }
trap cleanup EXIT

# the deploy stage checks its units with systemd-analyze (works without a running systemd)
# the multi-node tests reach a second "node" (127.0.0.3) through a real OpenSSH server they start themselves
missing=()
command -v systemd-analyze >/dev/null || missing+=(systemd)
[ -x /usr/sbin/sshd ] || missing+=(openssh-server)
# the report's offline check opens every report in headless Chromium; the workbook tests drive JupyterLab in it
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# guardrails: format, lint, types (strict for the records and stages), notebooks committed without outputs
echo "tests: ruff, mypy, nbstripout"
.venv/bin/ruff format --check --quiet lib tests benchmarks
.venv/bin/ruff check --quiet lib tests benchmarks
.venv/bin/mypy
.venv/bin/nbstripout --verify --extra-keys "metadata.language_info" notebooks/*.ipynb

# nbval checks that every cell of every notebook runs; the keyed pipeline test runs the same notebooks through
# papermill with every start they can make (the A/B's variant servers, the deploy's dry run) and a full sweep, so
# here the A/B keeps only the variant vLLM refuses (named before any start), stage 07 renders and verifies its unit
# without a second server, and the sweeps stop at 4 streams
rm -rf build/nbval
.venv/bin/servebook prepare params/ci.yaml --out build/nbval --set port=$nbval_port \
  --set 'ab_variants=[{name: bogus-flag, extra_args: [--no-such-flag]}]' --set deploy_dry_run=false \
  --set bench_max_concurrency=4 --set rehearse_max_concurrency=2 \
  --run-dir "$PWD/build/nbval/run" > /dev/null

.venv/bin/python -m pytest tests build/nbval --nbval-lax --nbval-cell-timeout=900 -p no:cacheprovider \
  --durations=40 -ra "$@"
echo "tests: wall time $(( $(date +%s) - started )) s (after setup)"
