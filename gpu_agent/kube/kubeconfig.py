"""The kubelet's kubeconfig, read under --root: server, CA, and the node's own credentials."""
from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Optional

import yaml

from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root


@dataclass(frozen=True)
class Credentials:
    server: str
    ca_file: Optional[str] = None  # host paths
    ca_data: Optional[bytes] = None
    insecure: bool = False
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    cert_data: Optional[bytes] = None
    key_data: Optional[bytes] = None
    token: Optional[str] = None
    token_file: Optional[str] = None
    user: str = "?"

    def identity(self) -> str:
        """Which credential is used, for error messages."""
        if self.cert_file:
            return f"user {self.user!r} with client certificate {self.cert_file}"
        if self.cert_data:
            return f"user {self.user!r} with the client certificate embedded in the kubeconfig"
        if self.token_file:
            return f"user {self.user!r} with the token in {self.token_file}"
        if self.token:
            return f"user {self.user!r} with a bearer token"
        return f"user {self.user!r} without credentials"


def load(root: Root, path: str) -> Credentials:
    text = _read(root, path, "kubeconfig")
    try:
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise AgentError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise AgentError(f"{path}: not a kubeconfig (expected a mapping at the top level)")
    context_name = config.get("current-context")
    context = _named(config, "contexts", context_name, path).get("context", {}) if context_name else \
        (config.get("contexts") or [{}])[0].get("context", {})
    cluster = _named(config, "clusters", context.get("cluster"), path).get("cluster") or {}
    user_name = context.get("user")
    user = _named(config, "users", user_name, path).get("user") or {}
    if not cluster.get("server"):
        raise AgentError(f"{path}: cluster {context.get('cluster')!r} has no server")
    base = str(PurePosixPath(path).parent)
    return Credentials(
        server=cluster["server"].rstrip("/"),
        ca_file=_path(base, cluster.get("certificate-authority")),
        ca_data=_data(cluster.get("certificate-authority-data"), path, "certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        cert_file=_path(base, user.get("client-certificate")),
        key_file=_path(base, user.get("client-key")),
        cert_data=_data(user.get("client-certificate-data"), path, "client-certificate-data"),
        key_data=_data(user.get("client-key-data"), path, "client-key-data"),
        token=user.get("token"),
        token_file=_path(base, user.get("tokenFile")),
        user=str(user_name),
    )


def _named(config: dict[str, Any], section: str, name: Optional[str], path: str) -> dict[str, Any]:
    for entry in config.get(section) or []:
        if entry.get("name") == name:
            return entry
    raise AgentError(f"{path}: {section}: no entry named {name!r}")


def _path(base: str, value: Optional[str]) -> Optional[str]:
    if not value:
        return None
    return value if value.startswith("/") else f"{base}/{value}"


def _data(value: Optional[str], path: str, key: str) -> Optional[bytes]:
    if not value:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise AgentError(f"{path}: {key} is not base64") from None


def _read(root: Root, path: str, what: str) -> str:
    try:
        return root(path).read_text()
    except FileNotFoundError:
        raise AgentError(f"{what} {path} not found") from None
    except OSError as exc:
        raise AgentError(f"cannot read {what} {path}: {exc.strerror}") from None
