"""CRI-O: an `nvidia` runtime in /etc/crio/crio.conf.d/99-nvidia.conf, inheriting the default
runtime's settings. CRI-O merges drop-ins key by key, so the drop-in holds only what it adds."""
from __future__ import annotations

import copy
from typing import Any

import tomlkit

from gpu_agent.host.files import read_text
from gpu_agent.host.paths import Root
from gpu_agent.toolkit.tomldoc import deep_merge, parse

MAIN = "/etc/crio/crio.conf"
DROP_IN_DIR = "/etc/crio/crio.conf.d"
DROP_IN = f"{DROP_IN_DIR}/99-nvidia.conf"
HEADER = "# Written by gpu-agent: the nvidia runtime for CRI-O. Do not edit.\n"
OWN_KEYS = ("runtime_path", "runtime_type")


def desired(root: Root, binary: str, set_as_default: bool) -> str:
    runtime = _effective(root)
    default_name = runtime.get("default_runtime", "crun")
    inherited = copy.deepcopy(runtime.get("runtimes", {}).get(default_name, {}))
    for key in OWN_KEYS:
        inherited.pop(key, None)
    nvidia: dict[str, Any] = {"runtime_path": binary, "runtime_type": "oci", **inherited}
    section: dict[str, Any] = {"runtimes": {"nvidia": nvidia}}
    if set_as_default:
        section = {"default_runtime": "nvidia", **section}
    return HEADER + tomlkit.dumps({"crio": {"runtime": section}})


def _effective(root: Root) -> dict[str, Any]:
    """[crio.runtime] as CRI-O reads it: crio.conf, then the drop-ins in name order, key by key."""
    merged: dict[str, Any] = {}
    paths = [MAIN] + [f"{DROP_IN_DIR}/{p.name}" for p in sorted(root(DROP_IN_DIR).glob("*.conf"))
                      if f"{DROP_IN_DIR}/{p.name}" != DROP_IN] if root(DROP_IN_DIR).is_dir() else [MAIN]
    for path in paths:
        text = read_text(root(path))
        if text is not None:
            deep_merge(merged, parse(text, path).get("crio", {}).get("runtime", {}))
    return merged
