"""A pod through containerd's CRI, as the kubelet starts one: the few CRI v1 calls and messages it takes.

Debian packages no crictl, so the tests speak the CRI themselves, with the agent's own proto3 codec. The
field numbers are those of k8s.io/cri-api's pkg/apis/runtime/v1/api.proto (Debian 13's
golang-github-kubernetes-cri-api-dev 0.32.3); only the fields used here are declared.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from grpclib.client import Channel, UnaryUnaryMethod

from gpu_agent.proto3 import Codec, Message, int32, message, messages, string, string_map, strings

NODE = 2  # NamespaceMode.NODE: the pod shares the node's network, so no CNI plugin is needed
EXITED = 2  # ContainerState.CONTAINER_EXITED


@dataclasses.dataclass
class Empty(Message):
    pass


@dataclasses.dataclass
class VersionRequest(Message):
    version: str = string(1)


@dataclasses.dataclass
class VersionResponse(Message):
    version: str = string(1)
    runtime_name: str = string(2)
    runtime_version: str = string(3)
    runtime_api_version: str = string(4)


@dataclasses.dataclass
class NamespaceOption(Message):
    network: int = int32(1)


@dataclasses.dataclass
class LinuxSandboxSecurityContext(Message):
    namespace_options: Any = message(1, NamespaceOption)


@dataclasses.dataclass
class LinuxPodSandboxConfig(Message):
    security_context: Any = message(2, LinuxSandboxSecurityContext)


@dataclasses.dataclass
class PodSandboxMetadata(Message):
    name: str = string(1)
    uid: str = string(2)
    namespace: str = string(3)


@dataclasses.dataclass
class PodSandboxConfig(Message):
    metadata: Any = message(1, PodSandboxMetadata)
    hostname: str = string(2)
    log_directory: str = string(3)
    linux: Any = message(8, LinuxPodSandboxConfig)


@dataclasses.dataclass
class RunPodSandboxRequest(Message):
    config: Any = message(1, PodSandboxConfig)


@dataclasses.dataclass
class PodSandboxIdRequest(Message):
    """RunPodSandboxResponse, StopPodSandboxRequest and RemovePodSandboxRequest: the sandbox's id alone."""

    pod_sandbox_id: str = string(1)


@dataclasses.dataclass
class ImageSpec(Message):
    image: str = string(1)


@dataclasses.dataclass
class ContainerMetadata(Message):
    name: str = string(1)


@dataclasses.dataclass
class CDIDevice(Message):
    name: str = string(1)


@dataclasses.dataclass
class ContainerConfig(Message):
    metadata: Any = message(1, ContainerMetadata)
    image: Any = message(2, ImageSpec)
    command: list[str] = strings(3)
    annotations: dict[str, str] = string_map(10)
    log_path: str = string(11)
    cdi_devices: list[CDIDevice] = messages(17, CDIDevice)


@dataclasses.dataclass
class CreateContainerRequest(Message):
    pod_sandbox_id: str = string(1)
    config: Any = message(2, ContainerConfig)
    sandbox_config: Any = message(3, PodSandboxConfig)


@dataclasses.dataclass
class ContainerIdMessage(Message):
    """CreateContainerResponse, StartContainerRequest and ContainerStatusRequest: the container's id."""

    container_id: str = string(1)


@dataclasses.dataclass
class ContainerStatus(Message):
    id: str = string(1)
    state: int = int32(3)
    exit_code: int = int32(7)
    reason: str = string(10)
    message: str = string(11)


@dataclasses.dataclass
class ContainerStatusResponse(Message):
    status: Any = message(1, ContainerStatus)


SERVICE = "/runtime.v1.RuntimeService/"


async def _call(channel: Channel, name: str, request: Message, reply: type[Message]) -> Any:
    method: UnaryUnaryMethod[Any, Any] = UnaryUnaryMethod(channel, SERVICE + name, type(request), reply)
    return await method(request, timeout=60)


async def _run_pod(socket: str, image: str, command: list[str], cdi_devices: list[str], annotations: dict[str, str],
                   logs: str) -> tuple[str, ContainerStatus]:
    channel = Channel(path=socket, codec=Codec())
    try:
        version = await _call(channel, "Version", VersionRequest("v1"), VersionResponse)
        sandbox = PodSandboxConfig(PodSandboxMetadata("gpu-pod", "e2e-gpu-pod", "default"), "", logs,
                                   LinuxPodSandboxConfig(LinuxSandboxSecurityContext(NamespaceOption(NODE))))
        pod = (await _call(channel, "RunPodSandbox", RunPodSandboxRequest(sandbox), PodSandboxIdRequest)).pod_sandbox_id
        try:
            config = ContainerConfig(ContainerMetadata("gpu"), ImageSpec(image), command, annotations, "gpu.log",
                                     [CDIDevice(name) for name in cdi_devices])
            created = await _call(channel, "CreateContainer", CreateContainerRequest(pod, config, sandbox),
                                  ContainerIdMessage)
            await _call(channel, "StartContainer", ContainerIdMessage(created.container_id), Empty)
            deadline = time.monotonic() + 60
            while True:
                status = (await _call(channel, "ContainerStatus", ContainerIdMessage(created.container_id),
                                      ContainerStatusResponse)).status
                if status.state == EXITED or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
        finally:
            await _call(channel, "StopPodSandbox", PodSandboxIdRequest(pod), Empty)
            await _call(channel, "RemovePodSandbox", PodSandboxIdRequest(pod), Empty)
        return f"{version.runtime_name} {version.runtime_version} (CRI {version.runtime_api_version})", status
    finally:
        channel.close()


def run_pod(socket: str, image: str, command: list[str], logs: str, cdi_devices: list[str] = (),  # type: ignore[assignment]
            annotations: dict[str, str] | None = None) -> tuple[str, ContainerStatus]:
    """Run `command` in a pod's container through the CRI socket `socket` (a path this process can reach),
    its CDI devices given as the kubelet gives them; the runtime's name and version and the container's
    final status. Its output is in `logs`/gpu.log (the node's path), in the CRI log format."""
    return asyncio.run(_run_pod(socket, image, command, list(cdi_devices), annotations or {}, logs))
