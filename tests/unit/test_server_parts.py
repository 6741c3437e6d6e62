"""Server pieces that need no running vLLM: command, environment, log reading, root causes."""

from pathlib import Path

import pytest

from servebook import client, server, server_config, serving, vllm_compat
from servebook.errors import PreflightError
from servebook.planner import Parallelism

CPU_LOG = """\
(APIServer pid=4061) INFO 11-30 12:53:46 [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0
(Worker pid=3060) INFO 11-30 12:49:00 [cpu_model_runner.py:68] Starting to load model /m/tiny...
(Worker pid=3060) INFO 11-30 12:49:01 [weight_utils.py:842] Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]
(Worker pid=3060) INFO 11-30 12:49:01 [weight_utils.py:842] Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 60.1it/s]
(Worker pid=3060) INFO 11-30 12:49:01 [default_loader.py:507] Loading weights took 0.02 seconds
(EngineCore pid=3048) INFO 11-30 12:49:01 [kv_cache_utils.py:2327] CPU KV cache size: 2,097,152 tokens, Maximum concurrency for 2,048 tokens per request: 1024.00x
(EngineCore pid=3048) INFO 11-30 12:49:06 [core.py:400] init engine (profile, create kv cache, warmup model) took 5.06 seconds
(APIServer pid=3030) INFO:     Application startup complete.
"""
GPU_LOG = """\
(Worker_TP0 pid=11) INFO [gpu_model_runner.py:5089] Model loading took 68.41 GiB memory and 2160.5 seconds
(Worker_TP0 pid=11) INFO [gpu_worker.py:773] Available KV cache memory: 12.50 GiB
(EngineCore pid=9) INFO [kv_cache_utils.py:1147] GPU KV cache size: 187,264 tokens, Maximum concurrency for 65,536 tokens per request: 2.86x
(Worker_TP0 pid=11) INFO [gpu_model_runner.py:6517] Graph capturing finished in 41 secs, took 1.25 GiB
"""


def test_load_progress_reads_every_phase():
    progress = server.LoadProgress()
    said = [progress.feed(line, i) for i, line in enumerate((CPU_LOG + GPU_LOG).splitlines())]
    v = progress.values
    assert v.vllm_version == "0.32.0" and v.shards_percent == 100 and v.weights_load_s == 0.02
    assert v.kv_cache_tokens == 187_264 and v.kv_cache_device == "GPU"  # the later GPU line wins
    assert v.max_concurrency == 2.86 and v.max_concurrency_context == 65_536
    assert v.model_memory_gib == 68.41 and v.model_load_s == 2160.5 and v.kv_cache_memory_gib == 12.5
    assert v.graph_capture_s == 41 and v.graph_memory_gib == 1.25 and v.engine_init_s == 5.06
    assert "checkpoint shards 100% (1/1)" in said
    assert progress.seen["shards"] == 3 and progress.seen["api_up"] == 7


@pytest.mark.parametrize(
    "log, expected",
    [
        (
            "usage: vllm serve ...\nvllm serve: error: unrecognized arguments: --enable-pcie-oneshot-allreduce\n",
            "bad command-line flag: unrecognized arguments: --enable-pcie-oneshot-allreduce",
        ),
        (
            "(EngineCore pid=3) ValueError: The output_size of gate's and up's weight = 192 is not divisible by weight quantization block_n = 128.\n"
            "(EngineCore pid=3) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n",
            "FP8 block alignment",
        ),
        (
            "(Worker_TP3 pid=9) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n",
            "out of GPU memory",
        ),
        ("(APIServer pid=1) OSError: [Errno 98] Address already in use\n", "port already in use"),
        (
            "(EngineCore pid=3) KeyError: 'experts'\nRuntimeError: Engine core initialization failed. See root cause above.\n",
            "exception while starting: KeyError: 'experts'",
        ),
        (
            "\x1b[31m(APIServer pid=1) ValueError: User-specified max_model_len (100000) is greater than the derived max_model_len\x1b[0m\n",
            "exception while starting: ValueError: User-specified max_model_len",
        ),
    ],
)
def test_root_cause_names_the_failure(log, expected):
    assert expected in server.root_cause(log)


def test_warnings_are_not_root_causes():
    log = "(APIServer pid=1) WARNING Found ulimit ... This can cause fd limit errors like `OSError: [Errno 24] Too many open files`.\n"
    assert server.root_cause(log).startswith("the server exited without a recognised error")


def cfg(**kw):
    """A configuration, the layout given as the params name its fields."""
    base = dict(model="m", model_path="/models/m", served_model_name="m", device="cuda")
    layout = {k: kw.pop(k) for k in serving.LAYOUT if k in kw}
    base.update(kw)
    return server.ServerConfig(**base, layout=Parallelism().updated(layout))


def test_serve_args_follow_the_layout():
    args = cfg(
        tensor_parallel_size=8,
        enable_expert_parallel=True,
        kv_cache_dtype="fp8",
        max_num_seqs=64,
        extra_args=["--enable-prefix-caching"],
    ).serve_args()
    assert args[:4] == ["--served-model-name", "m", "--host", "127.0.0.1"]
    for flag in (["--tensor-parallel-size", "8"], ["--kv-cache-dtype", "fp8"], ["--max-num-seqs", "64"]):
        i = args.index(flag[0])
        assert args[i : i + 2] == flag
    assert "--enable-expert-parallel" in args and args[-1] == "--enable-prefix-caching"
    assert "--pipeline-parallel-size" not in args
    cpu = cfg(device="cpu").serve_args()
    assert "--gpu-memory-utilization" not in cpu


def test_environment_keeps_the_api_key_off_the_command_line(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-secret-123456")
    c = cfg(api_key_env="MY_KEY", gpu_ids=[4, 5], extra_env={"NCCL_DEBUG": "WARN"}, load_timeout_s=4200)
    env = c.environment()
    assert env["VLLM_API_KEY"] == "sk-secret-123456"
    assert all("sk-secret" not in a for a in c.command())
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and env["NCCL_DEBUG"] == "WARN"
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == "4200"
    recorded = server.environment_record(c, env)
    assert recorded["VLLM_API_KEY"] == "***"


def test_missing_api_key_variable_is_a_preflight_error(monkeypatch):
    monkeypatch.delenv("NOPE_KEY", raising=False)
    with pytest.raises(PreflightError, match="NOPE_KEY, which is not set"):
        cfg(api_key_env="NOPE_KEY").environment()


def test_load_budget_grows_with_checkpoint_size(monkeypatch):
    monkeypatch.setattr(server.models, "checkpoint_bytes", lambda path: (547e9, True))
    assert cfg().load_budget_s() == pytest.approx(server_config.BASE_BUDGET_S + 547 * server_config.SECONDS_PER_GB)
    assert cfg().load_budget_s() > 36 * 60  # the story's load fits
    assert cfg(load_timeout_s=60).load_budget_s() == 60


def test_fingerprint_ignores_only_the_budget():
    assert cfg().fingerprint() == cfg(load_timeout_s=99).fingerprint()
    assert cfg().fingerprint() != cfg(max_model_len=8192).fingerprint()


def test_unknown_flags_against_a_cached_option_list():
    options = ["--max-model-len", "--enforce-eager", "--enable-prefix-caching", "--tensor-parallel-size", "-tp"]
    assert vllm_compat.unknown_flags(["--max-model-len", "4", "--enable-pcie-oneshot-allreduce"], options) == [
        "--enable-pcie-oneshot-allreduce"
    ]
    assert (
        vllm_compat.unknown_flags(
            [
                "--max_model_len=4",
                "--no-enable-prefix-caching",
                "--enforce",
                "-tp",
                "2",
                "--compilation-config.mode=none",
            ],
            options,
        )
        == []
    )
    assert vllm_compat.unknown_flags(["--en"], options) == ["--en"]  # ambiguous prefix


def test_removed_vllm_variables_get_a_hint():
    problems = vllm_compat.unknown_vllm_env(
        ["VLLM_USE_V1", "VLLM_ALL2ALL_BACKEND", "VLLM_LOGGING_LEVEL", "NCCL_DEBUG"], ["VLLM_LOGGING_LEVEL"]
    )
    assert len(problems) == 2
    assert "only the V1 engine" in problems[0] and "--all2all-backend" in problems[1]


def test_health_of_nothing_listening_is_loading():
    assert client.health("http://127.0.0.1:9") == "loading"


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-logs"


def test_every_phase_of_a_real_cpu_log_is_read():
    progress = server.LoadProgress()
    for i, line in enumerate((FIXTURES / "cpu-0.32.0-tiny-qwen3-moe.log").read_text().splitlines()):
        progress.feed(line, i)
    v = progress.values
    assert v.vllm_version == "0.32.0" and v.kv_cache_device == "CPU" and v.kv_cache_tokens == 2_097_152
    assert v.engine_init_s and v.weights_load_s is not None and "api_up" in progress.seen


def test_model_loading_without_the_word_memory_is_read():
    # dense models and several MoE runners in vLLM 0.25 log "Model loading took X GiB and Y seconds"
    progress = server.LoadProgress()
    progress.feed("(Worker_TP0 pid=9) INFO [default_loader.py:291] Model loading took 28.49 GiB and 41.2 seconds", 1)
    assert progress.values.model_memory_gib == 28.49 and progress.values.model_load_s == 41.2


def test_a_multi_line_exception_keeps_its_message():
    log = (
        "(EngineCore pid=3) RuntimeError:\n(EngineCore pid=3) NCCL error in: nccl.cpp:1234, unhandled system error\n"
        "(EngineCore pid=3) Last error: socket timeout\n"
    )
    cause = server.root_cause(log)
    assert cause.startswith("exception while starting: RuntimeError: NCCL error in: nccl.cpp:1234"), cause


def test_vllm_memory_profile_lines_are_read():
    """vLLM 0.25's DEBUG memory profile and its CUDA-graph estimate (INFO), from a real H200 run."""
    from servebook.vllm_log import read_values

    v = read_values((FIXTURES / "gpu-0.25.0-h200-bf16-tp1.log").read_text())
    assert (v.vllm_version, v.model_memory_gib, v.kv_cache_memory_gib) == ("0.25.0", 9.31, 115.07)
    assert (v.non_kv_memory_gib, v.activation_peak_gib, v.non_torch_gib) == (10.4, 0.87, 0.23)
    assert v.graph_estimate_share == pytest.approx(0.0025)
    assert v.kv_cache_tokens == 7_541_136


@pytest.mark.parametrize(
    ("text", "usage", "ok", "detail"),
    [
        ("Prom Prom", {"completion_tokens": 8}, True, "'Prom Prom'"),
        # the H200 run's deploy check: 8 tokens whose text vLLM left blank
        ("", {"completion_tokens": 8}, True, "8 tokens, blank text"),
        (" \n", {"completion_tokens": 3}, True, "3 tokens, blank text"),
        ("", {"completion_tokens": 0}, False, "no text and no completion_tokens"),
        ("", None, False, "no text and no completion_tokens"),
    ],
)
def test_an_answer_is_judged_by_its_tokens_not_its_text(text, usage, ok, detail):
    check = client.answer_check("completion", text, usage)
    assert check.check == "completion generated tokens"
    assert check.ok is ok
    assert detail in check.detail


def test_the_launch_bar_moves_with_every_milestone_and_fills_on_reuse():
    """Issue #41 point 7: the bar stayed empty until ready, and a reused server left "starting" showing."""
    from servebook import ui

    said = ["vLLM 0.32.0", "loading model", "checkpoint shards 50% (1/2)", "weights read in 2.0 s",
            "model loaded: 1.2 GiB in 2.4 s", "KV cache: 1,000 tokens", "engine initialised in 30 s", "API server up"]  # fmt: skip
    steps = [ui.load_step(m) for m in said]
    assert steps == sorted(steps) and 0 not in steps and steps[-1] < len(ui.LOAD_STEPS)
    assert ui.load_step("ready: reusing the healthy server on port 8000 (pid 7), nothing to load") == len(ui.LOAD_STEPS)


def test_a_running_server_that_differs_says_how_flag_by_flag():
    running = ["vllm", "serve", "/m", "--max-model-len", "1024", "--enforce-eager", "--port", "8000"]
    asked = ["vllm", "serve", "/m", "--port", "8000", "--max-model-len=2048", "--kv-cache-dtype", "fp8"]
    assert serving.flag_changes(running, asked) == [
        "--max-model-len 1024 → 2048",
        "--enforce-eager on → unset",
        "--kv-cache-dtype unset → fp8",
    ]
    assert serving.flag_changes(running, running) == []


def test_command_lines_parsed_ahead_in_one_subprocess_then_pass_their_preflights_from_the_cache(tmp_path, monkeypatch):
    """A rehearsal's candidates and their launches through vLLM's own parser at once: the accepted ones then pass
    their preflight without a subprocess; one vLLM refuses is not remembered, and its own preflight says why."""
    from servebook import models

    monkeypatch.setenv("SERVEBOOK_CACHE", str(tmp_path))
    model = str(models.tiny_model_dir())
    good = [["--max-model-len", "1024"], ["--max-model-len", "1024", "--max-num-seqs", "4"]]
    refused = ["--max-num-seqs", "four"]
    assert vllm_compat.parse_ahead(model, [*good, refused, good[0]]) == 3  # the repeat parsed once
    for args in good:
        parsed = vllm_compat.parse_serve_args(model, args)
        assert parsed.ok and parsed.from_cache and parsed.seconds < 1
    again = vllm_compat.parse_serve_args(model, refused)
    assert not again.ok and not again.from_cache and "four" in again.message
    assert vllm_compat.parse_ahead(model, good) == 0  # nothing left to parse


@pytest.mark.parametrize(
    ("ready", "grace_s", "waited"),
    [(None, 0.5, "0.5 s"), (False, server.STOP_GRACE_S, "5 s")],
    ids=["a server that served: the grace it is given", "one still starting: the grace of a start"],
)
def test_a_stop_says_which_processes_ignored_sigterm_and_were_killed(tmp_path, monkeypatch, ready, grace_s, waited):
    """A server group whose process ignores SIGTERM (as vLLM's API server does while its engine compiles) is killed
    after its grace, and the stop says so; nothing is left and the registration is gone. A start that never served
    has nothing to finish: it waits the workers' shutdown timeout, not the full grace."""
    import subprocess
    import sys

    import psutil

    monkeypatch.setenv("SERVEBOOK_CACHE", str(tmp_path))
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)"],
        start_new_session=True, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert stubborn.stdout is not None and stubborn.stdout.readline()  # its handler is set
    server.register(
        server.Registration(pid=stubborn.pid, pgid=stubborn.pid, port=9011, host="127.0.0.1", url="", fingerprint="",
                            command=[], log_path="", model="m", served_model_name="m", device="cpu", gpu_ids=[], started_at="",
                            ready=ready)
    )  # fmt: skip
    try:
        outcome = server.stop(port=9011, grace_s=grace_s)
        stubborn.wait(timeout=10)  # psutil reaped it: its status is lost to Popen, the stop's summary has it
        assert outcome.summary.startswith("1 process(es) stopped, nothing left"), outcome.summary
        assert f"(1 ignored SIGTERM for {waited} and were killed)" in outcome.summary
        assert server.registered(9011) is None
    finally:
        if psutil.pid_exists(stubborn.pid) and stubborn.poll() is None:
            stubborn.kill()
