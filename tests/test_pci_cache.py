"""A no-op pass reads no PCI ids: vendor, device and class are read again only for a device whose sysfs
entry was made again or announced a change (uevent)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpu_agent.host import pci
from gpu_agent.host.paths import Root
from gpu_agent.sim.machine import MachineState


def test_ids_are_read_once_per_device_until_its_entry_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    machine = MachineState(Root(tmp_path))
    machine.ensure("dgx-h100")
    root = Root(tmp_path).with_kernel(machine.kernel_dir)
    reads: list[str] = []
    hex_of = pci._hex

    def counting(entry: str, name: str) -> int:
        reads.append(f"{os.path.basename(entry)}/{name}")
        return hex_of(entry, name)

    monkeypatch.setattr(pci, "_hex", counting)
    first = pci.scan(root)
    assert len(first.gpus) == 8 and len(reads) == 3 * 20  # 8 GPUs, 4 NVSwitches, 8 NICs
    reads.clear()
    assert pci.scan(root) == first and reads == []

    gpu = root(f"/sys/bus/pci/devices/{first.gpus[3].address}")
    (gpu / "class").unlink()  # the device is made again, as another kind of function
    (gpu / "class").write_text("0x020000\n")
    (gpu / "uevent").write_text("DRIVER=nvidia\n")
    again = pci.scan(root)
    assert reads == [f"{gpu.name}/vendor", f"{gpu.name}/device", f"{gpu.name}/class"]
    assert len(again.gpus) == 7
    reads.clear()
    os.utime(gpu / "uevent", ns=(1, 1))  # a uevent: the kernel wrote the file
    pci.scan(root)
    assert reads == [f"{gpu.name}/vendor", f"{gpu.name}/device", f"{gpu.name}/class"]
