"""The local, read-only HTTP endpoint: /healthz, /readyz, /status, /metrics on TCP and a unix socket.

Only GET (and HEAD) routes exist: nothing that changes the host is reachable over HTTP.
"""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Callable, Optional

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from gpu_agent.config.schema import HttpConfig
from gpu_agent.metrics.exporter import render
from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)


def build_app(state: AgentState, registry: CollectorRegistry, loop_alive: Callable[[], bool]) -> web.Application:
    async def index(request: web.Request) -> web.Response:
        return web.Response(text="gpu-agent: /healthz /readyz /readyz?verbose /status /metrics\n")

    async def healthz(request: web.Request) -> web.Response:
        if not loop_alive():
            return web.Response(status=500, text="reconcile loop stopped\n")
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        checks = state.checks() if state.first_reconcile_done else []
        ready = state.ready
        if "verbose" in request.query or not ready:
            lines = [f"[+]{c.name} ok" if c.ok else f"[-]{c.name} failed: {c.reason}" for c in checks]
            if not state.first_reconcile_done:
                lines.append("[-]startup failed: first reconcile in progress")
            lines.append("readyz check passed" if ready else "readyz check failed")
            return web.Response(status=200 if ready else 503, text="\n".join(lines) + "\n")
        return web.Response(text="ok\n")

    async def status(request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(state.to_json(), indent=2) + "\n", content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        response = web.Response(body=render(registry))
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    return app


class HttpServer:
    def __init__(self, app: web.Application, root: Root) -> None:
        self.root = root
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._sites: list[web.BaseSite] = []
        self.settings: Optional[HttpConfig] = None

    async def start(self, settings: HttpConfig) -> None:
        """Serve on the configured TCP address and unix socket; a bind failure raises AgentError."""
        if not self._runner.server:
            await self._runner.setup()
        sites: list[web.BaseSite] = []
        try:
            if settings.listen:
                sites.append(await self._serve(
                    web.TCPSite(self._runner, settings.host, settings.port, reuse_address=True),
                    f"{settings.listen} (http.listen)",
                ))
            if settings.socket:
                path = self.root(settings.socket)
                _remove_stale_socket(path)
                path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
                sites.append(await self._serve(web.UnixSite(self._runner, str(path)), f"{path} (http.socket)"))
                os.chmod(path, 0o660)
        except AgentError:
            for site in sites:
                await site.stop()
            raise
        self._sites, self.settings = sites, settings
        log.info("serving /healthz /readyz /status /metrics on %s",
                 ", ".join(site.name for site in sites) or "nothing (http.listen and http.socket are off)")

    @staticmethod
    async def _serve(site: web.BaseSite, where: str) -> web.BaseSite:
        try:
            await site.start()
        except OSError as exc:
            raise AgentError(f"cannot serve HTTP on {where}: {exc.strerror or exc}") from None
        return site

    async def restart(self, settings: HttpConfig) -> None:
        """Move to new addresses; on failure keep serving on the old ones and raise."""
        if settings == self.settings:
            return
        old, old_settings = self._sites, self.settings
        for site in old:
            await site.stop()
        try:
            await self.start(settings)
        except AgentError:
            if old_settings is not None:
                await self.start(old_settings)
            raise

    async def stop(self) -> None:
        await self._runner.cleanup()
        if self.settings and self.settings.socket:
            _remove_stale_socket(self.root(self.settings.socket))


def _remove_stale_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
