"""Whether a program may be run by the agent: the file and every directory above it owned by root (or
by the user the agent runs as) and writable by no one else. Root runs what it finds in /usr/local/bin
and in the distributions' data directories; a file there that another user can replace would run
their code as root.

A directory writable by others but sticky (/tmp) is fine when root owns it: no one else may replace a
file in it that they do not own. Writable by the root group is fine too; by any other group it is not:
a Debian system whose /usr/local directories are root:staff 2775, as Debian's policy long had them,
lets members of `staff` run anything as root through the agent (move the program there, or make its
directory 0755 root:root).
"""
from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Mapping
from typing import Optional

from gpu_agent.errors import AgentError


def check_executable(program: str, env: Optional[Mapping[str, str]] = None) -> None:
    """Raise AgentError naming the file when `program` (a path, or a name looked up on the PATH of
    `env` or of this process) is not safe to run; a program that is not found passes (running it
    says so)."""
    path = program if "/" in program else shutil.which(program, path=(env or {}).get("PATH", os.environ.get("PATH")))
    if path is None:
        return
    real = os.path.realpath(path)
    try:
        problem = _problem(real, os.stat(real), "it")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise AgentError(f"refusing to run {program}: cannot look at {real}: {exc.strerror or exc}") from None
    directory = os.path.dirname(real)
    while problem is None:
        try:
            problem = _problem(directory, os.stat(directory), f"its directory {directory}")
        except OSError as exc:
            raise AgentError(f"refusing to run {program}: cannot look at {directory}: {exc.strerror or exc}") from None
        if directory == "/":
            break
        directory = os.path.dirname(directory)
    if problem is not None:
        shown = program if real == program else f"{program} ({real})"
        raise AgentError(f"refusing to run {shown}: {problem}; only root may be able to change what the agent "
                         "runs as root")


def _problem(path: str, status: os.stat_result, what: str) -> Optional[str]:
    owners = {0, os.geteuid()}
    if status.st_uid not in owners:
        return f"{what} is owned by uid {status.st_uid}, not root"
    mode = stat.S_IMODE(status.st_mode)
    sticky_dir = stat.S_ISDIR(status.st_mode) and mode & stat.S_ISVTX and status.st_uid == 0
    if mode & stat.S_IWGRP and status.st_gid != 0 and not sticky_dir:
        return f"{what} is writable by its group (gid {status.st_gid}, mode {mode:04o})"
    if mode & stat.S_IWOTH and not sticky_dir:
        return f"{what} is writable by everyone (mode {mode:04o})"
    return None
