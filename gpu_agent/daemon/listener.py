"""Accepting the local HTTP endpoint's connections so that no local user can exhaust the daemon.

asyncio's own accept loop caps nothing, never times out a client that does not finish its request,
and on running out of descriptors logs a traceback per accept attempt (and, in 3.9-3.12, schedules a
retry per attempt). A `Listener` owns one listening socket instead:

- it holds at most `limit` connections; a new one closes the longest-idle connection to make room,
  or waits in the kernel's backlog while every connection is busy with a request;
- a connection that has not sent a complete request within `idle_timeout` of connecting or of its
  previous request is closed (slowloris, forgotten keep-alives);
- out of descriptors, it stops accepting for a second and says so once a minute.

The limit is computed from RLIMIT_NOFILE so that the listeners never take more than half of the
descriptors: the other half stays free for the stages' files, subprocesses and NVML.
"""
from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import resource
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 5.0  # to send a complete request, after connecting or after the previous response
MAX_CONNECTIONS = 64  # per listener, however high the descriptor limit
_ACCEPT_BATCH = 16  # accepts per wake-up, before the connections they replace are closed
_ACCEPT_RETRY_S = 1.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def connection_limit(listeners: int, soft_limit: Optional[int] = None) -> int:
    """Connections allowed per listener so that `listeners` of them use at most half of the descriptors.

    A listener holds up to twice its limit for a moment (a batch of new connections before the idle
    ones they replace are closed), hence a quarter of the soft limit shared between the listeners.
    """
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft_limit // (4 * max(1, listeners))))


class OncePer:
    """Logs a message at most once per `period` seconds, saying how many were held back."""

    def __init__(self, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.period = period
        self._clock = clock
        self._next = 0.0
        self._held = 0

    def __call__(self, level: int, message: str, *args: Any) -> None:
        now = self._clock()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like this since the last one)"
        self._next, self._held = now + self.period, 0
        log.log(level, message, *args)


class Listener:
    """One listening socket, its accept loop, and the connections accepted from it."""

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.Protocol], name: str,
                 limit: int, idle_timeout: float = IDLE_TIMEOUT_S) -> None:
        self.sock = sock
        self.name = name
        self.limit = limit
        self.idle_timeout = idle_timeout
        self._factory = protocol_factory
        self._full_log = OncePer()
        self._exhausted_log = OncePer()
        self._loop = asyncio.get_running_loop()
        self._open: set[_Connection] = set()
        self._idle: dict[_Connection, None] = {}  # not handling a request, longest idle first
        self._attaching: set[asyncio.Task[Any]] = set()
        self._retry: Optional[asyncio.TimerHandle] = None
        self._watching = False
        self.evicted = 0
        self.timed_out = 0
        sock.setblocking(False)

    @property
    def connections(self) -> int:
        return len(self._open) + len(self._attaching)

    def start(self) -> None:
        self._watch(True)

    def close(self) -> None:
        """Stop accepting and close every connection; aiohttp cancels what they were doing."""
        if self._retry is not None:
            self._retry.cancel()
        self._watch(False)
        self.sock.close()
        for task in list(self._attaching):
            task.cancel()
        for connection in list(self._open):
            self._drop(connection)

    # --- accepting -------------------------------------------------------------------------------

    def _watch(self, on: bool) -> None:
        """Accept while on; while off, new connections wait in the kernel's backlog."""
        if on == self._watching or self.sock.fileno() < 0:
            return
        if on:
            self._loop.add_reader(self.sock.fileno(), self._accept)
        else:
            self._loop.remove_reader(self.sock.fileno())
        self._watching = on

    def _accept(self) -> None:
        for _ in range(min(_ACCEPT_BATCH, self.limit)):
            if self.connections >= self.limit and not self._idle:
                self._watch(False)  # until a request finishes (_room_freed)
                self._full_log(logging.WARNING, "%s: all %d connections are busy with a request (the limit); "
                               "new ones wait", self.name, self.limit)
                return
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                self._pause(exc)
                return
            if self.connections >= self.limit:
                self._evict_longest_idle()
            conn.setblocking(False)
            task = self._loop.create_task(self._attach(conn))
            self._attaching.add(task)
            task.add_done_callback(self._attached)

    async def _attach(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: _Connection(self, self._factory()), conn)
        except (OSError, ValueError) as exc:  # the client left already
            log.debug("%s: dropping a connection before it started: %s", self.name, exc)
            conn.close()

    def _attached(self, task: asyncio.Task[Any]) -> None:
        self._attaching.discard(task)
        self._room_freed()

    def _evict_longest_idle(self) -> None:
        self.evicted += 1
        self._drop(next(iter(self._idle)))
        self._full_log(logging.WARNING, "%s: %d connections open (the limit); closing the longest idle "
                       "ones to make room", self.name, self.limit)

    def _pause(self, exc: OSError) -> None:
        """Out of descriptors (or another accept failure): try again in a second, say so once a minute."""
        if exc.errno in _OUT_OF_RESOURCES:
            self._exhausted_log(logging.ERROR, "%s: cannot accept connections: %s (%d open here); retrying "
                                "every %g s. Raise LimitNOFILE of gpu-agent.service, or find what holds the "
                                "descriptors in /proc/%d/fd", self.name, exc.strerror or exc, self.connections,
                                _ACCEPT_RETRY_S, os.getpid())
        else:
            self._exhausted_log(logging.ERROR, "%s: accepting a connection failed: %s; retrying every %g s",
                                self.name, exc.strerror or exc, _ACCEPT_RETRY_S)
        self._watch(False)
        self._retry = self._loop.call_later(_ACCEPT_RETRY_S, self._resume)

    def _resume(self) -> None:
        self._retry = None
        self._watch(True)

    def _room_freed(self) -> None:
        if not self._watching and self._retry is None:
            self._watch(True)

    # --- connections -----------------------------------------------------------------------------

    def _opened(self, connection: _Connection) -> None:
        self._open.add(connection)
        self._set_idle(connection)

    def _set_idle(self, connection: _Connection) -> None:
        self._idle[connection] = None
        connection.timer = self._loop.call_later(self.idle_timeout, self._expire, connection)
        self._room_freed()

    def _set_busy(self, connection: _Connection) -> None:
        self._idle.pop(connection, None)
        if connection.timer is not None:
            connection.timer.cancel()
            connection.timer = None

    def _expire(self, connection: _Connection) -> None:
        connection.timer = None
        if connection in self._idle:
            self.timed_out += 1
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        self._forget(connection)
        if connection.transport is not None:
            connection.transport.abort()

    def _forget(self, connection: _Connection) -> None:
        self._set_busy(connection)
        if connection in self._open:
            self._open.discard(connection)
            self._room_freed()
            _garbage.closed()


class _GarbageAfterChurn:
    """Collects the garbage of closed connections soon, not at the next full collection.

    asyncio's socket transport keeps a bound method of itself, so every closed connection is a
    reference cycle, and one that lived a few seconds (idle, slowloris) sits in the oldest
    generation until a full collection, which a big heap makes rare. A burst of those grows the
    heap for good (memory the allocator cannot return), so collect after every `every` closures,
    at most once per `spacing` seconds.
    """

    def __init__(self, every: int = 64, spacing: float = 5.0) -> None:
        self.every = every
        self.spacing = spacing
        self._closed = 0
        self._pending: Optional[asyncio.TimerHandle] = None
        self._last = 0.0

    def closed(self) -> None:
        self._closed += 1
        if self._closed < self.every or self._pending is not None:
            return
        loop = asyncio.get_running_loop()
        self._pending = loop.call_at(max(loop.time(), self._last + self.spacing), self._collect)

    def _collect(self) -> None:
        self._pending, self._closed = None, 0
        self._last = asyncio.get_running_loop().time()
        gc.collect()


_garbage = _GarbageAfterChurn()


class _Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, seen by the listener: when it opens, works, idles, ends."""

    def __init__(self, listener: Listener, inner: asyncio.Protocol) -> None:
        self.listener = listener
        self.inner = inner
        self.transport: Optional[asyncio.Transport] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.requests = 0  # being handled now

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.listener._opened(self)
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.listener._forget(self)
        self.inner.connection_lost(exc)


@contextmanager
def handling_request(transport: Optional[asyncio.BaseTransport]) -> Iterator[None]:
    """Marks the connection busy while its request is handled: not idle, so neither timed out nor evicted."""
    connection = transport.get_protocol() if transport is not None else None
    if not isinstance(connection, _Connection):
        yield
        return
    listener = connection.listener
    connection.requests += 1
    listener._set_busy(connection)
    try:
        yield
    finally:
        connection.requests -= 1
        if connection.requests == 0 and connection in listener._open:
            listener._set_idle(connection)

