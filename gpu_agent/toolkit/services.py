"""Service control for the container runtimes: systemd."""
from __future__ import annotations

import socket
import time
from typing import Optional, Protocol

from gpu_agent.errors import AgentError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root

_POLL_S = 0.2


class ServiceControl(Protocol):
    def active(self, unit: str) -> bool: ...

    def restart(self, unit: str) -> None:
        """Restart the unit; raise AgentError when systemd reports a failure."""

    def wait_ready(self, unit: str, socket_path: str, timeout: float) -> Optional[str]:
        """None once the runtime answers on its socket, else what went wrong."""


class Systemd:
    def __init__(self, root: Root, timeout: float) -> None:
        self.root = root
        self.timeout = timeout

    def active(self, unit: str) -> bool:
        if not self.root.is_running_system:
            return False  # a sandbox root has no running services of its own
        return proc.run(["systemctl", "is-active", "--quiet", unit], timeout=self.timeout).returncode == 0

    def restart(self, unit: str) -> None:
        if not self.root.is_running_system:
            raise AgentError(f"refusing to restart {unit} on this machine while --root is {self.root.path}")
        done = proc.run(["systemctl", "restart", unit], timeout=self.timeout)
        if done.returncode != 0:
            raise AgentError(f"systemctl restart {unit} failed: {done.output}; see journalctl -u {unit}")

    def wait_ready(self, unit: str, socket_path: str, timeout: float) -> Optional[str]:
        return wait_for_socket(str(self.root(socket_path)), socket_path, timeout)


def wait_for_socket(path: str, name: str, timeout: float) -> Optional[str]:
    deadline = time.monotonic() + timeout
    last = "no attempt"
    while time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(path)
                return None
            except OSError as exc:
                last = exc.strerror or str(exc)
        time.sleep(_POLL_S)
    return f"no answer on {name} within {timeout:g} s ({last})"
