"""Docker: `runtimes.nvidia` merged into /etc/docker/daemon.json, every other key kept."""
from __future__ import annotations

import json
from typing import Any, Optional

from gpu_agent.errors import StageError

DAEMON_JSON = "/etc/docker/daemon.json"


def desired(current: Optional[str], binary: str, enable_cdi: bool, set_as_default: bool) -> str:
    settings = _parse(current) if current is not None else {}
    runtimes = settings.setdefault("runtimes", {})
    if not isinstance(runtimes, dict):
        raise StageError(f"{DAEMON_JSON}: runtimes: expected an object, got {type(runtimes).__name__}")
    runtimes["nvidia"] = {**runtimes.get("nvidia", {}), "path": binary, "args": runtimes.get("nvidia", {}).get("args", [])}
    if set_as_default:
        settings["default-runtime"] = "nvidia"
    if enable_cdi:
        features = settings.setdefault("features", {})
        features["cdi"] = True
    text = json.dumps(settings, indent=4) + "\n"
    # Unchanged content keeps the file exactly as it is, whatever its formatting.
    if current is not None and _parse(current) == settings:
        return current
    return text


def _parse(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise StageError(f"{DAEMON_JSON}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}; nothing was changed") from None
    if not isinstance(value, dict):
        raise StageError(f"{DAEMON_JSON}: expected a JSON object at the top level")
    return value
