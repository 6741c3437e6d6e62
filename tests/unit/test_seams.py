"""The hand-offs between stages: one owner per fact, checked where a second owner would drift.

What the plan prints is what the launch runs; a server's configuration is made of the params' own fields; a
stage reads only the parameters its notebook declares; the API key's variable is the one the params name."""

import ast
from pathlib import Path

import pytest

from servebook import multinode, params, results, runner, server_config, service, serving, stages, systemd
from servebook.params import AbVariant, Params
from servebook.planner import Parallelism
from servebook.records import LaunchRecord
from servebook.stages import launch, plan

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "lib" / "servebook"


def test_the_plans_command_is_the_launchs_command_argument_for_argument(tmp_path):
    p = params.load(REPO / "params" / "ci.yaml", ["max_num_seqs=8", "extra_args=['--seed', '3']"])
    planned = plan.make_plan(p, plan.device_for(p, tmp_path))
    (command,) = planned.node_commands
    assert command == launch.config_for(p, tmp_path).command()
    # the flags that drifted before: each is in the plan's command, and no GPU flag on a CPU
    for flag in ("--enforce-eager", "--max-num-seqs", "--served-model-name", "--host", "--port", "--seed"):
        assert flag in command, flag
    assert "--gpu-memory-utilization" not in command


def test_a_two_node_plan_prints_each_nodes_launch_command(tmp_path):
    p = params.load(
        REPO / "params" / "ci.yaml",
        ["nodes=2", "tensor_parallel_size=2", "node_hosts=['local', 'node-b']", "node_addresses=['127.0.0.1', '127.0.0.3']",
         "node_interconnect=100GbE", "max_num_seqs=8"],
    )  # fmt: skip
    planned = plan.make_plan(p, plan.device_for(p, tmp_path))
    head_cfg, workers = multinode.prepare(
        launch.config_for(p, tmp_path), multinode.NodeSet.for_nodes(p.nodes_section), tmp_path
    )
    assert planned.node_commands == [head_cfg.command(), *(w.command for w in workers)]
    head, worker = planned.node_commands
    assert "--headless" in worker and "--headless" not in head and "--max-num-seqs" in worker


def test_servebook_plan_json_carries_each_nodes_command():
    import json

    from typer.testing import CliRunner

    from servebook.cli import app

    out = CliRunner().invoke(
        app, ["plan", str(REPO / "tests/fixtures/configs/minimax-m2.5.json"), "--gpus", "8", "--nodes", "2",
              "--interconnect", "8x400Gb/s InfiniBand", "--json"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    record = json.loads(out.output)
    head, worker = record["node_commands"]
    assert "--headless" in worker and "--headless" not in head and "--data-parallel-start-rank" in worker
    for flag in record["recommended"]["flags"]:
        assert flag in head and flag in worker


def test_a_servers_configuration_is_made_of_the_params_own_fields():
    fields = server_config.serving_fields()
    assert set(fields) <= set(Params.model_fields), set(fields) - set(Params.model_fields)
    # the serving-field table declares every one of them, and the layout's four, which travel as one
    assert set(serving.names()) == set(fields) | set(serving.LAYOUT) and set(serving.LAYOUT) <= set(Params.model_fields)
    # an A/B variant changes serving fields only, and never one a server does not have
    assert set(AbVariant.model_fields) - {"name"} <= set(serving.names())
    # the defaults are the vocabulary's own
    defaults = server_config.ServerConfig(model="m", model_path="/m", served_model_name="m")
    for name in fields:
        if name not in ("model", "served_model_name"):
            assert getattr(defaults, name) == Params.model_fields[name].get_default(call_default_factory=True), name
    # every field is read from the params: a value set there reaches the server
    p = Params(port=8765, max_num_seqs=7, api_key_env="MY_KEY", extra_env={"NCCL_ALGO": "Ring"}, load_timeout_s=99,
               tensor_parallel_size=2, enable_expert_parallel=True)  # fmt: skip
    cfg = server_config.ServerConfig.from_params(p, "cpu", model_path="/m")
    assert (cfg.port, cfg.max_num_seqs, cfg.api_key_env, cfg.extra_env, cfg.load_timeout_s, cfg.layout) == (
        8765, 7, "MY_KEY", {"NCCL_ALGO": "Ring"}, 99, Parallelism(tp=2, ep=True)
    )  # fmt: skip


def test_the_key_travels_from_the_variable_the_params_name(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-the-right-one")
    monkeypatch.setenv("VLLM_API_KEY", "sk-the-wrong-one")
    cfg = server_config.ServerConfig(model="m", model_path="/m", served_model_name="m", api_key_env="MY_KEY")
    assert cfg.environment()["VLLM_API_KEY"] == "sk-the-right-one"
    assert cfg.target().headers == {"Authorization": "Bearer sk-the-right-one"}
    unit = service.unit_spec("m", LaunchRecord.planned(cfg))
    assert unit.secret_sources == {"VLLM_API_KEY": "MY_KEY"}
    assert systemd.secret_values(unit) == {"VLLM_API_KEY": "sk-the-right-one"}
    assert "# VLLM_API_KEY= (filled at install from $MY_KEY)" in systemd.render_env_file(unit)
    assert "sk-the-right-one" not in systemd.render_unit(unit)
    monkeypatch.delenv("MY_KEY")
    with pytest.raises(Exception, match="MY_KEY"):
        systemd.secret_values(unit)


def reconnaissance_stage_of(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 00's notebook replaced by one code cell after its parameters, for this test's runs."""
    import nbformat

    notebooks = tmp_path / "notebooks"
    notebooks.mkdir()
    kernel = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    nb = nbformat.v4.new_notebook(metadata=kernel)
    nb.cells = [
        nbformat.v4.new_code_cell(params.parameters_cell(["run_dir"]), metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(code),
    ]
    nbformat.write(nb, notebooks / "00_reconnaissance.ipynb")
    monkeypatch.setenv("SERVEBOOK_NOTEBOOKS", str(notebooks))
    monkeypatch.setenv("SERVEBOOK_OUTPUTS", str(tmp_path / "outputs"))


def test_a_stage_that_writes_no_record_fails_the_run_by_name(tmp_path, monkeypatch):
    from servebook.records import ReconRecord

    reconnaissance_stage_of("print('looked, wrote nothing')", tmp_path, monkeypatch)
    run_dir, code = runner.run(REPO / "params" / "ci.yaml", wanted="reconnaissance", log=lambda _: None)
    assert code != 0 and results.read(run_dir, ReconRecord) is None
    (entry,) = results.Manifest.model_validate_json((run_dir / "manifest.json").read_text()).stages
    assert entry.status == "failed" and "MissingRecord" in entry.error
    assert "stage reconnaissance finished without writing 00_reconnaissance.json" in entry.error


CLEANING_STAGE = """
import pathlib, signal, time
if {ignores}:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
pathlib.Path(run_dir, "started").touch()
try:
    time.sleep(120)
except KeyboardInterrupt:
    time.sleep(6)  # as long as a stage's own stop of a server that never served
    pathlib.Path(run_dir, "its except ran").touch()
    raise
"""


@pytest.mark.parametrize(
    ("ignores", "grace_s"), [(False, 60.0), (True, 4.0)], ids=["the stage acts on it", "the stage ignores it"]
)
def test_a_signal_to_servebook_reaches_the_running_stage_first(tmp_path, monkeypatch, ignores, grace_s):
    """SIGTERM to servebook interrupts the stage's kernel (a session of its own, which no signal to servebook
    reaches), and the run ends when the stage's own clean-up has (papermill's shutdown of the kernel gives it a
    second or two); a stage that does not act on it is ended by the run after the grace."""
    import asyncio
    import os
    import signal
    import threading
    import time

    reconnaissance_stage_of(CLEANING_STAGE.format(ignores=ignores), tmp_path, monkeypatch)
    monkeypatch.setattr(runner, "KERNEL_INTERRUPT_GRACE_S", grace_s)
    sent: list[float] = []

    def terminate_once_started() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list((tmp_path / "outputs").glob("*/started")):
            time.sleep(0.1)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_started, daemon=True).start()
    run_dir, code = runner.run(REPO / "params" / "ci.yaml", wanted="reconnaissance", log=lambda _: None)
    took = time.monotonic() - sent[0]
    assert code == 143
    assert (run_dir / "its except ran").exists() is not ignores
    manifest = results.Manifest.model_validate_json((run_dir / "manifest.json").read_text())
    assert manifest.status == "interrupted" and manifest.interrupted == "SIGTERM during 00_reconnaissance"
    assert manifest.stages[0].summary == runner.NOTHING_KEPT  # the report's row says why it has no answer
    assert 6 <= took < 30 if not ignores else grace_s <= took < grace_s + 20, took
    assert signal.getsignal(signal.SIGTERM) is not runner._Interrupt.received  # the run's handlers are gone
    # papermill's tasks for the abandoned cell ended with the run, not at the next notebook this process runs
    from jupyter_core.utils import ensure_event_loop

    assert not [task for task in asyncio.all_tasks(ensure_event_loop()) if not task.done()]


# ---------------------------------------------------------------- which parameters a stage reads


def _functions() -> dict[str, list[ast.FunctionDef]]:
    """Every function and method of the package by name (``name`` and ``Class.name``)."""
    found: dict[str, list[ast.FunctionDef]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                found.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        found.setdefault(f"{node.name}.{item.name}", []).append(item)
    return found


FUNCTIONS = _functions()
# what a Params property reads, and what reads every serving field by name (ServerConfig.from_params's getattr)
PROPERTIES = {
    "layout": {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel"},
    "world_size": {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"},
    "per_node": {"gpus_per_node", "nodes", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"},
}
DYNAMIC = {"ServerConfig.from_params": set(server_config.serving_fields()) | {"model"}}


def _params_args(fn: ast.FunctionDef) -> list[str]:
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    return [a.arg for a in args if a.annotation is not None and "Params" in ast.unparse(a.annotation)]


def _callee(call: ast.Call) -> str:
    parts = ast.unparse(call.func).split(".")
    return ".".join(parts[-2:]) if len(parts) > 1 and parts[-2][:1].isupper() else parts[-1]


def fields_read(fn: ast.FunctionDef, seen: set[int] | None = None) -> set[str]:
    """The Params fields a function reads through its Params arguments, following the calls it passes them to."""
    seen = seen if seen is not None else set()
    if id(fn) in seen:
        return set()
    seen.add(id(fn))
    names, out = set(_params_args(fn)), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            out |= PROPERTIES.get(node.attr, {node.attr} & set(Params.model_fields))
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id in names for a in node.args):
            callee = _callee(node)
            out |= DYNAMIC.get(callee, set())
            for target in FUNCTIONS.get(callee, []):
                out |= fields_read(target, seen)
    return out


@pytest.mark.parametrize("stage", stages.STAGES, ids=lambda s: s.name)
def test_each_stage_reads_only_the_parameters_its_notebook_declares(stage):
    tree = ast.parse(Path(stage.module.__file__).read_text())
    read = set().union(*(fields_read(fn) for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)))
    declared = set(runner.declared_parameters(runner.notebook_of(stage)))
    assert read, "no Params field read: the analysis lost the stage's parameter"
    assert read <= declared, f"{stage.notebook} must declare {sorted(read - declared)}, which {stage.name} reads"


def test_the_parameter_analysis_sees_a_read_through_a_helper():
    tree = ast.parse(
        "def helper(q: Params):\n    return q.bench_input_len\n"
        "def run(p: Params, run_dir):\n    return helper(p), p.layout, p.port\n"
    )
    FUNCTIONS.setdefault("helper", []).append(tree.body[0])
    try:
        assert fields_read(tree.body[1]) == {"bench_input_len", "port", *PROPERTIES["layout"]}
    finally:
        FUNCTIONS["helper"].remove(tree.body[0])


def test_the_variable_api_key_env_names_is_masked_whatever_its_name(monkeypatch):
    from servebook import secrets

    monkeypatch.setenv("MY_KEY", "sk-plain-named-key")
    monkeypatch.delenv(secrets.DECLARED, raising=False)
    assert "sk-plain-named-key" not in secrets.secret_values()  # MY_KEY does not look secret by its name
    server_config.ServerConfig(model="m", model_path="/m", served_model_name="m", api_key_env="MY_KEY").api_key()
    assert secrets.mask("key sk-plain-named-key, from MY_KEY") == "key ***, from MY_KEY"


def test_an_ab_variant_types_each_serving_field_as_the_params_do():
    for name, field in AbVariant.model_fields.items():
        if name != "name":
            assert field.annotation == Params.model_fields[name].annotation | None, name


def test_the_field_table_writes_the_commands_the_h200_launches_ran():
    """Every committed H200 launch record (schema 2: the layout's four fields in its configuration) reads back with
    its layout as one value, and the serving-field table writes the very flags that launch ran."""
    records = sorted((REPO / "docs" / "examples").rglob("03_launch.json"))
    assert len(records) >= 5
    layouts = set()
    for path in records:
        record = LaunchRecord.model_validate_json(path.read_text())
        args = record.config.serve_args()
        assert record.command[-len(args) :] == args, path
        layouts.add(record.config.layout)
    assert Parallelism(tp=2, ep=True) in layouts and Parallelism() in layouts


def test_the_kernel_clients_words_on_a_dying_kernel_go_to_kernels_log_not_the_terminal(tmp_path, capfd):
    """Seen once in CI after SIGTERM mid-benchmark: papermill's "Kernel died while waiting for execute reply." and
    asyncio's "Task exception was never retrieved" with a DeadKernelError traceback, on the terminal between the
    run's own lines. Both loggers now write to the run's kernels.log while the run lasts, and the abandoned task is
    collected before they are given back."""
    import asyncio
    import logging

    from nbclient.exceptions import DeadKernelError

    from servebook import runner

    async def dies() -> None:
        raise DeadKernelError("Kernel died")

    path = tmp_path / "kernels.log"
    with runner.kernel_clients_logged_to(path):
        logging.getLogger("papermill").error("Kernel died while waiting for execute reply.")
        loop = asyncio.new_event_loop()
        task = loop.create_task(dies())
        loop.run_until_complete(asyncio.sleep(0.01))
        loop.close()
        del task  # never awaited: asyncio reports its exception when the task is collected
    said = capfd.readouterr()
    logged = path.read_text()
    assert "Kernel died while waiting" in logged and "never retrieved" in logged and "DeadKernelError" in logged
    assert "Kernel died" not in said.out + said.err and "Traceback" not in said.err
    assert logging.getLogger("papermill").propagate and logging.getLogger("asyncio").propagate


def test_the_per_user_speed_plot_leaves_room_above_its_highest_label():
    """In the MiniMax H200 sweep the c=4 label sat on the plot's top edge (looked at in Chromium)."""
    import json
    from pathlib import Path

    from servebook import bench, plots

    path = Path(__file__).resolve().parents[2] / "docs/examples/h200-vllm/run-minimax-rehearse/05_benchmark.json"
    fig = plots.pareto(bench.SweepResult.model_validate(json.loads(path.read_text())))
    top = max(fig.data[0].y)
    assert fig.layout.yaxis.range[0] == 0 and fig.layout.yaxis.range[1] >= top * 1.15
