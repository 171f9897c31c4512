"""Subprocesses: always an argv list, always a timeout, never a shell."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

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
