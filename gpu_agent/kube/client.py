"""A small Kubernetes API client for one Node: GET and PATCH, with the node's own credentials.

Synchronous (stages run on worker threads), every request with a timeout, TLS verification on,
the client certificate re-read when the kubelet rotates it, and at most 12 requests a minute.
"""
from __future__ import annotations

import http.client
import json
import os
import ssl
import tempfile
import threading
import time
from collections import deque
from typing import Any, Optional
from urllib.parse import urlsplit

from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.kube.kubeconfig import Credentials, load

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
RATE = 12  # requests per minute, at most, whatever happens


class ApiError(AgentError):
    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class KubeClient:
    def __init__(self, root: Root, kubeconfig: str, timeout: float) -> None:
        self.root = root
        self.kubeconfig = kubeconfig
        self.timeout = timeout
        self._credentials: Optional[Credentials] = None
        self._kubeconfig_stamp: Optional[tuple[int, int]] = None
        self._context: Optional[ssl.SSLContext] = None
        self._context_key: Optional[tuple[Any, ...]] = None
        self._sent: deque[float] = deque()
        self._lock = threading.Lock()

    @property
    def credentials(self) -> Credentials:
        """The kubeconfig's, read again whenever the file changes (a new server, CA or user)."""
        stamp = _stamp(self.root, self.kubeconfig)
        if self._credentials is None or stamp != self._kubeconfig_stamp:
            self._credentials = load(self.root, self.kubeconfig)
            self._kubeconfig_stamp = stamp
            self._context = None
        return self._credentials

    def get_node(self, name: str) -> dict[str, Any]:
        return self._request("GET", f"/api/v1/nodes/{name}")

    def patch_node(self, name: str, patch: dict[str, Any], status: bool = False,
                   content_type: str = MERGE_PATCH) -> dict[str, Any]:
        path = f"/api/v1/nodes/{name}" + ("/status" if status else "")
        return self._request("PATCH", path, json.dumps(patch).encode(), content_type)

    # --- transport -------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Optional[bytes] = None,
                 content_type: Optional[str] = None) -> dict[str, Any]:
        self._take_token(method, path)
        credentials = self.credentials
        url = urlsplit(credentials.server)
        headers = {"Accept": "application/json", "User-Agent": "gpu-agent"}
        if content_type:
            headers["Content-Type"] = content_type
        token = self._token(credentials)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if url.scheme == "https":
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                url.hostname or "", url.port or 443, timeout=self.timeout, context=self._ssl(credentials))
        else:
            connection = http.client.HTTPConnection(url.hostname or "", url.port or 80, timeout=self.timeout)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ApiError(f"{method} {credentials.server}{path}: {exc}") from None
        finally:
            connection.close()
        try:
            document = json.loads(payload) if payload else {}
        except ValueError:
            document = {"message": payload[:200].decode(errors="replace")}
        if response.status >= 400:
            raise self._error(method, path, response.status, document, credentials)
        return document

    def _take_token(self, method: str, path: str) -> None:
        with self._lock:
            now = time.monotonic()
            while self._sent and now - self._sent[0] > 60:
                self._sent.popleft()
            if len(self._sent) >= RATE:
                raise ApiError(f"{method} {path} not sent: {RATE} requests in the last minute already")
            self._sent.append(now)

    @staticmethod
    def _error(method: str, path: str, status: int, document: dict[str, Any], credentials: Credentials) -> ApiError:
        message = document.get("message") or f"HTTP {status}"
        reason = document.get("reason", "")
        if status in (401, 403):
            return ApiError(f"{method} {path}: {status} {reason or 'Forbidden'}: {message} (as "
                            f"{credentials.identity()} from the kubeconfig)", status, reason)
        return ApiError(f"{method} {path}: {status} {reason}: {message}".replace("  ", " "), status, reason)

    def _token(self, credentials: Credentials) -> Optional[str]:
        if credentials.token_file:
            try:
                return self.root(credentials.token_file).read_text().strip()  # re-read: tokens rotate
            except OSError as exc:
                raise ApiError(f"cannot read token file {credentials.token_file}: {exc.strerror}") from None
        return credentials.token

    def _ssl(self, credentials: Credentials) -> ssl.SSLContext:
        """The TLS context, rebuilt when a certificate file changes (the kubelet rotates its own)."""
        files = [f for f in (credentials.ca_file, credentials.cert_file, credentials.key_file) if f]
        key = tuple(_stamp(self.root, f) for f in files)
        if self._context is None or key != self._context_key:
            try:
                self._context = self._build_ssl(credentials)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ApiError(f"cannot load the TLS files of {credentials.identity()} "
                               f"(kubeconfig {self.kubeconfig}): {exc}") from None
            self._context_key = key
        return self._context

    def _build_ssl(self, credentials: Credentials) -> ssl.SSLContext:
        context = ssl.create_default_context()
        if credentials.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif credentials.ca_data:
            context.load_verify_locations(cadata=credentials.ca_data.decode())
        elif credentials.ca_file:
            context.load_verify_locations(cafile=str(self.root(credentials.ca_file)))
        if credentials.cert_file:
            key = str(self.root(credentials.key_file)) if credentials.key_file else None
            context.load_cert_chain(str(self.root(credentials.cert_file)), key)
        elif credentials.cert_data:
            # ssl reads certificates from files only: a private temporary file, removed at once.
            with tempfile.NamedTemporaryFile("wb", delete=False) as chain:
                os.chmod(chain.name, 0o600)
                chain.write(credentials.cert_data + b"\n" + (credentials.key_data or b""))
            try:
                context.load_cert_chain(chain.name)
            finally:
                os.unlink(chain.name)
        return context


def _stamp(root: Root, path: str) -> tuple[int, int]:
    try:
        st = os.stat(root(path))
        return (st.st_ino, st.st_mtime_ns)
    except OSError:
        return (0, 0)
