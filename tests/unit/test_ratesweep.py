"""Open-loop arrivals and the rate sweep's verdicts, on drawn schedules and hand-built timelines."""

import numpy as np
import pytest

from servebook import loadgen, metrics, ratesweep
from servebook.loadgen import RequestRecord


@pytest.mark.parametrize(
    "kind, burstiness, cv",
    [("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5), ("constant", 1.0, 0.0)],
)
def test_inter_arrival_gaps_have_the_rate_and_the_spread_vllm_defines(kind, burstiness, cv):
    """Mean gap 1/rate; coefficient of variation 1/sqrt(burstiness) for gamma (1 for Poisson, 0 for constant)."""
    offsets = np.array(loadgen.arrival_offsets(20_000, 8.0, kind, burstiness, seed=3))
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, abs=0.05)


def test_the_same_seed_draws_the_same_schedule_and_bad_rates_are_refused():
    assert loadgen.arrival_offsets(50, 2.0, seed=7) == loadgen.arrival_offsets(50, 2.0, seed=7)
    assert loadgen.arrival_offsets(50, 2.0, seed=7) != loadgen.arrival_offsets(50, 2.0, seed=8)
    with pytest.raises(ValueError, match="positive"):
        loadgen.arrival_offsets(10, 0.0)


def timeline(sends, ends):
    out = []
    for i, (s, e) in enumerate(zip(sends, ends)):
        r = RequestRecord(index=i, level="r", warmup=False, arrival=s, send=s, expected_output=2)
        r.first_chunk, r.end, r.chunk_times, r.chunk_tokens, r.completion_tokens = s + 0.05, e, [s + 0.05, e], [1, 1], 2
        out.append(r)
    return out


def level_for(sends, ends, rate, cfg=None):
    cfg = cfg or ratesweep.RateSweepConfig(rates=[rate])
    recs = timeline(sends, ends)
    offsets = [s - sends[0] for s in sends]
    return ratesweep._level(rate, offsets, metrics.summarize(recs, cfg.objectives), recs, {}, cfg)


def test_a_server_that_keeps_up_completes_at_the_offered_rate():
    sends = [i * 0.5 for i in range(20)]  # 2 requests/s
    lv = level_for(sends, [s + 0.3 for s in sends], 2.0)
    assert lv.offered_rate == pytest.approx(2.0) and lv.achieved_rate == pytest.approx(2.0)
    assert lv.kept_up and lv.verdict.startswith("kept up")
    straggler = level_for(sends, [s + (3.0 if i == 19 else 0.3) for i, s in enumerate(sends)], 2.0)
    assert straggler.kept_up  # one slow last request is not a queue


def test_completions_that_bunch_never_read_as_more_completed_than_offered():
    """Issue #41 point 5: 8 requests whose answers came back closer together than they were sent."""
    sends = [0.0, 0.1, 0.5, 0.6, 0.7, 1.0, 1.1, 1.2]
    lv = level_for(sends, [1.3 + 0.02 * i for i in range(8)], 6.0)
    assert lv.kept_up and lv.achieved_rate >= lv.offered_rate
    assert lv.verdict.startswith("kept up: every request completed as offered") and " of " not in lv.verdict


def test_a_server_past_its_capacity_is_recorded_as_falling_behind_not_as_failing():
    sends = [i * 0.1 for i in range(20)]  # 10 requests/s offered, one served every 0.25 s
    lv = level_for(sends, [1.0 + i * 0.25 for i in range(20)], 10.0)
    assert lv.achieved_rate < 5.0 and not lv.kept_up and lv.failed == 0
    assert "could not keep up" in lv.verdict and "of 10.00 offered" in lv.verdict


def test_a_window_answered_in_one_late_batch_did_not_keep_up():
    """CI's 2-core server at 200 requests/s: every request came back 3-5 s after it went out, all within the last
    seconds; their latencies shrink across the window, but the completions came back at a third of the rate."""
    sends = [i * 0.005 for i in range(400)]  # 200 requests/s for 2 s
    ends = [4.0 + i * 0.008 for i in range(400)]  # answered together from 4 s on
    lv = level_for(sends, ends, 200.0)
    assert not lv.kept_up and lv.achieved_rate < 0.9 * lv.offered_rate
    assert lv.achieved_rate <= lv.offered_rate  # never more completed than offered


def test_objectives_judge_the_share_of_requests_that_meet_them():
    sends = [i * 0.5 for i in range(10)]
    ends = [s + (2.0 if i in (3, 6) else 0.2) for i, s in enumerate(sends)]  # two slow requests of ten
    strict = ratesweep.RateSweepConfig(rates=[2.0], objectives=metrics.Objectives(e2el_ms=1000), goodput_target=0.9)
    lv = level_for(sends, ends, 2.0, strict)
    assert lv.goodput_share == pytest.approx(0.8) and lv.meets_objectives is False
    assert "80% of requests met every objective" in lv.verdict
    lenient = ratesweep.RateSweepConfig(rates=[2.0], objectives=metrics.Objectives(e2el_ms=1000), goodput_target=0.8)
    assert level_for(sends, ends, 2.0, lenient).meets_objectives is True


def test_a_rate_whose_tokens_reached_the_client_in_bursts_says_so_in_its_verdict():
    sends = [i * 0.5 for i in range(20)]
    recs = timeline(sends, [s + 0.3 for s in sends])
    cfg = ratesweep.RateSweepConfig(rates=[2.0])
    summary, offsets = metrics.summarize(recs), [s - sends[0] for s in sends]
    burst = metrics.EngineClock(
        requests=20, vllm_requests=20, client_ttft_mean_ms=300.0, vllm_ttft_mean_ms=5.0,
        client_tpot_mean_ms=0.0, vllm_tpot_mean_ms=1.5,
    )  # fmt: skip
    lv = ratesweep._level(2.0, offsets, summary, recs, {}, cfg, clock=burst)
    assert lv.kept_up and lv.tpot_clock_gap_pct == pytest.approx(-100.0)
    assert lv.verdict.endswith(
        "the client's mean TPOT (0.0 ms) is -100 % off vLLM's own (1.5 ms): the API server delivered tokens late or "
        "in bursts"
    )
    steady = burst.model_copy(update={"client_tpot_mean_ms": 1.55})
    assert "vLLM's own" not in ratesweep._level(2.0, offsets, summary, recs, {}, cfg, clock=steady).verdict
    shared = burst.model_copy(update={"vllm_requests": 40})  # someone else's requests too: no comparison
    assert ratesweep._level(2.0, offsets, summary, recs, {}, cfg, clock=shared).tpot_clock_gap_pct is None


def test_every_window_has_a_stall_bound_from_the_window_before():
    """The window owns its stall policy: 30 s for a first window, ten times the slowest first token and gap after
    a measured one, never less than 30 s; a window without a bound cannot be made."""
    from servebook import client

    assert loadgen.WindowShape(concurrency=4, warmup=4, min_requests=8).stall_s == client.STALL.min_s == 30.0
    assert client.STALL.after(None, None) == 30.0
    assert client.STALL.after(4000.0, 500.0) == pytest.approx(45.0)
    with pytest.raises(ValueError, match="positive stall bound"):
        loadgen.WindowShape(concurrency=4, warmup=4, min_requests=8, stall_s=0)


def test_a_lost_request_says_where_in_its_exchange_it_was_lost():
    """What tells a server that dropped a stream from a connection the client reused too late, in the error a
    rate sweep counts."""
    streaming = RequestRecord(0, "r", False, 0.0, chunk_times=[1.0, 1.1, 1.2])
    assert loadgen._where_lost([200], streaming, 0) == "after the answer began: http 200, 3 chunks in"
    fresh = RequestRecord(1, "r", False, 0.0, new_connection=True)
    assert loadgen._where_lost([], fresh, 1) == "before any answer, on a new connection, sent 2 times"
    assert loadgen._where_lost([], RequestRecord(2, "r", False, 0.0), 0) == "before any answer, sent once"
