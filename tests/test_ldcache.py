"""gpu_agent.host.ldcache against caches the real ldconfig writes, and the simulator's writer."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gpu_agent.errors import AgentError
from gpu_agent.host import ldcache
from gpu_agent.host.ldcache import CacheEntry

needs_toolchain = pytest.mark.skipif(shutil.which("gcc") is None or shutil.which("ldconfig") is None,
                                     reason="needs gcc and ldconfig")

# (directory, file name, soname)
LIBRARIES = (("/opt/gpu/lib", "libgpuagent-a.so.1.2.3", "libgpuagent-a.so.1"),
             ("/opt/gpu/lib", "libgpuagent-b.so.7", "libgpuagent-b.so.7"),
             ("/usr/local/lib64", "libgpuagent-c.so.550.90.07", "libgpuagent-c.so.1"))


def ldconfig_root(tmp_path: Path, *args: str) -> Path:
    """A root with three real shared objects and the cache `ldconfig -r` writes for them."""
    root = tmp_path / "root"
    source = tmp_path / "empty.c"
    source.write_text("int gpu_agent_test(void) { return 1; }\n")
    for directory, name, soname in LIBRARIES:
        (root / directory.lstrip("/")).mkdir(parents=True, exist_ok=True)
        subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o",
                        str(root / directory.lstrip("/") / name), str(source)], check=True, capture_output=True)
    (root / "etc").mkdir()
    (root / "etc/ld.so.conf").write_text("/opt/gpu/lib\n/usr/local/lib64\n")
    subprocess.run(["ldconfig", *args, "-r", str(root)], check=True, capture_output=True)
    return root


@pytest.mark.subprocess
@pytest.mark.host_paths
@needs_toolchain
@pytest.mark.parametrize("fmt", ["new", "compat"])
def test_real_ldconfig_cache_lists_the_libraries(tmp_path: Path, fmt: str) -> None:
    # compat: the old ld.so-1.7.0 table with the new one after it, as glibc before 2.32 wrote by default
    root = ldconfig_root(tmp_path, "-c", fmt)
    data = (root / "etc/ld.so.cache").read_bytes()
    assert data.startswith(ldcache.OLD_MAGIC if fmt == "compat" else ldcache.NEW_MAGIC)
    entries = ldcache.read_cache(root / "etc/ld.so.cache")
    assert {(e.key, e.path) for e in entries} == {
        ("libgpuagent-a.so.1", "/opt/gpu/lib/libgpuagent-a.so.1"),
        ("libgpuagent-b.so.7", "/opt/gpu/lib/libgpuagent-b.so.7"),
        ("libgpuagent-c.so.1", "/usr/local/lib64/libgpuagent-c.so.1"),
    }
    assert all(e.flags == ldcache.native_flags() and e.elf for e in entries)
    x86_64 = ldcache.native_flags() & ldcache.FLAG_ARCH_MASK == ldcache.FLAG_X8664_LIB64
    assert all(e.x86_64 for e in entries) == x86_64
    assert (root / "opt/gpu/lib/libgpuagent-a.so.1").is_symlink()  # ldconfig made the soname link it lists


@pytest.mark.subprocess
@pytest.mark.host_paths
@needs_toolchain
def test_writer_orders_entries_as_ldconfig_does(tmp_path: Path) -> None:
    """The loader bisects the table, so the writer must keep ldconfig's order, not just its contents."""
    real = ldcache.read_cache(ldconfig_root(tmp_path) / "etc/ld.so.cache")
    assert ldcache.parse(ldcache.build(shuffled_but_ties(real))) == real


@pytest.mark.subprocess
@pytest.mark.host_paths
def test_host_cache_round_trips_in_order() -> None:
    if not Path("/etc/ld.so.cache").is_file():
        pytest.skip("this machine has no /etc/ld.so.cache")
    real = ldcache.read_cache("/etc/ld.so.cache")
    assert real and ldcache.parse(ldcache.build(shuffled_but_ties(real))) == real


def shuffled_but_ties(entries: list[CacheEntry]) -> list[CacheEntry]:
    """The entries out of order, but those of one name in the order given: ldconfig keeps such ties in the
    order it scanned their directories, which the entries alone do not tell (an H200 node's cache had
    libvdpau_nvidia.so.1 from /usr/local/nvidia/lib64, its ld.so.conf.d, before the one in /lib)."""
    return sorted(entries, key=lambda e: e.key[::-1])  # stable: the same name keeps its order


def test_one_name_in_two_directories_keeps_the_order_given() -> None:
    x86_64 = ldcache.FLAG_ELF_LIBC6 | 0x0300
    first = CacheEntry("libvdpau_nvidia.so.1", "/usr/local/nvidia/lib64/libvdpau_nvidia.so.1", x86_64)
    second = CacheEntry("libvdpau_nvidia.so.1", "/lib/libvdpau_nvidia.so.1", x86_64)
    other = CacheEntry("libcuda.so.1", "/lib/libcuda.so.1", x86_64)
    assert ldcache.parse(ldcache.build([other, first, second])) == [first, second, other]
    assert ldcache.parse(ldcache.build([second, other, first])) == [second, first, other]


def test_writer_round_trips_through_the_parser(tmp_path: Path) -> None:
    entries = [
        CacheEntry("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
        CacheEntry("libcuda.so.1", "/usr/lib/i386-linux-gnu/libcuda.so.1", ldcache.FLAG_ELF_LIBC6),
        CacheEntry("libnvidia-ml.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
        CacheEntry("libnvidia-gpucomp.so.550.90.07", "/usr/lib/x86_64-linux-gnu/libnvidia-gpucomp.so.550.90.07"),
        CacheEntry("libfoo.so.2", "/usr/lib/aarch64-linux-gnu/libfoo.so.2",
                   ldcache.FLAG_ELF_LIBC6 | ldcache.FLAG_AARCH64_LIB64, hwcap=1 << 62),
    ]
    path = tmp_path / "etc/ld.so.cache"
    ldcache.write_cache(path, entries)
    parsed = ldcache.read_cache(path)
    assert sorted(parsed, key=repr) == sorted(entries, key=repr)
    # descending _dl_cache_libcmp order; the x86-64 copy sorts above the i386 one
    assert [e.key for e in parsed] == ["libnvidia-ml.so.1", "libnvidia-gpucomp.so.550.90.07", "libfoo.so.2",
                                       "libcuda.so.1", "libcuda.so.1"]
    assert [e.x86_64 for e in parsed if e.key == "libcuda.so.1"] == [True, False]


def test_old_format_table_is_skipped_to_the_aligned_new_one() -> None:
    """An odd number of 12-byte old entries leaves the new table 4 bytes further on, at the 8-byte boundary."""
    new = ldcache.build([CacheEntry("libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")])
    old = ldcache.OLD_MAGIC + b"\0" + (1).to_bytes(4, "little") + b"\x03\x03\0\0" + bytes(8)  # 28 bytes
    assert ldcache.parse(old + bytes(4) + new) == ldcache.parse(new)
    with pytest.raises(ValueError, match="old format without"):
        ldcache.parse(old + new)


def test_libcmp_order_compares_numbers_as_numbers() -> None:
    names = ["libx.so.9", "libx.so.10", "libx.so", "libx2.so", "libxa.so"]
    ordered = [e.key for e in ldcache.parse(ldcache.build([CacheEntry(n, "/l/" + n) for n in names]))]
    assert ordered == ["libx2.so", "libxa.so", "libx.so.10", "libx.so.9", "libx.so"]


@pytest.mark.parametrize("content, reason", [
    (b"", "unknown format"),
    (b"this is not a cache at all, just some text\n" * 3, "unknown format"),
    (ldcache.NEW_MAGIC + b"\x05\x00", "truncated header"),
    (ldcache.OLD_MAGIC + b"\0" + b"\x01\0\0\0" + b"\0" * 40, "old format without"),
])
def test_garbage_is_a_clear_error_naming_the_file(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "ld.so.cache"
    path.write_bytes(content)
    with pytest.raises(AgentError) as error:
        ldcache.read_cache(path)
    assert str(path) in str(error.value) and reason in str(error.value) and "ldconfig" in str(error.value)


def test_truncated_cache_is_a_clear_error(tmp_path: Path) -> None:
    image = ldcache.build([CacheEntry(f"libn{n}.so.1", f"/usr/lib/libn{n}.so.1") for n in range(20)])
    path = tmp_path / "ld.so.cache"
    path.write_bytes(image[: len(image) - 40])
    with pytest.raises(AgentError, match=rf"{path}: not a usable ld.so cache \(truncated: 20 entries"):
        ldcache.read_cache(path)


def test_string_offset_outside_the_table_is_an_error(tmp_path: Path) -> None:
    image = bytearray(ldcache.build([CacheEntry("libn.so.1", "/usr/lib/libn.so.1")]))
    image[48 + 8:48 + 12] = (10 ** 6).to_bytes(4, "little")  # the entry's value offset
    path = tmp_path / "ld.so.cache"
    path.write_bytes(bytes(image))
    with pytest.raises(AgentError, match="points outside the string table"):
        ldcache.read_cache(path)


def test_missing_cache_says_to_run_ldconfig(tmp_path: Path) -> None:
    with pytest.raises(AgentError, match=rf"{tmp_path}/etc/ld.so.cache: no ld.so cache; run ldconfig"):
        ldcache.read_cache(tmp_path / "etc/ld.so.cache")
