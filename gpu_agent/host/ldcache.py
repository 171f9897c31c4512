"""/etc/ld.so.cache, read the way the dynamic loader reads it: which library each soname resolves to.

glibc writes the "glibc-ld.so.cache1.1" format; before 2.32 ldconfig wrote by default a "compat" file,
the old "ld.so-1.7.0" table followed by the new one (at the next 8-byte boundary), and readers use the
new one. Layout (glibc elf/cache.c, sysdeps/generic/dl-cache.h), little- or big-endian as flagged:

  header (48 bytes): magic "glibc-ld.so.cache" + version "1.1", nlibs u32, len_strings u32,
                     flags u8 (2 little, 3 big endian), 3 pad, extension_offset u32, 3 x u32 unused
  entry (24 bytes):  flags i32, key u32, value u32, osversion u32, hwcap u64
  strings:           NUL-terminated; offsets count from the start of the new header

Entries are sorted in descending _dl_cache_libcmp order, because the loader bisects them.
"""
from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from gpu_agent.errors import AgentError
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root

PATH = "/etc/ld.so.cache"
MAX_CACHE_BYTES = 64 << 20  # a cache of tens of thousands of libraries is a few MiB

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_HEADER = 16  # magic[11], padding, nlibs
_OLD_ENTRY = 12  # flags, key, value
_NEW_HEADER = 48
_NEW_ENTRY = 24
_ENDIAN = {0: "<", 2: "<", 3: ">"}  # 0: written before the flag existed (little-endian hosts)
_LITTLE = 2

# Entry flags: the low byte is the library type, the high byte the ABI.
FLAG_TYPE_MASK = 0x00FF
FLAG_ELF_LIBC6 = 0x0003
FLAG_ARCH_MASK = 0xFF00
FLAG_I386 = 0x0000  # no ABI bits: the 32-bit x86 (or other default) ABI
FLAG_POWERPC_LIB64 = 0x0500
FLAG_X8664_LIB64 = 0x0300
FLAG_X8664_LIBX32 = 0x0800
FLAG_AARCH64_LIB64 = 0x0A00
_NATIVE = {"x86_64": FLAG_X8664_LIB64, "aarch64": FLAG_AARCH64_LIB64, "ppc64le": FLAG_POWERPC_LIB64}


@dataclass(frozen=True)
class CacheEntry:
    key: str  # the soname, e.g. libcuda.so.1
    path: str  # where the loader finds it, e.g. /usr/lib/x86_64-linux-gnu/libcuda.so.1
    flags: int = FLAG_ELF_LIBC6 | FLAG_X8664_LIB64
    hwcap: int = 0

    @property
    def arch(self) -> int:
        return self.flags & FLAG_ARCH_MASK

    @property
    def elf(self) -> bool:
        return (self.flags & FLAG_TYPE_MASK) in (1, FLAG_ELF_LIBC6)  # FLAG_ELF, FLAG_ELF_LIBC6

    @property
    def x86_64(self) -> bool:
        return self.elf and self.arch == FLAG_X8664_LIB64


def native_flags() -> int:
    """The flags ldconfig gives this machine's own (64-bit) libraries."""
    machine = os.uname().machine
    if machine not in _NATIVE:
        raise AgentError(f"ld.so.cache: no known library ABI for machine type {machine!r}")
    return FLAG_ELF_LIBC6 | _NATIVE[machine]


def read_cache(path: Union[str, Path]) -> list[CacheEntry]:
    """Every entry of the cache file at `path` (a real path, already under the agent's root)."""
    try:
        data = read_bounded(path, MAX_CACHE_BYTES)
    except NotRegular as exc:
        raise AgentError(f"{path}: not an ld.so cache: it is {exc.kind}; run ldconfig to rebuild it") from None
    except TooLarge:
        raise AgentError(f"{path}: more than {MAX_CACHE_BYTES} bytes, not an ld.so cache; "
                         "run ldconfig to rebuild it") from None
    except OSError as exc:
        raise AgentError(f"{path}: cannot read the ld.so cache: {exc.strerror}") from None
    if data is None:
        raise AgentError(f"{path}: no ld.so cache; run ldconfig to create it")
    try:
        return parse(data)
    except ValueError as exc:
        raise AgentError(f"{path}: not a usable ld.so cache ({exc}); run ldconfig to rebuild it") from None


def native_entries(root: Root) -> list[CacheEntry]:
    """The entries for this machine's own ABI in the ld.so cache under `root`, in the loader's order."""
    arch = native_flags() & FLAG_ARCH_MASK
    return [entry for entry in read_cache(root(PATH)) if entry.elf and entry.arch == arch]


def find(root: Root, soname: str) -> Optional[str]:
    """Where the loader finds `soname` (a host path), or None when the cache does not list it."""
    return next((entry.path for entry in native_entries(root) if entry.key == soname), None)


def parse(data: bytes) -> list[CacheEntry]:
    """Entries of an ld.so.cache image; ValueError says what is wrong with it."""
    start = 0
    if data.startswith(OLD_MAGIC):
        if len(data) < _OLD_HEADER:
            raise ValueError("truncated old-format header")
        (old_count,) = struct.unpack_from("<I", data, 12)
        start = _align8(_OLD_HEADER + old_count * _OLD_ENTRY)
        if data[start:start + len(NEW_MAGIC)] != NEW_MAGIC:
            raise ValueError("old format without the glibc-ld.so.cache1.1 table after it")
    elif not data.startswith(NEW_MAGIC):
        raise ValueError("unknown format: neither glibc-ld.so.cache1.1 nor ld.so-1.7.0")
    if len(data) < start + _NEW_HEADER:
        raise ValueError("truncated header")
    endian = _ENDIAN.get(data[start + 28])
    if endian is None:
        raise ValueError(f"unknown byte order flag {data[start + 28]}")
    count, strings_size = struct.unpack_from(endian + "II", data, start + 20)
    strings_end = start + _NEW_HEADER + count * _NEW_ENTRY + strings_size
    if strings_end > len(data):
        raise ValueError(f"truncated: {count} entries and {strings_size} bytes of strings need "
                         f"{strings_end} bytes, the file has {len(data)}")
    entries = []
    for n in range(count):
        flags, key, value, _, hwcap = struct.unpack_from(endian + "iIIIQ", data, start + _NEW_HEADER + n * _NEW_ENTRY)
        entries.append(CacheEntry(_string(data, start, key, strings_end), _string(data, start, value, strings_end),
                                  flags, hwcap))
    return entries


def write_cache(path: Union[str, Path], entries: Iterable[CacheEntry]) -> None:
    """Write `entries` in the new format, sorted as ldconfig sorts them (for sandbox roots)."""
    atomic_write(Path(path), build(entries))


def build(entries: Iterable[CacheEntry]) -> bytes:
    ordered = sorted(entries, key=lambda e: (_libcmp_key(e.key), e.flags, e.hwcap), reverse=True)
    strings = bytearray()
    offsets: dict[str, int] = {}
    base = _NEW_HEADER + len(ordered) * _NEW_ENTRY
    for text in (s for e in ordered for s in (e.key, e.path)):
        if text not in offsets:
            offsets[text] = base + len(strings)
            strings += text.encode() + b"\0"
    header = NEW_MAGIC + struct.pack("<IIB3xI12x", len(ordered), len(strings), _LITTLE, 0)
    body = b"".join(struct.pack("<iIIIQ", e.flags, offsets[e.key], offsets[e.path], 0, e.hwcap) for e in ordered)
    return header + body + bytes(strings)


def _string(data: bytes, start: int, offset: int, end: int) -> str:
    position = start + offset
    stop = data.find(b"\0", position, end)
    if position >= end or stop < 0:
        raise ValueError(f"string offset {offset} points outside the string table")
    return data[position:stop].decode("utf-8", "surrogateescape")


def _align8(offset: int) -> int:
    return (offset + 7) & ~7


def _libcmp_key(name: str) -> list[tuple[int, int, str]]:
    """Sort key equivalent to glibc's _dl_cache_libcmp: digit runs compare as numbers (by length, then
    digits, never converted: a name may hold any number of them), above other characters."""
    return [(1, len(run.lstrip("0")), run.lstrip("0")) if run[0] in "0123456789" else (0, ord(run), "")
            for run in re.findall(r"[0-9]+|[^0-9]", name)]
