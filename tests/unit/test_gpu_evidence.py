"""GPU evidence per level: NVML samples summarised, and the walls they show named, on hand-built series and on
the fake NVML (the only fake servebook's tests use)."""

import time

import pytest

from servebook import gpu_evidence, levels, limits
from servebook.gpu_evidence import Sample


def wait_a_sample(sampler: gpu_evidence.GpuSampler, timeout_s: float = 2.0) -> None:
    """Until the sampler has read once (or gave up)."""
    end = time.monotonic() + timeout_s
    while not sampler.samples and not sampler.absent and time.monotonic() < end:
        time.sleep(0.01)


def sample(*, gpu=0, util=60.0, power=350.0, limit=600.0, clock=2400.0, reasons=0, tx=10.0, rx=10.0, gen=5, width=16):
    return Sample(gpu, util, power, limit, clock, 2600.0, reasons, tx, rx, gen, width)


def test_a_calm_series_shows_no_wall():
    e = gpu_evidence.summarize([sample(util=50), sample(util=70, gpu=1)])
    assert e.samples == 2 and e.sm_util_mean_pct == 60 and gpu_evidence.verdict(e) is None
    assert e.power_peak_pct == pytest.approx(100 * 350 / 600) and e.pcie_link == "Gen5 x16"


def test_pcie_traffic_near_the_links_bandwidth_is_the_wall():
    # Gen5 x16 carries 63 GB/s each way; one sample reaches 57 GB/s towards the GPU
    e = gpu_evidence.summarize([sample(rx=20.0), sample(rx=57.0, tx=30.0), sample(rx=25.0)])
    assert e.pcie_peak_pct == pytest.approx(100 * 57 / (3.938 * 16)) and e.pcie_peak_direction == "to the GPU"
    kind, words = gpu_evidence.verdict(e)
    assert kind == "pcie" and words == "PCIe at 90 % of Gen5 x16 (to the GPU)"


def test_a_power_cap_and_a_thermal_slowdown_are_named_from_nvmls_reasons():
    capped = gpu_evidence.summarize([sample(power=598.0, clock=1900.0, reasons=0x4)])
    kind, words = gpu_evidence.verdict(capped)
    assert kind == "power" and "598 W, 100 % of the limit" in words and "73 % of max" in words
    hot = gpu_evidence.summarize([sample(reasons=0x20 | 0x4, clock=1300.0)])
    assert gpu_evidence.verdict(hot)[0] == "thermal" and hot.slowdowns == ["power cap", "thermal (software)"]


def test_a_gpu_wall_labels_a_level_that_stopped_rising_and_not_one_still_rising():
    cfg = levels.SweepConfig()
    level = levels.Level(
        concurrency=64, repeats=2, output_throughput=4000.0, output_throughput_min=3950.0,
        output_throughput_max=4050.0, spread_pct=2.5, running_peak=64,
        gpu=gpu_evidence.GpuEvidence(
            samples=20, pcie_peak_pct=91.0, pcie_link="Gen5 x16", pcie_peak_direction="from the GPU",
            sm_util_mean_pct=55.0,
        ),
    )  # fmt: skip
    kind, words = limits.limit_of(level, gain=0.02, cfg=cfg)
    assert kind == "pcie" and words.startswith("PCIe at 91 % of Gen5 x16 (from the GPU)")
    assert limits.limit_of(level, gain=0.4, cfg=cfg)[0] == "rising"
    calm = level.model_copy(update={"gpu": level.gpu.model_copy(update={"pcie_peak_pct": 30.0})})
    kind, words = limits.limit_of(calm, gain=0.02, cfg=cfg)
    assert kind == "server" and "SM busy 55 %" in words


def test_a_batch_limit_is_read_from_vllms_queue_time_when_the_gauges_missed_the_level():
    """CI once saw '0 of 8 streams running' at max_num_seqs=4: the /metrics samples missed the whole level."""
    cfg = levels.SweepConfig(max_num_seqs=4)
    missed = levels.Level(
        concurrency=8, repeats=1, output_throughput=600.0, output_throughput_min=600.0,
        output_throughput_max=600.0, spread_pct=None, running_peak=0, waiting_peak=0, e2el_p50_ms=400.0,
        server_queue_ms=190.0, client_cpu_pct=1.0,
    )  # fmt: skip
    kind, words = limits.limit_of(missed, gain=-0.4, cfg=cfg)
    assert kind == "batch"
    assert (
        words == "batch limit max_num_seqs=4: 8 streams for 4 slots; requests waited 190 ms on average in vLLM's queue"
    )
    seen = missed.model_copy(update={"running_peak": 4, "waiting_peak": 3})
    assert limits.limit_of(seen, gain=0.0, cfg=cfg)[1].startswith("batch limit max_num_seqs=4: 4 running, 4 waiting;")
    # streams within max_num_seqs are no batch limit, whatever queued for the prefill budget
    within = missed.model_copy(update={"concurrency": 4, "running_peak": 4, "waiting_peak": 0})
    assert limits.limit_of(within, gain=-0.4, cfg=cfg)[0] == "decline"
    assert limits.limit_of(missed, gain=-0.4, cfg=levels.SweepConfig())[0] == "decline"  # no max_num_seqs set


def test_the_sampler_reads_the_fake_nvml_and_says_why_a_cpu_server_has_no_evidence(fake_nvml):
    fake_nvml("rtxpro6000x8-pcie-busy")
    with gpu_evidence.GpuSampler([0, 1], every_s=0.05) as sampler:
        wait_a_sample(sampler)
    e = sampler.evidence
    assert e is not None and e.samples >= 2 and sampler.absent == ""
    assert e.pcie_link == "Gen5 x16" and e.pcie_peak_pct == pytest.approx(90.0, abs=0.1)
    assert e.power_peak_w == pytest.approx(371) and e.sm_util_mean_pct == 64
    assert gpu_evidence.verdict(e) == ("pcie", "PCIe at 90 % of Gen5 x16 (from the GPU)")
    with gpu_evidence.GpuSampler([]) as cpu:
        pass
    assert cpu.evidence is None and cpu.absent == "no GPU serves this model"
    assert levels.gpu_columns(cpu.evidence) == {}


def nvlink(gpu, t_s, tx_gb, rx_gb, capacity=450.0):
    """A sample whose NVLink counters read ``tx_gb`` and ``rx_gb`` GB in all at ``t_s`` seconds."""
    return Sample(
        gpu, 60.0, 400.0, 700.0, 1980.0, 1980.0, 0, 1.0, 1.0, 5, 16,
        nvlink_tx_kib=tx_gb * 1e9 / 1024, nvlink_rx_kib=rx_gb * 1e9 / 1024, nvlink_us=t_s * 1e6, nvlink_gbs=capacity,
    )  # fmt: skip


def test_nvlink_rates_come_from_counter_deltas_and_a_busy_link_is_the_wall():
    # GPU 0 sends 100 GB in the first half second (200 GB/s), then 200 GB (400 GB/s of 450: 89 %); GPU 1 is calm
    series = [nvlink(0, 0.0, 1000, 500), nvlink(0, 0.5, 1100, 550), nvlink(0, 1.0, 1300, 600)]
    series += [nvlink(1, 0.0, 10, 10), nvlink(1, 0.5, 20, 20)]
    e = gpu_evidence.summarize(series)
    assert e.nvlink_peak_gbs == pytest.approx(400) and e.nvlink_peak_direction == "sent"
    assert e.nvlink_peak_pct == pytest.approx(100 * 400 / 450) and e.nvlink_capacity_gbs == 450
    assert gpu_evidence.verdict(e) == ("nvlink", "NVLink at 89 % of 450 GB/s (400 GB/s sent)")
    calm = gpu_evidence.summarize(series[:2] + series[3:])
    assert calm.nvlink_peak_pct == pytest.approx(100 * 200 / 450) and gpu_evidence.verdict(calm) is None
    # one reading per GPU gives no rate; GPUs without NVLink give none either
    assert gpu_evidence.summarize([series[0], sample()]).nvlink_peak_pct is None


def test_the_sampler_reads_nvlink_counters_and_link_speed_from_the_fake_nvml(fake_nvml):
    fake_nvml("h200x8-nvlink-busy")
    with gpu_evidence.GpuSampler([0, 1], every_s=0.05) as sampler:
        while len(sampler.samples) < 6 and not sampler.absent:
            time.sleep(0.01)
    e = sampler.evidence
    assert e is not None and e.nvlink_capacity_gbs == pytest.approx(18 * 25.0)  # 18 links up at 25,000 MB/s
    assert e.nvlink_peak_gbs == pytest.approx(405, rel=0.02) and e.nvlink_peak_direction == "sent"
    kind, words = gpu_evidence.verdict(e)
    assert kind == "nvlink" and words.startswith("NVLink at 90 % of 450 GB/s")
    row = levels.gpu_columns(sampler.evidence)
    assert row["gpu_nvlink_pct"] == pytest.approx(90, abs=2) and row["gpu_nvlink_direction"] == "sent"
    # an H200 board whose scenario gives no link speed: no bandwidth to measure against, so no NVLink evidence
    fake_nvml("h200x8-nvlink")
    with gpu_evidence.GpuSampler([0], every_s=0.05) as idle:
        wait_a_sample(idle)
    assert idle.evidence is not None and idle.evidence.nvlink_peak_pct is None


def test_an_nvlink_wall_labels_a_level_once_throughput_stops_rising():
    level = levels.Level(
        concurrency=128, repeats=2, output_throughput=9000.0, output_throughput_min=8900.0,
        output_throughput_max=9100.0, spread_pct=2.2, running_peak=128,
        gpu=gpu_evidence.GpuEvidence(
            samples=20, nvlink_peak_pct=92.0, nvlink_peak_gbs=414.0, nvlink_capacity_gbs=450.0,
            nvlink_peak_direction="sent",
        ),
    )  # fmt: skip
    kind, words = limits.limit_of(level, gain=0.01, cfg=levels.SweepConfig())
    assert kind == "nvlink" and words.startswith("NVLink at 92 % of 450 GB/s (414 GB/s sent)")
    assert limits.limit_of(level, gain=0.5, cfg=levels.SweepConfig())[0] == "rising"
    # issue #41: the same level with repeats 40 % apart cannot tell a plateau from noise, and says so
    noisy = level.model_copy(
        update={"output_throughput_min": 7200.0, "output_throughput_max": 10800.0, "spread_pct": 40.0}
    )
    kind, words = limits.limit_of(noisy, gain=0.01, cfg=levels.SweepConfig())
    assert kind == "noise" and "within noise" in words and "±20 %" in words


def test_the_limits_table_is_rounded_under_readable_headers_with_shared_notes_below():
    import pandas as pd

    from servebook.stages import benchmark

    levels = pd.DataFrame(
        {
            "concurrency": [1, 256],
            "limit": ["the first level: nothing limits it yet", "declined -32%"],
            "client_cpu_pct": [6.85, 42.65],
            "running_peak": [1.0, 256.0],
            "waiting_peak": [0.0, 0.0],
            "kv_cache_usage_peak": [3.39e-05, 0.008359],
            "gpu_sm_util_pct": [36.45, 23.49],
            "gpu_slowdowns": ["", "power cap"],
            "gpu_note": ["", ""],
            "gpu_samples": ["10", "24, 25"],
            "plan_ceiling_tok_s": [4997.38, 66147.57],
            "output_throughput": [562.0, 12670.0],
        }
    )
    shown, note = benchmark.limits_table(levels)
    assert shown.index.name == "streams" and list(shown.index) == [1, 256]
    assert list(shown.columns) == [
        "client CPU, % of a core", "running (peak)", "waiting (peak)", "KV cache used, %", "SM busy, %",
        "clock slowdowns", "plan's ceiling for this workload, tok/s", "what limits it",
    ]  # fmt: skip
    assert shown.loc[256, "KV cache used, %"] == 0.84 and shown.loc[256, "client CPU, % of a core"] == 43
    assert shown.loc[1, "plan's ceiling for this workload, tok/s"] == 4997 and shown.loc[1, "clock slowdowns"] == ""
    assert note == "NVML sampled each measurement 10–25 times"

    cpu = levels.assign(gpu_note="no GPU evidence: no GPU serves this model", gpu_samples="").drop(
        columns="gpu_slowdowns"
    )
    shown, note = benchmark.limits_table(cpu)
    assert note == "no GPU evidence: no GPU serves this model" and "GPU note" not in shown


def test_the_clock_and_rate_tables_show_both_clocks_and_the_verdict_in_full():
    import pandas as pd

    from servebook.stages import benchmark

    levels = pd.DataFrame(
        [
            {"concurrency": 1, "client_ttft_mean_ms": 46.04, "vllm_ttft_mean_ms": 3.91, "client_tpot_mean_ms": 0.0,
             "vllm_tpot_mean_ms": 1.284, "tpot_clock_gap_pct": -100.0, "window_requests": 46, "vllm_requests": 46},
        ]
    )  # fmt: skip
    clocks = benchmark.clock_table(levels)
    assert clocks.loc[1, "of it outside vLLM's clock, ms"] == pytest.approx(42.1)
    assert clocks.loc[1, "TPOT, client against vLLM, %"] == -100 and clocks.loc[1, "TPOT mean, vLLM, ms"] == 1.28
    assert benchmark.clock_table(levels.assign(vllm_tpot_mean_ms=None)).empty  # a server without the histograms
    verdict = "kept up: 6.10 of 6.12 requests/s completed; the client's mean TPOT is -29 % off vLLM's own: " * 2
    rates = pd.DataFrame([{"rate": 4.0, "output_throughput": 214.6, "tpot_clock_gap_pct": -29.4, "verdict": verdict}])
    html = benchmark.rates_style(rates).to_html()
    assert verdict in html and "TPOT, client against vLLM, %" in html and ">-29<" in html and ">215<" in html
    agreeing = benchmark.rates_style(rates.assign(tpot_clock_gap_pct=-0.3, output_throughput=2004.4)).to_html()
    assert ">0<" in agreeing and ">-0<" not in agreeing and ">2,004<" in agreeing  # never "-0"
