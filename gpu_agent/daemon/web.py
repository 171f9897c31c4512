"""aiohttp's server, without its client.

`import aiohttp.web` first runs aiohttp/__init__.py, which imports the whole client: its connector
builds two TLS contexts at import and loads the CA bundle for each, about 50 ms of the daemon's
start and a few MiB it keeps, for a client the agent never uses (the Kubernetes client speaks
http.client). So the package module is made here without running its __init__, aiohttp.web is
imported into it, and the rest of the package loads the first time anyone asks it for another name.
An aiohttp whose server needs more of its package than that is imported whole, as usual.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Any, Optional


def _server_only() -> None:
    if "aiohttp" in sys.modules:
        return
    spec = importlib.util.find_spec("aiohttp")
    version = _version(spec.origin) if spec is not None and spec.origin else None
    if spec is None or spec.loader is None or not spec.submodule_search_locations or version is None:
        return
    package = importlib.util.module_from_spec(spec)
    package.__dict__.update(__version__=version, __getattr__=_completing(package, spec.submodule_search_locations[0]))
    sys.modules["aiohttp"] = package
    try:
        importlib.import_module("aiohttp.web")
    except ImportError:
        for name in [name for name in sys.modules if name == "aiohttp" or name.startswith("aiohttp.")]:
            del sys.modules[name]


def _completing(package: ModuleType, directory: str) -> Any:
    def __getattr__(name: str) -> Any:
        """A name the package's __init__ would have set: run it now (it replaces this function)."""
        if name.startswith("__") or _is_submodule(directory, name):
            # importlib asks for a submodule's name before importing it (`from . import hdrs`)
            raise AttributeError(f"module 'aiohttp' has no attribute {name!r}")
        del package.__dict__["__getattr__"]
        assert package.__spec__ is not None and package.__spec__.loader is not None
        package.__spec__.loader.exec_module(package)
        return getattr(package, name)

    return __getattr__


def _is_submodule(directory: str, name: str) -> bool:
    try:
        entries = os.listdir(directory)
    except OSError:
        return False
    return any(entry == name or entry.startswith(name + ".") for entry in entries)


def _version(init_path: str) -> Optional[str]:
    """__version__ as aiohttp/__init__.py sets it on its first line (aiohttp.http imports it)."""
    try:
        with open(init_path, encoding="utf-8") as handle:
            head = handle.read(200)
    except OSError:
        return None
    match = re.match(r'__version__ = "([^"]+)"', head)
    return match.group(1) if match else None


_server_only()

from aiohttp import web  # noqa: E402  (after the package module above is in place)

__all__ = ["web"]
