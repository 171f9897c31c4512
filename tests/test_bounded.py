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
