"""MPS sharing (issue 24's device plugin config class, issue 25): NVIDIA's sharing config replayed as
upstream's tests state it, and the MPS control daemons run by the agent on a simulated DGX H100."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from gpu_agent.config.loader import LoadedConfig, parse_config, validated
from gpu_agent.config.plugin import PluginConfig
from gpu_agent.errors import ConfigError
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import compute
from gpu_agent.cli.status import print_mps
from gpu_agent.mps.control import DaemonSpec
from gpu_agent.mps.daemons import MpsManager, Timing, stop_daemon
from gpu_agent.plan import RemoveFile, StopMpsDaemon
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


def h100(index: int) -> Gpu:
    return Gpu(index, f"GPU-{index:08d}-0000-0000-0000-000000000000", f"00000000:{0x18 + index:02X}:00.0",
               "NVIDIA H100 80GB HBM3", 81559, (9, 0), index, MigState(True, False, False, ()))


EIGHT = Inventory("550.90.07", "12.4", tuple(h100(i) for i in range(8)))
MPS4 = ("version: v1\nplugin:\n  enabled: true\n  sharing:\n    mps:\n      resources:\n"
        "      - name: nvidia.com/gpu\n        replicas: 4\n")
FAST = Timing(poll_s=0.05, backoff_s=(0.05, 0.2))  # a dead daemon seen and started again in a tenth of a second


def test_mps_daemons_on_a_simulated_dgx_h100(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = Root(tmp_path)
    machine = MachineState(root)
    machine.ensure("dgx-h100")
    state = AgentState(LoadedConfig(parse_config(MPS4, "c"), "c", "d"), inventory=EIGHT)
    manager = MpsManager(root, state, SimMpsControl(machine, 0.2), lambda: None, FAST)

    async def scenario() -> None:
        task = asyncio.create_task(manager.run())
        try:
            await _until(lambda: bool(state.mps and state.mps["daemons"][0]["up"]), 5)
            daemon = machine.read()["mps"][GPU_RESOURCE]
            assert daemon["thread_percentage"] == 25.0
            assert daemon["visible_devices"] == ",".join(gpu.uuid for gpu in EIGHT.gpus)
            assert daemon["pinned_mem_limits"] == {str(n): f"{81559 // 4}M" for n in range(8)}  # a quarter of each
            resource = advertised(EIGHT, {}, "none", state.config.config.plugin, mps_down=state.mps_down).resources[
                GPU_RESOURCE]
            assert len(resource.devices) == 32 and resource.strategy == "mps"
            assert all(device.healthy for device in resource.devices)
            given = allocate(resource, [resource.devices[5].id], "cdi-cri", True)
            assert given.envs == {"CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe"}
            assert given.mounts == (("/mps/nvidia.com/gpu/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe"),
                                    ("/dev/shm", "/dev/shm"))
            assert given.cdi_devices == (f"nvidia.com/gpu={EIGHT.gpus[1].uuid}",)
            with pytest.raises(AllocationError, match="maximum request size for shared resources is 1"):
                allocate(resource, [d.id for d in resource.devices[:2]], "envvar", True)
            assert tmp_path.joinpath("run/nvidia/mps/nvidia.com/gpu/pipe").is_dir()

            kill(machine)
            await _until(lambda: GPU_RESOURCE in state.mps_down, 2)
            down = advertised(EIGHT, {}, "none", state.config.config.plugin, mps_down=state.mps_down)
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
                                   "up"]

            state.config = LoadedConfig(parse_config("version: v1\nplugin:\n  enabled: true\n", "c"), "c", "e")
            manager.wake()
            await _until(lambda: state.mps is None, 5)
            assert not machine.read()["mps"][GPU_RESOURCE]["alive"]  # sent quit
            assert not tmp_path.joinpath("run/nvidia/mps").exists() and Ledger(root).mps_directories() == {}
        finally:
            task.cancel()

    asyncio.run(scenario())


def test_a_pipe_directory_that_is_a_file_is_refused_and_nothing_starts(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    root = Root(tmp_path)
    machine = MachineState(root)
    machine.ensure("dgx-h100")
    pipe = tmp_path / "run/nvidia/mps/nvidia.com/gpu/pipe"
    pipe.parent.mkdir(parents=True)
    pipe.write_text("not a directory")
    state = AgentState(LoadedConfig(parse_config(MPS4, "c"), "c", "d"), inventory=EIGHT)
    asyncio.run(MpsManager(root, state, SimMpsControl(machine, 0.2), lambda: None).sync())
    assert state.mps is not None and "/run/nvidia/mps/nvidia.com/gpu/pipe: not a directory" in (
        state.mps["daemons"][0]["error"] or "")
    assert "mps" not in machine.read() and pipe.read_text() == "not a directory"
    assert GPU_RESOURCE in state.mps_down
    print_mps(state.mps)
    table = capsys.readouterr().out
    assert table.splitlines()[2].split()[-1] == "down" and "MPS nvidia.com/gpu down: /run/nvidia/mps/nvidia.com/" \
        "gpu/pipe: not a directory" in table


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


def test_uninstall_stops_the_daemons_then_removes_their_directories(tmp_path: Path) -> None:
    from harness import SimNode

    node = SimNode(tmp_path, "dgx-h100")
    node.machine.ensure("dgx-h100")
    root = Root(tmp_path)
    state = AgentState(LoadedConfig(parse_config(MPS4, "c"), "c", "d"), inventory=EIGHT)
    asyncio.run(MpsManager(root, state, SimMpsControl(node.machine, 0.2), lambda: None).sync())
    assert tmp_path.joinpath("run/nvidia/mps/nvidia.com/gpu/log").is_dir()
    pid = node.machine.read()["mps"][GPU_RESOURCE]["pid"]
    planned = node.uninstall(dry_run=True).changes("owned-files")
    assert planned[0] == StopMpsDaemon(GPU_RESOURCE, pid)
    assert RemoveFile("/run/nvidia/mps/nvidia.com/gpu/pipe") in planned
    assert node.machine.read()["mps"][GPU_RESOURCE]["alive"]  # a dry run stops nothing
    assert node.uninstall().ok
    assert not node.machine.read()["mps"][GPU_RESOURCE]["alive"]
    assert not tmp_path.joinpath("run/nvidia/mps").exists() and Ledger(root).mps_directories() == {}


def test_a_daemon_that_does_not_answer_quit_gets_sigterm(tmp_path: Path) -> None:
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h100")
    control = SimMpsControl(machine, 0.05)
    spec = DaemonSpec.left(GPU_RESOURCE)
    control.start(spec)
    with machine.edit() as sim:
        sim["faults"].append({"id": 1, "call": "mps", "error": "hang", "times": None})
    assert stop_daemon(control, spec, wait_s=0.1) is None and control.pid(spec) is None
