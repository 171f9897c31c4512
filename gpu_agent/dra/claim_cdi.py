"""The transient CDI spec of a prepared claim, as NVIDIA's DRA driver writes one for every claim
(cmd/gpu-kubelet-plugin/cdi.go CreateClaimSpecFile of kubernetes-sigs/dra-driver-nvidia-gpu at
95932046...): kind k8s.gpu.nvidia.com/claim, one device per device of the claim, `<claim uid>-<device name>`,
self-contained: the node spec's common edits (the driver's libraries and binaries, its hooks) at the top,
and each device's own edits (its device nodes) under its name. A device shared by MPS adds its daemon's:
CUDA_MPS_PIPE_DIRECTORY, and bind mounts of the daemon's pipe directory and of the daemons' tmpfs as
/dev/shm (mps/layout.py: the device plugin's MPS clients get the same). The kubelet is given only the
claim's devices. The edits are the agent's node spec's (toolkit.cdi.path) as the cdi stage last wrote it.

Where the agent writes no node spec (toolkit.cdi off), nothing can be copied: the claim is answered the node
spec's own names (nvidia.com/gpu=<UUID>, a spec someone else keeps), and only a claim shared by MPS gets a
spec of its own, with the MPS edits alone, given beside them.

Each spec is recorded in the ledger (claim_specs) before it is written (temp + fsync + rename), and removed
with its record at the claim's unprepare, or by `gpu-agent uninstall` when a claim was never unprepared.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import yaml

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.host.ledger import CLAIM_SPEC_DIR, Ledger
from gpu_agent.host.paths import Root, place
from gpu_agent.mps.layout import client_envs, client_mounts
from gpu_agent.toolkit.cdi import minimum_version

KIND = "k8s.gpu.nvidia.com/claim"
MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
MAX_NODE_SPEC_BYTES = 16 << 20  # an 8-GPU node with 7 MIG devices each writes well under 1 MiB
_UID = re.compile(r"[a-z0-9-]{1,64}")  # a Kubernetes UID (a UUID), and what a file name may be made of
_LISTS = ("env", "deviceNodes", "mounts", "hooks")


class ClaimSpecError(ValueError):
    """A claim whose spec cannot be named (its uid is no Kubernetes UID), or a node spec that cannot be read."""


@dataclass(frozen=True)
class NodeSpec:
    """The agent's node spec, as far as a claim's spec copies it."""

    common: dict[str, Any]  # its containerEdits
    devices: dict[str, dict[str, Any]]  # each device's containerEdits, by name (GPU-..., MIG-..., 0, 0:1, all)


def read_node_spec(path: Path) -> NodeSpec:
    """The node spec at `path`; ClaimSpecError naming the file and why it cannot be read."""
    try:
        data = read_bounded(path, MAX_NODE_SPEC_BYTES)
        if data is None:
            raise ClaimSpecError(f"{path}: the node's CDI spec is not there (see the cdi stage)")
        document = yaml.load(data, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, NotRegular, TooLarge, yaml.YAMLError) as exc:
        raise ClaimSpecError(f"{path}: the node's CDI spec cannot be read ({exc})") from None
    devices = document.get("devices") if isinstance(document, dict) else None
    try:
        json.dumps(document)
    except (TypeError, ValueError):  # a YAML date, a non-string key: nothing the agent writes
        devices = None
    if not isinstance(devices, list) or not all(
            isinstance(d, dict) and isinstance(d.get("name"), str) and _edits(d.get("containerEdits"))
            for d in devices) or not _edits(document.get("containerEdits") or {}):
        raise ClaimSpecError(f"{path}: not a CDI spec the agent wrote (devices, each with a name and containerEdits "
                             "of lists)")
    return NodeSpec(dict(document.get("containerEdits") or {}), {d["name"]: d["containerEdits"] for d in devices})


def _edits(edits: Any) -> bool:
    """Container edits whose lists are lists (env of strings, the others of objects), as merged() joins them."""
    if not isinstance(edits, dict):
        return False
    for key in (*_LISTS, "additionalGids"):
        value = edits.get(key, [])
        if not isinstance(value, list):
            return False
        kind = str if key == "env" else int if key == "additionalGids" else dict
        if not all(isinstance(item, kind) and not isinstance(item, bool) for item in value):
            return False
    return True


def mps_edits(resource: str) -> dict[str, Any]:
    """What a container of an MPS device needs of the control daemon serving `resource`."""
    return {"env": [f"{key}={value}" for key, value in sorted(client_envs(resource).items())],
            "mounts": [{"hostPath": host, "containerPath": container, "options": list(MOUNT_OPTIONS)}
                       for container, host in client_mounts(resource)]}


def merged(*edits: Mapping[str, Any]) -> dict[str, Any]:
    """Container edits one after the other: their lists joined, additionalGids as a set."""
    out: dict[str, Any] = {}
    for edit in edits:
        for key, value in edit.items():
            if key in _LISTS:
                out[key] = [*out.get(key, []), *value]
            elif key == "additionalGids":
                out[key] = sorted({*out.get(key, []), *value})
            else:
                out[key] = value
    return out


def spec_path(uid: str) -> str:
    if not _UID.fullmatch(uid):
        raise ClaimSpecError(f"the claim's uid {uid[:64]!r} is not a Kubernetes UID")
    return f"{CLAIM_SPEC_DIR}/k8s.gpu.nvidia.com-claim_{uid}.json"


def device_id(uid: str, device: str) -> str:
    """The fully qualified CDI device of the claim's `device`."""
    return f"{KIND}={uid}-{device}"


def render(uid: str, devices: Mapping[str, Mapping[str, Any]],
           common: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The spec for claim `uid`: `devices` are the claim's devices by name, each with its container edits;
    `common`: the edits every device of the claim gets (the node spec's)."""
    spec: dict[str, Any] = {"cdiVersion": "", "kind": KIND,
                            "devices": [{"name": f"{uid}-{device}", "containerEdits": dict(edits)}
                                        for device, edits in sorted(devices.items())]}
    if common:
        spec["containerEdits"] = dict(common)
    spec["cdiVersion"] = minimum_version(spec)  # 0.5.0: its device names start with the uid, often a digit
    return spec


def write(root: Root, ledger: Ledger, uid: str, devices: Mapping[str, Mapping[str, Any]],
          common: Optional[Mapping[str, Any]] = None) -> bool:
    """The claim's spec (render()), recorded first; False when it holds that already. OSError, or the
    ledger's AgentError, as the write's."""
    path = spec_path(uid)
    text = json.dumps(render(uid, devices, common), indent=1) + "\n"
    ledger.own_claim_spec(path, uid)  # nothing written when recorded already
    where = root(place(root, path))  # /var/run is often a link to /run: followed under the root
    try:
        found = read_bounded(where, 1 << 20, follow=False)
    except (NotRegular, TooLarge):
        found = None
    if found is not None and found.decode(errors="replace") == text:
        return False
    where.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(where, text, 0o644)
    return True


def remove(root: Root, ledger: Ledger, uid: str) -> None:
    """The claim's spec gone, then its record; nothing to do for a claim without one."""
    path = spec_path(uid)
    if path in ledger.claim_specs():
        _remove(root, ledger, path)


def remove_left(root: Root, ledger: Ledger) -> list[str]:
    """Every spec the ledger holds removed, with its record (uninstall); returns the paths removed. OSError as
    the first removal's that failed."""
    removed = []
    for path in sorted(ledger.claim_specs()):
        _remove(root, ledger, path)
        removed.append(path)
    return removed


def _remove(root: Root, ledger: Ledger, path: str) -> None:
    root(place(root, path)).unlink(missing_ok=True)
    ledger.disown_claim_spec(path)
