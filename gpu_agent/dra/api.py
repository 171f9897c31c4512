"""The kubelet's DRA plugin API (k8s.io.kubelet.pkg.apis.dra.v1 and v1beta1: the same messages) and its
plugin watcher registration (pluginregistration v1), their wire facts stated in tests/kubelet_api/
dra_v1.proto, dra_v1beta1.proto and pluginregistration.proto, declared for gpu_agent.proto3."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpclib.const import Cardinality, Handler

from gpu_agent.proto3 import Message, boolean, message_map, messages, string, strings

if TYPE_CHECKING:
    from grpclib.server import Stream

DRA_SERVICES = ("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin")
# What a registration lists in supported_versions for each service it serves, newest first.
SUPPORTED_VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
PLUGIN_TYPE = "DRAPlugin"


@dataclass
class InfoRequest(Message):
    pass


@dataclass
class PluginInfo(Message):
    type: str = string(1)
    name: str = string(2)
    endpoint: str = string(3)
    supported_versions: list[str] = strings(4)


@dataclass
class RegistrationStatus(Message):
    plugin_registered: bool = boolean(1)
    error: str = string(2)


@dataclass
class RegistrationStatusResponse(Message):
    pass


@dataclass
class Claim(Message):
    namespace: str = string(1)
    uid: str = string(2)
    name: str = string(3)


@dataclass
class Device(Message):
    request_names: list[str] = strings(1)
    pool_name: str = string(2)
    device_name: str = string(3)
    cdi_device_ids: list[str] = strings(4)


@dataclass
class NodePrepareResourceResponse(Message):
    devices: list[Device] = messages(1, Device)
    error: str = string(2)


@dataclass
class NodePrepareResourcesRequest(Message):
    claims: list[Claim] = messages(1, Claim)


@dataclass
class NodePrepareResourcesResponse(Message):
    claims: dict[str, NodePrepareResourceResponse] = message_map(1, NodePrepareResourceResponse)


@dataclass
class NodeUnprepareResourceResponse(Message):
    error: str = string(1)


@dataclass
class NodeUnprepareResourcesRequest(Message):
    claims: list[Claim] = messages(1, Claim)


@dataclass
class NodeUnprepareResourcesResponse(Message):
    claims: dict[str, NodeUnprepareResourceResponse] = message_map(1, NodeUnprepareResourceResponse)


class RegistrationBase(abc.ABC):
    """The plugin watcher's Registration service, served by the plugin on its registration socket."""

    @abc.abstractmethod
    async def GetInfo(self, stream: Stream[InfoRequest, PluginInfo]) -> None: ...

    @abc.abstractmethod
    async def NotifyRegistrationStatus(self, stream: Stream[RegistrationStatus, RegistrationStatusResponse]) -> None:
        ...

    def __mapping__(self) -> dict[str, Handler]:
        unary = Cardinality.UNARY_UNARY
        return {
            "/pluginregistration.Registration/GetInfo": Handler(self.GetInfo, unary, InfoRequest, PluginInfo),
            "/pluginregistration.Registration/NotifyRegistrationStatus":
                Handler(self.NotifyRegistrationStatus, unary, RegistrationStatus, RegistrationStatusResponse),
        }


class DRAPluginBase(abc.ABC):
    """The DRAPlugin service, under both of its versions' names (their messages are the same on the wire)."""

    @abc.abstractmethod
    async def NodePrepareResources(
            self, stream: Stream[NodePrepareResourcesRequest, NodePrepareResourcesResponse]) -> None: ...

    @abc.abstractmethod
    async def NodeUnprepareResources(
            self, stream: Stream[NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse]) -> None: ...

    def __mapping__(self) -> dict[str, Handler]:
        unary = Cardinality.UNARY_UNARY
        mapping = {}
        for service in DRA_SERVICES:
            mapping[f"/{service}/NodePrepareResources"] = Handler(
                self.NodePrepareResources, unary, NodePrepareResourcesRequest, NodePrepareResourcesResponse)
            mapping[f"/{service}/NodeUnprepareResources"] = Handler(
                self.NodeUnprepareResources, unary, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse)
        return mapping
