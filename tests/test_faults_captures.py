"""Hostile captures: a capture is data, and replaying one never touches anything outside --root.

The class: whatever a capture's parts say (links planted in the ld.so cache, in /dev or /sys, with
absolute or '../../..' targets; entries that are also another's directory; device numbers of other
devices) and whatever its directory holds instead of a part (a link, a FIFO, a device, a directory,
a huge file, a huge number), `--simulate CAPTURE check` ends with nothing outside the root changed
(a canary directory beside it compared byte for byte), a message naming the capture file, and no
traceback. Links the replay writes lead, as the OS follows them, to places under the root.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from gpu_agent.host.paths import Root, link_text, place
from harness import run_cli

CAPTURE = Path(__file__).resolve().parent / "data" / "captures" / "h100-580-vm"
LIB = "/usr/local/nvidia/lib64"


def snapshot(directory: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for path in sorted(directory.rglob("*")):
        info = os.lstat(path)
        key = str(path.relative_to(directory))
        if stat.S_ISLNK(info.st_mode):
            found[key] = ("link", os.readlink(path))
        elif stat.S_ISREG(info.st_mode):
            found[key] = ("file", path.read_bytes(), stat.S_IMODE(info.st_mode))
        else:
            found[key] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode))
    return found


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    """A directory outside the root, with a file, a subdirectory and a link to compare afterwards; not
    under /dev where `make test` keeps tmp_path on /dev/shm (a capture's libraries there are refused
    for being under /dev, before the escape these tests are about)."""
    if not tmp_path.is_relative_to("/dev"):
        yield from _canary(tmp_path / "canary")
        return
    outside = Path(tempfile.mkdtemp(prefix="canary-"))
    try:
        yield from _canary(outside / "canary")
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def _canary(directory: Path) -> Iterator[Path]:
    (directory / "lib64").mkdir(parents=True)
    (directory / "lib64" / "libcuda.so.1").write_text("the canary's own\n")
    (directory / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (directory / "link").symlink_to("passwd")
    yield directory


def edited(tmp_path: Path, part: str, edit: Callable[[Any], Any]) -> Path:
    directory = tmp_path / "capture"
    if not directory.exists():
        shutil.copytree(CAPTURE, directory)
    path = directory / part
    document = json.loads(path.read_text())
    result = edit(document)
    path.write_text(json.dumps(document if result is None else result))
    return directory


def check(tmp_path: Path, capture: Path) -> Any:
    result = run_cli("--simulate", str(capture), "check", root=tmp_path / "root")
    assert "Traceback" not in result.stderr + result.stdout
    assert "internal error" not in result.stderr + result.stdout
    return result


def assert_links_stay_under(root: Path) -> None:
    """Every link under the root leads, as the OS follows it, to a place under the root."""
    real = os.path.realpath(root)
    for path in root.rglob("*"):
        if path.is_symlink():
            assert os.path.realpath(path).startswith(real + os.sep), (path, os.readlink(path))


# --- links planted in the capture ------------------------------------------------------------------

def test_the_reported_ldcache_escape_is_refused_by_entry(tmp_path: Path, canary: Path) -> None:
    """The issue's reproduction: /opt linked out of the root, then libraries whose path goes through /opt."""
    before = snapshot(canary)
    capture = edited(tmp_path, "ldcache.json", lambda d: d.extend([
        {"key": "a", "path": "/opt", "flags": 771, "target": str(canary)},
        {"key": "libcuda.so.1", "path": "/opt/lib64/libcuda.so.1", "flags": 771, "target": "/opt/lib64/libx.so"},
        {"key": "b", "path": "/opt/passwd", "flags": 771, "target": "/opt/new/file"}]))
    result = check(tmp_path, capture)
    assert result.returncode == 1
    assert f"{capture}/ldcache.json: /opt: one entry of the capture, and the directory of another" in result.stderr
    assert snapshot(canary) == before


@pytest.mark.parametrize("target", ["/canary", "/canary/lib64", "/../../canary", "../../../../../../../../../canary"])
def test_a_library_link_to_anywhere_lands_under_the_root(tmp_path: Path, canary: Path, target: str) -> None:
    """Absolute: the target is read as in a chroot at the root, and the link written so that the OS reads it
    the same way. Relative, or not normalised: refused by entry."""
    target = target.replace("/canary", str(canary)) if target.startswith("/canary") else target
    before = snapshot(canary)
    capture = edited(tmp_path, "ldcache.json", lambda d: d.append(
        {"key": "libevil.so", "path": "/usr/lib/libevil.so", "flags": 771, "target": target}))
    result = check(tmp_path, capture)
    root = tmp_path / "root"
    if target.startswith(str(canary)):
        assert result.returncode in (0, 2), result.stderr
        assert os.path.realpath(root / "usr/lib/libevil.so") == str(root.resolve() / target.lstrip("/"))
    else:
        assert result.returncode == 1
        assert f"{capture}/ldcache.json: [10] target: " in result.stderr and "is not a normalised absolute path" \
            in result.stderr
    assert snapshot(canary) == before
    assert_links_stay_under(root)


@pytest.mark.parametrize("planted", ["absolute", "relative"])
def test_a_link_already_in_the_root_is_followed_under_it(tmp_path: Path, canary: Path, planted: str) -> None:
    """The sandbox root's own /usr/local/nvidia leads out of it (as the OS reads it): the replay's
    libraries under it go where a chroot would put them, and the canary is untouched."""
    root = tmp_path / "root"
    (root / "usr/local").mkdir(parents=True)
    text = str(canary) if planted == "absolute" else os.path.relpath(canary, root / "usr/local")
    (root / "usr/local/nvidia").symlink_to(text)
    before = snapshot(canary)
    result = check(tmp_path, CAPTURE)
    assert result.returncode in (0, 2), result.stderr
    assert snapshot(canary) == before
    if planted == "absolute":  # /usr/local/nvidia -> <canary> is <root>/<canary> in a chroot
        assert (root / str(canary).lstrip("/") / "lib64" / "libnvidia-ml.so.1").is_symlink()


@pytest.mark.parametrize("path, target", [
    ("/dev/char/195:0", "/canary/passwd"),
    ("/dev/char/195:0", "../../../../../../../../../../../canary/passwd"),
    ("/dev/nvidia-extra", "/canary"),
    ("/sys/bus/pci/devices/0000:00:06.0/driver", "../../../../../../../../../../../../../canary"),
    ("/sys/bus/pci/devices/0000:00:06.0/driver", "/canary"),
])
def test_a_kernel_link_to_anywhere_stays_in_the_simulated_kernel(tmp_path: Path, canary: Path, path: str,
                                                                 target: str) -> None:
    target = target.replace("/canary", str(canary))
    before = snapshot(canary)
    capture = edited(tmp_path, "links.json", lambda d: d.update({path: target}))
    result = check(tmp_path, capture)
    assert result.returncode in (0, 2), result.stderr
    result = check(tmp_path, capture)  # the kernel tree rendered again, over the links it holds
    assert snapshot(canary) == before
    assert_links_stay_under(tmp_path / "root")


def test_links_through_links_cannot_climb_out(tmp_path: Path, canary: Path) -> None:
    """A link to the tree's top, then one that goes down and back up through it more often than its
    text says: read as the kernel would (each '..' after a link from where the link leads)."""
    pci = "/sys/bus/pci/devices"
    climb = "../" * 12
    before = snapshot(canary)
    capture = edited(tmp_path, "links.json", lambda d: d.update({
        f"{pci}/top": "../../..", f"{pci}/0000:00:06.0/driver": f"../top/bus/pci/devices/top/{climb}{canary.name}"}))
    result = check(tmp_path, capture)
    assert result.returncode in (0, 2), result.stderr
    check(tmp_path, capture)
    assert snapshot(canary) == before
    assert_links_stay_under(tmp_path / "root")


@pytest.mark.parametrize("part, edit, message", [
    ("files.json", lambda d: d["files"].update({"/sys/module/nvidia/version/x": "1\n"}),
     r"files.json: /sys/module/nvidia/version: one entry of the capture, and the directory of another"),
    ("links.json", lambda d: d.update({"/sys/bus/pci/devices/0000:00:06.0": "../../../devices/x"}),
     r"one entry of the capture, and the directory of another"),
    ("ldcache.json", lambda d: d.append({"key": "x", "path": "/etc/os-release/x", "flags": 771, "target": "/x"}),
     r"files.json: /etc/os-release: one entry of the capture, and the directory of another"),
    ("links.json", lambda d: d.update({"/dev/nvidia-caps": "/tmp"}),
     r"links.json: /dev/nvidia-caps: one entry of the capture, and the directory of another"),
    ("devices.json", lambda d: d.append({"path": "/dev/nvidia-sda", "type": "char", "major": 8, "minor": 0,
                                         "mode": "0666", "uid": 0, "gid": 0}),
     r"devices.json: \[\d+\] major: .*major 8 is neither NVIDIA's"),
    ("devices.json", lambda d: d.append({"path": "/dev/nvidia-mem", "type": "char", "major": 1, "minor": 1,
                                         "mode": "0666", "uid": 0, "gid": 0}),
     r"major 1 is neither NVIDIA's"),
    ("devices.json", lambda d: d.append({"path": "/dev/nvidia-disk", "type": "block", "major": 240, "minor": 0,
                                         "mode": "0666", "uid": 0, "gid": 0}),
     r"devices.json: \[\d+\] type: "),
    ("ldcache.json", lambda d: d.append({"key": "x", "path": "/var", "flags": 771, "target": "/x"}),
     r"ldcache.json: \[\d+\] /var: cannot lay it out under the root: a directory is there"),
])
def test_a_capture_that_is_not_a_tree_of_nvidia_files_is_refused_by_file(tmp_path: Path, canary: Path, part: str,
                                                                        edit: Any, message: str) -> None:
    before = snapshot(canary)
    capture = edited(tmp_path, part, edit)
    result = check(tmp_path, capture)
    assert result.returncode == 1
    assert re.search(message, result.stderr), result.stderr
    assert str(capture) in result.stderr
    assert snapshot(canary) == before


# --- what the capture directory holds instead of a part --------------------------------------------

def _zero(directory: Path) -> Path:
    """/dev/zero's twin (1:5) beside the root: the test guard refuses opening the real one by its name."""
    zero = directory / "zero"
    if not zero.exists():
        os.mknod(zero, stat.S_IFCHR | 0o666, os.makedev(1, 5))
    return zero


def _replace(tmp_path: Path, part: str, make: Callable[[Path], None]) -> Path:
    directory = tmp_path / "capture"
    shutil.copytree(CAPTURE, directory)
    (directory / part).unlink()
    make(directory / part)
    return directory


@pytest.mark.parametrize("part", ["nvml.json", "files.json", "manifest.json"])
@pytest.mark.parametrize("kind, make, message", [
    ("symlink out", lambda p, c: p.symlink_to(c / "passwd"), "a symbolic link; a capture's parts are files"),
    ("symlink in", lambda p, c: p.symlink_to("ldcache.json"), "a symbolic link; a capture's parts are files"),
    ("a link to /dev/zero", lambda p, c: p.symlink_to(_zero(c.parent)), "a symbolic link; a capture's parts are files"),
    ("fifo", lambda p, c: os.mkfifo(p), "a FIFO, not a file"),
    ("device", lambda p, c: os.mknod(p, stat.S_IFCHR | 0o600, os.makedev(1, 5)), "a character device, not a file"),
    ("directory", lambda p, c: p.mkdir(), "a directory, not a file"),
])
def test_a_part_that_is_not_a_regular_file_is_refused_without_reading_it(
        tmp_path: Path, canary: Path, part: str, kind: str, make: Any, message: str) -> None:
    before = snapshot(canary)
    capture = _replace(tmp_path, part, lambda p: make(p, canary))
    outcome: list[Any] = []
    worker = threading.Thread(target=lambda: outcome.append(check(tmp_path, capture)), daemon=True)
    worker.start()
    worker.join(8)  # a FIFO opened for reading without O_NONBLOCK would block here for good
    assert outcome, f"check on a capture whose {part} is {kind} did not finish"
    result = outcome[0]
    assert result.returncode == 1
    if part == "manifest.json" and kind == "directory":
        assert "manifest.json" in result.stderr
    else:
        assert f"{capture / part}: {message}" in result.stderr, result.stderr
    assert snapshot(canary) == before


def test_a_huge_part_or_a_huge_number_is_refused_by_file(tmp_path: Path) -> None:
    capture = edited(tmp_path, "nvml.json", lambda d: d)
    text = (capture / "nvml.json").read_text()
    (capture / "nvml.json").write_text(text.replace('"ok": 1', '"ok": ' + "9" * 5000, 1))
    result = check(tmp_path, capture)
    assert result.returncode == 1
    assert re.search(rf"{re.escape(str(capture))}/nvml.json: an integer of 50\d\d digits \(at most 40\)", result.stderr)
    with open(capture / "files.json", "r+b") as handle:
        handle.truncate(17 << 20)  # sparse
    assert "files.json: larger than 16 MiB" in check(tmp_path, capture).stderr


# --- the building blocks -----------------------------------------------------------------------------

def test_place_and_link_text_keep_every_link_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a/b").mkdir(parents=True)
    (root / "up").symlink_to("../../../../..")
    (root / "abs").symlink_to("/a")
    sandbox = Root(root)
    assert place(sandbox, "/abs/b/x") == "/a/b/x"
    assert place(sandbox, "/up/up/a") == "/a"  # '..' above '/' stays at '/'
    assert link_text(sandbox, "/a/b/l", "/etc/passwd") == "../../etc/passwd"
    assert link_text(sandbox, "/a/b/l", "../../../../../../x") == "../../x"
    assert link_text(sandbox, "/a/b/l", "/up/abs/b") == "."
    with pytest.raises(ValueError):
        place(sandbox, "/")
