"""Issue 38's acceptance through the device plugin's gRPC, as the kubelet talks to it (grpclib, the kubelet's own
protos): on a simulated dgx-h100 with GPUs 4-7 passed through, the agent registers nvidia.com/gpu and KubeVirt's
nvidia.com/GH100_H100_SXM5_80GB; ListAndWatch gives the first GPUs 0-3 by UUID and the second GPUs 4-7 by PCI
address; Allocate of the second gives /dev/vfio/vfio and each /dev/vfio/<group>, and the variable KubeVirt reads."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server
from harness import SimNode, run_cli
from kubelet_api import deviceplugin_pb2 as api
from kubelet_api.deviceplugin_grpc import DevicePluginStub
from test_plugin_service import PLUGIN_DIR, Registrations

from gpu_agent.host.paths import Root
from gpu_agent.host.sockets import socket_address
from gpu_agent.plugin.service import DevicePluginManager

KUBEVIRT = "nvidia.com/GH100_H100_SXM5_80GB"
PASSED = ["0000:9a:00.0", "0000:ab:00.0", "0000:ba:00.0", "0000:db:00.0"]  # dgx-h100's GPUs 4-7
VM = {"gpus": dict.fromkeys("4567", "vm-passthrough")}


async def _first_list(directory: Path, socket: str) -> list[api.Device]:
    address, fd = socket_address(directory / socket)
    channel = Channel(path=address)
    try:
        async with DevicePluginStub(channel).ListAndWatch.open() as stream:
            await stream.send_message(api.Empty(), end=True)
            answer = await asyncio.wait_for(stream.recv_message(), 10)
            await stream.cancel()  # a ListAndWatch stream ends only with its resource
        assert answer is not None
        return list(answer.devices)
    finally:
        channel.close()
        if fd is not None:
            os.close(fd)


async def _allocate(directory: Path, socket: str, ids: list[str]) -> api.AllocateResponse:
    address, fd = socket_address(directory / socket)
    channel = Channel(path=address)
    try:
        request = api.AllocateRequest(container_requests=[api.ContainerAllocateRequest(devices_ids=ids)])
        return await asyncio.wait_for(DevicePluginStub(channel).Allocate(request), 10)
    finally:
        channel.close()
        if fd is not None:
            os.close(fd)


def test_kubevirts_resource_registers_lists_and_allocates_over_grpc(tmp_path: Path) -> None:
    node = SimNode(tmp_path / "root", "dgx-h100")
    directory = node.root / PLUGIN_DIR
    directory.mkdir(parents=True)
    done = node.apply({"toolkit": {"enabled": False}, "workload": VM})
    assert done.stage("vfio").state == "ok", done.stage("vfio").message
    state = done.state
    sim = json.loads(run_cli("sim", "show", "--json", root=node.root).stdout)["gpus"]
    uuids = [gpu["uuid"] for gpu in sim]
    groups = {gpu["pci_bus_id"].lower()[-12:]: str(gpu["iommu_group"]) for gpu in sim}

    async def scenario() -> dict[str, Any]:
        registrations = Registrations()
        kubelet = Server([registrations])
        address, fd = socket_address(directory / "kubelet.sock")
        await kubelet.start(path=address)
        manager = DevicePluginManager(Root(node.root), state)
        try:
            await manager.sync()
            for _ in range(200):  # registration runs beside the sync
                if len(manager.registered) == 2:
                    break
                await asyncio.sleep(0.05)
            sockets = {name: endpoint.path.name for name, endpoint in manager.endpoints.items()}
            found: dict[str, Any] = {"registered": {r.resource_name: r.endpoint for r in registrations.requests},
                                     "sockets": sockets}
            found["gpu"] = await _first_list(directory, sockets["nvidia.com/gpu"])
            found["vm"] = await _first_list(directory, sockets[KUBEVIRT])
            found["allocated"] = await _allocate(directory, sockets[KUBEVIRT], [PASSED[1], PASSED[3]])
            try:
                await _allocate(directory, sockets[KUBEVIRT], [PASSED[0], "0000:18:00.0"])  # GPU 0: not the VMs'
            except GRPCError as exc:
                found["refused"] = (exc.status, exc.message)
            return found
        finally:
            await manager.stop_all()
            kubelet.close()
            await kubelet.wait_closed()
            if fd is not None:
                os.close(fd)

    found = asyncio.run(scenario())
    assert found["registered"] == {"nvidia.com/gpu": "nvidia-gpu.sock",
                                   KUBEVIRT: "nvidia-GH100_H100_SXM5_80GB.sock"}
    assert sorted(device.ID for device in found["gpu"]) == sorted(uuids[:4])  # GPUs 0-3 only
    assert sorted(device.ID for device in found["vm"]) == PASSED
    assert all(device.health == "Healthy" for device in found["vm"])
    (container,) = found["allocated"].container_responses
    assert dict(container.envs) == {"PCI_RESOURCE_NVIDIA_COM_GH100_H100_SXM5_80GB": f"{PASSED[1]},{PASSED[3]}"}
    nodes = [(spec.container_path, spec.host_path, spec.permissions) for spec in container.devices]
    assert nodes == [("/dev/vfio/vfio", "/dev/vfio/vfio", "mrw"),
                     *((f"/dev/vfio/{groups[a]}", f"/dev/vfio/{groups[a]}", "mrw") for a in (PASSED[1], PASSED[3]))]
    assert not container.mounts and not container.cdi_devices
    status, message = found["refused"]
    assert status == Status.INVALID_ARGUMENT and "0000:18:00.0" in message
