"""Units rendered for the story's two deployments, with values derived from their plans."""

import re
from pathlib import Path

import pytest

from servebook import modelspec, params, planner, server, server_config, service, systemd
from servebook.errors import DeployFailed
from servebook.records import Command, DeployRecord, LaunchRecord
from servebook.stages import deploy

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "configs"


def story_unit(params_name: str, config_name: str, gpu: str) -> tuple[systemd.UnitSpec, str, dict]:
    p = params.load(REPO / "params" / params_name)
    spec = modelspec.load(str(CONFIGS / config_name))
    from servebook import gpus

    g = gpus.lookup(gpu)
    plan = planner.plan(
        spec,
        planner.Device.for_gpu(g, 8),
        max_model_len=p.max_model_len,
        gpu_memory_utilization=p.gpu_memory_utilization,
        kv_cache_dtype=p.kv_cache_dtype,
    )
    predicted = server_config.load_budget_s(plan.weights_total_bytes)
    cfg = server.ServerConfig.from_params(p, "cuda")
    unit = service.unit_spec(p.run_name, LaunchRecord.planned(cfg), predicted_load_s=predicted)
    return unit, systemd.render_unit(unit), plan


@pytest.mark.parametrize(
    "params_name, config_name, gpu",
    [
        ("minimax-m2.5-8gpu.yaml", "minimax-m2.5.json", "H200"),
        ("kimi-k2.5-8gpu.yaml", "kimi-k2.5.json", "RTX-PRO-6000"),
    ],
)
def test_story_units(params_name, config_name, gpu, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-never-in-the-unit")
    unit, text, plan = story_unit(params_name, config_name, gpu)
    line = lambda key: re.search(rf"^{key}=(.*)$", text, re.M).group(1)  # noqa: E731
    assert line("Type") == "exec" and line("KillMode") == "control-group" and line("Restart") == "on-failure"
    assert line("User") == "vllm" and line("LimitNOFILE") == "65536" and line("StandardOutput") == "journal"
    # the start timeout covers the predicted load of the plan's weights, with margin
    load = server_config.BASE_BUDGET_S + server_config.SECONDS_PER_GB * plan.weights_total_bytes / 1e9
    assert int(line("TimeoutStartSec")) == unit.timeout_start_s >= 1.5 * load
    assert f"VLLM_ENGINE_READY_TIMEOUT_S={unit.timeout_start_s}" in text
    assert int(line("StartLimitIntervalSec")) > 3 * unit.timeout_start_s
    assert line("ExecStartPre").endswith("gpu-check --port 8000 --gpus 0,1,2,3,4,5,6,7")
    assert "wait-ready --url http://127.0.0.1:8000" in line("ExecStartPost")
    assert "--tensor-parallel-size 8" in line("ExecStart") and "--host 127.0.0.1" in line("ExecStart")
    assert "sk-never-in-the-unit" not in text and "--api-key" not in text
    assert line("EnvironmentFile") == f"-/etc/servebook/{unit.name}.env"
    assert "VLLM_API_KEY" in systemd.render_env_file(unit) and "sk-never" not in systemd.render_env_file(unit)
    if "minimax" in params_name:
        assert "--enable-expert-parallel" in line("ExecStart")
    else:
        assert unit.timeout_start_s > 1.5 * 36 * 60  # the story's 36-minute load fits
    path = tmp_path / unit.unit_name
    path.write_text(text)
    result = systemd.verify(path)
    assert result.ran, result.output
    assert result.ok, result.output


def test_verify_catches_a_broken_unit(tmp_path):
    path = tmp_path / "servebook-bad.service"
    path.write_text("[Service]\nType=bogus\nExecStart=/bin/true\nKillMode=sometimes\n")
    result = systemd.verify(path)
    assert result.ran and not result.ok


def test_exec_lines_are_quoted_for_systemd():
    assert (
        systemd.exec_line(["/v/python", "-m", "x", "--json", '{"a": 1}', "100%", "$HOME"])
        == '/v/python -m x --json "{\\"a\\": 1}" "100%%" "$$HOME"'
    )


def test_without_systemd_analyze_the_unit_is_not_verified_and_the_run_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(systemd.shutil, "which", lambda name: None)
    result = systemd.verify(tmp_path / "x.service")
    assert not result.ran and "apt-get install systemd" in result.output
    record = DeployRecord(
        unit_name="servebook-x.service",
        unit_file="",
        env_file="",
        timeout_start_s=400,
        load_seconds=60,
        load_source="measured",
        start_limit_interval_s=1500,
        verify=result,
        systemd_running=False,
        pre_start_with_ad_hoc_server=Command(command="gpu-check", returncode=1, output="held"),
    )
    deploy.check(record, params.Params())  # a finding, not a failure
    assert "**not verified**: install systemd (apt-get install systemd)" in deploy.summary(record)
    with pytest.raises(DeployFailed, match="cannot be verified before it is installed"):
        deploy.check(record, params.Params(deploy_install=True))


def test_a_python_without_the_console_script_runs_the_module(tmp_path, monkeypatch):
    """On the H200s servebook was a tree on PYTHONPATH: no script beside the Python, so the unit and the
    pre-start check run ``python -m servebook.cli``, and that command answers."""
    import subprocess
    import sys

    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert service.servebook_command() == [str(tmp_path / "bin" / "python3"), "-m", "servebook.cli"]
    monkeypatch.undo()
    out = subprocess.run([sys.executable, "-m", "servebook.cli", "gpu-check", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--port" in out.stdout
    unit, text, _ = story_unit("minimax-m2.5-8gpu.yaml", "minimax-m2.5.json", "H200")
    unit.servebook = ["/usr/bin/python3", "-m", "servebook.cli"]
    assert "ExecStartPre=/usr/bin/python3 -m servebook.cli gpu-check --port" in systemd.render_unit(unit)


def test_a_two_node_server_gets_a_unit_per_node_and_the_heads_starts_and_stops_the_others(tmp_path):
    """Kimi-K2.5 on 2 x 8 H100: the head's unit starts the worker node's unit over SSH before its own vLLM, returns
    from `systemctl start` only once /health answers (every rank joined), and stops the worker's unit after."""
    from servebook import multinode

    p = params.load(REPO / "params" / "kimi-k2.5-2x8-h100.yaml")
    cfg = server.ServerConfig.from_params(p, "cuda")
    head_cfg, workers = multinode.prepare(cfg, multinode.NodeSet.for_nodes(p.nodes_section), tmp_path)
    launch = LaunchRecord.planned(head_cfg).model_copy(update={"workers": workers, "topology": "nodes"})
    unit = service.unit_spec(p.run_name, launch, predicted_load_s=2400)
    node_units = service.worker_units(unit, launch, tmp_path)
    head = systemd.render_unit(unit)
    worker = (tmp_path / node_units[0].unit_name).read_text()
    worker_unit = "servebook-kimi-k2.5-2x8-h100-node1.service"
    assert [u.unit_name for u in node_units] == [worker_unit]
    starts = re.findall(r"^ExecStartPre=(.*)$", head, re.M)
    assert starts[0].endswith("gpu-check --port 8000 --gpus 0,1,2,3,4,5,6,7")
    assert (
        starts[1]
        == f"/usr/bin/ssh -o BatchMode=yes -o ConnectTimeout=10 gpu-node-2 systemctl start --no-block {worker_unit}"
    )
    assert re.search(rf"^ExecStopPost=-/usr/bin/ssh .* gpu-node-2 systemctl stop {worker_unit}$", head, re.M)
    assert "--nnodes 2 --node-rank 0 --master-addr 10.0.0.1" in re.search(r"^ExecStart=(.*)$", head, re.M).group(1)
    assert "wait-ready" in re.search(r"^ExecStartPost=(.*)$", head, re.M).group(1)
    # the worker: headless, its own address for vLLM, nothing that waits on an API it does not serve
    exec_start = re.search(r"^ExecStart=(.*)$", worker, re.M).group(1)
    assert "--node-rank 1" in exec_start and "--headless" in exec_start.split() and "VLLM_HOST_IP=10.0.0.2" in worker
    assert not re.search(r"^ExecStart(Pre|Post)=", worker, re.M) and "KillMode=control-group" in worker
    for node_unit in node_units:
        assert not node_unit.verify.ran or node_unit.verify.ok, node_unit.verify.output
    path = tmp_path / unit.unit_name
    path.write_text(head)
    assert not systemd.verify(path).ran or systemd.verify(path).ok


def test_the_watchdog_asks_the_service_for_a_token_and_restarts_it_when_none_comes(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-unit-test-key")
    unit, _, _ = story_unit("kimi-k2.5-8gpu.yaml", "kimi-k2.5.json", "RTX-PRO-6000")
    service, timer = systemd.render_watchdog(unit)
    check = re.search(r"^ExecStart=(.*)$", service, re.M).group(1)
    assert f"watchdog --url {unit.url} --unit {unit.unit_name}" in check
    assert f"EnvironmentFile=-{unit.env_file}" in service  # the key, from the root-only file, never in the unit
    assert "sk-unit-test-key" not in service + timer
    assert f"WantedBy={unit.unit_name}" in timer and f"PartOf={unit.unit_name}" in timer
    for name, text in zip(systemd.watchdog_names(unit), (service, timer), strict=True):
        path = tmp_path / name
        path.write_text(text)
        verified = systemd.verify(path)
        assert not verified.ran or verified.ok, verified.output


def test_without_a_dry_run_the_launched_server_keeps_serving_and_the_unit_is_still_verified(tmp_path, monkeypatch):
    """deploy_dry_run: false on a port the launch's own server holds: the unit is rendered and verified, the
    server this run started is neither stopped nor replaced by a second start, and the summary says why."""
    p = params.load(REPO / "params" / "ci.yaml", ["deploy_dry_run=false"])
    assert p.deploy_section.dry_run is False
    launch = LaunchRecord.planned(server.ServerConfig.from_params(p, "cpu")).model_copy(
        update={"started_by_this_run": True}
    )

    def never(*args, **kwargs):
        raise AssertionError("deploy_dry_run: false started or stopped a server")

    held = Command(command="gpu-check", returncode=1, output=f"port {p.port} is held")
    monkeypatch.setattr(service, "pre_start_check", lambda unit, as_user=False: held)
    monkeypatch.setattr(server, "stop", never)
    monkeypatch.setattr(service, "dry_run_start", never)
    record = service.one_server(p.deploy_section, tmp_path, launch, "tiny", None)
    assert record.dry_run is None and record.ad_hoc_server_stopped == ""
    assert record.dry_run_skipped.startswith("deploy_dry_run is false") and (tmp_path / record.unit_name).is_file()
    assert "no dry run (deploy_dry_run: false)" in deploy.summary(record)
    deploy.check(record, p)  # not a failure: what was asked for
