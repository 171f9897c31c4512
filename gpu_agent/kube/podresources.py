"""The kubelet's pod-resources API, k8s.io/kubelet/pkg/apis/podresources/v1 (its wire facts stated in
tests/kubelet_api/podresources.proto), declared for gpu_agent.proto3: List, and of its answer the
fields that attribute a device to a container: the device plugins' devices, and the devices of the
containers' resource claims (DynamicResources) by driver, pool and device name. The rest (CPUs, memory,
CDI devices) is skipped on decoding, as protobuf skips fields a reader does not know.

The answer is read bounded (MAX_MESSAGE_BYTES, refused by its length prefix) and decoded by holdings(),
which keeps only the pods whose containers hold devices: a node's hundred thousand pods without a GPU
cost a walk over their bytes, not an object each. A name Kubernetes would not accept (a pod name over
253 characters or not a DNS subdomain, a namespace or container name over 63 or not a DNS label) is
not a pod the kubelet runs: its holder is skipped and counted, never a label value.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Optional, Union

from grpclib.client import Channel, UnaryUnaryMethod

from gpu_agent.proto3 import LENGTH_DELIMITED, DecodeError, Message, fields_of, messages, string, strings

MAX_MESSAGE_BYTES = 16 << 20  # a node's answer is kilobytes; four times grpc-go's default receive limit
MAX_HOLDING_PODS = 10_000  # pods holding devices in one answer; a node runs a few hundred pods
MAX_DEVICE_ID = 256  # a GPU or MIG UUID is about 40 characters, with a replica's ::n
MAX_RESOURCE_NAME = 317  # a qualified name: a 253-character DNS prefix, '/', a 63-character name
# k8s.io/apimachinery's IsDNS1123Subdomain (pod names: its parts are not limited to 63 characters, only
# the whole to 253) and IsDNS1123Label (namespaces, containers: at most 63), lengths checked apart
_PART = rb"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rb"%s(?:\.%s)*" % (_PART, _PART))
_LABEL = re.compile(_PART)
_POOL = re.compile(rb"%s(?:\.%s)*(?:/%s(?:\.%s)*)*" % (_PART, _PART, _PART, _PART))
MAX_POD_NAME, MAX_LABEL, MAX_POOL_NAME = 253, 63, 253


@dataclass
class ListPodResourcesRequest(Message):
    pass


@dataclass
class ContainerDevices(Message):
    resource_name: str = string(1)
    device_ids: list[str] = strings(2)


@dataclass
class ClaimResource(Message):
    driver_name: str = string(2)
    pool_name: str = string(3)
    device_name: str = string(4)


@dataclass
class DynamicResource(Message):
    claim_name: str = string(2)
    claim_namespace: str = string(3)
    claim_resources: list[ClaimResource] = messages(4, ClaimResource)


@dataclass
class ContainerResources(Message):
    name: str = string(1)
    devices: list[ContainerDevices] = messages(2, ContainerDevices)
    dynamic_resources: list[DynamicResource] = messages(5, DynamicResource)


@dataclass
class PodResources(Message):
    name: str = string(1)
    namespace: str = string(2)
    containers: list[ContainerResources] = messages(3, ContainerResources)


@dataclass
class ListPodResourcesResponse(Message):
    pod_resources: list[PodResources] = messages(1, PodResources)


def list_method(channel: Channel) -> UnaryUnaryMethod[ListPodResourcesRequest, ListPodResourcesResponse]:
    return UnaryUnaryMethod(channel, "/v1.PodResourcesLister/List", ListPodResourcesRequest, ListPodResourcesResponse)


@dataclass
class Holdings:
    """holdings()' answer: the pods whose containers hold devices, each with only those containers and
    devices, and how many holders were skipped for names Kubernetes would not accept."""

    pod_resources: list[PodResources] = field(default_factory=list)
    skipped: int = 0


def holdings(data: bytes) -> Holdings:
    """The devices' holders in an encoded ListPodResourcesResponse. Raises DecodeError for malformed
    bytes or more than MAX_HOLDING_PODS pods holding devices."""
    found = Holdings()
    for number, pod in _parts(data, "ListPodResourcesResponse"):
        kept = _holding_pod(pod) if number == 1 else None
        if kept is None:
            continue
        if not kept.containers:  # each holding container had a name Kubernetes would not accept
            found.skipped += 1
            continue
        if len(found.pod_resources) == MAX_HOLDING_PODS:
            raise DecodeError(f"ListPodResourcesResponse: more than {MAX_HOLDING_PODS} pods hold devices")
        found.pod_resources.append(kept)
    return found


def _parts(data: Union[bytes, memoryview], where: str) -> Iterator[tuple[int, memoryview]]:
    """The length-delimited fields of a message (all that these messages hold), as views."""
    for number, wire_type, value in fields_of(data, where):
        if wire_type == LENGTH_DELIMITED and isinstance(value, memoryview):
            yield number, value


def _holding_pod(data: memoryview) -> Optional[PodResources]:
    """The pod with its containers that hold devices; None when none does; a pod with no containers
    when its own name or namespace, or each holding container's name, is not a Kubernetes name."""
    name = namespace = memoryview(b"")
    containers: list[tuple[memoryview, list[ContainerDevices], list[DynamicResource]]] = []
    for number, value in _parts(data, "PodResources"):
        if number == 1:
            name = value
        elif number == 2:
            namespace = value
        elif number == 3:
            container = _holding_container(value)
            if container is not None:
                containers.append(container)
    if not containers:
        return None
    if not (_named(name, _SUBDOMAIN, MAX_POD_NAME) and _named(namespace, _LABEL, MAX_LABEL)):
        return PodResources()
    return PodResources(name=str(name, "ascii"), namespace=str(namespace, "ascii"),
                        containers=[ContainerResources(name=str(title, "ascii"), devices=devices,
                                                       dynamic_resources=claims)
                                    for title, devices, claims in containers if _named(title, _LABEL, MAX_LABEL)])


def _holding_container(data: memoryview) -> Optional[tuple[memoryview, list[ContainerDevices],
                                                          list[DynamicResource]]]:
    name = memoryview(b"")
    devices, claims = [], []
    for number, value in _parts(data, "ContainerResources"):
        if number == 1:
            name = value
        elif number == 2:
            held = _devices(value)
            if held is not None:
                devices.append(held)
        elif number == 5:
            claim = _claim(value)
            if claim is not None:
                claims.append(claim)
    return (name, devices, claims) if devices or claims else None


def _claim(data: memoryview) -> Optional[DynamicResource]:
    """One resource claim of a container, with its devices; None when it names none, or its name or
    namespace is not a Kubernetes name (a claim's name is a DNS subdomain, as a pod's is)."""
    name = namespace = memoryview(b"")
    resources = []
    for number, value in _parts(data, "DynamicResource"):
        if number == 2:
            name = value
        elif number == 3:
            namespace = value
        elif number == 4:
            resource = _claim_resource(value)
            if resource is not None:
                resources.append(resource)
    if not resources or not (_named(name, _SUBDOMAIN, MAX_POD_NAME) and _named(namespace, _LABEL, MAX_LABEL)):
        return None
    return DynamicResource(str(name, "ascii"), str(namespace, "ascii"), resources)


def _claim_resource(data: memoryview) -> Optional[ClaimResource]:
    """A claim's device by driver, pool and device name: a driver name is a DNS subdomain, a pool name
    one or more of them joined by '/', a device name a DNS label (resource.k8s.io's validation)."""
    fields = dict(_parts(data, "ClaimResource"))  # the last of a repeated scalar wins, as protobuf's
    driver, pool, device = (fields.get(number, memoryview(b"")) for number in (2, 3, 4))
    if not (_named(driver, _SUBDOMAIN, MAX_POD_NAME) and _named(device, _LABEL, MAX_LABEL)
            and _named(pool, _POOL, MAX_POOL_NAME)):
        return None
    return ClaimResource(str(driver, "ascii"), str(pool, "ascii"), str(device, "ascii"))


def _devices(data: memoryview) -> Optional[ContainerDevices]:
    """One resource's devices, the ids no GPU or MIG device could have left out."""
    resource, ids = "", []
    for number, value in _parts(data, "ContainerDevices"):
        if number == 1:
            resource = _text(value, MAX_RESOURCE_NAME)
        elif number == 2:
            ids.append(_text(value, MAX_DEVICE_ID))
    ids = [device_id for device_id in ids if device_id]
    return ContainerDevices(resource, ids) if ids else None


def _text(value: memoryview, limit: int) -> str:
    """The string, or "" when it is longer than `limit` bytes or not UTF-8."""
    if len(value) > limit:
        return ""
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError:
        return ""


def _named(value: memoryview, pattern: re.Pattern[bytes], limit: int) -> bool:
    return len(value) <= limit and pattern.fullmatch(value) is not None
