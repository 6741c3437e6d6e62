"""Replicas behind vllm-router without starting anything: the router's command, each replica's port and GPUs,
the shares the benchmark reads off each replica's /metrics, and the refusals before anything starts."""

import pytest

from servebook import levels, limits, params, replicas, router
from servebook.errors import ParamsError, PreflightError
from servebook.planner import Parallelism
from servebook.server_config import ServerConfig


def test_the_router_command_names_its_replicas_policy_and_a_metrics_port_clear_of_theirs():
    cfg = router.RouterConfig(port=8000, worker_urls=["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                              policy="consistent_hash")  # fmt: skip
    command = cfg.command()
    assert command[0].endswith("vllm-router")
    at = command.index("--worker-urls")
    assert command[at + 1 : at + 3] == cfg.worker_urls
    assert command[command.index("--policy") + 1] == "consistent_hash"
    assert command[command.index("--prometheus-port") + 1] == "28000"
    assert "--api-key" not in command  # the router forwards the client's key; it holds none
    assert cfg.url == "http://127.0.0.1:8000" and cfg.fingerprint().startswith("router-")


def test_a_missing_router_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setattr(router.shutil, "which", lambda _name: None)
    monkeypatch.setattr(router.sys, "executable", "/nowhere/bin/python")
    with pytest.raises(PreflightError, match=r"pip install vllm-router .*or set replicas: 1"):
        router.binary()


def test_each_replica_gets_its_port_and_its_slice_of_the_gpus():
    p = params.validate({"replicas": 2, "tensor_parallel_size": 4, "port": 9000, "device": "cuda"})
    cfg = ServerConfig(model="m", model_path="/m", served_model_name="m", device="cuda", layout=Parallelism(tp=4))
    first, second = (pl.config for pl in replicas.placements(p.replica_section, cfg))
    assert (first.port, first.gpu_ids, second.port, second.gpu_ids) == (9001, [0, 1, 2, 3], 9002, [4, 5, 6, 7])
    listed = ServerConfig(model="m", model_path="/m", served_model_name="m", device="cuda", layout=Parallelism(tp=4),
                          gpu_ids=[7, 6, 5, 4, 3, 2, 1, 0])  # fmt: skip
    p = params.validate({"replicas": 2, "tensor_parallel_size": 4, "replica_base_port": 9100,
                         "gpu_ids": [7, 6, 5, 4, 3, 2, 1, 0]})  # fmt: skip
    a, b = (pl.config for pl in replicas.placements(p.replica_section, listed))
    assert (a.port, a.gpu_ids, b.port, b.gpu_ids) == (9100, [7, 6, 5, 4], 9101, [3, 2, 1, 0])


def test_each_replicas_share_and_prefix_hits_come_from_its_own_counters():
    before = {
        "http://a": {"vllm:request_success_total": 10, "vllm:prefix_cache_queries_total": 100,
                     "vllm:prefix_cache_hits_total": 0},
        "http://b": {"vllm:request_success_total": 5, "vllm:prefix_cache_queries_total": 0},
    }  # fmt: skip
    after = {
        "http://a": {"vllm:request_success_total": 40, "vllm:prefix_cache_queries_total": 300,
                     "vllm:prefix_cache_hits_total": 150},
        "http://b": {"vllm:request_success_total": 15, "vllm:prefix_cache_queries_total": 100},
    }  # fmt: skip
    parts = levels.replica_shares(before, after)
    assert parts["http://a"].share == pytest.approx(0.75) and parts["http://b"].share == pytest.approx(0.25)
    assert parts["http://a"].prefix_cache_hit_rate == pytest.approx(0.75)
    assert parts["http://b"].prefix_cache_hit_rate == 0.0
    assert levels.replica_shares({"http://a": {}}, {"http://a": {}}) == {}  # one server: nothing to split
    gone = levels.replica_shares(before, {"http://a": after["http://a"], "http://b": {}})
    assert gone["http://b"].answered is False and gone["http://a"].share == 1.0


def test_a_level_carries_the_shares_into_its_table_row():
    level = levels.Level(concurrency=4, repeats=1, output_throughput=10.0, output_throughput_min=10.0,
                        output_throughput_max=10.0, spread_pct=None,
                        replica_shares={"http://b": 0.4, "http://a": 0.6},
                        replica_prefix_hit_rates={"http://a": 0.5, "http://b": None})  # fmt: skip
    row = level.flat()
    assert (row["replica0_url"], row["replica0_share"], row["replica0_prefix_hit_rate"]) == ("http://a", 0.6, 0.5)
    assert row["replica1_share"] == 0.4 and "replica_shares" not in row


@pytest.mark.parametrize(
    "values, says",
    [
        ({"replicas": 2, "port": 8000, "replica_base_port": 7999}, "puts a replica on port 8000, the router's"),
        ({"replicas": 2, "tensor_parallel_size": 2, "gpu_ids": [0, 1]}, "x replicas 2 = 4; list exactly 4"),
        ({"replicas": 0}, "replicas"),
        ({"replicas": 2, "router_policy": "fastest"}, "router_policy"),
        (
            {"replicas": 3, "replica_hosts": ["local", "b"]},
            "replicas 3 over 2 replica_hosts: every machine runs the same number; set replicas to a multiple of 2",
        ),
        (
            {"replicas": 2, "replica_hosts": ["b", "local"]},
            "replica_hosts[0] is 'b', but the router runs on the "
            "machine servebook runs on; list that machine first as 'local'",
        ),
        ({"replicas": 4, "replica_hosts": ["local", "b", "b", "c"]}, "replica_hosts lists a machine twice"),
        (
            {"replicas": 2, "replica_hosts": ["local", "b"], "replica_addresses": ["10.0.0.1"]},
            "replica_addresses lists 1 addresses for 2 replica_hosts",
        ),
        ({"replica_hosts": ["local", "b"]}, "replica_hosts set but replicas is 1; set replicas to a multiple"),
        ({"replicas": 2, "replica_addresses": ["10.0.0.1"]}, "replica_addresses set without replica_hosts"),
        (
            {"replicas": 4, "replica_hosts": ["local", "b"], "tensor_parallel_size": 2, "gpu_ids": [0, 1, 2, 3, 4, 5]},
            "x 2 replica(s) per replica_hosts machine (the same GPUs on each) = 4; list exactly 4",
        ),
        (
            {
                "replicas": 2,
                "replica_hosts": ["local", "b"],
                "nodes": 2,
                "node_hosts": ["local", "b"],
                "tensor_parallel_size": 2,
            },
            "replica_hosts with nodes 2: a replica spread over replica_hosts runs on one",
        ),
    ],
)
def test_replica_settings_that_cannot_work_are_refused_by_name(values, says):
    with pytest.raises(ParamsError) as err:
        params.validate({"ab_variants": [], **values})
    assert says in str(err.value)


def test_replicas_across_nodes_are_refused_before_a_launch_starts(tmp_path):
    from servebook import runner

    file = tmp_path / "p.yaml"
    file.write_text(
        "replicas: 2\nab_variants: []\nnodes: 2\ntensor_parallel_size: 2\nnode_hosts: [local, b]\nnode_interconnect: 100GbE\n"
    )
    with pytest.raises(
        ParamsError, match="runs each replica on one machine; set nodes: 1 and list the machines in replica_hosts"
    ):
        runner.run(file, wanted="reconnaissance,plan,launch")
    assert not (tmp_path / "outputs").exists()


def test_a_level_names_the_replica_that_died_and_what_the_router_did_about_it():
    counts = levels.RouterCounts.of(
        {"vllm_router_retries_total": 2.0}, {"vllm_router_retries_total": 5.0, "vllm_router_request_errors_total": 1.0}
    )
    assert counts == levels.RouterCounts(retries=3.0, retries_exhausted=0.0, errors=1.0)
    assert levels.RouterCounts.of({}, {}) is None  # no router answered: nothing counted, not zero
    level = levels.Level(concurrency=4, repeats=1, output_throughput=1.0, output_throughput_min=1.0,
                        output_throughput_max=1.0, spread_pct=None, failed=1, dead_replicas=["http://b"],
                        router_retries=3.0, router_retries_exhausted=1.0)  # fmt: skip
    said = limits.failover_text(level)
    assert said == (
        "http://b stopped answering; the router retried 3 request(s) on another replica (1 ran out of retries), "
        "1 request(s) lost"
    )
    assert level.flat()["dead_replicas"] == "http://b"
    calm = level.model_copy(update={"dead_replicas": [], "router_retries": 0.0, "failed": 0})
    assert limits.failover_text(calm) == ""


def test_replicas_spread_over_machines_get_their_machine_its_address_and_the_same_gpu_slices_there():
    from servebook import replicas

    p = params.validate({"replicas": 4, "replica_hosts": ["local", "gpu-b"], "replica_addresses": ["10.0.0.1",
                         "10.0.0.2"], "tensor_parallel_size": 4, "port": 9000, "device": "cuda", "ab_variants": []})  # fmt: skip
    cfg = ServerConfig(model="m", model_path="/m", served_model_name="m", device="cuda", layout=Parallelism(tp=4))
    placed = replicas.placements(p.replica_section, cfg)
    assert [(pl.node.ssh, pl.config.port, pl.config.gpu_ids) for pl in placed] == [
        ("", 9001, [0, 1, 2, 3]), ("", 9002, [4, 5, 6, 7]), ("gpu-b", 9003, [0, 1, 2, 3]), ("gpu-b", 9004, [4, 5, 6, 7])
    ]  # fmt: skip
    # this machine's replicas bind where the params say; the others on their own address, where the router finds them
    assert [pl.config.url for pl in placed] == [
        "http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://10.0.0.2:9003", "http://10.0.0.2:9004"
    ]  # fmt: skip
    assert [pl.elsewhere for pl in placed] == [False, False, True, True]
    assert p.replicas_per_host == 2


def test_a_secret_reaches_the_started_process_on_stdin_and_no_command_line(tmp_path):
    """remote.start on this machine (no SSH: the same script): the key is in the process's environment, in neither
    its argv nor the shell's that started it."""
    import os
    import time

    from servebook import remote

    log = tmp_path / "out.log"
    program = "import os, sys, time; print(os.environ['VLLM_API_KEY'], sys.argv[1:], flush=True); time.sleep(30)"
    pid = remote.start("", ["python3", "-c", program, "visible"], {"A": "b"}, str(log),
                       secrets={"VLLM_API_KEY": "sk-never-in-argv-42"})  # fmt: skip
    worker = remote.WorkerRecord(node="here", pid=pid, log_path=str(log), command=[])
    try:
        deadline = time.monotonic() + 20
        while "sk-" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert log.read_text().startswith("sk-never-in-argv-42 ['visible']")
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode()
        assert "sk-never" not in argv and "visible" in argv
        assert "sk-never" in open(f"/proc/{pid}/environ", "rb").read().decode()
        assert os.getsid(pid) == pid  # a session of its own, which the stop signals
    finally:
        assert remote.stop(worker, grace_s=5) == []
    with pytest.raises(remote.RemoteError, match="newline"):
        remote.start("", ["true"], {}, str(log), secrets={"K": "a\nb"})


def test_a_replicas_stop_checks_its_own_gpus_for_vllm_leftovers_not_its_neighbours(fake_nvml):
    """h200x8-leftovers: a vLLM worker holds GPU 3. A replica on GPUs 0-2 stopping while its neighbour on 3 still
    serves finds nothing of its own left; one on 3 does; a replica on another machine is not asked here."""
    from servebook import server

    fake_nvml("h200x8-leftovers")

    def registration(gpus, node=""):
        return server.Registration(pid=1, pgid=1, port=9001, host="127.0.0.1", url="", fingerprint="", command=[],
                                   log_path="", model="m", served_model_name="m", device="cuda", gpu_ids=gpus,
                                   started_at="", node=node)  # fmt: skip

    assert server._gpu_leftovers([registration([0, 1, 2])]) == []
    [left] = server._gpu_leftovers([registration([3])])
    assert "GPU 3" in left and "VLLM::Worker_TP3" in left
    assert server._gpu_leftovers([registration([3], node="machine1 (b)")]) == []
    assert len(server._gpu_leftovers([registration([])])) == 1  # no GPUs named: all of them are its own
