"""Host paths resolved under the agent's root (like node_exporter's --path.rootfs)."""
from __future__ import annotations

import os
from pathlib import Path


class Root:
    """The directory every host path is resolved under; "/" on a real node."""

    def __init__(self, path: str | os.PathLike[str] = "/") -> None:
        self.path = Path(path).resolve()

    def __call__(self, host_path: str | os.PathLike[str]) -> Path:
        """Map an absolute host path such as /etc/gpu-agent/config.yaml to its place under the root."""
        host_path = str(host_path)
        if not host_path.startswith("/"):
            raise ValueError(f"host path must be absolute: {host_path!r}")
        relative = os.path.normpath(host_path).lstrip("/")
        return self.path / relative if relative else self.path

    @property
    def is_host(self) -> bool:
        return self.path == Path("/")

    def __repr__(self) -> str:
        return f"Root({str(self.path)!r})"
