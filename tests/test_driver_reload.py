"""Issue 26: a driver upgraded under a loaded module (NVML's version mismatch) is reported, and with
driver.reload: when-idle reloaded as the GPU Operator's upgrade controller does: cordon, wait for the
GPUs to be idle, unload, load, verify, MIG and CDI back, uncordon, the upgrade-state label in order."""
from __future__ import annotations

import asyncio
import json
import lzma
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml
from grpclib.client import Channel
from grpclib.server import Server, Stream

from gpu_agent.config import load_config
from gpu_agent.daemon.app import Runtime
from gpu_agent.host import driver_version
from gpu_agent.host.sockets import socket_address
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.plugin.service import DevicePluginManager
from gpu_agent.errors import AgentError
from gpu_agent.sim.kernel import SimModprobe, loaded_version
from gpu_agent.stages import driver as driver_stage
from gpu_agent.stages.driver_reload import ORDER
from harness import SimNode, run_cli
from kube_emulator import KubeEmulator
from kubelet_api import deviceplugin_pb2 as pb
from kubelet_api.deviceplugin_grpc import DevicePluginStub, RegistrationBase

NODE = "gpu-node-1"
NEW = "570.124.06"
STATE = "nvidia.com/gpu-driver-upgrade-state"
CONFIG_FILE = "/etc/gpu-agent/mig-acceptance.yaml"
PLUGIN_DIR = "var/lib/kubelet/device-plugins"


def test_installed_versions_as_modprobe_and_modinfo_find_them(tmp_path: Path) -> None:
    root = Root(tmp_path)
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.8.0-31-generic\n")
    base = tmp_path / "lib/modules/6.8.0-31-generic"
    (base / "updates/dkms").mkdir(parents=True)
    (base / "modules.dep").write_text("kernel/fs/x.ko.zst:\nupdates/dkms/nvidia.ko.xz:\n")
    (base / "updates/dkms/nvidia.ko.xz").write_bytes(lzma.compress(driver_version.modinfo_bytes("575.51.03")))
    (tmp_path / "usr/lib64").mkdir(parents=True)
    (tmp_path / "usr/lib64/libnvidia-ml.so.575.51.03").write_text("")
    found = driver_version.installed(root)
    assert (found.library, found.module, found.module_path) == (
        "575.51.03", "575.51.03", "/lib/modules/6.8.0-31-generic/updates/dkms/nvidia.ko.xz")
    (base / "updates/dkms/nvidia.ko.xz").write_bytes(b"not xz")  # unreadable: the library speaks
    assert driver_version.installed(root).version == "575.51.03" and driver_version.installed(root).module is None


@pytest.fixture(name="api")
def kube_api(tmp_path: Path) -> Iterator[KubeEmulator]:
    """The Kubernetes API emulator with this node; `api` in the tests (here and test_driver_reload_daemon.py)."""
    emulator = KubeEmulator(tmp_path / "pki", nodes=(NODE,)).start()
    yield emulator
    emulator.close()


def settings(api: KubeEmulator, node: SimNode, reload: str = "when-idle") -> dict[str, Any]:
    api.write_kubeconfig(node.root / "etc/kubernetes/kubelet.conf", mode="cert-data")
    (node.root / "etc/gpu-agent").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).parent / "data/mig/acceptance.yaml", node.root / CONFIG_FILE.lstrip("/"))
    return {"toolkit": {"enabled": False}, "driver": {"reload": reload},
            "mig": {"config": "mixed", "config_file": CONFIG_FILE},
            "kubernetes": {"enabled": True, "node_name": NODE, "kubeconfig": "/etc/kubernetes/kubelet.conf"}}


def a_minute_later(node: SimNode) -> None:
    """The node's API request budget (12 a minute) as a minute later: the passes here come back to back."""
    (node.root / "var/lib/gpu-agent/kube-requests.json").unlink(missing_ok=True)


def label_history(api: KubeEmulator) -> list[str]:
    seen: list[str] = []
    for request in api.requests:
        value = ((((request.json if request.method == "PATCH" else None) or {}).get("metadata") or {})
                 .get("labels") or {}).get(STATE)
        if value and (not seen or seen[-1] != value):
            seen.append(value)
    return seen


def test_when_idle_waits_for_the_gpu_process_then_reloads_and_uncordons(tmp_path: Path, api: KubeEmulator) -> None:
    node = SimNode(tmp_path / "root", "dgx-h100")
    for binary in ("nvidia-container-runtime", "nvidia-container-runtime-hook", "nvidia-cdi-hook"):
        (node.root / "usr/bin").mkdir(parents=True, exist_ok=True)
        (node.root / "usr/bin" / binary).write_text("#!/bin/sh\n")
    node.sim("install-runtime", "podman", "5.4.2")  # reads the CDI spec: the agent writes one
    config = {**settings(api, node), "toolkit": {"enabled": True}}
    first = node.apply(config)
    assert first.stage("mig").state == "ok" and first.state.inventory is not None
    made_before = {device.uuid for gpu in first.state.inventory.gpus for device in gpu.mig.devices}
    geometry = [gpu["mig"] for gpu in node.machine.read()["gpus"]]
    node.sim("add-process", "--gpu", "0", "--pid", "4242", "--name", "train.py")
    node.sim("install-driver", NEW)
    a_minute_later(node)
    waiting = node.apply(config)
    driver = waiting.stage("driver")
    assert driver.state == "failed" and "wait-for-jobs-required" in driver.message and "4242" in driver.message
    assert api.get_node(NODE)["spec"].get("unschedulable") is True
    assert "nvidia.com/gpu.present" in api.get_node(NODE)["metadata"]["labels"]
    node.sim("clear")  # the process ends
    a_minute_later(node)
    done = node.apply(config)
    assert done.stage("driver").state == "ok", done.stage("driver").message
    assert done.stage("driver-upgrade").state == "ok", done.stage("driver-upgrade").message
    assert done.stage("mig").state == "ok" and done.stage("discovery").state == "ok"
    versions = {m["name"]: m["version"] for m in node.machine.read()["kernel"]["loaded"]}
    assert versions["nvidia"] == NEW and versions["nvidia_uvm"] == NEW
    assert [gpu["mig"]["current"] for gpu in node.machine.read()["gpus"]] == [g["current"] for g in geometry]
    assert [len(gpu["mig"]["gpu_instances"]) for gpu in node.machine.read()["gpus"]] == [
        len(g["gpu_instances"]) for g in geometry] and geometry[0]["gpu_instances"]
    assert done.stage("cdi").state == "ok", done.stage("cdi").message  # the spec names the MIG devices made again
    spec = (node.root / "var/run/cdi/nvidia.yaml").read_text()
    assert done.state.inventory is not None
    mig_devices = [device.uuid for gpu in done.state.inventory.gpus for device in gpu.mig.devices]
    assert mig_devices and all(uuid in spec for uuid in mig_devices)
    assert not made_before & set(mig_devices) and not any(uuid in spec for uuid in made_before)  # made again
    stored = api.get_node(NODE)
    assert not stored["spec"].get("unschedulable")
    assert stored["metadata"]["labels"][STATE] == "upgrade-done"
    history = label_history(api)
    assert history == [s for s in ORDER if s in history] and history[-1] == "upgrade-done"
    assert {"cordon-required", "wait-for-jobs-required", "pod-restart-required", "validation-required"} <= set(history)


def test_when_idle_waits_for_a_pod_whose_resource_claim_holds_a_gpu(tmp_path: Path, api: KubeEmulator) -> None:
    """A pod holding a GPU through a resource claim of the agent's DRA driver (pod-resources' DynamicResources)
    is a job the reload waits for, as one holding the device plugin's nvidia.com/gpu is; another driver's
    claim is not."""
    from kubelet_api.podresources_pb2 import ListPodResourcesResponse
    from test_pod_labels import Kubelet as PodResources, claims_response

    node = SimNode(tmp_path / "root", "dgx-h100")
    config = settings(api, node)
    assert node.apply(config).stage("mig").state == "ok"
    kubelet = PodResources(node.root)
    try:
        kubelet.answer = claims_response(
            ("ml", "trainer", "main", "big-gpu", "ml", [("gpu.nvidia.com", NODE, "gpu-3")]),
            ("ml", "nic", "main", "fpga", "ml", [("example.com", NODE, "fpga-0")]))
        node.sim("install-driver", NEW)
        a_minute_later(node)
        driver = node.apply(config).stage("driver")
        assert driver.state == "failed" and "wait-for-jobs-required" in driver.message, driver.message
        assert "pod ml/trainer" in driver.message and "ml/nic" not in driver.message
        kubelet.answer = ListPodResourcesResponse()  # the pod ended
        a_minute_later(node)
        done = node.apply(config)
    finally:
        kubelet.stop()
    assert done.stage("driver").state == "ok", done.stage("driver").message
    assert loaded_version(node.machine.read(), "nvidia") == NEW


def test_never_reports_only_and_a_refused_unload_leaves_it_cordoned_until_the_retry(
        tmp_path: Path, api: KubeEmulator) -> None:
    node = SimNode(tmp_path / "root", "dgx-h100")
    assert node.apply(settings(api, node, "never")).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    a_minute_later(node)
    report = node.apply(settings(api, node, "never"))
    message = report.stage("driver").message
    assert "reload required: loaded 550.90.07, installed 570.124.06" in message and "driver.reload is never" in message
    assert report.changes("driver") == [] and not api.get_node(NODE)["spec"].get("unschedulable")
    assert api.get_node(NODE)["metadata"]["labels"][STATE] == "upgrade-required"
    plan = node.check(settings(api, node))
    assert [c.step for c in plan.changes("driver")][:3] == ["cordon-required", "wait-for-jobs-required",
                                                             "pod-restart-required"]
    node.sim("fail", "rmmod", "--module", "nvidia", "--times", "1")
    a_minute_later(node)
    failed = node.apply(settings(api, node))
    assert "could not unload nvidia" in failed.stage("driver").message
    assert api.get_node(NODE)["spec"].get("unschedulable") is True
    assert api.get_node(NODE)["metadata"]["labels"][STATE] == "upgrade-failed"
    assert Ledger(Root(node.root)).driver_reload()["failed_step"] == "pod-restart-required"
    a_minute_later(node)
    # The next attempt finishes what the first left, also with driver.reload back at never: a node left
    # cordoned with its modules half swapped is worse than the reload it was asked for.
    again = node.apply(settings(api, node, "never"))
    assert again.stage("driver-upgrade").state == "ok", again.stage("driver-upgrade").message
    assert not api.get_node(NODE)["spec"].get("unschedulable")


def test_a_gpu_off_the_bus_is_no_driver_failure_and_no_version_mismatch(tmp_path: Path) -> None:
    """XID 79: NVML answers GPU_IS_LOST for GPU 3. That is gpu-health's to report; the driver stage, whose
    versions agree, notes it and stays ok (it once read as 'NVML fails ... the library on disk is')."""
    node = SimNode(tmp_path / "root", "dgx-h100")
    node.sim("inject-xid", "--gpu", "3", "--xid", "79")
    driver = node.apply({"toolkit": {"enabled": False}}).stage("driver")
    assert driver.state == "ok" and "GPU 3 lost" in driver.message, driver.message
    node.sim("clear")
    assert "lost" not in node.apply({"toolkit": {"enabled": False}}).stage("driver").message


def test_driver_reload_command_plans_refuses_a_busy_gpu_then_forces(tmp_path: Path) -> None:
    """`gpu-agent driver reload` in this process (no daemon holds the lock), with driver.reload: never."""
    node = SimNode(tmp_path / "root", "dgx-h100")
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\ntoolkit: {enabled: false}\n")
    assert node.apply({"toolkit": {"enabled": False}}).stage("driver").state == "ok"

    def driver_reload(*argv: str) -> Any:
        return run_cli("--simulate", "dgx-h100", "driver", "reload", *argv, root=node.root, config=config)

    nothing = driver_reload()
    assert nothing.returncode == 0 and nothing.stdout.startswith("nothing to reload: driver 550.90.07")
    node.sim("install-driver", NEW)
    plan = driver_reload("--dry-run")
    assert plan.returncode == 0 and f"reload required: loaded 550.90.07, installed {NEW}" in plan.stdout
    assert "unload the 550.90.07 modules in dependency order" in plan.stdout
    assert json.loads(driver_reload("--dry-run", "--json").stdout)["plan"][0]["step"] == "cordon-required"
    assert loaded_version(node.machine.read(), "nvidia") == "550.90.07"  # the dry run changed nothing
    node.sim("add-process", "--gpu", "1", "--pid", "777", "--name", "train.py")
    busy = driver_reload("--timeout", "0")
    assert busy.returncode == 1 and "failed at wait-for-jobs-required: still in use" in busy.stderr, busy.stderr
    assert "777" in busy.stderr
    forced = driver_reload("--force", "--json")
    assert forced.returncode == 1, forced.stdout  # the process holds the module: rmmod refuses, named
    assert "could not unload nvidia" in json.loads(forced.stdout)["message"]
    node.sim("clear")
    done = json.loads(driver_reload("--json").stdout)
    assert done["ok"] and done["via"] == "in-process"
    assert done["message"].startswith(f"driver reloaded 550.90.07 -> {NEW}")
    assert done["reload"]["step"] == "upgrade-done" and not done["reload"]["forced"]
    assert {m["name"]: m["version"] for m in node.machine.read()["kernel"]["loaded"]}["nvidia"] == NEW


def assert_reloaded(run: Any, node: SimNode, api: KubeEmulator) -> None:
    """The pass finished the reload: the new module loaded, the node uncordoned, upgrade-done."""
    assert run.stage("driver").state == "ok", run.stage("driver").message
    assert run.stage("driver-upgrade").state == "ok", run.stage("driver-upgrade").message
    assert loaded_version(node.machine.read(), "nvidia") == NEW
    stored = api.get_node(NODE)
    assert not stored["spec"].get("unschedulable") and stored["metadata"]["labels"][STATE] == "upgrade-done"
    assert unit_state(node, PERSISTENCED) == "active"  # stopped for the unload, started again


PERSISTENCED = "nvidia-persistenced.service"  # the simulated driver packages' unit


def unit_state(node: SimNode, unit: str) -> str:
    """The unit's ActiveState, as `systemctl show` says it."""
    from gpu_agent.sim.services import SimServices

    found = SimServices(node.machine, 5).state(unit)
    assert found is not None
    return found.active


def downgrade_what_modprobe_loads(node: SimNode) -> None:
    """A stale nvidia.ko earlier in modprobe's search path: the load succeeds with the old version."""
    with node.machine.edit() as state:
        state["kernel"]["installed"]["nvidia"] = "550.90.07"


def upgrade_what_modprobe_loads(node: SimNode) -> None:
    with node.machine.edit() as state:
        state["kernel"]["installed"]["nvidia"] = NEW


FAULTS = {
    "load": (lambda node: node.sim("fail", "modprobe", "--module", "nvidia", "--error", "key-rejected"),
             "could not load nvidia", lambda node: node.sim("clear")),
    "verify-version": (downgrade_what_modprobe_loads, "the loaded nvidia module is 550.90.07, not 570.124.06",
                       upgrade_what_modprobe_loads),
    "verify-nvml": (lambda node: node.sim("fail", "nvmlSystemGetDriverVersion"), "NVML fails with the new driver",
                    lambda node: node.sim("clear")),
}


@pytest.mark.parametrize("step", sorted(FAULTS))
def test_a_failing_load_or_verify_stays_cordoned_named_and_the_next_attempt_finishes(
        tmp_path: Path, api: KubeEmulator, step: str) -> None:
    inject, cause, cure = FAULTS[step]
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    inject(node)
    a_minute_later(node)
    failed = node.apply(config)
    assert failed.stage("driver").state == "failed" and cause in failed.stage("driver").message, \
        failed.stage("driver").message
    stored = api.get_node(NODE)
    assert stored["spec"].get("unschedulable") is True and stored["metadata"]["labels"][STATE] == "upgrade-failed"
    reload = failed.state.stages["driver-upgrade"].facts["reload"]
    assert (reload["step"], reload["failed_step"], reload["cordoned"]) == ("upgrade-failed", "pod-restart-required",
                                                                          True)
    # The units are started again while the retries go on, except with no nvidia module loaded (they hold it).
    assert cause in reload["failure"] and reload["stopped_units"] == ([] if step != "load" else [PERSISTENCED])
    assert unit_state(node, PERSISTENCED) == ("inactive" if step == "load" else "active")
    cure(node)
    a_minute_later(node)
    assert_reloaded(node.apply(config), node, api)
    assert unit_state(node, PERSISTENCED) == "active"


class Killed(BaseException):
    """kill -9: nothing after this point of the pass runs (no handler sees it)."""


CRASH_POINTS = (*ORDER[1:], "unloaded")


def killed_at(point: str, node: SimNode, config: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass on `node` dies (kill -9) right after recording `point` (or with every module unloaded)."""
    with monkeypatch.context() as patch:
        if point == "unloaded":
            def crash_at_load(*_: Any) -> None:
                assert "nvidia" not in node.loaded_modules()
                raise Killed

            patch.setattr("gpu_agent.stages.driver.load_module", crash_at_load)
        else:
            save = Ledger.save_driver_reload

            def crash_after(ledger: Ledger, entry: Any) -> None:
                save(ledger, entry)
                if entry is not None and entry["step"] == point:
                    raise Killed

            patch.setattr(Ledger, "save_driver_reload", crash_after)
        with pytest.raises(Killed):
            node.apply(config)


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_killed_at_any_step_the_restarted_agent_finishes_or_says_why(
        tmp_path: Path, api: KubeEmulator, monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """The agent dies right after recording `point` (or with every module unloaded); a fresh runtime on the
    same root (a restart) goes on from the ledger and finishes."""
    node, config = upgraded(tmp_path, api)
    killed_at(point, node, config, monkeypatch)
    a_minute_later(node)
    assert_reloaded(node.apply(config), node, api)


def test_the_ledger_is_not_locked_across_the_reload(tmp_path: Path, api: KubeEmulator,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger's lock is held for each step's record only: while the module loads (the longest step),
    another writer, such as the MPS control daemons' thread, takes it at once."""
    node = SimNode(tmp_path / "root", "t4")
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    a_minute_later(node)
    load = driver_stage.load_module
    other_writer: list[str] = []

    def load_while_another_writes(*args: Any, **kwargs: Any) -> Any:
        def write() -> None:  # a change each time: one that finds nothing to do takes no lock
            uuid = f"GPU-{len(other_writer)}"
            try:
                Ledger(Root(node.root), lock_timeout_s=0).save_compute_mode(uuid, "DEFAULT", "nvidia.com/gpu")
            except AgentError as exc:
                other_writer.append(str(exc))
            else:
                other_writer.append("written")

        thread = threading.Thread(target=write)
        thread.start()
        thread.join()
        return load(*args, **kwargs)

    monkeypatch.setattr(driver_stage, "load_module", load_while_another_writes)
    assert_reloaded(node.apply(config), node, api)
    assert other_writer and set(other_writer) == {"written"}
    assert len(Ledger(Root(node.root)).compute_modes()) == len(other_writer)


def upgraded(tmp_path: Path, api: KubeEmulator, profile: str = "t4") -> tuple[SimNode, dict[str, Any]]:
    """A node whose driver the agent adopted, then NEW installed; driver.reload: when-idle, the API on."""
    node = SimNode(tmp_path / "root", profile)
    config = {**settings(api, node), "mig": {}}
    assert node.apply(config).stage("driver").state == "ok"
    node.sim("install-driver", NEW)
    a_minute_later(node)
    return node, config


A30_MIG = """version: v1
mig-configs:
  split:
    - devices: all
      mig-enabled: true
      mig-devices: {"2g.12gb": 1, "1g.6gb": 2}
"""


class Kubelet(RegistrationBase):
    """The kubelet's Registration service: what registered, in order."""

    def __init__(self) -> None:
        self.registered: list[str] = []

    async def Register(self, stream: Stream[pb.RegisterRequest, pb.Empty]) -> None:
        request = await stream.recv_message()
        assert request is not None
        self.registered.append(request.resource_name)
        await stream.send_message(pb.Empty())


async def list_devices(socket: Path) -> list[str]:
    """The device IDs a plugin's ListAndWatch sends first."""
    address, fd = socket_address(socket)
    channel = Channel(path=address)
    try:
        async with DevicePluginStub(channel).ListAndWatch.open() as stream:
            await stream.send_message(pb.Empty(), end=True)
            response = await asyncio.wait_for(stream.recv_message(), timeout=10)
            await stream.cancel()  # ListAndWatch never ends of itself
            assert response is not None
            return sorted(device.ID for device in response.devices)
    finally:
        channel.close()
        if fd is not None:
            os.close(fd)


def test_the_plugin_is_held_off_across_a_restart_and_registers_again_with_the_new_mig_devices(tmp_path: Path) -> None:
    """A reload that fails after the plugin stopped, then an agent restarted: the new process keeps the
    plugin off from its first sync (the ledger's record), and once the reload finishes the plugin registers
    again and ListAndWatch serves the MIG devices made again."""
    node = SimNode(tmp_path / "root", "a30")
    (node.root / "etc/gpu-agent").mkdir(parents=True)
    (node.root / "etc/gpu-agent/mig.yaml").write_text(A30_MIG)
    (node.root / PLUGIN_DIR).mkdir(parents=True)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "version": "v1", "toolkit": {"enabled": False}, "driver": {"reload": "when-idle"},
        "mig": {"config": "split", "config_file": "/etc/gpu-agent/mig.yaml", "strategy": "mixed"}}))
    resource = "nvidia.com/mig-1g.6gb"

    def runtime() -> Runtime:
        return Runtime.build(Root(node.root), load_config(config, required=True), "a30")

    async def registered(manager: DevicePluginManager) -> None:
        for _ in range(200):
            if resource in manager.registered:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"not registered: {manager.errors}")

    async def scenario() -> dict[str, Any]:
        kubelet = Kubelet()
        server = Server([kubelet])
        address, fd = socket_address(node.root / PLUGIN_DIR / "kubelet.sock")
        descriptors = [fd] if fd is not None else []
        await server.start(path=address)
        first = runtime()
        runtimes, managers = [first], [DevicePluginManager(first.root, first.state, first.plugin_gate)]
        try:
            assert all(run.state == "ok" for run in await first.engine.reconcile(force=True))
            await managers[0].sync()
            await registered(managers[0])
            before = await list_devices(managers[0].endpoints[resource].path)
            node.sim("install-driver", NEW)
            node.sim("fail", "rmmod", "--module", "nvidia")
            failed = await first.engine.reconcile(force=True)
            await managers[0].sync()
            held = dict(first.state.plugin or {})
            await managers[0].stop_all()  # the first agent is gone; a new one starts
            second = runtime()
            runtimes.append(second)
            managers.append(DevicePluginManager(second.root, second.state, second.plugin_gate))
            restarted = second.plugin_gate.closed  # before any pass of the new process
            await managers[1].sync()
            off = dict(second.state.plugin or {})
            registrations_while_off = list(kubelet.registered)
            node.sim("clear")
            done = await second.engine.reconcile(force=True)
            await managers[1].sync()
            await registered(managers[1])
            after = await list_devices(managers[1].endpoints[resource].path)
            second.plugin_gate.close("a reload within one pass")  # closed and open again between two syncs
            second.plugin_gate.open()
            await managers[1].sync()
            await registered(managers[1])
            assert second.state.inventory is not None
            made = sorted(device.uuid for gpu in second.state.inventory.gpus for device in gpu.mig.devices
                          if device.profile == "1g.6gb")
            return {"before": before, "failed": next(r for r in failed if r.stage == "driver").message,
                    "held": held, "restarted": restarted, "off": off, "while_off": registrations_while_off,
                    "done": {r.stage: r.state for r in done}, "after": after, "made": made,
                    "registered": list(kubelet.registered)}
        finally:
            for manager in managers:
                await manager.stop_all()
            for each in runtimes:
                each.nvml.close()
            server.close()
            await server.wait_closed()
            for descriptor in descriptors:
                os.close(descriptor)

    result = asyncio.run(scenario())
    assert len(result["before"]) == 2 and "could not unload nvidia" in result["failed"]
    reason = f"driver reload of 550.90.07 to {NEW} in progress"
    assert result["held"]["resources"] == [] and result["held"]["reason"] == f"off: {reason}"
    assert result["restarted"] == reason
    assert result["off"]["resources"] == [] and result["off"]["reason"] == result["held"]["reason"]
    assert result["while_off"].count(resource) == 1  # the first registration only
    assert result["done"]["driver-upgrade"] == "ok" and result["done"]["mig"] == "ok"
    assert result["registered"].count(resource) == 3  # registered again after each reload
    assert result["after"] == result["made"] and len(result["after"]) == 2
    assert not set(result["before"]) & set(result["after"])  # the MIG devices made again, new UUIDs


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)
    return value


@pytest.mark.subprocess
@pytest.mark.host_paths  # the command reads /proc/PID/cmdline of the lock's holder
def test_driver_reload_is_handed_to_the_running_daemon(agent: Any, root: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The command, in this process, against a daemon subprocess: a request file, SIGHUP, the result file.
    What is not a request, or is stale, starts no reload; a daemon that does not take the request in time
    gets it withdrawn, with a clear error; --dry-run and the real run."""
    from gpu_agent.daemon.reload_request import request_path, result_path

    daemon = agent(simulate="t4", settings={"toolkit": {"enabled": False}})
    daemon.wait_ready()
    node = SimNode(root, "t4")
    node.sim("install-driver", NEW)  # driver.reload: never; the command reloads all the same
    config = tmp_path / "config.yaml"
    run = root / "run/gpu-agent"

    def driver_reload(*argv: str) -> Any:
        return run_cli("--simulate", "t4", "driver", "reload", *argv, root=root, config=config)

    foreign = root / request_path("0" * 32).lstrip("/")
    foreign.write_text("not a request\n")
    daemon.signal(signal.SIGHUP)
    wait_until(lambda: not foreign.exists(), "the foreign request dropped")
    stale = {"force": False, "timeout": None, "id": "1" * 32, "at": time.time() - 3600}
    (root / request_path(stale["id"]).lstrip("/")).write_text(json.dumps(stale))
    daemon.signal(signal.SIGHUP)
    result = root / result_path(stale["id"]).lstrip("/")
    answer = wait_until(lambda: result.exists() and json.loads(result.read_text()), "the stale request answered")
    assert answer["id"] == stale["id"] and not answer["ok"] and "stale" in answer["message"]
    result.unlink()
    plan = driver_reload("--dry-run")
    assert plan.returncode == 0 and f"reload required: loaded 550.90.07, installed {NEW}" in plan.stdout
    assert loaded_version(node.machine.read(), "nvidia") == "550.90.07" and Ledger(Root(root)).driver_reload() is None

    daemon.signal(signal.SIGSTOP)  # a daemon that does not answer
    try:
        monkeypatch.setattr("gpu_agent.daemon.reload_request.REQUEST_TTL_S", 0.5)
        stuck = driver_reload()
        assert stuck.returncode == 1 and "did not take the request within 0.5 s" in stuck.stderr, stuck.stderr
        assert not list(run.glob("driver-reload.*"))  # withdrawn: the daemon, going on, starts no reload
    finally:
        daemon.signal(signal.SIGCONT)
    monkeypatch.undo()
    done = driver_reload("--json")
    outcome = json.loads(done.stdout)
    assert done.returncode == 0 and outcome["via"] == f"daemon (pid {daemon.proc.pid})", done.stdout + done.stderr
    assert outcome["message"].startswith(f"driver reloaded 550.90.07 -> {NEW}")
    assert loaded_version(node.machine.read(), "nvidia") == NEW
    nothing = driver_reload("--abort")  # handed over as well: nothing under way
    assert nothing.returncode == 0 and nothing.stdout.startswith("no driver reload is under way: nothing to abort")


@pytest.mark.parametrize("number", ["1" + "0" * 400, "1e400", "NaN", "Infinity"])
@pytest.mark.parametrize("field", ["at", "timeout"])
def test_a_request_whose_time_is_no_finite_number_is_no_request(tmp_path: Path, field: str, number: str) -> None:
    """A time JSON can write but a float cannot hold (its age would raise OverflowError in the agent's loop
    and in the command) is refused as not a request."""
    from gpu_agent.daemon.reload_request import request_path, take_requests

    root = Root(tmp_path)
    request = root(request_path("0" * 32))
    request.parent.mkdir(parents=True)
    fields = {"force": "false", "timeout": "null", "id": f'"{"0" * 32}"', "at": repr(time.time()), field: number}
    request.write_text("{" + ", ".join(f'"{key}": {value}' for key, value in fields.items()) + "}")
    assert take_requests(root) == [] and not request.exists()


def test_an_abort_request_names_who_asked(tmp_path: Path) -> None:
    from gpu_agent.daemon.reload_request import ReloadRequest, request_path, take_requests, write_request

    root = Root(tmp_path)
    write_request(root, ReloadRequest(abort="alice, with `gpu-agent driver reload --abort` (pid 1)"))
    taken, = take_requests(root)
    assert taken.abort == "alice, with `gpu-agent driver reload --abort` (pid 1)"
    root(request_path("0" * 32)).write_text(json.dumps({"force": False, "timeout": None, "id": "0" * 32,
                                                          "at": time.time(), "abort": 1}))
    assert take_requests(root) == []  # not a request


def test_a_hung_modprobe_is_killed_after_its_timeout_and_loads_once_cleared(tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "t4")
    node.sim("fail", "modprobe", "--module", "nvidia", "--error", "hang")
    modprobe = SimModprobe(node.machine, Root(node.root), timeout=0.1)
    with pytest.raises(AgentError, match="modprobe nvidia did not finish within 0.1 s and was killed"):
        modprobe.load("nvidia")
    assert "nvidia" not in node.loaded_modules()
    node.sim("clear")
    modprobe.load("nvidia")
    assert "nvidia" in node.loaded_modules()
