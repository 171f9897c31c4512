"""The node's pool as ResourceSlices, written with the node's own credentials.

Kubernetes 1.34's Node authorizer lets a node create ResourceSlices (NodeRestriction admits only those whose
spec.nodeName is the node), get, update and delete those whose spec.nodeName is the node, and list them with
the field selector spec.nodeName=<node> (plugin/pkg/auth/authorizer/node/node_authorizer.go and
plugin/pkg/admission/noderestriction/admission.go of kubernetes/kubernetes at 00d03ec049aaa34f7d77b1bb86072e1b9a033177).

One sync lists the node's slices of the driver and makes them the pool asked for: the slices kept in name
order are replaced, missing ones created (generateName), extra ones deleted. The pool's generation goes up
with every change, above any generation the listed slices carry, so the scheduler never mixes two versions
of the pool. With the slices already as asked nothing is written.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from gpu_agent.dra.devices import DRIVER, DraDevice, slices

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

    def sync(self, devices: tuple[DraDevice, ...]) -> bool:
        """Make the node's slices publish `devices`; True when something was written. Raises the client's
        ApiError when the API refuses or does not answer (the caller retries)."""
        existing = sorted(self.client.list_resource_slices(self.node, DRIVER),
                          key=lambda item: str(item["metadata"].get("name", "")))
        listed = max((_generation(item) for item in existing), default=0)
        if existing and self._current(existing, devices, listed):
            self.generation = max(self.generation, listed)
            return False
        self.generation = max(self.generation, listed) + 1
        wanted = slices(self.node, devices, self.generation)
        for at, spec in enumerate(wanted):
            if at < len(existing):
                metadata = existing[at]["metadata"]
                body = {"apiVersion": API_VERSION, "kind": "ResourceSlice",
                        "metadata": {"name": metadata["name"], "resourceVersion": metadata.get("resourceVersion")},
                        "spec": spec}
                self.client.replace_resource_slice(str(metadata["name"]), body)
            else:
                self.client.create_resource_slice({"apiVersion": API_VERSION, "kind": "ResourceSlice",
                                                   "metadata": {"generateName": f"{self.node}-gpu.nvidia.com-"},
                                                   "spec": spec})
            self.writes += 1
        for extra in existing[len(wanted):]:
            self.client.delete_resource_slice(str(extra["metadata"]["name"]))
            self.writes += 1
        return True

    def _current(self, existing: list[dict[str, Any]], devices: tuple[DraDevice, ...], generation: int) -> bool:
        """Whether the listed slices are one complete pool of the generation they carry, holding `devices`."""
        wanted = slices(self.node, devices, generation)
        specs = [item.get("spec") for item in existing]
        return len(specs) == len(wanted) and all(_same(spec, want) for spec, want in zip(specs, wanted))


def _generation(item: dict[str, Any]) -> int:
    spec = item.get("spec")
    pool = spec.get("pool") if isinstance(spec, dict) else None
    value = pool.get("generation") if isinstance(pool, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _same(spec: Optional[Any], wanted: dict[str, Any]) -> bool:
    """The stored spec says what `wanted` says (the server may add fields the agent never sets)."""
    if not isinstance(spec, dict):
        return False
    return all(spec.get(key) == value for key, value in wanted.items())
