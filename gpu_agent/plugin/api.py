"""The kubelet's device plugin API, k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1 (its wire facts stated in
tests/kubelet_api/deviceplugin.proto), declared for gpu_agent.proto3: every message, field for field."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.const import Cardinality, Handler

from gpu_agent.proto3 import Message, boolean, int32, int64, message, messages, string, string_map, strings

if TYPE_CHECKING:
    from grpclib.server import Stream


@dataclass
class DevicePluginOptions(Message):
    pre_start_required: bool = boolean(1)
    get_preferred_allocation_available: bool = boolean(2)


@dataclass
class RegisterRequest(Message):
    version: str = string(1)
    endpoint: str = string(2)
    resource_name: str = string(3)
    options: Optional[DevicePluginOptions] = message(4, DevicePluginOptions)


@dataclass
class Empty(Message):
    pass


@dataclass
class NUMANode(Message):
    ID: int = int64(1)


@dataclass
class TopologyInfo(Message):
    nodes: list[NUMANode] = messages(1, NUMANode)


@dataclass
class Device(Message):
    ID: str = string(1)
    health: str = string(2)
    topology: Optional[TopologyInfo] = message(3, TopologyInfo)


@dataclass
class ListAndWatchResponse(Message):
    devices: list[Device] = messages(1, Device)


@dataclass
class PreStartContainerRequest(Message):
    devices_ids: list[str] = strings(1)


@dataclass
class PreStartContainerResponse(Message):
    pass


@dataclass
class ContainerPreferredAllocationRequest(Message):
    available_deviceIDs: list[str] = strings(1)
    must_include_deviceIDs: list[str] = strings(2)
    allocation_size: int = int32(3)


@dataclass
class PreferredAllocationRequest(Message):
    container_requests: list[ContainerPreferredAllocationRequest] = messages(1, ContainerPreferredAllocationRequest)


@dataclass
class ContainerPreferredAllocationResponse(Message):
    deviceIDs: list[str] = strings(1)


@dataclass
class PreferredAllocationResponse(Message):
    container_responses: list[ContainerPreferredAllocationResponse] = messages(1, ContainerPreferredAllocationResponse)


@dataclass
class ContainerAllocateRequest(Message):
    devices_ids: list[str] = strings(1)


@dataclass
class AllocateRequest(Message):
    container_requests: list[ContainerAllocateRequest] = messages(1, ContainerAllocateRequest)


@dataclass
class CDIDevice(Message):
    name: str = string(1)


@dataclass
class Mount(Message):
    container_path: str = string(1)
    host_path: str = string(2)
    read_only: bool = boolean(3)


@dataclass
class DeviceSpec(Message):
    container_path: str = string(1)
    host_path: str = string(2)
    permissions: str = string(3)


@dataclass
class ContainerAllocateResponse(Message):
    envs: dict[str, str] = string_map(1)
    mounts: list[Mount] = messages(2, Mount)
    devices: list[DeviceSpec] = messages(3, DeviceSpec)
    annotations: dict[str, str] = string_map(4)
    cdi_devices: list[CDIDevice] = messages(5, CDIDevice)


@dataclass
class AllocateResponse(Message):
    container_responses: list[ContainerAllocateResponse] = messages(1, ContainerAllocateResponse)


class DevicePluginBase(abc.ABC):
    """The DevicePlugin service, as the kubelet calls it on the plugin's own socket."""

    @abc.abstractmethod
    async def GetDevicePluginOptions(self, stream: Stream[Empty, DevicePluginOptions]) -> None: ...

    @abc.abstractmethod
    async def ListAndWatch(self, stream: Stream[Empty, ListAndWatchResponse]) -> None: ...

    @abc.abstractmethod
    async def GetPreferredAllocation(
        self, stream: Stream[PreferredAllocationRequest, PreferredAllocationResponse]) -> None: ...

    @abc.abstractmethod
    async def Allocate(self, stream: Stream[AllocateRequest, AllocateResponse]) -> None: ...

    @abc.abstractmethod
    async def PreStartContainer(self, stream: Stream[PreStartContainerRequest, PreStartContainerResponse]) -> None: ...

    def __mapping__(self) -> dict[str, Handler]:
        unary, streaming = Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM
        return {
            "/v1beta1.DevicePlugin/GetDevicePluginOptions":
                Handler(self.GetDevicePluginOptions, unary, Empty, DevicePluginOptions),
            "/v1beta1.DevicePlugin/ListAndWatch": Handler(self.ListAndWatch, streaming, Empty, ListAndWatchResponse),
            "/v1beta1.DevicePlugin/GetPreferredAllocation":
                Handler(self.GetPreferredAllocation, unary, PreferredAllocationRequest, PreferredAllocationResponse),
            "/v1beta1.DevicePlugin/Allocate": Handler(self.Allocate, unary, AllocateRequest, AllocateResponse),
            "/v1beta1.DevicePlugin/PreStartContainer":
                Handler(self.PreStartContainer, unary, PreStartContainerRequest, PreStartContainerResponse),
        }


def register_method(channel: Channel) -> UnaryUnaryMethod[RegisterRequest, Empty]:
    """The kubelet's Registration.Register, on its kubelet.sock."""
    return UnaryUnaryMethod(channel, "/v1beta1.Registration/Register", RegisterRequest, Empty)
