"""Issue 35: an MPS control daemon's pid file is trusted only for the process the agent started (mps.identity).
The issue's reproduction: a pid file naming a live process the agent never started, whose name ("nvidia")
is a prefix of the binary's, was adopted, and terminate() sent it SIGTERM. Its variants: the control
binary itself run by someone else, a pid reused (another start time), the process the pid file named
before the agent's start, an MPS server or another unit under systemd, another user, and pid files that
are not one (a FIFO, a directory, a link, digits of other scripts, 5,000 digits). Then the daemon the agent
started: known by its binary and start time across agent restarts, and after a driver upgrade replaced the
binary under it. Real processes are looked at in the real /proc (the root's kernel trees are the running
kernel's); systemd's control groups in a /proc written for the test."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest

from gpu_agent.host.paths import Root
from gpu_agent.mps import identity
from gpu_agent.mps.control import DaemonSpec, HostMpsControl, SystemdUnits, pinned_mib, shown_limit
from gpu_agent.mps.layout import PID_FILE, pipe_dir, unit_name

SPEC = DaemonSpec("nvidia.com/gpu", ("GPU-a",), (0,), (81559,), 4)
BINARY = "/usr/bin/nvidia-cuda-mps-control"
# Blocks SIGTERM, so that a SIGTERM sent stays pending where /proc/PID/status shows it (ShdPnd), then waits.
WAITER = ("import signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); print('ready', flush=True); "
          "sys.stdin.read()")


class Processes:
    """Processes started for a test, ended with it."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def run(self, program: Path) -> subprocess.Popen[str]:
        """`program` (Python, under another name) running WAITER until the test ends."""
        child = subprocess.Popen([str(program), "-I", "-S", "-c", WAITER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        self.started.append(child)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        return child

    def close(self) -> None:
        for child in self.started:
            child.kill()
            child.wait()


@pytest.fixture
def processes() -> Iterator[Processes]:
    made = Processes()
    try:
        yield made
    finally:
        made.close()


def python_as(path: Path) -> Path:
    """This Python copied to `path`: a program that is that file, as the kernel names what a process runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(os.path.realpath(sys.executable), path)
    path.chmod(0o755)
    tried = subprocess.run([str(path), "-I", "-S", "-c", "pass"], capture_output=True, timeout=30)
    if tried.returncode != 0:
        pytest.skip(f"this Python does not run as a copy: {tried.stderr[-200:]!r}")
    return path


def sigterm_pending(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    pending = next(line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:"))
    return bool(int(pending, 16) & (1 << (signal.SIGTERM - 1)))


def write_pid_file(root: Path, text: str) -> Path:
    path = root / pipe_dir(SPEC.resource).lstrip("/") / PID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def on_this_kernel(tmp_path: Path, systemd: Optional[SystemdUnits] = None) -> HostMpsControl:
    """The agent's control over files under tmp_path, with the running kernel's /proc."""
    return HostMpsControl(Root(tmp_path, kernel=Path("/")), 5.0, systemd)


@pytest.mark.subprocess
@pytest.mark.host_paths
@pytest.mark.parametrize("what", ["a name prefix of the binary's", "the binary, started by someone else"])
def test_a_pid_file_naming_a_process_the_agent_did_not_start_is_not_adopted_nor_signalled(
        tmp_path: Path, processes: Processes, what: str) -> None:
    binary = python_as(tmp_path / BINARY.lstrip("/"))
    if what == "a name prefix of the binary's":  # its comm is "nvidia": the reproduction
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin/nvidia").symlink_to(os.path.realpath(sys.executable))
        child = processes.run(tmp_path / "bin/nvidia")
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "nvidia"
    else:
        child = processes.run(binary)
    write_pid_file(tmp_path, f"{child.pid}\n")
    control = on_this_kernel(tmp_path)
    assert control.pid(SPEC) is None  # not adopted: the resource's daemon is started
    control.terminate(SPEC)
    assert not sigterm_pending(child.pid) and child.poll() is None
    assert control.uses_shm(SPEC)  # nothing of it is read either
    assert not (tmp_path / identity.started_path(SPEC.resource).lstrip("/")).exists()  # nor recorded as ours


@pytest.mark.subprocess
@pytest.mark.host_paths
def test_the_daemon_the_agent_started_is_known_by_its_binary_and_start_time(tmp_path: Path,
                                                                          processes: Processes) -> None:
    binary = python_as(tmp_path / BINARY.lstrip("/"))
    root = Root(tmp_path, kernel=Path("/"))
    before = processes.run(binary)  # what the pid file names as the start comes: not the one started
    write_pid_file(tmp_path, f"{before.pid}\n")
    identity.expect_start(root, SPEC.resource, identity.process(root, before.pid))
    control = on_this_kernel(tmp_path)
    assert control.pid(SPEC) is None
    daemon = processes.run(binary)  # the daemon the start made writes its pid file
    write_pid_file(tmp_path, f"{daemon.pid}\n")
    assert control.pid(SPEC) == daemon.pid
    record = tmp_path / identity.started_path(SPEC.resource).lstrip("/")
    found = identity.process(root, daemon.pid)
    assert found is not None and record.read_text() == f"{daemon.pid} {found.start}\n"
    assert on_this_kernel(tmp_path).pid(SPEC) == daemon.pid  # an agent started again adopts it
    binary.unlink()  # a driver upgrade replaces the binary under the running daemon
    python_as(binary)
    assert os.readlink(f"/proc/{daemon.pid}/exe").endswith(" (deleted)") and control.pid(SPEC) == daemon.pid
    control.terminate(SPEC)
    assert sigterm_pending(daemon.pid) and not sigterm_pending(before.pid)
    record.write_text(f"{daemon.pid} {found.start + 1}\n")  # the pid's process started at another time: reused
    assert control.pid(SPEC) is None
    record.unlink()  # no record: nothing the agent started
    assert control.pid(SPEC) is None


def fake_binary(root: Path) -> Path:
    """An executable file where the control binary is looked for (the processes below are written, not run)."""
    path = root / BINARY.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def fake_process(root: Path, pid: int, exe: str, cgroup: str, start: int = 12345,
                 cmdline: tuple[str, ...] = ()) -> None:
    """/proc/PID as the kernel shows a process: its program, its arguments, its stat line, its control groups."""
    base = root / f"proc/{pid}"
    base.mkdir(parents=True)
    (base / "exe").symlink_to(exe)
    (base / "cmdline").write_bytes(b"".join(argument.encode() + b"\0" for argument in cmdline or (exe,)))
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 30  # field 3 on; field 22 the start time
    (base / "stat").write_text(f"{pid} (nvidia-cuda-mps) {' '.join(fields)}\n")
    (base / "cgroup").write_text(cgroup)


UNIT = f"/system.slice/system-gpu\\x2dagent\\x2dmps.slice/{unit_name(SPEC.resource)}"


@pytest.mark.parametrize("exe, cgroup, ours", [
    (BINARY, f"0::{UNIT}\n", True),
    (BINARY, f"12:pids:/system.slice\n1:name=systemd:{UNIT}\n0::/\n", True),  # cgroup v1 beside v2 (hybrid)
    (BINARY, "0::/user.slice/user-1000.slice/session-3.scope\n", False),  # someone's own copy
    (BINARY, "0::/system.slice/gpu-agent-mps@nvidia.com-other.service\n", False),  # another resource's daemon
    (BINARY, f"0::{UNIT}/sub\n", False),
    ("/usr/bin/nvidia-cuda-mps-server", f"0::{UNIT}\n", False),  # an MPS server the daemon forked
    (BINARY, "", False),
])
def test_under_systemd_the_daemon_is_the_binary_in_its_unit(tmp_path: Path, exe: str, cgroup: str,
                                                            ours: bool) -> None:
    fake_binary(tmp_path)
    fake_process(tmp_path, 4242, str(tmp_path / exe.lstrip("/")), cgroup)
    write_pid_file(tmp_path, "4242\n")
    control = HostMpsControl(Root(tmp_path), 5.0, SystemdUnits("/usr/bin/systemctl"))
    assert control.pid(SPEC) == (4242 if ours else None)


@pytest.mark.parametrize("cmdline, ours", [
    (("/bin/sh", BINARY, "--serve"), True),  # the kernel ran a script's interpreter: the script comes first
    (("/bin/sh", "-c", BINARY), False),  # a shell told to run it: the process it starts is another
    (("/bin/sh", "/usr/bin/nvidia-cuda-mps-server"), False),
    (("/bin/sh",), False),
])
def test_under_systemd_a_script_standing_in_for_the_binary_is_known_by_its_argument(
        tmp_path: Path, cmdline: tuple[str, ...], ours: bool) -> None:
    """Where the control binary is a script (make e2e's stand-in), the process runs its interpreter with the
    script's path as the first argument; the unit's control group still decides."""
    fake_binary(tmp_path)
    script = tuple(str(tmp_path / a.lstrip("/")) if a.startswith("/usr/") else a for a in cmdline)
    fake_process(tmp_path, 4242, "/usr/bin/dash", f"0::{UNIT}\n", cmdline=script)
    write_pid_file(tmp_path, "4242\n")
    control = HostMpsControl(Root(tmp_path), 5.0, SystemdUnits("/usr/bin/systemctl"))
    assert control.pid(SPEC) == (4242 if ours else None)


def test_a_process_of_another_user_is_not_the_daemon(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("making /proc/PID another user's needs root")
    fake_binary(tmp_path)
    fake_process(tmp_path, 4242, str(tmp_path / BINARY.lstrip("/")), f"0::{UNIT}\n")
    write_pid_file(tmp_path, "4242\n")
    control = HostMpsControl(Root(tmp_path), 5.0, SystemdUnits("/usr/bin/systemctl"))
    assert control.pid(SPEC) == 4242
    os.chown(tmp_path / "proc/4242", 65534, 65534, follow_symlinks=False)
    assert control.pid(SPEC) is None


@pytest.mark.parametrize("kind", ["fifo", "directory", "link", "arabic digits", "5000 digits", "negative", "empty",
                                  "no stat"])
def test_a_pid_file_that_holds_no_pid_of_a_process_is_none(tmp_path: Path, kind: str) -> None:
    fake_binary(tmp_path)
    fake_process(tmp_path, 123, str(tmp_path / BINARY.lstrip("/")), f"0::{UNIT}\n")
    path = write_pid_file(tmp_path, "123\n")
    control = HostMpsControl(Root(tmp_path), 5.0, SystemdUnits("/usr/bin/systemctl"))
    assert control.pid(SPEC) == 123
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # no writer ever comes: reading it must not wait for one
    elif kind == "directory":
        path.mkdir()
    elif kind == "link":
        (tmp_path / "elsewhere").write_text("123\n")
        path.symlink_to(tmp_path / "elsewhere")
    elif kind == "no stat":
        path.write_text("123\n")
        (tmp_path / "proc/123/stat").write_text("123 (x) S 1 2\n")
    else:
        path.write_text({"arabic digits": "\u0661\u0662\u0663\n", "5000 digits": "1" * 5000, "negative": "-123",
                         "empty": ""}[kind])
    assert control.pid(SPEC) is None


@pytest.mark.parametrize("value", ["9" * 5000 + "M", "\u0661G", " 1M", "1.5G", "M", "-1M", "0x10M"])
def test_a_pinned_limit_that_is_no_number_is_minus_one(value: str) -> None:
    assert pinned_mib(value) == -1 and shown_limit(value) == "-1M"


def test_a_pinned_limit_in_mib_or_gib() -> None:
    assert pinned_mib("20390M") == 20390 and pinned_mib("2g") == 2048 and shown_limit("20390M") == "19G"
