"""One resource's device plugin: a gRPC server (grpclib) on its own unix socket, and its registration
with the kubelet. The kubelet is the client of both: it calls Register on kubelet.sock, then dials
the endpoint we named, as in k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1.

What a client of the socket can make the daemon hold is bounded: MAX_CONNECTIONS connections (the
kubelet opens one or two; a connection beyond is closed at once), MAX_STREAMS calls at once on each,
and a request of MAX_MESSAGE_BYTES at most, refused by its length prefix before it is read
(RESOURCE_EXHAUSTED, gpu_agent/grpcsize.py), so that no more than HTTP/2's flow-control window of it is
ever buffered; the kubelet's answer to Register is read the same way, MAX_REPLY_BYTES at most. What is
refused is counted (PluginEndpoint.refused), not logged: a client can repeat it at will.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from pathlib import Path
from typing import AbstractSet, Any, Callable, Optional, TypeVar

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream
from h2.settings import SettingCodes

from gpu_agent.grpcsize import Compressed, MessageTooLarge, Truncated, read_message, unary_reply
from gpu_agent.host.sockets import socket_address
from gpu_agent.plugin import api
from gpu_agent.plugin.allocate import AllocationError, allocate
from gpu_agent.plugin.devices import Resource
from gpu_agent.plugin.shared_policy import NotEnoughDevices
from gpu_agent.proto3 import Codec, DecodeError

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
REGISTER_TIMEOUT_S = 5.0
MAX_MESSAGE_BYTES = 4 << 20  # grpc-go's default for a message received
MAX_REPLY_BYTES = 64 << 10  # of the kubelet's answer to Register
DECODE_INLINE_BYTES = 64 << 10  # a request larger than this is decoded in a worker thread
MAX_CONNECTIONS = 16
MAX_STREAMS = 32  # calls at once on one connection (ListAndWatch holds one)

Request = TypeVar("Request")

# (resource, available, must_include, size) -> the preferred device ids; NotEnoughDevices when unmeetable
Preference = Callable[[Resource, list[str], list[str], int], list[str]]


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
                 prefer: Preference, cdi_spec: Callable[[], Optional[AbstractSet[str]]] = lambda: None,
                 called: Callable[[], None] = lambda: None) -> None:
        self.feed = feed
        self.list_strategy = list_strategy
        self.cdi_spec = cdi_spec
        self.fail_greater_than_one = fail_greater_than_one
        self.prefer = prefer
        self.streams = 0  # ListAndWatch streams open
        self.refused: Counter[str] = Counter()  # requests refused, by reason (not logged: a client repeats them)
        self.calls: Counter[str] = Counter()  # calls received, by method: what the kubelet asked, in /status
        self.called = called  # after each: /status shows the count (the plugin's manager publishes again)
        self.idle = asyncio.Event()
        self.idle.set()

    def _count(self, method: str) -> None:
        self.calls[method] += 1
        self.called()

    async def GetDevicePluginOptions(self, stream: Stream[api.Empty, api.DevicePluginOptions]) -> None:
        self._count("GetDevicePluginOptions")
        await request_of(stream, self.refused)
        await stream.send_message(options())

    async def ListAndWatch(self, stream: Stream[api.Empty, api.ListAndWatchResponse]) -> None:
        self._count("ListAndWatch")
        await request_of(stream, self.refused)
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
        self._count("GetPreferredAllocation")
        request = await request_of(stream, self.refused)
        resource = self.feed.resource
        known = {device.id for device in resource.devices}
        answers = []
        for container in request.container_requests:
            available, must = list(container.available_deviceIDs), list(container.must_include_deviceIDs)
            self._check_ids(resource.name, known, available, must)
            try:
                chosen = self.prefer(resource, available, must, container.allocation_size)
            except NotEnoughDevices as exc:
                self.refused["not_enough_devices"] += 1
                raise GRPCError(Status.INVALID_ARGUMENT, f"{resource.name}: {exc}") from None
            answers.append(api.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        await stream.send_message(api.PreferredAllocationResponse(container_responses=answers))

    def _check_ids(self, name: str, known: set[str], available: list[str], must: list[str]) -> None:
        """The ids of a preferred allocation request are ones this resource advertises, as many at most."""
        for what, ids in (("available", available), ("must-include", must)):
            if len(ids) > len(known):
                self.refused["too_many_ids"] += 1
                raise GRPCError(Status.INVALID_ARGUMENT, f"{len(ids)} {what} device ids; {name} advertises "
                                f"{len(known)}")
            unknown = [device for device in ids if device not in known]
            if unknown:
                self.refused["unknown_ids"] += 1
                shown = ", ".join(repr(device[:80]) for device in unknown[:3])
                raise GRPCError(Status.INVALID_ARGUMENT, f"{len(unknown)} {what} device ids that {name} does not "
                                f"advertise: {shown}{', ...' if len(unknown) > 3 else ''}")

    async def Allocate(self, stream: Stream[api.AllocateRequest, api.AllocateResponse]) -> None:
        self._count("Allocate")
        request = await request_of(stream, self.refused)
        resource = self.feed.resource
        answers = []
        for container in request.container_requests:
            if resource.groups:
                answers.append(self._vfio(resource, list(container.devices_ids)))
                continue
            try:
                given = allocate(resource, list(container.devices_ids), self.list_strategy(),
                                 self.fail_greater_than_one(), self.cdi_spec())
            except AllocationError as exc:
                log.warning("Allocate refused: %s", exc)
                raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
            answers.append(api.ContainerAllocateResponse(
                envs=given.envs, annotations=given.annotations,
                mounts=[api.Mount(container_path=inside, host_path=host) for inside, host in given.mounts],
                cdi_devices=[api.CDIDevice(name=name) for name in given.cdi_devices]))
        await stream.send_message(api.AllocateResponse(container_responses=answers))

    def _vfio(self, resource: Any, requested: list[str]) -> api.ContainerAllocateResponse:
        """The VM path: the VFIO device nodes and KubeVirt's variable (plugin/vfio.py)."""
        from gpu_agent.plugin.vfio import allocation

        healthy = {device.id for device in resource.devices if device.healthy}
        try:
            unhealthy = [address for address in requested if address not in healthy]
            envs, nodes = allocation(resource.name, requested, dict(resource.groups))
            if unhealthy:
                raise ValueError(f"{unhealthy[0]} of {resource.name} is not passed through (see gpu-agent status)")
        except ValueError as exc:
            log.warning("Allocate refused: %s", exc)
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        return api.ContainerAllocateResponse(envs=envs, devices=[
            api.DeviceSpec(container_path=node, host_path=node, permissions="mrw") for node in nodes])

    async def PreStartContainer(
            self, stream: Stream[api.PreStartContainerRequest, api.PreStartContainerResponse]) -> None:
        self._count("PreStartContainer")
        await request_of(stream, self.refused)  # never asked for: options() says pre_start_required=false
        await stream.send_message(api.PreStartContainerResponse())


async def request_of(stream: Stream[Request, Any], refused: Optional[Counter[str]] = None) -> Request:
    """The call's one request; a malformed one is the caller's error (INVALID_ARGUMENT), not ours; one
    over MAX_MESSAGE_BYTES is refused (RESOURCE_EXHAUSTED) before it is read."""
    try:
        request = await _receive(stream, Counter() if refused is None else refused)
    except DecodeError as exc:
        log.warning("device plugin: a malformed request: %s", exc)
        raise GRPCError(Status.INVALID_ARGUMENT, f"malformed request: {exc}") from None
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "the request carried no message")
    return request


async def _receive(stream: Stream[Request, Any], refused: Counter[str]) -> Optional[Request]:
    """grpclib's Stream.recv_message, but with the length prefix checked before the message is read
    (gpu_agent/grpcsize.py)."""
    try:
        data = await read_message(stream._stream, MAX_MESSAGE_BYTES)
    except MessageTooLarge as exc:
        refused["message_too_large"] += 1
        raise GRPCError(Status.RESOURCE_EXHAUSTED, str(exc)) from None
    except (Compressed, Truncated) as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
    if data is None:
        return None
    if len(data) <= DECODE_INLINE_BYTES:
        message: Request = stream._codec.decode(data, stream._recv_type)
    else:  # a request of a million device ids takes seconds to decode: not on the loop that answers /healthz
        message = await asyncio.to_thread(stream._codec.decode, data, stream._recv_type)
    return message


class CappedServer(Server):
    """grpclib's Server holding MAX_CONNECTIONS connections at most, MAX_STREAMS calls at once on each."""

    def __init__(self, *args: Any, refused: Counter[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connections = 0
        self.refused = refused

    def _protocol_factory(self) -> Any:
        if self.connections >= MAX_CONNECTIONS:
            self.refused["connections"] += 1
            return _Refused()
        return _Counted(super()._protocol_factory(), self)


class _Refused(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Counted(asyncio.Protocol):
    """grpclib's protocol of one connection, counted while open, its calls at once capped."""

    def __init__(self, inner: Any, server: CappedServer) -> None:
        self.inner = inner
        self.server = server
        server.connections += 1  # now: asyncio makes the protocols of a batch of accepts before any starts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)
        h2 = self.inner.connection._connection  # grpclib 0.4's h2 connection
        h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS})
        self.inner.connection.flush()

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.server.connections -= 1
        self.inner.connection_lost(exc)


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
        self.server = CappedServer([self.service], codec=Codec(), refused=self.service.refused)
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
        request = api.RegisterRequest(version=API_VERSION, endpoint=self.path.name, resource_name=self.name,
                                      options=options())
        try:
            async with api.register_method(channel).open(timeout=REGISTER_TIMEOUT_S) as stream:
                await unary_reply(stream, request, MAX_REPLY_BYTES)  # Empty: a kubelet's is 0 bytes
        finally:
            channel.close()
            if fd is not None:
                os.close(fd)
