"""The simulated kernel's trees lose what is not wanted at every render, though a render lists only the
directories that changed since the last one (gpu_agent/sim/listing.py)."""
from __future__ import annotations

import os
from pathlib import Path

from gpu_agent.sim import listing

WANTED = {"bus/pci/devices/a", "bus/pci/devices/b", "class/x"}
DIRS = {"bus", "bus/pci", "bus/pci/devices", "class"}


def tree(path: Path) -> str:
    for relative in WANTED:
        (path / relative).parent.mkdir(parents=True, exist_ok=True)
        (path / relative).write_text("x")
    listing.remember(str(path), WANTED, DIRS)
    return str(path)


def entries(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


def test_a_file_someone_added_right_after_the_render_goes_at_the_next(tmp_path: Path) -> None:
    root = tree(tmp_path / "sys")
    (tmp_path / "sys/bus/pci/devices/stray").write_text("y")  # in the same timestamp tick as the render
    (tmp_path / "sys/extra").mkdir()
    listing.remove_unwanted(root, WANTED, DIRS)
    assert entries(tmp_path / "sys") == WANTED | DIRS


def test_a_file_added_long_after_a_render_goes_too(tmp_path: Path) -> None:
    root = tree(tmp_path / "sys")
    old = (os.stat(root).st_mtime_ns - 10**9) / 1e9
    for directory in ["", *DIRS]:  # as if the render were a second ago: its stamps are kept
        os.utime(os.path.join(root, directory), (old, old))
    listing.remember(root, WANTED, DIRS)
    (tmp_path / "sys/class/stray").write_text("y")
    listing.remove_unwanted(root, WANTED, DIRS)
    assert entries(tmp_path / "sys") == WANTED | DIRS


def test_what_a_render_stops_wanting_goes_by_name(tmp_path: Path) -> None:
    root = tree(tmp_path / "sys")
    listing.remove_unwanted(root, WANTED - {"bus/pci/devices/b", "class/x"}, DIRS - {"class"})
    assert entries(tmp_path / "sys") == WANTED - {"bus/pci/devices/b", "class/x"} | DIRS - {"class"}


def test_a_directory_replaced_by_a_link_out_of_the_tree_is_removed_not_followed(tmp_path: Path) -> None:
    root = tree(tmp_path / "sys")
    outside = tmp_path / "outside"
    (outside / "devices").mkdir(parents=True)
    (outside / "devices" / "precious").write_text("keep")
    os.rename(tmp_path / "sys/bus/pci", tmp_path / "pci-moved")
    os.symlink(outside, tmp_path / "sys/bus/pci")
    listing.remove_unwanted(root, WANTED, DIRS)
    assert (outside / "devices" / "precious").read_text() == "keep"
    assert not (tmp_path / "sys/bus/pci").exists()


def test_a_tree_made_anew_is_listed_in_full(tmp_path: Path) -> None:
    root = tree(tmp_path / "sys")
    os.rename(root, tmp_path / "old")
    os.makedirs(tmp_path / "sys/bus/pci/devices")
    (tmp_path / "sys/bus/pci/devices/stray").write_text("y")
    listing.remove_unwanted(root, WANTED, DIRS)
    assert entries(tmp_path / "sys") == DIRS - {"class"}
