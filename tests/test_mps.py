"""MPS sharing (issue 24's device plugin config class, issue 25): NVIDIA's sharing config replayed as
upstream's tests state it, and the MPS control daemons run by the agent on a simulated DGX H100."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from gpu_agent.config.loader import LoadedConfig, parse_config, validated
from gpu_agent.config.plugin import PluginConfig
from gpu_agent.errors import AgentError, ConfigError
from gpu_agent.host.ledger import Ledger, OwnedMount
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import compute
from gpu_agent.cli.status import print_mps
from gpu_agent.mps.control import DaemonSpec
from gpu_agent.mps.daemons import MpsManager, Timing, stop_daemon
from gpu_agent.mps.layout import SHM_DIR as SHM
from gpu_agent.plan import RemoveFile, SetComputeMode, StopMpsDaemon, Unmount
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.nvml.model import Gpu, Inventory, MigState
from gpu_agent.plugin.allocate import AllocationError, allocate
from gpu_agent.plugin.devices import GPU_RESOURCE, advertised, sharing
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.mps import SimMpsControl, kill
from gpu_agent.state import AgentState

# NVIDIA/k8s-device-plugin api/config/v1/replicas_test.go at 1b826acc6af3079d8923bac395c3124b8861a9a6:
# TestUnmarshalReplicatedDevices (input -> accepted?) ...
UPSTREAM_DEVICES = [
    ('"not-all"', False), ("-2", False), ("2.0", False), ("[-1]", False), ('["-1"]', False),
    ('["invalid-UUID"]', False), ('["GPU-UUID"]', False), ('["MIG-UUID"]', False),
    ('["MIG-GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"]', False),
    ('"all"', True), ("2", True), ("[0]", True), ('["0"]', True), ('["0:0"]', True),
    ('["GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"]', True), ('["MIG-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"]', True),
    ('["MIG-GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c/0/0"]', True),
    ('[0, "0:0", "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"]', True),
    ('["0", "0:0", "GPU-4cf8db2d-06c0-7d70-1a51-e59b25b2c16c"]', True),
]
# ... TestUnmarshalReplicatedResource (a resource -> its name as upstream stores it, or None: refused) ...
UPSTREAM_RESOURCE = [
    ({}, None), ({"name": "valid"}, None), ({"name": "valid", "devices": "all"}, None),
    ({"name": "valid", "devices": "all", "rename": "valid-shared"}, None),
    ({"name": "valid", "devices": "all", "replicas": 2}, "nvidia.com/valid"),
    ({"name": "valid", "devices": "all", "replicas": 2, "rename": "valid-shared"}, "nvidia.com/valid"),
    ({"name": "valid", "replicas": -1}, None), ({"name": "valid", "replicas": 0}, None),
    ({"name": "valid", "replicas": 2}, "nvidia.com/valid"),
    ({"name": "valid", "replicas": 2, "rename": "valid-shared"}, "nvidia.com/valid"),
    ({"name": "$invalid$", "replicas": 2, "rename": "valid-shared"}, None),
    ({"name": "valid", "replicas": 2, "rename": "$invalid$"}, None),
]
# ... and TestUnmarshalReplicatedResources (the block -> accepted?), for timeSlicing and mps alike.
UPSTREAM_RESOURCES = [
    ({}, False), ({"resources": []}, False), ({"resources": [{"name": "valid", "replicas": 2}]}, True),
    ({"resources": [{"name": "valid1", "replicas": 2}, {"name": "valid2", "replicas": 2}]}, True),
    ({"resources": [{"name": "$invalid$", "replicas": 2}]}, False),
]


def accepted(block: dict[str, Any], key: str = "timeSlicing") -> bool:
    try:
        validated(PluginConfig, {"sharing": {key: block}})
    except Exception:  # pydantic's ValidationError: the config loader reports it with file and key
        return False
    return True


@pytest.mark.parametrize("devices, ok", UPSTREAM_DEVICES)
def test_upstream_devices_cases(devices: str, ok: bool) -> None:
    import json
    block = {"resources": [{"name": "gpu", "replicas": 2, "devices": json.loads(devices)}]}
    assert accepted(block) is ok


def test_upstream_resource_and_resources_cases() -> None:
    for key in ("timeSlicing", "mps"):
        for resource, name in UPSTREAM_RESOURCE:
            assert accepted({"resources": [resource]}, key) is (name is not None), (key, resource)
            if name:
                chosen = validated(PluginConfig, {"sharing": {key: {"resources": [resource]}}}).sharing.replicated
                assert chosen is not None and chosen.resources[0].name == name
        for block, ok in UPSTREAM_RESOURCES:
            assert accepted(block, key) is ok, (key, block)


def test_mps_config_semantics_and_errors() -> None:
    mps = validated(PluginConfig, {"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 4}]}}}).sharing
    assert mps.strategy == "mps" and mps.fail_requests_greater_than_one  # NVIDIA's NewConfig: true unless set
    relaxed = {"failRequestsGreaterThanOne": False, "resources": [{"name": "gpu", "replicas": 4}]}
    assert not validated(PluginConfig, {"sharing": {"mps": relaxed}}).sharing.fail_requests_greater_than_one
    head = "version: v1\nplugin:\n  sharing:\n    mps:\n      resources:\n      - name: "
    for text, error in [
        (head + "gpu\n        replicas: 0\n", "config.yaml:7: plugin.sharing.mps.resources.0.replicas: Input should "
                                            "be greater than or equal to 2"),
        (head + "mig-1g.10gb\n        replicas: 2\n", "config.yaml:3: plugin.sharing: mps.resources.0: "
                                                    "sharing using MPS is not supported for MIG devices"),
        (head + "gpu\n        replicas: 2\n        devices: ['0:1']\n", "not supported for MIG devices"),
        (head + "gpu\n        replicas: 49\n", "maximum allowed replicas exceeded: 49 > 48"),
        (head + "gpu\n        replicas: 2\n    timeSlicing:\n      resources:\n      - {name: gpu, replicas: 2}\n",
         "config.yaml:3: plugin.sharing: timeSlicing and mps are both set"),
        (head + "gpu\n        replicas: 2\nmig:\n  strategy: mixed\n",
         "config.yaml:4: plugin.sharing.mps: using mig.strategy mixed is not supported with MPS"),
        ("version: v1\nplugin:\n  sharing:\n    timeSlicing: {}\n", "config.yaml:4: plugin.sharing.timeSlicing: "
                                                                   "no resources specified"),
    ]:
        with pytest.raises(ConfigError) as caught:
            parse_config(text, "config.yaml")
        assert error in str(caught.value), text


def test_rename_and_devices_are_ignored_as_upstream_unless_opted_in(caplog: pytest.LogCaptureFixture) -> None:
    text = ("version: v1\nplugin:\n  sharing:\n    timeSlicing:\n      resources:\n      - name: gpu\n"
            "        replicas: 2\n        rename: mine\n        devices: 2\n")
    config = parse_config(text, "config.yaml")
    assert "config.yaml:8: plugin.sharing.timeSlicing.resources.0.rename: ignored" in caplog.text
    assert "config.yaml:9: plugin.sharing.timeSlicing.resources.0.devices: ignored" in caplog.text
    assert set(advertised(EIGHT, {}, "none", config.plugin).resources) == {GPU_RESOURCE}  # all 8 GPUs, own name
    assert len(advertised(EIGHT, {}, "none", config.plugin).resources[GPU_RESOURCE].devices) == 16
    opted = parse_config(text.replace("plugin:\n", "plugin:\n  per_resource_sharing: true\n"), "c")
    found = advertised(EIGHT, {}, "none", opted.plugin).resources
    assert len(found["nvidia.com/mine"].devices) == 4 and len(found[GPU_RESOURCE].devices) == 6


def h100(index: int, uuid: str = "") -> Gpu:
    return Gpu(index, uuid or f"GPU-{index:08d}-0000-0000-0000-000000000000", f"00000000:{0x18 + index:02X}:00.0",
               "NVIDIA H100 80GB HBM3", 81559, (9, 0), index, MigState(True, False, False, ()))


EIGHT = Inventory("550.90.07", "12.4", tuple(h100(i) for i in range(8)))
MPS4 = ("version: v1\nplugin:\n  enabled: true\n  sharing:\n    mps:\n      resources:\n"
        "      - name: nvidia.com/gpu\n        replicas: 4\n")
FAST = Timing(poll_s=0.05, backoff_s=(0.05, 0.2))  # a dead daemon seen and started again in a tenth of a second


@dataclass
class SimDgx:
    """A simulated DGX H100 with its driver loaded: its inventory, NVML's compute modes, the MPS agent state."""

    root: Root
    machine: MachineState
    inventory: Inventory
    nvml: Nvml

    @classmethod
    def make(cls, path: Path) -> SimDgx:
        root = Root(path)
        machine = MachineState(root)
        machine.ensure("dgx-h100")
        SimModprobe(machine, root.with_kernel(machine.kernel_dir)).load("nvidia")
        gpus = tuple(h100(i, gpu["uuid"]) for i, gpu in enumerate(machine.read()["gpus"]))
        return cls(root, machine, Inventory(EIGHT.driver_version, EIGHT.cuda_version, gpus), Nvml(FakeNvml(machine)))

    def state(self, config: str = MPS4) -> AgentState:
        return AgentState(LoadedConfig(parse_config(config, "c"), "c", "d"), inventory=self.inventory)

    def manager(self, state: AgentState) -> MpsManager:
        return MpsManager(self.root, state, SimMpsControl(self.machine, 0.2), self.nvml.inventory, lambda: None, FAST)

    def compute_modes(self) -> list[int]:
        return [gpu.get("compute_mode", 0) for gpu in self.machine.read()["gpus"]]


@pytest.fixture
def dgx(tmp_path: Path) -> Iterator[SimDgx]:
    node = SimDgx.make(tmp_path)
    yield node
    node.nvml.close()


def test_mps_daemons_on_a_simulated_dgx_h100(dgx: SimDgx, capsys: pytest.CaptureFixture[str]) -> None:
    root, machine, inventory, tmp_path = dgx.root, dgx.machine, dgx.inventory, dgx.root.path
    state = dgx.state()
    manager = dgx.manager(state)

    async def scenario() -> None:
        task = asyncio.create_task(manager.run())
        try:
            await _until(lambda: bool(state.mps and state.mps["daemons"][0]["up"]), 5)
            daemon = machine.read()["mps"][GPU_RESOURCE]
            assert daemon["thread_percentage"] == 25.0
            assert daemon["visible_devices"] == ",".join(gpu.uuid for gpu in inventory.gpus)
            assert daemon["pinned_mem_limits"] == {str(n): f"{81559 // 4}M" for n in range(8)}  # a quarter of each
            assert dgx.compute_modes() == [3] * 8  # EXCLUSIVE_PROCESS, as NVIDIA's daemon sets them
            assert state.mps["daemons"][0]["compute_mode"] == "EXCLUSIVE_PROCESS"
            assert state.mps["daemons"][0]["compute_modes_before"] == {str(n): "DEFAULT" for n in range(8)}
            resource = advertised(inventory, {}, "none", state.config.config.plugin, mps_down=state.mps_down).resources[
                GPU_RESOURCE]
            assert len(resource.devices) == 32 and resource.strategy == "mps"
            assert all(device.healthy for device in resource.devices)
            given = allocate(resource, [resource.devices[5].id], "cdi-cri", True)
            assert given.envs == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe"}
            assert given.mounts == (("/mps/nvidia.com/gpu/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe"),
                                    ("/dev/shm", SHM))  # the daemons' tmpfs, not the host's /dev/shm
            shm_options = "nosuid,nodev,noexec,mode=1777,size=65536k"  # the simulated node has no /proc/meminfo
            assert machine.read()["mounts"] == {SHM: {"fstype": "tmpfs", "source": "shm", "options": shm_options}}
            assert daemon["shm"] == {"source": SHM, "target": "/dev/shm", "options": shm_options}  # mps.launch's
            assert Ledger(root).mounts() == {SHM: OwnedMount(SHM, "tmpfs", shm_options, made=True)}
            assert given.cdi_devices == (f"nvidia.com/gpu={inventory.gpus[1].uuid}",)
            with pytest.raises(AllocationError, match="maximum request size for shared resources is 1"):
                allocate(resource, [d.id for d in resource.devices[:2]], "envvar", True)
            assert tmp_path.joinpath("run/nvidia/mps/nvidia.com/gpu/pipe").is_dir()

            kill(machine)
            await _until(lambda: GPU_RESOURCE in state.mps_down, 2)
            down = advertised(inventory, {}, "none", state.config.config.plugin, mps_down=state.mps_down)
            assert not any(d.healthy for d in down.resources[GPU_RESOURCE].devices)
            await _until(lambda: not state.mps_down, 5)  # started again after its backoff
            assert state.mps is not None and state.mps["daemons"][0]["restarts"] == 1
            from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
            exposed = render(make_registry(AgentCollector(state, lambda: 0, None))).decode()
            assert 'gpu_agent_mps_daemon_restarts_total{resource="nvidia.com/gpu"} 1' in exposed
            print_mps(state.mps)
            header, row = capsys.readouterr().out.strip().splitlines()
            assert header.split() == ["MPS", "RESOURCE", "GPUS", "PID", "THREADS", "MEMORY", "LIMIT", "RESTARTS",
                                      "STATE"]
            pid = machine.read()["mps"][GPU_RESOURCE]["pid"]
            assert row.split() == ["nvidia.com/gpu", "0,1,2,3,4,5,6,7", str(pid), "25%", "20389M", "per", "GPU", "1",
                                   "running"]

            state.config = LoadedConfig(parse_config("version: v1\nplugin:\n  enabled: true\n", "c"), "c", "e")
            manager.wake()
            await _until(lambda: state.mps is None, 5)
            assert not machine.read()["mps"][GPU_RESOURCE]["alive"]  # sent quit
            assert machine.read()["mounts"] == {} and Ledger(root).mounts() == {}  # unmounted, its directory gone
            assert not tmp_path.joinpath("run/nvidia/mps").exists() and Ledger(root).mps_directories() == {}
            assert dgx.compute_modes() == [0] * 8 and Ledger(root).compute_modes() == {}  # DEFAULT again
        finally:
            task.cancel()

    asyncio.run(scenario())


def test_a_pipe_directory_that_is_a_file_is_refused_and_nothing_starts(dgx: SimDgx,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    pipe = dgx.root.path / "run/nvidia/mps/nvidia.com/gpu/pipe"
    pipe.parent.mkdir(parents=True)
    pipe.write_text("not a directory")
    state = dgx.state()
    asyncio.run(dgx.manager(state).sync())
    assert state.mps is not None and "/run/nvidia/mps/nvidia.com/gpu/pipe: not a directory" in (
        state.mps["daemons"][0]["error"] or "")
    assert "mps" not in dgx.machine.read() and pipe.read_text() == "not a directory"
    assert dgx.compute_modes() == [0] * 8 and Ledger(dgx.root).compute_modes() == {}
    assert GPU_RESOURCE in state.mps_down
    print_mps(state.mps)
    table = capsys.readouterr().out
    assert table.splitlines()[2].split() == ["nvidia.com/gpu", "-", "-", "-", "none", "0", "down"]  # nothing runs
    assert "MPS nvidia.com/gpu down: /run/nvidia/mps/nvidia.com/gpu/pipe: not a directory" in table


def test_mps_labels_follow_gfd() -> None:
    settings = parse_config(MPS4, "c").plugin
    labels = compute(EIGHT, True, "none", None, sharing(EIGHT, "none", settings))
    assert labels["nvidia.com/mps.capable"] == "true" and labels["nvidia.com/gpu.sharing-strategy"] == "mps"
    assert labels["nvidia.com/gpu.replicas"] == "4" and labels["nvidia.com/gpu.product"].endswith("-SHARED")


async def _until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_uninstall_stops_the_daemons_then_restores_compute_modes_and_removes_directories(dgx: SimDgx) -> None:
    from harness import SimNode

    with dgx.machine.edit() as sim:
        sim["gpus"][0]["compute_mode"] = 2  # PROHIBITED before the agent: put back as it was
    asyncio.run(dgx.manager(dgx.state()).sync())
    assert dgx.root.path.joinpath("run/nvidia/mps/nvidia.com/gpu/log").is_dir() and dgx.compute_modes() == [3] * 8
    node = SimNode(dgx.root.path, "dgx-h100")
    pid = dgx.machine.read()["mps"][GPU_RESOURCE]["pid"]
    planned = node.uninstall(dry_run=True).changes("owned-files")
    first = dgx.inventory.gpus[0].uuid
    assert planned[0] == StopMpsDaemon(GPU_RESOURCE, pid) and SetComputeMode(first, "PROHIBITED") in planned
    assert RemoveFile("/run/nvidia/mps/nvidia.com/gpu/pipe") in planned
    assert planned.index(StopMpsDaemon(GPU_RESOURCE, pid)) < planned.index(Unmount(SHM)) < planned.index(
        RemoveFile("/run/nvidia/mps"))
    assert dgx.machine.read()["mps"][GPU_RESOURCE]["alive"] and dgx.compute_modes() == [3] * 8  # a dry run: nothing
    assert SHM in dgx.machine.read()["mounts"]
    assert node.uninstall().ok
    assert not dgx.machine.read()["mps"][GPU_RESOURCE]["alive"] and dgx.compute_modes() == [2] + [0] * 7
    assert not dgx.root.path.joinpath("run/nvidia/mps").exists()
    assert Ledger(dgx.root).mps_directories() == {} and Ledger(dgx.root).compute_modes() == {}
    assert dgx.machine.read()["mounts"] == {} and Ledger(dgx.root).mounts() == {}


def test_a_compute_mode_nvml_refuses_keeps_the_daemon_down_naming_why(dgx: SimDgx) -> None:
    with dgx.machine.edit() as sim:
        sim["faults"].append({"id": 1, "call": "nvmlDeviceSetComputeMode", "error": "NoPermission", "gpu": 3,
                              "times": None})
    state = dgx.state()
    asyncio.run(dgx.manager(state).sync())
    assert state.mps is not None and state.mps["daemons"][0]["error"] == (
        f"cannot set GPU 3 to EXCLUSIVE_PROCESS compute mode, which MPS needs: GPU {dgx.inventory.gpus[3].uuid}: "
        "nvmlDeviceSetComputeMode: Insufficient Permissions")
    assert "mps" not in dgx.machine.read() and GPU_RESOURCE in state.mps_down
    assert Ledger(dgx.root).compute_modes()[dgx.inventory.gpus[3].uuid] == ("DEFAULT", GPU_RESOURCE)


def test_a_daemon_that_does_not_answer_quit_gets_sigterm(tmp_path: Path) -> None:
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h100")
    control = SimMpsControl(machine, 0.05)
    spec = DaemonSpec.left(GPU_RESOURCE)
    with pytest.raises(AgentError, match="/run/nvidia/mps/shm is not a mounted tmpfs"):  # as mps.launch refuses
        control.start(spec)
    tmp_path.joinpath(SHM.lstrip("/")).mkdir(parents=True)
    control.mount_shm("mode=1777")
    control.start(spec)
    with machine.edit() as sim:
        sim["faults"].append({"id": 1, "call": "mps", "error": "hang", "times": None})
    assert stop_daemon(control, spec, wait_s=0.1) is None and control.pid(spec) is None


def test_a_tmpfs_gpu_agent_did_not_mount_is_refused_and_nothing_starts(dgx: SimDgx) -> None:
    dgx.root.path.joinpath(SHM.lstrip("/")).mkdir(parents=True)
    with dgx.machine.edit() as sim:  # NVIDIA's mps-control-daemon mounts one there too
        sim["mounts"] = {SHM: {"fstype": "tmpfs", "source": "shm", "options": "rw"}}
    state = dgx.state()
    asyncio.run(dgx.manager(state).sync())
    assert state.mps is not None and (state.mps["daemons"][0]["error"] or "").startswith(
        f"{SHM}: a tmpfs file system is mounted there, not gpu-agent's")
    assert "mps" not in dgx.machine.read() and dgx.compute_modes() == [0] * 8 and Ledger(dgx.root).mounts() == {}
    assert dgx.machine.read()["mounts"][SHM]["options"] == "rw"  # left as it was


def test_an_adopted_daemon_started_with_the_hosts_dev_shm_is_started_again_with_the_tmpfs(dgx: SimDgx) -> None:
    asyncio.run(dgx.manager(dgx.state()).sync())
    with dgx.machine.edit() as sim:  # as a gpu-agent from before the tmpfs left it
        pid = sim["mps"][GPU_RESOURCE].pop("shm") and sim["mps"][GPU_RESOURCE]["pid"]
        del sim["mounts"][SHM]
    state = dgx.state()
    manager = dgx.manager(state)
    asyncio.run(manager.sync())  # adopted, the tmpfs mounted again, the daemon found without it, started again
    daemon = dgx.machine.read()["mps"][GPU_RESOURCE]
    assert daemon["alive"] and daemon["pid"] != pid and daemon["shm"]["source"] == SHM
    assert state.mps is not None and state.mps["daemons"][0]["up"] and set(Ledger(dgx.root).mounts()) == {SHM}


def test_a_gpu_off_the_bus_keeps_the_daemon_serving_the_others(dgx: SimDgx) -> None:
    """GPU 3 falls off the bus (NVML: GPU_IS_LOST, discovery keeps it as last read, unreadable): the running
    daemon is not restarted (its clients on the other GPUs keep their server); one that dies starts again on
    the seven GPUs NVML reads, whose compute modes it can set; GPU 3 back, the daemon is started on all eight."""
    state = dgx.state()
    manager = dgx.manager(state)
    lost = replace(dgx.inventory.gpus[3], unreadable="nvmlDeviceGetHandleByIndex: GPU is lost",
                   known_from="last reading")
    uuids = [gpu.uuid for gpu in dgx.inventory.gpus]

    async def scenario() -> None:
        task = asyncio.create_task(manager.run())
        try:
            await _until(lambda: bool(state.mps and state.mps["daemons"][0]["up"]), 5)
            pid = dgx.machine.read()["mps"][GPU_RESOURCE]["pid"]
            with dgx.machine.edit() as sim:
                sim["lost_gpus"] = [3]
            state.inventory = replace(dgx.inventory, gpus=(*dgx.inventory.gpus[:3], lost, *dgx.inventory.gpus[4:]))
            await manager.sync()
            daemon = dgx.machine.read()["mps"][GPU_RESOURCE]
            assert daemon["alive"] and daemon["pid"] == pid and not state.mps_down  # kept as it runs
            assert state.mps is not None and state.mps["daemons"][0]["restarts"] == 0

            kill(dgx.machine)
            await _until(lambda: bool(state.mps and state.mps["daemons"][0]["restarts"] == 1 and not state.mps_down),
                         5)
            daemon = dgx.machine.read()["mps"][GPU_RESOURCE]
            assert daemon["visible_devices"] == ",".join(uuids[:3] + uuids[4:])  # GPU 3 left out
            assert state.mps["daemons"][0]["gpus"] == [0, 1, 2, 4, 5, 6, 7]
            assert dgx.compute_modes() == [3] * 8  # GPU 3's was set before it was lost, and left alone

            with dgx.machine.edit() as sim:
                sim["lost_gpus"] = []
            state.inventory = dgx.inventory
            manager.wake()
            await _until(lambda: dgx.machine.read()["mps"][GPU_RESOURCE]["visible_devices"] == ",".join(uuids)
                         and dgx.machine.read()["mps"][GPU_RESOURCE]["alive"], 5)
        finally:
            task.cancel()

    asyncio.run(scenario())
