"""A node whose driver is already loaded (by the OS image, the cloud or a driver container) is adopted:
nothing needs modprobe, and a host without modprobe is no failure. Feature modules degrade, never gate."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from gpu_agent.config.driver import DriverConfig, DriverModules
from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import pci
from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.stages.driver import PRELOADED, Driver
from gpu_agent.stages.driver_features import DriverFeatures


class NoModprobe:
    """A host without modprobe, as Modprobe reports it (../shared/hardware/h100-580-vm/binaries-on-path.txt)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def load(self, module: str) -> None:
        self.calls.append(module)
        raise AgentError("cannot run modprobe: not installed or not on PATH")


@pytest.fixture
def preloaded(tmp_path: Path) -> Iterator[tuple[Root, Nvml]]:
    """dgx-a100 (it has Mellanox NICs) with nvidia and nvidia_uvm loaded before the agent starts."""
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-a100")
    root = Root(tmp_path).with_kernel(machine.kernel_dir)
    for module in ("nvidia", "nvidia_uvm"):
        SimModprobe(machine, root).load(module)
    nvml = Nvml(FakeNvml(machine), call_timeout=5.0)
    yield root, nvml
    nvml.close()


def converge(stage: Driver | DriverFeatures) -> str:
    stage.start_pass()
    for _ in range(3):
        actions = stage.plan(stage.observe())
        if not actions:
            break
        stage.apply(actions)
    return stage.verify(stage.observe())


def test_a_preloaded_driver_is_adopted_without_modprobe(preloaded: tuple[Root, Nvml]) -> None:
    root, nvml = preloaded
    loader = NoModprobe()
    driver = Driver(root, nvml, loader, DriverConfig())
    planned = [action.summary for action in driver.plan(driver.observe())]
    assert planned and not [summary for summary in planned if summary.startswith("modprobe")]
    message = converge(driver)
    assert loader.calls == []
    assert "nvidia, nvidia_uvm already loaded when gpu-agent started" in message
    assert driver.facts(driver.observe())["loaded_by"] == PRELOADED


def test_a_feature_module_that_cannot_load_degrades_and_names_itself(preloaded: tuple[Root, Nvml]) -> None:
    root, _ = preloaded
    loader = NoModprobe()
    features = DriverFeatures(root, loader, DriverModules(nvidia_fs=True))
    assert features.gates_readiness is False
    with pytest.raises(StageError) as caught:
        converge(features)
    assert loader.calls == ["nvidia_peermem", "nvidia_fs"]  # each is tried, one failure stops none
    assert str(caught.value) == (
        "feature modules not loaded, the GPUs stay usable without them: "
        "nvidia_peermem: cannot run modprobe: not installed or not on PATH; "
        "nvidia_fs: cannot run modprobe: not installed or not on PATH")


def test_nvidia_modeset_comes_only_with_nvidia_drm_unless_asked(preloaded: tuple[Root, Nvml]) -> None:
    root, _ = preloaded
    features = DriverFeatures(root, NoModprobe(), DriverModules(nvidia_peermem=False))
    assert features.observe().wanted == ()
    assert DriverFeatures(root, NoModprobe(), DriverModules(nvidia_drm=True)).observe().wanted == (
        "nvidia_modeset", "nvidia_peermem", "nvidia_drm")
    assert DriverFeatures(root, NoModprobe(), DriverModules(nvidia_modeset=True, nvidia_peermem=False)
                          ).observe().wanted == ("nvidia_modeset",)


def test_peermem_auto_follows_the_driver_stages_count_of_mellanox_nics(preloaded: tuple[Root, Nvml],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    root, nvml = preloaded
    driver = Driver(root, nvml, NoModprobe(), DriverConfig())
    features = DriverFeatures(root, NoModprobe(), DriverModules())
    assert "nvidia_peermem" in features.observe().wanted  # its own scan: the node has Mellanox NICs
    features.inputs = driver.outputs(driver.observe())  # as the engine hands them on in a pass
    assert features.inputs["mellanox_nics"] == 8
    monkeypatch.setattr(pci, "scan", lambda root: pytest.fail("the bus was scanned twice in one pass"))
    assert "nvidia_peermem" in features.observe().wanted
    features.inputs = {"mellanox_nics": 0}
    assert "nvidia_peermem" not in features.observe().wanted


def test_a_missing_core_module_without_modprobe_says_so(preloaded: tuple[Root, Nvml], tmp_path: Path) -> None:
    machine = MachineState(Root(tmp_path / "cold"))
    machine.ensure("t4")
    root = Root(tmp_path / "cold").with_kernel(machine.kernel_dir)
    nvml = Nvml(FakeNvml(machine), call_timeout=5.0)
    try:
        with pytest.raises(AgentError, match="cannot run modprobe: not installed or not on PATH"):
            converge(Driver(root, nvml, NoModprobe(), DriverConfig()))
    finally:
        nvml.close()
