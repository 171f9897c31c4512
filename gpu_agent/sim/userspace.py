"""The driver's userspace on a simulated node: placeholder libraries, binaries and GSP firmware laid out
as the driver packages install them, and an /etc/ld.so.cache that lists the libraries as ldconfig would.

Only for sandbox roots: it writes real files under the root it is given.
"""
from __future__ import annotations

import os
import posixpath
import shutil
from pathlib import Path

from gpu_agent.host import ldcache
from gpu_agent.host.driver_version import modinfo_bytes
from gpu_agent.sim.files import publish
from gpu_agent.host.paths import Root, followed

# Library name -> soname suffix ("" means the soname is the versioned file itself), as the 550 driver ships them.
LIBRARIES = {
    "libcuda": "1", "libcudadebugger": "1", "libnvidia-ml": "1", "libnvidia-ptxjitcompiler": "1",
    "libnvidia-nvvm": "4", "libnvidia-cfg": "1", "libnvidia-opencl": "1", "libnvidia-allocator": "1",
    "libnvidia-gpucomp": "", "libnvidia-pkcs11": "", "libnvidia-pkcs11-openssl3": "",
}
LIBRARIES_32 = ("libcuda", "libnvidia-ml")  # multiarch installs also carry i386 copies, which CDI leaves out
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
_TRIPLETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "ppc64le": "powerpc64le-linux-gnu"}


def lib_dir() -> str:
    return f"/usr/lib/{_TRIPLETS.get(os.uname().machine, 'x86_64-linux-gnu')}"


def install_driver_userspace(root_path: Path, version: str) -> list[str]:
    """Install driver `version`'s userspace under the sandbox `root_path`, replacing any other version's;
    returns the host paths of the files written. Refuses the real root."""
    root_path = Path(root_path).resolve()
    if root_path == Path("/"):
        raise ValueError("install_driver_userspace writes placeholder driver files: never under /")
    at = _Placer(root_path)
    written: list[str] = []
    entries: list[ldcache.CacheEntry] = []
    for directory, names, flags in ((lib_dir(), list(LIBRARIES), ldcache.native_flags()),
                                    ("/usr/lib/i386-linux-gnu", list(LIBRARIES_32), ldcache.FLAG_ELF_LIBC6)):
        for name in names:
            _remove_other_versions(root_path / directory.lstrip("/"), name, version)
            real = f"{directory}/{name}.so.{version}"
            publish(at(real), f"placeholder {name} {version}\n", 0o644)
            written.append(real)
            file_name = posixpath.basename(real)
            soname = f"{name}.so.{LIBRARIES[name]}" if LIBRARIES[name] else file_name
            if soname != file_name:
                _symlink(at(f"{directory}/{soname}"), file_name)
            entries.append(ldcache.CacheEntry(soname, f"{directory}/{soname}", flags))
    for name in BINARIES:
        path = f"/usr/bin/{name}"
        publish(at(path), f"#!/bin/sh\necho '{name} {version} (simulated placeholder)'\n", 0o755)
        written.append(path)
    firmware_root = root_path / "lib/firmware/nvidia"
    for old in firmware_root.iterdir() if firmware_root.is_dir() else ():
        if old.name != version:
            shutil.rmtree(old)
    for name in FIRMWARE:
        path = f"/lib/firmware/nvidia/{version}/{name}"
        publish(at(path), f"placeholder GSP firmware {version}\n", 0o644)
        written.append(path)
    ldcache.write_cache(at(ldcache.PATH), entries)
    written.append(ldcache.PATH)
    return written


KERNEL_MODULES = ("nvidia", "nvidia-uvm", "nvidia-modeset", "nvidia-drm", "nvidia-peermem")


def install_driver_modules(root_path: Path, release: str, version: str) -> list[str]:
    """The driver's kernel modules for kernel `release`, as its DKMS build installs them under
    /lib/modules/RELEASE/updates/dkms, with a modules.dep that lists them (depmod's job). `root_path`: the
    simulated kernel's directory, where a simulating Root finds /lib/modules."""
    root_path = Path(root_path).resolve()
    if root_path == Path("/"):
        raise ValueError("install_driver_modules writes placeholder modules: never under /")
    at = _Placer(root_path)
    base = f"/lib/modules/{release}"
    written = []
    for name in KERNEL_MODULES:
        path = f"{base}/updates/dkms/{name}.ko"
        publish(at(path), modinfo_bytes(version) if name == "nvidia" else b"\x7fELF", 0o644)
        written.append(path)
    dep = "".join(f"updates/dkms/{name}.ko:{'' if name == 'nvidia' else ' updates/dkms/nvidia.ko'}\n"
                  for name in KERNEL_MODULES)
    publish(at(f"{base}/modules.dep"), dep, 0o644)
    return [*written, f"{base}/modules.dep"]


class _Placer:
    """Where an entry goes under the sandbox: the entry itself, the links in its directory followed as in
    a chroot there (host.paths.place). For one install: each directory is followed once, the installs
    making no link where a directory is."""

    def __init__(self, root_path: Path) -> None:
        self._root = Root(root_path)
        self._followed: dict[str, str] = {}

    def __call__(self, host_path: str) -> Path:
        directory, name = posixpath.split(host_path)
        followed_directory = self._followed.get(directory)
        if followed_directory is None:
            followed_directory = self._followed[directory] = followed(self._root, directory)
        return self._root(posixpath.join(followed_directory, name))


def _symlink(link: Path, target: str) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(target, link)


def _remove_other_versions(directory: Path, name: str, version: str) -> None:
    """An upgrade replaces the previous version's files; <name>.so.<soname number> links are rewritten instead."""
    for old in directory.glob(f"{name}.so.*") if directory.is_dir() else ():
        suffix = old.name[len(name) + len(".so."):]
        if suffix != version and suffix[:1].isdigit() and "." in suffix:
            old.unlink()
