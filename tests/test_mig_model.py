"""The MIG-shaped model: GPU instances with their compute instances, read through NVML's GPU instance
APIs from the simulator, which enforces NVML's MIG rules."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pynvml
import pytest

from gpu_agent.host.paths import Root
from gpu_agent.mig.profile import compute_sizes, compute_starts, parse_profile
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.mig import gi_id
from gpu_agent.sim.profiles import A30, A100_SXM4_40GB, H100_80GB_HBM3


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    made: list[Nvml] = []

    def make(spec: str) -> tuple[MachineState, Nvml]:
        state = MachineState(Root(tmp_path))
        state.ensure(spec)
        SimModprobe(state, Root(tmp_path)).load("nvidia")
        nvml = Nvml(FakeNvml(state), call_timeout=5)
        made.append(nvml)
        return state, nvml

    yield make
    for nvml in made:
        nvml.close()


def machine_file(tmp_path: Path, model: str, devices: list[str], enabled: bool = True) -> str:
    path = tmp_path / "machine.yaml"
    listed = "".join(f"\n        - {d}" for d in devices) if devices else " []"
    path.write_text(f"gpus:\n  - model: {model}\n    mig:\n      enabled: {str(enabled).lower()}\n"
                    f"      devices:{listed}\n  - model: {model}\n")
    return str(path)


def test_gpu_instance_without_compute_instance_is_visible(node: Any, tmp_path: Path) -> None:
    state, nvml = node(machine_file(tmp_path, "H100-80GB-HBM3", ["3g.40gb", "1c.3g.40gb"]))
    with state.edit() as doc:  # destroy the second GPU instance's compute instance, keep the instance
        doc["gpus"][0]["mig"]["gpu_instances"][1]["compute_instances"].clear()
    mig = nvml.inventory.read().gpus[0].mig
    assert [(gi.id, gi.profile, gi.placement) for gi in mig.gpu_instances] == [(1, "3g.40gb", (0, 4)),
                                                                              (2, "3g.40gb", (4, 4))]
    assert [len(gi.compute_instances) for gi in mig.gpu_instances] == [1, 0]
    assert [d.gpu_instance_id for d in mig.devices] == [1]  # a MIG device only where a compute instance is


def test_compute_instances_carry_profile_placement_and_device_uuid(node: Any, tmp_path: Path) -> None:
    _, nvml = node(machine_file(tmp_path, "H100-80GB-HBM3", ["1c.3g.40gb", "2g.20gb"]))
    gpu = nvml.inventory.read().gpus[0]
    three, two = gpu.mig.gpu_instances
    (small,) = three.compute_instances
    assert (small.profile, small.slices, small.placement, small.id) == ("1c.3g.40gb", 1, (0, 1), 0)
    assert (three.profile, three.placement, two.profile, two.placement) == ("3g.40gb", (0, 4), "2g.20gb", (4, 2))
    assert small.uuid.startswith("MIG-") and small.profile_id == pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE
    devices = gpu.mig.devices
    assert [(d.profile, d.gpu_instance_id, d.uuid) for d in devices] == [
        ("1c.3g.40gb", 1, small.uuid), ("2g.20gb", 5, two.compute_instances[0].uuid)]
    assert devices[0].memory_mib == 40448  # a compute instance shares its GPU instance's memory
    assert gpu.pci_device_id == 0x233010DE


def test_mig_disabled_gpu_lists_profiles_and_no_instances(node: Any) -> None:
    _, nvml = node("dgx-a100")
    gpu = nvml.inventory.read().gpus[0]
    assert not gpu.mig.enabled and gpu.mig.gpu_instances == () and gpu.mig.devices == ()
    assert [p.name for p in gpu.mig.profiles][:3] == ["1g.5gb", "1g.5gb+me", "1g.10gb"]


@pytest.mark.parametrize("model, placements", [
    (H100_80GB_HBM3, {(0, 8): 0, (0, 4): 1, (4, 4): 2, (0, 2): 3, (4, 2): 5, (6, 2): 6, (0, 1): 7, (6, 1): 13}),
    (A100_SXM4_40GB, {(0, 4): 1, (4, 2): 5, (6, 1): 13}),
    (A30, {(0, 4): 0, (0, 2): 1, (2, 2): 2, (0, 1): 3, (3, 1): 6}),
])
def test_gpu_instance_ids_follow_placement(model: Any, placements: dict[tuple[int, int], int]) -> None:
    assert {where: gi_id(model, *where) for where in placements} == placements


def test_compute_instance_sizes_and_starts() -> None:
    assert compute_sizes(7) == (7, 4, 3, 2, 1) and compute_sizes(4) == (4, 2, 1) and compute_sizes(3) == (3, 2, 1)
    assert compute_starts(7, 3) == (0, 4) and compute_starts(7, 2) == (0, 2, 4) and compute_starts(4, 3) == ()


@pytest.mark.parametrize("text, expected", [
    ("3g.40gb", "3g.40gb"), ("1c.3g.40gb", "1c.3g.40gb"), ("3c.3g.40gb", "3g.40gb"), ("1g.10gb+me", "1g.10gb+me"),
    ("1g.24gb-me", "1g.24gb-me"), ("1g.24gb+me.all", "1g.24gb+me.all"), ("2g.48gb+gfx", "2g.48gb+gfx"),
])
def test_profile_grammar_reads_what_mig_parted_writes(text: str, expected: str) -> None:
    assert str(parse_profile(text)) == expected


@pytest.mark.parametrize("text", ["", "3g", "3g.40", "g.40gb", "4c.3g.40gb", "1g.10gb+me-x", "1g.10gb+",
                                  "1g.10gb+me,me", " 3g.40gb", "3g.40gb\n", "3g.40GB", "1g.10gb+1me", "１g.10gb"])
def test_profile_grammar_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_profile(text)
