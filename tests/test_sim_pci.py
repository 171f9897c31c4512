"""The simulated PCI bus's drivers: IOMMU groups, driver_override, unbind and bind moving a function between
drivers, /dev/vfio's nodes, NVML losing a GPU the nvidia driver no longer holds, and the faults."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from harness import run_cli

from gpu_agent.host.paths import Root
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.pci import SimPciControl

GPU4 = "0000:9a:00.0"  # dgx-h100's fifth GPU


def _machine(root: Path, spec: str = "dgx-h100") -> tuple[MachineState, SimModprobe, SimPciControl]:
    machine = MachineState(Root(root))
    machine.ensure(spec)
    modprobe = SimModprobe(machine, Root(root).with_kernel(machine.kernel_dir))
    modprobe.load("nvidia")
    return machine, modprobe, SimPciControl(machine)


def _driver(machine: MachineState, address: str) -> str | None:
    link = machine.kernel_dir / f"sys/bus/pci/devices/{address}/driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


def _pass_through(pci: SimPciControl, address: str) -> None:
    pci.write("/sys/bus/pci/drivers/nvidia/unbind", address)
    pci.write(f"/sys/bus/pci/devices/{address}/driver_override", "vfio-pci")
    pci.write("/sys/bus/pci/drivers/vfio-pci/bind", address)


def test_unbind_and_bind_move_a_gpu_to_vfio_pci_and_out_of_nvml(root: Path) -> None:
    machine, modprobe, pci = _machine(root)
    kernel = machine.kernel_dir
    nvml = FakeNvml(machine)
    nvml.nvmlInit()
    uuids = [gpu["uuid"] for gpu in machine.read()["gpus"]]
    group = os.path.basename(os.readlink(kernel / f"sys/bus/pci/devices/{GPU4}/iommu_group"))
    assert (kernel / f"sys/kernel/iommu_groups/{group}/devices/{GPU4}").is_symlink()
    assert (kernel / f"sys/bus/pci/devices/{GPU4}/driver_override").read_text() == "(null)\n"
    assert _driver(machine, GPU4) == "nvidia" and nvml.nvmlDeviceGetCount() == 8

    with pytest.raises(OSError) as no_driver:  # vfio-pci is not loaded: its directory is not there
        pci.write("/sys/bus/pci/drivers/vfio-pci/bind", GPU4)
    assert no_driver.value.errno == errno.ENOENT
    modprobe.load("vfio_pci")
    assert sorted(os.listdir(kernel / "dev/vfio")) == ["vfio"]
    pci.write("/sys/bus/pci/drivers/nvidia/unbind", GPU4)
    assert _driver(machine, GPU4) is None and nvml.nvmlDeviceGetCount() == 7  # no driver: outside NVML too
    assert not (kernel / f"proc/driver/nvidia/gpus/{GPU4}").exists()
    pci.write(f"/sys/bus/pci/devices/{GPU4}/driver_override", "vfio-pci")
    with pytest.raises(OSError) as other:  # driver_override names another driver: nvidia's probe does not match
        pci.write("/sys/bus/pci/drivers/nvidia/bind", GPU4)
    assert other.value.errno == errno.ENODEV
    pci.write("/sys/bus/pci/drivers/vfio-pci/bind", GPU4)
    assert _driver(machine, GPU4) == "vfio-pci"
    assert sorted(os.listdir(kernel / "dev/vfio")) == sorted([group, "vfio"])
    # NVML's indices count the GPUs nvidia holds: its index 4 is the machine's sixth GPU
    assert nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(4)) == uuids[5]
    with pytest.raises(OSError) as held:
        pci.write("/sys/bus/pci/drivers/nvidia/bind", GPU4)
    assert held.value.errno == errno.EBUSY  # vfio-pci holds it

    shown = json.loads(run_cli("sim", "show", "--json", root=root).stdout)
    assert [gpu["driver"] for gpu in shown["gpus"]] == ["nvidia"] * 4 + ["vfio-pci"] + ["nvidia"] * 3
    assert shown["gpus"][4]["iommu_group"] == int(group)

    pci.write("/sys/bus/pci/drivers/vfio-pci/unbind", GPU4)
    pci.write(f"/sys/bus/pci/devices/{GPU4}/driver_override", "\n")
    pci.write("/sys/bus/pci/drivers_probe", GPU4)
    assert _driver(machine, GPU4) == "nvidia" and nvml.nvmlDeviceGetCount() == 8
    assert sorted(os.listdir(kernel / "dev/vfio")) == ["vfio"]  # the group's node went with its binding


def test_a_reboot_forgets_bindings_and_overrides(root: Path) -> None:
    machine, _, pci = _machine(root)
    SimModprobe(machine, Root(root).with_kernel(machine.kernel_dir)).load("vfio_pci")
    _pass_through(pci, GPU4)
    assert run_cli("sim", "reboot", root=root).returncode == 0
    assert _driver(machine, GPU4) == "nvidia"
    assert (machine.kernel_dir / f"sys/bus/pci/devices/{GPU4}/driver_override").read_text() == "(null)\n"
    assert not (machine.kernel_dir / "dev/vfio").exists()  # nothing loads vfio-pci at boot


def test_an_audio_function_shares_its_gpus_group_and_moves_with_it(root: Path, tmp_path: Path) -> None:
    spec = tmp_path / "audio.yaml"
    spec.write_text("gpus:\n  - model: T4\n    count: 1\n    pci_bus_ids: ['3b:00.0']\n    audio: true\n")
    machine, modprobe, pci = _machine(root, str(spec))
    kernel = machine.kernel_dir
    gpu, audio = "0000:3b:00.0", "0000:3b:00.1"
    group = os.readlink(kernel / f"sys/bus/pci/devices/{gpu}/iommu_group")
    assert os.readlink(kernel / f"sys/bus/pci/devices/{audio}/iommu_group") == group
    assert _driver(machine, audio) == "snd_hda_intel"
    modprobe.load("vfio_pci")
    _pass_through(pci, gpu)
    assert sorted(os.listdir(kernel / "dev/vfio")) == ["vfio"]  # the audio function keeps the group unviable
    pci.write("/sys/bus/pci/drivers/snd_hda_intel/unbind", audio)
    pci.write(f"/sys/bus/pci/devices/{audio}/driver_override", "vfio-pci")
    pci.write("/sys/bus/pci/drivers/vfio-pci/bind", audio)
    assert sorted(os.listdir(kernel / "dev/vfio")) == sorted([os.path.basename(group), "vfio"])


def test_faults_no_iommu_a_busy_unbind_a_refused_bind(root: Path) -> None:
    machine, modprobe, pci = _machine(root)
    modprobe.load("vfio_pci")
    assert run_cli("sim", "fail", "unbind", "--gpu", "4", "--times", "1", root=root).returncode == 0
    with pytest.raises(OSError) as busy:
        pci.write("/sys/bus/pci/drivers/nvidia/unbind", GPU4)
    assert busy.value.errno == errno.EBUSY and _driver(machine, GPU4) == "nvidia"
    pci.write("/sys/bus/pci/drivers/nvidia/unbind", GPU4)  # once only
    assert run_cli("sim", "fail", "bind", "--error", "refused", root=root).returncode == 0
    with pytest.raises(OSError) as refused:
        pci.write("/sys/bus/pci/drivers/vfio-pci/bind", GPU4)
    assert refused.value.errno == errno.ENODEV and _driver(machine, GPU4) is None
    assert run_cli("sim", "clear", root=root).returncode == 0

    assert run_cli("sim", "fail", "iommu", root=root).returncode == 0
    assert not (machine.kernel_dir / "sys/kernel/iommu_groups").exists()
    assert not (machine.kernel_dir / f"sys/bus/pci/devices/{GPU4}/iommu_group").exists()
    with pytest.raises(OSError) as no_iommu:
        pci.write("/sys/bus/pci/drivers/vfio-pci/bind", GPU4)
    assert no_iommu.value.errno == errno.EINVAL
    wrong = run_cli("sim", "fail", "bind", "--error", "busy", root=root)
    assert wrong.returncode == 1 and "--error busy: unknown for bind; one of refused" in wrong.stderr


def test_a_process_on_the_gpu_makes_its_unbind_busy(root: Path) -> None:
    machine, _, pci = _machine(root)
    assert run_cli("sim", "add-process", "--gpu", "4", "--pid", "4242", "--name", "python", root=root).returncode == 0
    with pytest.raises(OSError) as busy:
        pci.write("/sys/bus/pci/drivers/nvidia/unbind", GPU4)
    assert busy.value.errno == errno.EBUSY
