# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: tags,-all
#     formats: ipynb,py:percent
#     notebook_metadata_filter: kernelspec,jupytext,-all
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: servebook (.venv)
#     language: python
#     name: servebook
# ---

# %% [markdown]
# # 07 · Deploy
#
# **Answers:** the launched configuration as a systemd service that starts only when ready. **Needs:** stage 03's record (06's when it ran); root to install.
#
# The configuration the earlier stages chose, as a systemd service that starts only when ready and cleans up
# after itself. The unit is rendered from the launch stage's record (the exact command vLLM's parser accepted,
# its environment, the measured load time) plus the NCCL stage's recommended environment when it ran:
#
# - `Type=exec`, and an `ExecStartPost=` that waits for `/health`, so `systemctl start` returns when the model
#   answers, not half an hour before;
# - an `ExecStartPre=` that refuses to start while anything holds the GPUs or the port (`servebook gpu-check`);
# - `TimeoutStartSec` = 1.5 × the load time + 5 minutes, and vLLM's `VLLM_ENGINE_READY_TIMEOUT_S` to match;
# - `KillMode=control-group` with SIGTERM and a stop timeout: EngineCore and workers go with the API server;
# - `Restart=on-failure` with `RestartSec=30` and a start-limit window that holds three full loads;
# - a dedicated non-root user, journald logging, file-descriptor limits, and hardening that still lets vLLM read
#   the model, use the GPUs and write its caches. The API key lives in a root-only environment file.
#
# `systemd-analyze verify` checks the unit. Installing happens only with `deploy_install: true`. Where systemd is
# not running (containers, these CI machines), the stage runs the pre-start check, the exact serving command and the
# post-start wait itself, then a smoke test against that server, to prove each piece works. That dry run takes the
# launched server's place on its port; `deploy_dry_run: false` keeps the launched server serving and only renders and
# verifies the unit.

# %% tags=["parameters"]
params_file: str = "../params/default.yaml"  # params YAML filling this cell's defaults (a value edited here wins); `servebook run` leaves it empty
interactive: bool = True  # widgets and live views (JupyterLab) instead of printed lines and static plots; `servebook run` and nbval run with false
deploy_name: str = ""  # unit servebook-<name>.service; empty means the served name
deploy_user: str = "vllm"  # dedicated non-root user the service runs as
deploy_install: bool = False  # install, enable and start the unit (needs root and a running systemd)
deploy_dry_run: bool = True  # start the unit's exact command once as systemd would (in place of the launched server) and smoke-test it; false renders and verifies the unit and leaves the launched server serving
run_dir: str = ""  # run folder for results (set by `servebook run`); empty means outputs/interactive

# %%
from pathlib import Path

from IPython.display import Markdown, display

from servebook import ui
from servebook.stages import deploy as stage

p = ui.notebook_params(globals())
deployed = stage.run(p, run_dir)

# %% [markdown]
# ## The unit

# %%
print(Path(deployed.unit_file).read_text())

# %% [markdown]
# A server across several nodes gets one unit per other node: vLLM `--headless` there, started by the head's unit
# (`ExecStartPre`, over SSH) and stopped after it (`ExecStopPost`). Copy each to its node's
# `/etc/systemd/system/` (with `deploy_install: true` servebook does, over the same SSH).
#
#
# Several replicas behind vllm-router get one unit per replica, each with the command and cores it ran with here;
# the router's unit `Requires=` them and starts `After=` them, so `systemctl start` on the router brings every
# replica up first (each start returns once its `/health` answers), and `PartOf=` makes a stop or restart of the
# router reach them.

# %%
for node_unit in [*deployed.node_units, *deployed.replica_units]:
    print(f"# {node_unit.node}: {node_unit.unit_name} (systemd-analyze verify: {'passed' if node_unit.verify.ok else 'see notes'})")
    print(Path(node_unit.unit_file).read_text())
if not deployed.node_units and not deployed.replica_units:
    print("one server on one node: no other unit")

# %% [markdown]
# ## Checks

# %%
v = deployed.verify
lines = [f"- `systemd-analyze verify`: {'passed' if v.ok else 'FAILED'}" + (f" (notes: {v.output[:300]})" if v.output else "")]
pre = deployed.pre_start_with_ad_hoc_server
lines.append(f"- pre-start check while the ad hoc server runs: exit {pre.returncode} — {pre.output[:200]}")
if deployed.ad_hoc_server_stopped:
    lines.append(f"- ad hoc server stopped for the service: {deployed.ad_hoc_server_stopped}")
dry = deployed.dry_run
if dry:
    lines.append(f"- dry run, pre-start check: exit {dry.pre_start.returncode}")
    if dry.post_start:
        lines.append(f"- dry run, post-start wait: exit {dry.post_start.returncode} — {dry.post_start.output}")
    if dry.smoke_test:
        lines.append(f"- dry run, smoke test: {'passed' if dry.smoke_test.passed else 'FAILED'}")
    if dry.stop:
        lines.append(f"- dry run, stop: {len(dry.stop.signalled)} processes, {len(dry.stop.remaining)} left")
if deployed.dry_run_skipped:
    lines.append(f"- dry run: {deployed.dry_run_skipped}")
lines.append(f"- installed: {deployed.installed or 'no (deploy_install is false)'}")
display(Markdown("\n".join(lines)))

# %%
stage.check(deployed, p)
