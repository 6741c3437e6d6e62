"""The serving shape has one owner: the params name a shape once (topology.shape_of), each shape is one class in
one file, and the ports each shape holds are its own to stop."""

import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from servebook import params, topology
from servebook.errors import ParamsError
from servebook.planner import Parallelism
from servebook.server_config import ServerConfig
from servebook.topology import hybrid, mp_nodes, ray_nodes, replica_set, single

NODES = {"nodes": 2, "node_hosts": ["local", "node-b"], "node_addresses": ["10.0.0.1", "10.0.0.2"],
         "tensor_parallel_size": 2, "device": "cuda", "node_interconnect": "8x400Gb/s InfiniBand"}  # fmt: skip
SHAPES = [
    ({}, "single", single.SingleServer),
    (NODES, "nodes", mp_nodes.MultiNodeServer),
    ({**NODES, "distributed_backend": "ray"}, "ray", ray_nodes.RayServer),
    ({**NODES, "tensor_parallel_size": 1, "data_parallel_size": 2, "data_parallel_lb": "hybrid"}, "hybrid",
     hybrid.HybridServer),
    ({"replicas": 2, "port": 9000}, "replicas", replica_set.ReplicaSet),
]  # fmt: skip


@pytest.mark.parametrize(("values", "shape", "cls"), SHAPES, ids=[s for _, s, _ in SHAPES])
def test_each_shape_is_read_once_from_the_params_and_built_as_its_own_class(values, shape, cls, tmp_path):
    p = params.validate(values)
    cfg = ServerConfig.from_params(p, p.device if p.device != "auto" else "cpu", model_path="/m")
    built = topology.of(p, cfg, tmp_path)
    assert topology.shape_of(p) == shape and type(built) is cls and built.shape == shape
    assert built.describe() == topology.SHAPES[shape]
    # it holds its typed section, never the whole params, and the section cannot be changed past validation
    assert built.section == p.topology_section and not any(isinstance(v, params.Params) for v in vars(built).values())
    with pytest.raises(ValidationError, match="frozen"):
        built.section.nodes.per_node = 3  # type: ignore[misc]


def test_one_file_per_shape():
    files = {Path(sys.modules[cls.__module__].__file__) for _, _, cls in SHAPES}
    assert len(files) == len(topology.SHAPES) and {f.parent for f in files} == {Path(topology.__file__).parent}


def test_each_shape_holds_its_own_ports_the_router_first():
    p = params.validate({"replicas": 2, "port": 9000, "replica_base_port": 9100})
    cfg = ServerConfig(model="m", model_path="/m", served_model_name="m", port=9000)
    assert topology.of(p, cfg, Path("/tmp")).ports() == [9000, 9100, 9101]
    h = params.validate({**NODES, "tensor_parallel_size": 1, "data_parallel_size": 2, "data_parallel_lb": "hybrid",
                         "port": 8000})  # fmt: skip
    assert topology.of(h, ServerConfig.from_params(h, "cuda", model_path="/m"), Path("/tmp")).ports() == [8000, 8001]
    one = params.validate({"port": 8123})
    assert topology.of(one, ServerConfig.from_params(one, "cpu", model_path="/m"), Path("/tmp")).ports() == [8123]


def test_a_shape_servebooks_launch_cannot_start_is_refused_by_name():
    p = params.validate({**NODES, "replicas": 2, "gpu_ids": []})
    with pytest.raises(ParamsError, match="replicas 2 with nodes 2.*replica_hosts"):
        topology.shape_of(p, "run.yaml")


def test_a_launch_record_says_its_shape_also_from_before_it_was_written():
    assert topology.shape_of_launch(True, ["vllm"]) == "hybrid"
    assert topology.shape_of_launch(True, []) == "replicas"
    assert topology.shape_of_launch(False, ["ray", "ray"]) == "ray"
    assert topology.shape_of_launch(False, ["vllm"]) == "nodes"
    assert topology.shape_of_launch(False, []) == "single"
    assert topology.machines(params.validate({})) is None
    assert topology.machines(params.validate(NODES)).nodes[1].address == "10.0.0.2"
    assert Parallelism(tp=2) == ServerConfig.from_params(params.validate(NODES), "cuda", model_path="/m").layout


def test_servebook_launch_starts_the_params_shape_not_one_server_whatever_they_say():
    """`servebook launch` with replicas goes through the replica set: its preflight refuses two CUDA replicas on a
    machine without GPUs, by name, before anything starts (it used to start one server and ignore replicas)."""
    from typer.testing import CliRunner

    from servebook.cli import app

    params_file = str(Path(__file__).resolve().parents[2] / "params" / "default.yaml")
    out = CliRunner().invoke(app, ["launch", params_file, "--set", "replicas=2", "--set", "device=cuda",
                                   "--set", "ab_variants=[]"])  # fmt: skip
    assert out.exit_code != 0
    assert "launching independent replicas behind vllm-router" in out.output
    assert "replicas 2 x TP=1 need GPUs up to index 1" in out.output, out.output
