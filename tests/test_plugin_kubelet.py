"""The device plugin against a real gRPC peer: a kubelet stand-in in Go (grpc-go, the implementation
the kubelet uses; tests/kubelet_standin/), talking to the agent running on a simulated DGX H100.

Waits are generous and bounded: they assert what happens, never how fast."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from conftest import AgentProcess, cli
from kubelet_standin_build import standin_binary
from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.machine import MachineState
from gpu_agent.toolkit import cdi

pytestmark = pytest.mark.subprocess

HERE = Path(__file__).resolve().parent
PLUGIN_DIR = "var/lib/kubelet/device-plugins"
GPU = "nvidia.com/gpu"
MIG_3G = "nvidia.com/mig-3g.40gb"
MIG_CONFIGS = {"version": "v1", "mig-configs": {
    "half-3g": [{"devices": [0, 1, 2, 3], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}},
                {"devices": [4, 5, 6, 7], "mig-enabled": False}],
    "half-1g": [{"devices": [0, 1, 2, 3], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}},
                {"devices": [4, 5, 6, 7], "mig-enabled": False}],
}}


@pytest.fixture(scope="session")
def standin() -> Path:
    """The stand-in, built from Debian's Go packages (.ci/run installs them) once per distinct source."""
    binary = standin_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("go or protoc is missing in CI: .ci/run installs golang-go, golang-google-grpc-dev, "
                        "golang-goprotobuf-dev and protobuf-compiler")
        pytest.skip("the Go kubelet stand-in needs go and protoc: apt-get install golang-go golang-google-grpc-dev "
                    "golang-goprotobuf-dev protobuf-compiler")
    return binary


class Kubelet:
    """The stand-in as a subprocess: commands in, JSON events out."""

    def __init__(self, binary: Path, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.proc = subprocess.Popen([str(binary), "-dir", str(directory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        self.wait(lambda e: e["event"] == "ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._queue.put(json.loads(line))
            except ValueError:
                self._queue.put({"event": "stray-output", "line": line})

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 15.0,
             since: int = 0) -> dict[str, Any]:
        """The first event from index `since` on that satisfies `predicate`, waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        index = since
        while True:
            while index < len(self.events):
                if predicate(self.events[index]):
                    return self.events[index]
                index += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no such event within {timeout} s; the last ones: {self.events[-5:]}")
            try:
                self.events.append(self._queue.get(timeout=min(left, 0.1)))
            except queue.Empty:
                pass

    def send(self, **command: Any) -> dict[str, Any]:
        """Send a command; returns the event that answers it."""
        mark = self.mark()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer = {"allocate": "allocate", "preferred": "preferred", "restart": "restarted"}[command["op"]]
        return self.wait(lambda e: e["event"] == answer, since=mark)

    def mark(self) -> int:
        """Drain what has arrived; the index to wait from for what comes next."""
        while True:
            try:
                self.events.append(self._queue.get_nowait())
            except queue.Empty:
                return len(self.events)

    def latest_list(self, resource: str, since: int = 0, predicate: Callable[[list[dict[str, Any]]], bool] =
                    lambda devices: True, timeout: float = 15.0) -> list[dict[str, Any]]:
        event = self.wait(lambda e: e["event"] == "list" and e["resource"] == resource and predicate(e["devices"]),
                          timeout=timeout, since=since)
        return event["devices"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)


@pytest.fixture
def kubelet(standin: Path, root: Path) -> Iterator[Kubelet]:
    stand_in = Kubelet(standin, root / PLUGIN_DIR)
    yield stand_in
    stand_in.close()


def status(daemon: AgentProcess) -> dict[str, Any]:
    return json.loads(daemon.get("/status")[1])


def gpu_uuids(daemon: AgentProcess) -> list[str]:
    return [gpu["uuid"] for gpu in status(daemon)["gpus"]]


CDI_CRI: dict[str, Any] = {"plugin": {"device_list_strategy": "cdi-cri"}}


def cdi_names(root: Path) -> set[str]:
    """The qualified device names of the CDI spec the agent's CDI stage writes for this machine now, built
    here by the same code. These sandbox roots have no container runtime, so the device path's auto would
    choose envvar: the tests of CDI names set cdi-cri, and the spec is written for the plugin alone."""
    machine = MachineState(Root(root))
    nvml = Nvml(FakeNvml(machine))
    try:
        inventory = nvml.inventory.read()
    finally:
        nvml.close()
    kernel_root = Root(root).with_kernel(machine.kernel_dir)
    spec = cdi.build_spec(inventory, kernel_root, cdi.discover(kernel_root, inventory.driver_version))
    return {f"{spec['kind']}={device['name']}" for device in spec["devices"]}


def reload(daemon: AgentProcess, write_config: Callable[..., Path], settings: dict[str, Any]) -> None:
    digest = status(daemon)["config"]["digest"]
    write_config(settings)
    daemon.signal(signal.SIGHUP)
    daemon.wait_http("/status", lambda _, body: json.loads(body)["config"]["digest"] != digest)


def test_eight_gpus_registered_and_allocated_in_every_list_strategy(agent, kubelet: Kubelet, root: Path,
                                                                    write_config) -> None:
    daemon = agent("dgx-h100", settings=CDI_CRI)
    daemon.wait_ready()
    registration = kubelet.wait(lambda e: e["event"] == "register")
    assert registration == {"event": "register", "resource": GPU, "endpoint": "nvidia-gpu.sock",
                            "version": "v1beta1", "preferred_allocation": True}
    options = kubelet.wait(lambda e: e["event"] == "options")
    assert options["preferred_allocation"] is True and options["pre_start"] is False
    uuids = gpu_uuids(daemon)
    devices = kubelet.latest_list(GPU)
    assert [d["id"] for d in devices] == uuids and len(uuids) == 8
    assert all(d["health"] == "Healthy" for d in devices)
    assert [d["numa"] for d in devices] == [[0]] * 4 + [[1]] * 4  # a DGX H100: GPUs 0-3 on node 0, 4-7 on 1

    answer = kubelet.send(op="allocate", resource=GPU, ids=[uuids[1], uuids[5]])
    assert answer["ok"] and answer["cdi_devices"] == [f"nvidia.com/gpu={uuids[1]}", f"nvidia.com/gpu={uuids[5]}"]
    assert set(answer["cdi_devices"]) <= cdi_names(root)  # names the CDI stage wrote

    refused = kubelet.send(op="allocate", resource=GPU, ids=[uuids[0], "GPU-00000000-0000-0000-0000-000000000000"])
    assert not refused["ok"] and "InvalidArgument" in refused["error"]
    assert "unknown device 'GPU-00000000-0000-0000-0000-000000000000'" in refused["error"]

    preferred = kubelet.send(op="preferred", resource=GPU, available=uuids, must=[uuids[3]], size=2)
    assert preferred["ok"] and len(preferred["ids"]) == 2 and uuids[3] in preferred["ids"]
    assert {uuids.index(uuid) for uuid in preferred["ids"]} <= {0, 1, 2, 3}  # NVLink all-to-all: then NUMA

    reload(daemon, write_config, {"plugin": {"device_list_strategy": "envvar"}})
    answer = kubelet.send(op="allocate", resource=GPU, ids=[uuids[2]])
    assert answer["ok"] and answer["envs"] == {"NVIDIA_VISIBLE_DEVICES": uuids[2]} and answer["cdi_devices"] == []

    reload(daemon, write_config, {"plugin": {"device_list_strategy": "cdi-annotations"}})
    answer = kubelet.send(op="allocate", resource=GPU, ids=[uuids[2], uuids[4]])
    assert answer["ok"] and answer["cdi_devices"] == [] and len(answer["annotations"]) == 1
    (key, value), = answer["annotations"].items()
    assert key.startswith("cdi.k8s.io/gpu-agent_")
    assert value.split(",") == [f"nvidia.com/gpu={uuids[2]}", f"nvidia.com/gpu={uuids[4]}"]

    plugin = status(daemon)["plugin"]
    assert plugin["enabled"] and plugin["resources"][0]["name"] == GPU
    assert plugin["resources"][0]["devices"] == 8 and plugin["resources"][0]["registered"] is True
    # What the kubelet asked, as of the last reload's publish: one registration's options and stream (the real
    # kubelet's sequence: tests/e2e/cluster), the allocations and the preferred allocation made before it.
    calls = plugin["resources"][0]["calls"]
    assert (calls["GetDevicePluginOptions"], calls["ListAndWatch"], calls["GetPreferredAllocation"]) == (1, 1, 1)
    assert calls["Allocate"] >= 3 and "PreStartContainer" not in calls, calls


def test_time_slicing_32_devices_and_xid_79_marks_exactly_its_replicas(agent, kubelet: Kubelet, root: Path) -> None:
    sharing = {"timeSlicing": {"failRequestsGreaterThanOne": True,
                               "resources": [{"name": "nvidia.com/gpu", "replicas": 4}]}}
    daemon = agent("dgx-h100", settings={"plugin": {"sharing": sharing, **CDI_CRI["plugin"]}})
    daemon.wait_ready()
    uuids = gpu_uuids(daemon)
    devices = kubelet.latest_list(GPU)
    assert sorted(d["id"] for d in devices) == sorted(f"{uuid}::{n}" for uuid in uuids for n in range(4))
    names = cdi_names(root)
    for device in devices:  # every replica allocates to its GPU's CDI device
        answer = kubelet.send(op="allocate", resource=GPU, ids=[device["id"]])
        assert answer["ok"] and answer["cdi_devices"] == [f"nvidia.com/gpu={device['id'].split('::')[0]}"]
        assert answer["cdi_devices"][0] in names
    too_many = kubelet.send(op="allocate", resource=GPU, ids=[devices[0]["id"], devices[9]["id"]])
    assert not too_many["ok"] and "maximum request size for shared resources is 1" in too_many["error"]

    mark = kubelet.mark()
    assert cli("sim", "inject-xid", "--gpu", "2", "--xid", "79", root=root).returncode == 0
    sick = kubelet.latest_list(GPU, since=mark, predicate=lambda ds: any(d["health"] == "Unhealthy" for d in ds),
                               timeout=5.0)
    unhealthy = sorted(d["id"] for d in sick if d["health"] == "Unhealthy")
    assert unhealthy == [f"{uuids[2]}::{n}" for n in range(4)]  # exactly GPU 2's replicas
    refused = kubelet.send(op="allocate", resource=GPU, ids=[f"{uuids[2]}::1"])
    assert not refused["ok"] and f"{uuids[2]}::1" in refused["error"] and "unhealthy" in refused["error"]
    assert kubelet.send(op="allocate", resource=GPU, ids=[f"{uuids[3]}::1"])["ok"]  # the others still serve


def test_an_xid_turns_unhealthy_then_healthy_after_recovery(agent, kubelet: Kubelet, root: Path) -> None:
    daemon = agent("dgx-h100", settings={"health": {"recover_after_seconds": 2}})
    daemon.wait_ready()
    uuids = gpu_uuids(daemon)
    kubelet.latest_list(GPU)
    mark = kubelet.mark()
    assert cli("sim", "inject-xid", "--gpu", "5", "--xid", "48", root=root).returncode == 0
    sick = kubelet.latest_list(GPU, since=mark, predicate=lambda ds: any(d["health"] == "Unhealthy" for d in ds),
                               timeout=5.0)
    assert [d["id"] for d in sick if d["health"] == "Unhealthy"] == [uuids[5]]
    mark = kubelet.mark()
    kubelet.latest_list(GPU, since=mark, predicate=lambda ds: all(d["health"] == "Healthy" for d in ds), timeout=15.0)


def test_mixed_mig_resources_and_a_mig_change_relists(agent, kubelet: Kubelet, root: Path, write_config) -> None:
    (root / "etc/gpu-agent").mkdir(parents=True)
    (root / "etc/gpu-agent/mig.yaml").write_text(yaml.safe_dump(MIG_CONFIGS))
    daemon = agent("dgx-h100", settings={"mig": {"config": "half-3g", "strategy": "mixed"}, **CDI_CRI})
    daemon.wait_ready()
    gpus = kubelet.latest_list(GPU)
    migs = kubelet.latest_list(MIG_3G)
    assert len(gpus) == 4 and len(migs) == 8
    by_gpu = {gpu["uuid"]: [d["uuid"] for d in gpu["mig"]["instances"]] for gpu in status(daemon)["gpus"]}
    assert sorted(d["id"] for d in migs) == sorted(uuid for gpu in list(by_gpu)[:4] for uuid in by_gpu[gpu])
    answer = kubelet.send(op="allocate", resource=MIG_3G, ids=[migs[0]["id"]])
    assert answer["ok"] and answer["cdi_devices"] == [f"nvidia.com/gpu={migs[0]['id']}"]
    assert answer["cdi_devices"][0] in cdi_names(root)

    mark = kubelet.mark()
    reload(daemon, write_config, {"mig": {"config": "half-1g", "strategy": "mixed"}, **CDI_CRI})
    kubelet.wait(lambda e: e["event"] == "list-closed" and e["resource"] == MIG_3G, since=mark, timeout=30.0)
    assert len(kubelet.latest_list("nvidia.com/mig-1g.10gb", since=mark, timeout=30.0)) == 28
    daemon.wait_http("/status", lambda _, body: {r["name"] for r in json.loads(body)["plugin"]["resources"]}
                     == {GPU, "nvidia.com/mig-1g.10gb"}, timeout=30)
    deadline = time.monotonic() + 30
    while (root / PLUGIN_DIR / "nvidia-mig-3g.40gb.sock").exists():
        assert time.monotonic() < deadline, "the vanished resource's socket was not removed"
        time.sleep(0.05)


def test_a_kubelet_restart_brings_re_registration(agent, kubelet: Kubelet) -> None:
    daemon = agent("dgx-h100")
    daemon.wait_ready()
    kubelet.latest_list(GPU)
    mark = kubelet.mark()
    kubelet.send(op="restart")  # every socket deleted, kubelet.sock recreated
    kubelet.wait(lambda e: e["event"] == "register" and e["resource"] == GPU, since=mark, timeout=10.0)
    assert len(kubelet.latest_list(GPU, since=mark)) == 8
    assert status(daemon)["plugin"]["resources"][0]["registered"] is True


def test_nothing_advertised_when_nvml_fails_at_start(agent, kubelet: Kubelet, root: Path) -> None:
    assert cli("--simulate", "dgx-h100", "sim", "fail", "nvmlInit", root=root).returncode == 0
    daemon = agent("dgx-h100")
    daemon.wait_ready()
    daemon.wait_http("/status", lambda _, body: (json.loads(body).get("plugin") or {}).get("reason") is not None)
    plugin = status(daemon)["plugin"]
    assert plugin["resources"] == [] and plugin["reason"]
    with pytest.raises(AssertionError):
        kubelet.wait(lambda e: e["event"] == "register", timeout=3.0)
