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
