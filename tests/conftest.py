import os

import pytest

# No test may reach a hub: hub lookups fail fast instead of waiting on a network that is not there.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def fake_nvml():
    """Answer the code under test's NVML calls from a scenario (NVML is the only thing tests may fake)."""
    from servebook import nvml

    from .support.fake_nvml import FakeNvml, load_scenario

    def use(name: str) -> None:
        scenario = load_scenario(name)
        nvml.use_backend(lambda: FakeNvml(scenario))

    yield use
    nvml.use_backend(None)


@pytest.fixture
def ctrl_c_after():
    """A real SIGINT to this process after some seconds, as a terminal's Ctrl-C (a real signal also wakes a thread
    blocked on a lock, which ``_thread.interrupt_main`` does not). Python's own handler is installed for it: a
    background job, as CI runs the tests, starts with SIGINT ignored."""
    import signal
    import threading

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers: list[threading.Timer] = []

    def arm(seconds: float) -> None:
        timers.append(threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)))
        timers[-1].start()

    yield arm
    for timer in timers:
        timer.cancel()
    signal.signal(signal.SIGINT, before)
