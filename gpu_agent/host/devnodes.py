"""NVIDIA device nodes, checked and created the way nvidia-modprobe does, with /dev/char links.

Without the /dev/char/MAJ:MIN links, a `systemctl daemon-reload` makes systemd re-apply device
cgroup rules it cannot resolve, and running containers lose access to their GPUs (NVML errors).
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from typing import Optional

from gpu_agent.host.driver_gpus import driver_gpus
from gpu_agent.host.paths import Root
from gpu_agent.host.procfs import MAX_MINOR, MAX_MODE, UINT32_MAX, KeyValues, parse_key_values, read

NVIDIA_MAJOR_NAMES = ("nvidia", "nvidia-frontend")
CTL_MINOR = 255
MODESET_MINOR = 254
DEFAULT_MODE = 0o666


@dataclass(frozen=True)
class DeviceNode:
    path: str  # /dev/nvidia0
    major: int
    minor: int
    mode: int
    uid: int = 0
    gid: int = 0

    @property
    def char_link(self) -> str:
        return f"/dev/char/{self.major}:{self.minor}"

    def describe(self) -> str:
        return f"{self.path} ({self.major}:{self.minor}, {self.mode:04o}, {self.uid}:{self.gid})"


def expected(root: Root, majors: dict[str, int], gpu_minors: list[int], modules: set[str]) -> list[DeviceNode]:
    """The nodes the loaded modules should have, from /proc/devices and /proc/driver/nvidia.

    Owner and mode of the nvidia nodes follow the driver's DeviceFileUID/GID/Mode parameters
    (/proc/driver/nvidia/params), as nvidia-modprobe does.
    """
    nodes: list[DeviceNode] = []
    params = driver_file(root, "/proc/driver/nvidia/params")
    mode = params.integer("DeviceFileMode", DEFAULT_MODE, MAX_MODE)
    owner = {"uid": params.integer("DeviceFileUID", 0, UINT32_MAX - 1),
             "gid": params.integer("DeviceFileGID", 0, UINT32_MAX - 1)}
    nvidia = next((majors[name] for name in NVIDIA_MAJOR_NAMES if name in majors), None)
    if "nvidia" in modules and nvidia is not None:
        nodes.append(DeviceNode("/dev/nvidiactl", nvidia, CTL_MINOR, mode, **owner))
        nodes += [DeviceNode(f"/dev/nvidia{minor}", nvidia, minor, mode, **owner) for minor in sorted(gpu_minors)]
    if "nvidia_modeset" in modules and nvidia is not None:
        nodes.append(DeviceNode("/dev/nvidia-modeset", nvidia, MODESET_MINOR, mode, **owner))
    if "nvidia_uvm" in modules and "nvidia-uvm" in majors:
        nodes.append(DeviceNode("/dev/nvidia-uvm", majors["nvidia-uvm"], 0, mode, **owner))
        nodes.append(DeviceNode("/dev/nvidia-uvm-tools", majors["nvidia-uvm"], 1, mode, **owner))
    if "nvidia-caps" in majors:
        caps = [f"{CAPABILITIES}/mig/{cap}" for cap in ("config", "monitor")] + mig_instance_capabilities(root)
        for cap in caps:
            info = driver_file(root, cap)
            if "DeviceFileMinor" in info:
                minor = info.integer("DeviceFileMinor", 0, MAX_MINOR)
                cap_mode = info.integer("DeviceFileMode", 0o400, MAX_MODE)
                nodes.append(DeviceNode(f"/dev/nvidia-caps/nvidia-cap{minor}", majors["nvidia-caps"], minor, cap_mode))
    return nodes


CAPABILITIES = "/proc/driver/nvidia/capabilities"
_GPU_DIR = re.compile(r"gpu\d{1,3}")
_GI_DIR = re.compile(r"gi\d{1,3}")
_CI_DIR = re.compile(r"ci\d{1,3}")
_MAX_CAPABILITIES = 4096  # 32 GPU minors x 15 GPU instances x (1 + 8 compute instances) is 4,320 in nv-caps.c


def mig_instance_capabilities(root: Root) -> list[str]:
    """The access capability files of every MIG GPU instance and compute instance the driver has now
    (gpuN/mig/giG/access, gpuN/mig/giG/ciC/access): their /dev/nvidia-caps nodes are what nvidia-modprobe -f
    makes for a process that opens the instance, and what a container given a MIG device (CDI) needs."""
    found: list[str] = []
    for gpu in _entries(root, CAPABILITIES, _GPU_DIR):
        for gi in _entries(root, f"{CAPABILITIES}/{gpu}/mig", _GI_DIR):
            found.append(f"{CAPABILITIES}/{gpu}/mig/{gi}/access")
            found += [f"{CAPABILITIES}/{gpu}/mig/{gi}/{ci}/access"
                      for ci in _entries(root, f"{CAPABILITIES}/{gpu}/mig/{gi}", _CI_DIR)]
            if len(found) >= _MAX_CAPABILITIES:
                return found[:_MAX_CAPABILITIES]
    return found


def _entries(root: Root, host_path: str, pattern: re.Pattern[str]) -> list[str]:
    try:
        with os.scandir(root(host_path)) as listing:
            names = [entry.name for _, entry in zip(range(_MAX_CAPABILITIES), listing)]
    except OSError:
        return []
    return sorted((name for name in names if pattern.fullmatch(name)), key=lambda name: (len(name), name))


def gpu_minors(root: Root) -> dict[str, int]:
    """Device minor of each GPU by PCI address, from /proc/driver/nvidia/gpus/*/information."""
    return {gpu.bus_id: gpu.minor for gpu in driver_gpus(root) if gpu.minor is not None}


def node_problem(root: Root, node: DeviceNode) -> Optional[str]:
    """What is wrong with the node itself, or None."""
    path = root(node.path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{node.path} is missing"
    if not stat.S_ISCHR(st.st_mode):
        return f"{node.path} is not a character device"
    if (os.major(st.st_rdev), os.minor(st.st_rdev)) != (node.major, node.minor):
        found = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        return f"{node.path} is {found}, the driver says {node.major}:{node.minor}"
    if stat.S_IMODE(st.st_mode) != node.mode or (st.st_uid, st.st_gid) != (node.uid, node.gid):
        return (f"{node.path} is {stat.S_IMODE(st.st_mode):04o} {st.st_uid}:{st.st_gid}, "
                f"the driver says {node.mode:04o} {node.uid}:{node.gid}")
    return None


def link_problem(root: Root, node: DeviceNode) -> Optional[str]:
    """What is wrong with the node's /dev/char link, or None."""
    link = root(node.char_link)
    try:
        if os.readlink(link) == link_target(node) and not link.parent.is_symlink():
            return None  # as udev and create_link write it: no need to resolve both paths
    except OSError:  # not there, or not a link
        return f"{node.char_link} does not point to {node.path}"
    if os.path.realpath(link) != os.path.realpath(root(node.path)):
        return f"{node.char_link} does not point to {node.path}"
    return None


def create_node(root: Root, node: DeviceNode) -> None:
    """mknod, atomically replacing a wrong node, with the driver's owner and mode."""
    path = root(node.path)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.gpu-agent")
    if temporary.exists() or temporary.is_symlink():
        temporary.unlink()
    os.mknod(temporary, stat.S_IFCHR | node.mode, os.makedev(node.major, node.minor))
    os.chown(temporary, node.uid, node.gid)
    os.chmod(temporary, node.mode)  # mknod's mode is filtered by the umask
    os.rename(temporary, path)


def link_target(node: DeviceNode) -> str:
    """What the node's /dev/char link holds: ../<node>, relative as udev writes it."""
    if node.path.startswith("/dev/") and "/." not in node.path and "//" not in node.path:
        return "../" + node.path[len("/dev/"):]
    return os.path.relpath(node.path, os.path.dirname(node.char_link))


def create_link(root: Root, node: DeviceNode) -> None:
    """/dev/char/MAJ:MIN -> ../<node>, replacing whatever file or link is there."""
    link = root(node.char_link)
    link.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    target = link_target(node)
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.exists():
        raise OSError(f"{node.char_link} is a directory, not a link; remove it")
    os.symlink(target, link)


def driver_file(root: Root, host_path: str) -> KeyValues:
    """One of the driver's `Key: value` files; empty when it does not exist."""
    return parse_key_values(host_path, read(root, host_path) or "")
