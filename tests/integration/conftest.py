"""Real vLLM on the CPU: servers are shared, because each start costs about a minute here."""

import psutil
import pytest

from servebook import params, server

pytestmark = pytest.mark.integration

SHARED_PORT = 8131


def config(port: int, **kw) -> server.ServerConfig:
    values = dict(
        model="builtin:tiny-qwen3-moe",
        served_model_name="",
        port=port,
        max_model_len=1024,
        enforce_eager=True,
        cpu_kv_cache_gib=1,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    values.update(kw)
    return server.ServerConfig.from_params(params.Params(**values), "cpu")


def ours_left(pgid: int) -> list[str]:
    return [server.describe(p) for p in server.group_members(pgid)]


def vllm_titles() -> list[str]:
    found = []
    for proc in psutil.process_iter():
        try:
            if " ".join(proc.cmdline()).startswith("VLLM::"):
                found.append(server.describe(proc))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """One embedded server for the tests that only talk to it."""
    cfg = config(SHARED_PORT)
    launched = server.launch(cfg, tmp_path_factory.mktemp("shared"), stop_leftovers=True, log=print)
    yield launched
    server.stop(port=SHARED_PORT)
    assert ours_left(launched.pgid) == []
