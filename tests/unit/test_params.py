import subprocess
import sys
from pathlib import Path

import pytest

from servebook import params
from servebook.errors import ParamsError
from servebook.params import Params
from servebook.planner import Parallelism

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    return path


def test_every_shipped_params_file_is_valid():
    files = sorted((REPO / "params").glob("*.yaml"))
    assert {f.name for f in files} >= {"default.yaml", "ci.yaml", "minimax-m2.5-8gpu.yaml", "kimi-k2.5-8gpu.yaml"}
    for f in files:
        params.load(f)


def test_unknown_key_suggests_the_closest_name(tmp_path):
    with pytest.raises(ParamsError) as exc:
        params.load(write(tmp_path, "modle: x\ntensor_paralel_size: 2\n"))
    text = str(exc.value)
    assert "unknown parameter 'modle': did you mean 'model'?" in text
    assert "unknown parameter 'tensor_paralel_size': did you mean 'tensor_parallel_size'?" in text


def test_every_problem_is_reported_at_once_by_name(tmp_path):
    with pytest.raises(ParamsError) as exc:
        params.load(write(tmp_path, "port: abc\ngpu_memory_utilization: 1.5\nkv_cache_dtype: fp4\n"))
    problems = exc.value.problems
    assert len(problems) == 3
    assert any("'port'" in p and "valid integer" in p for p in problems)
    assert any("'gpu_memory_utilization'" in p and "less than or equal to 1" in p for p in problems)
    assert any("'kv_cache_dtype'" in p for p in problems)


def test_every_broken_combination_is_reported_too(tmp_path):
    text = "tensor_parallel_size: 8\ngpu_ids: [0, 1]\nbench_turns: 2\nbench_burstiness: 0.5\n"
    with pytest.raises(ParamsError) as exc:
        params.load(write(tmp_path, text))
    problems = exc.value.problems
    assert len(problems) == 3 and problems[0].startswith("gpu_ids lists 2 GPUs")
    assert problems[1].startswith("bench_turns 2 sends conversations") and problems[2].startswith("bench_burstiness")


def test_impossible_combination_is_named(tmp_path):
    with pytest.raises(ParamsError, match="gpu_ids lists 2 GPUs but .* = 8"):
        params.load(write(tmp_path, "tensor_parallel_size: 8\ngpu_ids: [0, 1]\n"))


def test_secrets_are_refused_in_params(tmp_path):
    with pytest.raises(ParamsError, match="extra_env.HF_TOKEN looks like a secret"):
        params.load(write(tmp_path, "extra_env: {HF_TOKEN: hf_abcdefgh}\n"))
    with pytest.raises(ParamsError, match="--api-key"):
        params.load(write(tmp_path, "extra_args: ['--api-key', 'sk-123']\n"))


def test_overrides_are_typed_and_validated(tmp_path):
    f = write(tmp_path, "port: 8000\n")
    p = params.load(f, ["port=8001", "enforce_eager=true", "extra_args=['--enable-prefix-caching']"])
    assert p.port == 8001 and p.enforce_eager is True and p.extra_args == ["--enable-prefix-caching"]
    with pytest.raises(ParamsError, match="did you mean 'port'"):
        params.load(f, ["prot=1"])
    with pytest.raises(ParamsError, match="not KEY=VALUE"):
        params.load(f, ["port"])


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(ParamsError, match="no such params file"):
        params.load(tmp_path / "nope.yaml")
    with pytest.raises(ParamsError, match="must be a mapping"):
        params.load(write(tmp_path, "- a\n- b\n"))


def test_cli_rejects_a_misspelled_key_without_creating_a_run_folder(tmp_path):
    f = write(tmp_path, "run_name: typo\nmodle: x\n")
    outputs = tmp_path / "outputs"
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "run", str(f)],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "SERVEBOOK_OUTPUTS": str(outputs)},
        timeout=60,
    )
    assert proc.returncode == 2
    assert "unknown parameter 'modle': did you mean 'model'?" in proc.stderr
    assert not outputs.exists()


def test_notebook_namespace_is_validated():
    p = params.from_namespace({"port": 9000, "run_dir": "x", "unrelated": 1})
    assert p.port == 9000
    with pytest.raises(ParamsError, match="'port'"):
        params.from_namespace({"port": 80})


def test_a_missing_local_model_folder_is_named_before_anything_starts(tmp_path):
    with pytest.raises(ParamsError, match=r"model: no folder /no/such/checkpoint on this machine"):
        params.validate({"model": "/no/such/checkpoint"})
    params.validate({"model": str(tmp_path)})  # an existing folder is fine
    params.validate({"model": "MiniMaxAI/MiniMax-M2.5"})  # and a hub repo id is not a path


def cli(*args):
    return subprocess.run([sys.executable, "-m", "servebook.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_answers_wrong_or_simple_input_in_one_line(tmp_path):
    assert cli("--version").stdout.startswith("servebook ")
    one = cli("compare", str(tmp_path))
    assert one.returncode == 1 and "compare needs two or more runs, got 1" in one.stderr
    not_runs = cli("compare", str(tmp_path), str(tmp_path))
    assert not_runs.returncode == 1 and "holds no 05_benchmark.json and no `vllm bench serve` result" in not_runs.stderr
    assert "Traceback" not in one.stderr + not_runs.stderr
    stop = cli("stop", str(REPO / "params" / "ci.yaml"))  # symmetric with `launch PARAMS`: that params file's port
    assert stop.returncode == 0 and "no servebook server on port 8123" in stop.stdout


def test_an_unreachable_hub_is_named_at_once_without_retries(monkeypatch):
    """huggingface_hub alone retries a refused connection for about 24 s; servebook asks once and says why."""
    import time

    from servebook import hub, modelspec
    from servebook.errors import HubUnreachable

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub._unreachable.cache_clear()
    started = time.monotonic()
    with pytest.raises(HubUnreachable) as err:
        modelspec.load("MiniMaxAI/MiniMax-M2.5")
    assert time.monotonic() - started < hub.PROBE_TIMEOUT_S + 2
    assert "http://127.0.0.1:9 does not answer" in str(err.value) and "HF_ENDPOINT" in str(err.value)
    assert "local checkpoint folder" in str(err.value)


def test_offline_mode_is_named_when_nothing_is_cached(monkeypatch, tmp_path):
    from servebook import hub, modelspec
    from servebook.errors import HubUnreachable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(HubUnreachable, match="HF_HUB_OFFLINE is set"):
        modelspec.load("some-org/never-downloaded")
    assert hub.offline()


def test_a_change_after_validation_is_validated_as_a_whole_file_is():
    """The plan's choice and the explorer's what-if reach the params through `updated`: pydantic's
    `model_copy(update=...)` would accept the layout that `Params(...)` refuses."""
    p = Params(gpu_ids=[0, 1], tensor_parallel_size=2)
    with pytest.raises(ParamsError, match="gpu_ids lists 2 GPUs"):
        p.updated({"tensor_parallel_size": 4}, source="the layout chosen in 01_plan")
    with pytest.raises(ParamsError, match="what if"):
        p.with_layout(Parallelism(tp=4), source="what if TP=4")
    moved = p.with_layout(Parallelism(tp=1, dp=2))
    assert (moved.tensor_parallel_size, moved.data_parallel_size) == (1, 2)
    assert moved.model_fields_set == p.model_fields_set | {
        "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "enable_expert_parallel"
    }  # fmt: skip
