"""gpu_agent.host.bounded: one bounded reader of regular files for every caller."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded, read_bounded_file


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
