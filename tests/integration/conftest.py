"""Real vLLM on the CPU: servers are shared, because each start costs about a minute here."""

import psutil
import pytest

from servebook import params, server, startplan, topology
from servebook.stages import launch as launch_stage

pytestmark = pytest.mark.integration

SHARED_PORT = 8131


def params_for(port: int, **kw) -> params.Params:
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
    return params.Params(**values)


def config(port: int, **kw) -> server.ServerConfig:
    """The server the launch stage would start for these params (its load path chosen), so that a `servebook run`
    on the same port finds it of the same configuration."""
    p = params_for(port, **kw)
    cfg = server.ServerConfig.from_params(p, "cpu")
    return startplan.with_load_choice(cfg, launch_stage.load_choice_for(p, cfg, None))


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
    """One embedded server for the tests that only talk to it, started and stopped as a one-server topology: its
    ``running()`` block stops it on the way out and verifies it gone."""
    p = params_for(SHARED_PORT, stop_leftovers=True)
    shape = topology.of(p, config(SHARED_PORT), tmp_path_factory.mktemp("shared"))
    with shape.running() as started:
        yield started.launch
    assert ours_left(started.launch.pgid) == [] and server.registered(SHARED_PORT) is None
