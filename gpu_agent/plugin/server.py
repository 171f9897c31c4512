"""One resource's device plugin: a gRPC server (grpclib) on its own unix socket, and its registration
with the kubelet. The kubelet is the client of both: it calls Register on kubelet.sock, then dials
the endpoint we named, as in k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from gpu_agent.host.sockets import socket_address
from gpu_agent.plugin import api
from gpu_agent.plugin.allocate import AllocationError, allocate
from gpu_agent.plugin.devices import Resource
from gpu_agent.proto3 import Codec, DecodeError

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
REGISTER_TIMEOUT_S = 5.0

Request = TypeVar("Request")

# (available, must_include, size) -> the preferred device ids
Preference = Callable[[list[str], list[str], int], list[str]]


class DeviceFeed:
    """The resource as last computed; ListAndWatch streams wait here for the next change."""

    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.version = 0
        self.closed = False
        self._changed = asyncio.Condition()

    async def update(self, resource: Resource) -> None:
        if resource == self.resource:
            return
        self.resource = resource
        await self._bump()

    async def close(self) -> None:
        self.closed = True
        await self._bump()

    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def wait_past(self, version: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != version or self.closed)


class DevicePluginService(api.DevicePluginBase):
    """The DevicePlugin service of one resource."""

    def __init__(self, feed: DeviceFeed, list_strategy: Callable[[], str], fail_greater_than_one: Callable[[], bool],
                 prefer: Preference) -> None:
        self.feed = feed
        self.list_strategy = list_strategy
        self.fail_greater_than_one = fail_greater_than_one
        self.prefer = prefer
        self.streams = 0  # ListAndWatch streams open
        self.idle = asyncio.Event()
        self.idle.set()

    async def GetDevicePluginOptions(self, stream: Stream[api.Empty, api.DevicePluginOptions]) -> None:
        await request_of(stream)
        await stream.send_message(options())

    async def ListAndWatch(self, stream: Stream[api.Empty, api.ListAndWatchResponse]) -> None:
        await request_of(stream)
        self.streams += 1
        self.idle.clear()
        try:
            feed = self.feed
            while not feed.closed:
                version = feed.version
                await stream.send_message(device_list(feed.resource))
                await feed.wait_past(version)
            # The resource is gone: end the stream with OK, so the kubelet sees it end, before the
            # server closes its connections.
            await stream.send_trailing_metadata()
        finally:
            self.streams -= 1
            if not self.streams:
                self.idle.set()

    async def GetPreferredAllocation(
            self, stream: Stream[api.PreferredAllocationRequest, api.PreferredAllocationResponse]) -> None:
        request = await request_of(stream)
        answers = []
        for container in request.container_requests:
            chosen = self.prefer(list(container.available_deviceIDs), list(container.must_include_deviceIDs),
                                 container.allocation_size)
            answers.append(api.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        await stream.send_message(api.PreferredAllocationResponse(container_responses=answers))

    async def Allocate(self, stream: Stream[api.AllocateRequest, api.AllocateResponse]) -> None:
        request = await request_of(stream)
        resource = self.feed.resource
        answers = []
        for container in request.container_requests:
            try:
                given = allocate(resource, list(container.devices_ids), self.list_strategy(),
                                 self.fail_greater_than_one())
            except AllocationError as exc:
                log.warning("Allocate refused: %s", exc)
                raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
            answers.append(api.ContainerAllocateResponse(
                envs=given.envs, annotations=given.annotations,
                cdi_devices=[api.CDIDevice(name=name) for name in given.cdi_devices]))
        await stream.send_message(api.AllocateResponse(container_responses=answers))

    async def PreStartContainer(
            self, stream: Stream[api.PreStartContainerRequest, api.PreStartContainerResponse]) -> None:
        await request_of(stream)  # never asked for: options() says pre_start_required=false
        await stream.send_message(api.PreStartContainerResponse())


async def request_of(stream: Stream[Request, Any]) -> Request:
    """The call's one request; a malformed one is the caller's error (INVALID_ARGUMENT), not ours."""
    try:
        request = await stream.recv_message()
    except DecodeError as exc:
        log.warning("device plugin: a malformed request: %s", exc)
        raise GRPCError(Status.INVALID_ARGUMENT, f"malformed request: {exc}") from None
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "the request carried no message")
    return request


def options() -> api.DevicePluginOptions:
    return api.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def device_list(resource: Resource) -> api.ListAndWatchResponse:
    return api.ListAndWatchResponse(devices=[
        api.Device(ID=device.id, health="Healthy" if device.healthy else "Unhealthy",
                   topology=api.TopologyInfo(nodes=[api.NUMANode(ID=device.numa_node)])
                   if device.numa_node is not None else None)
        for device in resource.devices])


class PluginEndpoint:
    """A resource's server on <device-plugins>/<socket name>, started, registered and stopped."""

    def __init__(self, directory: Path, resource: Resource, service_args: dict[str, Any]) -> None:
        self.path = directory / resource.socket_name
        self.feed = DeviceFeed(resource)
        self.service = DevicePluginService(self.feed, **service_args)
        self.server: Optional[Server] = None
        self.socket_inode: Optional[int] = None

    @property
    def name(self) -> str:
        return self.feed.resource.name

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)  # ours from a previous run, or a stale one: the name is ours
        self.server = Server([self.service], codec=Codec())
        address, fd = socket_address(self.path)
        try:
            await self.server.start(path=address)
        finally:
            if fd is not None:
                os.close(fd)
        self.socket_inode = self.path.stat().st_ino

    def socket_gone(self) -> bool:
        """The kubelet deletes every socket in its directory when it restarts."""
        try:
            return self.path.stat().st_ino != self.socket_inode
        except OSError:
            return True

    async def stop(self) -> None:
        await self.feed.close()
        try:
            await asyncio.wait_for(self.service.idle.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            log.warning("device plugin %s: a ListAndWatch stream did not end within 1 s", self.name)
        if self.server is not None:
            self.server.close()
            try:
                await asyncio.wait_for(self.server.wait_closed(), timeout=1.0)
            except asyncio.TimeoutError:
                log.warning("device plugin %s: a kubelet stream did not close within 1 s", self.name)
            self.server = None
        if not self.socket_gone():
            self.path.unlink(missing_ok=True)

    async def restart(self) -> None:
        await self.stop()
        self.feed = DeviceFeed(self.feed.resource)
        self.service.feed = self.feed
        await self.start()

    async def register(self, kubelet_socket: Path) -> None:
        address, fd = socket_address(kubelet_socket)
        channel = Channel(path=address, codec=Codec())
        try:
            await api.register_method(channel)(
                api.RegisterRequest(version=API_VERSION, endpoint=self.path.name, resource_name=self.name,
                                    options=options()),
                timeout=REGISTER_TIMEOUT_S)
        finally:
            channel.close()
            if fd is not None:
                os.close(fd)
