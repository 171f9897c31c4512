"""`python3 -m gpu_agent.mps.launch SHM BINARY [ARG...]`: run BINARY (nvidia-cuda-mps-control -d) with
SHM, the tmpfs the agent mounted at /run/nvidia/mps/shm, as its /dev/shm, as NVIDIA's DaemonSet
gives its control daemon `<mps root>/shm` at /dev/shm.

It takes a mount namespace of its own (unshare CLONE_NEWNS, the tree made private so that nothing
mounted here reaches the host), bind-mounts SHM onto /dev/shm there, and execs BINARY: the control
daemon and the MPS servers it forks keep that namespace, so their shared memory is SHM's, which the
device plugin mounts into each client as /dev/shm. Everything else (the pipe and log directories,
/dev/nvidia*) is the host's. Needs CAP_SYS_ADMIN. Exit 1 with the reason on stderr when SHM is not a
mounted tmpfs or a mount is refused, 127 when BINARY cannot be run.

Only without systemd: under it the packaged template unit gives each daemon the tmpfs as its /dev/shm
(BindPaths=, systemd/gpu-agent-mps@.service).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from gpu_agent.errors import AgentError
from gpu_agent.host import mounts
from gpu_agent.host.paths import Root
from gpu_agent.mps.layout import CLIENT_SHM

USAGE = "usage: python3 -m gpu_agent.mps.launch SHM BINARY [ARG...] (absolute paths)"


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or not all(arg.startswith("/") for arg in args[:2]):
        print(USAGE, file=sys.stderr)
        return 2
    shm, binary, *rest = args
    try:
        found = mounts.mount_at(Root("/"), shm)
        if found is None or found.fstype != "tmpfs":
            raise AgentError(f"{shm} is not a mounted tmpfs ({found.fstype if found else 'nothing'} is mounted there)")
        mounts.private_mount_namespace()
        mounts.bind(shm, CLIENT_SHM)
    except (OSError, AgentError) as exc:
        print(f"cannot give {binary} {shm} as its {CLIENT_SHM}: {getattr(exc, 'strerror', None) or exc}",
              file=sys.stderr)
        return 1
    sys.stdout.flush()
    try:
        os.execv(binary, [binary, *rest])
    except OSError as exc:
        print(f"cannot run {binary}: {exc.strerror or exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
