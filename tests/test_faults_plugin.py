"""A hostile client of the device plugin's socket: requests too big, too many ids, too many connections.

Each is refused (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, or the connection closed), counted, not
logged, and the plugin answers the kubelet's calls afterwards.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from gpu_agent.plugin import api
from gpu_agent.plugin import server as server_module
from gpu_agent.plugin.devices import PluginDevice, Resource
from gpu_agent.plugin.shared_policy import preferred_allocation
from gpu_agent.plugin.server import PluginEndpoint
from gpu_agent.proto3 import Codec

GPUS, REPLICAS = 8, 128  # the valid config: one pod asking for all 1,024 replicas


def _resource() -> Resource:
    devices = tuple(PluginDevice(f"GPU-{g}::{r}", f"GPU-{g}", f"GPU-{g}", g, 0, True)
                    for g in range(GPUS) for r in range(REPLICAS))
    return Resource("nvidia.com/gpu", devices, REPLICAS)


@asynccontextmanager
async def _plugin() -> AsyncIterator[tuple[PluginEndpoint, Channel]]:
    with tempfile.TemporaryDirectory() as directory:  # short: a unix socket path has at most 107 bytes
        endpoint = PluginEndpoint(Path(directory), _resource(), {
            "list_strategy": lambda: "envvar", "fail_greater_than_one": lambda: False,
            "prefer": lambda resource, available, must, size: preferred_allocation(
                resource, available, must, size, "distributed", None)})
        await endpoint.start()
        channel = Channel(path=str(endpoint.path), codec=Codec())
        try:
            yield endpoint, channel
        finally:
            channel.close()
            await endpoint.stop()


async def _prefer(channel: Channel, available: list[str], size: int) -> list[str]:
    method = channel.request("/v1beta1.DevicePlugin/GetPreferredAllocation", Cardinality.UNARY_UNARY,
                             api.PreferredAllocationRequest, api.PreferredAllocationResponse)
    async with method as stream:
        await stream.send_message(api.PreferredAllocationRequest(container_requests=[
            api.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=[],
                                                    allocation_size=size)]), end=True)
        response = await stream.recv_message()
    assert response is not None
    return list(response.container_responses[0].deviceIDs)


async def _options(channel: Channel) -> bool:
    method = channel.request("/v1beta1.DevicePlugin/GetDevicePluginOptions", Cardinality.UNARY_UNARY,
                             api.Empty, api.DevicePluginOptions)
    async with method as stream:
        await stream.send_message(api.Empty(), end=True)
        response = await stream.recv_message()
    return response is not None and response.get_preferred_allocation_available


@pytest.fixture(autouse=True)
def quiet(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.DEBUG, logger="gpu_agent"):
        yield
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_all_1024_replicas_are_preferred_and_unknown_or_too_many_ids_refused() -> None:
    async def scenario() -> None:
        async with _plugin() as (endpoint, channel):
            every = [device.id for device in endpoint.feed.resource.devices]
            assert sorted(await _prefer(channel, every, len(every))) == sorted(every)
            with pytest.raises(GRPCError) as unknown:
                await _prefer(channel, every[:10] + ["GPU-9::0"], 2)
            assert unknown.value.status is Status.INVALID_ARGUMENT and "'GPU-9::0'" in str(unknown.value.message)
            with pytest.raises(GRPCError) as too_many:
                await _prefer(channel, every * 10, 4)
            assert too_many.value.status is Status.INVALID_ARGUMENT and "advertises 1024" in str(too_many.value.message)
            assert endpoint.service.refused == {"unknown_ids": 1, "too_many_ids": 1}
            assert await _options(channel)

    asyncio.run(scenario())


def test_a_message_over_the_cap_is_refused_by_its_length_before_it_is_read() -> None:
    """An Allocate declaring 1 GiB (the issue's grew the daemon by 370 MB): RESOURCE_EXHAUSTED at once."""
    async def scenario() -> None:
        async with _plugin() as (endpoint, channel):
            method = channel.request("/v1beta1.DevicePlugin/Allocate", Cardinality.UNARY_UNARY,
                                     api.AllocateRequest, api.AllocateResponse)
            with pytest.raises(GRPCError) as refused:
                async with method as stream:
                    await stream.send_request()
                    prefix = b"\0" + (1 << 30).to_bytes(4, "big")
                    await stream._stream.send_data(prefix + b"\0" * 1000)
                    await stream.recv_message()
            assert refused.value.status is Status.RESOURCE_EXHAUSTED
            assert str(server_module.MAX_MESSAGE_BYTES) in str(refused.value.message)
            assert endpoint.service.refused == {"message_too_large": 1}
            assert await _options(channel)

    asyncio.run(scenario())


def test_connections_beyond_the_cap_are_closed_and_counted() -> None:
    async def scenario() -> None:
        async with _plugin() as (endpoint, channel):
            loop = asyncio.get_running_loop()
            held = []
            for _ in range(server_module.MAX_CONNECTIONS + 10):
                sock = socket.socket(socket.AF_UNIX)
                sock.setblocking(False)
                await loop.sock_connect(sock, str(endpoint.path))
                held.append(sock)
            closed = 0
            for sock in held[server_module.MAX_CONNECTIONS:]:
                closed += await asyncio.wait_for(loop.sock_recv(sock, 100), 5) == b""
            assert closed == 10 and endpoint.service.refused == {"connections": 10}
            for sock in held:
                sock.close()
            deadline = loop.time() + 5
            while endpoint.server is not None and endpoint.server.connections:  # type: ignore[attr-defined]
                assert loop.time() < deadline
                await asyncio.sleep(0.01)
            assert await _options(channel)  # the kubelet's connection is served again

    asyncio.run(scenario())


def test_a_large_request_is_decoded_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request near the 4 MiB cap (a million device ids) took seconds of the loop that answers /healthz;
    a small one is decoded where it arrives."""
    from gpu_agent import proto3

    where: list[str] = []  # of each request the plugin decoded
    real = proto3.Codec.decode

    def decode(self: Any, data: bytes, message_type: Any) -> Any:
        if message_type is api.PreferredAllocationRequest:
            try:
                asyncio.get_running_loop()
                where.append("event loop")
            except RuntimeError:
                where.append("worker")
        return real(self, data, message_type)

    monkeypatch.setattr(proto3.Codec, "decode", decode)

    async def scenario() -> None:
        async with _plugin() as (endpoint, channel):
            every = [device.id for device in endpoint.feed.resource.devices]
            await _prefer(channel, every[:2], 1)
            with pytest.raises(GRPCError):  # ids it does not advertise, past any node's count
                await _prefer(channel, [f"GPU-{n:040d}" for n in range(60_000)], 1)

    asyncio.run(scenario())
    assert where == ["event loop", "worker"]
