"""The daemon's config, without pydantic or PyYAML in the daemon's process.

`gpu-agent run` and a SIGHUP reload call start(): a file validated before (the cache, config/cache.py)
is read back at once; any other is validated by a child, which runs config/loader.py (pydantic) and
answers the config's canonical JSON, or the ConfigError's text with exit status INVALID. The daemon
builds the dataclasses from that JSON (config/build.py) and remembers it (config/cache.py). The CLI's
one-shot commands validate in their own process (config/loader.py), as they exit anyway.

Which child, by measurement (this 2-core machine, pinned to one core, a minimal config): a new
interpreter (`python -m gpu_agent.config.validate PATH`) costs 185-265 ms of CPU, as it starts Python
and imports gpu_agent's config again; os.fork() at start costs 83-85 ms, the same as validating in
the daemon's own process. So `gpu-agent run` forks, before it imports the daemon (it is single-threaded
then, and the validation runs beside those imports on the other core). A reload spawns the new
interpreter: the daemon has threads by then, and a forked copy of one of them could deadlock on a lock
another held.

A child that fails for another reason (killed, timed out, unreadable output) is not a verdict on the
file: the daemon then validates in its own process, paying pydantic's memory rather than refusing a
config it cannot judge."""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from gpu_agent.config.build import NotAConfig
from gpu_agent.config.cache import Validated, cache_key, read_cache, write_cache
from gpu_agent.config.loaded import (BUILT_IN, LoadedConfig, canonical_json, from_canonical, loaded,
                                     text_sha256)
from gpu_agent.config.schema import AgentConfig
from gpu_agent.config.text import read_config_text
from gpu_agent.errors import AgentError, ConfigError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root

INVALID = 65  # the child's exit status for an invalid file (sysexits' EX_DATAERR); its stdout says why
CHILD_TIMEOUT = 60.0  # seconds; the child takes about 0.3 s on an idle core
log = logging.getLogger(__name__)


class Loading:
    """A config being loaded for the daemon: result() gives it, or raises ConfigError naming what is wrong."""

    def __init__(self, path: Path, required: bool, root: Root, fork: bool = False) -> None:
        self.path, self.required, self.root = path, required, root
        self._error: Optional[ConfigError] = None
        self._done: Optional[Validated] = None
        self._child: Optional[Union[proc.Started, proc.Forked]] = None
        self._missing = False  # an optional file that is not there: the built-in defaults
        self._text_sha256: Optional[str] = None
        try:
            text = read_config_text(path)
        except ConfigError as exc:
            self._error = exc
            return
        if text is None:
            self._error = ConfigError(f"{path}: no such file") if required else None
            self._missing = not required
            return
        self._text_sha256 = text_sha256(text)
        self._done = read_cache(root, cache_key(path, self._text_sha256))
        if self._done is None:
            try:
                if fork:
                    self._child = proc.fork(f"validating {path}", lambda: _verdict(path), CHILD_TIMEOUT)
                else:
                    self._child = proc.start([sys.executable, "-m", __name__, str(path)], CHILD_TIMEOUT,
                                             env=child_environment())
            except (AgentError, OSError) as exc:
                log.warning("cannot start the config validation child (%s); validating in this process", exc)

    def result(self) -> LoadedConfig:
        if self._error is not None:
            raise self._error
        if self._missing:
            return loaded(AgentConfig(), BUILT_IN)
        validated = self._done or self._from_child()
        for warning in validated.warnings:
            log.warning("%s", warning)
        return loaded(validated.config, str(self.path), self._text_sha256)

    def _from_child(self) -> Validated:
        try:
            if self._child is None:
                raise AgentError("no validation child")
            done = self._child.wait()
            if done.returncode == INVALID:
                raise ConfigError(done.stdout.strip() or f"{self.path}: invalid")
            if done.returncode != 0:
                raise AgentError(f"exit status {done.returncode}: {done.stderr.strip()[-500:]}")
            answer = json.loads(done.stdout)
            settings, warnings, answered_sha256 = answer["config"], answer["warnings"], answer["sha256"]
            config = from_canonical(settings)
        except (AgentError, NotAConfig, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            log.warning("the config validation child failed (%s); validating %s in this process", exc, self.path)
            return self._in_process()
        write_cache(self.root, cache_key(self.path, answered_sha256), settings, list(warnings))
        return Validated(config, list(warnings))

    def _in_process(self) -> Validated:
        from gpu_agent.config.loader import check_config

        text = read_config_text(self.path)
        if text is None:
            raise ConfigError(f"{self.path}: no such file")
        return Validated(*check_config(text, str(self.path)))


def start(path: Path, required: bool, root: Root, fork: bool = False) -> Loading:
    """Begin loading the config at `path` for the daemon (a missing file gives the built-in defaults
    unless `required`); Loading.result() waits for it. `fork`: validate in a forked child rather than a
    new interpreter, only while this process has a single thread (gpu-agent run's start)."""
    return Loading(path, required, root, fork)


def load_daemon_config(path: Path, required: bool, root: Root) -> LoadedConfig:
    """The config at `path`, as start() then result() give it: for a reload, run in a worker thread."""
    return start(path, required, root).result()


def reload_config(path: Path, required: bool, root: Root, running: LoadedConfig) -> Optional[LoadedConfig]:
    """A SIGHUP's config: None when the file still holds exactly the text `running` came from (or is still
    absent, for the built-in defaults), as there is nothing to load; else load_daemon_config's answer."""
    try:
        text = read_config_text(path)
    except ConfigError:
        text, unchanged = None, False
    else:
        unchanged = (running.source == BUILT_IN if text is None
                     else running.source == str(path) and running.text_sha256 == text_sha256(text))
    return None if unchanged else load_daemon_config(path, required, root)


def child_environment() -> dict[str, str]:
    """What the validation interpreter needs to import what this process imports: the packaged agent's
    launcher (/usr/bin/gpu-agent) puts its private site directories on sys.path itself, which a new
    interpreter would not see, and writes no bytecode there."""
    env = {"PYTHONPATH": os.pathsep.join(entry for entry in sys.path if entry)}
    if sys.dont_write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _verdict(path: Path) -> tuple[int, str]:
    """What the child answers about the file at `path`: 0 and its canonical JSON (with the sha256 of the
    text validated, and the warnings), or INVALID and why."""
    from gpu_agent.config.loader import check_config

    try:
        text = read_config_text(path)
        if text is None:
            raise ConfigError(f"{path}: no such file")
        config, warnings = check_config(text, str(path))
    except ConfigError as exc:
        return INVALID, str(exc)
    answer: dict[str, Any] = {"sha256": text_sha256(text), "config": json.loads(canonical_json(config)),
                              "warnings": warnings}
    return 0, json.dumps(answer)


def main(argv: Sequence[str]) -> int:
    """The child: validate the file argv[0] names; print its canonical JSON, or why it is invalid."""
    code, text = _verdict(Path(argv[0]))
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
