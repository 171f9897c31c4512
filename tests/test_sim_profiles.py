"""The simulator's GPU models against real hardware: the H100 against the committed capture of a real
H100 (tests/data/captures/h100-580-vm), the H200 against the table nvidia-smi showed on a real H200."""
from __future__ import annotations

from pathlib import Path

import pynvml

from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml, SimHandle
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.profiles import BUILT_IN, H100_80GB_HBM3, H200, GiProfile
from gpu_agent.sim.replay import Capture

CAPTURE = Path(__file__).resolve().parent / "data" / "captures" / "h100-580-vm"


def _table(profiles: tuple[GiProfile, ...]) -> list[tuple[object, ...]]:
    return [(p.constant, p.id, p.name, p.slices, p.instances, p.multiprocessors, p.memory_mib, p.copy_engines,
             p.decoders, p.encoders, p.jpeg, p.ofa, p.starts, p.size) for p in profiles]


def test_the_h100_model_is_the_real_h100() -> None:
    real = Capture.load(CAPTURE)
    model = real.model(0)
    assert _table(H100_80GB_HBM3.mig_profiles) == _table(model.mig_profiles)
    assert (H100_80GB_HBM3.name, H100_80GB_HBM3.memory_mib, H100_80GB_HBM3.pci_device_id,
            H100_80GB_HBM3.compute_capability) == (model.name, model.memory_mib, model.pci_device_id,
                                                   model.compute_capability)
    reserved = real.answer("nvmlDeviceGetMemoryInfo", SimHandle(0), pynvml.nvmlMemory_v2).reserved >> 20
    assert H100_80GB_HBM3.reserved_mib == reserved == 480


def test_the_h200_has_the_profile_table_read_from_a_real_h200() -> None:
    assert (H200.name, H200.memory_mib, H200.pci_device_id >> 16, H200.compute_capability) == (
        "NVIDIA H200", 143771, 0x2335, (9, 0))
    table = {p.name.removeprefix("MIG "): (p.id, p.instances, p.memory_mib, p.starts, p.size)
             for p in H200.mig_profiles}
    seven = (0, 1, 2, 3, 4, 5, 6)
    assert table == {
        "1g.18gb": (19, 7, 16384, seven, 1),
        "1g.18gb+me": (20, 1, 16384, seven, 1),
        "1g.35gb": (15, 4, 33280, (0, 2, 4, 6), 2),
        "2g.35gb": (14, 3, 33280, (0, 2, 4), 2),
        "3g.71gb": (9, 2, 71424, (0, 4), 4),
        "4g.71gb": (5, 1, 71424, (0,), 4),
        "7g.141gb": (0, 1, 143360, (0,), 8),
    }
    # placements as on the H100: the same GH100 slices
    h100 = {p.id: (p.starts, p.size) for p in H100_80GB_HBM3.mig_profiles}
    assert {p.id: (p.starts, p.size) for p in H200.mig_profiles} == h100


def test_dgx_h200_is_eight_h200s_that_nvml_and_sysfs_agree_on(tmp_path: Path) -> None:
    assert len(BUILT_IN["dgx-h200"].gpus) == 8
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h200")
    root = Root(tmp_path).with_kernel(machine.kernel_dir)
    for module in ("nvidia", "nvidia_uvm"):
        SimModprobe(machine, root).load(module)
    nvml = Nvml(FakeNvml(machine), call_timeout=5.0)
    try:
        inventory = nvml.inventory.read()
    finally:
        nvml.close()
    assert [gpu.product for gpu in inventory.gpus] == ["NVIDIA H200"] * 8
    assert {gpu.memory_mib for gpu in inventory.gpus} == {143771}
    profiles = inventory.gpus[0].mig.profiles
    assert [(p.name, p.id, p.memory_mib, p.placements[-1]) for p in profiles] == [
        ("1g.18gb", 19, 16384, (6, 1)), ("1g.18gb+me", 20, 16384, (6, 1)), ("1g.35gb", 15, 33280, (6, 2)),
        ("2g.35gb", 14, 33280, (4, 2)), ("3g.71gb", 9, 71424, (4, 4)), ("4g.71gb", 5, 71424, (0, 4)),
        ("7g.141gb", 0, 143360, (0, 8))]
    for gpu in inventory.gpus:
        device = root(f"/sys/bus/pci/devices/{gpu.pci_bus_id}/device").read_text()
        assert device == "0x2335\n"
