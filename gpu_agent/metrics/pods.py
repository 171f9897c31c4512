"""Pod attribution of the DCGM series (`metrics.pod_labels: true`), as dcgm-exporter does it.

The kubelet's pod-resources API (v1 List, on <root>/var/lib/kubelet/pod-resources/kubelet.sock) says
which container holds which device. A device id is a GPU UUID, a MIG device UUID or a time-slicing
replica `<uuid>::<n>`: the replica suffix is stripped, a GPU's holders label its whole-GPU series and a
MIG device's holders label its GPU instance's series (GPU_I_ID), each with `pod`, `namespace` and
`container`. A device a resource claim gave (the agent's DRA plugin, driver gpu.nvidia.com) is named in the
answer by its pool and device name (`gpu-0`, `gpu-0-mig-1g10gb-19-0`), and its series also get
dcgm-exporter's `dra_claim_name`, `dra_claim_namespace`, `dra_device_name`, `dra_driver_name` and
`dra_pool_name`. A device several containers share (replicas) gets one series per holder, as dcgm-exporter
writes them for shared GPUs; a device nobody holds keeps its series without those labels.

The query runs on its own timer (the sample interval), never on a scrape, and is bounded by a timeout;
the answer by its size (kube/podresources.py: MAX_MESSAGE_BYTES, refused before it is read), and it is
decoded in a worker thread, off the event loop that answers /healthz. Only pods holding devices are
kept, and only names Kubernetes accepts become label values. When it fails, the series go without pod
labels and /status says why.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from gpu_agent.dra.devices import DRIVER, gpu_device_name, mig_device_name
from gpu_agent.host.sockets import socket_address
from gpu_agent.host.paths import Root
from gpu_agent.metrics.pod_metadata import PodKey, PodMeta, PodMetadata
from gpu_agent.nvml.model import Inventory

if TYPE_CHECKING:
    from gpu_agent.kube.podresources import Holdings

log = logging.getLogger(__name__)

SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
TIMEOUT_S = 5.0
MAX_REPLICA_CHARS = 16  # the n of <uuid>::n: a longer one is no replica number, and no label value
MAX_HOLDERS = 256  # per device: more containers than this on one GPU is not a real node's answer
LABELS = ("container", "namespace", "pod")  # in the order dcgm-exporter writes them (its attributes, sorted)

Key = tuple[str, Optional[int]]  # (GPU UUID, GPU instance id; None: the whole GPU)


DRA_LABELS = ("dra_claim_name", "dra_claim_namespace", "dra_device_name", "dra_driver_name", "dra_pool_name")


@dataclass(frozen=True, order=True)
class Holder:
    namespace: str
    pod: str
    container: str
    replica: str = ""  # of a shared GPU: the n of its device id <uuid>::n (metrics.virtual_gpus' vgpu label)
    claim: tuple[str, ...] = ()  # of a device a resource claim gave: the values of DRA_LABELS

    @property
    def labels(self) -> list[str]:
        """Values of LABELS."""
        return [self.container, self.namespace, self.pod]

    @property
    def dra_labels(self) -> dict[str, str]:
        """dcgm-exporter's labels of a device a resource claim gave (none for a device plugin's)."""
        return dict(zip(DRA_LABELS, self.claim))


@dataclass(frozen=True)
class PodAttribution:
    """Replaced, never changed: the last answer of the kubelet, or why there is none."""

    holders: dict[Key, tuple[Holder, ...]] = field(default_factory=dict)
    error: Optional[str] = None
    at: Optional[float] = None  # when the kubelet last answered (unix time)
    skipped: int = 0  # holders whose names Kubernetes would not accept (kube/podresources.py)
    metadata: dict[PodKey, PodMeta] = field(default_factory=dict)  # the holders' pods, from the Kubernetes API
    metadata_error: Optional[str] = None  # why the API's answer is missing or old

    def of(self, uuid: str, gpu_instance: Optional[int] = None) -> tuple[Holder, ...]:
        return self.holders.get((uuid, gpu_instance), ())

    def meta(self, holder: Holder) -> Optional[PodMeta]:
        return self.metadata.get((holder.namespace, holder.pod))

    def to_json(self) -> dict[str, Any]:
        return {
            "error": self.error,
            "updated_at": self.at,
            "skipped_holders": self.skipped,
            "pod_metadata_error": self.metadata_error,
            "devices": [
                {"uuid": uuid, "gpu_instance_id": gi,
                 "holders": [{"pod": h.pod, "namespace": h.namespace, "container": h.container,
                              **({"replica": h.replica} if h.replica else {}),
                              **({"claim": h.dra_labels} if h.claim else {})} for h in holders]}
                for (uuid, gi), holders in sorted(self.holders.items(), key=lambda item: (item[0][0], _gi(item[0][1])))
            ],
        }


def _gi(value: Optional[int]) -> int:
    return -1 if value is None else value


def attribute(response: Holdings, inventory: Optional[Inventory]) -> dict[Key, tuple[Holder, ...]]:
    """Who holds each of the inventory's GPUs and GPU instances, from the kubelet's answer: the device
    plugin's devices by UUID, the resource claims' by the names the agent's DRA plugin gives them."""
    devices: dict[str, Key] = {}
    named: dict[str, Key] = {}  # in the node's pool of driver gpu.nvidia.com
    for gpu in inventory.gpus if inventory else ():
        devices[gpu.uuid] = named[gpu_device_name(gpu)] = (gpu.uuid, None)
        for mig in gpu.mig.devices:
            devices[mig.uuid] = (gpu.uuid, mig.gpu_instance_id)
        for instance in gpu.mig.gpu_instances:
            named[mig_device_name(gpu, instance)] = (gpu.uuid, instance.id)
    found: dict[Key, set[Holder]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for claim in container.dynamic_resources:
                for resource in claim.claim_resources:
                    key = named.get(resource.device_name) if resource.driver_name == DRIVER else None
                    if key is not None:
                        values = (claim.claim_name, claim.claim_namespace, resource.device_name,
                                  resource.driver_name, resource.pool_name)
                        found.setdefault(key, set()).add(Holder(pod.namespace, pod.name, container.name, claim=values))
            for device in container.devices:
                for device_id in device.device_ids:
                    uuid, _, replica = device_id.partition("::")
                    key = devices.get(uuid)
                    replica = replica if len(replica) <= MAX_REPLICA_CHARS else ""
                    if key is not None:
                        found.setdefault(key, set()).add(Holder(pod.namespace, pod.name, container.name, replica))
    return {key: tuple(sorted(holders)[:MAX_HOLDERS]) for key, holders in found.items()}


async def list_pod_resources(socket: Path, timeout: float) -> Holdings:
    """The pods holding devices, as the kubelet's List answers (decoded in a worker thread); raises
    OSError, asyncio.TimeoutError, a grpclib error, grpcsize.MessageTooLarge or proto3.DecodeError."""
    from grpclib.client import Channel

    from gpu_agent.grpcsize import unary_reply
    from gpu_agent.kube.podresources import MAX_MESSAGE_BYTES, ListPodResourcesRequest, holdings, list_method
    from gpu_agent.proto3 import Codec, DecodeError

    async def call() -> Optional[bytes]:
        async with list_method(channel).open(timeout=timeout) as stream:
            return await unary_reply(stream, ListPodResourcesRequest(), MAX_MESSAGE_BYTES)

    address, fd = socket_address(socket)
    channel = Channel(path=address, codec=Codec())
    try:
        data = await asyncio.wait_for(call(), timeout)
        if data is None:
            raise DecodeError("the kubelet answered List with no message")
        return await asyncio.to_thread(holdings, data)
    finally:
        channel.close()
        if fd is not None:
            os.close(fd)


class PodLabels:
    """Asks the kubelet every `interval()` seconds while `enabled()`, and publishes the answer; while
    disabled it sleeps until reconfigured() (a configuration reload) instead of waking to look."""

    def __init__(self, root: Root, inventory: Callable[[], Optional[Inventory]],
                 publish: Callable[[Optional[PodAttribution]], None], enabled: Callable[[], bool],
                 interval: Callable[[], float], timeout: float = TIMEOUT_S,
                 metadata: Callable[[], Optional[PodMetadata]] = lambda: None) -> None:
        """`metadata`: where the holders' pods are read from the Kubernetes API, None while no setting
        needs them."""
        self.metadata = metadata
        self.socket = root(SOCKET)
        self.inventory = inventory
        self.publish = publish
        self.enabled = enabled
        self.interval = interval
        self.timeout = timeout
        self._last_error: Optional[str] = None
        self._reconfigured: Optional[asyncio.Event] = None  # made in run(): asyncio objects belong to the loop

    def reconfigured(self) -> None:
        """The configuration changed: look at enabled() and interval() again now."""
        if self._reconfigured is not None:
            self._reconfigured.set()

    async def run(self) -> None:
        self._reconfigured = reconfigured = asyncio.Event()
        while True:
            reconfigured.clear()
            enabled = False
            try:
                enabled = self.enabled()
                if enabled:
                    await self.refresh()
                else:
                    self.publish(None)
            except Exception:  # a bug: log it and keep the loop, the metrics go on without pod labels
                log.exception("pod labels: refresh failed; this is a gpu-agent bug")
            try:
                await asyncio.wait_for(reconfigured.wait(), timeout=self.interval() if enabled else None)
            except asyncio.TimeoutError:
                pass

    async def refresh(self) -> PodAttribution:
        """One query; a failure is published as the reason the series have no pod labels."""
        try:
            response = await list_pod_resources(self.socket, self.timeout)
            inventory = self.inventory()
            holders = await asyncio.to_thread(attribute, response, inventory)
            attribution = PodAttribution(holders, None, time.time(), response.skipped)
            source = self.metadata()
            if source is not None:
                wanted = {(h.namespace, h.pod) for found in holders.values() for h in found}
                known = await asyncio.to_thread(source.lookup, wanted)
                attribution = replace(attribution, metadata=known, metadata_error=source.error)
        except asyncio.TimeoutError:
            attribution = self._failed(f"the kubelet's pod-resources API at {self.socket} did not answer List "
                                       f"within {self.timeout:g} s")
        except FileNotFoundError:
            attribution = self._failed(f"no kubelet pod-resources socket at {self.socket} (is the kubelet running "
                                       "on this node, with its default --root-dir?)")
        except Exception as exc:  # grpclib's errors, a refused connection, a malformed answer: all say why
            attribution = self._failed(f"the kubelet's pod-resources API at {self.socket} failed: "
                                       f"{type(exc).__name__}: {_short(str(exc))}")
        else:
            if self._last_error is not None:
                log.info("pod labels: the kubelet's pod-resources API answers again")
            self._last_error = None
        self.publish(attribution)
        return attribution

    def _failed(self, reason: str) -> PodAttribution:
        if reason != self._last_error:
            log.warning("pod labels: %s; GPU metrics go without pod, namespace and container labels", reason)
        self._last_error = reason
        return PodAttribution({}, reason, None)


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
