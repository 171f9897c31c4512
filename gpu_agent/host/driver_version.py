"""Which NVIDIA driver is installed, as opposed to loaded: the version of the NVML library on disk, and
the version of the nvidia module that modprobe would load for the running kernel.

The module is found as modprobe finds it, through /lib/modules/$(uname -r)/modules.dep, and its version
is read as `modinfo -F version` reads it: the `version=` string of the module's .modinfo section (the
file uncompressed, or compressed with xz or gzip, as distributions ship it; zstd needs a library the
standard one lacks, so a .ko.zst module's version is unknown and only the library speaks).
"""
from __future__ import annotations

import gzip
import lzma
import os
import re
from dataclasses import dataclass
from typing import Optional

from gpu_agent.host.paths import Root, resolve
from gpu_agent.host.procfs import read

LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/nvidia/lib64")
_MODULE_NAMES = ("nvidia.ko", "nvidia.ko.xz", "nvidia.ko.gz", "nvidia.ko.zst")
_MOST_BYTES = 256 << 20  # the nvidia module is about 60 MiB uncompressed; a larger file is not one
_VERSION = re.compile(rb"\x00version=([0-9A-Za-z.+~-]{1,64})\x00")
_LONGEST_MATCH = 80  # a match straddling two reads is found in the last read's tail and the next
_RELEASE = re.compile(r"[0-9A-Za-z._+-]{1,128}")


@dataclass(frozen=True)
class Installed:
    """The installed driver: the NVML library's version and the on-disk module's, each None when unknown."""

    library: Optional[str]
    module: Optional[str]
    module_path: Optional[str]  # host path of the module file modprobe would load

    @property
    def version(self) -> Optional[str]:
        """The version a reload would bring: the module's where it is known, else the library's."""
        return self.module or self.library


def installed(root: Root) -> Installed:
    path = module_path(root)
    return Installed(library_version(root), module_version(root, path) if path else None, path)


def library_version(root: Root) -> Optional[str]:
    """The version in libnvidia-ml.so.<version>'s name, from the usual library directories."""
    for directory in LIBRARY_DIRS:
        real = resolve(root, directory)  # its links followed under the root, never on the host
        for library in sorted(root(real).glob("libnvidia-ml.so.*.*")) if real else ():
            return library.name[len("libnvidia-ml.so."):]
    return None


def kernel_release(root: Root) -> Optional[str]:
    """`uname -r`, from /proc/sys/kernel/osrelease."""
    text = (read(root, "/proc/sys/kernel/osrelease") or "").strip()
    return text if _RELEASE.fullmatch(text) else None


def module_path(root: Root) -> Optional[str]:
    """The host path of the nvidia module for the running kernel, from modules.dep (as modprobe)."""
    release = kernel_release(root)
    if release is None:
        return None
    base = f"/lib/modules/{release}"
    text = read(root, f"{base}/modules.dep") or ""
    for line in text.splitlines():
        name = line.partition(":")[0].strip()
        if os.path.basename(name) in _MODULE_NAMES:
            return name if name.startswith("/") else f"{base}/{name}"
    return None


def module_version(root: Root, host_path: str) -> Optional[str]:
    """`modinfo -F version` of the module file; None when it cannot be read or holds no version.

    The driver stage asks at every pass: the answer is kept while the file is the same one (its inode,
    size and time), and the file is read a MiB at a time, so a 60 MiB module is neither read at every
    pass nor held whole."""
    if host_path.endswith(".zst"):
        return None
    path = root(host_path)
    try:
        st = os.stat(path)
    except OSError:
        return None
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _READ.get(str(path))
    if known is not None and known[0] == identity:
        return known[1]
    version = _read_version(str(path), host_path)
    if len(_READ) >= 8:
        _READ.clear()
    _READ[str(path)] = (identity, version)
    return version


_READ: dict[str, tuple[tuple[int, ...], Optional[str]]] = {}  # module file -> (its identity, its version)


def _read_version(path: str, host_path: str) -> Optional[str]:
    opener = lzma.open if host_path.endswith(".xz") else gzip.open if host_path.endswith(".gz") else open
    tail, total = b"", 0
    try:
        with opener(path, "rb") as module:
            while chunk := module.read(1 << 20):
                total += len(chunk)
                if total > _MOST_BYTES:
                    return None
                match = _VERSION.search(tail + chunk)
                if match:
                    return match.group(1).decode("ascii")
                tail = (tail + chunk)[-_LONGEST_MATCH:]
    except (OSError, lzma.LZMAError, EOFError, ValueError):
        return None
    return None


def modinfo_bytes(version: str) -> bytes:
    """The .modinfo strings a module of `version` carries, as the kernel build writes them (simulator,
    tests)."""
    fields = ("license=NVIDIA", f"version={version}", "supported=external", "description=NVIDIA kernel module",
              "srcversion=0123456789ABCDEF0123456", "name=nvidia")
    return b"\x7fELF" + b"\x00" * 60 + b"".join(b"\x00" + field.encode() for field in fields) + b"\x00"
