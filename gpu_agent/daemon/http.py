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
from gpu_agent.daemon.listener import MAX_CONNECTIONS, Listener, connection_limit
from gpu_agent.daemon.protocol import HttpProtocol
from gpu_agent import endpoint_proof
from gpu_agent.daemon.responses import (
    Capped, Deflated, Handler, RenderCache, Rendered, Request, Response, cached_response, gzip_of,
)
from gpu_agent.errors import AgentError
from gpu_agent.host.files import atomic_write, remove
from gpu_agent.host.paths import Root
from gpu_agent.kube.labels import node_labels
from gpu_agent.metrics.exporter import AgentRegistry, DcgmText, content_type, render_own
from gpu_agent.printable import printable
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

_BACKLOG = 1024
_NO_STORE = [("Cache-Control", "no-store")]  # a probe's answer is true now, never later
# Requests each endpoint answers at once (a slow reader holds its place until its body is written).
_LIGHT_LIMIT = 32
_HEAVY_LIMIT = 16
_SHUTDOWN_TIMEOUT_S = 0.5  # for the answers being written at SIGTERM
TCP_RETRY_INITIAL_S = 1.0  # binding http.listen again after a failure: 1 s, then twice as long each time,
TCP_RETRY_MAX_S = 30.0  # up to this


class Endpoints:
    """The routes (path -> capped handler), and the render caches of /status and /metrics."""

    def __init__(self, routes: dict[str, Capped], caches: dict[str, RenderCache],
                 connection_errors: Optional[Counter[str]] = None) -> None:
        self.routes = routes
        self.caches = caches
        self.token: Optional[str] = None  # the agent's proof token (endpoint_proof.py), once written
        # What clients' sockets reported (resets, broken pipes) and the clients closed for not reading, by reason
        self.connection_errors: Counter[str] = Counter() if connection_errors is None else connection_errors


def this_second() -> int:
    """The second of the monotonic clock: what /metrics's cached body is valid for."""
    return int(time.monotonic())


def metrics_renderer(registry: AgentRegistry) -> Callable[[], Rendered]:
    """/metrics's body: the agent's own families rendered each time, the DCGM series once per sample
    (DcgmText), and their gzip compressed once per sample too (gzip_of)."""
    dcgm = DcgmText(registry.collector)
    tail = Deflated(b"")

    def rendered() -> Rendered:
        nonlocal tail
        own, series = render_own(registry), dcgm.get()
        if series is not tail.data:
            tail = Deflated(series)
        part = tail
        return Rendered(own + series, lambda: gzip_of(own, part))
    return rendered


def build_app(state: AgentState, registry: AgentRegistry, stalled: Callable[[], Optional[str]]) -> Endpoints:
    """The routes; `stalled()` says why the daemon is not live (its passes stopped), or None."""
    status_cache = RenderCache(lambda: (json.dumps(_status(state), indent=2) + "\n").encode(), lambda: state.version)
    # A second at most: the body carries gpu_agent_sample_age_seconds.
    metrics_cache = RenderCache(metrics_renderer(registry),
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

    def proven(handler: Handler) -> Handler:
        """The answer, with the agent's proof when the request carries a challenge (endpoint_proof.py)."""
        def answer(request: Request) -> Response:
            response = handler(request)
            challenge = request.headers.get(endpoint_proof.CHALLENGE_HEADER, "")
            if challenge and endpoints.token is not None and endpoint_proof.valid_challenge(challenge):
                response.headers = [*response.headers, (endpoint_proof.PROOF_HEADER,
                                                        endpoint_proof.proof(endpoints.token, challenge,
                                                                             response.body))]
            return response
        return answer

    # /livez: Kubernetes' name for liveness, the same answer as /healthz.
    routes = {"/": Capped(index, _LIGHT_LIMIT), "/healthz": Capped(proven(healthz), _LIGHT_LIMIT),
              "/livez": Capped(proven(healthz), _LIGHT_LIMIT),
              "/readyz": Capped(proven(readyz), _LIGHT_LIMIT), "/status": Capped(proven(status), _HEAVY_LIMIT),
              "/metrics": Capped(metrics, _HEAVY_LIMIT)}
    endpoints = Endpoints(routes, {"/status": status_cache, "/metrics": metrics_cache})
    registry.collector.connection_errors = endpoints.connection_errors
    return endpoints


class HttpServer:
    """The endpoint on its listeners; each caps its connections and times out idle ones (listener.py).

    The unix socket is the contract: one that cannot be bound is an error that stops the start (or
    rejects the reload). TCP is a convenience: any local user may bind its port first (in the second
    between a stop and a start), so an address that cannot be bound is reported (`tcp_error`, the log)
    and bound again with backoff while the agent runs and serves on the unix socket."""

    def __init__(self, endpoints: Endpoints, root: Root,
                 on_tcp_error: Callable[[Optional[str]], None] = lambda error: None) -> None:
        self.root = root
        self.endpoints = endpoints
        self._unix: list[Listener] = []
        self._tcp: list[Listener] = []
        self._tcp_binding: Optional[asyncio.Task[None]] = None  # retrying the TCP bind
        self._on_tcp_error = on_tcp_error
        self.tcp_error: Optional[str] = None
        self.settings: Optional[HttpConfig] = None

    @property
    def listeners(self) -> list[Listener]:
        return self._tcp + self._unix

    def _protocol(self) -> HttpProtocol:
        return HttpProtocol(self.endpoints.routes, self.endpoints.connection_errors)

    async def start(self, settings: HttpConfig) -> None:
        """Serve on the configured unix socket (a bind failure raises AgentError) and TCP address (a bind
        failure is reported and retried)."""
        await self.restart(settings)

    async def restart(self, settings: HttpConfig) -> None:
        """Move to new addresses. The unix socket first: on failure it keeps serving on the old one and
        raises, nothing changed. Then TCP, which is left as it is when its address did not change."""
        old = self.settings
        if settings == old:
            return
        if old is None or settings.socket != old.socket:
            unix = self._bind_unix(settings.socket)  # raises: nothing changed yet
            self._close(self._unix)
            if old is not None and old.socket:
                _remove_stale_socket(self.root(old.socket))
            self._unix = self._listen(unix)
        if old is None:
            self._write_token()
        self.settings = settings
        if old is None or settings.listen != old.listen:
            self._stop_tcp()
            if settings.listen:
                self._bind_tcp(settings)
        self._set_limits()
        log.info("serving /healthz /livez /readyz /status /metrics on %s (at most %d connections each)",
                 ", ".join(listener.name for listener in self.listeners)
                 or "nothing (http.listen and http.socket are off)",
                 self.listeners[0].limit if self.listeners else 0)

    def _write_token(self) -> None:
        """A fresh token for this run, readable by root only (endpoint_proof.py); without it the endpoint
        serves all the same, with no proof for `gpu-agent status --tcp`."""
        path = self.root(endpoint_proof.TOKEN_PATH)
        token = endpoint_proof.new_token()
        try:
            path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            remove(path)  # a new file, so 0600 whatever the one before was made
            atomic_write(path, token + "\n", 0o600)
        except OSError as exc:
            log.warning("cannot write %s: %s; `gpu-agent status --tcp` cannot tell this agent from another "
                        "process", path, exc.strerror or exc)
            return
        self.endpoints.token = token

    def _bind_unix(self, socket_path: str) -> list[tuple[socket.socket, str]]:
        if not socket_path:
            return []
        path = self.root(socket_path)

        def make() -> list[socket.socket]:
            _remove_stale_socket(path)
            path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            sock = _unix_socket(path)
            try:
                os.chmod(path, 0o660)
            except OSError:
                sock.close()
                raise
            return [sock]

        return [(sock, str(path)) for sock in _bind(f"{path} (http.socket)", make)]

    def _bind_tcp(self, settings: HttpConfig) -> None:
        """Listen on http.listen now, or report why not and retry with backoff until it can."""
        try:
            tcp = _bind(f"{settings.listen} (http.listen)", lambda: _tcp_sockets(settings.host, settings.port))
        except AgentError as exc:
            self._tcp_failed(str(exc))
            self._tcp_binding = asyncio.get_running_loop().create_task(self._retry_tcp(settings),
                                                                        name="http.listen")
            return
        self._tcp = self._listen([(sock, settings.listen) for sock in tcp])
        self._tcp_bound(settings)

    async def _retry_tcp(self, settings: HttpConfig) -> None:
        delay = TCP_RETRY_INITIAL_S
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, TCP_RETRY_MAX_S)
            try:
                tcp = _bind(f"{settings.listen} (http.listen)", lambda: _tcp_sockets(settings.host, settings.port))
            except AgentError as exc:
                self._tcp_failed(str(exc))
                continue
            self._tcp = self._listen([(sock, settings.listen) for sock in tcp])
            self._tcp_binding = None
            self._set_limits()
            self._tcp_bound(settings)
            return

    def _tcp_failed(self, error: str) -> None:
        error = (f"{error}; serving on the unix socket only, and binding again every {TCP_RETRY_MAX_S:g} s at "
                 "most (who listens there: ss -ltnp)")
        if error != self.tcp_error:  # a retry failing the same way says nothing new
            log.error("%s", error)
            self.tcp_error = error
            self._on_tcp_error(error)

    def _tcp_bound(self, settings: HttpConfig) -> None:
        if self.tcp_error is not None:
            log.warning("serving HTTP on %s (http.listen) again", settings.listen)
            self.tcp_error = None
            self._on_tcp_error(None)

    def _stop_tcp(self) -> None:
        if self._tcp_binding is not None:
            self._tcp_binding.cancel()
            self._tcp_binding = None
        self._close(self._tcp)
        self._tcp = []
        if self.tcp_error is not None:
            self.tcp_error = None
            self._on_tcp_error(None)

    def _listen(self, bound: list[tuple[socket.socket, str]]) -> list[Listener]:
        listeners = [Listener(sock, self._protocol, name, MAX_CONNECTIONS, errors=self.endpoints.connection_errors)
                     for sock, name in bound]
        for listener in listeners:
            listener.start()
        return listeners

    def _set_limits(self) -> None:
        """Each listener's share of the descriptors: a TCP address still being bound counts as one."""
        count = len(self.listeners) + (1 if self._tcp_binding is not None else 0)
        limit = connection_limit(count)
        for listener in self.listeners:
            listener.limit = limit

    @staticmethod
    def _close(listeners: list[Listener]) -> None:
        for listener in listeners:
            listener.close()

    async def stop(self) -> None:
        """Stop accepting, give the answers being written _SHUTDOWN_TIMEOUT_S, then close everything."""
        if self._tcp_binding is not None:
            self._tcp_binding.cancel()
            self._tcp_binding = None
        for listener in self.listeners:
            listener.stop_accepting()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SHUTDOWN_TIMEOUT_S
        while any(listener.answering for listener in self.listeners) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for listener in self.listeners:
            listener.close()
        if self.settings and self.settings.socket:
            _remove_stale_socket(self.root(self.settings.socket))
        if self.endpoints.token is not None:
            self.endpoints.token = None
            try:
                remove(self.root(endpoint_proof.TOKEN_PATH))
            except OSError as exc:
                log.warning("cannot remove %s: %s", endpoint_proof.TOKEN_PATH, exc.strerror or exc)


def _status(state: AgentState) -> dict[str, Any]:
    return state.to_json(labels=node_labels(state.config.config, state.inventory, state.ready, state.machine,
                                             state.workload))


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
