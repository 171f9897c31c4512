"""The node's pool as ResourceSlices, written with the node's own credentials.

Kubernetes 1.34's Node authorizer lets a node create ResourceSlices (NodeRestriction admits only those whose
spec.nodeName is the node), get, update and delete those whose spec.nodeName is the node, and list them with
the field selector spec.nodeName=<node> (plugin/pkg/auth/authorizer/node/node_authorizer.go and
plugin/pkg/admission/noderestriction/admission.go of kubernetes/kubernetes at 00d03ec049aaa34f7d77b1bb86072e1b9a033177).

One sync lists the node's slices of the driver and makes them the pool asked for: the slices kept in name
order are replaced, missing ones created (generateName), extra ones deleted. The pool's generation goes up
with every change, above any generation the listed slices carry, so the scheduler never mixes two versions
of the pool. With the slices already as asked nothing is written.

An unhealthy device carries taints (devices.health_taints). An API server whose DRADeviceTaints feature is
off drops taints from what it stores (ResourceSlice strategy, dropDisabledDRADeviceTaintsFields, unless
the stored slice held taints already): the first write of a tainted device whose answer comes back
without its taint tells the publisher so, and from then on it withdraws unhealthy devices instead, at
once in the same sync. The time the server gives a taint (timeAdded) is kept when the slice is written
again, and left out when the stored slices are compared with the wanted ones.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

from gpu_agent.dra.devices import DRIVER, DraDevice, slices

log = logging.getLogger(__name__)

API_VERSION = "resource.k8s.io/v1"


class SliceClient(Protocol):
    def list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]: ...

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]: ...

    def replace_resource_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def delete_resource_slice(self, name: str) -> dict[str, Any]: ...


class SlicePublisher:
    def __init__(self, client: SliceClient, node: str) -> None:
        self.client = client
        self.node = node
        self.generation = 0  # the pool's, as last written by this process
        self.writes = 0  # slices created, replaced or deleted (for /status and tests)
        self.taints: Optional[bool] = None  # whether the API server keeps device taints; None: not seen yet

    def served(self, devices: tuple[DraDevice, ...]) -> tuple[DraDevice, ...]:
        """What the pool holds of `devices`: the tainted ones withdrawn where the server drops taints."""
        return devices if self.taints is not False else tuple(d for d in devices if not d.tainted)

    def sync(self, devices: tuple[DraDevice, ...]) -> bool:
        """Make the node's slices publish `devices`; True when something was written. Raises the client's
        ApiError when the API refuses or does not answer (the caller retries)."""
        wrote = self._sync(self.served(devices))
        if self.taints is False and any(device.tainted for device in devices):
            wrote = self._sync(self.served(devices)) or wrote  # the taints just found dropped: withdrawn
        return wrote

    def _sync(self, devices: tuple[DraDevice, ...]) -> bool:
        existing = sorted(self.client.list_resource_slices(self.node, DRIVER),
                          key=lambda item: str(item["metadata"].get("name", "")))
        listed = max((_generation(item) for item in existing), default=0)
        if existing and self._current(existing, devices, listed):
            self.generation = max(self.generation, listed)
            return False
        self.generation = max(self.generation, listed) + 1
        wanted = slices(self.node, devices, self.generation)
        times = _taint_times(existing)
        for at, spec in enumerate(wanted):
            spec = _with_taint_times(spec, times)
            if at < len(existing):
                metadata = existing[at]["metadata"]
                body = {"apiVersion": API_VERSION, "kind": "ResourceSlice",
                        "metadata": {"name": metadata["name"], "resourceVersion": metadata.get("resourceVersion")},
                        "spec": spec}
                answer = self.client.replace_resource_slice(str(metadata["name"]), body)
            else:
                answer = self.client.create_resource_slice({
                    "apiVersion": API_VERSION, "kind": "ResourceSlice",
                    "metadata": {"generateName": f"{self.node}-gpu.nvidia.com-"}, "spec": spec})
            self._learn_taints(spec, answer)
            self.writes += 1
        for extra in existing[len(wanted):]:
            self.client.delete_resource_slice(str(extra["metadata"]["name"]))
            self.writes += 1
        return True

    def _learn_taints(self, sent: dict[str, Any], answer: Any) -> None:
        """Whether the server kept the taints of what was sent, from the slice it answered with."""
        tainted = {device["name"] for device in sent["devices"] if device.get("taints")}
        if not tainted or not isinstance(answer, dict):
            return
        stored = {device.get("name"): device for device in _devices(answer.get("spec"))}
        kept = all(stored.get(name, {}).get("taints") for name in tainted)
        if self.taints is None or self.taints != kept:
            log.info("DRA: the API server %s device taints%s", "keeps" if kept else "drops",
                     "" if kept else " (DRADeviceTaints is off): unhealthy devices are withdrawn from the pool instead")
        self.taints = kept

    def _current(self, existing: list[dict[str, Any]], devices: tuple[DraDevice, ...], generation: int) -> bool:
        """Whether the listed slices are one complete pool of the generation they carry, holding `devices`."""
        wanted = slices(self.node, devices, generation)
        specs = [item.get("spec") for item in existing]
        return len(specs) == len(wanted) and all(_same(spec, want) for spec, want in zip(specs, wanted))


def _devices(spec: Any) -> list[dict[str, Any]]:
    devices = spec.get("devices") if isinstance(spec, dict) else None
    return [device for device in devices if isinstance(device, dict)] if isinstance(devices, list) else []


def _taint_times(existing: list[dict[str, Any]]) -> dict[tuple[Any, ...], Any]:
    """When the server says each stored taint was added, by (device, key, value, effect)."""
    return {(device.get("name"), taint.get("key"), taint.get("value"), taint.get("effect")): taint["timeAdded"]
            for item in existing for device in _devices(item.get("spec"))
            for taint in device.get("taints") or () if isinstance(taint, dict) and taint.get("timeAdded")}


def _with_taint_times(spec: dict[str, Any], times: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """`spec` with each taint the slices hold already given the time it was added then."""
    if not times:
        return spec
    devices = []
    for device in spec["devices"]:
        if device.get("taints"):
            taints = []
            for taint in device["taints"]:
                added = times.get((device["name"], taint["key"], taint.get("value"), taint["effect"]))
                taints.append({**taint, "timeAdded": added} if added else taint)
            device = {**device, "taints": taints}
        devices.append(device)
    return {**spec, "devices": devices}


def _generation(item: dict[str, Any]) -> int:
    spec = item.get("spec")
    pool = spec.get("pool") if isinstance(spec, dict) else None
    value = pool.get("generation") if isinstance(pool, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _same(spec: Optional[Any], wanted: dict[str, Any]) -> bool:
    """The stored spec says what `wanted` says (the server may add fields the agent never sets: a taint's
    timeAdded)."""
    if not isinstance(spec, dict):
        return False
    stored = {**spec, "devices": [_without_taint_times(device) for device in _devices(spec)]}
    return all(stored.get(key) == value for key, value in wanted.items())


def _without_taint_times(device: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(device.get("taints"), list):
        return device
    return {**device, "taints": [{k: v for k, v in taint.items() if k != "timeAdded"} if isinstance(taint, dict)
                                 else taint for taint in device["taints"]]}
