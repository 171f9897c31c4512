"""The local, read-only HTTP endpoint: /healthz (/livez), /readyz, /status, /metrics on TCP and a unix socket.

Only GET (and HEAD) routes exist: nothing that changes the host is reachable over HTTP.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import stat
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from gpu_agent.config.schema import HttpConfig
from gpu_agent.daemon.listener import Listener, connection_limit
from gpu_agent.daemon.protocol import HttpProtocol
from gpu_agent.daemon.responses import Capped, RenderCache, Request, Response, cached_response
from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import node_labels
from gpu_agent.metrics.exporter import AgentRegistry, content_type, render
from gpu_agent.printable import printable
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

_BACKLOG = 1024
_NO_STORE = [("Cache-Control", "no-store")]  # a probe's answer is true now, never later
# Requests each endpoint answers at once (a slow reader holds its place until its body is written).
_LIGHT_LIMIT = 32
_HEAVY_LIMIT = 16
_SHUTDOWN_TIMEOUT_S = 0.5  # for the answers being written at SIGTERM


class Endpoints:
    """The routes (path -> capped handler), and the render caches of /status and /metrics."""

    def __init__(self, routes: dict[str, Capped], caches: dict[str, RenderCache],
                 connection_errors: Optional[Counter[str]] = None) -> None:
        self.routes = routes
        self.caches = caches
        # What clients' sockets reported (resets, broken pipes) and the clients closed for not reading, by reason
        self.connection_errors: Counter[str] = Counter() if connection_errors is None else connection_errors


def this_second() -> int:
    """The second of the monotonic clock: what /metrics's cached body is valid for."""
    return int(time.monotonic())


def build_app(state: AgentState, registry: AgentRegistry, stalled: Callable[[], Optional[str]]) -> Endpoints:
    """The routes; `stalled()` says why the daemon is not live (its passes stopped), or None."""
    status_cache = RenderCache(lambda: (json.dumps(_status(state), indent=2) + "\n").encode(), lambda: state.version)
    # A second at most: the body carries gpu_agent_sample_age_seconds.
    metrics_cache = RenderCache(lambda: render(registry),
                                lambda: None if state.version is None else (state.version, this_second()))

    def index(request: Request) -> Response:
        return Response.text("gpu-agent: /healthz /livez /readyz /readyz?verbose /status /metrics\n")

    def healthz(request: Request) -> Response:
        problem = stalled()
        if problem is not None:
            return Response.text(f"{printable(problem)}\n", 500, _NO_STORE)
        return Response.text("ok\n", headers=_NO_STORE)

    def readyz(request: Request) -> Response:
        ready = state.ready  # the checks once: they cost about 0.1 ms on a node of 8 GPUs with 7 MIG devices each
        if not ready or "verbose" in request.query:
            checks = state.checks() if state.first_reconcile_done else []
            lines = [f"[+]{c.name} ok" if c.ok else f"[-]{c.name} failed: {printable(c.reason)}" for c in checks]
            if not state.first_reconcile_done:
                lines.append("[-]startup failed: first reconcile in progress")
            lines.append("readyz check passed" if ready else "readyz check failed")
            return Response.text("\n".join(lines) + "\n", 200 if ready else 503, _NO_STORE)
        return Response.text("ok\n", headers=_NO_STORE)

    def status(request: Request) -> Response:
        return cached_response(request, status_cache.get(), "application/json; charset=utf-8")

    def metrics(request: Request) -> Response:
        return cached_response(request, metrics_cache.get(), content_type())

    # /livez: Kubernetes' name for liveness, the same answer as /healthz.
    routes = {"/": Capped(index, _LIGHT_LIMIT), "/healthz": Capped(healthz, _LIGHT_LIMIT),
              "/livez": Capped(healthz, _LIGHT_LIMIT),
              "/readyz": Capped(readyz, _LIGHT_LIMIT), "/status": Capped(status, _HEAVY_LIMIT),
              "/metrics": Capped(metrics, _HEAVY_LIMIT)}
    endpoints = Endpoints(routes, {"/status": status_cache, "/metrics": metrics_cache})
    registry.collector.connection_errors = endpoints.connection_errors
    return endpoints


class HttpServer:
    """The endpoint on its listeners; each caps its connections and times out idle ones (listener.py)."""

    def __init__(self, endpoints: Endpoints, root: Root) -> None:
        self.root = root
        self.endpoints = endpoints
        self._listeners: list[Listener] = []
        self.settings: Optional[HttpConfig] = None

    @property
    def listeners(self) -> list[Listener]:
        return list(self._listeners)

    def _protocol(self) -> HttpProtocol:
        return HttpProtocol(self.endpoints.routes, self.endpoints.connection_errors)

    async def start(self, settings: HttpConfig) -> None:
        """Serve on the configured TCP address and unix socket; a bind failure raises AgentError."""
        bound: list[tuple[socket.socket, str]] = []  # and the name each is known by
        try:
            if settings.listen:
                tcp = _bind(f"{settings.listen} (http.listen)", lambda: _tcp_sockets(settings.host, settings.port))
                bound += [(sock, settings.listen) for sock in tcp]
            if settings.socket:
                path = self.root(settings.socket)
                _remove_stale_socket(path)
                path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
                bound += [(sock, str(path)) for sock in _bind(f"{path} (http.socket)", lambda: [_unix_socket(path)])]
                os.chmod(path, 0o660)
        except AgentError:
            for sock, _ in bound:
                sock.close()
            raise
        limit = connection_limit(len(bound))
        listeners = [Listener(sock, self._protocol, name, limit, errors=self.endpoints.connection_errors)
                     for sock, name in bound]
        for listener in listeners:
            listener.start()
        self._listeners, self.settings = listeners, settings
        log.info("serving /healthz /livez /readyz /status /metrics on %s (at most %d connections each)",
                 ", ".join(listener.name for listener in listeners)
                 or "nothing (http.listen and http.socket are off)", limit)

    async def restart(self, settings: HttpConfig) -> None:
        """Move to new addresses; on failure keep serving on the old ones and raise."""
        if settings == self.settings:
            return
        old_settings = self.settings
        for listener in self._listeners:
            listener.close()
        try:
            await self.start(settings)
        except AgentError:
            if old_settings is not None:
                await self.start(old_settings)
            raise

    async def stop(self) -> None:
        """Stop accepting, give the answers being written _SHUTDOWN_TIMEOUT_S, then close everything."""
        for listener in self._listeners:
            listener.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SHUTDOWN_TIMEOUT_S
        while any(listener.answering for listener in self._listeners) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for listener in self._listeners:
            listener.close()
        if self.settings and self.settings.socket:
            _remove_stale_socket(self.root(self.settings.socket))


def _status(state: AgentState) -> dict[str, Any]:
    return state.to_json(labels=node_labels(state.config.config, state.inventory, state.ready, state.machine))


def _bind(where: str, make: Callable[[], list[socket.socket]]) -> list[socket.socket]:
    try:
        return make()
    except OSError as exc:
        raise AgentError(f"cannot serve HTTP on {where}: {exc.strerror or exc}") from None


def _tcp_sockets(host: str, port: int) -> list[socket.socket]:
    """A listening socket on each address `host` resolves to, as asyncio's create_server binds them."""
    sockets: list[socket.socket] = []
    try:
        for family, type_, proto, _, address in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(_BACKLOG)
    except socket.gaierror as exc:
        for sock in sockets:
            sock.close()
        raise OSError(exc.errno, f"cannot resolve {host!r}: {exc.strerror}") from None
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _unix_socket(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def _remove_stale_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
