"""Bandwidth formulas, the gloo path of the micro-benchmark, and the noise-band verdict."""

import pandas as pd
import pytest

from servebook import ab, loadgen, nccl, params, rehearsal, results
from servebook.errors import ParamsError
from servebook.params import AbVariant
from servebook.planner import Parallelism
from servebook.records import RehearsalRecord
from servebook.stages import nccl_tuning


def test_bandwidth_as_nccl_tests_defines_it():
    # 256 MB all-reduce in 889.5 us on 2 GPUs: algbw 301.8 GB/s, busbw x 2(n-1)/n = x1
    assert nccl.algbw(268_435_456, 889.5e-6) == pytest.approx(301.78, rel=1e-3)
    assert nccl.busbw("all_reduce", 268_435_456, 889.5e-6, 2) == pytest.approx(301.78, rel=1e-3)
    assert nccl.busbw("all_reduce", 1e9, 1.0, 8) == pytest.approx(1.75)  # 2 x 7/8
    assert nccl.busbw("all_gather", 1e9, 1.0, 8) == pytest.approx(0.875)  # 7/8
    assert nccl.bus_factor("all_reduce", 1) == 0.0


def test_sizes_and_parsing():
    assert nccl.sizes(8192, 65536) == [8192, 16384, 32768, 65536]
    assert nccl.parse_size("8K") == 8192 and nccl.parse_size("256M") == 268_435_456
    with pytest.raises(ValueError):
        nccl.parse_size("lots")


def test_harmful_sets_are_flagged_against_the_baseline():
    def rows(bw_big, small_us):
        return [
            {"collective": "all_reduce", "bytes": 8192, "time_us": small_us, "algbw_gbs": 0, "busbw_gbs": 0.2},
            {"collective": "all_reduce", "bytes": 1 << 28, "time_us": 900, "algbw_gbs": bw_big, "busbw_gbs": bw_big},
        ]

    def result(name, env, ok, measured, error=""):
        return nccl.SetResult(
            name=name, env=env, ok=ok, rows=measured, info={}, error=error, confirmations=[], seconds=1
        )

    sets = [
        result("baseline", {}, True, rows(300, 40)),
        result("p2p_disable", {"NCCL_P2P_DISABLE": "1"}, True, rows(28, 42)),
        result("algo_ring", {"NCCL_ALGO": "Ring"}, True, rows(301, 39)),
        result("algo_tree", {"NCCL_ALGO": "Tree"}, False, [], "ranks exited with code 1"),
    ]
    summary = {(r.set, r.collective): r for r in nccl.summarize(sets)}
    assert summary[("p2p_disable", "all_reduce")].harmful == "busbw 28.0 vs 300.0 GB/s"
    assert summary[("algo_ring", "all_reduce")].harmful == ""
    assert summary[("algo_tree", "-")].harmful.startswith("failed: ranks exited")


def test_confirmations_come_from_ncclS_own_log():
    log = "vm:1:1 [0] NCCL INFO NCCL_PROTO set by environment to LL\nother line\n"
    assert nccl.confirmations(log, {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring"}) == [
        "vm:1:1 [0] NCCL INFO NCCL_PROTO set by environment to LL",
        "NCCL_ALGO: no NCCL log line mentions it",
    ]


def test_gloo_path_runs_without_gpus():
    result = nccl.run_all(nccl.Sweep("gloo", 2, 8192, 65536, 2, 1), ["baseline", "proto_ll"], log=lambda _: None)
    assert result.backend == "gloo" and [s.name for s in result.sets] == ["baseline"]
    rows = result.sets[0].rows
    assert {r.collective for r in rows} == {"all_reduce", "all_gather"} and len(rows) == 8
    assert all(
        r.time_us > 0 and r.busbw_gbs == pytest.approx(r.algbw_gbs * nccl.bus_factor(r.collective, 2)) for r in rows
    )


@pytest.mark.parametrize(
    "base, variant, noise, expected, apart",
    [
        ([100, 104], [110, 112], 0.04, "better", True),  # +8.7 % against a 4 % band
        ([100, 104], [103, 101], 0.04, "no effect", False),
        ([100, 104], [90, 92], 0.04, "worse", True),
        ([100, 130], [120, 121], 0.30, "no effect", False),  # +17 % but the baseline itself moved 26 %
        # the H200's enforce_eager A/B at 64 streams: -77 % inside a 78 % band that one cold baseline window made;
        # every eager sample lies below every baseline one, which the row flags, but inside the band is no verdict
        ([5397, 16405, 17259, 18513], [3172, 4716], 0.78, "no effect", True),
        ([100, 140], [150, 170], 0.40, "no effect", True),  # +33 % inside a 40 % band, above the whole range
        ([100, 101], [99.0, 99.5], 0.02, "no effect", True),  # apart, but by less than the 2 % floor
        ([100, 140], [105, 98], 0.40, "no effect", False),  # one sample inside the baseline's range
    ],
)
def test_better_or_worse_only_outside_the_noise_band(base, variant, noise, expected, apart):
    call, change = ab.verdict(base, variant, noise)
    assert call == expected and ab.samples_apart(base, variant, change) == apart


def test_noise_band_is_the_baselines_spread_with_a_floor():
    assert ab.noise_band([100, 110, 105]) == pytest.approx(10 / 105)
    assert ab.noise_band([100, 100.5]) == ab.MIN_NOISE


def test_variants_are_validated_with_the_params():
    with pytest.raises(ParamsError, match=r"ab_variants\[0\] \(x\): unknown keys \['max_num_seq'\]"):
        params.validate({"ab_variants": [{"name": "x", "max_num_seq": 4}]})
    with pytest.raises(ParamsError, match="has no 'name'"):
        params.validate({"ab_variants": [{"max_num_seqs": 4}]})


def test_recommendation_keeps_the_default_unless_an_environment_set_wins():
    def outcome(verdict, variant):
        rows = [ab.AbRow(variant=variant.name, concurrency=c, verdict=verdict, change=0.1, noise=0.05) for c in (1, 32)]
        return ab.AbResult(
            variants=[variant], samples={}, rows=rows, failures={}, concurrencies=[1, 32], workload=loadgen.Workload()
        )

    nccl_ll = AbVariant(name="nccl-ll", extra_env={"NCCL_PROTO": "LL"})
    assert nccl_tuning.recommend(outcome("no effect", nccl_ll))[0] == {}
    assert nccl_tuning.recommend(outcome("better", nccl_ll))[0] == {"NCCL_PROTO": "LL"}
    assert nccl_tuning.recommend(None)[0] == {}
    # a winner that changes serving flags is a note, never the environment to deploy with
    seqs = AbVariant(name="seqs", max_num_seqs=8)
    env, _, notes = nccl_tuning.recommend(outcome("better", seqs))
    assert env == {} and notes and notes[0].startswith("seqs: better at every concurrency")


def test_the_ab_prices_its_relaunches_before_the_first_and_flags_the_ones_not_worth_it():
    """The story relaunched a 547 GB model for marginal gains: every relaunch is priced at the measured start
    (plus a compile miss where a variant changes a compile-key flag) and a variant inside the noise band at
    every concurrency is named as not worth its relaunch, with what it cost."""
    from servebook.server_config import ServerConfig

    base = ServerConfig(model="m", model_path="/m", served_model_name="m")
    nccl_ll = AbVariant(name="nccl-ll", extra_env={"NCCL_PROTO": "LL"})
    seqs = AbVariant(name="seqs", max_num_seqs=8)
    order = [("baseline", base), ("nccl-ll", ab.variant_config(base, nccl_ll)), ("seqs", ab.variant_config(base, seqs)),
             ("baseline", base)]  # fmt: skip
    cost = ab.price(base, order, (2160.0, "the measured start"), compile_miss_s=60.0)
    assert [r.expected_s for r in cost.relaunches] == [2160.0, 2220.0, 2160.0]  # NCCL_* is outside the compile key
    said = cost.describe()
    assert said.startswith("3 relaunches at about 2160 s each (the measured start)")
    assert "seqs changes a flag the compile cache is keyed on (+60 s each)" in said and "109.0 min" in said
    cost.relaunches[0].seconds_to_ready = 2100.0
    rows = [ab.AbRow(variant=v, concurrency=c, verdict=verdict, change=0.01, noise=0.05)
            for v, verdict in (("nccl-ll", "no effect"), ("seqs", "better")) for c in (1, 32)]  # fmt: skip
    result = ab.AbResult(variants=[nccl_ll, seqs], samples={}, rows=rows, failures={}, concurrencies=[1, 32],
                         workload=loadgen.Workload(), cost=cost)  # fmt: skip
    assert result.not_worth_relaunching() == {"nccl-ll": 2100.0}
    _, _, notes = nccl_tuning.recommend(result)
    assert any(n.startswith("nccl-ll: inside the baseline's noise band") and "2100 s" in n for n in notes)


def test_a_reused_server_is_priced_at_the_plans_prediction():
    from servebook import startup
    from servebook.records import LaunchRecord

    fields = LaunchRecord.model_fields
    assert "start_prediction" in fields and "reused" in fields
    prediction = startup.StartPrediction(total_s=300.0, phases={}, bytes_per_rank=0, disk_bytes=0, read_gb_per_s=None,
                                         compile_cache="hit", limit="", basis="")  # fmt: skip

    class Reused:
        reused, seconds_to_ready, start_prediction = True, 0.0, prediction

    assert nccl_tuning.start_cost(Reused())[0] == 300.0  # type: ignore[arg-type]
    Reused.start_prediction = None
    assert nccl_tuning.start_cost(Reused())[1].startswith("unknown")  # type: ignore[arg-type]


def test_an_eager_server_pays_no_compile_miss_on_relaunch():
    from servebook.server_config import ServerConfig

    base = ServerConfig(model="m", model_path="/m", served_model_name="m", enforce_eager=True)
    bogus = ab.variant_config(base, AbVariant(name="bogus", extra_args=["--no-such-flag"]))
    cost = ab.price(base, [("baseline", base), ("bogus", bogus), ("baseline", base)], (25.0, "measured"), 42.0)
    assert [r.expected_s for r in cost.relaunches] == [25.0, 25.0]
    assert "compile cache" not in cost.describe()


@pytest.mark.parametrize(
    ("base", "variant", "noise", "said"),
    [
        ([5397, 16405, 17259, 18513], [3172, 4716], 0.78, "likely worse"),  # -70 %, all apart, in a 78 % band
        ([100, 140], [150, 170], 0.40, "likely better"),
        ([100, 101], [99.0, 99.5], 0.02, "no effect"),  # apart, but by less than the 2 % floor
        ([100, 140], [105, 98], 0.40, "no effect"),  # one sample inside the baseline's range
        ([100, 101], [80, 82], 0.02, "worse"),
    ],
)
def test_the_words_follow_the_numbers(base, variant, noise, said):
    """Issue #41 point 5: a change with every sample apart is never called "no effect"."""
    assert ab.worded(base, variant, noise)[0] == said


def test_only_the_variant_ahead_at_every_concurrency_earns_a_real_relaunch():
    """Issue #39 item 5: the dummy-weight pass picks at most one variant for the real weights: better (or likely
    better) at every concurrency, the one whose smallest gain is largest."""

    def row(variant, concurrency, verdict, change):
        return ab.AbRow(variant=variant, concurrency=concurrency, verdict=verdict, change=change, noise=0.03)

    def result(rows):
        names = sorted({r.variant for r in rows})
        return ab.AbResult(variants=[AbVariant(name=n) for n in names], samples={}, rows=rows, failures={},
                           concurrencies=[1, 32], workload=loadgen.Workload())  # fmt: skip

    mixed = result([row("ll", 1, "better", 0.2), row("ll", 32, "no effect", 0.01),
                    row("ring", 1, "likely better", 0.04), row("ring", 32, "better", 0.09),
                    row("tree", 1, "better", 0.30), row("tree", 32, "better", 0.05)])  # fmt: skip
    assert ab.promising(mixed) == "tree"  # 5 % at worst beats ring's 4 %; ll is no better at 32 streams
    assert ab.promising(result([row("ll", 1, "failed to start", None), row("ll", 32, "worse", -0.2)])) == ""


def test_the_record_says_which_variants_never_met_the_real_weights():
    cost = ab.RelaunchCost(
        start_s=2160.0, compile_miss_s=0.0, relaunches=[ab.Relaunch(name="baseline", expected_s=2160.0)]
    )
    dummy = ab.AbResult(variants=[AbVariant(name="ll"), AbVariant(name="seqs")], samples={}, rows=[], failures={},
                        concurrencies=[1], workload=loadgen.Workload())  # fmt: skip
    real = ab.AbResult(variants=[], samples={}, rows=[], failures={}, concurrencies=[1], workload=loadgen.Workload(),
                       cost=cost)  # fmt: skip
    none_won = ab.RehearsedAb(dummy=dummy, real=real, winner="", routing="uniform_random")
    [said] = nccl_tuning.rehearsal_notes(none_won)
    assert said.startswith("2 variant(s) rehearsed on dummy weights with uniform_random routing; none beat")
    assert "ll, seqs never relaunched with the real weights: about 4320 s of real starts spared" in said
    one_won = none_won.model_copy(update={"winner": "seqs"})
    [said] = nccl_tuning.rehearsal_notes(one_won)
    assert "seqs beat the dummy baseline and was confirmed on the real weights" in said and "about 2160 s" in said
    # the rehearsal's windows as the dummy pass: the real server never stopped, so its restart is spared too
    [said] = nccl_tuning.rehearsal_notes(none_won.model_copy(update={"from_rehearsal": True}))
    assert "by stage 02" in said and "the real server was never stopped" in said and "about 6480 s" in said


def test_a_dummy_start_is_priced_without_the_weights_read():
    from servebook import startup

    timeline = startup.Timeline(
        total_s=2160.0, phases=[startup.Phase(name="weights_read", label="weights", start_s=60.0, seconds=1800.0)]
    )

    class Started:
        reused, seconds_to_ready, start_prediction = False, 2160.0, None

    Started.timeline = timeline  # type: ignore[attr-defined]
    seconds, basis = nccl_tuning.dummy_start_cost(Started())  # type: ignore[arg-type]
    assert seconds == 360.0 and basis == "the measured start, less its weights' read (1800 s)"


def test_a_variant_the_baseline_already_runs_is_not_started(tmp_path):
    """The main job's rehearsal can pick the A/B's own setting for the launch: measuring it again against itself
    costs starts and reads noise as a verdict (a `likely worse` for the same server was seen)."""
    from servebook.server_config import ServerConfig

    base = ServerConfig(model="m", model_path="/m", served_model_name="m", max_num_seqs=4)
    said: list[str] = []
    plan = ab.AbPlan(workload=loadgen.Workload(), concurrencies=[1, 8])
    result = ab.run(base, [AbVariant(name="max-4-seqs", max_num_seqs=4)], tmp_path, plan, log=said.append)
    assert result.rows == [] and result.variants == [] and result.samples == {}
    assert any("the baseline already runs it" in line for line in said) and not list(tmp_path.iterdir())


def test_auto_rehearses_on_dummy_weights_only_where_the_dummy_pass_saves_starts():
    """Two dummy baselines more than the real pass: they pay for a 547 GB read, never for a model loaded in a
    second (the embedded default, whose real and dummy starts both take about 30 s)."""
    from servebook.server_config import ServerConfig

    base = ServerConfig(model="m", model_path="/m", served_model_name="m", max_num_seqs=8)
    one = [AbVariant(name="four", max_num_seqs=4), AbVariant(name="same", max_num_seqs=8)]
    dear, why = ab.dummy_pass_pays(base, one, real_start_s=2160, dummy_start_s=90)
    assert dear and "1 variant(s)" in why and "4320 s" in why and "2430 s" in why
    cheap, why = ab.dummy_pass_pays(base, one, real_start_s=31, dummy_start_s=30)
    assert not cheap and why.startswith("on the real weights") and "read is short" in why
    nothing, why = ab.dummy_pass_pays(base, one[1:], real_start_s=2160, dummy_start_s=90)
    assert not nothing and "nothing to rehearse" in why


def test_the_rehearsals_windows_are_the_dummy_pass_only_where_it_started_the_same_servers():
    """Issue #39 item 5 without a start: stage 02 already ran the baseline's and the variant's exact dummy servers
    with the A/B's workload, so their windows are the dummy pass; a server it did not start (another flag or
    environment) or a concurrency it did not reach sends the A/B back to its own dummy pass, saying why."""
    from servebook.server_config import ServerConfig

    base = ServerConfig(model="m", model_path="/m", served_model_name="m", port=8000)
    dummy = ab.DummyWeights(lambda cfg: rehearsal.routing_env(cfg, "uniform_random", True), "uniform_random")
    plan = ab.AbPlan(workload=loadgen.Workload(), concurrencies=[1, 8])
    four = AbVariant(name="four", max_num_seqs=4)

    def server_of(cfg, samples, env=None):
        return ab.RehearsedServer(" ".join(dummy.make(cfg).command()), env or {}, samples)

    windows = {1: [100.0, 102.0], 2: [190.0, 195.0], 4: [380.0, 390.0], 8: [700.0, 720.0]}
    fewer = {1: [100.0, 101.0], 2: [150.0, 151.0], 4: [200.0, 203.0], 8: [200.0, 204.0]}
    servers = [server_of(base, windows), server_of(ab.variant_config(base, four), fewer)]
    found, why = ab.from_rehearsal(base, [four], plan, dummy, servers)
    assert why == "" and found is not None and found.samples["four"]["8"] == [200.0, 204.0]
    assert [(r.concurrency, r.verdict) for r in found.rows] == [(1, "no effect"), (8, "worse")]
    assert ab.promising(found) == "" and found.cost is not None and found.cost.relaunches == []

    nccl_env = AbVariant(name="ll", extra_env={"NCCL_PROTO": "LL"})  # same command line, another environment
    found, why = ab.from_rehearsal(base, [nccl_env], plan, dummy, servers)
    assert found is None and why == "the rehearsal did not start the server of ll"
    short = [server_of(base, windows), server_of(ab.variant_config(base, four), {1: [100.0], 2: [150.0]})]
    found, why = ab.from_rehearsal(base, [four], plan, dummy, short)
    assert found is None and why == "the rehearsal did not measure four at concurrency 8"
    found, why = ab.from_rehearsal(base, [four], plan, dummy, [])
    assert found is None and "no rehearsal" in why


def test_each_pass_says_what_it_cost_in_starts():
    """The notebook's words for each pass: relaunches priced and spent, or the rehearsal's windows and the running
    server as they are (no '0 relaunches at about 35 s each')."""
    from servebook.records import NcclTuningRecord

    def result(relaunches):
        cost = ab.RelaunchCost(start_s=35.0, compile_miss_s=0.0, relaunches=relaunches)
        return ab.AbResult(variants=[], samples={}, rows=[], failures={}, concurrencies=[1, 8],
                           workload=loadgen.Workload(), cost=cost)  # fmt: skip

    micro = nccl.MicroResult.model_construct()
    reused = ab.RehearsedAb(dummy=result([]), real=result([]), winner="", from_rehearsal=True)
    record = NcclTuningRecord(micro=micro, ab=reused.real, rehearsed=reused, recommended_env={}, recommendation="",
                              notes=[])  # fmt: skip
    assert [w for w, _ in nccl_tuning.passes(record)] == ["stage 02's dummy", "real"]
    assert nccl_tuning.pass_costs(record) == [
        "dummy weights: stage 02's rehearsal windows of the same servers; no server started for them",
        "real weights: the running server measured as it is; no relaunch",
    ]
    restarted = result([ab.Relaunch(name="baseline", expected_s=35.0, seconds_to_ready=33.0)])
    record = record.model_copy(update={"ab": restarted, "rehearsed": None})
    [said] = nccl_tuning.pass_costs(record)
    assert said.startswith("real weights, before: 1 relaunch") and said.endswith("spent: 0.6 min")


def test_an_interrupted_set_kills_its_ranks(ctrl_c_after):
    """Each rank runs in a session of its own, which no Ctrl-C at the terminal reaches: an interrupt of servebook
    must stop them itself, or they outlive the run holding the GPUs."""
    import signal
    import subprocess
    import sys
    import time

    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"],
            start_new_session=True,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(2)
    ]
    ctrl_c_after(0.5)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        nccl._collect(ranks, began, timeout_s=120)
    assert time.monotonic() - began < 5
    assert [r.poll() for r in ranks] == [-signal.SIGKILL] * 2


def test_the_ab_reuses_the_windows_of_measured_and_dropped_candidates_never_a_failed_one(tmp_path):
    def candidate(name, status):
        line = f"vllm serve /dummy --max-num-seqs {len(name)} --load-format dummy"
        return rehearsal.Rehearsed(name=name, layout=Parallelism(), setting=rehearsal.AS_SET, status=status,
                                   command_line=line)  # fmt: skip

    found = [candidate("TP=1", "measured"), candidate("TP=1 · s4", "dropped"), candidate("TP=2", "failed")]
    for c in found:
        folder = tmp_path / RehearsalRecord.FILE / rehearsal.slug_of(c.name)
        folder.mkdir(parents=True)
        pd.DataFrame({"concurrency": [1, 1, 4], "output_throughput": [10.0, 11.0, 30.0]}).to_parquet(
            folder / "sweep_runs.parquet"
        )
    record = RehearsalRecord(model_path="/dummy", routing="", ranked_by="output tok/s", candidates=found)
    results.write(tmp_path, record)
    servers = nccl_tuning.rehearsed_servers(tmp_path, "/real")
    # a candidate dropped behind the leader still measured every level up to ab_concurrency (SweepConfig.reach)
    assert [s.command_line for s in servers] == [
        "vllm serve /real --max-num-seqs 4 --load-format dummy",
        "vllm serve /real --max-num-seqs 9 --load-format dummy",
    ]
    assert servers[1].samples == {1: [10.0, 11.0], 4: [30.0]}
