"""gpu_agent.proto3 held to protobuf itself: the declarations to the kubelet APIs' .proto files (their
descriptors, as protoc compiled them into tests/kubelet_api), and every encoding, decoding and
rejection to protobuf's own runtime on the same messages and bytes."""
from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message as ProtobufMessage
from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError
from kubelet_api import deviceplugin_pb2, podresources_pb2

from gpu_agent.host.sockets import socket_address
from gpu_agent.kube import podresources
from gpu_agent.plugin import api
from gpu_agent.plugin.devices import Resource
from gpu_agent.plugin.server import PluginEndpoint
from gpu_agent.proto3 import BOOL, INT32, INT64, MESSAGE, STRING, STRING_MAP, DecodeError, Message

KINDS = {FieldDescriptor.TYPE_STRING: STRING, FieldDescriptor.TYPE_BOOL: BOOL, FieldDescriptor.TYPE_INT32: INT32,
         FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_MESSAGE: MESSAGE}
PLUGIN_MESSAGES = sorted(deviceplugin_pb2.DESCRIPTOR.message_types_by_name)


def declared(kind: type[Message]) -> dict[int, tuple[str, str, bool, str]]:
    return {field.number: (field.name, field.kind, field.repeated and field.kind != STRING_MAP,
                           field.message.__name__ if field.message else "") for field in kind.fields()}


def described(descriptor: Descriptor) -> dict[int, tuple[str, str, bool, str]]:
    found = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            found[field.number] = (field.name, STRING_MAP, False, "")
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == FieldDescriptor.LABEL_REPEATED
        found[field.number] = (field.name, KINDS[field.type], repeated,
                               field.message_type.name if field.message_type else "")
    return found


@pytest.mark.parametrize("name", PLUGIN_MESSAGES)
def test_every_device_plugin_message_is_declared_field_for_field(name: str) -> None:
    assert declared(getattr(api, name)) == described(deviceplugin_pb2.DESCRIPTOR.message_types_by_name[name])


def test_the_pod_resources_declarations_are_a_faithful_subset() -> None:
    for kind in (podresources.ListPodResourcesRequest, podresources.ListPodResourcesResponse,
                 podresources.PodResources, podresources.ContainerResources, podresources.ContainerDevices):
        ours = declared(kind)
        theirs = described(podresources_pb2.DESCRIPTOR.message_types_by_name[kind.__name__])
        assert ours and {number: theirs[number] for number in ours} == ours or not theirs, kind.__name__


def test_the_service_paths_and_shapes_are_the_protos() -> None:
    class Service(api.DevicePluginBase):
        GetDevicePluginOptions = ListAndWatch = GetPreferredAllocation = Allocate = PreStartContainer = None  # type: ignore

    service = deviceplugin_pb2.DESCRIPTOR.services_by_name["DevicePlugin"]
    mapping = Service().__mapping__()
    assert set(mapping) == {f"/v1beta1.DevicePlugin/{method.name}" for method in service.methods}
    for method in service.methods:
        handler = mapping[f"/v1beta1.DevicePlugin/{method.name}"]
        assert (handler.request_type.__name__, handler.reply_type.__name__) == (method.input_type.name,
                                                                                method.output_type.name)
        assert (handler.cardinality is Cardinality.UNARY_STREAM) == method.server_streaming
    register = deviceplugin_pb2.DESCRIPTOR.services_by_name["Registration"].methods_by_name["Register"]
    method = api.register_method(None)  # type: ignore[arg-type]
    assert method.name == "/v1beta1.Registration/Register"
    assert (method.request_type.__name__, method.reply_type.__name__) == (register.input_type.name,
                                                                          register.output_type.name)
    listed = podresources.list_method(None)  # type: ignore[arg-type]
    assert listed.name == "/v1.PodResourcesLister/List"


# -- random messages, the same on both sides ------------------------------------------------------------

TEXTS = ["", "a", "GPU-fef8089b-4820-abfc-e83e-94318197576e", "nvidia.com/gpu", "ünïcødé ✓ 🚀", "x" * 300, "\x00"]


def random_value(rng: random.Random, field: Any, depth: int) -> Any:
    if field.kind == STRING_MAP:
        return {rng.choice(TEXTS) + str(i): rng.choice(TEXTS) for i in range(rng.randrange(4))}
    if field.repeated and field.kind == MESSAGE:
        return [random_message(rng, field.message, depth + 1) for _ in range(rng.randrange(4))]
    if field.repeated:
        return [random_value(rng, field._replace(repeated=False), depth) for _ in range(rng.randrange(4))]
    if field.kind == STRING:
        return rng.choice(TEXTS)
    if field.kind == BOOL:
        return rng.random() < 0.5
    if field.kind in (INT32, INT64):
        bits = 32 if field.kind == INT32 else 64
        return rng.choice([0, 1, -1, 127, 128, 300, (1 << (bits - 1)) - 1, -(1 << (bits - 1)),
                           rng.randrange(-(1 << (bits - 1)), 1 << (bits - 1))])
    return None if rng.random() < 0.3 and depth else random_message(rng, field.message, depth + 1)


def random_message(rng: random.Random, kind: type[Message], depth: int = 0) -> Message:
    return kind(**{field.name: random_value(rng, field, depth) for field in kind.fields()})  # type: ignore[call-arg]


def as_dict(message: Message) -> dict[str, Any]:
    """As protobuf's MessageToDict (proto names, zero values left out) sees the same message."""
    found: dict[str, Any] = {}
    for field in message.fields():
        value = getattr(message, field.name)
        if field.kind == MESSAGE:
            value = [as_dict(item) for item in value] if field.repeated else None if value is None else as_dict(value)
        elif field.kind == INT64 and value:
            value = str(value)  # JSON's int64 is a string
        if value or (field.kind == MESSAGE and value == {}):
            found[field.name] = value
    return found


def protobuf_class(kind: type[Message]) -> type[ProtobufMessage]:
    module = deviceplugin_pb2 if kind.__module__ == api.__name__ else podresources_pb2
    return getattr(module, kind.__name__)  # type: ignore[no-any-return]


def theirs_of(message: Message) -> ProtobufMessage:
    return protobuf_class(type(message)).FromString(message.encode())


@pytest.mark.parametrize("name", PLUGIN_MESSAGES)
def test_encodings_agree_with_protobuf_both_ways(name: str) -> None:
    kind = getattr(api, name)
    rng = random.Random(name)
    for _ in range(200):
        ours = random_message(rng, kind)
        encoded = ours.encode()
        theirs = protobuf_class(kind).FromString(encoded)
        assert MessageToDict(theirs, preserving_proto_field_name=True) == as_dict(ours)
        assert theirs.SerializeToString(deterministic=True) == encoded  # the same bytes, field for field
        assert kind.decode(theirs.SerializeToString()) == ours


def test_a_pod_resources_answer_keeps_what_attribution_needs_and_skips_the_rest() -> None:
    full = podresources_pb2.ListPodResourcesResponse()
    pod = full.pod_resources.add(name="trainer", namespace="ml", cpu_ids=[1, 2, 300])
    pod.memory.add(memory_type="hugepages-1Gi", size=1 << 40).topology.nodes.add(ID=1)
    container = pod.containers.add(name="main", cpu_ids=[4, 5])
    container.devices.add(resource_name="nvidia.com/gpu", device_ids=["GPU-1", "GPU-2"]).topology.nodes.add(ID=0)
    claim = container.dynamic_resources.add(claim_name="c", claim_namespace="ml")
    claim.claim_resources.add(driver_name="gpu.nvidia.com", pool_name="node-1", device_name="gpu-0", share_id="s",
                              cdi_devices=[{"name": "k8s.gpu.nvidia.com/claim=c-gpu-0"}])
    decoded = podresources.ListPodResourcesResponse.decode(full.SerializeToString())
    assert decoded == podresources.ListPodResourcesResponse(pod_resources=[podresources.PodResources(
        name="trainer", namespace="ml", containers=[podresources.ContainerResources(name="main", devices=[
            podresources.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=["GPU-1", "GPU-2"])],
            dynamic_resources=[podresources.DynamicResource("c", "ml", [
                podresources.ClaimResource("gpu.nvidia.com", "node-1", "gpu-0")])])])])


def test_a_singular_message_seen_twice_merges_and_the_last_scalar_wins() -> None:
    first = api.Device(ID="a", health="Healthy", topology=api.TopologyInfo(nodes=[api.NUMANode(ID=0)]))
    second = api.Device(ID="b", topology=api.TopologyInfo(nodes=[api.NUMANode(ID=1)]))
    both = first.encode() + second.encode()
    ours = api.Device.decode(both)
    assert ours == api.Device(ID="b", health="Healthy", topology=api.TopologyInfo(nodes=[api.NUMANode(ID=0),
                                                                                         api.NUMANode(ID=1)]))
    assert MessageToDict(deviceplugin_pb2.Device.FromString(both), preserving_proto_field_name=True) == as_dict(ours)


def test_an_empty_message_set_is_sent_and_an_unset_one_is_not() -> None:
    assert api.Device(ID="x", topology=api.TopologyInfo()).encode() == b"\n\x01x\x1a\x00"
    assert api.Device(ID="x").encode() == b"\n\x01x"
    assert api.Device.decode(b"\n\x01x\x1a\x00").topology == api.TopologyInfo()


# -- malformed input: rejected as protobuf rejects it, with DecodeError and nothing else ----------------

MALFORMED = {
    "a truncated varint": b"\x18\x80",
    "a varint of 11 bytes": b"\x18" + b"\xff" * 10 + b"\x01",
    "a length past the end": b"\n\x05abc",
    "a tag that never ends": b"\x80",
    "field number 0": b"\x00\x01",
    "wire type 6": b"\x0e",
    "wire type 7": b"\x0f",
    "an end group never started": b"\x0c",
    "an unterminated group": b"\x4b\x08\x01",
    "a group ended by another number": b"\x4b\x54",
    "a truncated fixed64": b"\x49\x01\x02",
    "a truncated fixed32": b"\x4d\x01",
    "invalid UTF-8 in a string": b"\n\x02\xc3\x28",
    "invalid UTF-8 in a nested string": b"\x2a\x04\n\x02\xff\xfe",  # as ContainerAllocateResponse.cdi_devices[0]
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_bytes_raise_decode_error_where_protobuf_refuses_them_too(case: str) -> None:
    data = MALFORMED[case]
    kind = api.ContainerAllocateResponse if "nested" in case else api.Device
    with pytest.raises(DecodeError):
        kind.decode(data)
    with pytest.raises(ProtobufDecodeError):
        protobuf_class(kind).FromString(data)


def test_unknown_fields_of_every_wire_type_are_skipped_as_protobuf_skips_them() -> None:
    unknown = (b"\x48\x96\x01"  # 9: varint
               b"\x51" + bytes(8) +  # 10: fixed64
               b"\x5a\x03abc"  # 11: length-delimited
               b"\x63\x68\x01\x64"  # 12: a group holding field 13, then its end
               b"\x75" + bytes(4) +  # 14: fixed32
               b"\x10\x01")  # health as a varint: the wrong wire type, so unknown too
    data = b"\n\x01x" + unknown
    assert api.Device.decode(data) == api.Device(ID="x")
    assert deviceplugin_pb2.Device.FromString(data).ID == "x"


def has_map(kind: type[Message], seen: frozenset[str] = frozenset()) -> bool:
    return any(field.kind == STRING_MAP or (field.message is not None and field.message.__name__ not in seen
                                            and has_map(field.message, seen | {kind.__name__}))
               for field in kind.fields())


def test_random_bytes_never_raise_anything_but_decode_error_and_agree_with_protobuf() -> None:
    """Mutated encodings of every message, read as every message. Where a map entry holds unknown fields,
    protobuf's upb keeps the whole entry as an unknown field of the parent, where Go's protobuf (the
    kubelet's) and we skip those fields and keep the entry: there only the absence of any other error counts.
    The agent decodes no message with a map."""
    rng = random.Random(15)
    seeds = [random_message(rng, getattr(api, name)).encode() for name in PLUGIN_MESSAGES for _ in range(3)]
    disagreements = []
    for trial in range(3000):
        data = bytearray(rng.choice(seeds) or b"\n")
        for _ in range(rng.randrange(1, 4)):
            spot = rng.randrange(len(data))
            data[spot] = rng.randrange(256) if rng.random() < 0.7 else data[spot] ^ 0x80
            if rng.random() < 0.2:
                del data[rng.randrange(1, len(data) + 1):]
        kind = getattr(api, rng.choice(PLUGIN_MESSAGES))
        try:
            ours: Any = as_dict(kind.decode(bytes(data)))
        except DecodeError:
            ours = "rejected"
        if has_map(kind):
            continue
        try:
            theirs: Any = MessageToDict(protobuf_class(kind).FromString(bytes(data)), preserving_proto_field_name=True)
        except ProtobufDecodeError:
            theirs = "rejected"
        if ours != theirs:
            disagreements.append((trial, kind.__name__, bytes(data), ours, theirs))
    assert not disagreements[:3]


def test_values_out_of_range_or_of_the_wrong_type_are_refused_when_encoding() -> None:
    with pytest.raises(ValueError, match="ContainerPreferredAllocationRequest.allocation_size"):
        api.ContainerPreferredAllocationRequest(allocation_size=1 << 31).encode()
    with pytest.raises(TypeError, match="Device.ID must be a str"):
        api.Device(ID=5).encode()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ListAndWatchResponse.devices must be a Device"):
        api.ListAndWatchResponse(devices=[api.NUMANode()]).encode()  # type: ignore[list-item]


# -- over gRPC: a malformed request is the caller's error ----------------------------------------------

class RawCodec(CodecBase):
    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


def test_a_malformed_allocate_request_is_answered_invalid_argument(tmp_path: Path) -> None:
    async def scenario() -> GRPCError:
        endpoint = PluginEndpoint(tmp_path, Resource("nvidia.com/gpu", ()),
                                  {"list_strategy": lambda: "envvar", "fail_greater_than_one": lambda: False,
                                   "prefer": lambda resource, available, must, size: available[:size]})
        await endpoint.start()
        address, fd = socket_address(endpoint.path)
        channel = Channel(path=address, codec=RawCodec())
        try:
            allocate = UnaryUnaryMethod(channel, "/v1beta1.DevicePlugin/Allocate", bytes, bytes)  # type: ignore[var-annotated]
            with pytest.raises(GRPCError) as raised:
                await allocate(b"\n\x04\n\x02\xff\xfe", timeout=5)
            return raised.value
        finally:
            channel.close()
            await endpoint.stop()

    error = asyncio.run(scenario())
    assert error.status is Status.INVALID_ARGUMENT
    assert error.message == "malformed request: ContainerAllocateRequest.devices_ids: a string that is not valid UTF-8"
