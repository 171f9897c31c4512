"""Docker: `runtimes.nvidia` merged into /etc/docker/daemon.json, every other key kept."""
from __future__ import annotations

import json
from typing import Any, Optional

from gpu_agent.errors import StageError

DAEMON_JSON = "/etc/docker/daemon.json"


def desired(current: Optional[str], binary: str, enable_cdi: bool, set_as_default: bool) -> str:
    settings = _parse(current) if current is not None else {}
    runtimes = _object(settings, "runtimes")
    nvidia = runtimes.get("nvidia", {})
    if not isinstance(nvidia, dict):
        raise StageError(f"{DAEMON_JSON}: runtimes.nvidia: expected an object with a path, got {json.dumps(nvidia)}")
    runtimes["nvidia"] = {**nvidia, "path": binary, "args": nvidia.get("args", [])}
    if set_as_default:
        settings["default-runtime"] = "nvidia"
    elif settings.get("default-runtime") == "nvidia":
        del settings["default-runtime"]  # set by us earlier: back to Docker's own default (runc)
    if enable_cdi:
        _object(settings, "features")["cdi"] = True
    text = json.dumps(settings, indent=4) + "\n"
    # Unchanged content keeps the file exactly as it is, whatever its formatting.
    if current is not None and _parse(current) == settings:
        return current
    return text


def _object(settings: dict[str, Any], key: str) -> dict[str, Any]:
    value = settings.setdefault(key, {})
    if not isinstance(value, dict):
        raise StageError(f"{DAEMON_JSON}: {key}: expected an object, got {json.dumps(value)}; nothing was changed")
    return value


def _parse(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise StageError(f"{DAEMON_JSON}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}; nothing was changed") from None
    if not isinstance(value, dict):
        raise StageError(f"{DAEMON_JSON}: expected a JSON object at the top level")
    return value
