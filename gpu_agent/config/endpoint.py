"""Where the running daemon answers, read without pydantic: `gpu-agent status` and `labels` only need
the http section, and validating the whole config costs them more than the question they ask.

Only a plainly valid http section is read here. Anything else gives None and the caller loads the
config in full (config_of), which names the file, line and key at fault.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple, Optional

from gpu_agent.config.text import read_config_text
from gpu_agent.errors import ConfigError

DEFAULT_LISTEN = "127.0.0.1:9445"
DEFAULT_SOCKET = "/run/gpu-agent/agent.sock"
LISTEN_MAX = 300
PATH_MAX = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_HOST = re.compile(r"[A-Za-z0-9._-]+")  # a name or an IPv4 address; an IPv6 one goes in brackets


def valid_listen(value: str) -> bool:
    """HOST:PORT, or "" (TCP off): HOST a name or IPv4 address, or an IPv6 address in brackets ([::1]:9445)."""
    if value == "":
        return True
    host, sep, port = value.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and len(port) <= 5 and int(port) <= 65535):
        return False
    if host.startswith("[") or host.endswith("]"):
        import ipaddress

        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return host.startswith("[") and host.endswith("]")
    return _HOST.fullmatch(host) is not None


SOCKET_DIRECTORIES = ("/run/", "/var/run/")  # a socket elsewhere could take the name of a file the agent does not own


def valid_socket(value: str) -> bool:
    """A path under /run (or /var/run) without control characters or "..", or "" (the socket off)."""
    return value == "" or (value.startswith(SOCKET_DIRECTORIES) and not _CONTROL.search(value)
                           and ".." not in value.split("/"))


class Endpoint(NamedTuple):  # not a dataclass: `gpu-agent status` would import dataclasses (and inspect) for it
    listen: str = DEFAULT_LISTEN
    socket: str = DEFAULT_SOCKET

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


def read_endpoint(path: Path, required: bool) -> Optional[Endpoint]:
    """The endpoint the config at `path` gives (the defaults when an optional file is missing), or None
    when that needs the full loader to say what is wrong."""
    from gpu_agent.config.safe_yaml import load_yaml

    try:
        text = read_config_text(path)
        if text is None:
            return None if required else Endpoint()
        _, data = load_yaml(text, str(path))
    except ConfigError:
        return None
    if data is None:
        return Endpoint()
    if not isinstance(data, dict) or data.get("version") != "v1":
        return None
    return _endpoint(data.get("http", {}))


def _endpoint(http: Any) -> Optional[Endpoint]:
    if not isinstance(http, dict) or not set(http) <= {"listen", "socket"}:
        return None
    listen, socket = http.get("listen", DEFAULT_LISTEN), http.get("socket", DEFAULT_SOCKET)
    if not (isinstance(listen, str) and len(listen) <= LISTEN_MAX and valid_listen(listen)):
        return None
    if not (isinstance(socket, str) and len(socket) <= PATH_MAX and valid_socket(socket)):
        return None
    return Endpoint(listen, socket)
