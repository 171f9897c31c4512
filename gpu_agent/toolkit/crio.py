"""CRI-O: an `nvidia` runtime in /etc/crio/crio.conf.d/99-nvidia.conf, inheriting the default
runtime's settings (else runc's, else crun's, as nvidia-ctk picks them). CRI-O merges drop-ins key
by key, so the drop-in holds only what it adds.

nvidia-ctk runtime configure (1.18 and later) writes its own drop-in, /etc/crio/crio.conf.d/99-nvidia.toml
(cmd/nvidia-ctk/runtime/configure at v1.20.0, commit f0c382c8), which CRI-O reads after the agent's. Where
the files besides the agent's already give the nvidia runtime the agent would (its binary, and the default
runtime where asked), the agent writes no drop-in of its own; where a file read after the agent's sets the
nvidia runtime otherwise, the agent's would be overridden, and that file is named instead."""
from __future__ import annotations

import copy
from typing import Any, Optional

from gpu_agent.errors import StageError
from gpu_agent.host.paths import Root
from gpu_agent.toolkit import configfile, containerd
from gpu_agent.toolkit.document import STRING, TABLE
from gpu_agent.toolkit.tomldoc import deep_merge, load

MAIN = "/etc/crio/crio.conf"
DROP_IN_DIR = "/etc/crio/crio.conf.d"
DROP_IN = f"{DROP_IN_DIR}/99-nvidia.conf"
HEADER = "# Written by gpu-agent: the nvidia runtime for CRI-O. Do not edit.\n"
OWN_KEYS = ("runtime_path", "runtime_type")
NVIDIA_CTK_DROP_IN = f"{DROP_IN_DIR}/99-nvidia.toml"
MAX_FILES = 256
SCHEMA = (
    (("crio",), TABLE),
    (("crio", "runtime"), TABLE),
    (("crio", "runtime", "default_runtime"), STRING),
    (("crio", "runtime", "runtimes"), TABLE),
    (("crio", "runtime", "runtimes", "*"), TABLE),
)


def desired(root: Root, binary: str, set_as_default: bool) -> Optional[str]:
    """The agent's drop-in; None where the other files already give CRI-O the nvidia runtime it would."""
    import tomlkit

    runtime = _effective(root)
    nvidia_now = runtime.get("runtimes", {}).get("nvidia", {})
    if nvidia_now.get("runtime_path") == binary and (not set_as_default or runtime.get("default_runtime") == "nvidia"):
        return None
    for path, later in _after_ours(root):
        theirs = later.get("runtimes", {}).get("nvidia", {})
        overridden = [key for key, value in (("runtime_path", binary), ("runtime_type", "oci"))
                      if key in theirs and theirs[key] != value]
        if overridden or (set_as_default and later.get("default_runtime", "nvidia") != "nvidia"):
            keys = ", ".join(overridden or ["default_runtime"])
            raise StageError(f"{path} (nvidia-ctk runtime configure writes one there) is read after gpu-agent's "
                             f"{DROP_IN} and sets the nvidia runtime's {keys} otherwise: remove it, or make it run "
                             f"{binary}; nothing was changed")
    default_name = runtime.get("default_runtime", "crun")
    inherited = copy.deepcopy(containerd.inherited(runtime.get("runtimes", {}), default_name))
    for key in OWN_KEYS:
        inherited.pop(key, None)
    nvidia: dict[str, Any] = {"runtime_path": binary, "runtime_type": "oci", **inherited}
    section: dict[str, Any] = {"runtimes": {"nvidia": nvidia}}
    if set_as_default:
        section = {"default_runtime": "nvidia", **section}
    return HEADER + tomlkit.dumps({"crio": {"runtime": section}})


def _after_ours(root: Root) -> list[tuple[str, dict[str, Any]]]:
    """[crio.runtime] of each drop-in CRI-O reads after the agent's."""
    found = []
    for path in configfile.walk(root, DROP_IN_DIR):
        file = configfile.read(root, path) if path > DROP_IN else None
        if file is not None and file.text is not None:
            found.append((path, load(file.text, file.shown).table("crio", "runtime")))
    return found


def _effective(root: Root) -> dict[str, Any]:
    """[crio.runtime] as CRI-O reads it: crio.conf, then every file under the drop-in directory
    (CRI-O walks it whole, in name order, whatever the files are called), key by key."""
    drop_ins = [path for path in configfile.walk(root, DROP_IN_DIR) if path != DROP_IN]
    if len(drop_ins) > MAX_FILES:
        raise StageError(f"{DROP_IN_DIR}: holds more than {MAX_FILES} files; nothing was changed")
    merged: dict[str, Any] = {}
    for path in [MAIN, *drop_ins]:
        file = configfile.read(root, path)
        if file.text is not None:
            document = load(file.text, file.shown)
            document.check(SCHEMA)
            deep_merge(merged, document.table("crio", "runtime"))
    return merged
