"""Prepared claims: what NodePrepareResources gave each ResourceClaim, and the checkpoint that keeps it
across restarts of the agent, so that a claim prepared before a restart is answered the same and
unprepared after it.

The checkpoint, /var/lib/gpu-agent/dra/prepared.json, has one owner: the DRA plugin's service, which
changes it only on its event loop, one call at a time, each change written whole (temp + fsync + rename).
It is agent state beside the ledger, not a host file the agent took over: nothing to put back at uninstall.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from gpu_agent.dra import claim_cdi
from gpu_agent.dra.devices import DRIVER, DraDevice
from gpu_agent.dra.params import INTERVALS, LEVELS, MPS, TIME_SLICING, ConfigError, MpsLimits, Sharing, sharing_of
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.state import ClaimMps
from gpu_agent.toolkit.cdi import KIND as CDI_KIND

log = logging.getLogger(__name__)

CHECKPOINT = "/var/lib/gpu-agent/dra/prepared.json"
VERSION = 1
MAX_CHECKPOINT_BYTES = 16 << 20  # a node's prepared claims: thousands at most, each a few hundred bytes


class ClaimError(Exception):
    """Why one claim cannot be prepared: its answer's error, which the kubelet shows in the pod's events."""


@dataclass(frozen=True)
class PreparedDevice:
    requests: tuple[str, ...]  # the claim's requests this device satisfies
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    sharing: Optional[Sharing] = None  # from the claim's opaque config; None: the device is given whole

    @property
    def gpu(self) -> str:
        """The GPU's or MIG device's UUID: the name of the node spec's CDI device that gives it."""
        return self.cdi_ids[0].split("=", 1)[1]

    def to_json(self) -> dict[str, Any]:
        sharing: Optional[dict[str, Any]] = None
        if self.sharing is not None:
            sharing = {"strategy": self.sharing.strategy, "interval": self.sharing.interval or None}
            limits = self.sharing.mps
            if limits is not None:
                sharing["mps"] = {"threads": limits.threads, "pinned_mib": limits.pinned_mib,
                                  "per_device_mib": dict(limits.per_device_mib)}
        return {"requests": list(self.requests), "pool": self.pool, "device": self.device,
                "cdi_ids": list(self.cdi_ids), "sharing": sharing}


@dataclass(frozen=True)
class PreparedClaim:
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "name": self.name, "devices": [d.to_json() for d in self.devices]}


def devices_for(claim: Mapping[str, Any], uid: str, pool: str, published: Mapping[str, DraDevice],
                spec: Optional[frozenset[str]]) -> tuple[PreparedDevice, ...]:
    """The devices `claim` (the ResourceClaim object) was allocated of this node's pool, each with the CDI
    device of the agent's spec that gives it. Raises ClaimError naming what is wrong: another claim under
    the name (its uid), no allocation, no device of this driver, another pool, a device the pool does not
    publish (now), a CDI device the spec lacks, an opaque config that cannot be read or applied (MPS)."""
    try:
        claim_cdi.spec_path(uid)  # the name of the claim's own CDI spec
    except claim_cdi.ClaimSpecError as exc:
        raise ClaimError(str(exc)) from None
    metadata = _mapping(claim.get("metadata"))
    if metadata.get("uid") != uid:
        raise ClaimError(f"the ResourceClaim of that name has uid {str(metadata.get('uid'))[:64]!r}, not {uid!r}: "
                         "it was deleted and made again")
    allocation = _mapping(_mapping(_mapping(claim.get("status")).get("allocation")).get("devices"))
    results = allocation.get("results")
    if not isinstance(results, list):
        raise ClaimError("the claim is not allocated (status.allocation.devices.results is missing)")
    ours: dict[str, list[str]] = {}
    for result in results:
        if not isinstance(result, dict) or result.get("driver") != DRIVER:
            continue
        device, where = result.get("device"), result.get("pool")
        if where != pool:
            raise ClaimError(f"device {str(device)[:64]!r} is allocated from pool {str(where)[:253]!r}; this node "
                             f"publishes pool {pool!r}")
        if not isinstance(device, str) or device not in published:
            raise ClaimError(f"device {str(device)[:64]!r} is not one this node publishes now (a stale allocation "
                             "after a MIG change, a GPU NVML cannot read, or an unhealthy GPU withdrawn)")
        if published[device].tainted:
            taints = ", ".join(f"{t['key']}={t['value']}" if t.get("value") else t["key"]
                               for t in published[device].entry["taints"])
            raise ClaimError(f"device {device!r} is unhealthy (tainted {taints}): gpu-agent "
                             "does not prepare a device it knows to be failing, a claim that tolerates the taint "
                             "included")
        request = result.get("request")
        ours.setdefault(device, [])
        if isinstance(request, str) and request not in ours[device]:
            ours[device].append(request)
    if not ours:
        drivers = sorted({str(r.get("driver"))[:64] for r in results if isinstance(r, dict)})
        raise ClaimError(f"the claim allocates no {DRIVER} device (its drivers: {', '.join(drivers) or 'none'})")
    try:
        sharing = sharing_of(allocation.get("config"), [
            (device, request, published[device].uuid != published[device].gpu_uuid)
            for device, requests in ours.items() for request in requests or [""]])
    except ConfigError as exc:
        raise ClaimError(f"opaque config: {exc}") from None
    prepared = []
    for device, requests in sorted(ours.items()):
        chosen = sharing[device]
        if chosen is not None and chosen.strategy == MPS and published[device].uuid != published[device].gpu_uuid:
            raise ClaimError(f"device {device!r}: sharing.strategy {MPS} on a MIG device is not supported by "
                             "gpu-agent (on whole GPUs it is; docs/dra.md)")
        cdi = f"{CDI_KIND}={published[device].uuid}"
        if spec is not None and cdi not in spec:
            raise ClaimError(f"the agent's CDI spec holds no {cdi} (see the cdi stage in `gpu-agent status`)")
        ids: tuple[str, ...] = (cdi,)
        if chosen is not None and chosen.strategy == MPS:
            ids = (cdi, claim_cdi.device_id(uid, device))  # its MPS daemon's edits, in the claim's own spec
        prepared.append(PreparedDevice(tuple(requests), pool, device, ids, chosen))
    try:
        claim_daemons({uid: PreparedClaim("", "", tuple(prepared))})
    except ConfigError as exc:
        raise ClaimError(f"opaque config: {exc}") from None
    return tuple(prepared)


MPS_CLAIMS = "k8s.gpu.nvidia.com/claim"  # the MPS resources of claims: <this>/<claim uid>[-<n>]


def claim_daemons(claims: Mapping[str, PreparedClaim]) -> dict[str, ClaimMps]:
    """The MPS control daemons the prepared claims ask for, by resource: one for each claim and set of
    limits its MPS devices share (most claims: one), on those devices' GPUs. Raises ConfigError for a
    per-device limit that names no device of its set."""
    daemons: dict[str, ClaimMps] = {}
    for uid, claim in sorted(claims.items()):
        for resource, (limits, devices) in _mps_groups(uid, claim).items():
            gpus = tuple(device.gpu for device in devices)
            daemons[resource] = ClaimMps(gpus, limits.threads if limits else None,
                                         limits.pinned_for(gpus) if limits else None)
    return daemons


def mps_resources(uid: str, claim: PreparedClaim) -> dict[str, str]:
    """The claim's MPS devices by name, each with the resource of the daemon that serves it."""
    return {device.device: resource for resource, (_, devices) in _mps_groups(uid, claim).items()
            for device in devices}


def timeslice_levels(claim: PreparedClaim) -> dict[str, int]:
    """The compute time-slice level each whole GPU of the claim shared by TimeSlicing asks for, by UUID (a MIG
    device's interval is its GPU's, never set per claim)."""
    return {device.gpu: LEVELS[device.sharing.interval] for device in claim.devices
            if device.sharing is not None and device.sharing.strategy == TIME_SLICING and device.sharing.interval}


def _mps_groups(uid: str, claim: PreparedClaim) -> dict[str, tuple[Optional[MpsLimits], list[PreparedDevice]]]:
    """The claim's MPS devices by the limits they share, each set under its daemon's resource."""
    groups: dict[Optional[MpsLimits], list[PreparedDevice]] = {}
    for device in claim.devices:
        if device.sharing is not None and device.sharing.strategy == MPS:
            groups.setdefault(device.sharing.mps, []).append(device)
    return {f"{MPS_CLAIMS}/{uid}" + (f"-{number}" if len(groups) > 1 else ""): (limits, devices)
            for number, (limits, devices) in enumerate(groups.items())}


class Checkpoint:
    """The prepared claims by claim uid, as last written; read once at start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, PreparedClaim] = {}
        self.error: Optional[str] = None  # why the file could not be read or written

    def load(self) -> None:
        try:
            data = read_bounded(self.path, MAX_CHECKPOINT_BYTES, follow=False)
            if data is None:
                return
            document = json.loads(data)
            if not isinstance(document, dict) or document.get("version") != VERSION:
                raise ValueError(f"not a version {VERSION} checkpoint")
            self.claims = {uid: _claim(entry) for uid, entry in document["claims"].items()}
        except (OSError, NotRegular, TooLarge, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.error = f"{CHECKPOINT} cannot be read ({exc}); claims prepared before are unprepared as unknown"
            log.warning("DRA: %s", self.error)

    def put(self, uid: str, claim: PreparedClaim) -> None:
        if self.claims.get(uid) != claim:
            self._write({**self.claims, uid: claim})

    def drop(self, uid: str) -> None:
        if uid in self.claims:
            self._write({key: value for key, value in self.claims.items() if key != uid})

    def to_json(self) -> dict[str, Any]:
        """The prepared claims by uid, as the file and /status hold them."""
        return _claims_json(self.claims)

    def _write(self, claims: dict[str, PreparedClaim]) -> None:
        document = {"version": VERSION, "claims": _claims_json(claims)}
        atomic_write(self.path, json.dumps(document, indent=1) + "\n", mode=0o600)  # OSError: the caller's answer
        self.claims = claims
        self.error = None


def _claims_json(claims: Mapping[str, PreparedClaim]) -> dict[str, Any]:
    return {uid: claim.to_json() for uid, claim in sorted(claims.items())}


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _claim(entry: dict[str, Any]) -> PreparedClaim:
    devices = tuple(PreparedDevice(tuple(str(r) for r in d["requests"]), str(d["pool"]), str(d["device"]),
                                   tuple(str(c) for c in d["cdi_ids"]), _sharing(d.get("sharing")))
                    for d in entry["devices"])
    return PreparedClaim(str(entry["namespace"]), str(entry["name"]), devices)


def _sharing(entry: Any) -> Optional[Sharing]:
    if entry is None:  # a device given whole, or a checkpoint written before sharing was read
        return None
    mps = entry.get("mps")
    limits = None if mps is None else MpsLimits(
        _optional_int(mps["threads"]), _optional_int(mps["pinned_mib"]),
        tuple((str(key), _whole(value)) for key, value in sorted(mps["per_device_mib"].items())))
    interval = str(entry.get("interval") or "")
    if interval not in ("", *INTERVALS):
        raise ValueError(f"interval {interval[:32]!r} is none of {', '.join(INTERVALS)}")
    return Sharing(str(entry["strategy"]), interval, limits)


def _optional_int(value: Any) -> Optional[int]:
    return None if value is None else _whole(value)


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{str(value)[:32]!r} is not a whole number")
    return value
