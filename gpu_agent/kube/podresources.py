"""The kubelet's pod-resources API, k8s.io/kubelet/pkg/apis/podresources/v1 (its wire facts stated in
tests/kubelet_api/podresources.proto), declared for gpu_agent.proto3: List, and of its answer the
fields that attribute a device to a container. The rest (CPUs, memory, dynamic resources) is skipped
on decoding, as protobuf skips fields a reader does not know."""
from __future__ import annotations

from dataclasses import dataclass

from grpclib.client import Channel, UnaryUnaryMethod

from gpu_agent.proto3 import Message, messages, string, strings


@dataclass
class ListPodResourcesRequest(Message):
    pass


@dataclass
class ContainerDevices(Message):
    resource_name: str = string(1)
    device_ids: list[str] = strings(2)


@dataclass
class ContainerResources(Message):
    name: str = string(1)
    devices: list[ContainerDevices] = messages(2, ContainerDevices)


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
