"""gpu_agent.host.proc: what a command prints is bounded, its whole process group is killed at the
timeout, a child it leaves holding the output does not hold the agent until the timeout, and a
program that is not root's is refused (host/trusted.py). Real processes: `sh`, `cat`, `sleep`."""
from __future__ import annotations

import os
import re
import stat
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root
from gpu_agent.host.trusted import check_executable
from gpu_agent.toolkit.versions import BINARIES, Versions

pytestmark = [pytest.mark.subprocess, pytest.mark.host_paths]  # host_paths: /proc/PID/stat of the children
LONG = 120.0  # a timeout no command here reaches unless the agent waits for what it should not


def gone(pid: int) -> bool:
    """Whether `pid` exits (a zombie not yet reaped by its new parent counts) within LONG seconds: a
    SIGKILL is delivered when the process next runs, not when kill(2) returns."""
    deadline = time.monotonic() + LONG
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def pid_in(path: Path) -> int:
    return int(path.read_text().split()[0])


@pytest.mark.parametrize("script", [
    "yes",  # on stdout
    "yes >&2",  # on stderr
    "head -c 3000000 /dev/zero; sleep 300",  # a burst, then it lingers
    "while :; do printf '%01000d\\n' 0; done",  # a line at a time
])
def test_a_command_that_floods_its_output_is_killed_at_the_limit(script: str) -> None:
    with pytest.raises(AgentError, match=r"wrote more than 65536 bytes of output and was killed$"):
        proc.run(["sh", "-c", script], timeout=LONG, limit=64 << 10)


def test_a_child_left_holding_the_output_is_killed_and_does_not_hold_the_agent(tmp_path: Path) -> None:
    """A wrapper that starts a daemon in the background and prints its version: the daemon inherits
    stdout, so reading to the end of it waited for the whole timeout, and the daemon stayed."""
    pid_file = tmp_path / "pid"
    done = proc.run(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; echo 'tool version 1.2.3'"], timeout=LONG)
    assert (done.returncode, done.stdout) == (0, "tool version 1.2.3\n")
    assert gone(pid_in(pid_file))


def test_at_the_timeout_the_whole_group_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(AgentError, match=r"did not finish within 0.5 s and was killed$"):
        proc.run(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; sleep 300"], timeout=0.5)
    assert gone(pid_in(pid_file))


def test_output_that_is_not_utf8_is_decoded_with_replacements() -> None:
    done = proc.run(["sh", "-c", r"printf 'caf\351 version 1.2.3\n'; printf '\377\376' >&2"], timeout=LONG)
    assert (done.stdout, done.stderr) == ("caf\ufffd version 1.2.3\n", "\ufffd\ufffd")


def test_input_larger_than_a_pipe_is_fed_while_output_is_read() -> None:
    given = os.urandom(1 << 20)
    returncode, out, err = proc.run_bytes(["cat"], timeout=LONG, given=given, limit=2 << 20)
    assert (returncode, out, err) == (0, given, b"")


def test_a_command_that_closes_its_input_early_is_not_an_error() -> None:
    returncode, out, _ = proc.run_bytes(["sh", "-c", "exec 0<&-; echo done"], timeout=LONG, given=b"x" * (1 << 20))
    assert (returncode, out) == (0, b"done\n")


def test_a_missing_program_is_named() -> None:
    with pytest.raises(AgentError, match=r"^cannot run /nonexistent/tool: not installed or not on PATH$"):
        proc.run(["/nonexistent/tool", "--version"], timeout=LONG)


# --- programs run as root must be root's ----------------------------------------------------------------

def tool(directory: Path, mode: int = 0o755, owner: Optional[int] = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tool"
    path.write_text("#!/bin/sh\necho 'tool version 1.2.3'\n")
    path.chmod(mode)
    if owner is not None:
        os.chown(path, owner, -1)
    return path


@pytest.mark.parametrize("mode, said", [
    (0o777, "it is writable by everyone (mode 0777)"),
    (0o757, "it is writable by everyone (mode 0757)"),
])
def test_a_program_others_can_change_is_refused_naming_it(tmp_path: Path, mode: int, said: str) -> None:
    path = tool(tmp_path / "bin", mode)
    with pytest.raises(AgentError, match=f"^{re.escape(f'refusing to run {path}: {said}; only root')}"):
        proc.run([str(path), "--version"], timeout=LONG)


def test_a_program_writable_by_a_group_other_than_root_is_refused(tmp_path: Path) -> None:
    path = tool(tmp_path / "bin", 0o775)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file another group")
    os.chown(path, -1, 50)  # Debian's staff
    with pytest.raises(AgentError, match=r"it is writable by its group \(gid 50, mode 0775\)"):
        check_executable(str(path))
    os.chown(path, -1, 0)
    check_executable(str(path))  # the root group's: fine


def test_a_program_another_user_owns_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    path = tool(tmp_path / "bin", owner=1000)
    with pytest.raises(AgentError, match=rf"^refusing to run {path}: it is owned by uid 1000, not root"):
        proc.run([str(path)], timeout=LONG)


def test_a_directory_others_can_write_is_refused_and_a_sticky_one_is_not(tmp_path: Path) -> None:
    path = tool(tmp_path / "open" / "bin")
    (tmp_path / "open").chmod(0o777)
    with pytest.raises(AgentError, match=rf"its directory {tmp_path / 'open'} is writable by everyone \(mode 0777\)"):
        check_executable(str(path))
    (tmp_path / "open").chmod(0o777 | stat.S_ISVTX)
    if os.stat(tmp_path / "open").st_uid == 0:
        check_executable(str(path))


def test_a_program_found_on_path_is_checked_where_it_is_found_through_links(tmp_path: Path) -> None:
    real = tool(tmp_path / "real", 0o777)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").symlink_to(real)
    with pytest.raises(AgentError, match=rf"^refusing to run nvidia-smi \({real}\): it is writable by everyone"):
        proc.run(["nvidia-smi", "-L"], timeout=LONG, env={"PATH": str(tmp_path / "bin")})
    check_executable(sys.executable)  # this Python, and where it is installed, pass


# --- a runtime's --version, as Versions runs it on the running system ----------------------------------

@pytest.fixture
def running_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Root that says it is the running system, whose binaries live under tmp_path."""
    monkeypatch.setattr(Root, "is_running_system", property(lambda self: True))
    return tmp_path


@pytest.mark.parametrize("script, said", [
    ("yes 'containerd 1.7.24'", "wrote more than 65536 bytes of output and was killed"),
    ("printf 'containerd \\377\\376 1.7.24\\n'", None),
    ("sleep 300 & echo 'containerd 1.7.24'", None),
    ("printf 'containerd %05000d.1\\n' 9", "--version told no version"),
])
def test_a_runtime_whose_version_misbehaves_gives_a_version_or_the_reason(running_system: Path, script: str,
                                                                         said: Optional[str]) -> None:
    binary = running_system / BINARIES["containerd"][0].lstrip("/")
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!/bin/sh\n{script}\n")
    binary.chmod(0o755)
    version, source = Versions(Root(running_system), timeout=LONG).read("containerd")
    if said is None:
        assert (version, source) == ("1.7.24", "/usr/bin/containerd --version")
    else:
        assert version is None and said in source
