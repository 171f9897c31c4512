"""Subprocesses: always an argv list, always a timeout, never a shell; what they print is bounded.

Each command runs in a process group of its own. Its output is read as it comes, at most `limit`
bytes a stream: a command that prints more is killed, group and all, and is an error naming the
limit, so a wrapper that floods its output costs the daemon `limit` bytes, not a gigabyte a second.
At the timeout the whole group is killed. When the command itself has exited, what it left behind
in its group (a child it started in the background, still holding the output pipe) is killed too,
after at most LINGER_S, instead of the agent waiting for the pipe to close until the timeout. A
child that made a session of its own is out of reach of the group; the agent stops reading it all
the same.

A program run as root by its path (or found on PATH) must be root's: owned by root and writable by
no one else, or the agent refuses to run it, naming the file (host/trusted.py).
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.trusted import check_executable

MAX_OUTPUT_BYTES = 4 << 20  # a stream; `containerd config dump` of a 1 MiB config is the largest expected
LINGER_S = 1.0  # how long output is still read once the command has exited
POLL_S = 0.05  # where no pidfd says when the command exits, how often to look
_CHUNK = 64 << 10


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stderr and stdout, trimmed: what a person wants to read when the command failed."""
        return " ".join(part.strip() for part in (self.stderr, self.stdout) if part.strip())


def run(argv: Sequence[str], timeout: float, env: Optional[Mapping[str, str]] = None,
        limit: int = MAX_OUTPUT_BYTES) -> Completed:
    """Run `argv`; a missing or untrusted program, a timeout or more than `limit` bytes on stdout or
    stderr raises AgentError; a non-zero exit is returned. `env` adds to this process's environment.
    Output that is not UTF-8 is decoded with replacement characters."""
    argv = tuple(argv)
    returncode, out, err = run_bytes(argv, timeout, env=env, limit=limit)
    return Completed(argv, returncode, out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace"))


def run_bytes(argv: Sequence[str], timeout: float, env: Optional[Mapping[str, str]] = None,
              limit: int = MAX_OUTPUT_BYTES, given: bytes = b"") -> tuple[int, bytes, bytes]:
    """run(), with `given` on its standard input: (exit status, stdout, stderr) as bytes."""
    argv = tuple(argv)
    check_executable(argv[0], env)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.PIPE if given else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                 env={**os.environ, **env} if env else None)
    except FileNotFoundError:
        raise AgentError(f"cannot run {argv[0]}: not installed or not on PATH") from None
    except OSError as exc:
        raise AgentError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    try:
        out, err, problem = _collect(child, given, time.monotonic() + timeout, limit)
    finally:
        _kill_group(child)  # before the leader is reaped: its id cannot name another group meanwhile
        child.wait()
        for pipe in (child.stdin, child.stdout, child.stderr):
            if pipe is not None:
                pipe.close()
    if problem == "timeout":
        raise AgentError(f"{' '.join(argv)} did not finish within {timeout:g} s and was killed")
    if problem == "flood":
        raise AgentError(f"{' '.join(argv)} wrote more than {limit} bytes of output and was killed")
    assert child.returncode is not None
    return child.returncode, out, err


def _collect(child: subprocess.Popen[bytes], given: bytes, deadline: float,
             limit: int) -> tuple[bytes, bytes, Optional[str]]:
    """What the child writes until it has exited and both pipes are closed, or LINGER_S after it
    exited; with "timeout" or "flood" when it was cut off for that."""
    assert child.stdout is not None and child.stderr is not None
    streams = {child.stdout.fileno(): bytearray(), child.stderr.fileno(): bytearray()}
    exit_fd = _pidfd(child.pid)  # readable once the child has exited; None: looked at every POLL_S
    left = memoryview(given)
    with selectors.DefaultSelector() as selector:
        for fd in streams:
            selector.register(fd, selectors.EVENT_READ)
        if exit_fd is not None:
            selector.register(exit_fd, selectors.EVENT_READ)
        if child.stdin is not None:
            os.set_blocking(child.stdin.fileno(), False)
            selector.register(child.stdin.fileno(), selectors.EVENT_WRITE)
        exited_at: Optional[float] = None
        try:
            while True:
                now = time.monotonic()
                if exited_at is None and _exited(child.pid):
                    exited_at = now
                reading = any(fd in selector.get_map() for fd in streams)
                if exited_at is not None and (not reading or now >= exited_at + LINGER_S):
                    break  # what still holds a pipe is killed with the group, or is in a session of its own
                if now >= deadline:
                    return b"", b"", "timeout"
                wake = deadline if exited_at is None else min(deadline, exited_at + LINGER_S)
                if exited_at is None and exit_fd is None:
                    wake = min(wake, now + POLL_S)
                for key, _ in selector.select(max(wake - now, 0.0)):
                    if key.fd == exit_fd:
                        selector.unregister(exit_fd)  # _exited() says so at the top of the loop
                    elif key.fd in streams:
                        chunk = os.read(key.fd, _CHUNK)
                        if not chunk:
                            selector.unregister(key.fd)
                        elif len(streams[key.fd]) + len(chunk) > limit:
                            return b"", b"", "flood"
                        else:
                            streams[key.fd] += chunk
                    else:
                        left = _feed(child, left, selector)
        finally:
            if exit_fd is not None:
                os.close(exit_fd)
    return bytes(streams[child.stdout.fileno()]), bytes(streams[child.stderr.fileno()]), None


def _feed(child: subprocess.Popen[bytes], left: memoryview, selector: selectors.BaseSelector) -> memoryview:
    """Write what the child's stdin takes of `left`; once all is written (or the child closed its end),
    close it."""
    assert child.stdin is not None
    try:
        left = left[os.write(child.stdin.fileno(), left[:_CHUNK]):]
    except BlockingIOError:
        return left
    except BrokenPipeError:
        left = left[:0]
    if not left:
        selector.unregister(child.stdin.fileno())
        child.stdin.close()
    return left


def _pidfd(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux before 5.3, or a seccomp filter that refuses it
        return None


def _exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its process group stays its own meanwhile)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in it
