"""Subprocesses: always an argv list, always a timeout, never a shell."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Optional

from gpu_agent.errors import AgentError


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


def run(argv: Sequence[str], timeout: float, env: Optional[Mapping[str, str]] = None) -> Completed:
    """Run `argv`; a missing program or a timeout raises AgentError, a non-zero exit is returned.
    `env` adds to this process's environment."""
    argv = tuple(argv)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL, env={**os.environ, **env} if env else None)
    except FileNotFoundError:
        raise AgentError(f"cannot run {argv[0]}: not installed or not on PATH") from None
    except subprocess.TimeoutExpired:
        raise AgentError(f"{' '.join(argv)} did not finish within {timeout:g} s and was killed") from None
    return Completed(argv, done.returncode, done.stdout, done.stderr)


class Started:
    """A process `start` began, running beside this one: `wait` collects it."""

    def __init__(self, argv: tuple[str, ...], timeout: float, process: subprocess.Popen[str]) -> None:
        self.argv, self.timeout, self.process = argv, timeout, process
        self.deadline = time.monotonic() + timeout

    def wait(self) -> Completed:
        """Its outcome; past the timeout given to `start` (counted from the start) it is killed and
        AgentError raised."""
        try:
            stdout, stderr = self.process.communicate(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            raise AgentError(f"{' '.join(self.argv)} did not finish within {self.timeout:g} s and was killed") \
                from None
        return Completed(self.argv, self.process.returncode, stdout, stderr)


def start(argv: Sequence[str], timeout: float, env: Optional[Mapping[str, str]] = None) -> Started:
    """Start `argv` and return at once (run() waits): this process goes on while it runs. `env`: variables
    set for it on top of this process's environment."""
    argv = tuple(argv)
    try:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env={**os.environ, **env} if env else None)
    except FileNotFoundError:
        raise AgentError(f"cannot run {argv[0]}: not installed or not on PATH") from None
    return Started(argv, timeout, process)


class Forked:
    """A forked child computing one answer: `wait` collects it as a Completed (its exit status and
    what it wrote), or raises AgentError past the timeout (it is killed)."""

    def __init__(self, name: str, timeout: float, pid: int, reader: int) -> None:
        self.name, self.timeout, self.pid, self.reader = name, timeout, pid, reader
        self.deadline = time.monotonic() + timeout

    def wait(self) -> Completed:
        chunks: list[bytes] = []
        try:
            while True:
                left = self.deadline - time.monotonic()
                if left <= 0 or not select.select([self.reader], [], [], left)[0]:
                    os.kill(self.pid, signal.SIGKILL)
                    os.waitpid(self.pid, 0)
                    raise AgentError(f"{self.name} did not finish within {self.timeout:g} s and was killed")
                chunk = os.read(self.reader, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(self.reader)
        _, status = os.waitpid(self.pid, 0)
        return Completed((self.name,), os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace"), "")


def fork(name: str, answer: Callable[[], tuple[int, str]], timeout: float) -> Forked:
    """Run `answer` in a forked child, beside this process: its (exit status, text) come back through a
    pipe, and nothing else it writes reaches this process's output (stdout and stderr are /dev/null).
    Only for a single-threaded process (a start-up, before any thread): a fork copies one thread."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 70  # sysexits' EX_SOFTWARE, for an exception
        try:
            os.close(reader)
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            code, text = answer()
            data = text.encode()
            while data:
                data = data[os.write(writer, data):]
        finally:
            os._exit(code)
    os.close(writer)
    return Forked(name, timeout, pid, reader)
