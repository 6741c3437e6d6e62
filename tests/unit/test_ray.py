"""distributed_backend: ray without a cluster: the head's command as vLLM's own parser reads it, each node's
`ray start`, the version preflight and the params vLLM or servebook would refuse. The cluster's lifecycle runs for
real in tests/integration/test_ray.py."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from servebook import multinode, params, raycluster, server_config
from servebook.planner import Parallelism

REPO = Path(__file__).resolve().parents[2]


def ray_params(**kw) -> params.Params:
    values = dict(
        model="builtin:tiny-qwen3-moe", device="cuda", tensor_parallel_size=8, pipeline_parallel_size=2, nodes=2,
        gpus_per_node=8, node_hosts=["local", "gpu-b"], node_addresses=["10.0.0.1", "10.0.0.2"],
        distributed_backend="ray", node_python="/opt/vllm/bin/python",
    )  # fmt: skip
    values.update(kw)
    return params.Params(**values)


def head_args(tmp_path, layout: Parallelism, gpus_per_node: int = 8) -> tuple[list[str], dict[str, str]]:
    model = str(tmp_path)
    p = ray_params()
    cfg = server_config.ServerConfig(
        model=model, model_path=model, served_model_name="m", device="cuda", distributed_backend="ray", nodes=2
    )
    cfg = raycluster.head_config(dataclasses.replace(cfg, layout=layout), raycluster.RayCluster.for_nodes(p.nodes_section),
                                 gpus_per_node)  # fmt: skip
    (only,) = multinode.node_configs(cfg, 2, gpus_per_node, "10.0.0.1", 29500)  # on Ray only the head runs vLLM
    return only.serve_args(), only.extra_env


def test_vllms_parser_takes_the_heads_command_on_ray(tmp_path):
    """TP=8 × PP=2 across two nodes and DP=2 × TP=8 with EP: one `vllm serve` on the head, Ray's executor, no
    --nnodes or --headless, the data-parallel ranks launched by Ray too, parsed by the installed vLLM."""
    pp, pp_env = head_args(tmp_path, Parallelism(tp=8, pp=2))
    dp, dp_env = head_args(tmp_path, Parallelism(tp=8, dp=2, ep=True))
    wide, wide_env = head_args(tmp_path, Parallelism(tp=16, dp=2), gpus_per_node=8)
    for args in (pp, dp, wide):
        assert "--nnodes" not in args and "--headless" not in args and "--data-parallel-address" not in args
    assert pp_env["RAY_ADDRESS"] == "10.0.0.1:6379" and pp_env["VLLM_HOST_IP"] == "10.0.0.1"
    assert "VLLM_RAY_DP_PACK_STRATEGY" not in dp_env and wide_env["VLLM_RAY_DP_PACK_STRATEGY"] == "span"
    script = r"""
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
out = []
for argv in json.loads(sys.argv[1]):
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", sys.argv[2], *argv]))
    out.append([args.distributed_executor_backend, args.data_parallel_backend, args.tensor_parallel_size,
                args.pipeline_parallel_size, args.data_parallel_size])
print(json.dumps(out))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps([pp, dp]), str(tmp_path)], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [["ray", "mp", 8, 2, 1], ["ray", "ray", 8, 1, 2]]


def test_each_nodes_ray_start_registers_its_own_address_and_blocks():
    head, worker = raycluster.RayCluster.for_nodes(
        ray_params(ray_port=6400, ray_start_args=["--num-gpus=8"]).nodes_section
    ).commands()
    assert head[0] == sys.executable and worker[0] == "/opt/vllm/bin/python"  # the other nodes' Python
    for argv in (head, worker):
        assert argv[1:4] == ["-m", "ray.scripts.scripts", "start"] and "--block" in argv and argv[-1] == "--num-gpus=8"
    assert head[head.index("--node-ip-address") + 1] == "10.0.0.1" and "--head" in head
    assert head[head.index("--port") + 1] == "6400"
    assert worker[worker.index("--node-ip-address") + 1] == "10.0.0.2"
    assert worker[worker.index("--address") + 1] == "10.0.0.1:6400" and "--head" not in worker


def test_the_plan_prints_the_ray_starts_before_the_heads_vllm(tmp_path):
    from servebook.stages import plan as plan_stage

    p = ray_params(
        plan_gpu="H100",
        layout_from_plan=False,
        node_interconnect="8x400Gb/s InfiniBand",
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        gpus_per_node=1,
    )  # the tiny model's heads
    record = plan_stage.make_plan(p, plan_stage.device_for(p, tmp_path))
    assert len(record.ray_commands) == 2 and len(record.node_commands) == 1
    text = plan_stage.node_commands_text(record)
    assert text.index("start the Ray head") < text.index("join the Ray cluster") < text.index("vllm")
    assert "--distributed-executor-backend ray" in text


def probe(node, ray="2.60.0", python="3.11.7", **kw):
    return multinode.NodeProbe(node=node, reachable=True, versions={"ray": ray}, python_version=python, **kw)


def test_a_ray_or_python_version_that_differs_is_refused_by_node_with_the_fix():
    assert multinode.ray_version_problems([probe("node0"), probe("node1", python="3.11.2")]) == []  # minor only
    found = multinode.ray_version_problems(
        [probe("node0"), probe("node1", ray="2.49.1"), probe("node2", python="3.12.3"), probe("node3", ray=None)]
    )
    assert len(found) == 3
    assert found[0].startswith("node1: Ray 2.49.1 on Python 3.11.7, but node0 has Ray 2.60.0 on Python 3.11.7")
    assert "install Ray 2.60.0 on Python 3.11 there" in found[0]
    assert found[1].startswith("node2: Ray 2.60.0 on Python 3.12.3")
    assert found[2].startswith("node3: Ray is not installed") and "pip install ray==2.60.0 there" in found[2]


def test_params_that_ray_cannot_serve_are_refused_naming_the_parameter():
    with pytest.raises(ValueError) as refused:
        ray_params(device="cpu")
    assert "vLLM's CPU build refuses Ray" in str(refused.value) and "distributed_backend: mp" in str(refused.value)
    with pytest.raises(ValueError) as refused:
        ray_params(nodes=1, node_hosts=[], node_addresses=[], gpus_per_node=0)
    assert "distributed_backend: ray with nodes 1" in str(refused.value)
    with pytest.raises(ValueError) as refused:
        ray_params(ray_port=29500)
    assert "ray_port and node_master_port are both 29500" in str(refused.value)
    cfg = server_config.ServerConfig(model="m", model_path="m", served_model_name="m",
                                     extra_args=["--distributed-executor-backend", "ray"])  # fmt: skip
    assert cfg.conflicts() == [
        "extra_args sets --distributed-executor-backend, which the parameter distributed_backend owns; set "
        "distributed_backend and take --distributed-executor-backend out of extra_args"
    ]


def test_deploy_writes_a_unit_per_ray_node_and_the_heads_waits_for_every_node_before_vllm(tmp_path):
    """Kimi-K2.5 on 2 x 8 H100 over Ray: a unit runs each node's `ray start --block` (the head's too), the head's
    server unit starts them, waits until Ray counts both alive (`servebook ray-wait`), then runs vLLM on Ray."""
    import re

    from servebook import service, systemd
    from servebook.records import LaunchRecord

    p = params.load(REPO / "params" / "kimi-k2.5-2x8-h100-ray.yaml")
    cluster = raycluster.RayCluster.for_nodes(p.nodes_section)
    cfg = raycluster.head_config(server_config.ServerConfig.from_params(p, "cuda"), cluster, p.per_node)
    workers = [w.model_copy(update={"pid": 100 + i}) for i, w in enumerate(cluster.records(tmp_path))]
    launch = LaunchRecord.planned(cfg).model_copy(update={"workers": workers, "topology": "ray"})
    unit = service.unit_spec(p.run_name, launch, predicted_load_s=2400)
    node_units = service.worker_units(unit, launch, tmp_path)
    names = ["servebook-kimi-k2.5-2x8-h100-ray-ray0.service", "servebook-kimi-k2.5-2x8-h100-ray-ray1.service"]
    assert [u.unit_name for u in node_units] == names
    head = systemd.render_unit(unit)
    starts = re.findall(r"^ExecStartPre=(.*)$", head, re.M)
    assert starts[1] == f"/usr/bin/systemctl start --no-block {names[0]}"  # the head's own Ray, no SSH
    assert starts[2].endswith(f"gpu-node-2 systemctl start --no-block {names[1]}")
    assert starts[3].endswith("ray-wait --address 10.0.0.1:6379 --nodes 2")
    exec_start = re.search(r"^ExecStart=(.*)$", head, re.M).group(1)
    assert "--distributed-executor-backend ray" in exec_start and "--nnodes" not in exec_start
    ray1 = (tmp_path / names[1]).read_text()
    ray1_start = re.search(r"^ExecStart=(.*)$", ray1, re.M).group(1)
    assert "-m ray.scripts.scripts start --block" in ray1_start and "--address 10.0.0.1:6379" in ray1_start
    assert "RAY_NODE_IP_ADDRESS=10.0.0.2" in ray1 and "Restart=on-failure" in ray1
    assert "PrivateTmp=no" in ray1 and "PrivateTmp=no" in head  # ray.init finds the node's raylet in /tmp/ray
    for node_unit in node_units:
        assert not node_unit.verify.ran or node_unit.verify.ok, node_unit.verify.output
