"""Issue 38, the agent's own users of a GPU it passes through: its MPS control daemon serving the GPU quits before
the unbind (its server is no foreign process: no refusal), the MPS watch then starts it on the GPUs left; the
device plugin's lists leave the GPU out before it is unbound; a pod the kubelet's pod-resources API says holds
it refuses the switch, named in the stage's facts (/status)."""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.server import Server
from harness import SimNode
from kubelet_api import deviceplugin_pb2 as api
from kubelet_api.deviceplugin_grpc import DevicePluginStub
from test_plugin_service import PLUGIN_DIR, Registrations
from test_pod_labels import Kubelet, claims_response, response

from gpu_agent.daemon.app import Runtime
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.host.sockets import socket_address
from gpu_agent.mps.daemons import MpsManager, Timing
from gpu_agent.nvml.client import Nvml
from gpu_agent.plugin.service import DevicePluginManager
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.mps import SimMpsControl
from gpu_agent.sim.pci import gpu_driver
from gpu_agent.state import AgentState
from gpu_agent.config import load_config

VM = {"gpus": {"4": "vm-passthrough", "5": "vm-passthrough", "6": "vm-passthrough", "7": "vm-passthrough"}}
MPS = {"enabled": True, "sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2}]}}}
GPU = "nvidia.com/gpu"
EXCLUSIVE, DEFAULT = 3, 0  # NVML's compute modes as the simulator keeps them
AT_ONCE = Timing(poll_s=0.05, probe_s=0.0, backoff_s=(0.0, 0.0))


def _drivers(node: SimNode) -> list[Any]:
    state = node.machine.read()
    return [gpu_driver(state, gpu) for gpu in state["gpus"]]


def _watch(node: SimNode, state: AgentState, nvml: Nvml) -> MpsManager:
    root = Root(node.root).with_kernel(node.machine.kernel_dir)
    return MpsManager(root, state, SimMpsControl(node.machine, 0.2), nvml.inventory, lambda: None, AT_ONCE)


def test_the_agents_mps_daemon_is_no_blocker_quits_before_the_unbind_and_comes_back_on_the_others(
        tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "dgx-h100")
    config = {"toolkit": {"enabled": False}, "plugin": MPS}
    first = node.apply(config)
    nvml = Nvml(FakeNvml(node.machine))
    try:
        asyncio.run(_watch(node, first.state, nvml).sync())
        daemon = node.machine.read()["mps"][GPU]
        uuids = [gpu["uuid"] for gpu in node.machine.read()["gpus"]]
        assert daemon["alive"] and daemon["visible_devices"].split(",") == uuids
        # A pod's process used the daemon and ended: its server stays, every GPU of the daemon's open.
        node.sim("add-process", "--gpu", "4", "--pid", "4242", "--name", "train.py", "--mps", GPU)
        node.sim("clear")
        assert len(node.machine.read()["mps"][GPU]["servers"]) == 1

        switched = node.apply({**config, "workload": VM})
        vfio = switched.stage("vfio")
        assert vfio.state == "ok", vfio.message
        assert _drivers(node) == ["nvidia"] * 4 + ["vfio-pci"] * 4
        kinds = [change.kind for change in switched.changes("vfio")]
        assert kinds.index("StopMpsDaemon") < kinds.index("UnbindPciFunction")  # quit before the first unbind
        assert not node.machine.read()["mps"][GPU]["alive"]
        modes = [gpu.get("compute_mode", DEFAULT) for gpu in node.machine.read()["gpus"]]
        assert modes[:4] == [EXCLUSIVE] * 4  # kept for the daemon's next start on them
        assert set(Ledger(Root(node.root)).compute_modes()) == set(uuids[:4])  # GPUs 4-7's were put back

        asyncio.run(_watch(node, switched.state, nvml).sync())  # the MPS watch: started again without 4-7
        daemon = node.machine.read()["mps"][GPU]
        assert daemon["alive"] and daemon["visible_devices"].split(",") == uuids[:4]
    finally:
        nvml.close()


def test_a_pod_holding_a_gpu_refuses_its_switch_and_the_facts_say_which(tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "dgx-h100")
    config: dict[str, Any] = {"toolkit": {"enabled": False}}
    node.apply(config)
    uuids = [gpu["uuid"] for gpu in node.machine.read()["gpus"]]
    kubelet = Kubelet(node.root)
    try:
        kubelet.answer = response(("ml", "trainer", {"main": {GPU: [uuids[6]]}}),
                                  ("ml", "other", {"main": {GPU: [uuids[1]]}}))
        switched = node.apply({**config, "workload": VM})
    finally:
        kubelet.stop()
    vfio = switched.stage("vfio")
    assert vfio.state == "failed"
    assert "GPU 6 (0000:ba:00.0) not passed through: pod ml/trainer holds it" in vfio.message
    assert "ml/other" not in vfio.message  # GPU 1 stays in the container path
    assert _drivers(node) == ["nvidia"] * 4 + ["vfio-pci", "vfio-pci", "nvidia", "vfio-pci"]
    reasons = {gpu["index"]: gpu["reason"] for gpu in vfio.facts["gpus"]}
    assert reasons[6] == "pod ml/trainer holds it" and reasons[5] is None


def test_a_pod_whose_resource_claim_holds_a_gpu_refuses_its_switch(tmp_path: Path) -> None:
    """A GPU the agent's DRA plugin gave a claim (pod-resources' DynamicResources, by its device name gpu-<minor>)
    is held as a device plugin's is; another driver's device of the same name is not the GPU."""
    node = SimNode(tmp_path / "root", "dgx-h100")
    config: dict[str, Any] = {"toolkit": {"enabled": False}}
    node.apply(config)
    kubelet = Kubelet(node.root)
    try:
        kubelet.answer = claims_response(("ml", "trainer", "main", "big-gpu", "ml", [("gpu.nvidia.com", "n", "gpu-5")]),
                                         ("ml", "nic", "main", "fpga", "ml", [("example.com", "n", "gpu-7")]))
        switched = node.apply({**config, "workload": VM})
    finally:
        kubelet.stop()
    vfio = switched.stage("vfio")
    assert vfio.state == "failed"
    reasons = {gpu["index"]: gpu["reason"] for gpu in vfio.facts["gpus"]}
    assert reasons[5] == "pod ml/trainer holds it" and reasons[7] is None
    assert _drivers(node)[4:] == ["vfio-pci", "nvidia", "vfio-pci", "vfio-pci"]


class _Watched:
    """The simulated kernel's PCI writes, each unbind noting what the device plugin's nvidia.com/gpu lists then."""

    def __init__(self, pci: Any, manager: DevicePluginManager) -> None:
        self.pci, self.manager = pci, manager
        self.at_unbind: dict[str, list[int]] = {}

    def write(self, path: str, value: str) -> None:
        if path == "/sys/bus/pci/drivers/nvidia/unbind":
            devices = self.manager.endpoints[GPU].feed.resource.devices
            self.at_unbind[value] = sorted(device.gpu_index for device in devices)
        self.pci.write(path, value)


def test_the_device_plugin_stops_advertising_a_gpu_before_it_is_unbound(tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "dgx-h100")
    first = node.apply({"toolkit": {"enabled": False}})
    directory = node.root / PLUGIN_DIR
    directory.mkdir(parents=True)
    (tmp_path / "config.yaml").write_text("version: v1\ntoolkit: {enabled: false}\nplugin: {enabled: true}\n"
                                          "workload: {gpus: {'4': vm-passthrough, '5': vm-passthrough}}\n")
    runtime = Runtime.build(Root(node.root), load_config(tmp_path / "config.yaml", required=True), "dgx-h100")
    gate = runtime.plugin_gate
    state = first.state
    state.config = runtime.state.config

    async def scenario() -> dict[str, Any]:
        registrations = Registrations()
        kubelet = Server([registrations])
        address, fd = socket_address(directory / "kubelet.sock")
        await kubelet.start(path=address)
        manager = DevicePluginManager(Root(node.root), state, gate)
        loop, syncs = asyncio.get_running_loop(), []
        # As the daemon wires it: the gate's listener has the plugin sync on the loop, from the stage's thread.
        gate.listener = lambda: loop.call_soon_threadsafe(lambda: syncs.append(loop.create_task(manager.sync())))
        gate.serving(True)
        await manager.sync()
        stage = runtime.vfio_stage(runtime.state.config.config)
        assert stage is not None
        watched = stage.pci = _Watched(stage.pci, manager)
        try:
            assert GPU in manager.endpoints, state.plugin
            plugin_address, plugin_fd = socket_address(directory / "nvidia-gpu.sock")
            channel = Channel(path=plugin_address)
            lists: list[list[str]] = []
            async with DevicePluginStub(channel).ListAndWatch.open() as stream:
                await stream.send_message(api.Empty(), end=True)
                lists.append(sorted(d.ID for d in (await stream.recv_message()).devices))

                def one_pass() -> None:
                    observed = stage.observe()
                    for action in stage.plan(observed):
                        action.execute()
                done = threading.Thread(target=one_pass)
                done.start()
                while done.is_alive():
                    await asyncio.sleep(0.02)
                done.join()
                lists.append(sorted(d.ID for d in (await asyncio.wait_for(stream.recv_message(), 10)).devices))
                await stream.cancel()  # a ListAndWatch stream ends only with its resource
            channel.close()
            for descriptor in (fd, plugin_fd):
                if descriptor is not None:
                    os.close(descriptor)
            return {"lists": lists, "at_unbind": watched.at_unbind}
        finally:
            await asyncio.gather(*syncs, return_exceptions=True)
            await manager.stop_all()
            gate.serving(False)
            kubelet.close()
            await kubelet.wait_closed()
            runtime.nvml.close()

    result = asyncio.run(scenario())
    assert len(result["lists"][0]) == 8 and len(result["lists"][1]) == 6
    # At each unbind, the list the plugin serves (and streams) already leaves both GPUs out.
    assert result["at_unbind"] == {"0000:9a:00.0": [0, 1, 2, 3, 6, 7], "0000:ab:00.0": [0, 1, 2, 3, 6, 7]}
    assert _drivers(node)[4:6] == ["vfio-pci", "vfio-pci"]


def test_the_sampler_leaves_gpus_being_passed_through_alone(tmp_path: Path) -> None:
    """Between the switch and the pass's discovery, the inventory still lists GPUs 4-7, which NVML no longer
    sees: read, they would fail (query errors, unhealthy transitions on /metrics); the vfio stage's `leaving`
    keeps the sampler off them, and the other GPUs are sampled."""
    from gpu_agent.metrics.sampler import Sampler

    node = SimNode(tmp_path / "root", "dgx-h100")
    before = node.apply({"toolkit": {"enabled": False}}).state  # its inventory: eight GPUs
    node.apply({"toolkit": {"enabled": False}, "workload": VM})
    assert _drivers(node)[4:] == ["vfio-pci"] * 4
    nvml = Nvml(FakeNvml(node.machine))
    try:
        leaving = frozenset(("0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"))
        Sampler(nvml, before, Root(node.root), lambda: leaving).sample()
        assert len(before.samples) == 4 and not before.health_transitions
        assert all(health.healthy for health in before.health.values())
        Sampler(nvml, before, Root(node.root)).sample()  # without it: the errors the daemon logged
        assert sorted(key for key, _ in before.health_transitions) == sorted(gpu.uuid for gpu in
                                                                             before.inventory.gpus[4:])
    finally:
        nvml.close()


def test_a_gpu_the_stage_starts_moving_while_the_sampler_reads_it_is_not_a_failure(tmp_path: Path) -> None:
    """The race the daemon test met on a loaded machine: the sampler read `leaving` (empty), then the vfio stage
    marked GPUs 4-7 leaving and unbound them, and their readings failed in the same sample. Those failures are
    the move, not the GPUs: no query error, no unhealthy transition; GPUs 0-3 are sampled."""
    from gpu_agent.metrics.sampler import Sampler

    node = SimNode(tmp_path / "root", "dgx-h100")
    before = node.apply({"toolkit": {"enabled": False}}).state
    node.apply({"toolkit": {"enabled": False}, "workload": VM})
    nvml = Nvml(FakeNvml(node.machine))
    answers = iter((frozenset(),))  # the first read: before the stage marked them
    leaving = frozenset(("0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"))
    try:
        Sampler(nvml, before, Root(node.root), lambda: next(answers, leaving)).sample()
        assert len(before.samples) == 4 and not before.health_transitions
        assert not any(health.query_error for health in before.health.values())
    finally:
        nvml.close()
