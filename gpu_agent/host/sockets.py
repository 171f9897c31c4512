"""Unix socket addresses for paths under a deep --root."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def socket_address(path: Path) -> tuple[str, Optional[int]]:
    """An address for the unix socket at `path`: the path itself, or for one longer than a socket
    address allows (a deep --root), the same file through an open descriptor of its directory,
    /proc/self/fd/N/name (this process's own descriptor, not a host path). The caller closes N."""
    if len(os.fsencode(str(path))) <= SOCKET_PATH_MAX:
        return str(path), None
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return f"/proc/self/fd/{fd}/{path.name}", fd
