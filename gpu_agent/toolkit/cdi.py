"""The CDI spec for the node's GPUs: what `nvidia-ctk cdi generate` writes for compute and utility use.

Devices: each GPU by index ("0") and UUID, each MIG device by "<gpu index>:<mig index>" and "MIG-" UUID,
and "all". Common edits: the control nodes, the driver's libraries (found through the ld.so cache),
binaries, GSP firmware and IPC sockets mounted read-only, and nvidia-cdi-hook createContainer hooks
that add the libcuda.so link and refresh the container's ld.so cache. Host paths are the node's own
(never prefixed with the agent's --root), so the spec is valid on the node as written.
"""
from __future__ import annotations

import os
import posixpath
import re
import stat
from dataclasses import dataclass
from typing import Any, Optional

import yaml

from gpu_agent.errors import AgentError
from gpu_agent.host import ldcache, procfs
from gpu_agent.host.paths import Root, first_executable, resolve
from gpu_agent.nvml.model import Gpu, Inventory

KIND = "nvidia.com/gpu"
HOOK = "/usr/bin/nvidia-cdi-hook"
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
IPC_OPTIONS = (*MOUNT_OPTIONS, "noexec")

# libnvidia-container's "utility" and "compute" sets (nvc_info.c), each as <name>.so.<driver version>.
LIBRARIES = ("libnvidia-ml", "libnvidia-cfg", "libnvidia-nscq", "libcuda", "libcudadebugger", "libnvidia-opencl",
             "libnvidia-gpucomp", "libnvidia-ptxjitcompiler", "libnvidia-fatbinaryloader", "libnvidia-allocator",
             "libnvidia-compiler", "libnvidia-pkcs11", "libnvidia-pkcs11-openssl3", "libnvidia-nvvm")
REQUIRED = ("libcuda", "libnvidia-ml")  # without these no CUDA program or nvidia-smi works in a container
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
BINARY_DIRS = ("/usr/local/bin", "/usr/bin")  # in $PATH order, as nvidia-ctk searches
FIRMWARE_DIR = "/lib/firmware/nvidia"
IPC = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket", "/tmp/nvidia-mps")
COMMON_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
CAPS = "/proc/driver/nvidia/capabilities"
CAPS_DEV = "/dev/nvidia-caps"


@dataclass(frozen=True)
class DriverFiles:
    """The driver's userspace files on the node, as host paths."""

    version: str
    libraries: tuple[str, ...] = ()  # resolved files, e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.550.90.07
    binaries: tuple[str, ...] = ()
    firmware: tuple[str, ...] = ()
    ipc: tuple[str, ...] = ()  # sockets and the MPS pipe directory that exist now
    missing: tuple[str, ...] = ()  # required libraries the ld.so cache does not lead to, e.g. libcuda.so.550.90.07

    @property
    def library_dirs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(posixpath.dirname(path) for path in self.libraries))


def discover(root: Root, driver_version: str) -> DriverFiles:
    """The files of driver `driver_version` under `root`; AgentError when the ld.so cache is missing or broken."""
    wanted = {f"{name}.so.{driver_version}" for name in LIBRARIES}
    libraries: list[str] = []
    for entry in ldcache.native_entries(root):
        real = resolve(root, entry.path)
        if real is not None and posixpath.basename(real) in wanted and real not in libraries:
            libraries.append(real)
    found = {posixpath.basename(path) for path in libraries}
    firmware_dir = f"{FIRMWARE_DIR}/{driver_version}"
    real_firmware_dir = resolve(root, firmware_dir)  # its links followed under the root, never on the host
    firmware = sorted(p.name for p in root(real_firmware_dir).glob("*.bin") if p.is_file()) if real_firmware_dir else []
    return DriverFiles(
        version=driver_version,
        libraries=tuple(sorted(libraries)),
        binaries=tuple(path for path in (first_executable(root, BINARY_DIRS, name) for name in BINARIES) if path),
        firmware=tuple(f"{firmware_dir}/{name}" for name in firmware),
        ipc=tuple(path for path in IPC if root(path).exists()),
        missing=tuple(f"{name}.so.{driver_version}" for name in REQUIRED if f"{name}.so.{driver_version}" not in found),
    )


def build_spec(inventory: Inventory, root: Root, files: DriverFiles, hook: str = HOOK,
               additional_gids: bool = False) -> dict[str, Any]:
    """The spec as a dict (cdiVersion set to the lowest version whose features it uses). A GPU NVML cannot
    read keeps its devices as last known while its device node is there (a container restarted with it
    resolves its name, and the spec does not change with each loss), the plugin having made it Unhealthy.
    `additional_gids`: each edit gives the container the groups of its device nodes that a non-root user
    could not open otherwise (cdiVersion 0.7.0), as nvidia-ctk 1.20 does (internal/edits/device.go)."""
    if not inventory.gpus:
        raise AgentError("no GPUs: a CDI spec needs at least one device (an \"all\" without nodes is invalid)")
    devices: list[dict[str, Any]] = []
    for gpu in inventory.gpus:
        gpu_node = f"/dev/{gpu.device_node}"
        if gpu.unreadable and "major" not in _node(root, gpu_node):
            continue  # NVML cannot read it and its device node is gone: nothing a container could be given
        devices += [_device(name, root, [gpu_node], hook, additional_gids) for name in (str(gpu.index), gpu.uuid)]
        if not gpu.mig.enabled:
            continue
        for position, mig in enumerate(gpu.mig.devices):
            gi, ci = mig.gpu_instance_id, mig.compute_instance_id
            try:
                nodes = [gpu_node, _cap_node(root, gpu, gi), _cap_node(root, gpu, gi, ci)]
            except AgentError:
                if gpu.unreadable:  # its MIG devices as last read, where the driver still has their capabilities
                    continue
                raise
            devices += [_device(name, root, nodes, hook, additional_gids)
                        for name in (f"{gpu.index}:{position}", mig.uuid)]
    if not devices:
        raise AgentError("no GPU device node: NVML cannot read any GPU and their device nodes are gone")
    every = [node["path"] for device in devices for node in device["containerEdits"]["deviceNodes"]]
    devices.append(_device("all", root, list(dict.fromkeys(every)), hook, additional_gids))
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": KIND,
        "devices": sorted(devices, key=lambda device: device["name"]),
        "containerEdits": _common_edits(root, files, hook, additional_gids),
    }
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def device_node_paths(spec: dict[str, Any]) -> list[str]:
    """Every device node the spec names, once each."""
    edits = [spec.get("containerEdits") or {}] + [device.get("containerEdits") or {} for device in spec["devices"]]
    return list(dict.fromkeys(node["path"] for edit in edits for node in edit.get("deviceNodes") or []))


def render(spec: dict[str, Any]) -> str:
    """Deterministic YAML: the same spec gives the same bytes."""
    return yaml.dump(spec, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=4096)


# --- the CDI specification's version rules (container-device-interface specs-go/version.go) --------------

VERSIONS = ("0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")


def minimum_version(spec: dict[str, Any]) -> str:
    """The lowest cdiVersion that has every feature `spec` uses (0.3.0 is the earliest still accepted)."""
    devices = spec.get("devices") or []
    edits = [spec.get("containerEdits") or {}] + [device.get("containerEdits") or {} for device in devices]
    rdt = [e["intelRdt"] for e in edits if e.get("intelRdt") is not None]
    _, _, kind_class = (spec.get("kind") or "").partition("/")
    required = {
        "1.1.0": any(e.get("netDevices") for e in edits)
        or any(r.get("schemata") is not None or r.get("enableMonitoring") for r in rdt),
        "0.7.0": bool(rdt) or any(e.get("additionalGids") for e in edits),
        "0.6.0": bool(spec.get("annotations")) or any(device.get("annotations") for device in devices)
        or "." in kind_class,
        "0.5.0": any(not _ascii_letter(device.get("name", "x")[:1] or "x") for device in devices)
        or any(node.get("hostPath") for e in edits for node in e.get("deviceNodes") or []),
        "0.4.0": any(mount.get("type") for e in edits for mount in e.get("mounts") or []),
    }
    return next((version for version in reversed(VERSIONS) if required.get(version)), VERSIONS[0])


def _ascii_letter(char: str) -> bool:
    return ("a" <= char <= "z") or ("A" <= char <= "Z")


# --- parts of the spec ----------------------------------------------------------------------------


def _common_edits(root: Root, files: DriverFiles, hook: str, additional_gids: bool) -> dict[str, Any]:
    mounts = [_mount(path, MOUNT_OPTIONS) for path in (*files.libraries, *files.binaries, *files.firmware)]
    mounts += [_mount(path, IPC_OPTIONS) for path in files.ipc]
    hooks = []
    links = [f"libcuda.so.1::{posixpath.dirname(path)}/libcuda.so" for path in files.libraries
             if posixpath.basename(path).startswith("libcuda.so.")]
    if links:
        hooks.append(_hook(hook, "create-symlinks", *(arg for link in links for arg in ("--link", link))))
    if files.library_dirs:
        hooks.append(_hook(hook, "update-ldcache", *(arg for d in files.library_dirs for arg in ("--folder", d))))
    nodes = [path for path in COMMON_NODES if "major" in _node(root, path)]
    edits = {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": _sorted_nodes([_node(root, path) for path in nodes]),
        "mounts": sorted(mounts, key=lambda mount: _depth_order(mount["containerPath"])),
        "hooks": hooks,
        "additionalGids": group_ids(root, nodes) if additional_gids else [],
    }
    return {key: value for key, value in edits.items() if value}


def _device(name: str, root: Root, nodes: list[str], hook: str, additional_gids: bool) -> dict[str, Any]:
    """A device with its nodes; nested /dev/nvidia-caps nodes get nvidia-ctk's hook that makes the folder
    traversable for non-root users in the container (crun under rootless podman creates it 0700)."""
    edits: dict[str, Any] = {"deviceNodes": _sorted_nodes([_node(root, path) for path in nodes])}
    if any(path.startswith(CAPS_DEV + "/") for path in nodes):
        edits["hooks"] = [_hook(hook, "chmod", "--mode", "755", "--path", CAPS_DEV)]
    groups = group_ids(root, nodes) if additional_gids else []
    if groups:
        edits["additionalGids"] = groups
    return {"name": name, "containerEdits": edits}


def group_ids(root: Root, nodes: list[str]) -> list[int]:
    """The groups a container's user needs to open `nodes`: each node's group where it is not root's and the
    node is not both readable and writable by everyone (nvidia-ctk 1.20's getAdditionalGIDs)."""
    found = []
    for path in nodes:
        try:
            st = os.stat(root(path))
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode) and st.st_gid != 0 and st.st_mode & 0o006 != 0o006:
            found.append(st.st_gid)
    return sorted(set(found))


def _node(root: Root, path: str) -> dict[str, Any]:
    """A device node; with its type and numbers when it exists on the host (the runtime fills them in otherwise)."""
    try:
        st = os.stat(root(path))
    except OSError:
        return {"path": path}
    if not stat.S_ISCHR(st.st_mode):
        return {"path": path}
    node = {"path": path, "type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)}
    return {**node, "gid": st.st_gid} if st.st_gid != 0 else node  # as nvidia-ctk writes it: when not root's


def _cap_node(root: Root, gpu: Gpu, gi: int, ci: Optional[int] = None) -> str:
    """/dev/nvidia-caps/nvidia-capN for a GPU instance's (or compute instance's) access capability."""
    proc = f"{CAPS}/gpu{gpu.minor_number}/mig/gi{gi}" + (f"/ci{ci}" if ci is not None else "") + "/access"
    text = procfs.read(root, proc)
    if text is None:
        raise AgentError(f"{proc} is missing: the driver has not registered MIG instance gi{gi}"
                         f"{f'/ci{ci}' if ci is not None else ''} of GPU {gpu.index}; query again once MIG is settled")
    match = re.search(r"^DeviceFileMinor:\s*(\d+)\s*$", text, re.MULTILINE)
    if match is None:
        raise AgentError(f"{proc}: no DeviceFileMinor line in {text!r}")
    return f"{CAPS_DEV}/nvidia-cap{match.group(1)}"


def _mount(path: str, options: tuple[str, ...]) -> dict[str, Any]:
    return {"hostPath": path, "containerPath": path, "options": list(options)}


def _hook(hook: str, name: str, *args: str) -> dict[str, Any]:
    """A createContainer hook; nvidia-ctk itself takes the hooks as `nvidia-ctk hook NAME`."""
    program = posixpath.basename(hook)
    prefix = [program, "hook"] if program == "nvidia-ctk" else [program]
    return {"hookName": "createContainer", "path": hook, "args": [*prefix, name, *args]}


def _sorted_nodes(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(nodes, key=lambda node: _depth_order(node["path"]))


def _depth_order(path: str) -> tuple[int, str]:
    """nvidia-ctk's order: shallower paths first, then by name."""
    return posixpath.normpath(path).count("/"), path


class _Dumper(yaml.SafeDumper):
    """SafeDumper without anchors: repeated edits are written out in full, as CDI readers expect."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
