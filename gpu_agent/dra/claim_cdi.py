"""The transient CDI spec of a prepared claim whose devices are shared by MPS.

Kind k8s.gpu.nvidia.com/claim, one device per MPS device of the claim, `<claim uid>-<device name>`, whose
edits give its containers the claim's MPS control daemon: CUDA_MPS_PIPE_DIRECTORY, and bind mounts of the
daemon's pipe directory and of the daemons' tmpfs as /dev/shm (mps/layout.py: the device plugin's MPS
clients get the same). The kubelet passes it beside the agent's own spec's device, which gives the GPU.
NVIDIA's DRA driver writes a spec of this kind for every claim (cmd/gpu-kubelet-plugin/cdi.go and
sharing.go of kubernetes-sigs/dra-driver-nvidia-gpu at 14fd2e64bad38879d01a798444bf6847e8a47198); the agent
writes one only for a claim that needs edits its own spec does not hold.

Each spec is recorded in the ledger (claim_specs) before it is written (temp + fsync + rename), and removed
with its record at the claim's unprepare, or by `gpu-agent uninstall` when a claim was never unprepared.
"""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.host.ledger import CLAIM_SPEC_DIR, Ledger
from gpu_agent.host.paths import Root
from gpu_agent.mps.layout import client_envs, client_mounts
from gpu_agent.toolkit.cdi import minimum_version

KIND = "k8s.gpu.nvidia.com/claim"
MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")
_UID = re.compile(r"[a-z0-9-]{1,64}")  # a Kubernetes UID (a UUID), and what a file name may be made of


class ClaimSpecError(ValueError):
    """A claim whose spec cannot be named (its uid is no Kubernetes UID)."""


def spec_path(uid: str) -> str:
    if not _UID.fullmatch(uid):
        raise ClaimSpecError(f"the claim's uid {uid[:64]!r} is not a Kubernetes UID")
    return f"{CLAIM_SPEC_DIR}/k8s.gpu.nvidia.com-claim_{uid}.json"


def device_id(uid: str, device: str) -> str:
    """The fully qualified CDI device of the claim's `device`."""
    return f"{KIND}={uid}-{device}"


def render(uid: str, devices: Mapping[str, str]) -> dict[str, Any]:
    """The spec for claim `uid`: `devices` are the claim's MPS devices by name, each with its daemon's resource."""
    entries = []
    for device, resource in sorted(devices.items()):
        env = [f"{key}={value}" for key, value in sorted(client_envs(resource).items())]
        mounts = [{"hostPath": host, "containerPath": container, "options": list(MOUNT_OPTIONS)}
                  for container, host in client_mounts(resource)]
        entries.append({"name": f"{uid}-{device}", "containerEdits": {"env": env, "mounts": mounts}})
    spec = {"cdiVersion": "", "kind": KIND, "devices": entries}
    spec["cdiVersion"] = minimum_version(spec)  # 0.5.0: its device names start with the uid, often a digit
    return spec


def write(root: Root, ledger: Ledger, uid: str, devices: Mapping[str, str]) -> bool:
    """The claim's spec as `devices` ask, recorded first; False when it holds that already. OSError, or the
    ledger's AgentError, as the write's."""
    path = spec_path(uid)
    text = json.dumps(render(uid, devices), indent=1) + "\n"
    try:
        found = read_bounded(root(path), 1 << 20, follow=False)
    except (NotRegular, TooLarge):
        found = None
    if found is not None and found.decode(errors="replace") == text:
        return False
    ledger.own_claim_spec(path, uid)
    root(CLAIM_SPEC_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write(root(path), text, 0o644)
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
    root(path).unlink(missing_ok=True)
    ledger.disown_claim_spec(path)
