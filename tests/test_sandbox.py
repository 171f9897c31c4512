"""A directory that appeared after the agent started, read-only in its systemd sandbox (EROFS simulated):
what a write says, the one restart asked for under systemd, and never a second one for the same directory."""
from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Iterator

import pytest

from gpu_agent.host import files, sandbox
from gpu_agent.host.paths import Root
from gpu_agent.host.sandbox import RESTARTED, Sandbox

CONTAINERD = "/etc/containerd"
APPEARED = ("/etc/containerd appeared after gpu-agent started and is read-only in its sandbox (ProtectSystem=strict): "
            "restarting so that systemd makes it writable")


@pytest.fixture
def read_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[Path]]:
    """Directories that refuse writes with EROFS, as a read-only mount does (to root too)."""
    refusing: set[Path] = set()
    mkstemp, mkdir = files.tempfile.mkstemp, Path.mkdir

    def refused(path: Path) -> bool:
        return any(path == d or d in path.parents for d in refusing)

    def make_temp(dir: str, **kwargs: str) -> tuple[int, str]:
        if refused(Path(dir)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), f"{dir}/.x.tmp")
        return mkstemp(dir=dir, **kwargs)

    def make_directory(self: Path, mode: int = 0o777, parents: bool = False, exist_ok: bool = False) -> None:
        if not self.exists() and refused(self.parent):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        mkdir(self, mode, parents, exist_ok)

    monkeypatch.setattr(files.tempfile, "mkstemp", make_temp)
    monkeypatch.setattr(Path, "mkdir", make_directory)
    # access(2) on a read-only mount, or below one, says EROFS
    monkeypatch.setattr(sandbox, "_writable", lambda path: not refused(path) and os.access(path, os.W_OK))
    yield refusing
    sandbox.install(None)


def _under_systemd(root: Path, restarts: list[str]) -> Sandbox:
    jail = Sandbox(Root(root), systemd=True, restart=lambda: restarts.append("restart"))
    sandbox.install(jail)
    return jail


def test_a_directory_that_appeared_restarts_the_agent_once_and_says_why(
        tmp_path: Path, read_only: set[Path], caplog: pytest.LogCaptureFixture) -> None:
    restarts: list[str] = []
    _under_systemd(tmp_path, restarts)
    (tmp_path / "etc/containerd").mkdir(parents=True)  # after the start
    read_only.add(tmp_path / "etc/containerd")
    with caplog.at_level(logging.WARNING, "gpu_agent.host.sandbox"):
        for _ in range(2):  # a second write in the same pass: no second restart, no second line
            with pytest.raises(OSError) as raised:
                files.atomic_write(tmp_path / "etc/containerd/config.toml", "version = 2\n")
            assert raised.value.errno == errno.EROFS and raised.value.strerror == sandbox.RESTARTING
            assert raised.value.filename == str(tmp_path / "etc/containerd/config.toml")
    assert restarts == ["restart"]
    assert [record.getMessage() for record in caplog.records] == [APPEARED]
    assert (tmp_path / RESTARTED.lstrip("/")).read_text() == f"{CONTAINERD}\n"
    assert not list((tmp_path / "etc/containerd").iterdir())


def test_still_read_only_after_the_restart_fails_the_write_and_restarts_no_more(
        tmp_path: Path, read_only: set[Path]) -> None:
    """The restart did not help (a read-only mount): the marker in /run/gpu-agent says the agent restarted for
    it, so the next run reports the write as failed instead of exiting again."""
    first: list[str] = []
    _under_systemd(tmp_path, first)
    (tmp_path / "etc/containerd").mkdir(parents=True)
    read_only.add(tmp_path / "etc/containerd")
    with pytest.raises(OSError):
        files.atomic_write(tmp_path / "etc/containerd/config.toml", "")
    again: list[str] = []
    _under_systemd(tmp_path, again)  # the agent as systemd starts it again
    with pytest.raises(OSError) as raised:
        files.atomic_write(tmp_path / "etc/containerd/config.toml", "")
    assert first == ["restart"] and again == []
    assert raised.value.strerror == (
        "/etc/containerd is read-only to gpu-agent (EROFS) although gpu-agent restarted to make it writable: a "
        "read-only mount, or a gpu-agent.service without ReadWritePaths=-/etc/containerd; not restarting again")


def test_a_restart_that_helped_is_forgotten_so_the_next_appearance_restarts_again(
        tmp_path: Path, read_only: set[Path]) -> None:
    marker = tmp_path / RESTARTED.lstrip("/")
    marker.parent.mkdir(parents=True)
    marker.write_text("/etc/containerd\n/var/lib/kubelet/device-plugins\n/etc/passwd\n")
    (tmp_path / "etc/containerd").mkdir(parents=True)  # writable now: the restart helped
    restarts: list[str] = []
    _under_systemd(tmp_path, restarts)  # the kubelet's directory gone, /etc/passwd none of the unit's
    assert not marker.exists()
    (tmp_path / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    read_only.add(tmp_path / "var/lib/kubelet/device-plugins")
    reason = sandbox.current().read_only(tmp_path / "var/lib/kubelet/device-plugins/nvidia-gpu.sock")
    assert reason == sandbox.RESTARTING
    assert restarts == ["restart"] and marker.read_text() == "/var/lib/kubelet/device-plugins\n"


def test_without_systemd_the_write_names_the_directory_and_erofs(tmp_path: Path, read_only: set[Path]) -> None:
    (tmp_path / "var/run/cdi").mkdir(parents=True)
    read_only.add(tmp_path / "var/run/cdi")
    sandbox.install(Sandbox(Root(tmp_path)))
    with pytest.raises(OSError) as raised:
        files.atomic_write(tmp_path / "var/run/cdi/nvidia.yaml", "")
    assert raised.value.strerror == "/var/run/cdi is on a read-only file system (EROFS)"
    assert not (tmp_path / RESTARTED.lstrip("/")).exists()


def test_a_directory_still_missing_is_not_restarted_for(tmp_path: Path, read_only: set[Path]) -> None:
    """systemd skips a ReadWritePaths=-... that does not exist: a restart would leave it read-only again."""
    (tmp_path / "etc").mkdir()
    read_only.add(tmp_path / "etc")
    restarts: list[str] = []
    _under_systemd(tmp_path, restarts)
    with pytest.raises(OSError) as raised:
        files.atomic_write(tmp_path / "etc/cdi/nvidia.yaml", "")
    assert restarts == []
    assert raised.value.strerror == (
        "read-only in gpu-agent's sandbox (EROFS): /etc/cdi did not exist when gpu-agent started, and its unit "
        "makes only existing directories writable; create it (mkdir -p /etc/cdi) and gpu-agent restarts to write "
        "there")


def test_a_marker_that_cannot_be_written_means_no_restart(tmp_path: Path, read_only: set[Path]) -> None:
    (tmp_path / "run/gpu-agent").mkdir(parents=True)
    restarts: list[str] = []
    jail = _under_systemd(tmp_path, restarts)
    (tmp_path / "etc/containerd").mkdir(parents=True)
    read_only.update({tmp_path / "etc/containerd", tmp_path / "run/gpu-agent"})
    reason = jail.read_only(tmp_path / "etc/containerd/config.toml")
    assert restarts == []
    assert reason.startswith(APPEARED.split(": restarting")[0] + ": restart gpu-agent to make it writable")
    assert "cannot record a restart of its own in /run/gpu-agent/restarted-for" in reason


def test_late_writable_takes_the_innermost_directory_and_var_run() -> None:
    assert sandbox.late_writable("/etc/containerd/conf.d/99-nvidia.toml") == CONTAINERD
    assert sandbox.late_writable("/var/run/cdi/nvidia.yaml") == "/run/cdi"
    assert sandbox.late_writable("/etc/containerd-other/x") is None
    assert sandbox.late_writable("/var/lib/gpu-agent/ledger.json") is None


def test_a_marker_that_cannot_be_updated_at_start_is_only_warned_about(
        tmp_path: Path, read_only: set[Path], caplog: pytest.LogCaptureFixture) -> None:
    marker = tmp_path / RESTARTED.lstrip("/")
    marker.parent.mkdir(parents=True)
    marker.write_text("/etc/containerd\n/etc/docker\n")  # docker's gone now: to be forgotten
    (tmp_path / "etc/containerd").mkdir(parents=True)
    read_only.update({marker.parent, tmp_path / "etc/containerd"})
    with caplog.at_level(logging.WARNING, "gpu_agent.host.sandbox"):
        jail = _under_systemd(tmp_path, [])
    assert marker.read_text() == "/etc/containerd\n/etc/docker\n"
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"cannot update {RESTARTED}: ") and warning.endswith("(EROFS)")
    assert "although gpu-agent restarted" in jail.read_only(tmp_path / "etc/containerd/config.toml")


# --- a read-only mount below a directory the unit makes writable ------------------------------------------


def test_a_read_only_mount_below_a_directory_there_at_start_restarts_nothing_and_names_itself(
        tmp_path: Path, read_only: set[Path], caplog: pytest.LogCaptureFixture) -> None:
    """/etc/containerd was there when the agent started (the unit made it writable), its conf.d is a read-only
    mount: a restart cannot help. Before, the agent exited 75 saying /etc/containerd "appeared after
    gpu-agent started"."""
    (tmp_path / "etc/containerd/conf.d").mkdir(parents=True)
    restarts: list[str] = []
    _under_systemd(tmp_path, restarts)
    read_only.add(tmp_path / "etc/containerd/conf.d")
    with caplog.at_level(logging.WARNING, "gpu_agent.host.sandbox"), pytest.raises(OSError) as raised:
        files.atomic_write(tmp_path / "etc/containerd/conf.d/sub/99-nvidia.toml", "")  # its folder made first
    assert restarts == [] and caplog.records == []
    assert raised.value.strerror == (
        "/etc/containerd/conf.d is read-only to gpu-agent (EROFS) although /etc/containerd was there when gpu-agent "
        "started, so its unit made it writable: a read-only mount, or a gpu-agent.service without "
        "ReadWritePaths=-/etc/containerd; a restart would not change that (if /etc/containerd was made as "
        "gpu-agent started, `systemctl restart gpu-agent`)")
    assert not (tmp_path / RESTARTED.lstrip("/")).exists()
    writable = tmp_path / "etc/containerd/config.toml"
    files.atomic_write(writable, "version = 2\n")  # beside the mount, the directory is writable
    assert writable.read_text() == "version = 2\n"


@pytest.mark.parametrize("mounted", ["/etc/containerd/conf.d", "/var/lib/kubelet/device-plugins/sub"])
def test_a_read_only_mount_below_a_directory_that_appeared_restarts_once_and_never_loops(
        mounted: str, tmp_path: Path, read_only: set[Path]) -> None:
    """The issue's loop: the directory appeared after the start with a read-only mount below it. The restart
    is asked for once, the marker names where the write failed, and every start after it (the directory
    there now, the mount read-only still: access(2) tested there, not at the top directory, which is
    writable) reports the write instead of exiting 75 again. Before, each start forgot the marker (the top
    directory was writable) and restarted: forever."""
    top = sandbox.late_writable(mounted)
    assert top is not None
    restarts: list[str] = []
    jail = _under_systemd(tmp_path, restarts)
    (tmp_path / mounted.lstrip("/")).mkdir(parents=True)
    read_only.add(tmp_path / mounted.lstrip("/"))
    target = tmp_path / mounted.lstrip("/") / "nvidia.sock"
    assert jail.read_only(target) == sandbox.RESTARTING
    marker = tmp_path / RESTARTED.lstrip("/")
    assert marker.read_text() == f"{mounted}\n"
    for _ in range(5):  # systemd starts it again, and again
        reason = _under_systemd(tmp_path, restarts).read_only(target)
        assert reason == (f"{mounted} is read-only to gpu-agent (EROFS) although gpu-agent restarted to make it "
                          f"writable: a read-only mount, or a gpu-agent.service without ReadWritePaths=-{top}; not "
                          "restarting again")
        assert marker.read_text() == f"{mounted}\n"
    assert restarts == ["restart"]


def test_the_marker_forgets_a_mount_that_became_writable_or_went(tmp_path: Path, read_only: set[Path]) -> None:
    marker = tmp_path / RESTARTED.lstrip("/")
    marker.parent.mkdir(parents=True)
    marker.write_text("/etc/containerd/conf.d\n/etc/cdi/gone\n/etc/docker/ro\n")
    for kept in ("etc/containerd/conf.d", "etc/docker/ro"):
        (tmp_path / kept).mkdir(parents=True)
    read_only.add(tmp_path / "etc/docker/ro")  # still read-only: kept; the others are forgotten
    _under_systemd(tmp_path, [])
    assert marker.read_text() == "/etc/docker/ro\n"
