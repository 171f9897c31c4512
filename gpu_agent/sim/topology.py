"""How a simulated machine's GPUs are wired: NUMA nodes, PCIe switches, NVLinks through NVSwitch.

Each GPU in the machine state carries `topology`: {"numa_node": n or -1, "pcie_path": [switch, ...]
from its root port down, "nvlinks": links into the NVSwitch fabric}. The fake NVML answers the
topology calls from it, and the simulated kernel writes numa_node into sysfs.
"""
from __future__ import annotations

from typing import Any

import pynvml

UNKNOWN_NUMA = -1


def gpu_topology(numa_node: int, pcie_path: tuple[str, ...], nvlinks: int) -> dict[str, Any]:
    return {"numa_node": numa_node, "pcie_path": list(pcie_path), "nvlinks": nvlinks}


def of(gpu: dict[str, Any]) -> dict[str, Any]:
    """A GPU's topology; a state written before topology existed has none: unknown, no NVLink."""
    return gpu.get("topology") or gpu_topology(UNKNOWN_NUMA, (), 0)


def common_ancestor(a: dict[str, Any], b: dict[str, Any]) -> int:
    """nvmlDeviceGetTopologyCommonAncestor of two GPUs (NVML_TOPOLOGY_*)."""
    if a is b or a["uuid"] == b["uuid"]:
        return pynvml.NVML_TOPOLOGY_INTERNAL
    path_a, path_b = of(a)["pcie_path"], of(b)["pcie_path"]
    if path_a and path_a == path_b:
        return pynvml.NVML_TOPOLOGY_SINGLE
    if path_a and path_b and path_a[0] == path_b[0]:
        return pynvml.NVML_TOPOLOGY_MULTIPLE
    node_a, node_b = of(a)["numa_node"], of(b)["numa_node"]
    if node_a == node_b and node_a != UNKNOWN_NUMA:
        return pynvml.NVML_TOPOLOGY_NODE
    return pynvml.NVML_TOPOLOGY_SYSTEM


def nvswitch_of_link(link: int, links: int, nvswitches: list[str]) -> str:
    """The NVSwitch a GPU's link leads to: the links spread evenly over the switches, in order (a DGX
    A100's 12 go two to each of its 6; a DGX H100's 18 go 4 or 5 to each of its 4 NVSwitch chips)."""
    return nvswitches[link * len(nvswitches) // links]
