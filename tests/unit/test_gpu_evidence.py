"""GPU evidence per level: NVML samples summarised, and the walls they show named, on hand-built series and on
the fake NVML (the only fake servebook's tests use)."""

import pytest

from servebook import bench, gpu_evidence
from servebook.gpu_evidence import Sample


def sample(gpu=0, util=60.0, power=350.0, limit=600.0, clock=2400.0, reasons=0, tx=10.0, rx=10.0, gen=5, width=16):
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
    cfg = bench.SweepConfig()
    level = bench.Level(
        concurrency=64, repeats=2, output_throughput=4000.0, output_throughput_min=3950.0,
        output_throughput_max=4050.0, spread_pct=2.5, running_peak=64, gpu_pcie_pct=91.0, gpu_pcie_link="Gen5 x16",
        gpu_pcie_direction="from the GPU", gpu_sm_util_pct=55.0,
    )  # fmt: skip
    kind, words = bench.limit_of(level, gain=0.02, cfg=cfg)
    assert kind == "pcie" and words.startswith("PCIe at 91 % of Gen5 x16 (from the GPU)")
    assert bench.limit_of(level, gain=0.4, cfg=cfg)[0] == "rising"
    calm = level.model_copy(update={"gpu_pcie_pct": 30.0})
    kind, words = bench.limit_of(calm, gain=0.02, cfg=cfg)
    assert kind == "server" and "SM busy 55 %" in words


def test_the_sampler_reads_the_fake_nvml_and_says_why_a_cpu_server_has_no_evidence(monkeypatch):
    monkeypatch.setenv("SERVEBOOK_FAKE_NVML", "rtxpro6000x8-pcie-busy")
    with gpu_evidence.GpuSampler([0, 1], every_s=0.05) as sampler:
        gpu_evidence.wait_a_sample(sampler)
    e = sampler.evidence
    assert e is not None and e.samples >= 2 and sampler.absent == ""
    assert e.pcie_link == "Gen5 x16" and e.pcie_peak_pct == pytest.approx(90.0, abs=0.1)
    assert e.power_peak_w == pytest.approx(371) and e.sm_util_mean_pct == 64
    assert gpu_evidence.verdict(e) == ("pcie", "PCIe at 90 % of Gen5 x16 (from the GPU)")
    with gpu_evidence.GpuSampler([]) as cpu:
        pass
    assert cpu.evidence is None and cpu.absent == "no GPU serves this model"
    assert bench._gpu_columns(cpu) == {"gpu_note": "no GPU evidence: no GPU serves this model"}
