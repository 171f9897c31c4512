"""The device plugin service in-process, with a grpclib kubelet (the Go stand-in tests, which need go,
are in test_plugin_kubelet.py): it follows the state model, and what fails is reported, not fatal."""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.server import Server, Stream

from gpu_agent.host.paths import Root
from kubelet_api import deviceplugin_pb2 as api
from kubelet_api.deviceplugin_grpc import DevicePluginStub, RegistrationBase
from gpu_agent.host.sockets import socket_address
from gpu_agent.plugin.service import DevicePluginManager
from gpu_agent.state import AgentState

from harness import SimNode

PLUGIN_DIR = "var/lib/kubelet/device-plugins"


class Registrations(RegistrationBase):
    def __init__(self) -> None:
        self.requests: list[api.RegisterRequest] = []

    async def Register(self, stream: Stream[api.RegisterRequest, api.Empty]) -> None:
        request = await stream.recv_message()
        assert request is not None
        self.requests.append(request)
        await stream.send_message(api.Empty())


def sim_state(tmp_path: Path) -> tuple[Path, AgentState]:
    root = tmp_path / "r"
    state = SimNode(root, "dgx-h100").apply({"toolkit": {"enabled": False}}).state
    return root, state


def test_without_the_kubelet_directory_it_waits_and_says_so(tmp_path: Path) -> None:
    root, state = sim_state(tmp_path)
    config = state.config.config
    state.config = dataclasses.replace(state.config, config=dataclasses.replace(
        config, plugin=dataclasses.replace(config.plugin, enabled=True)))
    asyncio.run(DevicePluginManager(Root(root), state).sync())
    assert state.plugin is not None and state.plugin["enabled"] is True and state.plugin["resources"] == []
    assert state.plugin["reason"] == "waiting for the kubelet: /var/lib/kubelet/device-plugins does not exist"


def test_registers_lists_and_unregisters_a_vanished_resource(tmp_path: Path) -> None:
    root, state = sim_state(tmp_path)
    directory = root / PLUGIN_DIR
    directory.mkdir(parents=True)

    async def scenario() -> dict[str, Any]:
        registrations = Registrations()
        kubelet = Server([registrations])
        address, fd = socket_address(directory / "kubelet.sock")  # the test's directory is deep
        descriptors = [fd]
        await kubelet.start(path=address)
        manager = DevicePluginManager(Root(root), state)
        try:
            await manager.sync()
            for _ in range(100):  # registration runs beside the sync
                if manager.registered:
                    break
                await asyncio.sleep(0.05)
            plugin_address, plugin_fd = socket_address(directory / "nvidia-gpu.sock")
            descriptors.append(plugin_fd)
            channel = Channel(path=plugin_address)
            stub = DevicePluginStub(channel)
            async with stub.ListAndWatch.open() as stream:
                await stream.send_message(api.Empty(), end=True)
                first = await stream.recv_message()
                assert state.inventory is not None
                state.inventory = dataclasses.replace(state.inventory, gpus=())  # every GPU gone
                await manager.sync()
                after = await asyncio.wait_for(stream.recv_message(), timeout=5)
            channel.close()
            return {"registered": [r.resource_name for r in registrations.requests],
                    "endpoint": registrations.requests[0].endpoint,
                    "preferred": registrations.requests[0].options.get_preferred_allocation_available,
                    "first": [d.ID for d in first.devices] if first else None, "after": after,
                    "socket_left": (directory / "nvidia-gpu.sock").exists(), "status": state.plugin}
        finally:
            await manager.stop_all()
            kubelet.close()
            await kubelet.wait_closed()
            for descriptor in descriptors:
                if descriptor is not None:
                    os.close(descriptor)

    result = asyncio.run(scenario())
    assert result["registered"] == ["nvidia.com/gpu"] and result["endpoint"] == "nvidia-gpu.sock"
    assert result["preferred"] is True and len(result["first"]) == 8
    assert result["after"] is None and not result["socket_left"]  # the stream ended, the socket is gone
    assert result["status"]["resources"] == [] and "no GPU" in result["status"]["reason"]


def test_a_file_where_the_kubelet_directory_goes_is_named(tmp_path: Path) -> None:
    root, state = sim_state(tmp_path)
    config = state.config.config
    state.config = dataclasses.replace(state.config, config=dataclasses.replace(
        config, plugin=dataclasses.replace(config.plugin, enabled=True)))
    (root / PLUGIN_DIR).parent.mkdir(parents=True)
    (root / PLUGIN_DIR).write_text("")
    asyncio.run(DevicePluginManager(Root(root), state).sync())
    assert state.plugin is not None
    assert state.plugin["reason"] == "waiting for the kubelet: /var/lib/kubelet/device-plugins is not a directory"


def test_a_socket_that_cannot_be_served_is_reported_and_the_service_goes_on(tmp_path: Path) -> None:
    root, state = sim_state(tmp_path)
    (root / PLUGIN_DIR / "nvidia-gpu.sock").mkdir(parents=True)  # in the way: not ours to remove
    manager = DevicePluginManager(Root(root), state)
    asyncio.run(manager.sync())
    assert state.plugin is not None
    (resource,) = state.plugin["resources"]
    assert resource["name"] == "nvidia.com/gpu" and resource["socket"] is None
    assert resource["error"] == ("cannot serve nvidia.com/gpu on /var/lib/kubelet/device-plugins/nvidia-gpu.sock: "
                                 "a directory is where its socket goes; remove it")


def test_a_kubelet_directory_made_after_start_restarts_the_agent_under_systemd(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket's bind refused with EROFS (the directory is read-only in the unit's sandbox, simulated): the
    restart is asked for once, and the resource's error says why."""
    from gpu_agent.host import sandbox
    from gpu_agent.plugin import server

    root, state = sim_state(tmp_path)

    async def refused(self: server.PluginEndpoint) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(server.PluginEndpoint, "start", refused)
    restarts: list[str] = []
    sandbox.install(sandbox.Sandbox(Root(root), systemd=True, restart=lambda: restarts.append("restart")))
    (root / PLUGIN_DIR).mkdir(parents=True)  # after the agent started
    try:
        manager = DevicePluginManager(Root(root), state)
        asyncio.run(manager.sync())
        asyncio.run(manager.sync())
    finally:
        sandbox.install(None)
    assert restarts == ["restart"]
    assert state.plugin is not None
    (resource,) = state.plugin["resources"]
    assert resource["error"] == ("cannot serve nvidia.com/gpu on /var/lib/kubelet/device-plugins/nvidia-gpu.sock: "
                                 "read-only in gpu-agent's sandbox (EROFS) until it restarts, as it does now")
