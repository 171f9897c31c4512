"""gpu_agent.host.bounded: one bounded reader of regular files for every caller."""
from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.host.bounded import (NotRegular, TooLarge, TooSlow, Unreadable, read_bounded, read_bounded_file,
                                    read_head, read_text)


def test_a_regular_file_up_to_the_limit_is_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    assert read_bounded(path, 10) == b"x" * 10
    found = read_bounded_file(path, 10)
    assert found is not None and found[1].st_size == 10


def test_a_missing_file_is_none_and_a_larger_one_is_refused_with_its_size(tmp_path: Path) -> None:
    assert read_bounded(tmp_path / "missing", 10) is None
    assert read_bounded(tmp_path / "missing" / "below", 10) is None
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(TooLarge) as error:
        read_bounded(tmp_path / "big", 10)
    assert (error.value.limit, error.value.size) == (10, 11)


def test_a_fifo_and_a_directory_are_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegular) as error:
        read_bounded(tmp_path / "fifo", 10)
    assert error.value.kind == "a FIFO"
    with pytest.raises(NotRegular, match="a directory"):
        read_bounded(tmp_path, 10)


def test_a_link_is_followed_only_when_asked(tmp_path: Path) -> None:
    (tmp_path / "target").write_text("hello")
    (tmp_path / "link").symlink_to("target")
    assert read_bounded(tmp_path / "link", 10) == b"hello"
    with pytest.raises(OSError) as error:
        read_bounded(tmp_path / "link", 10, follow=False)
    assert error.value.errno == errno.ELOOP


KMALLOC_MAX_SIZE = 4 << 20  # x86-64


def test_no_read_asks_for_what_the_kernel_refuses_on_proc_sys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linux answers a read(2) of a /proc/sys file with a count of KMALLOC_MAX_SIZE or more with ENOMEM
    (fs/proc/proc_sysctl.c, proc_sys_call_handler): the real H200 node's driver stage failed on
    /proc/sys/kernel/osrelease while procfs asked for its whole 4 MiB limit in one read."""
    from gpu_agent.host import bounded
    from gpu_agent.host.paths import Root
    from gpu_agent.host.procfs import MAX_PROC_BYTES, read

    real_read = os.read

    def sysctl_read(fd: int, count: int) -> bytes:
        if count >= KMALLOC_MAX_SIZE:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real_read(fd, count)

    monkeypatch.setattr(bounded.os, "read", sysctl_read)
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("6.18.44-fc-v657-gpu\n")
    assert MAX_PROC_BYTES >= KMALLOC_MAX_SIZE
    assert read(Root(tmp_path), "/proc/sys/kernel/osrelease") == "6.18.44-fc-v657-gpu\n"
    big = tmp_path / "big"
    big.write_bytes(bytes(range(256)) * (3 * bounded.READ_CHUNK // 256 + 7))
    assert read_bounded(big, MAX_PROC_BYTES) == big.read_bytes()


def test_a_sparse_2_gib_file_is_refused_by_its_size_without_a_read(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.host import bounded

    huge = tmp_path / "huge"
    with open(huge, "wb") as f:
        f.truncate(2 << 30)  # sparse: nothing written
    asked: list[int] = []
    real_read = os.read
    monkeypatch.setattr(bounded.os, "read", lambda fd, count: asked.append(count) or real_read(fd, count))
    with pytest.raises(Unreadable, match=rf"cannot read /var/lib/dpkg/status: more than {1 << 20} bytes$"):
        read_text(huge, "/var/lib/dpkg/status", 1 << 20)
    assert asked == []


def test_a_file_that_keeps_answering_is_given_up_after_the_time_cap(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A /proc or /sys file answering in small pieces: each read(2) a chunk, the clock past the cap."""
    from gpu_agent.host import bounded

    slow = tmp_path / "slow"
    slow.write_bytes(b"x" * (3 * bounded.READ_CHUNK))
    clock = iter(range(0, 1000, 4))  # four seconds a read
    monkeypatch.setattr(bounded.time, "monotonic", lambda: float(next(clock)))
    with pytest.raises(TooSlow) as error:
        read_bounded(slow, 1 << 20)
    assert isinstance(error.value, OSError) and error.value.errno == errno.ETIMEDOUT
    with pytest.raises(Unreadable, match=r"cannot read /sys/x: still answering after 5 s, given up"):
        read_text(slow, "/sys/x", 1 << 20)


@pytest.mark.parametrize("errors, expected", [("replace", "caf\ufffd\n"), ("surrogateescape", "caf\udce9\n")])
def test_text_is_decoded_as_its_format_says(tmp_path: Path, errors: str, expected: str) -> None:
    latin1 = tmp_path / "latin1"
    latin1.write_bytes(b"ok\ncaf\xe9\n")
    assert read_text(latin1, "/etc/x", 100, errors=errors) == "ok\n" + expected
    with pytest.raises(Unreadable, match=r"^cannot read /etc/x:2: not UTF-8 text \(byte 6\)$"):
        read_text(latin1, "/etc/x", 100)


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    (lambda p: p.mkdir(), "a directory"),
    (lambda p: os.mknod(p, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 5)), "a character device"),
])
def test_every_reader_refuses_what_is_not_a_file_without_blocking(tmp_path: Path, make: Any, kind: str) -> None:
    path = tmp_path / "odd"
    make(path)
    with pytest.raises(Unreadable, match=rf"^cannot read /x: it is {kind}, not a file$"):
        read_text(path, "/x", 100)
    with pytest.raises(NotRegular, match=kind):
        read_head(path, 10)


def test_read_head_reads_the_first_bytes_only(tmp_path: Path) -> None:
    path = tmp_path / "cmdline"
    path.write_bytes(b"/usr/bin/nvidia-persistenced\0--verbose\0" + b"x" * (1 << 20))
    assert read_head(path, 32) == b"/usr/bin/nvidia-persistenced\0--v"
    assert read_head(tmp_path / "missing", 32) is None
