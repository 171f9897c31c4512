"""The local, read-only HTTP endpoint: /healthz, /readyz, /status, /metrics on TCP and a unix socket.

Only GET (and HEAD) routes exist: nothing that changes the host is reachable over HTTP.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

from gpu_agent.daemon.web import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from gpu_agent.config.schema import HttpConfig
from gpu_agent.daemon.responses import Capped, RenderCache, cached_response
from gpu_agent.daemon.listener import Listener, connection_limit, handling_request
from gpu_agent.metrics.exporter import render
from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

_BACKLOG = 1024
_NO_STORE = {"Cache-Control": "no-store"}  # a probe's answer is true now, never later
# Requests each endpoint answers at once (a slow reader holds its place until its body is written).
_LIGHT_LIMIT = 32
_HEAVY_LIMIT = 16
RENDER_CACHES = web.AppKey("render_caches", dict)
_SHUTDOWN_TIMEOUT_S = 0.5  # for a request being answered at SIGTERM


def build_app(state: AgentState, registry: CollectorRegistry, loop_alive: Callable[[], bool]) -> web.Application:
    status_cache = RenderCache(lambda: (json.dumps(state.to_json(), indent=2) + "\n").encode(), lambda: state.version)
    # A second at most: the body carries gpu_agent_sample_age_seconds.
    metrics_cache = RenderCache(lambda: render(registry),
                                lambda: None if state.version is None else (state.version, int(time.monotonic())))

    async def index(request: web.Request) -> web.Response:
        return web.Response(text="gpu-agent: /healthz /readyz /readyz?verbose /status /metrics\n")

    async def healthz(request: web.Request) -> web.Response:
        if not loop_alive():
            return web.Response(status=500, text="reconcile loop stopped\n", headers=_NO_STORE)
        return web.Response(text="ok\n", headers=_NO_STORE)

    async def readyz(request: web.Request) -> web.Response:
        checks = state.checks() if state.first_reconcile_done else []
        ready = state.ready
        if "verbose" in request.query or not ready:
            lines = [f"[+]{c.name} ok" if c.ok else f"[-]{c.name} failed: {c.reason}" for c in checks]
            if not state.first_reconcile_done:
                lines.append("[-]startup failed: first reconcile in progress")
            lines.append("readyz check passed" if ready else "readyz check failed")
            return web.Response(status=200 if ready else 503, text="\n".join(lines) + "\n", headers=_NO_STORE)
        return web.Response(text="ok\n", headers=_NO_STORE)

    async def status(request: web.Request) -> web.Response:
        return cached_response(request, status_cache.get(), "application/json; charset=utf-8")

    async def metrics(request: web.Request) -> web.Response:
        return cached_response(request, metrics_cache.get(), CONTENT_TYPE_LATEST)

    app = web.Application()
    app.router.add_get("/", Capped(index, _LIGHT_LIMIT).handle)
    app.router.add_get("/healthz", Capped(healthz, _LIGHT_LIMIT).handle)
    app.router.add_get("/readyz", Capped(readyz, _LIGHT_LIMIT).handle)
    app.router.add_get("/status", Capped(status, _HEAVY_LIMIT).handle)
    app.router.add_get("/metrics", Capped(metrics, _HEAVY_LIMIT).handle)
    app[RENDER_CACHES] = {"/status": status_cache, "/metrics": metrics_cache}
    return app


class HttpServer:
    """The endpoint on its listeners; each caps its connections and times out idle ones (listener.py)."""

    def __init__(self, app: web.Application, root: Root) -> None:
        self.root = root
        app.middlewares.append(_mark_busy)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     shutdown_timeout=_SHUTDOWN_TIMEOUT_S)
        self._listeners: list[Listener] = []
        self.settings: Optional[HttpConfig] = None

    async def start(self, settings: HttpConfig) -> None:
        """Serve on the configured TCP address and unix socket; a bind failure raises AgentError."""
        if not self._runner.server:
            await self._runner.setup()
        server = self._runner.server
        assert server is not None
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
        listeners = [Listener(sock, server, name, limit) for sock, name in bound]
        for listener in listeners:
            listener.start()
        self._listeners, self.settings = listeners, settings
        log.info("serving /healthz /readyz /status /metrics on %s (at most %d connections each)",
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
        for listener in self._listeners:
            listener.close()
        await self._runner.cleanup()
        if self.settings and self.settings.socket:
            _remove_stale_socket(self.root(self.settings.socket))


@web.middleware
async def _mark_busy(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                     ) -> web.StreamResponse:
    with handling_request(request.transport):
        return await handler(request)


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
