"""Bad input at every entry point: one line that names the input and the fix, exit 2, nothing started, no
traceback."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servebook import stages

REPO = Path(__file__).resolve().parents[2]
CI = str(REPO / "params" / "ci.yaml")


def servebook(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "servebook.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def refused(proc: subprocess.CompletedProcess, *words: str, code: int = 2) -> None:
    said = proc.stdout + proc.stderr
    assert proc.returncode == code, said
    assert "Traceback" not in said, said
    for word in words:
        assert word in said, said


def test_a_set_value_that_is_not_yaml_names_the_override():
    refused(servebook("check", CI, "--set", "port=[1"), "--set", "'port=[1'", "not YAML")


def test_a_params_file_with_a_number_for_a_key_or_bytes_that_are_not_utf8(tmp_path):
    numbered = tmp_path / "numbered.yaml"
    numbered.write_text("port: 8123\n1: 2\n")
    refused(servebook("check", str(numbered)), "key 1 is not a parameter name")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("run_name: caf\xe9\n".encode("latin-1"))
    refused(servebook("check", str(latin)), "not UTF-8 text", "save it as UTF-8")


def test_a_served_name_with_a_newline_never_reaches_a_unit(tmp_path):
    refused(servebook("check", CI, "--set", 'served_model_name="tiny\\nExecStartPost=/bin/true"'), "control character")


def test_check_runs_vllms_parser_on_the_whole_command_and_names_flags_set_twice():
    refused(
        servebook("check", CI, "--set", "extra_args=['--no-such-flag']"),
        "rejects the serving command",
        "--no-such-flag",
    )
    refused(
        servebook("check", CI, "--set", "extra_args=['--tensor-parallel-size', '2']"),
        "extra_args sets --tensor-parallel-size, which the parameter tensor_parallel_size owns",
    )
    assert servebook("check", CI).returncode == 0


def test_check_counts_a_dataset_against_max_model_len_with_the_served_tokenizer(tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 3000, "output_tokens": 8}) + "\n")
    refused(servebook("check", CI, "--set", f"bench_dataset={long}"), "max_model_len")


def test_compare_on_a_cut_record_names_the_file(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "05_benchmark.json").write_text('{"levels": [')
    refused(servebook("compare", str(tmp_path / "a"), str(tmp_path / "b")), "05_benchmark.json", code=1)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["gpu-check", "--port", "8000", "--gpus", "a,b"], ["--gpus 'a,b'", "as numbers"]),
        (["wait-ready", "--url", "notaurl", "--timeout", "1"], ["--url 'notaurl'", "http://127.0.0.1:8000"]),
        (["plan", "builtin:tiny-qwen3-moe", "--gpus", "0"], ["--gpus"]),
        (["plan", "builtin:tiny-qwen3-moe", "--vllm-version", "latest"], ["--vllm-version 'latest'", "0.25"]),
    ],
    ids=["gpu-check --gpus a,b", "wait-ready --url notaurl", "plan --gpus 0", "plan --vllm-version latest"],
)
def test_cli_entry_points_refuse_bad_values_in_one_line(args, words):
    refused(servebook(*args), *words)


@pytest.mark.parametrize("text", ['{"hidden_size": 12', "[]"], ids=["cut", "not an object"])
def test_plan_on_a_broken_config_names_the_file(tmp_path, text):
    config = tmp_path / "config.json"
    config.write_text(text)
    refused(servebook("plan", str(tmp_path)), str(config))


def test_a_read_only_outputs_folder_is_named_before_anything_starts(tmp_path):
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    env = {**os.environ, "SERVEBOOK_OUTPUTS": str(ro / "outputs")}
    if os.geteuid() == 0:  # root writes anywhere: a file where the folder should be stands in for read-only
        env["SERVEBOOK_OUTPUTS"] = str(tmp_path / "a-file" / "outputs")
        (tmp_path / "a-file").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "run", CI, "--stages", "reconnaissance"],
        capture_output=True, text=True, cwd=REPO, env=env, timeout=120,
    )  # fmt: skip
    refused(proc, "cannot create a run folder under", "SERVEBOOK_OUTPUTS", code=1)


def test_a_malformed_index_is_a_verification_problem_not_a_traceback(tmp_path):
    import shutil

    from servebook import download, models

    shutil.copytree(models.build_tiny_model(), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text('{"weight_map": {')
    found = download.verify(tmp_path / "ckpt")
    assert not found.ok and any("model.safetensors.index.json: not readable JSON" in p for p in found.problems)


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("tensor_parallel_size=3", ["layout TP=3", "attention heads (4)", "tensor_parallel_size", "servebook plan"]),
        ("max_model_len=100000", ["max_model_len 100000", "max_position_embeddings 4096", "max_model_len: 4096"]),
    ],
    ids=["TP=3 on 4 heads", "max_model_len past the positions"],
)
def test_check_and_launch_refuse_what_the_plan_knows_before_anything_starts(override, words):
    """Issue #41 point 3: what vLLM would refuse 18 s into a launch, said by `check` and by `launch` at once."""
    refused(servebook("check", CI, "--set", override), *words)
    refused(servebook("launch", CI, "--set", override), *words)


def test_check_names_a_port_another_program_holds():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        refused(servebook("check", CI, "--set", f"port={port}"), f"port {port}", "held by", "set port to a free one")


def test_check_says_a_hub_model_out_of_reach(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "check", CI, "--set", "model=nobody-here/no-such-model"],
        capture_output=True, text=True, cwd=REPO, timeout=300, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    refused(proc, "model:", "nobody-here/no-such-model", "HF_HUB_OFFLINE")


def test_stages_that_read_the_launch_without_it_are_refused_with_the_selection_that_works(tmp_path):
    """Each run starts in a folder of its own, so ``--stages benchmark`` alone once started a kernel, failed on the
    missing launch record and wrote a report of that failure. It is refused now, before any folder exists, with the
    selection that works (the launch reuses a server already serving)."""
    import os

    env = os.environ | {"SERVEBOOK_OUTPUTS": str(tmp_path / "out")}
    proc = subprocess.run([sys.executable, "-m", "servebook.cli", "run", CI, "--stages", "07,smoke_test,benchmark"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)  # fmt: skip
    refused(proc, "--stages:", "smoke_test, benchmark, deploy need the launch stage", "--stages launch,smoke_test,"
            "benchmark,deploy", "reuses a server already serving")  # fmt: skip
    assert not (tmp_path / "out").exists()
    stages.require_upstream(stages.select("launch,benchmark"))  # with it, the selection stands
    stages.require_upstream(stages.select("reconnaissance,plan"))  # and so does one that reads no launch


def test_a_key_variable_that_is_not_set_is_named_before_the_first_stage_and_a_plan_needs_none(tmp_path):
    import os

    env = {k: v for k, v in os.environ.items() if k != "SB_UNSET_KEY"} | {"SERVEBOOK_OUTPUTS": str(tmp_path / "out")}
    args = [sys.executable, "-m", "servebook.cli", "run", CI, "--set", "api_key_env=SB_UNSET_KEY"]
    proc = subprocess.run([*args, "--stages", "reconnaissance,smoke_test"], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=120)  # fmt: skip
    refused(proc, "api_key_env names SB_UNSET_KEY, which is not set", "needed by smoke_test;", "export SB_UNSET_KEY")
    assert not (tmp_path / "out").exists()  # refused before a run folder, let alone a stage
    proc = subprocess.run([*args, "--stages", "reconnaissance"], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
