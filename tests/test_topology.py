"""GPU topology: the simulator's wiring, what the NVML client reads of it, captures and replays, and the
preferred allocation policy on a simulated machine."""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Iterator

import pytest

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.host.pci import numa_node
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import Inventory
from gpu_agent.plugin.preferred import preferred
from gpu_agent.capture import capture
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState, load_machine_file
from gpu_agent.sim.replay import simulated_nvml

HERE = Path(__file__).resolve().parent
PCIE_MACHINE = HERE / "data" / "machines" / "pcie-8x-a30.yaml"
CAPTURE = HERE / "data" / "captures" / "h100-580-vm"


@pytest.fixture
def simulated(tmp_path: Path) -> Iterator[Any]:
    """simulated(spec) -> (machine, Nvml reading NUMA nodes from the simulated sysfs)."""
    made: list[Nvml] = []

    def make(spec: str, where: str = "root") -> tuple[MachineState, Nvml]:
        root = Root(tmp_path / where)
        machine = MachineState(root)
        machine.ensure(spec)
        if not machine.read().get("capture"):
            SimModprobe(machine, root).load("nvidia")
        nvml = Nvml(simulated_nvml(machine), 5.0, root.with_kernel(machine.kernel_dir))
        made.append(nvml)
        return machine, nvml

    yield make
    for nvml in made:
        nvml.close()


def kinds(inventory: Inventory) -> dict[tuple[int, int], str]:
    return {(link.a, link.b): link.kind for link in inventory.links}


@pytest.mark.parametrize("profile, nvlinks", [("dgx-a100", 12), ("dgx-h100", 18), ("dgx-h200", 18)])
def test_dgx_gpus_are_nvlinked_all_to_all_on_two_numa_nodes(simulated: Any, profile: str, nvlinks: int) -> None:
    _, nvml = simulated(profile)
    inventory = nvml.inventory.read()
    assert [gpu.numa_node for gpu in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len(inventory.links) == 28
    assert set(kinds(inventory).values()) == {f"NV{nvlinks}"}
    pcie = {(link.a, link.b): link.pcie for link in inventory.links}
    assert pcie[(0, 4)] == pcie[(3, 7)] == "SYS"
    assert pcie[(0, 2)] == pcie[(5, 7)] == "NODE"
    assert pcie[(0, 1)] == ("PXB" if profile == "dgx-a100" else "NODE")  # an A100 pair shares a PCIe switch complex


def test_the_pcie_machine_file_has_switches_numa_nodes_and_no_nvlink(simulated: Any) -> None:
    machine, nvml = simulated(str(PCIE_MACHINE))
    inventory = nvml.inventory.read()
    assert len(inventory.gpus) == 8 and {gpu.product for gpu in inventory.gpus} == {"NVIDIA A30"}
    assert [gpu.numa_node for gpu in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    links = kinds(inventory)
    assert links[(0, 3)] == links[(4, 7)] == "PIX" and links[(3, 4)] == links[(0, 7)] == "SYS"
    assert all(link.nvlinks == 0 for link in inventory.links)
    # The kernel's view (what the kubelet reads) is the simulated sysfs.
    kernel = Root(machine.root.path).with_kernel(machine.kernel_dir)
    assert kernel("/sys/bus/pci/devices/0000:88:00.0/numa_node").read_text() == "1\n"


def test_one_gpu_machines_and_the_real_vm_capture_have_no_links_and_an_unknown_numa_node(simulated: Any) -> None:
    _, nvml = simulated("t4")
    inventory = nvml.inventory.read()
    assert inventory.links == () and inventory.gpus[0].numa_node is None
    _, replayed = simulated(str(CAPTURE), "replay")
    node = replayed.inventory.read()
    assert node.links == () and node.gpus[0].numa_node is None  # sysfs numa_node -1 in the VM


def test_an_nvml_without_topology_calls_leaves_links_unknown(simulated: Any) -> None:
    machine, nvml = simulated("dgx-h100")
    with machine.edit() as state:
        for n, call in enumerate(("nvmlDeviceGetNvLinkState", "nvmlDeviceGetTopologyCommonAncestor")):
            state["faults"].append({"id": n + 1, "call": call, "gpu": None, "times": None,
                                    "error": "FunctionNotFound"})
    inventory = nvml.inventory.read()
    assert set(kinds(inventory).values()) == {"unknown"}
    assert [gpu.numa_node for gpu in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]  # sysfs still knows


def test_topology_is_read_once_and_again_after_an_unexpected_error(simulated: Any) -> None:
    machine, nvml = simulated("dgx-h100")
    with machine.edit() as state:
        state["faults"].append({"id": 1, "call": "nvmlDeviceGetP2PStatus", "gpu": None, "times": 1,
                                "error": "Unknown"})
    fake = nvml.lib
    first = nvml.inventory.read()
    assert set(kinds(first).values()) == {"NV18"}  # a pair NVML could not confirm is taken at its links' word
    asked = fake.calls["nvmlDeviceGetNvLinkState"]
    second = nvml.inventory.read()  # read again: the last reading met an error
    assert second == first and fake.calls["nvmlDeviceGetNvLinkState"] == 2 * asked
    assert nvml.inventory.read() == second and fake.calls["nvmlDeviceGetNvLinkState"] == 2 * asked  # then kept


def test_numa_node_from_sysfs(tmp_path: Path) -> None:
    root = Root(tmp_path)
    device = tmp_path / "sys/bus/pci/devices/0000:18:00.0"
    device.mkdir(parents=True)
    for text, expected in (("1\n", 1), ("-1\n", None), ("banana", None), ("0", 0)):
        (device / "numa_node").write_text(text)
        assert numa_node(root, "0000:18:00.0") == expected
    assert numa_node(root, "0000:99:00.0") is None


@pytest.mark.parametrize("text, message", [
    ("gpus: [{model: A30}]\nnvlinks: 4\n", "nvlinks: NVLink all-to-all goes through NVSwitches"),
    ("gpus: [{model: A30, pcie_switch: 'a//b'}]\n", "gpus.0.pcie_switch"),
    ("gpus: [{model: A30, numa_node: -2}]\n", "gpus.0.numa_node"),
])
def test_a_bad_topology_in_a_machine_file_names_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "machine.yaml"
    path.write_text(text)
    with pytest.raises(AgentError) as error:
        load_machine_file(path)
    assert str(path) in str(error.value) and message in str(error.value)


def _config(tmp_path: Path) -> Any:
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\n")
    return load_config(path, required=True)


def test_a_capture_of_a_simulated_dgx_replays_its_topology(tmp_path: Path) -> None:
    runtime = Runtime.build(Root(tmp_path / "original"), _config(tmp_path), "dgx-a100")
    try:
        SimModprobe(runtime.machine, runtime.root).load("nvidia")
        manifest = capture(runtime.root, runtime.nvml.lib, tmp_path / "capture", 5.0, "--simulate dgx-a100",
                           "simulated")
        original = runtime.nvml.inventory.read()
    finally:
        runtime.nvml.close()
    assert manifest["problems"] == []
    replayed = Runtime.build(Root(tmp_path / "replayed"), _config(tmp_path), str(tmp_path / "capture"))
    try:
        inventory = replayed.nvml.inventory.read()
        assert inventory.links == original.links and set(kinds(inventory).values()) == {"NV12"}
        assert [gpu.numa_node for gpu in inventory.gpus] == [gpu.numa_node for gpu in original.gpus]
        asyncio.run(replayed.engine.reconcile(force=True))
        status = replayed.state.to_json()["gpus"]
        assert status[0]["numa_node"] == 0 and status[0]["links"]["7"] == "NV12" and "0" not in status[0]["links"]
    finally:
        replayed.nvml.close()


def test_preferred_allocation_on_simulated_machines(simulated: Any) -> None:
    _, dgx = simulated("dgx-h100")
    inventory = dgx.inventory.read()
    uuids = [gpu.uuid for gpu in inventory.gpus]
    assert preferred(uuids, [], 4, inventory) == uuids[:4]
    assert preferred(uuids[2:], [uuids[5]], 3, inventory) == [uuids[5], uuids[4], uuids[6]]
    _, box = simulated(str(PCIE_MACHINE), "pcie")
    inventory = box.inventory.read()
    uuids = [gpu.uuid for gpu in inventory.gpus]
    assert preferred([uuids[i] for i in (2, 3, 4, 5, 6)], [], 3, inventory) == [uuids[4], uuids[5], uuids[6]]
