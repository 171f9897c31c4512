"""Answers that cost the event loop almost nothing, and a cap on what each endpoint takes on at once.

/status and /metrics are rendered once per version of what they show (the state model as last
published, and for /metrics at most a second old, for its sample age), then served as the cached
bytes: gzipped (once per render) when the client accepts it, with an ETag, and 304 Not Modified to
an If-None-Match that matches. A scrape flood then costs the loop the HTTP exchange, not a render.

Each endpoint answers at most `limit` requests at once (a request counts until its body is written,
so a client that reads slowly holds its place); beyond that it answers 503 with Retry-After at once,
so a flood of one endpoint neither queues without bound nor delays the others or the watchdog.
"""
from __future__ import annotations

import gzip
import hashlib
from collections.abc import Hashable
from typing import Awaitable, Callable, Optional

from gpu_agent.daemon.web import web

RETRY_AFTER_S = 1
_GZIP_LEVEL = 6


class Rendered:
    """One rendering of an endpoint's body, with its ETag and (made on first use) its gzip."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.etag = '"' + hashlib.blake2b(body, digest_size=12).hexdigest() + '"'
        self._gzipped: Optional[bytes] = None

    @property
    def gzipped(self) -> bytes:
        if self._gzipped is None:
            self._gzipped = gzip.compress(self.body, _GZIP_LEVEL, mtime=0)
        return self._gzipped


class RenderCache:
    """The body `render` gives, rendered again only when `version()` changes; a None version means
    "do not cache" (the state before the first reconcile, which changes with every stage)."""

    def __init__(self, render: Callable[[], bytes], version: Callable[[], Optional[Hashable]]) -> None:
        self._render = render
        self._version = version
        self._cached: Optional[tuple[Hashable, Rendered]] = None
        self.renders = 0

    def get(self) -> Rendered:
        version = self._version()
        if version is not None and self._cached is not None and self._cached[0] == version:
            return self._cached[1]
        rendered = Rendered(self._render())
        self.renders += 1
        self._cached = None if version is None else (version, rendered)
        return rendered


def cached_response(request: web.Request, rendered: Rendered, content_type: str) -> web.Response:
    """200 with the body (gzipped when accepted), or 304 when the client holds this version."""
    gzipped = accepts_gzip(request.headers.get("Accept-Encoding", ""))
    etag = rendered.etag[:-1] + '-gz"' if gzipped else rendered.etag
    headers = {"ETag": etag, "Vary": "Accept-Encoding", "Cache-Control": "no-cache"}
    if etag in _tags(request.headers.get("If-None-Match", "")):
        return web.Response(status=304, headers=headers)
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    response = web.Response(body=rendered.gzipped if gzipped else rendered.body, headers=headers)
    response.headers["Content-Type"] = content_type
    return response


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


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Capped:
    """An endpoint's handler answering at most `limit` requests at once; 503 with Retry-After beyond."""

    def __init__(self, handler: Handler, limit: int) -> None:
        self.handler = handler
        self.limit = limit
        self.busy = 0
        self.shed = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.busy >= self.limit:
            self.shed += 1
            return web.Response(status=503, text="busy: too many requests to this endpoint at once; retry\n",
                                headers={"Retry-After": str(RETRY_AFTER_S), "Cache-Control": "no-store"})
        self.busy += 1
        try:
            response = await self.handler(request)
            await response.prepare(request)  # the body is written while this request holds its place
            await response.write_eof()
            return response
        finally:
            self.busy -= 1
