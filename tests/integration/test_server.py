"""Launch, reuse, refuse, fail and stop with real vLLM (no fake server)."""

import dataclasses
import socket
import subprocess
import sys
import time

import pytest

from servebook import client, modelspec, params, planner, server
from servebook.errors import LaunchError, ParamsError, PreflightError

from .conftest import SHARED_PORT, config, vllm_titles

pytestmark = pytest.mark.integration


def test_good_launch_is_ready_and_passes_the_smoke_test(shared_server):
    assert not shared_server.reused and shared_server.started_by_this_run
    assert client.health(shared_server.url) == "ready"
    v = shared_server.values
    # 1 GiB / (2 layers x 2 (K and V) x 2 KV heads x 32 head_dim x 2 bytes), as GUIDE.md section 3 computed
    assert v.kv_cache_tokens == 2**30 // (2 * 2 * 2 * 32 * 2)
    assert v.max_concurrency_context == 1024
    assert {"loading_model", "kv_cache", "ready"} <= set(shared_server.phases)
    # the planner predicts what vLLM itself computed
    spec = modelspec.load(shared_server.config.model_path)
    cpu = planner.Device("CPU", 1, 0, 0.0, kind="cpu", cpu_kv_bytes=2**30)
    plan = planner.plan(spec, cpu, max_model_len=1024)
    assert plan.find(planner.Parallelism()).max_kv_tokens == v.kv_cache_tokens
    result = client.smoke_test(shared_server.config.target(), max_tokens=16)
    assert result.passed, result.checks
    assert result.stream.completion_tokens == 16 and result.stream.ttft_ms > 0
    # the decode figure is vLLM's own clock for this request, not the delivery's (bursts on a starved API server)
    s = result.stream
    assert s.vllm_tpot_ms and s.decode_tok_s == pytest.approx(1000 / s.vllm_tpot_ms)
    assert s.delivery_bound == (abs(s.client_decode_tok_s / s.decode_tok_s - 1) > 0.25)
    assert len(server.group_members(shared_server.pgid)) >= 2  # API server and engine core


def test_the_watchdog_gets_a_token_from_a_live_server(shared_server):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "servebook.cli", "watchdog", "--url", shared_server.url, "--timeout", "60"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0 and "a token came back" in done.stdout, done.stdout + done.stderr


def test_same_parameters_reuse_the_running_server(shared_server, tmp_path):
    again = server.launch(config(SHARED_PORT), tmp_path, log=print)
    assert again.reused and not again.started_by_this_run
    assert again.pid == shared_server.pid


def test_a_different_configuration_on_our_port_is_refused(shared_server, tmp_path):
    with pytest.raises(
        PreflightError,
        match=f"port {SHARED_PORT} is held by a servebook server with a different configuration"
        r": --max-model-len \d+ → 512 \(pid",  # what differs, so the person knows what their edit changed
    ):
        server.launch(config(SHARED_PORT, max_model_len=512), tmp_path, log=print)


def test_misspelled_flag_is_rejected_with_vllms_message_before_launch(tmp_path):
    before = set(vllm_titles())
    start = time.monotonic()
    with pytest.raises(PreflightError) as exc:
        server.launch(config(8132, extra_args=["--enable-pcie-oneshot-allreduce"]), tmp_path, log=print)
    print(f"bad flag reported in {time.monotonic() - start:.2f} s")
    assert "vllm serve: error: unrecognized arguments: --enable-pcie-oneshot-allreduce" in str(exc.value)
    with pytest.raises(PreflightError) as exc:
        server.launch(config(8132, extra_args=["--max-num-active-seqs", "many"]), tmp_path, log=print)
    assert "argument --max-num-active-seqs: Value many cannot be converted to <class 'int'>" in str(exc.value)
    # a flag a parameter owns is refused as such before vLLM's parser runs: the params would describe another server;
    # the params refuse it, and so does the launch of a configuration built past them (an A/B variant's flags)
    owned = "extra_args sets --max-num-seqs, which the parameter max_num_seqs owns"
    with pytest.raises(ParamsError, match=owned):
        params.validate({"model": "builtin:tiny-qwen3-moe", "extra_args": ["--max-num-seqs", "8"]})
    with pytest.raises(PreflightError, match=owned):
        server.launch(dataclasses.replace(config(8132), extra_args=["--max-num-seqs", "8"]), tmp_path, log=print)
    assert set(vllm_titles()) == before and server.registered(8132) is None
    assert not list(tmp_path.glob("server*.log"))


def test_removed_vllm_variable_is_rejected(tmp_path):
    with pytest.raises(PreflightError, match="VLLM_USE_V1.*only the V1 engine"):
        server.launch(config(8132, extra_env={"VLLM_USE_V1": "1"}), tmp_path, log=print)


def test_port_held_by_a_foreign_process_names_the_holder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-m", "http.server", "8133", "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(50):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", 8133)) == 0:
                    break
            time.sleep(0.1)
        with pytest.raises(PreflightError) as exc:
            server.launch(config(8133), tmp_path, stop_leftovers=True, log=print)
        text = str(exc.value)
        assert f"port 8133 on 127.0.0.1 is held by pid {holder.pid}" in text and "http.server" in text
        assert holder.poll() is None  # never touched, even with stop_leftovers
    finally:
        holder.terminate()
        holder.wait()


def test_a_crash_during_start_reports_the_root_cause_and_leaves_nothing(tmp_path):
    # The parser accepts it; vLLM refuses it when it reads the model's config.
    with pytest.raises(LaunchError) as exc:
        server.launch(config(8134, max_model_len=100_000), tmp_path, log=print)
    err = exc.value
    assert "max_model_len" in err.cause and "100000" in err.cause
    assert err.log_tail and err.log_path.endswith("server.log")
    assert server.registered(8134) is None
    assert server.vllm_orphans() == []
