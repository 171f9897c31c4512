"""The device plugin's VM path: resource names as KubeVirt's GPU device plugin makes them, and what Allocate gives."""
from __future__ import annotations

import pytest

from gpu_agent.plugin.vfio import allocation, device_entry, kubevirt_name, resource_for

# NVIDIA/kubevirt-gpu-device-plugin at d26f2374d3c3f4785f52689cf954d1eea6202fb5, pkg/device_plugin/
# device_plugin_test.go, "getDeviceName() Tests": its pci.ids text and expected names, as our own data.
PCI_IDS = """
8086  Intel Corporation
\t2331  DH89xxCC Chap Counter
10de NVIDIA Corporation
\t118a  GK104GL [GRID K520]
\t118b  GK104GL [GRID K2 GeForce USM]
\t118d  gk104gl [grid k520]
\t118e gk104.gl [grid/k./520]
\t2331 GH100 [H100 PCIe]
"""


@pytest.mark.parametrize(("device_id", "name"), [
    (0x118A, "GK104GL_GRID_K520"),  # "Retrives correct device name from pci.ids file"
    (0x118D, "GK104GL_GRID_K520"),  # "Returns the device name from pci.ids in capital letters"
    (0x118E, "GK104_GL_GRID_K__520"),  # "Replaces / and . with _"
    (0x2331, "GH100_H100_PCIE"),  # "... even if another vendor's device shares device id"
])
def test_names_follow_kubevirts_rule(device_id: int, name: str) -> None:
    entry = device_entry(PCI_IDS, device_id)
    assert entry is not None and kubevirt_name(entry) == name


def test_an_id_the_database_lacks_is_named_by_its_id_and_known_gpus_need_no_database() -> None:
    assert device_entry(PCI_IDS, 0xABCD) is None
    assert resource_for(0xABCD, PCI_IDS) == "nvidia.com/abcd"
    assert resource_for(0x2330, "") == "nvidia.com/GH100_H100_SXM5_80GB"  # dgx-h100's GPUs


def test_allocate_gives_the_vfio_nodes_and_kubevirts_variable() -> None:
    groups = {"0000:9a:00.0": "28", "0000:ab:00.0": "30"}
    envs, nodes = allocation("nvidia.com/GH100_H100_SXM5_80GB", ["0000:9a:00.0", "0000:ab:00.0"], groups)
    assert envs == {"PCI_RESOURCE_NVIDIA_COM_GH100_H100_SXM5_80GB": "0000:9a:00.0,0000:ab:00.0"}
    assert nodes == ["/dev/vfio/vfio", "/dev/vfio/28", "/dev/vfio/30"]
    with pytest.raises(ValueError, match="passes through no such GPU"):
        allocation("nvidia.com/GH100_H100_SXM5_80GB", ["0000:18:00.0"], groups)
