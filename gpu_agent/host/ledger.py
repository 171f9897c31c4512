"""What the agent owns on the host and what it owes it, across crashes: a small versioned JSON file
under /var/lib/gpu-agent.

- owned: every file the agent created or changed, with where the original is saved (None when the
  agent created the file), the digest of what it last wrote, and the unit to restart when it is
  undone. Recorded (fsynced) before the file is written. When the config stops asking for a file,
  or at `gpu-agent uninstall`, it is removed or its original put back.
- links: every symbolic link the agent created (the driver's /dev/char/MAJ:MIN links), with its owner
  and the target it was given. Recorded before the link is made; `gpu-agent uninstall` removes
  those that still point there.
- pending_restarts: runtime restarts the agent owes, recorded before a runtime's config is written and
  cleared once the runtime was restarted and answered. A pass that starts, even in a new process
  after a kill -9, performs them first.
- mps_directories: the directories the agent made for its MPS control daemons (under /run/nvidia/mps),
  recorded before each is made; removed with what is in them when the daemon stops or at uninstall.
- mounts: the file systems the agent mounted (only the MPS control daemons' tmpfs, /run/nvidia/mps/shm),
  with their options and whether the agent made the directory; recorded before the mount, and dropped
  once it was unmounted (when the last daemon stops, or at uninstall).
- compute_modes: by GPU UUID, the compute mode a GPU had before the agent set it to EXCLUSIVE_PROCESS for an
  MPS control daemon, and that daemon's resource; recorded before the change and cleared once the mode
  was put back (when the daemon stops, or at uninstall).
- mig_checkpoints: by GPU UUID, the GPU's whole MIG state (mode, GPU instances with placements, compute
  instances) from before a MIG change, recorded before its first NVML change and cleared once the change
  was made or undone (gpu_agent.mig.checkpoint).
- units: other packages' systemd units the agent took over (the toolkit package's nvidia-cdi-refresh units,
  which write the CDI spec the agent writes), with their UnitFileState and whether they were active before;
  recorded before the first is stopped, and dropped once each was put back (when the agent stops writing
  the spec, or at uninstall).
- vfio: by the PCI address of a GPU being passed through to VMs (or passed through, or being given back), the
  switch's step and, for each function of its IOMMU group, the driver and driver_override it had before; recorded
  before each sysfs write of the switch (gpu_agent.stages.vfio), dropped once the GPU is back on its drivers.
- claim_specs: the transient CDI specs the DRA plugin wrote for prepared claims (under /var/run/cdi), by
  path, with the claim's uid; recorded before each is written, dropped once it was removed (at the claim's
  unprepare, or at uninstall).
- timeslices: by GPU UUID, the DRA claim whose TimeSlicing interval the agent set on the GPU (its compute
  time-slice level, the boot it was set in) and the compute mode the GPU had before it was set to DEFAULT
  for it (null when it was DEFAULT); recorded before the change, dropped once the time-slice is Default
  again and the mode put back (at the claim's unprepare, or at uninstall).
- driver_reload: the step a driver reload has reached (gpu_agent.stages.driver_reload), recorded before
  each step is taken, so that after a kill -9 the next agent finishes the sequence or says where it stopped.

Every change is a read, an edit and a write of the whole file, made under one lock (host/lockfile.py)
between the agent's threads (the engine's stages, the MPS control daemons' thread) and its processes
(the daemon, `gpu-agent uninstall`, `mig apply`, `driver reload`): /var/lib/gpu-agent/ledger.lock, held
only for that read and write, never across a restart, a wait or an NVML change. A change that finds
nothing to do writes nothing and takes no lock; readers never wait (the file is replaced atomically).
"""
from __future__ import annotations

import contextlib
import json
import posixpath
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host import jsontext
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.files import atomic_write
from gpu_agent.host.lockfile import Busy, FileLock
from gpu_agent.host.paths import Root, followed, walk
from gpu_agent.plan import COMPUTE_MODES

PATH = "/var/lib/gpu-agent/ledger.json"
_DROPPED_WHEN_EMPTY = ("mig_checkpoints", "mps_directories", "compute_modes", "mounts", "units", "vfio",
                       "claim_specs", "timeslices")
CLAIM_SPEC_DIR = "/var/run/cdi"  # the transient CDI specs of DRA claims, and only there
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F-]{1,64}")  # nvidia-smi -i takes an index too: only a UUID is recorded
_CLAIM_SPEC = re.compile(r"k8s\.gpu\.nvidia\.com-claim_[a-z0-9-]{1,64}\.json")
LOCK_PATH = "/var/lib/gpu-agent/ledger.lock"  # not a file the agent owns: the package's purge removes it
LOCK_TIMEOUT_S = 10.0  # a change holds the lock for milliseconds: a holder this long is stuck
MPS_DIRECTORY_ROOT = "/run/nvidia/mps"  # mps/layout.py's MPS_ROOT: the only place MPS directories may be
MOUNT_POINTS = (f"{MPS_DIRECTORY_ROOT}/shm",)  # mps/layout.py's SHM_DIR: the only mount the agent makes
VERSION = 1
_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class Owned:
    path: str  # host path of the file
    owner: str  # the stage that wants it
    original: Optional[str]  # host path of its saved original; None: the agent created the file
    written: str  # sha256 of what the agent last wrote
    restart: Optional[str] = None  # the unit that reads it: restarted after the file is undone


@dataclass(frozen=True)
class OwnedLink:
    path: str  # host path of the link
    owner: str  # the stage that made it
    target: str  # what the agent made it point to, as written in the link


@dataclass(frozen=True)
class OwnedUnit:
    unit: str  # nvidia-cdi-refresh.service
    owner: str  # the stage that took it over
    file_state: str  # its UnitFileState before: enabled, disabled, static, ...
    active: bool  # whether it was active (running, or waiting on its paths) before


@dataclass(frozen=True)
class OwnedMount:
    path: str  # the mount point, a host path
    fstype: str  # "tmpfs"
    options: str  # as mount(8) takes them
    made: bool  # the agent made the directory: removed after the unmount


@dataclass(frozen=True)
class TimeSlice:
    claim: str  # the DRA claim's uid
    level: int  # the compute time-slice set: 0 Default, 1 Short, 2 Medium, 3 Long
    boot: str  # the boot it was set in (/proc/sys/kernel/random/boot_id): a reboot sets Default again
    mode_before: Optional[str]  # the compute mode to put back; None: it was DEFAULT, nothing was changed
    applied: bool = False  # the mode and time-slice were set (False: recorded before, set next, or failed)


class LedgerError(AgentError):
    """The ledger cannot be read or written; the message names the file and what to do."""


class Ledger:
    """`{"version": 1, "pending_restarts": {"containerd.service": {"since": "2025-01-06T10:00:00Z"}},
    "owned": {...}, "mig_checkpoints": {...}}`"""

    def __init__(self, root: Root, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.root = root
        self.lock_timeout_s = lock_timeout_s

    @property
    def path(self) -> Path:
        """Where the file is: its links (and /var/lib's) followed under the root, never on the real host.
        OSError for a loop of links."""
        return self.root(followed(self.root, PATH))

    def owned(self) -> dict[str, Owned]:
        """The files the agent owns, by host path."""
        return {path: Owned(path=path, **entry) for path, entry in self._read()["owned"].items()}

    def own(self, entry: Owned) -> None:
        """Record (durably, before the write) that the agent writes `entry.path`; the first original stays."""
        fields = {key: value for key, value in asdict(entry).items() if key != "path"}
        self._merge("owned", entry.path, lambda before: fields if before is None
                    else {**fields, "original": before["original"]})

    def disown(self, path: str) -> None:
        self._forget("owned", path)

    def links(self) -> dict[str, OwnedLink]:
        """The symbolic links the agent created, by host path."""
        return {path: OwnedLink(path=path, **entry) for path, entry in self._read()["links"].items()}

    def own_link(self, entry: OwnedLink) -> None:
        """Record (durably, before the link is made) that the agent creates `entry.path`."""
        self._record("links", entry.path, {"owner": entry.owner, "target": entry.target})

    def disown_link(self, path: str) -> None:
        self._forget("links", path)

    def pending_restarts(self) -> set[str]:
        """The units the agent owes a restart."""
        return set(self._read()["pending_restarts"])

    def add_pending_restart(self, unit: str) -> None:
        """Durably, before the change that makes the restart necessary."""
        since = {"since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._merge("pending_restarts", unit, lambda before: since if before is None else before)

    def clear_pending_restart(self, unit: str) -> None:
        """Once the unit was restarted and answered."""
        self._forget("pending_restarts", unit)

    def units(self) -> dict[str, OwnedUnit]:
        """The units the agent took over, by name."""
        return {unit: OwnedUnit(unit=unit, **entry) for unit, entry in self._read()["units"].items()}

    def own_unit(self, entry: OwnedUnit) -> None:
        """Record (durably, before it is stopped) that the agent takes `entry.unit` over; what it was before
        stays as first recorded."""
        fields = {"owner": entry.owner, "file_state": entry.file_state, "active": entry.active}
        self._merge("units", entry.unit, lambda before: fields if before is None else before)

    def disown_unit(self, unit: str) -> None:
        self._forget("units", unit)

    def mps_directories(self) -> dict[str, str]:
        """The MPS directories the agent made (under /run/nvidia/mps), by host path: the resource they serve."""
        return dict(self._read()["mps_directories"])

    def own_mps_directory(self, path: str, resource: str) -> None:
        """Record (durably, before it is made) that the agent makes directory `path` for `resource`."""
        if not _mps_directory(path):
            raise LedgerError(f"{path}: not under {MPS_DIRECTORY_ROOT}, never an MPS directory of gpu-agent's")
        self._record("mps_directories", path, resource)

    def disown_mps_directory(self, path: str) -> None:
        self._forget("mps_directories", path)

    def claim_specs(self) -> dict[str, str]:
        """The transient CDI specs of prepared DRA claims, by host path: the claim's uid."""
        return dict(self._read()["claim_specs"])

    def own_claim_spec(self, path: str, uid: str) -> None:
        """Record (durably, before it is written) that the agent writes the CDI spec `path` for claim `uid`."""
        if not _claim_spec(path):
            raise LedgerError(f"{path}: not a claim's CDI spec in {CLAIM_SPEC_DIR}, never one of gpu-agent's")
        self._record("claim_specs", path, uid)

    def disown_claim_spec(self, path: str) -> None:
        self._forget("claim_specs", path)

    def timeslices(self) -> dict[str, TimeSlice]:
        """By GPU UUID: the time-slice the agent set on the GPU for a DRA claim."""
        return {uuid: TimeSlice(**entry) for uuid, entry in self._read()["timeslices"].items()}

    def save_timeslice(self, gpu_uuid: str, entry: TimeSlice) -> TimeSlice:
        """Durably, before the GPU's compute mode or time-slice is changed for `entry.claim`. The compute mode
        recorded by an earlier change is kept: that one is what to put back. Returns what is recorded."""
        recorded = self._merge("timeslices", gpu_uuid, lambda before: asdict(entry) if before is None else {
            **asdict(entry), "mode_before": before["mode_before"]})
        return TimeSlice(**recorded)

    def clear_timeslice(self, gpu_uuid: str) -> None:
        self._forget("timeslices", gpu_uuid)

    def mounts(self) -> dict[str, OwnedMount]:
        """The file systems the agent mounted, by mount point."""
        return {path: OwnedMount(path=path, **entry) for path, entry in self._read()["mounts"].items()}

    def own_mount(self, entry: OwnedMount) -> None:
        """Record (durably, before the mount) that the agent mounts `entry`; whether it made the directory
        stays as first recorded."""
        if entry.path not in MOUNT_POINTS:
            raise LedgerError(f"{entry.path}: not a mount point gpu-agent makes ({', '.join(MOUNT_POINTS)})")
        self._merge("mounts", entry.path, lambda before: {
            "fstype": entry.fstype, "options": entry.options, "made": entry.made if before is None else before["made"]})

    def disown_mount(self, path: str) -> None:
        self._forget("mounts", path)

    def compute_modes(self) -> dict[str, tuple[str, str]]:
        """By GPU UUID: (the compute mode to put back, the MPS resource it was changed for)."""
        return {uuid: (entry["mode"], entry["resource"]) for uuid, entry in self._read()["compute_modes"].items()}

    def save_compute_mode(self, gpu_uuid: str, mode: str, resource: str) -> str:
        """Durably, before the GPU's compute mode is changed: `mode`, unless one is recorded already (an
        earlier start changed it: that one is what to put back), now for `resource`. Returns the mode
        recorded."""
        recorded = self._merge("compute_modes", gpu_uuid, lambda before: {
            "mode": mode if before is None else before["mode"], "resource": resource})
        return str(recorded["mode"])

    def clear_compute_mode(self, gpu_uuid: str) -> None:
        self._forget("compute_modes", gpu_uuid)

    def mig_checkpoint(self, gpu_uuid: str) -> Optional[dict[str, Any]]:
        """The MIG state recorded for a GPU before its change, or None."""
        entry = self._read()["mig_checkpoints"].get(gpu_uuid)
        return None if entry is None else dict(entry)

    def save_mig_checkpoint(self, gpu_uuid: str, entry: dict[str, Any],
                            keep: Callable[[dict[str, Any]], bool] = lambda earlier: False) -> None:
        """Durably, before the GPU's first MIG change; an entry recorded earlier stays if `keep` says so."""
        self._merge("mig_checkpoints", gpu_uuid,
                    lambda earlier: earlier if earlier is not None and keep(dict(earlier)) else entry)

    def clear_mig_checkpoint(self, gpu_uuid: str) -> None:
        """Once the GPU's change was made or undone."""
        self._forget("mig_checkpoints", gpu_uuid)

    def driver_reload(self) -> Optional[dict[str, Any]]:
        entry = self._read().get("driver_reload")
        return dict(entry) if isinstance(entry, dict) else None

    def save_driver_reload(self, entry: Optional[dict[str, Any]]) -> None:
        """Durably, before the step it names is taken; None once the sequence is over."""
        def change(document: dict[str, Any]) -> bool:
            if document.get("driver_reload") == entry:
                return False
            if entry is None:
                document.pop("driver_reload", None)
            else:
                document["driver_reload"] = entry
            return True

        self._update(change)

    def vfio(self) -> dict[str, dict[str, Any]]:
        """The GPUs the agent passes (or passed) through, by PCI address: their switch's record."""
        return {address: dict(entry) for address, entry in self._read().get("vfio", {}).items()}

    def save_vfio(self, address: str, entry: Optional[dict[str, Any]]) -> None:
        """Durably, before the sysfs write it prepares; None once the GPU is back on its drivers."""
        def change(document: dict[str, Any]) -> bool:
            section = document.setdefault("vfio", {})
            if section.get(address) == entry:
                return False
            if entry is None:
                section.pop(address, None)
            else:
                section[address] = entry
            return True

        self._update(change)

    def _record(self, section: str, key: str, value: Any) -> None:
        """`value` under `key` in `section`, written only when it changes it."""
        self._merge(section, key, lambda before: value)

    def _merge(self, section: str, key: str, value: Callable[[Optional[Any]], Any]) -> Any:
        """`value(what is recorded under key, or None)` recorded under `key` in `section`, read and written
        under the lock (written only when it changes it). Returns what is recorded now."""
        now = None

        def change(document: dict[str, Any]) -> bool:
            nonlocal now
            before = document[section].get(key)
            now = document[section][key] = value(before)
            return before != now

        self._update(change)
        return now

    def _forget(self, section: str, key: str) -> None:
        """`key` out of `section`, written only when it was there."""
        self._update(lambda document: document[section].pop(key, None) is not None)

    # --- one change at a time --------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The ledger to this thread alone (re-entrant), against the agent's other threads and processes:
        for a read and the changes decided from it, never for long work (a restart, a wait, an NVML
        call). LedgerError, naming the lock file and its holder, when it is held past the timeout."""
        directory, name = posixpath.split(LOCK_PATH)
        try:  # the directory's links followed under the root; never a link at the lock's name (it is written to)
            lock = FileLock(self.root(followed(self.root, directory)) / name, self.lock_timeout_s)
            lock.acquire()
        except Busy as exc:
            raise LedgerError(f"{LOCK_PATH}: {exc.holder} has held the ledger's lock for more than "
                              f"{self.lock_timeout_s:g} s, where a change takes milliseconds: it is stuck; nothing "
                              f"was changed: stop it, or wait for it, and try again") from None
        except OSError as exc:
            raise LedgerError(f"{LOCK_PATH}: cannot lock the ledger ({exc.strerror or exc}); nothing was "
                              "changed") from None
        try:
            yield
        finally:
            lock.release()

    def _update(self, change: Callable[[dict[str, Any]], bool]) -> None:
        """`change` edits the document and says whether it changed it; it may be called twice. A change
        found on a read without the lock is made again on a read under it: no write is lost, and one
        that changes nothing takes no lock."""
        if not change(self._read()):
            return
        with self.locked():
            document = self._read()
            if change(document):
                self._write(document)

    # --- the file --------------------------------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        try:
            _, missing, dangling = walk(self.root, PATH)
            if missing and dangling:  # not "no ledger yet": someone put a link there, and it leads nowhere
                raise self._error("a link that leads to nothing under the root, not a file gpu-agent wrote; "
                                  "point it at the ledger or remove it")
            raw = read_bounded(self.path, _MAX_BYTES)
        except NotRegular as exc:
            raise self._error(f"cannot read it ({exc.kind}, not a file)") from None
        except TooLarge:
            raise self._error(f"larger than {_MAX_BYTES} bytes, not a file gpu-agent wrote") from None
        except OSError as exc:
            raise self._error(f"cannot read it ({exc.strerror or exc})") from None
        if raw is None:
            return {"version": VERSION, "pending_restarts": {}, "owned": {}, "links": {}, "mig_checkpoints": {},
                    "mps_directories": {}, "compute_modes": {}, "mounts": {}, "units": {}, "claim_specs": {},
                    "timeslices": {}}
        try:
            document = jsontext.loads(raw.decode("utf-8"), max_digits=jsontext.OWN_DIGITS)
        except jsontext.NumberTooLong as exc:
            raise self._error(f"line:column {exc.where}: an integer of {exc.digits} digits (at most {exc.limit}), "
                              "not a file gpu-agent wrote") from None
        except UnicodeDecodeError as exc:
            raise self._error(f"not UTF-8 text (byte {exc.start})") from None
        except json.JSONDecodeError as exc:
            raise self._error(f"line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise self._error("nested too deeply, not a file gpu-agent wrote") from None
        return self._checked(document)

    def _checked(self, document: Any) -> dict[str, Any]:
        if not isinstance(document, dict):
            raise self._error("expected a JSON object")
        version = document.get("version")
        if version != VERSION:
            raise self._error(f"version: {version!r} is not a ledger version this gpu-agent knows ({VERSION}); "
                              "was it written by a newer gpu-agent?")
        owned = document.setdefault("owned", {})
        if not isinstance(owned, dict) or not all(_owned_entry(path, entry) for path, entry in owned.items()):
            raise self._error('owned: expected an object of host paths, such as {"/etc/x.conf": {"owner": "driver", '
                              '"original": null, "written": "sha256:...", "restart": null}}')
        links = document.setdefault("links", {})
        if not isinstance(links, dict) or not all(_link_entry(path, entry) for path, entry in links.items()):
            raise self._error('links: expected an object of host paths, such as {"/dev/char/195:0": '
                              '{"owner": "driver", "target": "../nvidia0"}}')
        pending = document.setdefault("pending_restarts", {})
        if not isinstance(pending, dict) or not all(_unit_name(k) and isinstance(v, dict) for k, v in pending.items()):
            raise self._error('pending_restarts: expected an object of units, such as {"containerd.service": {}}')
        checkpoints = document.setdefault("mig_checkpoints", {})
        if not isinstance(checkpoints, dict) or not all(isinstance(v, dict) for v in checkpoints.values()):
            raise self._error('mig_checkpoints: expected an object of GPU UUIDs, such as {"GPU-...": {"gpu": 0, '
                              '"checkpoint": {...}}}')
        directories = document.setdefault("mps_directories", {})
        if not isinstance(directories, dict) or not all(
                _mps_directory(k) and isinstance(v, str) for k, v in directories.items()):
            raise self._error(f'mps_directories: expected an object of directories under {MPS_DIRECTORY_ROOT}, such '
                              f'as {{"{MPS_DIRECTORY_ROOT}/nvidia.com/gpu": "nvidia.com/gpu"}}')
        slices = document.setdefault("timeslices", {})
        if not isinstance(slices, dict) or not all(
                _GPU_UUID.fullmatch(k) and _timeslice_entry(v) for k, v in slices.items()):
            raise self._error('timeslices: expected an object of GPU UUIDs, such as {"GPU-...": {"claim": "<uid>", '
                              '"level": 1, "boot": "<boot id>", "mode_before": null, "applied": true}} (a level 0 to '
                              f'3, a mode_before null or one of {", ".join(COMPUTE_MODES)})')
        specs = document.setdefault("claim_specs", {})
        if not isinstance(specs, dict) or not all(_claim_spec(k) and isinstance(v, str) for k, v in specs.items()):
            raise self._error(f'claim_specs: expected an object of CDI specs in {CLAIM_SPEC_DIR}, such as '
                              f'{{"{CLAIM_SPEC_DIR}/k8s.gpu.nvidia.com-claim_<uid>.json": "<uid>"}}')
        mounted = document.setdefault("mounts", {})
        if not isinstance(mounted, dict) or not all(_mount_entry(k, v) for k, v in mounted.items()):
            raise self._error(f'mounts: expected an object of mount points ({", ".join(MOUNT_POINTS)}), such as '
                              f'{{"{MOUNT_POINTS[0]}": {{"fstype": "tmpfs", "options": "nosuid,nodev,noexec,mode=1777,'
                              'size=65536k", "made": true}}}}')
        units = document.setdefault("units", {})
        if not isinstance(units, dict) or not all(_unit_entry(k, v) for k, v in units.items()):
            raise self._error('units: expected an object of systemd units, such as {"nvidia-cdi-refresh.path": '
                              '{"owner": "cdi", "file_state": "enabled", "active": true}}')
        reload = document.get("driver_reload")
        if reload is not None and not (isinstance(reload, dict) and isinstance(reload.get("step"), str)):
            raise self._error('driver_reload: expected an object such as {"step": "wait-for-jobs-required", '
                              '"target": "570.124.06", ...}')
        vfio = document.setdefault("vfio", {})
        if not isinstance(vfio, dict) or not all(_vfio_entry(k, v) for k, v in vfio.items()):
            raise self._error('vfio: expected an object of PCI addresses, such as {"0000:9a:00.0": {"step": "on-vfio", '
                              '"functions": {"0000:9a:00.0": {"driver": "nvidia", "override": ""}}, ...}}')
        modes = document.setdefault("compute_modes", {})
        if not isinstance(modes, dict) or not all(
                isinstance(v, dict) and set(v) == {"mode", "resource"} and v["mode"] in COMPUTE_MODES
                and isinstance(v["resource"], str) for v in modes.values()):
            raise self._error('compute_modes: expected an object of GPU UUIDs, such as {"GPU-...": {"mode": "DEFAULT", '
                              f'"resource": "nvidia.com/gpu"}}}} (a mode one of {", ".join(COMPUTE_MODES)})')
        return document

    def _write(self, document: dict[str, Any]) -> None:
        # a node without MIG changes or MPS keeps the file as it was
        document = {key: value for key, value in document.items()
                    if key not in _DROPPED_WHEN_EMPTY or value}
        path = self.root(PATH)
        try:
            path = self.path
            atomic_write(path, json.dumps(document, indent=1, sort_keys=True) + "\n", mode=0o600)
        except OSError as exc:
            raise LedgerError(f"{PATH}: cannot record what gpu-agent changes ({exc.strerror or exc}); "
                              f"nothing was changed: make {path.parent} writable") from None

    def _error(self, reason: str) -> LedgerError:
        return LedgerError(f"{PATH}: {reason}. It records the files gpu-agent changed, the container runtime "
                           "restarts it owes and the MIG geometry of GPUs it is changing: restore it from a backup, "
                           "or remove it (then gpu-agent can no longer undo its changes) and restart the runtimes "
                           "whose configs gpu-agent changed")


_PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _vfio_entry(address: Any, entry: Any) -> bool:
    def function(name: Any, value: Any) -> bool:
        return (isinstance(name, str) and _PCI_ADDRESS.fullmatch(name) is not None and isinstance(value, dict)
                and (value.get("driver") is None or isinstance(value["driver"], str))
                and isinstance(value.get("override"), str))

    return (isinstance(address, str) and _PCI_ADDRESS.fullmatch(address) is not None and isinstance(entry, dict)
            and isinstance(entry.get("step"), str) and isinstance(entry.get("functions"), dict)
            and all(function(k, v) for k, v in entry["functions"].items()))


def _timeslice_entry(entry: Any) -> bool:
    return (isinstance(entry, dict) and set(entry) == {"claim", "level", "boot", "mode_before", "applied"}
            and isinstance(entry["claim"], str) and isinstance(entry["boot"], str)
            and isinstance(entry["applied"], bool)
            and type(entry["level"]) is int and 0 <= entry["level"] <= 3
            and (entry["mode_before"] is None or entry["mode_before"] in COMPUTE_MODES))


def _claim_spec(path: Any) -> bool:
    return isinstance(path, str) and posixpath.dirname(path) == CLAIM_SPEC_DIR and \
        _CLAIM_SPEC.fullmatch(posixpath.basename(path)) is not None


def _mps_directory(path: Any) -> bool:
    return isinstance(path, str) and (path == MPS_DIRECTORY_ROOT or path.startswith(MPS_DIRECTORY_ROOT + "/")) and \
        not {"..", "."} & set(path.split("/"))


def _mount_entry(path: Any, entry: Any) -> bool:
    return (path in MOUNT_POINTS and isinstance(entry, dict) and set(entry) == {"fstype", "options", "made"}
            and entry["fstype"] == "tmpfs" and isinstance(entry["options"], str) and isinstance(entry["made"], bool))


_UNIT = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_.@-]{0,199}\.(service|socket|target|path)")
_FILE_STATE = re.compile(r"[a-z-]{1,40}")  # systemd's UnitFileState words


def _owned_entry(path: Any, entry: Any) -> bool:
    def text(value: Any) -> bool:
        return isinstance(value, str) and value.startswith("/")

    return (text(path) and isinstance(entry, dict) and set(entry) == {"owner", "original", "written", "restart"}
            and isinstance(entry["owner"], str) and isinstance(entry["written"], str)
            and (entry["original"] is None or text(entry["original"]))
            and (entry["restart"] is None or _unit_name(entry["restart"])))


def _unit_name(value: Any) -> bool:
    """A systemd unit's name (containerd.service): never a path, an option or words for a shell."""
    return isinstance(value, str) and _UNIT.fullmatch(value) is not None


def _unit_entry(unit: Any, entry: Any) -> bool:
    return (_unit_name(unit) and isinstance(entry, dict) and set(entry) == {"owner", "file_state", "active"}
            and isinstance(entry["owner"], str) and isinstance(entry["file_state"], str)
            and _FILE_STATE.fullmatch(entry["file_state"]) is not None and isinstance(entry["active"], bool))


def _link_entry(path: Any, entry: Any) -> bool:
    return (isinstance(path, str) and path.startswith("/") and isinstance(entry, dict)
            and set(entry) == {"owner", "target"} and isinstance(entry["owner"], str)
            and isinstance(entry["target"], str) and entry["target"] != "")
