"""A hung engine (SIGSTOP on VLLM::EngineCore, while /health answers 200: vllm-project/vllm#39863) is named within a
minute in every kind of window and probe: the open-loop rate sweep, the A/B, the smoke test, a relaunch that would
reuse the server, a `servebook run` whose sweep meets it, and a launch whose engine stops while it loads. The
session's shared vLLM server on the CPU for the windows and the run, one more for the launch."""

import json
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from servebook import ab, client, loadgen, ratesweep, server
from servebook.errors import AbFailed, LaunchError, PreflightError, SmokeTestFailed

from .conftest import SHARED_PORT, config, ours_left
from .test_faults import Run, manifest_of

pytestmark = pytest.mark.integration
PORT = 8177  # the launch's own server
NAMED_WITHIN_S = 60.0


def engine_of(pgid: int):
    return next(p for p in server.group_members(pgid) if "EngineCore" in " ".join(p.cmdline()))


@contextmanager
def stopped(engine, after_s: float = 0.0):
    """The engine SIGSTOPped (``after_s`` seconds from now, in the background), and let go again on the way out."""
    timer = threading.Timer(after_s, lambda: engine.send_signal(signal.SIGSTOP))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if engine.is_running():
            engine.send_signal(signal.SIGCONT)


def timed(what, call):
    started = time.monotonic()
    try:
        return call(), time.monotonic() - started
    finally:
        print(f"{what}: {time.monotonic() - started:.1f} s")


@pytest.fixture
def running(shared_server):
    """The session's shared server, stopped and let go again by each test (each checks that it serves again)."""
    yield shared_server
    assert client.first_token(shared_server.config.target(timeout_s=60)) == ""


def test_a_rate_sweep_window_names_the_stall_and_stops(running, tmp_path):
    target = running.config.target(timeout_s=600)
    cfg = ratesweep.RateSweepConfig(rates=[2.0, 4.0], workload=loadgen.Workload(32, 64), min_requests=16, warmup=1)
    with stopped(engine_of(running.pgid), after_s=3.0):
        result, seconds = timed(
            "rate sweep", lambda: ratesweep.sweep_rates(target, running.config.model_path, cfg, tmp_path, log=print)
        )
    assert seconds < NAMED_WITHIN_S + 3
    assert "stopped producing tokens" in result.fault and "servebook status" in result.fault
    assert result.stop_reason.startswith("server fault") and not result.levels[-1].kept_up
    assert "stalled" in result.levels[-1].verdict


def test_an_ab_window_names_the_stall(running):
    target = running.config.target(timeout_s=600)
    maker = loadgen.PromptMaker(loadgen.load_tokenizer(running.config.model_path))
    plan = ab.AbPlan(workload=loadgen.Workload(32, 256), concurrencies=[4], requests=64, repeats=1)
    with stopped(engine_of(running.pgid), after_s=2.0), pytest.raises(AbFailed, match="stopped producing tokens"):
        timed("A/B window", lambda: ab.measure(target, maker, plan))


def test_the_smoke_test_and_a_reusing_launch_name_a_hung_engine(running):
    target = running.config.target(timeout_s=120)
    with stopped(engine_of(running.pgid)):
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(SmokeTestFailed, match="produced no token"):
            client.smoke_test(target)
        assert time.monotonic() - started < NAMED_WITHIN_S
        started = time.monotonic()
        with pytest.raises(PreflightError, match=r"hung engine: .*EngineCore.* stopped"):
            server.preflight(running.config)  # same configuration: it would be reused, were it not hung
        assert time.monotonic() - started < 5
    assert client.first_token(target) == ""  # let go, it serves again


def test_a_hung_engine_is_named_within_a_minute_while_health_answers(running, tmp_path):
    """`servebook run` through launch (which finds the shared server with its own configuration and reuses it) and
    the benchmark; mid-sweep the engine is SIGSTOPped while /health still answers 200: `servebook status` says the
    server is hung, and the benchmark fails naming the stall instead of waiting out 600-s request timeouts. The run
    leaves the server it did not start running."""
    run = Run(tmp_path, "--set", f"port={SHARED_PORT}", "--stages", "launch,benchmark")
    run.wait_for("concurrency    1 repeat 1")
    engine = engine_of(running.pgid)
    engine.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        time.sleep(2)
        (row,) = [r for r in server.status() if r.port == SHARED_PORT]
        assert row.health == "hung" and "EngineCore" in row.detail, row
        run.wait_for("the engine stopped producing tokens while /health answered ready", timeout_s=NAMED_WITHIN_S)
        print(f"the hang was named {time.monotonic() - stopped_at:.1f} s after the SIGSTOP")
        code = run.finish(timeout_s=150)
    finally:
        if engine.is_running():
            engine.send_signal(signal.SIGCONT)
    assert code != 0
    launch = json.loads((run.run_dir / "03_launch.json").read_text())
    assert launch["reused"] and not launch["started_by_this_run"], launch.get("reused")
    failed = [s for s in manifest_of(run)["stages"] if s["status"] == "failed"]
    assert failed and "SweepAborted" in failed[0]["error"] and "stopped producing tokens" in failed[0]["error"]
    assert server.registered(SHARED_PORT).pid == running.pid  # still ours to stop at the session's end


def test_a_launch_whose_engine_stops_while_loading_fails_naming_it(tmp_path):
    port = PORT
    outcome: dict[str, BaseException | float] = {}

    def launch() -> None:
        started = time.monotonic()
        try:
            server.launch(config(port), tmp_path, log=print)
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=launch)
    thread.start()
    engine = None
    deadline = time.monotonic() + 120
    while engine is None and time.monotonic() < deadline and thread.is_alive():
        record = server.registered(port)
        try:
            engine = engine_of(record.pgid) if record else None
        except StopIteration:
            time.sleep(0.5)
    assert engine is not None, outcome
    record = server.registered(port)
    try:
        engine.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        thread.join(timeout=NAMED_WITHIN_S)
        named_after = time.monotonic() - stopped_at
    finally:
        if engine.is_running():
            engine.send_signal(signal.SIGCONT)
        thread.join(timeout=120)
        server.stop(port=port)
    print(f"the stopped load was named {named_after:.1f} s after the SIGSTOP")
    assert isinstance(outcome.get("error"), LaunchError), outcome
    assert "EngineCore" in str(outcome["error"]) and "stopped" in str(outcome["error"])
    assert named_after < NAMED_WITHIN_S
    assert ours_left(record.pgid) == []
