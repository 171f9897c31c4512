"""Reading a config file, bounded, and quoting values in messages: what the config loader shares with the
light readers (config/endpoint.py) that must not import pydantic."""
from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from gpu_agent.errors import ConfigError
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded

DEFAULT_CONFIG_PATH = "/etc/gpu-agent/config.yaml"
MAX_CONFIG_BYTES = 256 * 1024  # a full config is about 5 KiB; this bounds the cost of any file


def shown(value: Any, limit: int = 60) -> str:
    """`value` for an error message: repr'd, and cut short so a huge value cannot flood the output."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def read_config_text(path: Path, option: str = "--config") -> str | None:
    """The file's text, or None when it does not exist. Only a regular file of at most MAX_CONFIG_BYTES
    is read: a FIFO, a device or a directory is refused without blocking or reading from it. `option`
    names what gave the path, for the message."""
    try:
        data = read_bounded(path, MAX_CONFIG_BYTES)
    except NotRegular as exc:
        raise ConfigError(f"{path}: not a regular file (it is {_file_kind(exc.mode)}); "
                          f"{option} must name a YAML file") from None
    except TooLarge as exc:
        if exc.size is None:  # it grew while we read it
            raise ConfigError(f"{path}: more than {MAX_CONFIG_BYTES} bytes is too large for a config file") from None
        raise ConfigError(f"{path}: {exc.size} bytes is too large for a config file "
                          f"(at most {MAX_CONFIG_BYTES}); is this the right file?") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {exc.start}); is this the right file?") from None


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "not a plain file")
