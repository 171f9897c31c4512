"""Waking a daemon task when files change: inotify on the directories that hold them, so an idle
agent sleeps until something happens; polling every `poll` seconds only where inotify cannot be had."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Iterable, Optional

from gpu_agent.host.inotify import DirectoryWatch

log = logging.getLogger(__name__)

_SETTLE_S = 0.05  # an editor's save or a rename is several events: look once they are all in


class FileChanges:
    def __init__(self, what: str, poll: float) -> None:
        self.what = what
        self.poll = poll
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._inotify: Optional[DirectoryWatch] = None
        try:
            self._inotify = DirectoryWatch()
        except OSError as exc:
            self._fall_back(exc)
        else:
            self._loop.add_reader(self._inotify.fileno(), self._readable)

    def watch_for(self, paths: Iterable[Path]) -> None:
        """Wake for changes of these files (a missing one: when it or its directory appears)."""
        if self._inotify is not None:
            try:
                self._inotify.watch_for(paths)
            except OSError as exc:  # the watch limit (fs.inotify.max_user_watches) reached
                self.close()
                self._fall_back(exc)

    async def wait(self) -> None:
        """Until something may have changed under the watched directories."""
        if self._inotify is None:
            await asyncio.sleep(self.poll)
            return
        await self._changed.wait()
        await asyncio.sleep(_SETTLE_S)
        self._changed.clear()

    def close(self) -> None:
        if self._inotify is not None:
            self._loop.remove_reader(self._inotify.fileno())
            self._inotify.close()
            self._inotify = None

    def _readable(self) -> None:
        if self._inotify is not None and self._inotify.drain():
            self._changed.set()

    def _fall_back(self, exc: OSError) -> None:
        log.warning("%s: cannot watch with inotify (%s); checking every %g s instead", self.what,
                    exc.strerror or exc, self.poll)
