"""The DRA kubelet plugin for gpu.nvidia.com: its wire declarations held to our .proto files (compiled by
protoc) and to protobuf's encodings, the devices it publishes, the pool written through the kube emulator with
the node's credentials as the 1.34 API server authorizes them, and the kubelet's calls over gRPC with
protobuf's own stubs: registration, prepare, unprepare, across a restart of the agent."""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from grpclib.client import Channel
from kubelet_api import dra_v1_grpc, dra_v1_pb2, dra_v1beta1_grpc, dra_v1beta1_pb2, pluginregistration_grpc
from kubelet_api import pluginregistration_pb2

from gpu_agent.config.loader import load_config
from gpu_agent.dra import api
from gpu_agent.dra.claims import CHECKPOINT, Checkpoint, ClaimError, PreparedClaim, PreparedDevice, devices_for
from gpu_agent.dra.devices import MAX_ATTRIBUTES_AND_CAPACITIES, DraDevice, published, quantity, semver, slices
from gpu_agent.dra.params import ConfigError, MpsLimits, Sharing, sharing_of
from gpu_agent.dra.service import DraManager
from gpu_agent.dra.slices import SlicePublisher
from gpu_agent.host.ledger import Ledger, TimeSlice
from gpu_agent.host.paths import Root
from gpu_agent.host.sockets import socket_address
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.client import ApiError, KubeClient
from gpu_agent.nvml.model import (IDENTITY, LAST_READING, ComputeInstance, Gpu, GpuHealth, GpuInstance, Inventory,
                                  MigProfile, MigState)
from gpu_agent.proto3 import BOOL, MESSAGE, MESSAGE_MAP, STRING, Message
from gpu_agent.state import AgentState, ClaimMps
from kube_emulator import KubeEmulator
from test_dra_timeslice import Gpus

NODE = "gpu-node-1"
KUBECONFIG = "/etc/kubernetes/kubelet.conf"
KINDS = {FieldDescriptor.TYPE_STRING: STRING, FieldDescriptor.TYPE_BOOL: BOOL, FieldDescriptor.TYPE_MESSAGE: MESSAGE}
PROFILE_3G = MigProfile("3g.40gb", 9, 3, 2, 60, 40448, 3, 2, 0, 0, 0, ((0, 4), (4, 4)))


def gpu(index: int, *mig: str) -> Gpu:
    """An H100 (minor = index + 10, so names are seen to follow the minor); with MIG profiles, in MIG mode with
    one MIG device of each, the first at placement 0, the next at 4."""
    instances = tuple(GpuInstance(n + 1, 9, profile, 3, (4 * n, 4), 40448,
                                  (ComputeInstance(0, 2, profile, 3, (0, 3), 60, f"MIG-{index:04d}{n:04d}-0", n),))
                      for n, profile in enumerate(mig))
    return Gpu(index, f"GPU-{index:08d}-0000-0000-0000-000000000000", f"00000000:{0x18 + index:02X}:00.0",
               "NVIDIA H100 80GB HBM3", 81559, (9, 0), index + 10,
               MigState(True, bool(mig), bool(mig), instances, (PROFILE_3G,)), numa_node=index // 4)


def inventory(*gpus: Gpu) -> Inventory:
    return Inventory("550.90.07", "12.4", gpus)


# -- the wire -----------------------------------------------------------------------------------------------

def declared(kind: type[Message]) -> dict[int, tuple[str, str, bool, str]]:
    return {field.number: (field.name, field.kind, field.repeated, field.message.__name__ if field.message else "")
            for field in kind.fields()}


def described(descriptor: Descriptor) -> dict[int, tuple[str, str, bool, str]]:
    found = {}
    for field in descriptor.fields:
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:
            found[field.number] = (field.name, MESSAGE_MAP, False, entry.fields_by_name["value"].message_type.name)
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == FieldDescriptor.LABEL_REPEATED
        found[field.number] = (field.name, KINDS[field.type], repeated, entry.name if entry else "")
    return found


@pytest.mark.parametrize("module", [dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2], ids=lambda m: m.__name__)
def test_every_message_is_declared_field_for_field(module: Any) -> None:
    for name, descriptor in module.DESCRIPTOR.message_types_by_name.items():
        assert declared(getattr(api, name)) == described(descriptor), name


def test_the_service_paths_are_the_protos_of_both_versions_and_the_registration() -> None:
    class Dra(api.DRAPluginBase):
        NodePrepareResources = NodeUnprepareResources = None  # type: ignore[assignment]

    class Registration(api.RegistrationBase):
        GetInfo = NotifyRegistrationStatus = None  # type: ignore[assignment]

    expected = set()
    for module in (dra_v1_pb2, dra_v1beta1_pb2):
        service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
        expected |= {f"/{service.full_name}/{method.name}" for method in service.methods}
    assert set(Dra().__mapping__()) == expected
    service = pluginregistration_pb2.DESCRIPTOR.services_by_name["Registration"]
    assert set(Registration().__mapping__()) == {f"/{service.full_name}/{m.name}" for m in service.methods}
    assert [name.rsplit(".", 2)[-2] + ".DRAPlugin" for name in api.DRA_SERVICES] == list(api.SUPPORTED_VERSIONS)


def test_a_map_of_messages_encodes_and_decodes_as_protobuf_does() -> None:
    ours = api.NodePrepareResourcesResponse(claims={
        "uid-b": api.NodePrepareResourceResponse(devices=[api.Device(
            request_names=["gpu"], pool_name=NODE, device_name="gpu-0", cdi_device_ids=["nvidia.com/gpu=GPU-0"])]),
        "uid-a": api.NodePrepareResourceResponse(error="claim x/y: not allocated"),
        "uid-empty": api.NodePrepareResourceResponse()})
    theirs = dra_v1_pb2.NodePrepareResourcesResponse.FromString(ours.encode())
    assert MessageToDict(theirs, preserving_proto_field_name=True) == {"claims": {
        "uid-b": {"devices": [{"request_names": ["gpu"], "pool_name": NODE, "device_name": "gpu-0",
                               "cdi_device_ids": ["nvidia.com/gpu=GPU-0"]}]},
        "uid-a": {"error": "claim x/y: not allocated"}, "uid-empty": {}}}
    assert api.NodePrepareResourcesResponse.decode(theirs.SerializeToString()) == ours
    # an entry without its value (field 2) is the empty message; one given twice merges, as protobuf's
    bare = b"\x0a\x05\x0a\x03uid"
    assert api.NodeUnprepareResourcesResponse.decode(bare).claims == {"uid": api.NodeUnprepareResourceResponse()}
    assert dict(dra_v1_pb2.NodeUnprepareResourcesResponse.FromString(bare).claims) == {
        "uid": dra_v1_pb2.NodeUnprepareResourceResponse()}


# -- the devices --------------------------------------------------------------------------------------------

def test_whole_gpus_and_mig_devices_get_nvidias_names_attributes_and_capacities() -> None:
    devices = {device.name: device for device in published(inventory(gpu(0), gpu(1, "3g.40gb", "3g.40gb")), {})}
    assert sorted(devices) == ["gpu-10", "gpu-11-mig-3g40gb-9-0", "gpu-11-mig-3g40gb-9-4"]
    whole = devices["gpu-10"].entry
    assert whole["attributes"] == {
        "type": {"string": "gpu"}, "uuid": {"string": "GPU-00000000-0000-0000-0000-000000000000"},
        "productName": {"string": "NVIDIA H100 80GB HBM3"}, "architecture": {"string": "Hopper"},
        "cudaComputeCapability": {"version": "9.0.0"}, "driverVersion": {"version": "550.90.7"},
        "cudaDriverVersion": {"version": "12.4.0"}, "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
        "resource.kubernetes.io/numaNode": {"int": 0}}
    assert whole["capacity"] == {"memory": {"value": str(81559 << 20)}}
    mig = devices["gpu-11-mig-3g40gb-9-4"].entry
    assert mig["attributes"]["type"] == {"string": "mig"} and mig["attributes"]["profile"] == {"string": "3g.40gb"}
    assert mig["attributes"]["parentUUID"] == {"string": "GPU-00000001-0000-0000-0000-000000000000"}
    assert mig["attributes"]["uuid"] == {"string": "MIG-00010001-0"}
    assert mig["capacity"]["multiprocessors"] == {"value": "60"} and mig["capacity"]["copyEngines"] == {"value": "3"}
    slices_held = [key for key in mig["capacity"] if key.startswith("memorySlice")]
    assert slices_held == [f"memorySlice{n}" for n in (4, 5, 6, 7)]
    for device in devices.values():
        assert len(device.entry["attributes"]) + len(device.entry["capacity"]) <= MAX_ATTRIBUTES_AND_CAPACITIES


def test_an_unhealthy_device_carries_nvidias_taints_until_it_recovers() -> None:
    """The keys of NVIDIA's gpu-kubelet-plugin (device_health.go at 15a116f03ce09bbaabff2635c0bf3823d15aff19):
    gpu.nvidia.com/xid=<xid> and gpu.nvidia.com/gpu-lost, NoSchedule; the agent's gpu.nvidia.com/unhealthy for
    failing NVML queries and checks, which NVIDIA's plugin does not run."""
    node = inventory(gpu(0), gpu(1), gpu(2), gpu(3, "3g.40gb", "3g.40gb"), gpu(4))
    mig = node.gpus[3].mig.gpu_instances[1].compute_instances[0].uuid
    sick = {node.gpus[1].uuid: GpuHealth(xid_reason="XID 79 (fallen off the bus)", last_xid=79, lost=True),
            node.gpus[2].uuid: GpuHealth(query_error="NVML: unknown error"),
            node.gpus[4].uuid: GpuHealth(xid_reason="XID 48", last_xid=48, check_reason="too hot"),
            mig: GpuHealth(check_reason="pending row remaps")}
    devices = {device.name: device for device in published(node, sick)}
    xid = {"key": "gpu.nvidia.com/xid", "effect": "NoSchedule"}
    assert {name: device.entry.get("taints") for name, device in devices.items()} == {
        "gpu-10": None,
        "gpu-11": [{**xid, "value": "79"}, {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}],
        "gpu-12": [{"key": "gpu.nvidia.com/unhealthy", "value": "nvml-query-failed", "effect": "NoSchedule"}],
        "gpu-13-mig-3g40gb-9-0": None,
        "gpu-13-mig-3g40gb-9-4": [{"key": "gpu.nvidia.com/unhealthy", "value": "health-check-failed",
                                   "effect": "NoSchedule"}],
        "gpu-14": [{**xid, "value": "48"}, {"key": "gpu.nvidia.com/unhealthy", "value": "health-check-failed",
                                           "effect": "NoSchedule"}]}
    assert devices["gpu-11"].to_json()["taints"] == devices["gpu-11"].entry["taints"]
    # a MIG device of an unhealthy GPU carries its GPU's taints
    parent = {node.gpus[3].uuid: GpuHealth(xid_reason="XID 48", last_xid=48)}
    assert {d.name: d.entry["taints"] for d in published(node, parent) if d.tainted} == {
        "gpu-13-mig-3g40gb-9-0": [{**xid, "value": "48"}], "gpu-13-mig-3g40gb-9-4": [{**xid, "value": "48"}]}
    assert not any(device.tainted for device in published(node, {}))
    assert published(None, {}) == ()
    # off the bus: as last read, gpu-lost (and its XID where one was seen); known by its identity alone: absent
    lost = inventory(gpu(0), replace(gpu(1), unreadable="GPU is lost", known_from=LAST_READING),
                     replace(gpu(2), unreadable="GPU is lost", known_from=IDENTITY))
    assert [(d.name, d.entry.get("taints")) for d in published(lost, {})] == [
        ("gpu-10", None), ("gpu-11", [{"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}])]
    assert [t["key"] for t in published(lost, sick)[1].entry["taints"]] == ["gpu.nvidia.com/xid",
                                                                             "gpu.nvidia.com/gpu-lost"]


def test_a_tainted_device_is_not_prepared_and_the_claim_says_why() -> None:
    devices = {device.name: device for device in published(inventory(gpu(0), gpu(1)), {
        gpu(1).uuid: GpuHealth(xid_reason="XID 79", last_xid=79)})}
    allocated = {"metadata": {"uid": "u"}, "status": {"allocation": {"devices": {"results": [
        {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-11", "request": "gpu"}]}}}}
    with pytest.raises(ClaimError, match=r"'gpu-11' is unhealthy \(tainted gpu.nvidia.com/xid=79\)"):
        devices_for(allocated, "u", NODE, devices, None)


def test_quantities_and_versions_are_written_as_the_api_server_writes_them_back() -> None:
    assert [quantity(v) for v in (0, 1, 60, 1000, 1500, 2_000_000, 81559 << 20, 10_000 << 20)] == \
        ["0", "1", "60", "1k", "1500", "2M", "85520809984", "10485760k"]
    assert [semver(v) for v in ("550.90.07", "12.4", "580.159.04", "nonsense")] == \
        ["550.90.7", "12.4.0", "580.159.4", None]


def test_a_pool_is_split_into_slices_of_at_most_128_devices() -> None:
    devices = tuple(DraDevice(f"gpu-{n}", f"GPU-{n}", f"GPU-{n}", {"name": f"gpu-{n}"}) for n in range(300))
    made = slices(NODE, devices, 7)
    assert [len(item["devices"]) for item in made] == [128, 128, 44]
    assert all(item["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 3} for item in made)
    assert slices(NODE, (), 1)[0]["devices"] == []


# -- the pool through the API, with the node's credentials ---------------------------------------------------

@pytest.fixture()
def emulator(tmp_path: Path) -> Iterator[KubeEmulator]:
    with KubeEmulator(tmp_path / "pki") as server:
        server.write_kubeconfig(tmp_path / "root" / KUBECONFIG.lstrip("/"))
        yield server


def client_of(tmp_path: Path) -> KubeClient:
    return KubeClient(Root(tmp_path / "root"), KUBECONFIG, 5, RequestBudget(per_minute=1000))


def test_the_pool_is_published_once_bumped_on_change_and_published_again_after_the_kubelet_deleted_it(
        tmp_path: Path, emulator: KubeEmulator) -> None:
    publisher = SlicePublisher(client_of(tmp_path), NODE)
    eight = published(inventory(*(gpu(n) for n in range(8))), {})
    assert publisher.sync(eight)
    stored = emulator.resource_slices(NODE)
    assert len(stored) == 1 and stored[0]["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert [device["name"] for device in stored[0]["spec"]["devices"]] == [f"gpu-{n}" for n in range(10, 18)]
    writes = len(emulator.requests_for(method="POST")) + len(emulator.requests_for(method="PUT"))
    assert not publisher.sync(eight)  # as stored (quantities in the server's form): nothing written
    assert len(emulator.requests_for(method="POST")) + len(emulator.requests_for(method="PUT")) == writes
    assert publisher.sync(eight[:7])  # a GPU withdrawn: the same slice replaced, generation 2
    again = emulator.resource_slices(NODE)
    assert [item["metadata"]["name"] for item in again] == [stored[0]["metadata"]["name"]]
    assert again[0]["spec"]["pool"]["generation"] == 2 and len(again[0]["spec"]["devices"]) == 7
    emulator.delete_resource_slices(NODE)  # a kubelet that starts
    assert publisher.sync(eight[:7])
    assert emulator.resource_slices(NODE)[0]["spec"]["pool"]["generation"] == 3


def test_where_the_api_server_drops_taints_an_unhealthy_device_is_withdrawn(tmp_path: Path,
                                                                          emulator: KubeEmulator) -> None:
    """DRADeviceTaints off (the emulator's default, as kube-apiserver 1.34's): the first write of a tainted
    device comes back without its taint, and the same sync withdraws the device; recovered, it returns."""
    node = inventory(*(gpu(n) for n in range(3)))
    publisher = SlicePublisher(client_of(tmp_path), NODE)
    assert publisher.sync(published(node, {})) and publisher.taints is None
    sick = published(node, {node.gpus[1].uuid: GpuHealth(xid_reason="XID 79", last_xid=79)})
    assert publisher.sync(sick) and publisher.taints is False
    stored = emulator.resource_slices(NODE)[0]["spec"]
    assert [device["name"] for device in stored["devices"]] == ["gpu-10", "gpu-12"]
    assert stored["pool"]["generation"] == 3  # the tainted write, then the withdrawal
    assert not publisher.sync(sick)  # as stored: nothing written
    assert publisher.sync(published(node, {})) and len(emulator.resource_slices(NODE)[0]["spec"]["devices"]) == 3


def test_where_the_api_server_keeps_taints_an_unhealthy_device_is_tainted_in_place(tmp_path: Path) -> None:
    """DRADeviceTaints on: the device stays in the pool with its taint, the time the server gave the taint
    is neither a change nor lost when another device's taint is written; recovered, the taint goes."""
    with KubeEmulator(tmp_path / "pki", device_taints=True) as server:
        server.write_kubeconfig(tmp_path / "root" / KUBECONFIG.lstrip("/"))
        node = inventory(*(gpu(n) for n in range(3)))
        publisher = SlicePublisher(client_of(tmp_path), NODE)
        one = published(node, {node.gpus[1].uuid: GpuHealth(xid_reason="XID 79", last_xid=79)})
        assert publisher.sync(one) and publisher.taints is True

        def taints() -> dict[str, Any]:
            return {d["name"]: d.get("taints") for d in server.resource_slices(NODE)[0]["spec"]["devices"]}

        first = taints()["gpu-11"]
        assert len(first) == 1 and first[0]["key"] == "gpu.nvidia.com/xid" and first[0]["timeAdded"]
        assert not publisher.sync(one)  # the server's timeAdded is no change
        two = published(node, {node.gpus[1].uuid: GpuHealth(xid_reason="XID 79", last_xid=79),
                               node.gpus[2].uuid: GpuHealth(check_reason="too hot")})
        assert publisher.sync(two)
        assert taints()["gpu-11"] == first and taints()["gpu-12"][0]["value"] == "health-check-failed"
        lost = published(node, {node.gpus[1].uuid: GpuHealth(xid_reason="XID 79", last_xid=79),
                                node.gpus[2].uuid: GpuHealth(lost=True)})  # gpu-lost: a taint without a value
        assert publisher.sync(lost) and [t["key"] for t in taints()["gpu-12"]] == ["gpu.nvidia.com/gpu-lost"]
        assert not publisher.sync(lost) and taints()["gpu-11"] == first
        assert publisher.sync(published(node, {}))
        assert taints() == {"gpu-10": None, "gpu-11": None, "gpu-12": None}


def test_a_restarted_agent_continues_the_generation_it_finds(tmp_path: Path, emulator: KubeEmulator) -> None:
    devices = published(inventory(gpu(0), gpu(1)), {})
    SlicePublisher(client_of(tmp_path), NODE).sync(devices)
    SlicePublisher(client_of(tmp_path), NODE).sync(devices[:1])
    later = SlicePublisher(client_of(tmp_path), NODE)
    assert not later.sync(devices[:1]) and later.generation == 2
    assert later.sync(devices) and emulator.resource_slices(NODE)[0]["spec"]["pool"]["generation"] == 3


def test_a_node_writes_and_lists_only_its_own_slices(tmp_path: Path, emulator: KubeEmulator) -> None:
    client = client_of(tmp_path)
    devices = published(inventory(gpu(0)), {})
    other = slices("gpu-node-2", devices, 1)[0]
    with pytest.raises(ApiError, match="403.*same NodeName"):
        client.create_resource_slice({"metadata": {"generateName": "x-"}, "spec": other})
    with pytest.raises(ApiError, match="403.*nodeName field selector"):
        client.list_resource_slices("gpu-node-2", "gpu.nvidia.com")
    SlicePublisher(client_of(tmp_path), NODE).sync(devices)
    assert client.list_resource_slices(NODE, "gpu.nvidia.com")[0]["spec"]["nodeName"] == NODE


# -- the kubelet's side over gRPC ----------------------------------------------------------------------------

class Kubelet:
    """The kubelet's calls, through protobuf's generated grpclib stubs, on the plugin's two sockets."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.channels: list[Channel] = []

    def channel(self, host_path: str) -> Channel:
        address, _ = socket_address(self.root / host_path.lstrip("/"))
        channel = Channel(path=address)
        self.channels.append(channel)
        return channel

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


async def started(root: Path, state: AgentState) -> tuple[DraManager, asyncio.Task[None]]:
    manager = DraManager(Root(root), state, client_of(root.parent), NODE)
    task = asyncio.create_task(manager.run())
    for _ in range(200):
        if (root / manager.host_registration.lstrip("/")).exists() and manager.state.dra is not None:
            break
        await asyncio.sleep(0.01)
    return manager, task


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


NODE_SPEC_COMMON = {"env": ["NVIDIA_VISIBLE_DEVICES=void"], "deviceNodes": [{"path": "/dev/nvidiactl"}]}


def agent_state(root: Path) -> AgentState:
    """Two GPUs (minors 10 and 11), and the node CDI spec the cdi stage would have written for them."""
    state = AgentState(load_config(root / "missing.yaml", required=False))
    state.inventory = inventory(gpu(0), gpu(1))
    state.cdi_devices = frozenset(f"nvidia.com/gpu={g.uuid}" for g in state.inventory.gpus)
    spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "containerEdits": NODE_SPEC_COMMON,
            "devices": [{"name": g.uuid, "containerEdits": {"deviceNodes": [{"path": f"/dev/{g.device_node}"}]}}
                        for g in state.inventory.gpus]}
    path = root / state.config.config.toolkit.cdi.path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))  # JSON is YAML
    return state


def claim(uid: str, name: str) -> Any:
    return dra_v1_pb2.Claim(namespace="default", uid=uid, name=name)


def test_registration_prepare_and_unprepare_over_grpc_across_a_restart(tmp_path: Path, emulator: KubeEmulator) -> None:
    root = tmp_path / "root"
    (root / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    emulator.add_resource_claim("default", "one-gpu", "uid-1", NODE,
                                [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-11", "request": "gpu"}])
    emulator.add_resource_claim("default", "other-driver", "uid-2", NODE,
                                [{"driver": "dra.example.com", "pool": NODE, "device": "x", "request": "r"}])
    emulator.add_resource_claim("default", "stale", "uid-3", NODE,
                                [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-99", "request": "gpu"}])
    emulator.add_resource_claim("default", "elsewhere", "uid-4", "gpu-node-2",
                                [{"driver": "gpu.nvidia.com", "pool": "gpu-node-2", "device": "gpu-10"}])

    async def scenario() -> None:
        kubelet = Kubelet(root)
        manager, task = await started(root, agent_state(root))
        try:
            registration = pluginregistration_grpc.RegistrationStub(kubelet.channel(manager.host_registration))
            info = await registration.GetInfo(pluginregistration_pb2.InfoRequest())
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                "DRAPlugin", "gpu.nvidia.com", "/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock",
                ["v1.DRAPlugin", "v1beta1.DRAPlugin"])
            await registration.NotifyRegistrationStatus(
                pluginregistration_pb2.RegistrationStatus(plugin_registered=True))
            for _ in range(500):
                if emulator.resource_slices(NODE) and manager.state.dra and manager.state.dra["published"]:
                    break
                await asyncio.sleep(0.01)
            assert [d["name"] for d in emulator.resource_slices(NODE)[0]["spec"]["devices"]] == ["gpu-10", "gpu-11"]
            dra = dra_v1_grpc.DRAPluginStub(kubelet.channel(manager.host_endpoint))
            answer = await dra.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(claims=[
                claim("uid-1", "one-gpu"), claim("uid-2", "other-driver"), claim("uid-3", "stale"),
                claim("uid-4", "elsewhere"), claim("uid-5", "missing")]))
            assert set(answer.claims) == {"uid-1", "uid-2", "uid-3", "uid-4", "uid-5"}
            one = answer.claims["uid-1"]
            assert not one.error and [(d.device_name, d.pool_name, list(d.request_names), list(d.cdi_device_ids))
                                      for d in one.devices] == [
                ("gpu-11", NODE, ["gpu"], ["k8s.gpu.nvidia.com/claim=uid-1-gpu-11"])]
            # the claim's own spec, as NVIDIA's driver writes one: the node spec's common edits and its GPU's
            assert json.loads((root / "var/run/cdi/k8s.gpu.nvidia.com-claim_uid-1.json").read_text()) == {
                "cdiVersion": "0.3.0", "kind": "k8s.gpu.nvidia.com/claim", "containerEdits": NODE_SPEC_COMMON,
                "devices": [{"name": "uid-1-gpu-11", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia11"}]}}]}
            assert "allocates no gpu.nvidia.com device" in answer.claims["uid-2"].error
            assert "gpu-99" in answer.claims["uid-3"].error and "not one this node publishes" in answer.claims[
                "uid-3"].error
            assert "403" in answer.claims["uid-4"].error and "403" in answer.claims["uid-5"].error
            assert manager.state.dra["prepared_claims"]["uid-1"]["devices"][0]["device"] == "gpu-11"
        finally:
            await stopped(task)
            kubelet.close()
        assert not (root / manager.host_endpoint.lstrip("/")).exists()
        assert list(json.loads((root / CHECKPOINT.lstrip("/")).read_text())["claims"]) == ["uid-1"]

        kubelet = Kubelet(root)
        gets = len(emulator.requests_for(method="GET", path="*/resourceclaims/*"))
        manager, task = await started(root, agent_state(root))  # the agent restarted
        try:
            beta = dra_v1beta1_grpc.DRAPluginStub(kubelet.channel(manager.host_endpoint))
            again = await beta.NodePrepareResources(dra_v1beta1_pb2.NodePrepareResourcesRequest(claims=[
                dra_v1beta1_pb2.Claim(namespace="default", uid="uid-1", name="one-gpu")]))
            assert [(d.device_name, list(d.cdi_device_ids)) for d in again.claims["uid-1"].devices] == [
                ("gpu-11", ["k8s.gpu.nvidia.com/claim=uid-1-gpu-11"])]
            assert len(emulator.requests_for(method="GET", path="*/resourceclaims/*")) == gets  # from the checkpoint
            dra = dra_v1_grpc.DRAPluginStub(kubelet.channel(manager.host_endpoint))
            for _ in range(2):  # idempotent: the second finds nothing to do and says so without error
                gone = await dra.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(claims=[
                    claim("uid-1", "one-gpu"), claim("uid-unknown", "never-prepared")]))
                assert {uid: answer.error for uid, answer in gone.claims.items()} == {"uid-1": "", "uid-unknown": ""}
        finally:
            await stopped(task)
            kubelet.close()
        assert json.loads((root / CHECKPOINT.lstrip("/")).read_text())["claims"] == {}
        assert not (root / "var/run/cdi/k8s.gpu.nvidia.com-claim_uid-1.json").exists()
        assert Ledger(Root(root)).claim_specs() == {}

    asyncio.run(scenario())


def test_a_claim_is_refused_while_the_node_spec_cannot_be_read_and_given_its_names_where_cdi_is_off(
        tmp_path: Path, emulator: KubeEmulator, write_config: Any) -> None:
    root = tmp_path / "root"
    state = agent_state(root)
    manager = DraManager(Root(root), state, client_of(tmp_path), NODE)
    manager.sync_devices()
    emulator.add_resource_claim("default", "one", "uid-1", NODE,
                                [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-10", "request": "gpu"}])
    node_spec = root / "var/run/cdi/nvidia.yaml"
    node_spec.write_text("devices: [")
    answer = manager.prepare([api.Claim("default", "uid-1", "one")], float("inf"))["uid-1"]
    assert answer.error.startswith(f"claim default/one: {node_spec}: the node's CDI spec cannot be read (")
    for devices in ([{"name": "GPU-00000000-0000-0000-0000-000000000000", "containerEdits": {"env": None}}],
                    [{"name": "x", "containerEdits": {"deviceNodes": ["/dev/nvidia0"]}}]):
        node_spec.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices}))
        answer = manager.prepare([api.Claim("default", "uid-1", "one")], float("inf"))["uid-1"]
        assert answer.error == f"claim default/one: {node_spec}: not a CDI spec the agent wrote (devices, each with " \
                               "a name and containerEdits of lists)"
    node_spec.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": []}))
    answer = manager.prepare([api.Claim("default", "uid-1", "one")], float("inf"))["uid-1"]
    assert answer.error == ("claim default/one: the node's CDI spec has no device "
                            "GPU-00000000-0000-0000-0000-000000000000 now (see the cdi stage); the kubelet asks again")
    assert not (root / "var/run/cdi/k8s.gpu.nvidia.com-claim_uid-1.json").exists()
    # toolkit.cdi off: no node spec of the agent's to copy; the claim is given the names another spec keeps
    state.config = load_config(write_config({"toolkit": {"cdi": {"enabled": False}}}), required=True)
    answer = manager.prepare([api.Claim("default", "uid-1", "one")], float("inf"))["uid-1"]
    assert not answer.error and list(answer.devices[0].cdi_device_ids) == [
        "nvidia.com/gpu=GPU-00000000-0000-0000-0000-000000000000"]
    assert not (root / "var/run/cdi/k8s.gpu.nvidia.com-claim_uid-1.json").exists()


def test_a_uid_that_names_no_spec_is_that_claims_error_and_an_unreadable_checkpoint_puts_nothing_back(
        tmp_path: Path, emulator: KubeEmulator) -> None:
    root = tmp_path / "root"
    gpus = Gpus()
    manager = DraManager(Root(root), agent_state(root), client_of(tmp_path), NODE, gpus=(gpus, gpus))
    manager.sync_devices()
    for uid, name in (("UID-1", "upper"), ("uid-2", "fine")):
        emulator.add_resource_claim("default", name, uid, NODE,
                                    [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-10", "request": "g"}])
    answers = manager.prepare([api.Claim("default", "UID-1", "upper"), api.Claim("default", "uid-2", "fine")],
                              float("inf"))
    assert answers["UID-1"].error == "claim default/upper: the claim's uid 'UID-1' is not a Kubernetes UID"
    assert not answers["uid-2"].error and sorted(manager.checkpoint.claims) == ["uid-2"]
    first = "GPU-00000000-0000-0000-0000-000000000000"
    Ledger(Root(root)).save_timeslice(first, TimeSlice("uid-2", 3, manager.boot, None, True))
    root.joinpath(CHECKPOINT.lstrip("/")).write_text("{")
    restarted = DraManager(Root(root), agent_state(root), client_of(tmp_path), NODE, gpus=(gpus, gpus))
    restarted.checkpoint.load()
    restarted._put_back_timeslices()  # which claims hold GPUs cannot be told: the time-slice stays
    assert restarted.checkpoint.error and gpus.calls == [] and first in Ledger(Root(root)).timeslices()


def test_every_claim_of_a_huge_request_gets_an_answer(tmp_path: Path, emulator: KubeEmulator) -> None:
    root = tmp_path / "root"
    manager = DraManager(Root(root), agent_state(root), client_of(tmp_path), NODE)
    claims = [api.Claim("default", f"uid-{n}", f"claim-{n}") for n in range(10_000)]
    answers = manager.prepare(claims, deadline=0.0)  # the deadline already passed: no claim is read
    assert len(answers) == 10_000 and all(answer.error for answer in answers.values())
    assert "more than 256 claims" in answers["uid-9999"].error and "deadline" in answers["uid-0"].error
    assert not emulator.requests_for(path="*/resourceclaims/*")


def mig_node_state(tmp_path: Path) -> AgentState:
    """A simulated node with one H100 in MIG mode (two 3g.40gb devices) and one whole: its inventory read
    through NVML and the CDI devices of the spec the cdi stage builds from it (MIG devices by UUID)."""
    import yaml
    from test_cdi import MIG_MACHINE, VERSION, Node

    from gpu_agent.sim.userspace import install_driver_userspace
    from gpu_agent.toolkit import cdi
    from gpu_agent.toolkit.cdi_duplicates import device_names

    machine = tmp_path / "machine.yaml"
    machine.write_text(yaml.safe_dump(MIG_MACHINE))
    node = Node(tmp_path / "root", str(machine)).load("nvidia")
    install_driver_userspace(node.path, VERSION)
    node.make_device_nodes()
    state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
    state.inventory = node.inventory()
    spec = cdi.build_spec(state.inventory, node.root, cdi.discover(node.root, VERSION))
    state.cdi_devices = frozenset(device_names(spec))
    path = tmp_path / "root" / state.config.config.toolkit.cdi.path.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cdi.render(spec))  # as the cdi stage writes it
    return state


def test_a_claim_for_a_mig_device_gets_that_mig_devices_cdi_device(tmp_path: Path, emulator: KubeEmulator) -> None:
    import yaml
    from test_cdi import schema_validator

    state = mig_node_state(tmp_path)
    manager = DraManager(Root(tmp_path / "root"), state, client_of(tmp_path), NODE)
    manager.sync_devices()
    mig = {device.name: device for device in manager.devices if device.name.startswith("gpu-0-mig-")}
    assert sorted(mig) == ["gpu-0-mig-3g40gb-9-0", "gpu-0-mig-3g40gb-9-4"]
    second = state.inventory.gpus[0].mig.devices[1].uuid
    assert second.startswith("MIG-") and mig["gpu-0-mig-3g40gb-9-4"].uuid == second
    emulator.add_resource_claim("default", "mig", "uid-mig", NODE,
                                [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0-mig-3g40gb-9-4",
                                  "request": "mig"}])
    emulator.add_resource_claim("default", "parent", "uid-parent", NODE,
                                [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0", "request": "gpu"}])
    answers = manager.prepare([api.Claim("default", "uid-mig", "mig"), api.Claim("default", "uid-parent", "parent")],
                              deadline=float("inf"))
    assert [(d.device_name, d.cdi_device_ids) for d in answers["uid-mig"].devices] == [
        ("gpu-0-mig-3g40gb-9-4", ["k8s.gpu.nvidia.com/claim=uid-mig-gpu-0-mig-3g40gb-9-4"])]
    assert f"nvidia.com/gpu={second}" in state.cdi_devices  # the device the agent's own spec defines
    node_spec = yaml.safe_load((tmp_path / "root/var/run/cdi/nvidia.yaml").read_text())
    claim_spec = json.loads((tmp_path / "root/var/run/cdi/k8s.gpu.nvidia.com-claim_uid-mig.json").read_text())
    [edits] = [d["containerEdits"] for d in node_spec["devices"] if d["name"] == second]
    assert [node["path"] for node in edits["deviceNodes"]] == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21",
                                                               "/dev/nvidia-caps/nvidia-cap22"]
    assert claim_spec["containerEdits"] == node_spec["containerEdits"]  # the driver's libraries, its hooks
    assert claim_spec["devices"] == [{"name": "uid-mig-gpu-0-mig-3g40gb-9-4", "containerEdits": edits}]
    assert not list(schema_validator().iter_errors(claim_spec))
    # a GPU in MIG mode is published as its MIG devices only: the whole GPU is not a device to prepare
    assert "gpu-0" not in [device.name for device in manager.devices]
    assert "'gpu-0' is not one this node publishes" in answers["uid-parent"].error


# -- opaque claim parameters (resource.nvidia.com/v1beta1) ----------------------------------------------------

def opaque(source: str, parameters: Any, *requests: str, driver: str = "gpu.nvidia.com") -> dict[str, Any]:
    entry: dict[str, Any] = {"source": source, "opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        entry["requests"] = list(requests)
    return entry


def gpu_config(strategy: str, **sharing: Any) -> dict[str, Any]:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
            "sharing": {"strategy": strategy, **sharing}}


def test_an_mps_config_is_read_into_its_limits_as_nvidias_driver_reads_them() -> None:
    """api/nvidia.com/resource/v1beta1/sharing.go at 95932046683719c43b6a0dd9613c2e5aad5d6703: the default
    pinned limit applies to every device, the per-device one (by UUID or index) over it, each in whole MiB
    (bytes / 1024 / 1024) and at least 1."""
    config = gpu_config("MPS", mpsConfig={"defaultActiveThreadPercentage": 40, "defaultPinnedDeviceMemoryLimit": "10Gi",
                                          "defaultPerDevicePinnedMemoryLimit": {"1": "1G", "GPU-c": 2 ** 30},
                                          "multiUser": False})
    found = sharing_of([opaque("FromClaim", config)], [("gpu-0", "gpu", False)])["gpu-0"]
    assert found is not None and found.mps == MpsLimits(40, 10240, (("1", 953), ("GPU-c", 1024)))
    assert found.mps.pinned_for(("GPU-a", "GPU-b", "GPU-c")) == (10240, 953, 1024)
    assert MpsLimits(threads=50).pinned_for(("GPU-a",)) is None
    assert MpsLimits(per_device_mib=(("0", 5),)).pinned_for(("GPU-a", "GPU-b")) == (5, 0)
    with pytest.raises(ConfigError, match="'2' is neither the UUID nor the index"):
        MpsLimits(per_device_mib=(("2", 5),)).pinned_for(("GPU-a", "GPU-b"))
    assert sharing_of([opaque("FromClaim", gpu_config("MPS"))], [("gpu-0", "gpu", False)])["gpu-0"] == Sharing("MPS")


@pytest.mark.parametrize("mps, error", [
    ({"defaultPinnedDeviceMemoryLimit": "lots"}, "'lots' is not a quantity"),
    ({"defaultPinnedDeviceMemoryLimit": "0.5Mi"}, "less than 1 MiB"),
    ({"defaultPinnedDeviceMemoryLimit": True}, "is not a quantity"),
    ({"defaultPerDevicePinnedMemoryLimit": ["1Gi"]}, "is not a map"),
    ({"defaultPerDevicePinnedMemoryLimit": {"0": "-1Gi"}}, r"defaultPerDevicePinnedMemoryLimit\[0\]: '-1Gi' is less"),
    ({"multiUser": True}, "multiUser: true is not supported"),
])
def test_a_malformed_mps_config_is_named(mps: Any, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        sharing_of([opaque("FromClaim", gpu_config("MPS", mpsConfig=mps))], [("gpu-0", "gpu", False)])


def test_opaque_configs_apply_by_precedence_request_and_device_type() -> None:
    short = gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Short"})
    long = gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Long"})
    mig = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}
    results = [("gpu-0", "a", False), ("gpu-1", "b", False), ("gpu-2-mig-1g10gb-19-0", "c", True)]
    # the claim's config outranks the class's whatever their order; a later one outranks an earlier one
    found = sharing_of([opaque("FromClaim", long), opaque("FromClass", short), opaque("FromClaim", mig)], results)
    assert found == {"gpu-0": Sharing("TimeSlicing", "Long"), "gpu-1": Sharing("TimeSlicing", "Long"),
                     "gpu-2-mig-1g10gb-19-0": Sharing("MPS")}
    found = sharing_of([opaque("FromClaim", short, "b"), opaque("FromClaim", long),
                        opaque("FromClaim", {"x": 1}, driver="dra.example.com")], results)
    assert found["gpu-0"] == Sharing("TimeSlicing", "Long") and found["gpu-2-mig-1g10gb-19-0"] is None
    assert found["gpu-1"] == Sharing("TimeSlicing", "Long")  # the later typeless config comes first from the end
    assert sharing_of([opaque("FromClaim", long), opaque("FromClaim", short, "b")], results)["gpu-1"] == Sharing(
        "TimeSlicing", "Short")
    assert sharing_of([opaque("FromClaim", gpu_config("TimeSlicing"))], results)["gpu-0"] == Sharing(
        "TimeSlicing", "Default")
    assert sharing_of(None, results) == {"gpu-0": None, "gpu-1": None, "gpu-2-mig-1g10gb-19-0": None}
    with pytest.raises(ConfigError, match=r"config\[0\] \(FromClaim\): a GpuConfig cannot apply to "
                                          r"'gpu-2-mig-1g10gb-19-0'.*takes MigDeviceConfig"):
        sharing_of([opaque("FromClaim", short, "c")], results)


@pytest.mark.parametrize(("config", "error"), [
    ("not a list", "config is not a list"),
    ([{"source": "FromSomewhere"}], "source 'FromSomewhere' is not one of FromClass, FromClaim"),
    ([{"source": "FromClaim"}], "only opaque parameters"),
    ([opaque("FromClaim", "text")], "opaque.parameters is not an object"),
    ([opaque("FromClaim", {**gpu_config("MPS"), "apiVersion": "resource.nvidia.com/v1"})], "apiVersion 'resource"),
    ([opaque("FromClaim", {**gpu_config("MPS"), "kind": "VfioDeviceConfig"})], "kind 'VfioDeviceConfig' is not read"),
    ([opaque("FromClaim", {**gpu_config("MPS"), "sharng": {}})], "unknown field 'sharng'"),
    ([opaque("FromClaim", gpu_config("Exclusive"))], "unknown sharing.strategy 'Exclusive'"),
    ([opaque("FromClaim", gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Tiny"}))], "interval 'Tiny'"),
    ([opaque("FromClaim", gpu_config("TimeSlicing", timeSlicingConfig={"intervall": "Short"}))],
     "unknown field 'intervall'"),
    ([opaque("FromClaim", gpu_config("TimeSlicing", mpsConfig={}))], "mpsConfig cannot be used with the TimeSlicing"),
    ([opaque("FromClaim", gpu_config("MPS", timeSlicingConfig={}))], "timeSlicingConfig cannot be used with the MPS"),
    ([opaque("FromClaim", gpu_config("MPS", mpsConfig={"defaultActiveThreadPercentage": 101}))], "0 to 100"),
    ([opaque("FromClaim", gpu_config("MPS", mpsConfig={"defaultActiveThreadPercentage": True}))], "0 to 100"),
    ([opaque("FromClaim", {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
                           "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {}}})],
     "unknown field 'timeSlicingConfig'"),
    ([opaque("FromClaim", gpu_config("MPS"), 7)], "requests is not a list of names"),
])
def test_a_malformed_opaque_config_is_named(config: Any, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        sharing_of(config, [("gpu-0", "a", False)])


def test_claims_with_opaque_configs_are_prepared_shared_refused_or_named_each_on_its_own(
        tmp_path: Path, emulator: KubeEmulator) -> None:
    root = tmp_path / "root"
    first = "GPU-00000000-0000-0000-0000-000000000000"
    gpus = Gpus({first: "EXCLUSIVE_PROCESS"})
    manager = DraManager(Root(root), agent_state(root), client_of(tmp_path), NODE, gpus=(gpus, gpus))
    manager.sync_devices()
    allocated = [{"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-10", "request": "gpu"}]
    short = gpu_config("TimeSlicing", timeSlicingConfig={"interval": "Short"})
    emulator.add_resource_claim("default", "sliced", "uid-ts", NODE, allocated, [opaque("FromClaim", short)])
    mps = gpu_config("MPS", mpsConfig={"defaultActiveThreadPercentage": 50})
    emulator.add_resource_claim("default", "mps", "uid-mps", NODE, allocated, [opaque("FromClass", mps)])
    emulator.add_resource_claim("default", "typo", "uid-typo", NODE, allocated,
                                [opaque("FromClaim", gpu_config("TimeSlicing", timeSlicingConfig={"interval": 5}))])
    far = gpu_config("MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}})
    emulator.add_resource_claim("default", "far", "uid-far", NODE, allocated, [opaque("FromClaim", far)])
    wanted: list[int] = []
    manager.mps_wanted = lambda: wanted.append(1)
    clock = iter(range(1000)).__next__  # each look at the time a second later: the deadline comes at once
    answers = manager.prepare([api.Claim("default", uid, name) for uid, name in
                               (("uid-ts", "sliced"), ("uid-typo", "typo"), ("uid-far", "far"), ("uid-mps", "mps"))],
                              10, now=clock)
    assert not answers["uid-ts"].error and [d.device_name for d in answers["uid-ts"].devices] == ["gpu-10"]
    assert manager.checkpoint.claims["uid-ts"].devices[0].sharing == Sharing("TimeSlicing", "Short")
    # as NVIDIA's plugin sets it: compute mode DEFAULT, then the time-slice; what the mode was is kept
    assert gpus.calls == [("mode", first, "DEFAULT"), ("timeslice", first, 1)]
    assert Ledger(Root(root)).timeslices() == {first: TimeSlice("uid-ts", 1, manager.boot, "EXCLUSIVE_PROCESS", True)}
    resource = "k8s.gpu.nvidia.com/claim/uid-mps"
    assert manager.state.claim_mps == {resource: ClaimMps(("GPU-00000000-0000-0000-0000-000000000000",), 50, None)}
    assert wanted  # the daemon's MPS watch was told
    # its daemon does not run (nothing starts it here): not answered yet, kept prepared, asked again
    assert answers["uid-mps"].error == ("claim default/mps: its MPS control daemon does not run yet (not started "
                                        "yet); the kubelet asks again")
    manager.state.publish_mps(None, {}, {resource})  # as the MPS watch publishes a daemon running as asked
    again = manager.prepare([api.Claim("default", "uid-mps", "mps")], float("inf"))
    assert not again["uid-mps"].error and [d.device_name for d in again["uid-mps"].devices] == ["gpu-10"]
    assert list(again["uid-mps"].devices[0].cdi_device_ids) == ["k8s.gpu.nvidia.com/claim=uid-mps-gpu-10"]
    spec_file = root / "var/run/cdi/k8s.gpu.nvidia.com-claim_uid-mps.json"
    pipe = "/run/nvidia/mps/k8s.gpu.nvidia.com/claim/uid-mps/pipe"
    assert json.loads(spec_file.read_text()) == {
        "cdiVersion": "0.3.0", "kind": "k8s.gpu.nvidia.com/claim",  # a uid that starts with a letter
        "containerEdits": NODE_SPEC_COMMON,
        "devices": [{"name": "uid-mps-gpu-10", "containerEdits": {  # the GPU's edits, then its daemon's
            "deviceNodes": [{"path": "/dev/nvidia10"}],
            "env": ["CUDA_MPS_PIPE_DIRECTORY=/mps/k8s.gpu.nvidia.com/claim/uid-mps/pipe"],
            "mounts": [{"hostPath": pipe, "containerPath": "/mps/k8s.gpu.nvidia.com/claim/uid-mps/pipe",
                        "options": ["rw", "nosuid", "nodev", "bind"]},
                       {"hostPath": "/run/nvidia/mps/shm", "containerPath": "/dev/shm",
                        "options": ["rw", "nosuid", "nodev", "bind"]}]}}]}
    assert Ledger(Root(root)).claim_specs() == {"/var/run/cdi/k8s.gpu.nvidia.com-claim_uid-mps.json": "uid-mps",
                                                "/var/run/cdi/k8s.gpu.nvidia.com-claim_uid-ts.json": "uid-ts"}
    stamp = spec_file.stat().st_mtime_ns
    manager.prepare([api.Claim("default", "uid-mps", "mps")], float("inf"))
    assert spec_file.stat().st_mtime_ns == stamp  # as written: not written again
    assert "claim default/typo: opaque config: config[0] (FromClaim): unknown sharing.timeSlicingConfig.interval " \
           "'5'" in answers["uid-typo"].error
    assert "claim default/far: opaque config: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: '3' is neither" \
           in answers["uid-far"].error
    assert sorted(manager.checkpoint.claims) == ["uid-mps", "uid-ts"]
    assert manager.unprepare([api.Claim("default", "uid-mps", "mps")])["uid-mps"].error == ""
    assert manager.state.claim_mps == {}
    assert not spec_file.exists() and list(Ledger(Root(root)).claim_specs().values()) == ["uid-ts"]
    reread = Checkpoint(manager.checkpoint.path)
    reread.load()
    assert reread.claims == manager.checkpoint.claims  # the sharing survives a restart of the agent
    manager.prepare([api.Claim("default", "uid-ts", "sliced")], float("inf"))
    assert len(gpus.calls) == 2  # the time-sliced claim asked again, set already: nothing changed
    assert manager.unprepare([api.Claim("default", "uid-ts", "sliced")])["uid-ts"].error == ""
    assert gpus.calls[2:] == [("timeslice", first, 0), ("mode", first, "EXCLUSIVE_PROCESS")]
    assert Ledger(Root(root)).timeslices() == {} and Ledger(Root(root)).claim_specs() == {}


@pytest.mark.parametrize(("settings", "api"), [({"dra": {"enabled": True}}, "dra"), ({"plugin": {"api": "dra"}}, "dra"),
                                             ({"plugin": {"api": "both"}}, "both")])
def test_while_the_node_serves_through_dra_the_device_plugin_advertises_nothing_and_says_why(
        tmp_path: Path, settings: dict[str, Any], api: str) -> None:
    from gpu_agent.plugin.service import DevicePluginManager
    from harness import SimNode

    root = tmp_path / "r"
    (root / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    state = SimNode(root, "dgx-h100").apply({"toolkit": {"enabled": False}, **settings}).state
    asyncio.run(DevicePluginManager(Root(root), state).sync())
    assert state.plugin is not None and state.plugin["resources"] == []
    assert state.plugin["reason"].startswith(f"off: plugin.api is {api}: ")
    assert state.to_json()["api"] == {"configured": api, "serving": api, "switch": None, "both": None}
    assert not list((root / "var/lib/kubelet/device-plugins").iterdir())
    # the same inventory is what DRA publishes: a simulated DGX H100's eight GPUs under NVIDIA's names
    devices = published(state.inventory, state.health_of(state.inventory))
    assert [device.name for device in devices] == [f"gpu-{n}" for n in range(8)]
    assert {device.entry["attributes"]["productName"]["string"] for device in devices} == {"NVIDIA H100 80GB HBM3"}


def test_the_old_spelling_dra_enabled_yields_to_an_explicit_plugin_api() -> None:
    from gpu_agent.config.plugin import DraConfig, PluginConfig, configured_api

    assert configured_api(PluginConfig(), DraConfig()) == "device-plugin"
    assert configured_api(PluginConfig(), DraConfig(enabled=True)) == "dra"
    assert configured_api(PluginConfig(api="both"), DraConfig(enabled=True)) == "both"


def test_a_switch_of_api_waits_for_the_pods_and_claims_holding_gpus(tmp_path: Path) -> None:
    from test_pod_labels import Kubelet as PodResources
    from test_pod_labels import response

    from gpu_agent.dra import switch
    from gpu_agent.dra.claims import PreparedClaim, PreparedDevice

    root = Root(tmp_path)
    assert asyncio.run(switch.holders(root, "device-plugin")) == []  # no kubelet: nothing held
    assert asyncio.run(switch.holders(root, "dra")) == []  # no checkpoint: no claim prepared
    kubelet = PodResources(tmp_path)
    try:
        kubelet.answer = response(("ml", "trainer", {"main": {"nvidia.com/gpu": ["GPU-1"]}}),
                                  ("web", "nginx", {"main": {"example.com/nic": ["eth1"]}}))
        held = asyncio.run(switch.holders(root, "device-plugin"))
    finally:
        kubelet.stop()
    assert held == ["pod ml/trainer"]
    message = switch.waiting("device-plugin", "dra", held)
    assert message == "plugin.api dra waits: serving device-plugin until these end: pod ml/trainer"
    checkpoint = Checkpoint(root(CHECKPOINT))
    checkpoint.put("uid-1", PreparedClaim("ml", "claim-a", (PreparedDevice(("gpu",), NODE, "gpu-0", ("x",)),)))
    assert asyncio.run(switch.holders(root, "both")) == ["claim ml/claim-a"]
    assert switch.switch_now("dra", "both") and not switch.switch_now("both", "device-plugin")
    many = switch.waiting("dra", "device-plugin", [f"claim ml/c{n}" for n in range(8)])
    assert many.endswith("claim ml/c4 and 3 more")
    root(CHECKPOINT).write_text("{")
    with pytest.raises(OSError, match="cannot be read"):
        asyncio.run(switch.holders(root, "dra"))


async def api_until(state: AgentState, done: Any) -> None:
    """Until done() is true (10 s at most); /status api shown if it never is."""
    for _ in range(1000):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(state.to_json()["api"])


def test_the_daemon_switches_api_only_once_no_pod_holds_a_gpu(root: Path, write_config: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from kubelet_api.podresources_pb2 import ListPodResourcesResponse
    from test_pod_labels import Kubelet as PodResources
    from test_pod_labels import response

    from gpu_agent.daemon import app

    monkeypatch.setattr(app, "SWITCH_RECHECK_S", 0.01)
    config = write_config({})
    runtime = app.Runtime.build(Root(root), load_config(config, required=True), "dgx-h100")
    state = runtime.state
    kubelet = PodResources(root)
    kubelet.answer = response(("ml", "trainer", {"main": {"nvidia.com/gpu": ["GPU-1"]}}))

    async def scenario() -> None:
        daemon = app.Daemon(runtime, config, config_required=True)
        monkeypatch.setattr(daemon, "publish", lambda: None)
        daemon._ensure_api()
        assert state.serving() == "device-plugin" and state.api_switch is None
        state.config = load_config(write_config({"plugin": {"api": "dra"}}), required=True)
        daemon._ensure_api()
        await api_until(state, lambda: state.api_switch and "pod ml/trainer" in state.api_switch)
        assert state.serving() == "device-plugin" and state.to_json()["api"] == {
            "configured": "dra", "serving": "device-plugin",
            "switch": "plugin.api dra waits: serving device-plugin until these end: pod ml/trainer", "both": None}
        calls = kubelet.calls
        await api_until(state, lambda: kubelet.calls > calls)  # asked again while it waits
        kubelet.answer = ListPodResourcesResponse()  # the pod ended
        await api_until(state, lambda: state.serving_api == "dra")
        assert state.api_switch is None
        state.config = load_config(write_config({"plugin": {"api": "both"}}), required=True)
        daemon._ensure_api()  # both serves through DRA as dra does: nothing changes hands
        assert state.serving() == "both" and state.api_switch is None

    try:
        asyncio.run(scenario())
    finally:
        kubelet.stop()
        runtime.nvml.close()


def test_status_shows_the_pool_and_the_checkpoints_claims_while_the_dra_plugin_does_not_run(
        root: Path, write_config: Any) -> None:
    """plugin.api device-plugin (the default): /status dra names the devices the pool would publish and the
    claims the checkpoint still holds (prepared before the node switched back), and that nothing runs."""
    from gpu_agent.daemon import app
    from gpu_agent.dra.claims import PreparedClaim, PreparedDevice

    config = write_config({"kubernetes": {"node_name": NODE}})
    runtime = app.Runtime.build(Root(root), load_config(config, required=True), "dgx-h100")
    try:
        asyncio.run(runtime.engine.reconcile(force=True))
        daemon = app.Daemon(runtime, config, config_required=True)
        daemon._ensure_dra()
        section = runtime.state.to_json()["dra"]
        assert section["running"] is False and section["pool"] == NODE and "does not run" in section["reason"]
        assert [device["name"] for device in section["devices"]] == [f"gpu-{n}" for n in range(8)]
        assert section["prepared_claims"] == {} and section["checkpoint_error"] is None
        Checkpoint(Root(root)(CHECKPOINT)).put("uid-1", PreparedClaim("ml", "big-gpu", (
            PreparedDevice(("gpu",), NODE, "gpu-3", ("nvidia.com/gpu=GPU-3",)),)))
        daemon._ensure_dra()
        claims = runtime.state.to_json()["dra"]["prepared_claims"]
        assert claims["uid-1"]["name"] == "big-gpu" and claims["uid-1"]["devices"][0]["device"] == "gpu-3"
    finally:
        runtime.nvml.close()


def test_damaged_answers_decode_as_protobuf_decodes_them_or_raise_decode_error() -> None:
    import random

    from google.protobuf import unknown_fields
    from google.protobuf.message import DecodeError as ProtobufDecodeError

    from gpu_agent.proto3 import DecodeError

    good = api.NodePrepareResourcesResponse(claims={
        f"uid-{n}": api.NodePrepareResourceResponse(devices=[api.Device(["r"], NODE, f"gpu-{n}", [f"c={n}"])],
                                                    error="e" * n) for n in range(3)}).encode()
    rng = random.Random(37)
    agreed = 0
    for _ in range(400):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            theirs = dra_v1_pb2.NodePrepareResourcesResponse.FromString(bytes(data))
        except ProtobufDecodeError:
            theirs = None
        try:
            ours = api.NodePrepareResourcesResponse.decode(bytes(data))
        except DecodeError:
            ours = None
        if theirs is not None and ours is not None and not len(unknown_fields.UnknownFieldSet(theirs)):
            # (a map entry with an unknown field in it: Python's protobuf sets the whole entry aside as unknown,
            # Go's, the kubelet's, keeps it under its key, as proto3.py does; those cases are not compared)
            # protobuf keeps unknown fields and re-sends them; what both read is the same
            mine = dra_v1_pb2.NodePrepareResourcesResponse.FromString(ours.encode())
            assert MessageToDict(mine) == MessageToDict(theirs)
            agreed += 1
    assert agreed > 50  # most damage still decodes: the comparison ran


def test_a_socket_directory_it_cannot_make_is_named_and_served_once_it_can(tmp_path: Path,
                                                                          emulator: KubeEmulator) -> None:
    root = tmp_path / "root"
    (root / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    (root / "var/lib/kubelet/plugins").write_text("not a directory")

    async def scenario() -> None:
        manager = DraManager(Root(root), agent_state(root), client_of(tmp_path), NODE)
        task = asyncio.create_task(manager.run())
        try:
            for _ in range(500):
                if manager.state.dra and manager.state.dra["serve_error"]:
                    break
                await asyncio.sleep(0.01)
            assert manager.state.dra is not None and "Not a directory" in manager.state.dra["serve_error"]
            assert not task.done()
            (root / "var/lib/kubelet/plugins").unlink()
            manager.wake()
            for _ in range(500):
                if (root / manager.host_registration.lstrip("/")).exists() and not manager.serve_error:
                    break
                await asyncio.sleep(0.01)
            assert (root / manager.host_endpoint.lstrip("/")).exists() and manager.serve_error is None
        finally:
            await stopped(task)

    asyncio.run(scenario())


@pytest.mark.subprocess
@pytest.mark.parametrize("device_taints", [False, True], ids=["taints-dropped", "taints-kept"])
def test_the_daemon_publishes_an_xid_lost_gpu_withdrawn_or_tainted_and_returns_it(
        device_taints: bool, agent: Any, root: Path, tmp_path: Path) -> None:
    """gpu-agent run with dra.enabled on a simulated DGX H100: registered by a kubelet, its pool published with
    the node's credentials; an XID 79 on GPU 2 withdraws it from the pool where the API server drops device
    taints, and taints it where it keeps them (a new generation either way); its recovery returns it."""
    import time

    from harness import run_cli

    with KubeEmulator(tmp_path / "pki", nodes=(NODE,), device_taints=device_taints) as server:
        server.write_kubeconfig(root / KUBECONFIG.lstrip("/"))
        (root / "var/lib/kubelet/device-plugins").mkdir(parents=True)
        daemon = agent("dgx-h100", settings={"kubernetes": {"node_name": NODE}, "dra": {"enabled": True}})
        daemon.wait_ready()
        registration_socket = root / "var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock"

        def pool(count: int, tainted: int = 0) -> dict[str, Any]:
            deadline = time.monotonic() + 20
            while True:
                stored = server.resource_slices(NODE)
                if stored and len(stored[0]["spec"]["devices"]) == count and \
                        sum(bool(d.get("taints")) for d in stored[0]["spec"]["devices"]) == tainted:
                    return stored[0]["spec"]
                assert time.monotonic() < deadline, f"no pool of {count} devices: {stored}"
                time.sleep(0.05)

        async def register() -> None:
            for _ in range(1000):
                if registration_socket.exists():
                    break
                await asyncio.sleep(0.01)
            kubelet = Kubelet(root)
            try:
                stub = pluginregistration_grpc.RegistrationStub(kubelet.channel(
                    "/var/lib/kubelet/plugins_registry/gpu.nvidia.com-reg.sock"))
                assert (await stub.GetInfo(pluginregistration_pb2.InfoRequest())).name == "gpu.nvidia.com"
                await stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True))
            finally:
                kubelet.close()

        asyncio.run(register())
        first = pool(8)
        assert [device["name"] for device in first["devices"]] == [f"gpu-{n}" for n in range(8)]
        assert run_cli("sim", "inject-xid", "--gpu", "2", "--xid", "79", root=root).returncode == 0
        if device_taints:
            lost = pool(8, tainted=1)
            taint = next(d["taints"] for d in lost["devices"] if d["name"] == "gpu-2")
            assert [(t["key"], t.get("value"), t["effect"]) for t in taint] == [
                ("gpu.nvidia.com/xid", "79", "NoSchedule"), ("gpu.nvidia.com/gpu-lost", None, "NoSchedule")]
        else:
            lost = pool(7)
            assert "gpu-2" not in [device["name"] for device in lost["devices"]]
        assert lost["pool"]["generation"] > first["pool"]["generation"]
        assert run_cli("sim", "clear", root=root).returncode == 0
        back = pool(8)
        assert back["pool"]["generation"] > lost["pool"]["generation"]
        server.delete_resource_slices(NODE)  # a kubelet that restarts deletes them, then registers the plugin again
        asyncio.run(register())
        assert pool(8)["pool"]["generation"] > back["pool"]["generation"]
        status = json.loads(daemon.wait_http("/status", lambda code, _: code == 200)[1])
        assert status["dra"]["pool"] == NODE and len(status["dra"]["devices"]) == 8
        assert status["dra"]["device_taints"] is device_taints
        assert status["plugin"]["resources"] == [] and "plugin.api is dra" in status["plugin"]["reason"]


def test_the_checkpoint_keeps_a_claims_mps_limits_across_a_restart(tmp_path: Path) -> None:
    limits = MpsLimits(30, 10240, (("0", 953), ("GPU-c", 1024)))
    claim_ = PreparedClaim("ml", "shared", (PreparedDevice(("gpu",), NODE, "gpu-10", ("nvidia.com/gpu=GPU-a",),
                                                          Sharing("MPS", mps=limits)),
                                           PreparedDevice(("gpu",), NODE, "gpu-11", ("nvidia.com/gpu=GPU-b",),
                                                          Sharing("TimeSlicing", "Long"))))
    Checkpoint(tmp_path / "prepared.json").put("uid-1", claim_)
    again = Checkpoint(tmp_path / "prepared.json")
    again.load()
    assert again.error is None and again.claims == {"uid-1": claim_}
    damaged = json.loads((tmp_path / "prepared.json").read_text())
    damaged["claims"]["uid-1"]["devices"][0]["sharing"]["mps"]["threads"] = "30"
    (tmp_path / "prepared.json").write_text(json.dumps(damaged))
    broken = Checkpoint(tmp_path / "prepared.json")
    broken.load()
    assert broken.claims == {} and "cannot be read" in str(broken.error)


def test_mps_on_a_mig_device_is_refused_for_its_claim() -> None:
    devices = {device.name: device for device in published(inventory(gpu(0, "3g.40gb")), {})}
    config = [opaque("FromClaim", {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
                                   "sharing": {"strategy": "MPS"}})]
    allocated = {"metadata": {"uid": "u"}, "status": {"allocation": {"devices": {"config": config, "results": [
        {"driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-10-mig-3g40gb-9-0", "request": "mig"}]}}}}
    with pytest.raises(ClaimError, match="MPS on a MIG device is not supported by gpu-agent"):
        devices_for(allocated, "u", NODE, devices, None)


def test_a_claims_cdi_spec_is_valid_cdi_and_named_only_from_a_kubernetes_uid() -> None:
    from gpu_agent.dra import claim_cdi
    from test_cdi import schema_validator

    mps = claim_cdi.mps_edits("k8s.gpu.nvidia.com/claim/x")
    gpu_1 = claim_cdi.merged({"deviceNodes": [{"path": "/dev/nvidia1"}], "additionalGids": [44]}, mps)
    assert gpu_1["env"] == mps["env"] and gpu_1["deviceNodes"] == [{"path": "/dev/nvidia1"}]
    spec = claim_cdi.render("5b3c2f6e-0d1a-4c1e-9f0a-1b2c3d4e5f60", {"gpu-0": mps, "gpu-1": gpu_1},
                            {"env": ["NVIDIA_VISIBLE_DEVICES=void"]})
    assert not list(schema_validator().iter_errors(spec))
    assert spec["cdiVersion"] == "0.7.0"  # additionalGids; a name that starts with a digit needs 0.5.0 at least
    assert [device["name"] for device in spec["devices"]] == ["5b3c2f6e-0d1a-4c1e-9f0a-1b2c3d4e5f60-gpu-0",
                                                              "5b3c2f6e-0d1a-4c1e-9f0a-1b2c3d4e5f60-gpu-1"]
    for uid in ("../etc", "A", "", "x" * 65, "uid/1"):
        with pytest.raises(claim_cdi.ClaimSpecError, match="is not a Kubernetes UID"):
            claim_cdi.spec_path(uid)
