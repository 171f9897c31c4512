"""Accepting the local HTTP endpoint's connections so that no local user can exhaust the daemon.

asyncio's own accept loop caps nothing, never times out a client that does not finish its request,
and on running out of descriptors logs a traceback for every failed accept (CPython 3.11 also
schedules a retry for each). A `Listener` owns one listening socket instead:

- it holds at most `limit` connections; a new one closes a connection whose request the protocol
  refused (it only drops what that client still sends), or one whose client has ended its sending
  while its requests wait for their turn (gone, most likely: a flood of pipelined requests from
  clients that close at once would otherwise hold every place), else the longest-idle connection (one without
  a request the protocol parsed) to make room, or waits in the kernel's backlog while every connection
  has a request being answered or parsed and waiting to be. Only the protocol says what a request is:
  header ends in bytes it drops or skips are none;
- a connection whose client pipelined more than one request's worth (two heads' ends or more) and
  already ended its sending is closed as it is accepted (errors: reason gone_at_accept): a flood of such
  clients fills the kernel's accept queue faster than taking each on could empty it, and a probe's
  connection was dropped there, waiting out TCP's 1 s retransmit;
- a connection that has not sent a whole request within `idle_timeout` of connecting or of its
  previous answer is closed (slowloris, forgotten keep-alives); on TCP the kernel keeps connections
  that send nothing out of the accept queue for that long (TCP_DEFER_ACCEPT), so a flood of idle
  connections never stands between a probe and its answer;
- a connection whose client does not read its answer (the kernel's buffers are full and the
  transport holds the rest) for UNREAD_GRACE_S may be closed for a newcomer, as an idle one is; and
  the answers its connections hold unwritten are MAX_UNWRITTEN_BYTES at most: beyond, the one unread
  longest is closed. Both are counted (errors: reason unread_evicted, unwritten_cap), not logged;
- out of descriptors, it stops accepting for a second and says so once a minute.

The limit is computed from RLIMIT_NOFILE so that the listeners never take more than half of the
descriptors: the other half stays free for the stages' files, subprocesses and NVML.
"""
from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import logging
import math
import os
import resource
import select
import socket
import struct
import termios
import time
from collections import Counter
from typing import Any, Callable, Optional

from gpu_agent.daemon import responses
from gpu_agent.host.memory import give_back

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 5.0  # to send a complete request, after connecting or after the previous response
MAX_CONNECTIONS = 64  # per listener, however high the descriptor limit
_ACCEPT_BATCH = 16  # accepts per wake-up, before the connections they replace are closed
_ACCEPT_RETRY_S = 1.0
_EVICT_AFTER_S = 0.1  # a client sends its request right after connecting: do not evict it before
# The kernel's send buffer of each connection, fixed instead of autotuned (on loopback up to 4 MiB): a
# client that does not read then holds at most this much in the kernel, and its pipelined requests wait
# for it to read instead of each answer being copied into a buffer nobody empties.
SEND_BUFFER_BYTES = 16 << 10
MAX_UNWRITTEN_BYTES = 8 << 20  # answers held for clients that do not read, per listener
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

    def __init__(self, period: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 logger: Optional[logging.Logger] = None) -> None:
        self.period = period
        self._log = logger or log
        self._clock = clock
        self._next = 0.0
        self._held = 0

    def __call__(self, level: int, message: str, *args: Any, exc_info: bool = False) -> None:
        now = self._clock()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            message += f" ({self._held} more like this since the last one)"
        self._next, self._held = now + self.period, 0
        self._log.log(level, message, *args, exc_info=exc_info)


class Listener:
    """One listening socket, its accept loop, and the connections accepted from it."""

    def __init__(self, sock: socket.socket, protocol_factory: Callable[[], asyncio.Protocol], name: str,
                 limit: int, idle_timeout: float = IDLE_TIMEOUT_S, errors: Optional[Counter[str]] = None) -> None:
        self.sock = sock
        self.name = name
        self.limit = limit
        self.idle_timeout = idle_timeout
        self._factory = protocol_factory
        self._full_log = OncePer()
        self._exhausted_log = OncePer()
        self._loop = asyncio.get_running_loop()
        self._open: set[_Connection] = set()
        # Connections without a request, longest idle first, and when they became idle; those whose
        # request the protocol refused, and those accepted without a byte after TCP_DEFER_ACCEPT's wait,
        # are kept apart: they go first.
        self._idle: dict[_Connection, float] = {}
        self._stale: dict[_Connection, None] = {}
        # Connections whose answer waits for its client to read, and since when, longest first.
        self._unread: dict[_Connection, float] = {}
        self.errors: Counter[str] = Counter() if errors is None else errors
        self._attaching: set[asyncio.Task[Any]] = set()
        self._retry: Optional[asyncio.TimerHandle] = None
        self._recheck: Optional[asyncio.TimerHandle] = None
        self._watching = False
        self._garbage = _GarbageAfterChurn(self._loop)
        self.evicted = 0
        self.timed_out = 0
        sock.setblocking(False)
        self._deferred = sock.family in (socket.AF_INET, socket.AF_INET6) and hasattr(socket, "TCP_DEFER_ACCEPT")
        if self._deferred:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, max(1, math.ceil(idle_timeout)))

    @property
    def connections(self) -> int:
        return len(self._open) + len(self._attaching)

    def start(self) -> None:
        self._watch(True)

    @property
    def answering(self) -> int:
        """Connections with a request being answered (its answer not yet written)."""
        return sum(1 for connection in self._open if connection.handling)

    def stop_accepting(self) -> None:
        """Close the listening socket; the connections already open go on."""
        for timer in (self._retry, self._recheck):
            if timer is not None:
                timer.cancel()
        self._retry = self._recheck = None
        self._watch(False)
        self.sock.close()

    def close(self) -> None:
        """Stop accepting and close every connection, answers being written included."""
        self.stop_accepting()
        self._garbage.cancel()
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
            evict = self._evictable() if self.connections >= self.limit else None
            if self.connections >= self.limit and evict is None:
                self._watch(False)  # until a connection closes, or turns out to be idle (_room_freed)
                self._full_log(logging.WARNING, "%s: all %d connections have a request being answered or "
                               "on its way (the limit); new ones wait", self.name, self.limit)
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
            pending = _unread_bytes(conn)
            if _gone_after_pipelining(conn, pending):  # before any other makes room for it
                self.errors["gone_at_accept"] += 1
                conn.close()
                continue
            if evict is not None and evict in self._unread:
                self.errors["unread_evicted"] += 1
                self._drop(evict)
            elif evict is not None:
                self.evicted += 1
                self._drop(evict)
                self._full_log(logging.WARNING, "%s: %d connections open (the limit); closing the longest idle "
                               "ones to make room", self.name, self.limit)
            # Nothing sent yet although TCP_DEFER_ACCEPT held it back for idle_timeout: first to go
            # (unless its bytes turn up first: under a flood, SYN cookies let connections through early).
            stale = self._deferred and not pending
            conn.setblocking(False)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            task = self._loop.create_task(self._attach(conn, stale))
            self._attaching.add(task)
            task.add_done_callback(self._attached)

    async def _attach(self, conn: socket.socket, stale: bool) -> None:
        try:
            await self._loop.connect_accepted_socket(lambda: _Connection(self, self._factory(), stale), conn)
        except (OSError, ValueError) as exc:  # the client left already
            log.debug("%s: dropping a connection before it started: %s", self.name, exc)
            conn.close()

    def _attached(self, task: asyncio.Task[Any]) -> None:
        self._attaching.discard(task)
        self._room_freed()

    def _evictable(self) -> Optional[_Connection]:
        """A refused or stale connection; else the longest idle one, except one that has sent nothing for
        less than _EVICT_AFTER_S (a client sends its request right after connecting) and one whose bytes
        the loop has not read yet (likely a request: a burst of connections can arrive faster than the
        loop reads)."""
        stale = next(iter(self._stale), None) or self._gone_while_waiting()
        if stale is not None:
            return stale
        now = self._loop.time()
        youngest_protected: Optional[float] = None
        for connection, since in self._idle.items():
            if not connection.partial and now - since < _EVICT_AFTER_S:
                youngest_protected = youngest_protected or since
                continue
            sock = connection.transport.get_extra_info("socket") if connection.transport else None
            if sock is None or not _unread_bytes(sock):
                return connection
        recheck = None if youngest_protected is None else youngest_protected + _EVICT_AFTER_S
        for connection, since in self._unread.items():  # no idle one: a client that does not read
            if now - since >= responses.UNREAD_GRACE_S:
                return connection
            recheck = min(recheck or math.inf, since + responses.UNREAD_GRACE_S)
            break
        if recheck is not None and self._recheck is None:
            self._recheck = self._loop.call_at(recheck, self._rechecked)
        return None

    def _gone_while_waiting(self) -> Optional[_Connection]:
        """Connections whose requests wait for their turn are not read meanwhile (the protocol's rule), so
        their client's end of sending or reset is not seen by a read: the kernel says so instead, and
        they are ended (_ended), the first to make room. A flood of pipelined requests from clients that
        close at once filled every place with such connections, and the kernel's backlog behind them
        overflowed, dropping a probe's connection for a second."""
        waiting = {}
        for connection in self._open:
            sock = connection.transport.get_extra_info("socket") if connection.transport else None
            if connection.arrived and not connection.handling and not connection.ended and sock is not None:
                waiting[sock.fileno()] = connection
        if not waiting:
            return None
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLRDHUP)  # POLLHUP and POLLERR are always reported
        for fd, _ in poller.poll(0):
            waiting[fd].ended = True
            self._ended(waiting[fd])
        return next(iter(self._stale), None)

    def _rechecked(self) -> None:
        self._recheck = None
        self._room_freed()

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
        self._start_timer(connection)
        if connection.stale:
            self._stale[connection] = None
            self._room_freed()
        else:
            self._set_idle(connection)

    def _set_idle(self, connection: _Connection) -> None:
        connection.partial = False
        if connection.refused:  # answered and dropping the rest: the first to make room
            self._stale[connection] = None
        else:
            self._idle[connection] = self._loop.time()
        self._room_freed()

    def _ended(self, connection: _Connection) -> None:
        """The client ended its sending: while its requests wait for their turn, it makes room first."""
        if connection.arrived and not connection.handling and connection in self._open:
            self._stale[connection] = None
            self._room_freed()

    def _not_idle(self, connection: _Connection) -> None:
        self._idle.pop(connection, None)
        self._stale.pop(connection, None)

    def _answer_unread(self, connection: _Connection) -> None:
        """The connection's answer waits for its client to read: evictable after UNREAD_GRACE_S, and
        if the answers held so pass MAX_UNWRITTEN_BYTES, the others unread longest are closed now."""
        self._unread.setdefault(connection, self._loop.time())
        held = {c: c.transport.get_write_buffer_size() for c in self._unread if c.transport is not None}
        total = sum(held.values())
        for other, size in held.items():
            if total <= MAX_UNWRITTEN_BYTES:
                break
            if other is not connection:
                total -= size
                self.errors["unwritten_cap"] += 1
                self._drop(other)

    def _answer_read(self, connection: _Connection) -> None:
        self._unread.pop(connection, None)

    def _request_parsed(self, connection: _Connection) -> None:
        self._not_idle(connection)
        if connection.ended:
            self._ended(connection)

    def _request_started(self, connection: _Connection) -> None:
        self._not_idle(connection)
        self._stop_timer(connection)

    def _request_done(self, connection: _Connection) -> None:
        if connection in self._open:
            self._start_timer(connection)
            if not connection.arrived:
                self._set_idle(connection)
            elif connection.ended:
                self._ended(connection)

    def _start_timer(self, connection: _Connection) -> None:
        """The next request must have arrived and started within idle_timeout (slowloris)."""
        self._stop_timer(connection)
        connection.timer = self._loop.call_later(self.idle_timeout, self._expire, connection)

    def _stop_timer(self, connection: _Connection) -> None:
        if connection.timer is not None:
            connection.timer.cancel()
            connection.timer = None

    def _expire(self, connection: _Connection) -> None:
        connection.timer = None
        if connection in self._open and not connection.handling:
            self.timed_out += 1
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        self._forget(connection)
        if connection.transport is not None:
            connection.transport.abort()

    def _forget(self, connection: _Connection) -> None:
        self._not_idle(connection)
        self._unread.pop(connection, None)
        self._stop_timer(connection)
        if connection in self._open:
            self._open.discard(connection)
            self._room_freed()
            self._garbage.closed()


class _GarbageAfterChurn:
    """Collects the garbage of closed connections soon, not at the next full collection.

    asyncio's socket transport keeps a bound method of itself, so every closed connection is a
    reference cycle, and one that lived a few seconds (idle, slowloris) sits in the oldest
    generation until a full collection, which a big heap makes rare. A burst of those grows the
    heap for good (memory the allocator cannot return), so collect after every `every` closures,
    at most once per `spacing` seconds. (The daemon freezes its start-up objects, so a full
    collection only walks what was allocated since: about a millisecond.)
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, every: int = 32, spacing: float = 1.0) -> None:
        self._loop = loop
        self.every = every
        self.spacing = spacing
        self._closed = 0
        self._pending: Optional[asyncio.TimerHandle] = None
        self._last = 0.0

    def closed(self) -> None:
        self._closed += 1
        if self._closed >= self.every and self._pending is None:
            self._pending = self._loop.call_at(max(self._loop.time(), self._last + self.spacing), self._collect)

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    def _collect(self) -> None:
        self._pending, self._closed = None, 0
        self._last = self._loop.time()
        gc.collect()
        give_back()  # and what the collection freed leaves the resident set (RSS back to idle after a flood)


class _Connection(asyncio.BufferedProtocol):
    """The HTTP protocol of one connection, seen by the listener: when it opens, works, idles, ends.

    A connection is idle, and evictable, until the protocol has parsed a whole request from it (what
    the protocol refuses or skips is none): one whose parsed request waits for its turn is kept, so a
    burst of real requests is served in turn instead of evicting itself. A connection whose request
    was refused is evictable first. The idle timer stops only while a request is handled.
    """

    def __init__(self, listener: Listener, inner: asyncio.Protocol, stale: bool = False) -> None:
        self.listener = listener
        self.inner = inner
        self.stale = stale  # accepted without a byte after TCP_DEFER_ACCEPT's wait, no request since
        self.transport: Optional[asyncio.Transport] = None
        self.timer: Optional[asyncio.TimerHandle] = None
        self.partial = False  # bytes have arrived since the last request, not a whole request
        self.arrived = 0  # requests parsed, waiting for their turn (request_parsed)
        self.handling = 0  # requests being handled
        self.requests = 0  # requests the protocol has parsed in all
        self.refused = False  # the protocol refused a request: what the client still sends is dropped
        self.ended = False  # the client ended its sending (EOF): gone, or half-closed waiting for answers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.listener._opened(self)
        self.inner.connection_made(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        """Every connection reads into one buffer (each read is handled before the next), not into a new
        256 KiB allocation per read as with asyncio's plain Protocol (an mmap, a page fault, a munmap)."""
        return _READ_BUFFER

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(_READ_BUFFER[:nbytes]))

    def data_received(self, data: bytes) -> None:
        requests = self.requests
        self.inner.data_received(data)
        if self.requests == requests and not self.handling and not self.arrived:
            self.partial = True  # a real client sends its request at once: no grace for a trickle
            self.listener._room_freed()  # read, and still idle: evictable again

    def eof_received(self) -> Optional[bool]:
        self.ended = True
        self.listener._ended(self)
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.listener._answer_unread(self)
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.listener._answer_read(self)
        self.inner.resume_writing()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.listener._forget(self)
        self.transport = None
        self.inner.connection_lost(exc)


_READ_BUFFER = memoryview(bytearray(64 * 1024))


def _gone_after_pipelining(sock: socket.socket, pending: int) -> bool:
    """Whether a connection, before it is taken on, holds more than one request's worth of unread bytes
    (`pending`) with two request heads' ends or more in them, from a client that has already ended its
    sending. Such a client
    has left without reading (a flood's) or, at the very least, answers to it would only fill buffers: it
    is closed at accept, for ~20 us, instead of a transport and a protocol made for it (~400 us). One
    oversize head is not that (it is answered 431), nor a client that pipelines a little; clients that
    pipeline more than 16 KiB before reading a byte and half-close meanwhile are none of this endpoint's
    (Prometheus, curl, the kubelet's probes, the shim)."""
    if pending <= responses.MAX_HEAD_BYTES:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP)  # POLLHUP and POLLERR are always reported
    if not poller.poll(0):
        return False
    try:
        head = sock.recv(2 * responses.MAX_HEAD_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False
    return head.count(b"\r\n\r\n") >= 2


def _unread_bytes(sock: Any) -> int:
    """Bytes received by the kernel that nobody has read yet (a socket or asyncio's wrapper of one)."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def _connection_of(transport: Optional[asyncio.BaseTransport]) -> Optional[_Connection]:
    connection = transport.get_protocol() if transport is not None else None
    return connection if isinstance(connection, _Connection) else None


def request_parsed(transport: Optional[asyncio.BaseTransport]) -> None:
    """The protocol has parsed a whole request that waits for its turn (request_started): the connection
    is not idle, and not evicted, meanwhile."""
    connection = _connection_of(transport)
    if connection is not None:
        connection.arrived += 1
        connection.listener._request_parsed(connection)


def request_started(transport: Optional[asyncio.BaseTransport], refused: bool = False) -> Callable[[], None]:
    """Marks the connection busy with one request the protocol parsed (never evicted, no idle timer) until
    the function returned is called, once its answer is written. `refused`: the request is refused and
    the connection only drops what its client still sends: once answered, it is the first to make room."""
    connection = _connection_of(transport)
    if connection is None:
        return _nothing
    listener = connection.listener
    connection.arrived = max(0, connection.arrived - 1)
    connection.handling += 1
    connection.requests += 1
    connection.stale = connection.partial = False
    connection.refused = connection.refused or refused
    listener._request_started(connection)

    def finished() -> None:
        connection.handling -= 1
        if not connection.handling:
            listener._request_done(connection)

    return finished


def _nothing() -> None:
    pass
