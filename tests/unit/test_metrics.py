"""Metric definitions on hand-built timelines."""

import json

import pandas as pd
import pytest

from servebook import bench, client, levels, limits, loadgen, metrics, plots, results, server
from servebook.errors import ServebookError
from servebook.loadgen import RequestRecord
from servebook.planner import Parallelism
from servebook.records import BenchmarkRecord, LaunchRecord
from servebook.stages import benchmark


def rec(send, chunks, tokens, *, prompt=10, warmup=False, error="", arrival=None, expected_output=None):
    r = RequestRecord(
        index=0,
        level="t",
        warmup=warmup,
        arrival=send if arrival is None else arrival,
        send=send,
        expected_input=10,
        expected_output=expected_output if expected_output is not None else sum(tokens),
    )
    if not error:
        r.chunk_times, r.chunk_tokens = list(chunks), list(tokens)
        r.first_chunk, r.end = chunks[0], chunks[-1]
        r.prompt_tokens, r.completion_tokens = prompt, sum(tokens)
    r.error = error
    return r


def test_single_request_definitions():
    r = rec(10.0, [10.2, 10.3, 10.5], [1, 1, 1])
    assert metrics.ttft(r) == pytest.approx(0.2)
    assert metrics.e2el(r) == pytest.approx(0.5)
    assert metrics.tpot(r) == pytest.approx((0.5 - 0.2) / 2)
    assert metrics.itl_per_chunk(r) == pytest.approx([0.1, 0.2])


def test_chunks_carrying_several_tokens():
    # 1 token at 0.1 s, then a chunk of 3 tokens 0.3 s later, then 2 tokens 0.1 s later: 6 tokens
    r = rec(0.0, [0.1, 0.4, 0.5], [1, 3, 2])
    assert metrics.output_tokens(r) == 6
    assert metrics.tpot(r) == pytest.approx((0.5 - 0.1) / 5)
    assert metrics.itl_per_chunk(r) == pytest.approx([0.3, 0.1])  # what vLLM reports: one value per chunk
    assert metrics.itl_per_token(r) == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05])
    assert sum(metrics.itl_per_token(r)) == pytest.approx(0.4)


def test_one_token_outputs_have_no_tpot():
    assert metrics.tpot(rec(0.0, [0.1], [1])) is None


def test_summary_throughput_goodput_and_failures():
    records = [
        rec(0.0, [0.05], [1], warmup=True),  # excluded
        rec(1.0, [1.1, 1.3], [1, 3]),  # ttft 0.1, tpot 0.2/3, e2el 0.3
        rec(1.0, [1.4, 1.5], [1, 1], arrival=0.5),  # waited 0.5 s for a slot; ttft 0.4, e2el 0.5
        rec(1.2, [], [], error="http 500: boom"),
        rec(1.2, [], [], error="timeout: no complete answer"),
    ]
    s = metrics.summarize(records, metrics.Objectives(ttft_ms=200))
    assert s.requests == 4 and s.completed == 2 and s.failed == 2
    assert s.errors == {"http 500": 1, "timeout": 1}
    assert s.duration_s == pytest.approx(0.5)  # first send 1.0 to last response 1.5
    assert s.output_tokens == 6 and s.input_tokens == 20
    assert s.output_throughput == pytest.approx(12.0)
    assert s.total_throughput == pytest.approx(52.0)
    assert s.request_throughput == pytest.approx(4.0)
    assert s.ttft_ms.p50 == pytest.approx(250)  # latencies are reported in milliseconds
    assert s.ttft_ms.p50_all is None  # half the requests failed: the median request never answered
    assert s.goodput == pytest.approx(2.0)  # one request of four met TTFT <= 200 ms, over 0.5 s
    assert s.goodput_share == pytest.approx(0.25)
    assert s.client_queue_ms.p50 == pytest.approx(0.0) and s.client_queue_ms.p99 > 400
    assert s.itl_ms.p50 == pytest.approx(150)
    row = s.flat()  # the table row: one unit per quantity, named in the column
    assert row["ttft_p50_ms"] == pytest.approx(250) and row["errors"] == "http 500: 1, timeout: 1"


def test_percentiles_interpolate_like_numpy():
    p = metrics.percentiles([0.001, 0.002, 0.003, 0.004])  # seconds in, milliseconds out
    assert p.p50 == pytest.approx(2.5) and p.p90 == pytest.approx(3.7) and p.mean == pytest.approx(2.5)
    assert p.p50_all is None


def test_failed_requests_count_as_infinitely_slow():
    p = metrics.percentiles([0.1, 0.2, 0.4], failed=1)
    assert p.p50 == pytest.approx(200)
    assert p.p50_all == pytest.approx(400)  # [0.1, 0.2, 0.4, inf]: the median moves up
    assert p.p90_all is None and p.p99_all is None  # those are the failure


def test_length_checks_flag_ignored_max_tokens():
    short = rec(0.0, [0.1, 0.2], [1, 1], expected_output=4)
    longer_prompt = rec(0.0, [0.1, 0.2], [1, 1], prompt=12)
    assert metrics.length_mismatches([short, longer_prompt]) == metrics.LengthMismatches(input=1, output=1, checked=2)


def test_plateau_rule():
    assert not limits.plateau_reached([100, 190], 0.05)
    assert not limits.plateau_reached([100, 190, 360], 0.05)
    assert limits.plateau_reached([100, 190, 360, 370, 372], 0.05)  # 360 -> 372 over two doublings: 3 %
    assert not limits.plateau_reached([100, 190, 360, 370, 390], 0.05)  # 8 % over two doublings
    assert limits.plateau_level([1, 2, 4, 8, 16], [100, 190, 360, 370, 372], 0.05) == 4


def test_a_plateau_inside_its_levels_noise_does_not_stop_the_sweep():
    """The main job on two CPU cores: 2, 4 and 8 streams read 620, 651 and 523 tok/s (medians of three repeats 34 to
    57 % apart) and the sweep stopped on a "plateau" that each level's own line called noise."""
    cfg = levels.SweepConfig(plateau_gain=0.05)

    def sweep(spreads):
        return [
            _level(c, output_throughput=t, output_throughput_min=t * (1 - s / 200), output_throughput_max=t * (1 + s / 200),
                   spread_pct=s, repeats=3)
            for c, t, s in zip([1, 2, 4, 8], [420.5, 620.4, 650.6, 522.9], spreads)
        ]  # fmt: skip

    noisy = sweep([5.0, 5.0, 88.0, 98.0])
    assert limits.plateau_reached([lv.output_throughput for lv in noisy], 0.05)
    assert limits.unresolved_plateau(noisy, cfg) and limits.stop_rule(noisy, cfg) is None
    steady = sweep([5.0, 5.0, 4.0, 4.0])  # the same medians from tight repeats: a plateau (the decline is 2 repeats)
    stop = limits.stop_rule(steady, cfg)
    assert stop is not None and stop.by in ("plateau", "decline")
    flat = sweep([5.0, 5.0, 4.0, 4.0])
    flat[-1] = flat[-1].model_copy(update={"output_throughput": 640.0, "output_throughput_min": 627.0,
                                           "output_throughput_max": 653.0})  # fmt: skip
    flat_stop = limits.stop_rule(flat, cfg)
    assert flat_stop is not None and flat_stop.by == "plateau" and not limits.unresolved_plateau(flat, cfg)


def test_broken_objective_names_the_metric():
    level = levels.Level(
        concurrency=4,
        repeats=1,
        output_throughput=1,
        output_throughput_min=1,
        output_throughput_max=1,
        spread_pct=0,
        ttft_p50_ms=250,
        tpot_p50_ms=10,
        e2el_p50_ms=1000,
    )
    assert (
        limits.objective_broken(level, metrics.Objectives(ttft_ms=200))
        == "median TTFT 250 ms exceeds the 200 ms objective"
    )
    assert limits.objective_broken(level, metrics.Objectives(tpot_ms=20)) == ""


def run_row(concurrency: int, repeat: int, output_throughput: float, **fields) -> levels.RunRow:
    """A measured window as the sweep records it, with only the figures a test names."""
    clock = metrics.EngineClock(
        requests=0, vllm_requests=0, client_ttft_mean_ms=None, vllm_ttft_mean_ms=None, client_tpot_mean_ms=None,
        vllm_tpot_mean_ms=None,
    )  # fmt: skip
    summary = metrics.summarize([]).model_copy(update={"output_throughput": output_throughput})
    return levels.RunRow(
        concurrency=concurrency, repeat=repeat, summary=summary, server=levels.ServerCounters(), clock=clock,
        prefix_cache_reset="reset", client_cpu_pct=10.0, client_processes=1, **fields,
    )  # fmt: skip


def test_aggregate_reports_median_and_spread():
    rows = [run_row(4, rep, t) for rep, t in enumerate((90.0, 100.0, 110.0))]
    (level,) = levels.aggregate(rows)
    assert level.output_throughput == 100 and level.spread_pct == pytest.approx(20.0)
    assert level.client_cpu_pct == 10.0 and level.gpu is None


def test_a_levels_gpu_evidence_is_the_median_of_its_repeats_and_names_every_slowdown():
    from servebook.gpu_evidence import GpuEvidence

    seen = [
        GpuEvidence(samples=10, sm_util_mean_pct=40.0, pcie_peak_pct=80.0, pcie_link="Gen5 x16", slowdowns=[]),
        GpuEvidence(
            samples=12, sm_util_mean_pct=60.0, pcie_peak_pct=90.0, pcie_link="Gen5 x16", slowdowns=["power cap"]
        ),
    ]
    (level,) = levels.aggregate([run_row(8, rep, 1000.0, gpu=e) for rep, e in enumerate(seen)])
    assert level.gpu.sm_util_mean_pct == 50 and level.gpu.pcie_peak_pct == 85 and level.gpu.pcie_link == "Gen5 x16"
    assert level.gpu.slowdowns == ["power cap"] and level.gpu_samples == [10, 12]
    row = level.flat()  # the levels table keeps its columns
    assert row["gpu_sm_util_pct"] == 50 and row["gpu_slowdowns"] == "power cap" and row["gpu_samples"] == "10, 12"


def test_crossover_between_two_layouts():
    tp2 = pd.DataFrame({"concurrency": [1, 2, 4, 8, 16], "output_throughput": [90, 170, 300, 420, 450]})
    tp8 = pd.DataFrame({"concurrency": [1, 2, 4, 8, 16], "output_throughput": [80, 150, 290, 480, 800]})
    assert plots.crossover(tp2, tp8) == 8
    assert plots.crossover(tp2, tp2 * 0 + tp2.assign(output_throughput=tp2.output_throughput + 1)) is None


def test_compare_labels_layouts_and_finds_the_crossover(tmp_path):
    def run(name, layout, tps):
        d = tmp_path / name
        d.mkdir()
        cfg = server.ServerConfig(model="m", model_path="/m", served_model_name="m", device="cuda", **layout)
        results.write(d, LaunchRecord.planned(cfg))
        measured = [
            levels.Level(
                concurrency=c,
                repeats=1,
                output_throughput=tp,
                output_throughput_min=tp,
                output_throughput_max=tp,
                spread_pct=0,
                per_user_tok_s=u,
                ttft_p50_ms=ms,
            )
            for c, tp, u, ms in zip([1, 2, 4, 8], tps, [80, 70, 60, 40], [50, 60, 80, 200])
        ]
        results.write(
            d,
            BenchmarkRecord(
                url="",
                model="m",
                workload=loadgen.Workload(),
                max_concurrency=8,
                repeats=1,
                plateau_gain=0.05,
                objectives=metrics.Objectives(),
                levels=measured,
                runs=[],
                stopped_by="max_concurrency",
                stop_reason="",
                fault="",
                plateau_concurrency=None,
                last_gain=None,
                best=None,
                single_stream=None,
                length_mismatches=metrics.LengthMismatches(),
                warnings=[],
                tables={},
            ),
        )
        return d

    a = run("tp2", dict(layout=Parallelism(tp=2, dp=4, ep=True)), [90, 170, 300, 420])
    b = run("tp8", dict(layout=Parallelism(tp=8, ep=True)), [80, 150, 320, 600])
    fig, crossings = plots.compare([benchmark.load_run(a), benchmark.load_run(b)])
    assert crossings == [plots.Crossing("TP=2+DP=4+EP (tp2)", "TP=8+EP (tp8)", 4)]
    assert len(fig.data) == 6
    # each run keeps its legend's colour in every panel
    for name in {t.name for t in fig.data}:
        assert len({t.line.color for t in fig.data if t.name == name}) == 1
    assert len({t.line.color for t in fig.data}) == 2
    assert plots.workload_warning({"a": benchmark.workload_of(a), "b": benchmark.workload_of(b)}) == ""


def test_compare_warns_when_the_runs_sent_different_requests():
    warning = plots.workload_warning({"short": (128, 128), "long": (2048, 128), "unknown": None})
    assert "the runs sent different requests" in warning and "long: 2048 in / 128 out" in warning
    assert plots.workload_warning({"a": (128, 128), "b": (130, 126)}) == ""  # within 10 %


def test_compare_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(ServebookError, match="holds no 05_benchmark.json and no `vllm bench serve` result"):
        benchmark.load_run(tmp_path)
    with pytest.raises(ServebookError, match="no such file or folder"):
        benchmark.load_run(tmp_path / "typo")


def test_compare_says_what_a_run_without_a_benchmark_ran(tmp_path):
    """A run folder whose run ended before the benchmark, named as such rather than as a stray JSON file."""
    from servebook import params, runner

    ci = runner.repo_root() / "params" / "ci.yaml"
    manifest = runner._manifest(params.load(ci, []), ci, [], tmp_path)
    manifest.status = "failed"
    manifest.stages = [results.StageRun(name="04_smoke_test", status="failed", error="MissingRecord")]
    (tmp_path / "manifest.json").write_text(manifest.model_dump_json())
    with pytest.raises(ServebookError, match=r"a servebook run without a benchmark \(failed: 04_smoke_test failed\)"):
        benchmark.load_run(tmp_path)


def stream(events):
    """A request's timeline from (time, event) pairs, sent at t=0."""
    r = RequestRecord(index=0, level="", warmup=False, arrival=0.0, send=0.0, expected_output=4)
    for now, event in events:
        loadgen.apply_event(r, event, now)
    return r


def usage(done):
    return {"prompt_tokens": 8, "completion_tokens": done, "total_tokens": 8 + done}


def test_ttft_counts_a_chunk_with_empty_text_as_vllms_benchmark_does():
    # the first token decodes to half a UTF-8 character: its chunk carries choices with empty text
    r = stream(
        [
            (0.10, {"choices": [{"text": ""}], "usage": usage(1)}),
            (0.12, {"choices": [{"text": "é"}], "usage": usage(2)}),
            (0.14, {"choices": [{"text": "a"}], "usage": usage(3)}),
            (0.16, {"choices": [{"text": "b", "finish_reason": "length"}], "usage": usage(4)}),
            (0.17, {"choices": [], "usage": usage(4)}),
        ]
    )  # usage-only: counts, never timing
    assert r.ok and metrics.ttft(r) == pytest.approx(0.10) and metrics.e2el(r) == pytest.approx(0.16)
    assert metrics.tpot(r) == pytest.approx(0.02) and r.chunk_tokens == [1, 1, 1, 1]
    assert metrics.itl_per_chunk(r) == pytest.approx([0.02, 0.02, 0.02])


def test_chat_role_only_chunk_starts_the_clock_like_vllm():
    r = stream(
        [
            (0.05, {"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": usage(0)}),
            (0.10, {"choices": [{"delta": {"content": "x"}}], "usage": usage(1)}),
            (0.20, {"choices": [{"delta": {"content": "y"}}], "usage": usage(2)}),
        ]
    )
    assert metrics.ttft(r) == pytest.approx(0.05) and r.chunk_tokens == [0, 1, 1]


def test_a_stream_of_only_empty_text_tokens_is_a_success_not_a_failure():
    r = stream([(0.1 * i, {"choices": [{"text": ""}], "usage": usage(i)}) for i in range(1, 5)])
    assert r.first_chunk is not None and sum(r.chunk_tokens) == 4 and r.completion_tokens == 4


def test_without_usage_on_every_chunk_the_final_count_settles_the_tokens():
    """vLLM's own benchmark asks for usage once, at the end; a chunk of several tokens (speculative decoding)
    is then counted when the stream closes, and the chat stream's role chunk counts none."""
    chat = stream(
        [
            (0.05, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
            (0.10, {"choices": [{"delta": {"content": "x"}}]}),
            (0.20, {"choices": [{"delta": {"content": "yz"}}]}),
            (0.21, {"choices": [], "usage": usage(4)}),
        ]
    )
    assert chat.chunk_tokens == [0, 1, 1]
    loadgen.finish_stream(chat)
    assert chat.ok and chat.chunk_tokens == [0, 1, 3] and metrics.ttft(chat) == pytest.approx(0.05)
    empty = stream([(0.1, {"choices": [], "usage": usage(0)})])
    loadgen.finish_stream(empty)
    assert not empty.ok and empty.error.startswith("empty")


def test_usage_only_stream_has_no_token_chunk():
    r = stream([(0.1, {"choices": [], "usage": usage(0)})])
    assert r.first_chunk is None and r.chunk_times == []


def level(c, tp, low=None, high=None):
    return levels.Level(
        concurrency=c,
        repeats=2,
        output_throughput=tp,
        output_throughput_min=low or tp,
        output_throughput_max=high or tp,
        spread_pct=0,
    )


def test_a_decline_past_the_best_level_ends_the_sweep():
    # the H200 story: 21,028 tok/s at 128 streams, 13,487 at 256
    measured = [level(64, 15000), level(128, 21028), level(256, 13487, 13000, 14000)]
    assert limits.declined(measured, 0.05).concurrency == 128
    # a noisy level whose best repeat reaches the peak is not a decline
    assert limits.declined([level(8, 937), level(16, 917, 450, 1380)], 0.05) is None
    assert limits.declined([level(1, 100)], 0.05) is None


def test_spread_is_range_over_median_and_needs_two_runs():
    from servebook.levels import spread_pct

    assert spread_pct([100.0]) is None
    assert spread_pct([90.0, 110.0]) == pytest.approx(20.0)
    assert spread_pct([13_487.0, 21_028.0, 20_000.0]) == pytest.approx(100 * 7_541 / 20_000)


def test_a_level_window_is_sized_for_its_seconds_at_the_expected_rate():
    from servebook.levels import SweepConfig

    cfg = SweepConfig(prompts_per_level=64, min_level_s=20.0)
    assert cfg.prompts_for(16, None) == 64  # nothing known yet: the count alone
    assert cfg.prompts_for(16, 60.0) == 2400  # 20 s at twice the 60 requests/s expected
    assert cfg.prompts_for(256, 0.1) == 1024  # never under 4 per stream
    assert SweepConfig(prompts_per_level=64).prompts_for(16, 60.0) == 64  # no seconds asked: the count


def _level(concurrency, **kw):
    base = dict(repeats=2, output_throughput=1000.0, output_throughput_min=990.0, output_throughput_max=1010.0,
                spread_pct=2.0)  # fmt: skip
    return levels.Level(concurrency=concurrency, **{**base, **kw})


@pytest.mark.parametrize(
    "level, gain, kind, words",
    [
        (_level(256, client_cpu_pct=97.0, running_peak=256, waiting_peak=0), 0.01, "client", "97 % of a core"),
        (
            _level(16, running_peak=4, waiting_peak=12, client_cpu_pct=20.0),
            0.0,
            "batch",
            "max_num_seqs=4: 4 running, 12 waiting",
        ),
        (
            _level(64, kv_cache_usage_peak=0.99, running_peak=40, waiting_peak=24),
            -0.1,
            "kv_cache",
            "99% used, 24 waiting",
        ),
        (
            _level(64, kv_cache_usage_peak=0.6, running_peak=64, waiting_peak=3, preemptions=5.0),
            0.0,
            "kv_cache",
            "5 preemptions",
        ),
        (_level(32, running_peak=32, waiting_peak=0, client_cpu_pct=40.0), 0.02, "server", "32 of 32 streams"),
        (_level(8, running_peak=8, waiting_peak=0), 0.8, "rising", "still rising"),
        (_level(256, running_peak=256, waiting_peak=0), -0.51, "decline", "client's CPU was not measured"),
        (_level(1, running_peak=1), None, "rising", "first level"),
    ],
)
def test_what_limits_a_level(level, gain, kind, words):
    """Each rule on hand-built evidence; the client is judged first, then the batch, the KV cache, the gain."""
    got_kind, text = limits.limit_of(level, gain, levels.SweepConfig(max_num_seqs=4 if kind == "batch" else 1024))
    assert got_kind == kind and words in text


def test_levels_are_labelled_against_the_level_before():
    measured = [
        _level(1, output_throughput=100.0),
        _level(2, output_throughput=190.0),
        _level(4, output_throughput=192.0),
    ]
    limits.label_limits(measured, levels.SweepConfig(plateau_gain=0.05))
    assert [lv.limit_kind for lv in measured] == ["rising", "rising", "server"]


def vllm_events(chat: bool):
    """A stream as vLLM 0.32 sends it (compact JSON; usage once, at the end), as raw server-sent events."""

    def chunk(piece, usage=None, finish=None):
        choice = ({"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}) | {
            "logprobs": None,
            "finish_reason": finish,
        }
        return {"id": "x", "object": "chunk", "created": 1, "model": "m", "choices": [choice], "usage": usage}

    events = [chunk("é"[:0]), chunk("ab"), chunk("c", finish="length")]
    if chat:
        role = chunk("")
        role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        events.insert(0, role)
    events.append({"id": "x", "object": "chunk", "created": 1, "model": "m", "choices": [], "usage": usage(3)})
    return [b"data: " + json.dumps(e, separators=(",", ":")).encode() for e in events] + [b"data: [DONE]"]


@pytest.mark.parametrize("chat", [False, True])
def test_the_fast_path_times_a_stream_exactly_as_parsing_every_event_does(chat):
    """Token chunks are timed unparsed; usage, role and error events still parsed: the same timeline either way."""
    fast, full = (RequestRecord(index=0, level="", warmup=False, arrival=0.0) for _ in range(2))
    done = []
    for i, raw in enumerate(vllm_events(chat)):
        done.append(loadgen.fold_event(fast, raw, 0.1 * (i + 1), [], parse_all=False))
        loadgen.fold_event(full, raw, 0.1 * (i + 1), [], parse_all=True)
    loadgen.finish_stream(fast), loadgen.finish_stream(full)
    assert done[-1] and not any(done[:-1])
    assert fast.chunk_times == full.chunk_times and fast.chunk_tokens == full.chunk_tokens
    assert (fast.first_chunk, fast.end, fast.completion_tokens) == (full.first_chunk, full.end, 3)
    assert sum(fast.chunk_tokens) == 3 and fast.chunk_tokens[0] == (0 if chat else 1)
    error = RequestRecord(index=0, level="", warmup=False, arrival=0.0)
    loadgen.fold_event(error, b'data: {"error":{"message":"boom"}}', 0.1, [], parse_all=False)
    assert error.error == "stream error: {'message': 'boom'}"


def _vllm_metrics(requests: int, ttft_s: float, tpot_s: float) -> dict[str, float]:
    """/metrics as vLLM prints its histograms (labels per engine and model), parsed as servebook reads them."""
    lines = []
    for name, total in (
        ("vllm:time_to_first_token_seconds", requests * ttft_s),
        ("vllm:request_time_per_output_token_seconds", requests * tpot_s),
    ):
        lines += [
            f'{name}_bucket{{engine="0",le="+Inf",model_name="m"}} {float(requests)}',
            f'{name}_count{{engine="0",model_name="m"}} {float(requests)}',
            f'{name}_sum{{engine="0",model_name="m"}} {total}',
        ]
    return client.parse_metrics("\n".join(lines))


def test_engine_clock_sets_the_clients_means_beside_vllms_over_the_same_requests():
    # two streamed requests, warm-up included: vLLM counts it too
    records = [rec(0.0, [0.05, 0.06, 0.07], [1, 1, 1], warmup=True), rec(0.1, [0.16, 0.17, 0.18], [1, 1, 1])]
    before = _vllm_metrics(5, 0.01, 0.01)
    after = _vllm_metrics(7, 0.0, 0.0)  # cumulative: add the window's two requests to the sums
    after["vllm:time_to_first_token_seconds_sum"] = before["vllm:time_to_first_token_seconds_sum"] + 2 * 0.04
    after["vllm:request_time_per_output_token_seconds_sum"] = (
        before["vllm:request_time_per_output_token_seconds_sum"] + 2 * 0.01
    )
    clock = metrics.engine_clock(records, before, after)
    assert clock.same_requests and clock.vllm_requests == 2
    assert clock.vllm_ttft_mean_ms == pytest.approx(40.0)
    assert clock.client_ttft_mean_ms == pytest.approx(55.0)  # 15 ms of HTTP and streaming outside vLLM's clock
    assert clock.client_tpot_mean_ms == pytest.approx(10.0)
    assert clock.tpot_gap_pct == pytest.approx(0.0, abs=1e-6)


def test_tokens_delivered_in_one_burst_are_named_as_off_the_engines_clock():
    # CI's CPU-starved API server: every token of a request reached the client at once (client TPOT 0) while
    # the engine produced them 25 ms apart
    burst = [rec(0.0, [1.5, 1.5, 1.5, 1.5], [1, 1, 1, 1]) for _ in range(8)]
    before, after = _vllm_metrics(0, 0.0, 0.0), _vllm_metrics(8, 1.4, 0.025)
    clock = metrics.engine_clock(burst, before, after)
    assert clock.tpot_gap_pct == pytest.approx(-100.0)
    level = levels.Level(
        concurrency=8,
        repeats=1,
        output_throughput=20.0,
        output_throughput_min=20.0,
        output_throughput_max=20.0,
        spread_pct=None,
        **levels.clock_fields(clock),
    )
    warning = levels.clock_disagreements([level])
    assert "c=8 (0.0 against 25.0 ms, -100 %)" in warning and "API server" in warning
    kind, words = limits.limit_of(level, gain=0.0, cfg=levels.SweepConfig())
    assert kind == "api_server"
    assert "engine had the first token after 1400 ms and the rest 25.0 ms apart" in words
    assert "reached the client after 1500 ms and 0.0 ms apart" in words
    # while throughput still rises with the streams, the level is not yet limited by it (as for a GPU wall)
    assert limits.limit_of(level, gain=0.5, cfg=levels.SweepConfig())[0] == "rising"
    steady = level.model_copy(update={"client_tpot_mean_ms": 26.0, "tpot_clock_gap_pct": 4.0})
    assert levels.clock_disagreements([steady]) == ""
    assert limits.limit_of(steady, gain=0.0, cfg=levels.SweepConfig())[0] == "server"


def test_the_headline_never_shows_a_tpot_the_client_could_not_measure():
    """Issue #41 point 5: `TPOT p50 0.0 ms` in the report's headline, from tokens that came in one burst."""
    from servebook.stages.benchmark import headline_tpot

    burst = _level(1, tpot_p50_ms=0.0, vllm_tpot_mean_ms=11.4, tpot_clock_gap_pct=-99.0)
    assert headline_tpot(0.0, burst) == "TPOT 11.4 ms by vLLM's clock (tokens reached the client in bursts)"
    assert "not measurable by the client" in headline_tpot(0.01, None) and "0.0" not in headline_tpot(0.01, None)
    steady = _level(1, tpot_p50_ms=12.34, vllm_tpot_mean_ms=12.1, tpot_clock_gap_pct=2.0)
    assert headline_tpot(12.34, steady) == "TPOT p50 12.3 ms"


def test_a_busy_host_is_measured_apart_from_the_client_and_the_server(monkeypatch):
    """Issue #41 point 5: each window records what other processes took of the host's CPUs, and the sweep says so."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    import psutil

    from servebook import bench, server

    quiet = subprocess.Popen(["sleep", "30"], start_new_session=True)  # stands for the server's process group
    monkeypatch.setattr(server, "registered", lambda port: SimpleNamespace(pgid=quiet.pid))
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        time.sleep(0.3)
        host, started = bench.HostCpu("http://127.0.0.1:8000"), time.monotonic()
        time.sleep(1.5)
        others = host.others_pct(time.monotonic() - started)
    finally:
        burner.kill(), quiet.kill(), burner.wait(), quiet.wait()
    cores = psutil.cpu_count() or 1
    assert others is not None and others >= 50 / cores, (others, cores)  # one busy core of `cores`
    busy = _level(4, host_others_cpu_pct=40.0)
    said = bench.sweep_warnings([busy], metrics.LengthMismatches(), [], levels.SweepConfig())
    assert any("the host was busy" in w and "40 % of its CPUs at c=4" in w for w in said)
    monkeypatch.setattr(server, "registered", lambda port: None)  # a server servebook did not start: no split
    assert bench.HostCpu("http://127.0.0.1:8000").others_pct(1.0) is None


def test_an_interrupted_window_cancels_its_requests_rather_than_waiting_for_them(ctrl_c_after):
    """Ctrl-C (or the runner's interrupt of the stage) during a window ends it within seconds: its streams are
    cancelled and closed, not awaited (a window of long outputs at high concurrency runs for minutes)."""
    import asyncio
    import time

    closed: list[str] = []

    async def long_window() -> None:
        try:
            await asyncio.sleep(120)
        finally:
            closed.append("the window's streams")

    ctrl_c_after(0.5)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        loadgen._in_own_loop(long_window())
    assert time.monotonic() - began < 0.5 + loadgen.INTERRUPTED_WINDOW_WAIT_S
    assert closed == ["the window's streams"]


def test_interrupted_client_processes_are_stopped_rather_than_awaited(ctrl_c_after):
    """The sweep's client processes (``bench_client_processes``) are stopped at an interrupt, not left to finish
    their window."""
    import contextlib
    import multiprocessing
    import time

    import psutil

    ctrl_c_after(3.0)  # after the spawned processes started
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        loadgen._map_in_processes(multiprocessing.get_context("spawn"), time.sleep, [120, 120])
    assert time.monotonic() - began < 10

    def workers() -> list[psutil.Process]:  # not multiprocessing's resource tracker, which outlives every pool
        found = []
        for child in psutil.Process().children():
            with contextlib.suppress(psutil.Error):
                if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                    found.append(child)
        return found

    end = time.monotonic() + 5
    while time.monotonic() < end and workers():
        time.sleep(0.1)
    assert workers() == []


def test_no_stop_rule_ends_a_sweep_below_the_concurrency_another_stage_reuses():
    # stage 06's A/B reads the rehearsal's windows at ab_concurrency: on two CPU cores a baseline that "declined"
    # at 2 streams left none at 4, and the A/B restarted servers on the real weights instead
    curve = {1: (400, 390, 410), 2: (300, 290, 310), 4: (290, 280, 295), 8: (280, 275, 285), 16: (270, 265, 275)}

    def swept(reach: int, drop: str | None = None, rising: bool = False) -> tuple[str, list[int]]:
        sweep = object.__new__(bench._Sweep)
        sweep.cfg, sweep.levels, sweep.processes = levels.SweepConfig(max_concurrency=16, reach=reach), [], 1
        sweep.log, sweep.on_level, sweep.drop_when = (lambda _said: None), (lambda: None), (lambda _levels: drop)
        sweep.level = lambda c: level(c, 100 * c) if rising else level(c, *curve[c])
        return sweep.run().by, [lv.concurrency for lv in sweep.levels]

    assert swept(0) == ("decline", [1, 2])
    assert swept(8) == ("decline", [1, 2, 4, 8])  # the stop rules still decide, from the reach on
    assert swept(0, drop="behind the leader", rising=True) == ("dropped", [1])
    assert swept(4, drop="behind the leader", rising=True) == ("dropped", [1, 2, 4])
