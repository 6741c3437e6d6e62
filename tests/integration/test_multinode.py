"""Two nodes on one machine: the head on 127.0.0.2 (this machine) and a worker node on 127.0.0.3 that servebook
reaches through a real OpenSSH server. The embedded model served by real vLLM (CPU build) with TP=2 across the
two nodes through vLLM's multiprocessing multi-node launch (--nnodes 2, the worker --headless)."""

import socket
import threading
import time

import pytest

from servebook import params, remote, results, server
from servebook.errors import PreflightError
from servebook.records import BenchmarkRecord
from servebook.stages import benchmark, deploy, launch, smoke_test

from . import sshnode
from .conftest import ours_left

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not sshnode.available(), reason="needs Debian's openssh-server"),
]

PORT = 8161


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
