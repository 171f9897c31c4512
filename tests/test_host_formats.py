"""What real kernels and drivers write under /proc and /sys, read by the driver stage in-process.

Every format a real node shows is accepted (the lines come from tests/data/captures/h100-580-vm-raw and
NVIDIA's documented variants); every malformed line is a StageError naming the file and the line,
never an internal error.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Union

import pytest

from gpu_agent.config.driver import DriverConfig
from gpu_agent.errors import StageError
from gpu_agent.host import procfs
from gpu_agent.host.modules import KernelModules
from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe
from gpu_agent.sim.machine import MachineState
from gpu_agent.stages.driver import Driver

# tests/data/captures/h100-580-vm-raw/proc-modules-and-sys-module.txt: a kernel without module unloading.
REAL_MODULES = ("nvidia_uvm 1830912 - - Live 0xffffffffc080c000 (O)\n"
                "nvidia 14299136 - - Live 0xffffffffc0400000 (O)\n")
# proc-devices.txt (shortened): nvidia and nvidiactl share 195; the NVSwitch, NVLink and IMEX majors.
REAL_DEVICES = ("Character devices:\n  1 mem\n  4 /dev/vc/0\n195 nvidia\n195 nvidiactl\n238 nvidia-uvm\n"
                "239 nvidia-nvswitch\n240 nvidia-nvlink\n241 nvidia-caps\n242 nvidia-caps-imex-channels\n"
                "\nBlock devices:\n  7 loop\n259 blkext\n")
OPEN_VERSION = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
                "GCC version:  gcc version 15.3.0 (GCC) \n")
PROPRIETARY_VERSION = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct  2 12:00:00 UTC 2025\n"
ARM_VERSION = "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.159.04  Release Build  (dvs-builder@)\n"
# proc-driver-nvidia-params.txt: empty quoted values.
REAL_PARAMS = ('ResmanDebugLevel: 4294967295\nDeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\n'
               'CoherentGPUMemoryMode: ""\nRegistryDwords: ""\nRmMsg: ""\nExcludedGpus: ""\n')

Content = Union[str, bytes, None]  # None: make the path a directory


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Root, Driver]]:
    """One simulated T4 with nvidia and nvidia_uvm loaded, and the real driver stage over it."""
    machine = MachineState(Root(tmp_path))
    machine.ensure("t4")
    root = Root(tmp_path).with_kernel(machine.kernel_dir)
    for module in ("nvidia", "nvidia_uvm"):
        SimModprobe(machine, root).load(module)
    nvml = Nvml(FakeNvml(machine), call_timeout=5.0)
    yield root, Driver(root, nvml, SimModprobe(machine, root), DriverConfig())
    nvml.close()


def put(root: Root, host_path: str, content: Content) -> None:
    path = root(host_path)
    if path.is_dir():
        path.rmdir()
    elif path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content.encode() if isinstance(content, str) else content)


def gpu_dir(root: Root) -> str:
    return next(root("/proc/driver/nvidia/gpus").iterdir()).name


ACCEPTED: list[tuple[str, Content]] = [
    ("/proc/modules", REAL_MODULES),
    ("/proc/modules", "nvidia_uvm 4890624 0 - Live 0x0000000000000000 (POE)\n"
                      "nvidia 56807424 2 nvidia_uvm,nvidia_modeset, Live 0x0000000000000000 (POE)\n"),
    ("/proc/modules", "nvidia 56807424 0 - Live 0x0\n\nnvidia_uvm 4890624 0 - Live 0x0\n"),  # no taint column
    ("/proc/devices", REAL_DEVICES),
    ("/proc/devices", REAL_DEVICES.replace("195 nvidia\n195 nvidiactl\n", "195 nvidia-frontend\n")),
    ("/proc/driver/nvidia/version", OPEN_VERSION),
    ("/proc/driver/nvidia/version", PROPRIETARY_VERSION),
    ("/proc/driver/nvidia/version", ARM_VERSION),
    ("/proc/driver/nvidia/params", REAL_PARAMS),
    ("/proc/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n"),
]


@pytest.mark.parametrize(("host_path", "content"), ACCEPTED)
def test_every_real_format_is_read(node: tuple[Root, Driver], host_path: str, content: Content) -> None:
    root, driver = node
    put(root, host_path, content)
    observed = driver.observe()
    assert {"nvidia", "nvidia_uvm"} <= set(observed.loaded)
    assert any(n.path == "/dev/nvidia0" and n.major == 195 for n in observed.nodes)


MALFORMED: list[tuple[str, Content, str]] = [
    ("/proc/modules", "nvidia\n", "/proc/modules:1: cannot read 'nvidia': expected name, size, refcount"),
    ("/proc/modules", "nvidia 14299136 x - Live 0x0\n", "/proc/modules:1:"),
    ("/proc/modules", "nvidia_uvm 1 - - Live 0x0\nnvidia big - - Live 0x0\n", "/proc/modules:2:"),
    ("/proc/modules", b"nvidia \xff\xfe - - Live\n", "/proc/modules:1:"),
    ("/proc/modules", "x" * 1_000_000 + "\n", "/proc/modules:1: cannot read 'xxx"),
    ("/proc/modules", None, "cannot read /proc/modules: it is a directory, not a file"),
    ("/proc/devices", "Character devices:\nabc nvidia\n", "/proc/devices:2: cannot read 'abc nvidia'"),
    ("/proc/devices", "Character devices:\n195\n", "/proc/devices:2:"),
    ("/proc/devices", "195 nvidia\n", "/proc/devices:1: cannot read '195 nvidia': expected a 'Character devices:'"),
    ("/proc/driver/nvidia/version", "NVRM version: something else\n", "/proc/driver/nvidia/version:1:"),
    ("/proc/driver/nvidia/version", "", "/proc/driver/nvidia/version:1: cannot read ''"),
    ("/proc/driver/nvidia/params", "DeviceFileMode: rw-rw-rw-\n",
     "/proc/driver/nvidia/params:1: cannot read 'DeviceFileMode: rw-rw-rw-': expected DeviceFileMode to be a decimal"),
    ("/proc/driver/nvidia/params", "DeviceFileMode 438\n", "/proc/driver/nvidia/params:1: cannot read"),
    ("/proc/driver/nvidia/params", ": 438\n", "/proc/driver/nvidia/params:1:"),
    ("/proc/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: one\n",
     "/proc/driver/nvidia/capabilities/mig/config:1:"),
    ("/proc/driver/nvidia/gpus/{gpu}/information", "Model: T4\nDevice Minor: \t zero\n",
     "/proc/driver/nvidia/gpus/{gpu}/information:2: cannot read 'Device Minor: \\t zero'"),
    # Numbers past what a device node can carry (dev_t: 12-bit major, 20-bit minor; a mode's 12 bits).
    ("/proc/devices", "Character devices:\n99999999999999999999 nvidia\n",
     "/proc/devices:2: cannot read '99999999999999999999 nvidia': expected a 'Character devices:' or 'Block devices:' "
     "heading, or a major number (0 to 4095)"),
    ("/proc/devices", "Character devices:\n4096 nvidia\n", "/proc/devices:2:"),
    ("/proc/devices", "Character devices:\n\u0661\u0669\u0665 nvidia\n", "/proc/devices:2:"),  # Arabic-Indic 195
    ("/proc/driver/nvidia/params", "DeviceFileMode: 99999999999\n",
     "/proc/driver/nvidia/params:1: cannot read 'DeviceFileMode: 99999999999': expected DeviceFileMode to be a decimal "
     "number from 0 to 4095"),
    ("/proc/driver/nvidia/params", "DeviceFileMode: -438\n", "/proc/driver/nvidia/params:1:"),
    ("/proc/driver/nvidia/params", "DeviceFileUID: 4294967295\n", "expected DeviceFileUID to be a decimal number"),
    ("/proc/driver/nvidia/params", "DeviceFileGID: 1_000\n", "expected DeviceFileGID to be a decimal number"),
    ("/proc/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: 99999999999999\n",
     "/proc/driver/nvidia/capabilities/mig/config:1: cannot read 'DeviceFileMinor: 99999999999999': expected "
     "DeviceFileMinor to be a decimal number from 0 to 1048575"),
    ("/proc/driver/nvidia/capabilities/mig/config", "DeviceFileMinor: -1\n",
     "/proc/driver/nvidia/capabilities/mig/config:1:"),
    ("/proc/driver/nvidia/gpus/{gpu}/information", "Model: T4\nDevice Minor: 1048576\n",
     "/proc/driver/nvidia/gpus/{gpu}/information:2:"),
    ("/sys/bus/pci/devices/{gpu}/vendor", "nvidia\n", "/sys/bus/pci/devices/{gpu}/vendor:1: cannot read 'nvidia'"),
    ("/sys/bus/pci/devices/{gpu}/class", b"\x00\x01\n", "/sys/bus/pci/devices/{gpu}/class:1:"),
]


@pytest.mark.parametrize(("host_path", "content", "message"), MALFORMED)
def test_a_malformed_line_is_a_stage_error_naming_file_and_line(
        node: tuple[Root, Driver], host_path: str, content: Content, message: str) -> None:
    root, driver = node
    gpu = gpu_dir(root)
    put(root, host_path.format(gpu=gpu), content)
    with pytest.raises(StageError) as caught:
        observed = driver.observe()
        driver.verify(observed)
    assert message.format(gpu=gpu) in str(caught.value)
    assert len(str(caught.value)) < 400  # a huge line is cut, not echoed


def test_an_unreadable_module_version_is_named_not_a_crash(node: tuple[Root, Driver]) -> None:
    root, driver = node
    put(root, "/sys/module/nvidia/version", b"\xff\xfe\n")
    with pytest.raises(StageError, match="kernel module is \ufffd\ufffd but the NVML library is"):
        driver.verify(driver.observe())


@pytest.mark.parametrize(("text", "version", "open_module"), [
    (OPEN_VERSION, "580.159.04", True), (PROPRIETARY_VERSION, "580.159.04", False), (ARM_VERSION, "580.159.04", True),
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\n", "550.90.07", False),
])
def test_driver_version_lines(text: str, version: str, open_module: bool) -> None:
    parsed = procfs.parse_driver_version("/proc/driver/nvidia/version", text)
    assert (parsed.version, parsed.open_module) == (version, open_module)


def test_modules_without_unloading_have_no_refcount(node: tuple[Root, Driver]) -> None:
    root, _ = node
    put(root, "/proc/modules", REAL_MODULES)
    loaded = KernelModules(root).loaded()
    assert loaded["nvidia"] == procfs.LoadedModule("nvidia", None, ())


def test_a_module_in_proc_modules_but_not_in_sys_module_is_probed_again(node: tuple[Root, Driver]) -> None:
    root, driver = node
    sys_module = root("/sys/module/nvidia_uvm")
    for child in sorted(sys_module.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    sys_module.rmdir()
    assert [action.summary for action in driver.plan(driver.observe())][:1] == ["modprobe nvidia_uvm"]


def test_majors_keep_the_first_name_of_a_shared_major() -> None:
    majors = procfs.parse_char_majors("/proc/devices", REAL_DEVICES)
    assert (majors["nvidia"], majors["nvidiactl"], majors["nvidia-caps-imex-channels"]) == (195, 195, 242)
    assert "loop" not in majors  # a block device

