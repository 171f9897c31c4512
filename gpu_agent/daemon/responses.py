"""Answers that cost the event loop almost nothing, and a cap on what each endpoint takes on at once.

/status and /metrics are rendered once per version of what they show (the state model as last
published, and for /metrics at most a second old, for its sample age), then served as the cached
bytes: gzipped (once per render) when the client accepts it, with an ETag, and 304 Not Modified to
an If-None-Match that matches. A scrape flood then costs the loop the HTTP exchange, not a render.

Each endpoint answers at most `limit` requests at once (a request counts until its body is written,
so a client that reads slowly holds its place); beyond that it answers 503 with Retry-After at once,
so a flood of one endpoint neither queues without bound nor delays the others or the watchdog.

A handler is a plain function from a `Request` to a `Response`: every answer is ready at once (the
bodies are rendered in memory), and protocol.py writes it.
"""
from __future__ import annotations

import gzip
import hashlib
import struct
import time
import zlib
from collections.abc import Hashable
from typing import Callable, Optional, Sequence, Union
from urllib.parse import parse_qsl

RETRY_AFTER_S = 1
MAX_HEAD_BYTES = 16 * 1024  # a request line and headers longer than this are refused (431; daemon/protocol.py)
# An answer its client has not read for this long gives its place (and its connection) up to a newcomer,
# the one unread longest first. None: a client that reads steadily leaves the unread ones at every read
# and comes back last, so under a flood of clients that never read the newcomers (a probe among them)
# take the places of those, at once, instead of waiting in the kernel's backlog (with a grace of 0.5 s,
# 500 such connections held a probe there for 2.5 s).
UNREAD_GRACE_S = 0.0
_GZIP_LEVEL = 6
TEXT = "text/plain; charset=utf-8"


class Request:
    """What a handler sees of a request: its method, path (percent-decoded), query and headers
    (names in lower case; a repeated header's values joined with ", ")."""

    __slots__ = ("method", "path", "query_string", "headers")

    def __init__(self, method: str, path: str, query_string: str = "", headers: Optional[dict[str, str]] = None
                 ) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers or {}

    @property
    def query(self) -> dict[str, str]:
        """The query's parameters; a bare name (`?verbose`) has the value ""."""
        return dict(parse_qsl(self.query_string, keep_blank_values=True))


class Response:
    """A whole answer: status, body and headers (Content-Length and Connection are the protocol's)."""

    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int = 200, body: bytes = b"", headers: Sequence[tuple[str, str]] = (),
                 content_type: Optional[str] = TEXT) -> None:
        self.status = status
        self.body = body
        self.headers = [("Content-Type", content_type), *headers] if content_type else list(headers)

    @classmethod
    def text(cls, text: str, status: int = 200, headers: Sequence[tuple[str, str]] = ()) -> Response:
        return cls(status, text.encode(), headers)


class Rendered:
    """One rendering of an endpoint's body, with its ETag and (made on first use) its gzip: by `compress`
    where given (gzip_of's parts), else of the whole body."""

    def __init__(self, body: bytes, compress: Optional[Callable[[], bytes]] = None) -> None:
        self.body = body
        self.etag = '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'
        self._compress = compress
        self._gzipped: Optional[bytes] = None

    @property
    def gzipped(self) -> bytes:
        if self._gzipped is None:
            self._gzipped = (self._compress() if self._compress is not None
                             else gzip.compress(self.body, _GZIP_LEVEL, mtime=0))
        return self._gzipped


class Deflated:
    """A body's last part, compressed (on first use) once however many bodies end with it: raw deflate
    ending with the final block."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._deflated: Optional[bytes] = None

    @property
    def deflated(self) -> bytes:
        if self._deflated is None:
            compressor = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
            self._deflated = compressor.compress(self.data) + compressor.flush()
        return self._deflated


# RFC 1952's member header as gzip.compress(mtime=0) writes it: deflate, no flags, no time, OS unknown.
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"


def gzip_of(head: bytes, tail: Deflated) -> bytes:
    """gzip of head + tail.data as one member, compressing only `head`: its deflate blocks end with a sync
    flush (byte-aligned, not final), and tail's own blocks, which refer to nothing before them, follow;
    the trailer's CRC-32 and size are the whole body's."""
    compressor = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
    blocks = compressor.compress(head) + compressor.flush(zlib.Z_SYNC_FLUSH)
    crc = zlib.crc32(tail.data, zlib.crc32(head))
    return _GZIP_HEADER + blocks + tail.deflated + struct.pack("<II", crc, (len(head) + len(tail.data)) & 0xFFFFFFFF)


class RenderCache:
    """The body `render` gives, rendered again only when `version()` changes; a None version means
    "do not cache" (the state before the first reconcile, which changes with every stage)."""

    def __init__(self, render: Callable[[], Union[bytes, Rendered]], version: Callable[[], Optional[Hashable]]
                 ) -> None:
        self._render = render
        self._version = version
        self._cached: Optional[tuple[Hashable, Rendered]] = None
        self.renders = 0

    def get(self) -> Rendered:
        version = self._version()
        if version is not None and self._cached is not None and self._cached[0] == version:
            return self._cached[1]
        body = self._render()
        rendered = body if isinstance(body, Rendered) else Rendered(body)
        self.renders += 1
        self._cached = None if version is None else (version, rendered)
        return rendered


def cached_response(request: Request, rendered: Rendered, content_type: str) -> Response:
    """200 with the body (gzipped when accepted), or 304 when the client holds this version."""
    gzipped = accepts_gzip(request.headers.get("accept-encoding", ""))
    etag = rendered.etag[:-1] + '-gz"' if gzipped else rendered.etag
    headers = [("ETag", etag), ("Vary", "Accept-Encoding"), ("Cache-Control", "no-cache")]
    if etag in _tags(request.headers.get("if-none-match", "")):
        return Response(304, headers=headers, content_type=None)
    if gzipped:
        headers.append(("Content-Encoding", "gzip"))
    return Response(body=rendered.gzipped if gzipped else rendered.body, headers=headers, content_type=content_type)


def accepts_gzip(header: str) -> bool:
    """Whether Accept-Encoding lists gzip (or *) without q=0."""
    for item in header.split(","):
        name, *params = item.split(";")
        if name.strip().lower() in ("gzip", "*"):
            return not any(_is_zero_q(param) for param in params)
    return False


def _is_zero_q(param: str) -> bool:
    key, _, value = param.partition("=")
    try:
        return key.strip().lower() == "q" and float(value) == 0
    except ValueError:
        return False


def _tags(header: str) -> set[str]:
    tags = {tag.strip() for tag in header.split(",")}
    return tags | {tag[2:] for tag in tags if tag.startswith("W/")}


Handler = Callable[[Request], Response]
_BUSY = Response.text("busy: too many requests to this endpoint at once; retry\n", 503,
                      [("Retry-After", str(RETRY_AFTER_S)), ("Cache-Control", "no-store")])


class Capped:
    """An endpoint's handler answering at most `limit` requests at once; 503 with Retry-After beyond.

    `answer` takes a place for the request; whoever writes the answer calls `release` once it is written.
    An answer left unwritten because its client does not read is registered with `unread`: when the
    endpoint is full, the one unread longest (for UNREAD_GRACE_S at least) is evicted for the newcomer.
    """

    def __init__(self, handler: Handler, limit: int) -> None:
        self.handler = handler
        self.limit = limit
        self.busy = 0
        self.shed = 0
        self.evicted = 0
        self._unread: dict[object, tuple[float, Callable[[], None]]] = {}  # oldest first

    def answer(self, request: Request) -> tuple[Response, bool]:
        """The answer, and whether it holds a place (to release once written): not when it is the 503."""
        if self.busy >= self.limit:
            self._evict_unread()
        if self.busy >= self.limit:
            self.shed += 1
            return _BUSY, False
        response = self.handler(request)
        self.busy += 1
        return response, True

    def unread(self, holder: object, evict: Callable[[], None]) -> None:
        """`holder`'s answer waits for its client to read; `evict()` closes that client and releases."""
        self._unread[holder] = (time.monotonic(), evict)

    def release(self, holder: object = None) -> None:
        self._unread.pop(holder, None)
        self.busy -= 1

    def _evict_unread(self) -> None:
        for holder, (since, evict) in self._unread.items():
            if time.monotonic() - since >= UNREAD_GRACE_S:
                self.evicted += 1
                evict()
                self._unread.pop(holder, None)
            return
