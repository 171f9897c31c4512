"""A plan is data: each change a stage would make is a small typed value, so it can be shown (as a
table or JSON), compared, counted by kind and asserted on, instead of an English string.

A change names its target and everything that makes it that change; it carries no behaviour. The
stage that plans it also says how to carry it out (stages.base.Action).
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Optional


@dataclass(frozen=True)
class Change:
    kind: ClassVar[str]

    def describe(self) -> str:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, **{f.name: _plain(getattr(self, f.name)) for f in fields(self)}}


@dataclass(frozen=True)
class WriteFile(Change):
    kind: ClassVar[str] = "WriteFile"
    path: str
    sha256: str  # of the new content
    size: int
    replaces: Optional[str] = None  # sha256 of the content replaced; None for a new file
    mode: Optional[int] = None  # for a new file; an existing one keeps its own

    @classmethod
    def of(cls, path: str, content: str, current: Optional[str], mode: Optional[int] = None) -> WriteFile:
        return cls(path, digest(content), len(content.encode()), digest(current) if current is not None else None,
                   mode)

    def describe(self) -> str:
        return f"write {self.path}"


@dataclass(frozen=True)
class RemoveFile(Change):
    kind: ClassVar[str] = "RemoveFile"
    path: str

    def describe(self) -> str:
        return f"remove {self.path}"


@dataclass(frozen=True)
class RestoreFile(Change):
    """Put back the file the agent replaced, from its saved original."""

    kind: ClassVar[str] = "RestoreFile"
    path: str
    original: str  # host path of the saved original

    def describe(self) -> str:
        return f"restore {self.path} from {self.original}"


@dataclass(frozen=True)
class LoadModule(Change):
    kind: ClassVar[str] = "LoadModule"
    module: str

    def describe(self) -> str:
        return f"modprobe {self.module}"


@dataclass(frozen=True)
class CreateDeviceNode(Change):
    kind: ClassVar[str] = "CreateDeviceNode"
    path: str
    major: int
    minor: int
    mode: int
    uid: int
    gid: int
    reason: str

    def describe(self) -> str:
        return f"mknod {self.path} ({self.major}:{self.minor}, {self.mode:04o}, {self.uid}:{self.gid}): {self.reason}"


@dataclass(frozen=True)
class CreateLink(Change):
    kind: ClassVar[str] = "CreateLink"
    path: str
    target: str
    reason: str

    def describe(self) -> str:
        return f"link {self.path} -> {self.target}: {self.reason}"


@dataclass(frozen=True)
class RemoveLink(Change):
    """Remove a symbolic link the agent created (and that still points where it made it point)."""

    kind: ClassVar[str] = "RemoveLink"
    path: str
    target: str

    def describe(self) -> str:
        return f"remove link {self.path} -> {self.target}"


@dataclass(frozen=True)
class SetPersistenceMode(Change):
    kind: ClassVar[str] = "SetPersistenceMode"
    gpu: int
    enabled: bool

    def describe(self) -> str:
        return f"{'enable' if self.enabled else 'disable'} persistence mode on GPU {self.gpu}"


# nvmlComputeMode_t by value, in nvidia-smi's words (EXCLUSIVE_THREAD's support was removed).
COMPUTE_MODES = ("DEFAULT", "EXCLUSIVE_THREAD", "PROHIBITED", "EXCLUSIVE_PROCESS")


@dataclass(frozen=True)
class SetComputeMode(Change):
    """A GPU's compute mode: EXCLUSIVE_PROCESS under an MPS control daemon, the one it had before after."""

    kind: ClassVar[str] = "SetComputeMode"
    gpu: str  # UUID
    mode: str  # one of COMPUTE_MODES

    def describe(self) -> str:
        return f"set GPU {self.gpu}'s compute mode to {self.mode}"


@dataclass(frozen=True)
class SetTimeSlice(Change):
    """A GPU's compute time-slice (`nvidia-smi compute-policy --set-timeslice`): 0 Default .. 3 Long."""

    kind: ClassVar[str] = "SetTimeSlice"
    gpu: str  # UUID
    level: int

    def describe(self) -> str:
        return f"set GPU {self.gpu}'s compute time-slice to level {self.level}"


@dataclass(frozen=True)
class StopMpsDaemon(Change):
    """`quit` to an MPS control daemon (SIGTERM if it does not exit), before its directories go."""

    kind: ClassVar[str] = "StopMpsDaemon"
    resource: str
    pid: int

    def describe(self) -> str:
        return f"stop the MPS control daemon for {self.resource} (pid {self.pid})"


@dataclass(frozen=True)
class Unmount(Change):
    """A file system the agent mounted (the MPS daemons' tmpfs), detached, and its directory removed."""

    kind: ClassVar[str] = "Unmount"
    path: str

    def describe(self) -> str:
        return f"unmount {self.path}"


@dataclass(frozen=True)
class SetDriverOverride(Change):
    """A PCI function's driver_override: the only driver that may bind it ("" clears it)."""

    kind: ClassVar[str] = "SetDriverOverride"
    address: str
    driver: str

    def describe(self) -> str:
        return f"set driver_override of {self.address} to {self.driver or '(null)'}"


@dataclass(frozen=True)
class UnbindPciFunction(Change):
    kind: ClassVar[str] = "UnbindPciFunction"
    address: str
    driver: str

    def describe(self) -> str:
        return f"unbind {self.address} from {self.driver}"


@dataclass(frozen=True)
class BindPciFunction(Change):
    """Bind a PCI function to a driver ("": drivers_probe, the driver probing picks)."""

    kind: ClassVar[str] = "BindPciFunction"
    address: str
    driver: str

    def describe(self) -> str:
        return f"bind {self.address} to {self.driver or 'the driver probing picks'}"


@dataclass(frozen=True)
class VfioStep(Change):
    """A GPU's switch between its drivers and vfio-pci reaches a step (stages/vfio_transitions.py), recorded in
    the ledger before the writes that follow: to-vfio, on-vfio (verified), to-host, or done (back, forgotten)."""

    kind: ClassVar[str] = "VfioStep"
    address: str
    step: str

    def describe(self) -> str:
        return f"record GPU {self.address}'s switch as {self.step}"


@dataclass(frozen=True)
class InstallPackage(Change):
    kind: ClassVar[str] = "InstallPackage"
    package: str
    reason: str

    def describe(self) -> str:
        return f"install {self.package} ({self.reason})"


@dataclass(frozen=True)
class RestartService(Change):
    kind: ClassVar[str] = "RestartService"
    unit: str

    def describe(self) -> str:
        return f"restart {self.unit}"


@dataclass(frozen=True)
class TakeOverUnit(Change):
    """Another package's unit that writes what the agent writes: stopped, disabled and masked, what it was
    recorded first, so that it is put back as it was (GiveBackUnit)."""

    kind: ClassVar[str] = "TakeOverUnit"
    unit: str
    file_state: str  # its UnitFileState now
    active: bool

    def describe(self) -> str:
        was = f"{self.file_state or 'state unknown'}, {'active' if self.active else 'inactive'}"
        return f"take over {self.unit} ({was}): stop, disable, mask"


@dataclass(frozen=True)
class GiveBackUnit(Change):
    """A unit the agent took over, unmasked and enabled and started again as it was."""

    kind: ClassVar[str] = "GiveBackUnit"
    unit: str
    file_state: str  # as recorded before the take-over
    active: bool

    def describe(self) -> str:
        steps = ["unmask"] + (["enable"] if self.file_state == "enabled" else []) + (["start"] if self.active else [])
        return f"give back {self.unit}: {', '.join(steps)}"


@dataclass(frozen=True)
class PatchNode(Change):
    kind: ClassVar[str] = "PatchNode"
    node: str
    part: str  # "labels" or "condition"
    summary: str  # the keys changed, or the condition's new status

    def describe(self) -> str:
        return f"patch node {self.node} {self.part}: {self.summary}"


@dataclass(frozen=True)
class SetMigMode(Change):
    kind: ClassVar[str] = "SetMigMode"
    gpu: int
    uuid: str
    enabled: bool

    def describe(self) -> str:
        return f"{'enable' if self.enabled else 'disable'} MIG mode on GPU {self.gpu}"


@dataclass(frozen=True)
class CreateGpuInstance(Change):
    kind: ClassVar[str] = "CreateGpuInstance"
    gpu: int
    uuid: str
    profile: str  # e.g. "3g.40gb"
    profile_id: int
    placement: tuple[int, int]  # (start, size) in memory slices

    def describe(self) -> str:
        return f"create GPU instance {self.profile} at {_slices(self.placement)} on GPU {self.gpu}"


@dataclass(frozen=True)
class CreateComputeInstance(Change):
    kind: ClassVar[str] = "CreateComputeInstance"
    gpu: int
    uuid: str
    gpu_instance: tuple[int, int]  # the placement of its GPU instance, which says which one it is
    profile: str  # the MIG device it makes: "3g.40gb", "1c.3g.40gb"
    slices: int
    start: int  # in compute slices of the GPU instance

    def describe(self) -> str:
        return (f"create compute instance {self.profile} at {self.start} in the GPU instance at "
                f"{_slices(self.gpu_instance)} on GPU {self.gpu}")


@dataclass(frozen=True)
class DestroyComputeInstance(Change):
    kind: ClassVar[str] = "DestroyComputeInstance"
    gpu: int
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    gpu_instance: tuple[int, int]
    start: int

    def describe(self) -> str:
        return (f"destroy compute instance {self.compute_instance_id} ({self.profile}) of GPU instance "
                f"{self.gpu_instance_id} on GPU {self.gpu}")


@dataclass(frozen=True)
class DestroyGpuInstance(Change):
    kind: ClassVar[str] = "DestroyGpuInstance"
    gpu: int
    uuid: str
    gpu_instance_id: int
    profile: str
    placement: tuple[int, int]

    def describe(self) -> str:
        return (f"destroy GPU instance {self.gpu_instance_id} ({self.profile} at {_slices(self.placement)}) "
                f"on GPU {self.gpu}")


def _slices(placement: tuple[int, int]) -> str:
    return f"{placement[0]}:{placement[1]}"  # start:size, as nvidia-smi writes placements


def digest(content: str | bytes) -> str:
    data = content.encode() if isinstance(content, str) else content
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value


@dataclass(frozen=True)
class DriverReloadStep(Change):
    """One step of a driver reload (stages/driver_reload.py): `step` is the GPU Operator's upgrade state
    the node is in while it is taken, `action` what the agent does in it."""

    kind: ClassVar[str] = "DriverReloadStep"
    step: str
    action: str

    def describe(self) -> str:
        return f"driver reload [{self.step}]: {self.action}"
