"""The validated-config cache: what validating a config file gave, so that the daemon's next start or
reload with the same file needs no validation (no child, no pydantic).

One entry, <root>/var/lib/gpu-agent/config.validated.json, keyed by the config file's path and the
sha256 of its bytes, the agent's version and a digest of the schema's source (config/*.py): an edit,
an upgrade or another file never reuses a result. The cache is an optimisation, never an input: an
entry is used only when its checksum holds, its settings have exactly the schema's shape, and they
read back to the very JSON stored; anything else is a miss, and the file is validated again."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any, NamedTuple, Optional

from gpu_agent import __version__
from gpu_agent.config.build import NotAConfig
from gpu_agent.config.loaded import from_canonical
from gpu_agent.config.schema import AgentConfig
from gpu_agent.config.text import read_config_text
from gpu_agent.errors import AgentError, ConfigError
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root

CACHE_PATH = "/var/lib/gpu-agent/config.validated.json"
FORMAT = 1
log = logging.getLogger(__name__)


class Validated(NamedTuple):
    config: AgentConfig
    warnings: list[str]  # deprecated keys, logged at every load as when it was validated


def cache_key(path: Path, text_sha256: str) -> str:
    """What a validation result depends on: the file (name and bytes), this agent and its schema."""
    parts = (str(FORMAT), __version__, schema_digest(), str(path), text_sha256)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@functools.cache
def schema_digest() -> str:
    """sha256 of the config package's source: a changed schema, check or message misses the cache."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def read_cache(root: Root, key: str) -> Optional[Validated]:
    """The cached result for `key`, or None: missing, for another key, damaged or not this schema's."""
    path = root(CACHE_PATH)
    try:
        text = read_config_text(path)  # bounded, and never blocks on a FIFO
        if text is None:
            return None
        entry = json.loads(text, parse_constant=_no_constant)
    except (ConfigError, ValueError) as exc:
        log.info("%s: ignored, validating the config again: %s", path, exc)
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    settings: Any = entry.get("config")
    warnings: Any = entry.get("warnings")
    if entry.get("checksum") != _checksum(key, settings, warnings) or not _strings(warnings):
        log.info("%s: ignored (damaged), validating the config again", path)
        return None
    try:
        config = from_canonical(settings)
    except NotAConfig as exc:
        log.info("%s: ignored (not this schema's: %s), validating the config again", path, exc)
        return None
    return Validated(config, list(warnings))


def write_cache(root: Root, key: str, settings: Any, warnings: list[str]) -> None:
    """Remember a validation's result (`settings`: the config's canonical JSON, parsed); a failure to
    write only costs the next load a validation."""
    entry = {"format": FORMAT, "key": key, "config": settings, "warnings": warnings,
             "checksum": _checksum(key, settings, warnings)}
    try:
        atomic_write(root(CACHE_PATH), json.dumps(entry, sort_keys=True) + "\n", mode=0o600)
    except (OSError, AgentError) as exc:
        log.info("cannot write %s (the next load validates again): %s", root(CACHE_PATH), exc)


def _checksum(key: str, settings: Any, warnings: Any) -> str:
    text = json.dumps([key, settings, warnings], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a setting's value")


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)
