"""Reconnaissance over fake NVML scenarios (NVML is the one thing tests may fake)."""

import pytest

from servebook import hardware, nvml
from servebook.stages import reconnaissance
from servebook.units import MiB


def assess(fake_nvml, scenario, **kw):
    fake_nvml(scenario)
    args = dict(model="builtin:tiny-qwen3-moe", model_store="/", device="cuda", world_size=8)
    args.update(kw)
    return reconnaissance.assess(**args)


def test_h200_board_is_ready_with_nvlink(fake_nvml):
    fake_nvml("h200x8-nvlink")
    inv = hardware.inventory()
    assert inv.available and len(inv.gpus) == 8 and len(inv.pairs) == 28
    g = inv.gpus[0]
    assert g.name == "NVIDIA H200" and g.memory_total == 143771 * MiB and g.nvlink_active == 18
    assert g.mig_enabled is False and g.pcie_gen_max == 5
    assert inv.nvlink_everywhere and inv.cuda_driver_version == "13.0"
    found = assess(fake_nvml, "h200x8-nvlink")
    assert found.verdict.ready, found.verdict
    assert any("NVLink connects every pair" in n for n in found.verdict.notes)


def test_pcie_box_reports_no_nvlink_and_missing_p2p(fake_nvml):
    found = assess(fake_nvml, "rtxpro6000x8-pcie")
    notes = " ".join(found.verdict.notes)
    assert found.verdict.ready
    assert "collectives go over PCIe" in notes and "custom all-reduce" in notes
    assert "no PCIe P2P between GPU pairs 0-4" in notes
    assert "PCIe link at Gen1 of Gen5" in notes
    assert found.inventory.gpus[0].nvlink_active == 0
    assert reconnaissance.pair_matrix(found.inventory, "topology").loc[0, 7] == "SYS"


def test_mig_blocks_only_the_gpus_it_is_on(fake_nvml):
    found = assess(fake_nvml, "a100x4-mig", world_size=4)
    assert not found.verdict.ready
    assert found.verdict.reasons == [
        "GPU 1 has MIG enabled; vLLM's tensor parallelism needs whole GPUs (nvidia-smi -i 1 -mig 0)"
    ]
    found = assess(fake_nvml, "a100x4-mig", world_size=2, gpu_ids=[2, 3])
    assert found.verdict.ready


def test_no_driver_is_said_plainly_and_the_host_still_reported(fake_nvml):
    found = assess(fake_nvml, "no-driver")
    assert not found.inventory.available
    assert "NVML is not available" in found.inventory.error
    assert not found.verdict.ready and "no usable NVIDIA GPU" in found.verdict.reasons[0]
    assert found.host.cpu_cores_logical >= 1 and found.host.ram_total_bytes > 0
    cpu = assess(fake_nvml, "no-driver", device="auto", world_size=1)
    assert cpu.device == "cpu" and cpu.verdict.ready


def test_leftovers_and_invisible_memory_are_reasons(fake_nvml):
    found = assess(fake_nvml, "h200x8-leftovers")
    reasons = found.verdict.reasons
    assert any(r.startswith("GPU 3 holds 41.0 GiB for a leftover VLLM::Worker_TP3") for r in reasons), reasons
    assert any(r.startswith("GPU 5 has 30.0 GiB in use by no process NVML can list") for r in reasons), reasons
    assert len(reasons) == 2
    gpu3 = found.inventory.gpus[3]
    assert gpu3.processes[0].is_vllm and not gpu3.processes[0].visible


def test_layout_larger_than_the_box(fake_nvml):
    found = assess(fake_nvml, "a100x4-mig", world_size=8)
    assert "the layout needs 8 GPUs but NVML sees 4" in found.verdict.reasons


def test_disk_too_small_for_a_hub_checkpoint(fake_nvml, tmp_path):
    found = assess(
        fake_nvml, "h200x8-nvlink", model="moonshotai/Kimi-K2.5", model_store=str(tmp_path), checkpoint_gb=10_000_000
    )
    reason = [r for r in found.verdict.reasons if "free at" in r]
    assert reason and "for a 10000000 GB checkpoint" in reason[0] and "model_store" in reason[0]


def test_unknown_size_is_a_note_not_a_failure(fake_nvml):
    found = assess(fake_nvml, "h200x8-nvlink", model="org/not-reachable-offline")
    assert found.verdict.ready
    assert any("checkpoint size of org/not-reachable-offline unknown" in n for n in found.verdict.notes)


def test_p2p_index_is_passed_as_an_integer():
    # nvidia-ml-py 13.615.71 defines NVML_P2P_CAPS_INDEX_READ as the tuple (0,)
    assert [int(c) for c in nvml.P2PCap] == [0, 1, 2]


def test_real_nvml_without_a_driver_is_unavailable():
    inv = hardware.inventory()
    if inv.available:
        pytest.skip("this host has an NVIDIA driver")
    assert "NVML is not available" in inv.error


def test_unknown_scenario_names_the_known_ones():
    from ..support.fake_nvml import load_scenario

    with pytest.raises(FileNotFoundError, match="h200x8-nvlink"):
        load_scenario("nope")
