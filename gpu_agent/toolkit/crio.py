"""CRI-O: an `nvidia` runtime in /etc/crio/crio.conf.d/99-nvidia.conf, inheriting the default
runtime's settings (else runc's, else crun's, as nvidia-ctk picks them). CRI-O merges drop-ins key
by key, so the drop-in holds only what it adds."""
from __future__ import annotations

import copy
from typing import Any

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
MAX_FILES = 256
SCHEMA = (
    (("crio",), TABLE),
    (("crio", "runtime"), TABLE),
    (("crio", "runtime", "default_runtime"), STRING),
    (("crio", "runtime", "runtimes"), TABLE),
    (("crio", "runtime", "runtimes", "*"), TABLE),
)


def desired(root: Root, binary: str, set_as_default: bool) -> str:
    import tomlkit

    runtime = _effective(root)
    default_name = runtime.get("default_runtime", "crun")
    inherited = copy.deepcopy(containerd.inherited(runtime.get("runtimes", {}), default_name))
    for key in OWN_KEYS:
        inherited.pop(key, None)
    nvidia: dict[str, Any] = {"runtime_path": binary, "runtime_type": "oci", **inherited}
    section: dict[str, Any] = {"runtimes": {"nvidia": nvidia}}
    if set_as_default:
        section = {"default_runtime": "nvidia", **section}
    return HEADER + tomlkit.dumps({"crio": {"runtime": section}})


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
