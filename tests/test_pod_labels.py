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
    decoded = podresources.holdings(answer.SerializeToString())  # as the kubelet sent it
    holders = attribute(decoded, node.state.inventory)
    assert holders == {
        (gpu0, None): (Holder("ml", "trainer", "main"),),
        # the replica (device id <uuid>::n) is kept, for metrics.virtual_gpus' vgpu label
        (gpu1, None): (Holder("ml", "shared-b", "a", "3"), Holder("ml", "shared-b", "b", "0")),
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


# --- hostile answers: sizes, names, counts -------------------------------------------------------------

def test_names_kubernetes_would_not_accept_never_become_label_values(node: Node, kubelet: Kubelet) -> None:
    """One pod with a 1 MB name made /metrics 192 MB and the daemon 610 MB: each of the GPU's series
    carried it. Kubernetes' own limits: pod names 253 characters of a DNS subdomain, namespaces and
    container names 63 of a DNS label."""
    gpu0, gpu1 = node.gpus[0].uuid, node.gpus[1].uuid
    good = ("ml", "trainer", {"main": {"nvidia.com/gpu": [gpu0]}})
    kubelet.answer = response(
        good,
        ("ml", "p" * (1 << 20), {"c": {"nvidia.com/gpu": [gpu1]}}),  # a 1 MB pod name
        ("ml", "x" * 254, {"c": {"nvidia.com/gpu": [gpu1]}}),
        ("n" * 64, "pod", {"c": {"nvidia.com/gpu": [gpu1]}}),
        ("ml", "pod", {"c" * 64: {"nvidia.com/gpu": [gpu1]}}),
        ("ml", 'pod"} evil{x="', {"c": {"nvidia.com/gpu": [gpu1]}}),
        ("ml", "Pod\nforged_metric 1", {"c": {"nvidia.com/gpu": [gpu1]}}),
        ("ml", "pod", {"c": {"nvidia.com/gpu": [gpu1 + "x" * 300]}}),  # a device id no GPU has
        ("ml", "a" * 253, {"c" * 63: {"nvidia.com/gpu": [f"{gpu1}::7"]}}),  # at the limits: kept
    )
    result = asyncio.run(node.labels().refresh())
    assert result.error is None and result.skipped == 6
    assert result.of(gpu0) == (Holder("ml", "trainer", "main"),)
    assert result.of(gpu1) == (Holder("ml", "a" * 253, "c" * 63, "7"),)
    text = render(node.registry)
    assert len(text) < 64 << 10 and b"evil" not in text and b"forged_metric" not in text
    assert node.state.to_json()["pod_labels"]["skipped_holders"] == 6


def test_an_answer_larger_than_the_limit_is_refused_by_its_length(node: Node, kubelet: Kubelet) -> None:
    gpu0 = node.gpus[0].uuid
    kubelet.answer = response(("x" * (podresources.MAX_MESSAGE_BYTES + 1), "pod", {"c": {"nvidia.com/gpu": [gpu0]}}))
    result = asyncio.run(node.labels(timeout=30).refresh())
    assert "MessageTooLarge: a message of" in str(result.error)
    assert f"the limit is {podresources.MAX_MESSAGE_BYTES}" in str(result.error)


class RawKubelet:
    """A pod-resources List that answers with the bytes `frame` gives (a gRPC message's 5-byte prefix and
    whatever follows), by grpclib, to declare what grpcio would never send."""

    def __init__(self, root: Path, frame: Callable[[], Iterator[bytes]]) -> None:
        self.path = Root(root)(SOCKET)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.frame = frame
        self.sent = 0

    def __mapping__(self) -> dict[str, Any]:
        from grpclib.const import Cardinality, Handler

        return {"/v1.PodResourcesLister/List": Handler(self._list, Cardinality.UNARY_UNARY,
                                                      podresources.ListPodResourcesRequest,
                                                      podresources.ListPodResourcesResponse)}

    async def _list(self, stream: Any) -> None:
        await stream.recv_message()
        await stream.send_initial_metadata()
        for data in self.frame():
            await stream._stream.send_data(data)
            self.sent += len(data)

    async def serve(self, work: Any) -> Any:
        from grpclib.server import Server

        from gpu_agent.proto3 import Codec

        server = Server([self], codec=Codec())
        directory = os.open(self.path.parent, os.O_PATH | os.O_DIRECTORY)
        try:
            await server.start(path=f"/proc/self/fd/{directory}/{self.path.name}")
            return await work
        finally:
            server.close()
            os.close(directory)


def test_a_declared_2_gib_answer_is_refused_before_it_is_read(node: Node) -> None:
    """Such an answer grew the daemon to 687 MB at every refresh: grpclib read whatever length the prefix
    declared, acknowledging each part so that the kubelet sent more."""
    def frame() -> Iterator[bytes]:
        yield b"\0" + (2 << 30).to_bytes(4, "big")
        while True:
            yield b"\0" * (1 << 20)

    kubelet = RawKubelet(node.root, frame)
    result = asyncio.run(kubelet.serve(node.labels(timeout=30).refresh()))
    assert f"a message of {2 << 30} bytes; the limit is {podresources.MAX_MESSAGE_BYTES}" in str(result.error)
    assert kubelet.sent < podresources.MAX_MESSAGE_BYTES  # flow control held the rest back: never asked for


def test_a_hundred_thousand_pods_are_decoded_off_the_event_loop_and_not_kept(node: Node, kubelet: Kubelet,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000 pods stalled /healthz 3.8 s a refresh: the answer was decoded on the event loop, each pod an
    object. Now it is walked in a worker thread and only the pods holding devices are kept."""
    gpu0 = node.gpus[0].uuid
    pods = [("ns", f"idle-{n}", {"c": {}}) for n in range(100_000)]
    kubelet.answer = response(*pods, ("ml", "trainer", {"main": {"nvidia.com/gpu": [gpu0]}}))
    threads = []
    real = podresources.holdings

    def recorded(data: bytes) -> Any:
        try:
            asyncio.get_running_loop()
            threads.append("event loop")
        except RuntimeError:
            threads.append("worker")
        return real(data)

    monkeypatch.setattr(podresources, "holdings", recorded)
    result = asyncio.run(node.labels(timeout=60).refresh())
    assert result.error is None and threads == ["worker"]
    assert result.of(gpu0) == (Holder("ml", "trainer", "main"),)
    kept = real(kubelet.answer.SerializeToString())
    assert [pod.name for pod in kept.pod_resources] == ["trainer"]


def test_more_pods_holding_devices_than_a_node_runs_is_an_error(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(podresources, "MAX_HOLDING_PODS", 50)
    answer = response(*[("ns", f"p{n}", {"c": {"nvidia.com/gpu": [node.gpus[0].uuid]}}) for n in range(51)])
    with pytest.raises(podresources.DecodeError, match="more than 50 pods hold devices"):
        podresources.holdings(answer.SerializeToString())
    assert len(podresources.holdings(response(*[("ns", f"p{n}", {"c": {"nvidia.com/gpu": ["GPU-x"]}})
                                                for n in range(50)]).SerializeToString()).pod_resources) == 50


def claims_response(*pods: tuple[str, str, str, str, str, list[tuple[str, str, str]]]) -> ListPodResourcesResponse:
    """(namespace, pod, container, claim name, claim namespace, [(driver, pool, device)]) each."""
    answer = ListPodResourcesResponse()
    for namespace, name, container_name, claim_name, claim_namespace, devices in pods:
        container = answer.pod_resources.add(name=name, namespace=namespace).containers.add(name=container_name)
        claim = container.dynamic_resources.add(claim_name=claim_name, claim_namespace=claim_namespace)
        for driver, pool, device in devices:
            claim.claim_resources.add(driver_name=driver, pool_name=pool, device_name=device,
                                      cdi_devices=[{"name": f"k8s.gpu.nvidia.com/claim={device}"}])
    return answer


def test_devices_a_resource_claim_gave_carry_dcgm_exporters_dra_labels(node: Node, kubelet: Kubelet) -> None:
    """As dcgm-exporter reads pod-resources' DynamicResources (Kubernetes' KubeletPodResourcesDynamicResources
    page shows its series): the claim's device is found by the DRA plugin's name for it, a GPU's `gpu-<minor>`,
    a MIG device's `gpu-<minor>-mig-<profile>-<GI profile id>-<placement start>`."""
    from gpu_agent.dra.devices import gpu_device_name, mig_device_name

    gpu0, mig_gpu = node.gpus[0], node.gpus[2]
    instance = next(i for i in mig_gpu.mig.gpu_instances if i.id == node.mig[1].gpu_instance_id)
    mig_name = mig_device_name(mig_gpu, instance)
    kubelet.answer = claims_response(
        ("gpu-test3", "pod1", "ctr", "single-gpu", "gpu-test3", [("gpu.nvidia.com", "node-1", gpu_device_name(gpu0))]),
        ("ml", "slice", "main", "mig-claim", "ml", [("gpu.nvidia.com", "node-1", mig_name)]),
        ("ml", "other", "main", "nic", "ml", [("example.com", "node-1", "gpu-1")]),  # another driver's gpu-1
        ("ml", "lost", "main", "gone", "ml", [("gpu.nvidia.com", "node-1", "gpu-9")]),  # no such device here
        ("ml", "bad", "main", "Not_A_Name", "ml", [("gpu.nvidia.com", "node-1", "gpu-1")]),
    )
    result = asyncio.run(node.labels().refresh())
    assert result.error is None
    held = {(s["UUID"], s.get("GPU_I_ID")): s for s in node.series("DCGM_FI_DEV_GPU_TEMP") if "pod" in s}
    assert set(held) == {(gpu0.uuid, None), (mig_gpu.uuid, str(instance.id))}
    assert list(held[(gpu0.uuid, None)])[7:] == [
        "container", "dra_claim_name", "dra_claim_namespace", "dra_device_name", "dra_driver_name", "dra_pool_name",
        "namespace", "pod"]
    assert {key: value for key, value in held[(gpu0.uuid, None)].items() if key.startswith("dra_")} == {
        "dra_claim_name": "single-gpu", "dra_claim_namespace": "gpu-test3", "dra_device_name": "gpu-0",
        "dra_driver_name": "gpu.nvidia.com", "dra_pool_name": "node-1"}
    assert held[(mig_gpu.uuid, str(instance.id))]["dra_device_name"] == mig_name
    devices = {d["uuid"]: d["holders"] for d in node.state.to_json()["pod_labels"]["devices"]}
    assert devices[gpu0.uuid] == [{"pod": "pod1", "namespace": "gpu-test3", "container": "ctr", "claim": {
        "dra_claim_name": "single-gpu", "dra_claim_namespace": "gpu-test3", "dra_device_name": "gpu-0",
        "dra_driver_name": "gpu.nvidia.com", "dra_pool_name": "node-1"}}]
