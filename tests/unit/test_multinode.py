"""Several nodes without starting any: the plan across nodes, each node's vLLM command (parsed by vLLM's own
parser), the checks between nodes, and the params that describe them."""

import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from servebook import gpus, modelspec, multinode, params, planner, remote, server_config, vllm_compat
from servebook.errors import ParamsError, PlanInputError
from servebook.planner import Parallelism

CONFIGS = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
IB = planner.parse_interconnect("8x400Gb/s InfiniBand")


def two_by_eight(model: str, link: planner.NodeLink = IB, gpu: str = "H100") -> planner.Plan:
    device = planner.Device.for_gpu(gpus.lookup(gpu), 16, nodes=2, link=link)
    return planner.plan(modelspec.load(str(CONFIGS / f"{model}.json")), device, max_model_len=8192)


def test_interconnects_are_read_as_bandwidth_per_node_and_latency():
    assert planner.parse_interconnect("400Gb/s InfiniBand").bandwidth_bytes_s == 50e9
    eight = planner.parse_interconnect("8x400G IB")
    assert eight.bandwidth_bytes_s == 400e9 and eight.rdma and eight.latency_s == planner.RDMA_COLLECTIVE_S
    ethernet = planner.parse_interconnect("100GbE")
    assert ethernet.bandwidth_bytes_s == 12.5e9 and not ethernet.rdma and ethernet.latency_s == planner.TCP_COLLECTIVE_S
    assert planner.parse_interconnect("200G RoCE 18us").latency_s == pytest.approx(18e-6)
    with pytest.raises(PlanInputError, match="node_interconnect 'fast' is not a link speed; write it as"):
        planner.parse_interconnect("fast")


def test_kimi_k25_needs_two_nodes_and_the_plan_says_how_to_launch_them():
    """547 GB of INT4 weights leave 8 x 80 GB no KV cache; on 2 x 8 every layout with fewer than 16 ways of
    expert sharding is checked, where its groups fall, how vLLM is launched, what crosses the network."""
    one = planner.plan(
        modelspec.load(str(CONFIGS / "kimi-k2.5.json")),
        planner.Device.for_gpu(gpus.lookup("H100"), 8),
        max_model_len=8192,
    )
    assert one.recommended is None
    two = two_by_eight("kimi-k2.5")
    by_name = {layout.name: layout for layout in two.layouts}
    assert two.recommended is not None and two.recommended.usable
    tp16 = by_name["TP=16"]
    assert tp16.crosses == ["TP"] and tp16.strategy == "mp" and tp16.network_collectives_per_token == 2 * 61
    assert any("TP=16 spans 2 nodes" in w and "8x400Gb/s InfiniBand" in w for w in tp16.warnings)
    tp8pp2 = by_name["TP=8+PP=2"]
    assert tp8pp2.crosses == ["PP"] and tp8pp2.strategy == "mp" and tp8pp2.network_collectives_per_token == 1
    dp = by_name["TP=8+DP=2+EP"]
    assert dp.crosses == ["DP"] and dp.strategy == "dp"
    # the network is charged: over 100 GbE, TP across the nodes loses more than PP does
    slow = {layout.name: layout for layout in two_by_eight("kimi-k2.5", planner.parse_interconnect("100GbE")).layouts}
    tp_loss = 1 - slow["TP=16"].decode_tok_s_single / tp16.decode_tok_s_single
    pp_loss = 1 - slow["TP=8+PP=2"].decode_tok_s_single / tp8pp2.decode_tok_s_single
    assert tp_loss > 0.05 and tp_loss > 10 * pp_loss


def test_one_node_plans_are_unchanged_by_the_multinode_fields():
    """The single-node behaviour stays exactly as it was: no crossings, no strategy, the same ranking."""
    device = planner.Device.for_gpu(gpus.lookup("H200"), 8)
    result = planner.plan(modelspec.load(str(CONFIGS / "minimax-m2.5.json")), device, max_model_len=8192)
    assert all(not layout.crosses and not layout.strategy for layout in result.layouts)
    assert result.recommended is not None and result.recommended.network_collectives_per_token == 0


def test_a_node_count_that_does_not_divide_the_world_is_vllms_refusal():
    message = planner.nodes_rule(8, 3)
    assert message is not None and "`--nnodes 3` must evenly divide the total world size (8)" in message
    assert planner.nodes_rule(16, 2) is None
    # the same words as vLLM's own check
    from vllm.engine import arg_utils

    source = inspect.getsource(arg_utils)
    assert "must evenly divide the total " in source and "world size ({world_size}). Adjust `--nnodes`" in source
    with pytest.raises(ValueError, match="--nnodes 3"):
        multinode.node_flags(Parallelism(tp=8), 3, 3, 0, head_address="10.0.0.1", port=29500)


def test_each_nodes_command_is_accepted_by_vllms_parser(tmp_path):
    """TP across nodes (mp: --nnodes, --node-rank, --master-addr; the worker --headless) and DP replicas per
    node (the head --data-parallel-address, the worker --headless --data-parallel-start-rank), parsed and turned
    into vLLM's engine arguments by the installed vLLM."""
    model = str(tmp_path)  # a local folder: vLLM's engine arguments look a hub name up

    def commands(layout, port=29500, **serving):
        cfg = server_config.ServerConfig(model=model, model_path=model, served_model_name="m", device="cuda", **serving)
        cfg = dataclasses.replace(cfg, layout=layout)
        prefix = len(vllm_compat.serve_prefix(model))
        return [argv[prefix:] for argv in multinode.commands(cfg, 2, 8, "10.0.0.1", port, sys.executable)]

    cases = {
        "mp": commands(Parallelism(tp=16, ep=True), max_model_len=8192),
        "pp": commands(Parallelism(tp=8, pp=2)),
        "dp": commands(Parallelism(tp=8, dp=2, ep=True), port=29600),
    }
    assert "--headless" in cases["mp"][1] and cases["mp"][0].count("--node-rank") == 1
    assert "--data-parallel-start-rank" in cases["dp"][1] and "--headless" not in cases["dp"][0]
    script = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
out = []
for argv in json.loads(sys.argv[1]):
    ns = parser.parse_args(["--model", sys.argv[2], *argv])
    args = AsyncEngineArgs.from_cli_args(ns)
    out.append({"tp": args.tensor_parallel_size, "pp": args.pipeline_parallel_size, "dp": args.data_parallel_size,
                "nnodes": args.nnodes, "rank": args.node_rank, "master": args.master_addr, "headless": ns.headless,
                "dp_local": args.data_parallel_size_local, "dp_start": args.data_parallel_start_rank,
                "dp_address": args.data_parallel_address, "dp_port": args.data_parallel_rpc_port})
print(json.dumps(out))
"""
    flat = [argv for lines in cases.values() for argv in lines]
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(flat), model], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    mp_head, mp_worker, pp_head, pp_worker, dp_head, dp_worker = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (mp_head["tp"], mp_head["nnodes"], mp_head["rank"], mp_head["master"]) == (16, 2, 0, "10.0.0.1")
    assert (mp_worker["rank"], mp_worker["headless"]) == (1, True) and not mp_head["headless"]
    assert (pp_worker["tp"], pp_worker["pp"], pp_worker["nnodes"]) == (8, 2, 2)
    assert (dp_head["dp"], dp_head["dp_local"], dp_head["dp_address"], dp_head["dp_port"]) == (2, 1, "10.0.0.1", 29600)
    assert (dp_worker["dp_start"], dp_worker["headless"]) == (1, True)


def probe(node, **kw):
    found = dict(
        node=node,
        reachable=True,
        versions={"vllm": "0.25.0", "torch": "2.9.0", "nccl": "2.27.5"},
        checkpoint={"exists": True, "files": 64, "bytes": 547_000_000_000, "hashed": "model.safetensors.index.json",
                    "sha256": "ab" * 32},
        interface="ib0",
        interfaces=["ib0", "lo"],
    )  # fmt: skip
    found.update(kw)
    return multinode.NodeProbe(**found)


NODES = multinode.NodeSet(
    nodes=[multinode.Node(name="node0 (this machine)", address="10.0.0.1"),
           multinode.Node(name="node1 (gpu-b)", ssh="gpu-b", address="10.0.0.2")],
    gpus_per_node=8,
)  # fmt: skip


def test_nodes_that_differ_are_refused_each_by_name_with_the_fix():
    head = probe("node0 (this machine)", ports_in_use=["29500 (Address already in use)"])
    other = probe(
        "node1 (gpu-b)",
        versions={"vllm": "0.24.1", "torch": "2.9.0", "nccl": "2.27.5"},
        checkpoint={"exists": True, "files": 63, "bytes": 540_000_000_000, "sha256": "cd" * 32},
        clock_skew_s=42.0,
        env={"NCCL_SOCKET_IFNAME": "eth9"},
    )
    found = multinode.problems([head, other], NODES)
    assert "node0 (this machine): port 29500 (Address already in use) is in use; stop what holds it" in found[0]
    text = "\n".join(found)
    assert "node1 (gpu-b): vllm 0.24.1, but node0 (this machine) has 0.25.0; install the same versions" in text
    assert "node1 (gpu-b): its checkpoint differs" in text and "copy the head's checkpoint again" in text
    assert "node1 (gpu-b): its clock is +42.0 s off the head's" in text
    assert "node1 (gpu-b): NCCL_SOCKET_IFNAME=eth9 names no interface there" in text
    assert multinode.problems([probe("node0 (this machine)"), probe("node1 (gpu-b)")], NODES) == []


def test_the_networks_that_broke_users_launches_are_refused_by_node_with_the_fix():
    """An address that is not where the route to the head leaves, NCCL's syntax given to Gloo, a 64 MiB /dev/shm."""
    head = probe("node0 (this machine)", route={"dev": "ib0", "src": "10.0.0.1"}, peer="10.0.0.2", shm_bytes=32 << 30)
    other = probe(
        "node1 (gpu-b)", route={"dev": "eth0", "src": "192.168.1.7"}, peer="10.0.0.1", interfaces=["eth0", "ib0", "lo"],
        env={"GLOO_SOCKET_IFNAME": "^lo,docker0"}, shm_bytes=64 << 20,
    )  # fmt: skip
    text = "\n".join(multinode.problems([head, other], NODES))
    assert (
        "node1 (gpu-b): node_addresses gives 10.0.0.2 (on ib0), but `ip -4 route get 10.0.0.1` there leaves through "
        "eth0 (from 192.168.1.7); list 192.168.1.7 in node_addresses" in text
    )
    assert "GLOO_SOCKET_IFNAME=^lo,docker0 is NCCL's syntax" in text and "set GLOO_SOCKET_IFNAME=eth0" in text
    assert "node1 (gpu-b): /dev/shm is 64 MiB" in text and "--shm-size=16g" in text
    assert "node0" not in text


def test_the_probe_reads_this_machines_route_and_shared_memory():
    """The probe for real on this machine (no SSH for a local node): the route to a peer, /dev/shm's size."""
    nodes = multinode.NodeSet(
        nodes=[multinode.Node(name="node0", address="127.0.0.1"), multinode.Node(name="node1", address="127.0.0.3")],
        gpus_per_node=1,
    )
    found = multinode.probe(nodes.nodes[0], nodes, "/nonexistent", [])
    assert found.peer == "127.0.0.3" and found.route == {"dev": "lo", "src": "127.0.0.1"}
    assert found.shm_bytes and found.shm_bytes > 0
    assert multinode.network_problems(found, nodes.nodes[0]) == []


def test_an_unreachable_node_is_refused_before_anything_starts(tmp_path):
    """A real SSH client against an address where nothing listens: refused, named, with the fix."""
    config = tmp_path / "ssh_config"
    config.write_text("Host gone\n  HostName 127.0.0.1\n  Port 1\n  ConnectTimeout 3\n")
    nodes = NODES.model_copy(update={"ssh_config": str(config)}, deep=True)  # NODES is shared by other tests
    nodes.nodes[1] = multinode.Node(name="node1 (gone)", ssh="gone", address="127.0.0.1")
    found = multinode.probe(nodes.nodes[1], nodes, "/nonexistent", [])
    assert not found.reachable and "cannot reach gone over SSH" in found.error
    with pytest.raises(Exception, match=r"node1 \(gone\): cannot reach gone over SSH.*`ssh gone true`"):
        multinode.preflight(nodes, "/nonexistent", [])
    with pytest.raises(remote.RemoteError, match="cannot reach gone"):
        remote.run("gone", "true", str(config))


def test_params_describe_the_nodes_and_refuse_what_vllm_would(tmp_path):
    ok = params.Params(
        nodes=2, gpus_per_node=8, tensor_parallel_size=16, node_interconnect="8x400Gb/s InfiniBand",
        node_hosts=["local", "gpu-b"], node_addresses=["10.0.0.1", "10.0.0.2"], device="cuda",
    )  # fmt: skip
    assert ok.per_node == 8 and multinode.NodeSet.for_nodes(ok.nodes_section).nodes[1].ssh == "gpu-b"
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "nodes: 3\ntensor_parallel_size: 8\nnode_interconnect: fast\nnode_hosts: [gpu-a, gpu-b]\ndevice: cuda\n"
    )
    with pytest.raises(ParamsError) as refused:
        params.load(bad)
    text = str(refused.value)
    assert "nodes 3 does not divide the layout's 8 GPUs" in text
    assert "node_interconnect 'fast' is not a link speed" in text
    assert "node_hosts lists 2 nodes but nodes is 3" in text
    assert "node_hosts[0] is 'gpu-a', but the head is the machine servebook runs on" in text


def test_the_two_node_example_params_plan_kimi_on_h100s():
    example = params.load(Path(__file__).resolve().parents[2] / "params" / "kimi-k2.5-2x8-h100.yaml")
    assert example.nodes == 2 and example.gpus_per_node == 8 and example.plan_gpu == "H100"
    assert example.node_hosts[0] == "local" and example.layout_from_plan


def test_the_plan_stage_writes_each_nodes_command_and_reconnaissance_wants_the_nodes_named(tmp_path):
    """The embedded model at TP=2 over two CPU nodes: one engine across them (mp); the plan stage records the
    command each node runs. Reconnaissance with two nodes and no node_hosts is not ready, and says what to set."""
    from servebook.stages import plan as plan_stage
    from servebook.stages import reconnaissance

    p = params.Params(
        model="builtin:tiny-qwen3-moe", device="cpu", tensor_parallel_size=2, nodes=2,
        node_addresses=["127.0.0.2", "127.0.0.3"], node_master_port=29611,
    )  # fmt: skip
    record = plan_stage.run(p, tmp_path)
    assert record.device.nodes == 2 and record.requested and record.requested.strategy == "mp"
    head, worker = record.node_commands
    assert head[-8:] == ["--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.2", "--master-port", "29611"]
    assert worker[-1] == "--headless" and "--tensor-parallel-size" in worker
    assert "# TP=2: one engine across the nodes" in plan_stage.node_commands_text(record)
    assert "2 nodes of 1 × CPU" in plan_stage.summary(record)
    found = reconnaissance.run(p, tmp_path)
    assert not found.verdict.ready
    assert (
        "node_hosts is empty; list each node's SSH destination, this machine first as 'local'"
        in found.verdict.reasons[0]
    )


def test_a_worker_whose_start_never_answered_is_found_by_its_pid_file_and_stopped(tmp_path):
    """`remote.start` writes the pid on the node before printing it: a lost answer leaves no untracked worker."""
    log = str(tmp_path / "node1" / "worker.log")
    pid = remote.start("", [sys.executable, "-c", "import time; time.sleep(60)"], {}, log)
    assert Path(remote.pid_file(log)).read_text().strip() == str(pid)
    done = remote.stop_unanswered("", log, grace_s=5)
    assert done == f"stopped the worker's session {pid}"
    assert subprocess.run(["pgrep", "-s", str(pid)], capture_output=True).returncode == 1  # the session is gone
    assert remote.stop_unanswered("", str(tmp_path / "never" / "worker.log")) == "no worker had started (no pid file)"


def test_a_lost_start_on_an_unreachable_node_says_what_to_run_there(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host gone\n  HostName 127.0.0.1\n  Port 1\n  ConnectTimeout 3\n")
    done = remote.stop_unanswered("gone", "/var/log/w.log", str(config))
    assert "cannot reach gone over SSH" in done and "kill -TERM -- -$(cat /var/log/w.log.pid)` on gone" in done


def test_an_engine_wait_shorter_than_the_load_is_refused_before_the_launch():
    from servebook import server_config
    from servebook.errors import PreflightError
    from servebook.stages import launch as launch_stage

    p = params.validate({"model": "builtin:tiny-qwen3-moe", "load_timeout_s": 900,
                         "extra_env": {"VLLM_ENGINE_READY_TIMEOUT_S": "600"}})  # fmt: skip
    cfg = server_config.ServerConfig.from_params(p, "cpu", model_path="/nonexistent")
    with pytest.raises(PreflightError, match="VLLM_ENGINE_READY_TIMEOUT_S=600, under the load budget of 900 s"):
        launch_stage.check_load_options(cfg)
    longer = server_config.ServerConfig.from_params(
        p.model_copy(update={"extra_env": {"VLLM_ENGINE_READY_TIMEOUT_S": "1200"}}), "cpu", model_path="/nonexistent"
    )
    launch_stage.check_load_options(longer)


def test_hybrid_load_balancing_gives_every_node_its_own_api_and_vllms_parser_takes_it(tmp_path):
    """--data-parallel-hybrid-lb: no --headless anywhere, each node's start rank, the worker's API on its own
    address; a layout whose replicas span nodes, or hybrid params vLLM's mode cannot serve, refused by name."""
    model = str(tmp_path)
    cfg = server_config.ServerConfig(model=model, model_path=model, served_model_name="m", device="cuda",
                                     data_parallel_lb="hybrid", layout=Parallelism(tp=8, dp=2, ep=True))  # fmt: skip
    head, (worker,) = multinode.prepare(cfg, NODES, tmp_path, api_port=8001)
    worker_args = worker.command[len(vllm_compat.serve_prefix(model, sys.executable)) :]
    for args in (head.serve_args(), worker_args):
        assert "--data-parallel-hybrid-lb" in args and "--headless" not in args
        parsed = vllm_compat.parse_serve_args(model, args)
        assert parsed.ok, parsed.message
    assert worker_args[worker_args.index("--data-parallel-start-rank") + 1] == "1"
    assert worker_args[worker_args.index("--host") + 1] == "10.0.0.2" and head.host == "127.0.0.1"
    assert head.port == 8001 and worker_args[worker_args.index("--port") + 1] == "8001"
    with pytest.raises(ValueError, match="data_parallel_lb: hybrid needs every data-parallel replica inside one node"):
        multinode.node_configs(dataclasses.replace(cfg, layout=Parallelism(tp=16)), 2, 8,
                               "10.0.0.1", 29500)  # fmt: skip
    with pytest.raises(ValueError) as refused:
        params.Params(model="builtin:tiny-qwen3-moe", nodes=2, data_parallel_lb="hybrid", tensor_parallel_size=2,
                      replicas=2)  # fmt: skip
    text = str(refused.value)
    assert "data_parallel_lb: hybrid with data_parallel_size 1 on 2 nodes" in text and "set replicas: 1" in text


def test_a_hybrid_server_deploys_as_the_heads_unit_behind_the_routers(tmp_path):
    """MiniMax-M2.5 in hybrid data parallelism on 2 x 8 H200 as a service: the router's unit requires the head
    node's vllm serve unit, waits for the other node's API server, and the head's unit starts and stops the other
    node's over SSH, exactly the commands the launch ran."""
    import re

    from servebook import router
    from servebook.records import LaunchRecord, ReplicaRecord
    from servebook.stages import deploy
    from servebook.topology.hybrid import HybridServer

    p = params.load(Path(__file__).parents[2] / "params" / "minimax-m2.5-2x8-hybrid.yaml")
    cfg = server_config.ServerConfig.from_params(p, "cuda")
    head_cfg, workers = multinode.prepare(cfg, multinode.NodeSet.for_nodes(p.nodes_section), tmp_path, api_port=8001)
    urls = ["http://127.0.0.1:8001", "http://10.0.0.2:8001"]
    routed = router.RouterRecord(url="http://127.0.0.1:8000", port=8000, policy="cache_aware", worker_urls=urls,
                                 command=["/bin/true", "--port", "8000", "--worker-urls", *urls],
                                 pid=0, pgid=0, log_path="", seconds_to_ready=2.0)  # fmt: skip
    replicas = [ReplicaRecord(index=i, url=u, port=8001, pid=0, pgid=0, gpu_ids=list(range(8)), log_path="",
                              seconds_to_ready=0, command=[]) for i, u in enumerate(urls)]  # fmt: skip
    launch = LaunchRecord.planned(head_cfg).model_copy(
        update={"workers": workers, "router": routed, "replicas": replicas, "topology": "hybrid"}
    )
    record = HybridServer.deploy_units(
        params.DeploySection(user=p.deploy_user, install=False), tmp_path, launch, "mm", None
    )
    name = "servebook-mm.service"
    assert record.unit_name == name and [u.unit_name for u in record.replica_units] == ["servebook-mm-dp.service"]
    assert [u.unit_name for u in record.node_units] == ["servebook-mm-dp-node1.service"]
    front = (tmp_path / name).read_text()
    assert (
        "Requires=servebook-mm-dp.service" in front and "After=network-online.target servebook-mm-dp.service" in front
    )
    assert re.search(r"^ExecStartPre=.* wait-ready --url http://10.0.0.2:8001 ", front, re.M)
    assert "--worker-urls http://127.0.0.1:8001 http://10.0.0.2:8001" in front
    head = (tmp_path / "servebook-mm-dp.service").read_text()
    assert "PartOf=servebook-mm.service" in head and "--data-parallel-hybrid-lb" in head
    assert re.search(
        r"^ExecStartPre=.* gpu-node-2 systemctl start --no-block servebook-mm-dp-node1.service$", head, re.M
    )
    assert re.search(r"^ExecStopPost=-.* gpu-node-2 systemctl stop servebook-mm-dp-node1.service$", head, re.M)
    other = (tmp_path / "servebook-mm-dp-node1.service").read_text()
    other_start = re.search(r"^ExecStart=(.*)$", other, re.M).group(1)
    assert "--data-parallel-start-rank 2" in other_start and "--host 10.0.0.2" in other_start
    assert "--headless" not in other_start and "VLLM_HOST_IP=10.0.0.2" in other
    for unit in [*record.replica_units, *record.node_units]:
        assert not unit.verify.ran or unit.verify.ok, unit.verify.output
    assert not record.verify.ran or record.verify.ok, record.verify.output
    assert "with 1 worker node unit(s) it starts and stops over SSH" in deploy.summary(record)
