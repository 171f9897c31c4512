"""Pod attribution of the DCGM series (metrics.pod_labels): the kubelet's pod-resources API, served here by
grpcio (another gRPC implementation than the agent's grpclib) on a unix socket under a tmp root."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpu_agent.config import load_config
from gpu_agent.host.paths import Root
from gpu_agent.kube import podresources
from kubelet_api.podresources_pb2 import ListPodResourcesRequest, ListPodResourcesResponse
from gpu_agent.metrics.exporter import AgentCollector, make_registry, render
from gpu_agent.metrics.pods import SOCKET, Holder, PodAttribution, PodLabels, attribute
from gpu_agent.metrics.sampler import Sampler
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.state import AgentState

MACHINE = """name: lab
gpus:
  - model: H100-80GB-HBM3
    count: 2
  - model: H100-80GB-HBM3
    mig: {devices: [3g.40gb, 3g.40gb]}
"""


def response(*pods: tuple[str, str, dict[str, dict[str, list[str]]]]) -> ListPodResourcesResponse:
    """(namespace, pod, {container: {resource: [device ids]}}) each."""
    answer = ListPodResourcesResponse()
    for namespace, name, containers in pods:
        pod = answer.pod_resources.add(name=name, namespace=namespace)
        for container_name, devices in containers.items():
            container = pod.containers.add(name=container_name)
            for resource, ids in devices.items():
                container.devices.add(resource_name=resource, device_ids=ids)
    return answer


class Kubelet:
    """The pod-resources List service on <root>/var/lib/kubelet/pod-resources/kubelet.sock, by grpcio."""

    def __init__(self, root: Path) -> None:
        self.path = Root(root)(SOCKET)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.answer = ListPodResourcesResponse()
        self.delay = 0.0
        self.calls = self.answered = 0
        self._stopping = threading.Event()
        handler = grpc.method_handlers_generic_handler("v1.PodResourcesLister", {
            "List": grpc.unary_unary_rpc_method_handler(
                self._list, request_deserializer=ListPodResourcesRequest.FromString,
                response_serializer=ListPodResourcesResponse.SerializeToString)})
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        # A tmp root is deep: bind through a descriptor of the directory, as the agent connects.
        self._dir = os.open(self.path.parent, os.O_PATH | os.O_DIRECTORY)
        assert self.server.add_insecure_port(f"unix:/proc/self/fd/{self._dir}/{self.path.name}")
        self.server.start()

    def _list(self, request: ListPodResourcesRequest, context: Any) -> ListPodResourcesResponse:
        self.calls += 1
        self._stopping.wait(self.delay)
        self.answered += 1
        return self.answer

    def stop(self) -> None:
        self._stopping.set()
        self.server.stop(0).wait()
        os.close(self._dir)


class Node:
    def __init__(self, tmp_path: Path) -> None:
        spec = tmp_path / "lab.yaml"
        spec.write_text(MACHINE)
        self.root = tmp_path / "root"
        machine = MachineState(Root(self.root))
        machine.ensure(str(spec))
        SimModprobe(machine, Root(self.root)).load("nvidia")
        self.nvml = Nvml(FakeNvml(machine), call_timeout=2.0)
        self.state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
        self.state.inventory = self.nvml.inventory.read()
        Sampler(self.nvml, self.state, Root(self.root)).sample()
        self.registry = make_registry(AgentCollector(self.state, lambda: 0, "node-1"))
        self.gpus = self.state.inventory.gpus
        self.mig = self.gpus[2].mig.devices

    def labels(self, timeout: float = 2.0) -> PodLabels:
        return PodLabels(Root(self.root), lambda: self.state.inventory, lambda pods: setattr(self.state, "pods", pods),
                         lambda: True, lambda: 0.05, timeout)

    def series(self, name: str) -> list[dict[str, str]]:
        families = {f.name: f for f in text_string_to_metric_families(render(self.registry).decode())}
        return [sample.labels for sample in families[name].samples]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path)
    yield made
    made.nvml.close()


@pytest.fixture
def kubelet(node: Node) -> Iterator[Kubelet]:
    server = Kubelet(node.root)
    yield server
    server.stop()


def test_device_ids_map_to_gpus_and_gpu_instances(node: Node) -> None:
    gpu0, gpu1 = node.gpus[0].uuid, node.gpus[1].uuid
    answer = response(
        ("ml", "trainer", {"main": {"nvidia.com/gpu": [gpu0]}}),
        ("ml", "shared-b", {"a": {"nvidia.com/gpu.shared": [f"{gpu1}::3"]}, "b": {"nvidia.com/gpu": [f"{gpu1}::0"]}}),
        ("dev", "notebook", {"nb": {"nvidia.com/mig-3g.40gb": [node.mig[1].uuid], "example.com/fpga": ["fpga-0"]}}),
        ("dev", "stranger", {"x": {"nvidia.com/gpu": ["GPU-not-on-this-node"]}}),
    )
    decoded = podresources.ListPodResourcesResponse.decode(answer.SerializeToString())  # as the kubelet sent it
    holders = attribute(decoded, node.state.inventory)
    assert holders == {
        (gpu0, None): (Holder("ml", "trainer", "main"),),
        (gpu1, None): (Holder("ml", "shared-b", "a"), Holder("ml", "shared-b", "b")),
        (node.gpus[2].uuid, node.mig[1].gpu_instance_id): (Holder("dev", "notebook", "nb"),),
    }
    assert attribute(decoded, None) == {}


def test_series_carry_the_holders_labels_from_the_kubelet(node: Node, kubelet: Kubelet) -> None:
    gpu0, gpu1 = node.gpus[0].uuid, node.gpus[1].uuid
    kubelet.answer = response(
        ("ml", "trainer", {"main": {"nvidia.com/gpu": [gpu0]}}),
        ("ml", "a", {"c": {"nvidia.com/gpu": [f"{gpu1}::0"]}}),
        ("ml", "b", {"c": {"nvidia.com/gpu": [f"{gpu1}::1"]}}),
        ("dev", "notebook", {"nb": {"nvidia.com/mig-3g.40gb": [node.mig[0].uuid]}}))
    result = asyncio.run(node.labels().refresh())
    assert result.error is None and kubelet.calls == 1
    temp = node.series("DCGM_FI_DEV_GPU_TEMP")
    held_gi, free_gi = str(node.mig[0].gpu_instance_id), str(node.mig[1].gpu_instance_id)
    # GPU 2 has GPU instances: as dcgm-exporter, one series per GPU instance, each with its own holders
    assert sorted((s["UUID"], s.get("GPU_I_ID"), s.get("namespace"), s.get("pod"), s.get("container"))
                  for s in temp) == sorted([
        (gpu0, None, "ml", "trainer", "main"), (gpu1, None, "ml", "a", "c"), (gpu1, None, "ml", "b", "c"),
        (node.gpus[2].uuid, held_gi, "dev", "notebook", "nb"), (node.gpus[2].uuid, free_gi, None, None, None)])
    assert list(temp[0]) == ["gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname",
                             "DCGM_FI_DRIVER_VERSION", "container", "namespace", "pod"]
    instances = [s for s in node.series("DCGM_FI_DEV_FB_USED") if "GPU_I_ID" in s]
    held = {s["GPU_I_ID"]: s.get("pod") for s in instances}
    assert held == {str(node.mig[0].gpu_instance_id): "notebook", str(node.mig[1].gpu_instance_id): None}
    xid = node.series("DCGM_FI_DEV_XID_ERRORS")
    assert xid[0]["pod"] == "trainer"
    # dcgm-exporter sorts its attributes (pod labels, err_code and err_msg) after the labels
    assert list(xid[0])[6:] == ["DCGM_FI_DRIVER_VERSION", "container", "err_code", "err_msg", "namespace", "pod"]
    status = node.state.to_json()["pod_labels"]
    assert status["error"] is None and {d["uuid"] for d in status["devices"]} == {gpu0, gpu1, node.gpus[2].uuid}


def test_a_missing_kubelet_leaves_the_series_unlabelled_and_says_why(node: Node) -> None:
    result = asyncio.run(node.labels().refresh())
    assert "no kubelet pod-resources socket at" in str(result.error)
    assert all("pod" not in labels for labels in node.series("DCGM_FI_DEV_GPU_TEMP"))
    assert node.state.to_json()["pod_labels"]["error"] == result.error


def test_a_kubelet_that_does_not_answer_in_time_is_a_reason_not_a_hang(node: Node, kubelet: Kubelet) -> None:
    kubelet.delay = 30  # cut short by stop()
    result = asyncio.run(node.labels(timeout=0.3).refresh())
    assert "did not answer List within 0.3 s" in str(result.error)
    assert (kubelet.calls, kubelet.answered) == (1, 0)  # given up before the kubelet answered
    assert len(node.series("DCGM_FI_DEV_GPU_TEMP")) == 4  # two GPUs, and the two GPU instances of the third


def test_a_socket_that_is_not_grpc_is_a_reason(node: Node) -> None:
    path = Root(node.root)(SOCKET)
    path.parent.mkdir(parents=True, exist_ok=True)
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"/proc/self/fd/{directory}/{path.name}")
    listener.listen(1)

    def answer_garbage() -> None:
        connection, _ = listener.accept()
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"\0" * 64)
        connection.close()

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    try:
        result = asyncio.run(node.labels().refresh())
    finally:
        listener.close()
        os.close(directory)
    assert str(result.error).startswith(f"the kubelet's pod-resources API at {path} failed: ")
    assert all("pod" not in labels for labels in node.series("DCGM_FI_DEV_GPU_TEMP"))


def test_the_loop_asks_while_enabled_and_clears_when_turned_off(node: Node, kubelet: Kubelet) -> None:
    kubelet.answer = response(("ml", "trainer", {"main": {"nvidia.com/gpu": [node.gpus[0].uuid]}}))
    enabled = [True]
    published: list[Optional[PodAttribution]] = []

    def publish(pods: Optional[PodAttribution]) -> None:
        published.append(pods)
        node.state.pods = pods

    labels = PodLabels(Root(node.root), lambda: node.state.inventory, publish, lambda: enabled[0], lambda: 0.05)

    async def run_until(done: Callable[[], bool]) -> None:
        task = asyncio.create_task(labels.run())
        deadline = time.monotonic() + 10
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()

    asyncio.run(run_until(lambda: kubelet.calls >= 2))
    assert published[-1] is not None and published[-1].of(node.gpus[0].uuid)[0].pod == "trainer"
    enabled[0] = False
    asyncio.run(run_until(lambda: published[-1] is None))
    assert published[-1] is None and node.state.to_json()["pod_labels"] is None
    assert all("pod" not in labels for labels in node.series("DCGM_FI_DEV_GPU_TEMP"))


def test_pod_labels_are_off_by_default(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("version: v1\n")
    assert load_config(config, required=True).config.metrics.pod_labels is False
    config.write_text("version: v1\nmetrics: {pod_labels: true}\n")
    assert load_config(config, required=True).config.metrics.pod_labels is True



def test_the_daemon_wires_pod_labels_to_its_state_config_and_metrics(root: Path, write_config: Any) -> None:
    from gpu_agent.daemon import app

    config = write_config({"metrics": {"pod_labels": True}})
    runtime = app.Runtime.build(Root(root), load_config(config, required=True), "dgx-h100")
    kubelet = Kubelet(root)

    async def scrape_after_one_query() -> tuple[app.Daemon, str]:
        daemon = app.Daemon(runtime, config, config_required=True)
        await runtime.engine.reconcile(force=True)
        daemon.sampler.sample()
        gpu = runtime.state.inventory.gpus[3].uuid
        kubelet.answer = response(("ml", "trainer", {"main": {"nvidia.com/gpu": [gpu]}}))
        assert daemon.pod_labels.enabled()
        assert daemon.pod_labels.interval() == daemon.config.metrics.sample_interval_seconds
        await daemon.pod_labels.refresh()
        return daemon, render(make_registry(daemon.collector)).decode()

    try:
        daemon, text = asyncio.run(scrape_after_one_query())
    finally:
        kubelet.stop()
        runtime.nvml.close()
    held = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_POWER_USAGE{") and "pod=" in line]
    assert len(held) == 1 and f'UUID="{runtime.state.inventory.gpus[3].uuid}"' in held[0]
    assert json.loads(json.dumps(daemon.state.to_json()))["pod_labels"]["devices"][0]["holders"] == [
        {"pod": "trainer", "namespace": "ml", "container": "main"}]
