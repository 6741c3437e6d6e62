"""Two nodes on one machine: the head on 127.0.0.2 (this machine) and a worker node on 127.0.0.3 that servebook
reaches through a real OpenSSH server. The embedded model served by real vLLM (CPU build) with TP=2 across the
two nodes through vLLM's multiprocessing multi-node launch (--nnodes 2, the worker --headless)."""

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from servebook import client, k8s, limits, models, params, remote, results, router, server
from servebook.errors import PreflightError
from servebook.records import BenchmarkRecord
from servebook.runner import stop_started_servers
from servebook.stages import benchmark, deploy, launch, smoke_test

from . import sshnode
from .conftest import ours_left, vllm_titles

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sshnode.available(), reason="needs Debian's openssh-server"),
]

PORT = 8161
KEY_ENV, KEY = "SERVEBOOK_NODES_KEY", "sk-nodes-0123456789"


@pytest.fixture(scope="module")
def node_b(tmp_path_factory):
    proc, ssh_config = sshnode.start(tmp_path_factory.mktemp("ssh"))
    yield ssh_config
    proc.kill()
    proc.wait()


def two_nodes(ssh_config, **kw) -> params.Params:
    values = dict(
        model="builtin:tiny-qwen3-moe",
        device="cpu",
        tensor_parallel_size=2,
        nodes=2,
        node_hosts=["local", "node-b"],
        node_addresses=["127.0.0.2", "127.0.0.3"],
        node_ssh_config=str(ssh_config),
        node_master_port=29611,
        port=PORT,
        max_model_len=1024,
        enforce_eager=True,
        cpu_kv_cache_gib=1,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
        bench_input_len=32,
        bench_output_len=16,
        bench_max_concurrency=2,
        bench_prompts_per_level=4,
        bench_min_level_s=1,
        bench_repeats=1,
        bench_max_repeats=1,
        bench_request_rates=[],
    )
    values.update(kw)
    return params.Params(**values)


def test_tp_across_two_nodes_serves_benchmarks_and_a_killed_worker_fails_clearly(node_b, tmp_path):
    p = two_nodes(node_b)
    started = time.monotonic()
    try:
        record = launch.run(p, tmp_path)
        ready_s = time.monotonic() - started
        # every node was probed before the launch: same vLLM and torch, same checkpoint, address on an interface
        assert [n.reachable for n in record.nodes] == [True, True]
        assert record.nodes[0].versions == record.nodes[1].versions and record.nodes[1].interface == "lo"
        assert record.nodes[0].checkpoint["sha256"] == record.nodes[1].checkpoint["sha256"]
        worker = record.workers[0]
        assert worker.ssh == "node-b" and "--headless" in worker.command and "--node-rank" in worker.command
        assert "--nnodes" in record.command and "--master-addr" in record.command
        assert "across 2 nodes" in launch.summary(record)
        # the head serves only once every rank has joined: TP=2 over two nodes, one KV cache per rank
        assert record.vllm_reported.kv_cache_tokens and remote.alive(worker)
        assert "2 nodes, every worker running" in next(r.detail for r in server.status() if r.port == PORT)

        smoke = smoke_test.run(p, tmp_path)
        assert smoke.passed

        swept = benchmark.run(p, tmp_path)
        assert not swept.fault and swept.best and swept.best.output_throughput > 0
        assert all(level.failed == 0 for level in swept.levels)
        print(f"two-node launch {ready_s:.0f} s; best {swept.best.output_throughput:.1f} tok/s")

        # the worker node's vLLM dies in the middle of a benchmark: the sweep stops on a fault that names it
        p_long = two_nodes(node_b, bench_min_level_s=20, bench_max_concurrency=1)
        killer = threading.Timer(4.0, lambda: remote.run(worker.ssh, f"kill -9 -- -{worker.pid}", worker.ssh_config))
        killer.start()
        broken = benchmark.run(p_long, tmp_path)
        killer.join()
        print(f"fault: {broken.fault}")
        assert broken.fault and "vLLM is gone on node1 (node-b)" in broken.fault
        assert "ends without an error: it was killed from outside" in broken.fault
        assert results.read(tmp_path, BenchmarkRecord).fault == broken.fault
        with pytest.raises(Exception, match="node-b"):
            benchmark.check(broken, p_long)

        # the service: a unit per node, the head's starting and stopping the worker's over SSH
        deployed = deploy.run(p, tmp_path)
        assert [u.unit_name for u in deployed.node_units] == ["servebook-tiny-qwen3-moe-node1.service"]
        head_unit = (tmp_path / deployed.unit_name).read_text()
        assert "node-b systemctl start --no-block servebook-tiny-qwen3-moe-node1.service" in head_unit
        assert deployed.dry_run_skipped and all(u.verify.ok or not u.verify.ran for u in deployed.node_units)
    finally:
        outcome = server.stop(port=PORT)
    # nothing of ours on either node: the head's process group here, the worker's session over there
    assert outcome.remaining == [] and ours_left(record.pgid) == []
    assert remote.leftovers(worker) == []
    assert server.registered(PORT) is None


def test_a_node_that_cannot_be_reached_is_refused_before_anything_starts(node_b, tmp_path):
    """An SSH destination nobody answers at, and a port in use on the head: named, with the fix, and no vLLM
    process started."""
    bad_config = tmp_path / "ssh_config"
    bad_config.write_text(node_b.read_text() + "\nHost node-gone\n  HostName 127.0.0.9\n  Port 1\n  ConnectTimeout 3\n")
    p = two_nodes(bad_config, node_hosts=["local", "node-gone"], node_addresses=["127.0.0.2", "127.0.0.9"])
    with pytest.raises(PreflightError) as refused:
        launch.run(p, tmp_path)
    message = str(refused.value)
    assert "node1 (node-gone): cannot reach node-gone over SSH" in message and "`ssh node-gone true`" in message
    assert server.registered(PORT) is None and not (tmp_path / "server.log").exists()

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the test before may leave TIME_WAIT behind
        held.bind(("127.0.0.2", 29611))
        held.listen()
        with pytest.raises(PreflightError, match=r"node0 \(this machine\): port 29611 .*in use"):
            launch.run(two_nodes(node_b), tmp_path)
    assert server.registered(PORT) is None


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    """The embedded model's tokenizer and sizes without the experts (Qwen3, dense): vLLM's CPU build runs a MoE
    layer's data-parallel dispatch through all_gatherv, which its CPU communicator does not implement
    (NotImplementedError on the first request), so data parallelism across processes is served dense here."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tiny = Path(models.build_tiny_model())
    out = tmp_path_factory.mktemp("tiny-qwen3-dense")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tiny / name, out / name)
    sizes = {
        k: v
        for k, v in models.TINY_CONFIG.items()
        if k
        not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step", "norm_topk_prob")
    }
    torch.manual_seed(0)
    config = Qwen3Config(**sizes, torch_dtype="bfloat16", eos_token_id=2, pad_token_id=0, bos_token_id=None)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def test_hybrid_data_parallel_serves_an_api_on_each_node_behind_the_router(node_b, dense_model, tmp_path, monkeypatch):
    """vLLM's --data-parallel-hybrid-lb over two nodes: DP=4, two ranks per node (with one, vLLM switches to its
    external mode, an API per rank), each node's own API server (the worker's on its own address), vllm-router in
    front on the head; keyed (the worker node's API server gets the key over SSH's stdin); smoke-tested and
    benchmarked through the router, each node's share of the requests recorded, and nothing left on either node."""
    api = PORT + 1
    monkeypatch.setenv(KEY_ENV, KEY)
    p = two_nodes(node_b, model=str(dense_model), tensor_parallel_size=1, data_parallel_size=4,
                  data_parallel_lb="hybrid", replica_base_port=api, router_policy="round_robin",
                  bench_max_concurrency=4, api_key_env=KEY_ENV)  # fmt: skip
    record = None
    try:
        record = launch.run(p, tmp_path)
        worker = record.workers[0]
        assert "--data-parallel-hybrid-lb" in record.command and "--data-parallel-hybrid-lb" in worker.command
        assert "--headless" not in worker.command
        assert worker.command[worker.command.index("--data-parallel-start-rank") + 1] == "2"
        assert worker.command[worker.command.index("--host") + 1] == "127.0.0.3"
        assert record.router and record.router.url.endswith(f":{PORT}")
        assert [r.url for r in record.replicas] == [f"http://127.0.0.1:{api}", f"http://127.0.0.3:{api}"]
        assert all(w.healthy for w in record.router.workers), record.router.workers
        # every API server refuses a request without the key: the worker node's too, which serves on its address
        assert [client.keyless_status(r.url) for r in record.replicas] == [401, 401]
        assert KEY not in " ".join(worker.command)

        assert smoke_test.run(p, tmp_path).passed
        swept = benchmark.run(p, tmp_path)
        assert not swept.fault and all(level.failed == 0 for level in swept.levels)
        top = swept.levels[-1]
        assert set(top.replica_shares) == {r.url for r in record.replicas}
        assert all(share > 0 for share in top.replica_shares.values()), top.replica_shares
        print(f"hybrid DP=4 over two nodes: best {swept.best.output_throughput:.1f} tok/s; shares {top.replica_shares}")

        # the service: the router's unit requires the head's, which starts node-b's over SSH; the units replace
        # the ad hoc servers, which deploy stops
        deployed = deploy.run(p, tmp_path)
        name = deployed.unit_name.removeprefix("servebook-").removesuffix(".service")
        front = (tmp_path / deployed.unit_name).read_text()
        assert (
            f"Requires=servebook-{name}-dp.service\n" in front and f"wait-ready --url http://127.0.0.3:{api} " in front
        )
        assert [u.unit_name for u in deployed.node_units] == [f"servebook-{name}-dp-node1.service"]
        head_unit = (tmp_path / f"servebook-{name}-dp.service").read_text()
        assert f"node-b systemctl start --no-block servebook-{name}-dp-node1.service" in head_unit
        assert KEY not in front + head_unit and all(u.verify.ok for u in deployed.replica_units if u.verify.ran)
        assert f"port {PORT}: " in deployed.ad_hoc_server_stopped and server.registered(api) is None
    finally:
        outcome = server.stop(port=PORT)  # the router
        outcome.remaining += server.stop(port=api).remaining  # the head's vLLM and, over SSH, the worker node's
    assert outcome.remaining == []
    if record:
        assert ours_left(record.pgid) == [] and remote.leftovers(record.workers[0]) == []
    assert server.registered(PORT) is None and server.registered(api) is None


def test_replicas_on_two_machines_serve_fail_over_behind_the_router_and_stop_on_both(node_b, tmp_path, monkeypatch):
    """The replicas shape end to end (its one such test): two independent replicas, one on each machine
    (replica_hosts): node-b's started over SSH on its own address with the key over SSH's stdin, this machine's as
    usual, vllm-router in front here; smoke-tested and benchmarked through the router with each replica's share,
    this machine's replica SIGKILLed mid-sweep (the levels after it name it and the router marks it down), then
    stopped the way an interrupted run stops what it started, nothing left on either machine, and the service's
    units rendered for both machines."""
    monkeypatch.setenv(KEY_ENV, KEY)
    router_port = PORT + 10
    p = two_nodes(node_b, nodes=1, node_hosts=[], node_addresses=[], tensor_parallel_size=1, replicas=2,
                  replica_hosts=["local", "node-b"], replica_addresses=["127.0.0.2", "127.0.0.3"], port=router_port,
                  router_policy="round_robin", api_key_env=KEY_ENV, bench_max_concurrency=8, bench_output_len=32,
                  bench_prompts_per_level=16, ab_variants=[])  # fmt: skip
    record = None
    try:
        record = launch.run(p, tmp_path)
        here, there = record.replicas
        assert (here.url, here.node) == (f"http://127.0.0.1:{router_port + 1}", "")
        assert (there.url, there.ssh) == (f"http://127.0.0.3:{router_port + 2}", "node-b")
        assert there.command[there.command.index("--host") + 1] == "127.0.0.3"
        assert [n.node for n in record.nodes] == ["machine0 (this machine)", "machine1 (node-b)"]
        assert all(w.healthy for w in router.workers(record.router.url)) and len(record.router.worker_urls) == 2
        assert "2 replicas behind vllm-router (round_robin)" in launch.summary(record)
        # the key reached node-b's vLLM on stdin: it refuses a keyless request, and no command line holds the key
        assert [client.keyless_status(r.url) for r in record.replicas] == [401, 401]
        # the router forwards the client's key; without it the replicas refuse, through the router too
        keyless = httpx.post(f"{record.router.url}/v1/completions", json={"model": record.served_model_name,
                             "prompt": "hi", "max_tokens": 2}, timeout=30)  # fmt: skip
        assert keyless.status_code == 401
        assert KEY not in open(f"/proc/{there.pid}/cmdline", "rb").read().decode()
        assert KEY not in " ".join(there.command) and KEY not in (tmp_path / "03_launch.json").read_text()
        mine = next(s for s in server.status() if s.port == router_port + 2)
        assert mine.health == "ready" and "a replica on machine1 (node-b), running there" in mine.detail
        table = launch.replica_table(record)
        assert list(table["machine"]) == ["this one", "machine1 (node-b)"] and all(table["healthy at the router"])
        # the readiness probe `servebook export k8s` renders, run the way the kubelet runs it in the leader
        probe = k8s.readiness_script(here.port, record.served_model_name)
        for key, ready in ((KEY, True), ("sk-wrong", False)):
            ran = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "VLLM_API_KEY": key},
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
            assert (ran.returncode == 0) is ready, ran.stderr[-400:]

        smoke = smoke_test.run(p, tmp_path)
        assert smoke.passed, smoke.failed()
        assert smoke.stream.vllm_tpot_ms, "vLLM's own decode speed, from the replicas' /metrics"
        swept = sweep_killing_a_replica(p, tmp_path, here)
        first, *after_kill = swept.levels
        assert first.failed == 0 and first.dead_replicas == [] and first.router_retries == 0
        assert set(first.replica_shares) == {here.url, there.url}
        assert all(0.3 <= share <= 0.7 for share in first.replica_shares.values()), first.replica_shares
        assert sum(first.replica_shares.values()) == pytest.approx(1.0, abs=0.01)
        # the levels after the kill name the dead replica and say what the router retried and what was lost
        assert after_kill and all(level.dead_replicas == [here.url] for level in after_kill), swept.levels
        hit = after_kill[0]
        assert hit.router_retries is not None and hit.router_errors is not None
        said = limits.failover_text(hit)
        assert f"{here.url} stopped answering" in said and "request(s) lost" in said
        table = benchmark.replica_table(swept.levels)
        assert set(table[table["replica"] == here.url]["answered"][1:]) == {"no: stopped during the level"}
        assert all(level.replica_shares[there.url] == 1.0 for level in after_kill)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and all(w.healthy for w in router.workers(record.router.url)):
            time.sleep(1)
        assert {w.url: w.healthy for w in router.workers(record.router.url)} == {here.url: False, there.url: True}
        print(f"two replicas on two machines: first level {first.output_throughput:.1f} tok/s; shares "
              f"{first.replica_shares}; failover: {said}; ready in {record.seconds_to_ready:.0f} s, node-b's in "
              f"{there.seconds_to_ready:.0f} s")  # fmt: skip
    finally:
        said = stop_started_servers(tmp_path, print)  # what an interrupted run does: every server it started
    assert record is not None
    assert "nothing left" in said and said.count("port ") == 3, said
    there_worker = remote.WorkerRecord(node="node-b", ssh="node-b", ssh_config=str(node_b), pid=there.pid,
                                       log_path="", command=[])  # fmt: skip
    assert ours_left(here.pgid) == [] and remote.leftovers(there_worker) == []
    assert [server.registered(router_port + i) for i in range(3)] == [None, None, None]
    # a stage that needs the server, after it stopped: one line naming the record, the URL and the fix
    with pytest.raises(PreflightError) as stopped:
        smoke_test.run(p, tmp_path)
    assert str(stopped.value).startswith(
        f"smoke_test needs the server in 03_launch.json, and http://127.0.0.1:{router_port} does"
    )
    assert "run 03_launch" in str(stopped.value)

    # the service: the router's unit requires this machine's replica and starts node-b's over SSH before it
    deployed = deploy.run(p, tmp_path)
    name = "tiny-qwen3-moe"
    front = (tmp_path / deployed.unit_name).read_text()
    assert f"Requires=servebook-{name}-replica0.service\n" in front
    assert f"node-b systemctl start servebook-{name}-replica1.service" in front
    assert "ExecStopPost=-/usr/bin/ssh" in front and f"node-b systemctl stop servebook-{name}-replica1.service" in front
    remote_unit = (tmp_path / f"servebook-{name}-replica1.service").read_text()
    assert "--host 127.0.0.3" in remote_unit and "PartOf=" not in remote_unit
    assert "Environment=VLLM_HOST_IP=127.0.0.3" in remote_unit and KEY not in remote_unit
    assert [u.node for u in deployed.replica_units] == [f"replica 0 on port {router_port + 1}",
                                                        f"replica 1 on port {router_port + 2} on machine1 (node-b)"]  # fmt: skip
    assert all(u.verify.ok for u in deployed.replica_units if u.verify.ran), deployed.replica_units
    here_unit = (tmp_path / f"servebook-{name}-replica0.service").read_text()
    assert f"PartOf=servebook-{name}.service" in here_unit and f"--port {router_port + 1}" in here_unit
    assert "VLLM_CPU_OMP_THREADS_BIND" in here_unit and KEY not in here_unit  # its own cores, as it ran here
    assert f"(filled at install from ${KEY_ENV})" in (tmp_path / f"{name}-replica0.env").read_text()
    assert deployed.verify.ok, deployed.verify.output
    # node-b's load runs inside the router's start (its ExecStartPre): the router's timeout makes room for it
    assert deployed.timeout_start_s >= 1.5 * there.seconds_to_ready + 300


def test_a_replica_machine_with_its_port_taken_is_refused_before_anything_starts(node_b, tmp_path):
    """node-b's replica port is held there: named with the machine and the fix, and nothing started here either."""
    p = two_nodes(node_b, nodes=1, node_hosts=[], node_addresses=[], tensor_parallel_size=1, replicas=2,
                  replica_hosts=["local", "node-b"], replica_addresses=["127.0.0.2", "127.0.0.3"], port=PORT + 20,
                  ab_variants=[])  # fmt: skip
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.3", PORT + 22))
        held.listen()
        with pytest.raises(PreflightError) as refused:
            launch.run(p, tmp_path)
    message = str(refused.value)
    assert f"machine1 (node-b): port {PORT + 22} (Address already in use) is in use there" in message, message
    assert "choose another replica_base_port" in message
    assert all(server.registered(PORT + 20 + i) is None for i in range(3))


def test_an_interrupted_run_stops_the_replica_it_started_on_the_other_machine(node_b, tmp_path):
    """`servebook run --stages launch` with a replica on node-b, SIGTERM while node-b's replica loads: the run
    stops it there over SSH (and this machine's), and nothing of either is left. (SIGINT takes the same handler:
    tried on one server in test_faults.)"""
    sig, code = signal.SIGTERM, 143
    port = PORT + 30
    before = set(vllm_titles())
    values = two_nodes(node_b, nodes=1, node_hosts=[], node_addresses=[], tensor_parallel_size=1, replicas=2,
                       replica_hosts=["local", "node-b"], replica_addresses=["127.0.0.2", "127.0.0.3"], port=port,
                       ab_variants=[], api_key_env=KEY_ENV).model_dump(exclude_defaults=True)  # fmt: skip
    file = tmp_path / "two-machines.yaml"
    file.write_text(yaml.safe_dump(values))
    proc = subprocess.Popen(
        [sys.executable, "-m", "servebook.cli", "run", str(file), "--stages", "launch"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "SERVEBOOK_OUTPUTS": str(tmp_path / "outputs"), KEY_ENV: KEY},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if "started on machine1 (node-b)" in line:
            break
    started = next((line for line in lines if "started on machine1 (node-b)" in line), "")
    assert started, "\n".join(lines[-30:])
    pid = int(re.search(r"\(pid (\d+) there\)", started).group(1))
    time.sleep(5)  # node-b's vLLM is importing and loading; this machine's replica is starting
    proc.send_signal(sig)
    lines += proc.stdout.read().splitlines()
    assert proc.wait(timeout=180) == code, "\n".join(lines[-40:])
    print("\n".join(lines[-15:]))
    # the launch stage stops it (the interrupt reaches the stage first), or else the run does
    stopped = (f"stopped the replica this launch started on port {port + 2}: ",
               f"stopped the server this run started on port {port + 2}: ")  # fmt: skip
    assert any(any(s in line for s in stopped) for line in lines), lines[-20:]
    there = remote.WorkerRecord(node="node-b", ssh="node-b", ssh_config=str(node_b), pid=pid, log_path="", command=[])
    assert remote.leftovers(there) == [] and not remote.alive(there)
    assert all(server.registered(port + i) is None for i in range(3))
    assert server.port_holder("127.0.0.1", port + 1) is None and set(vllm_titles()) <= before


def sweep_killing_a_replica(p: params.Params, run_dir: Path, victim) -> BenchmarkRecord:
    """The benchmark stage through the router, ``victim`` SIGKILLed once the first level is on disk."""
    swept_box: list[BenchmarkRecord] = []
    sweeping = threading.Thread(target=lambda: swept_box.append(benchmark.run(p, run_dir)))
    sweeping.start()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and sweeping.is_alive():
        so_far = results.read(run_dir, BenchmarkRecord)
        if so_far and so_far.levels:
            break
        time.sleep(0.5)
    os.killpg(victim.pgid, signal.SIGKILL)
    sweeping.join(timeout=600)
    return swept_box[0]
