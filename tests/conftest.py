import os

import pytest

# No test may reach a hub: hub lookups fail fast instead of waiting on a network that is not there.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def fake_nvml(monkeypatch):
    """Select a fake NVML scenario for the code under test (the only thing tests may fake)."""

    def use(name: str) -> None:
        monkeypatch.setenv("SERVEBOOK_FAKE_NVML", name)

    return use
