"""A GPU's switch between the host's drivers and vfio-pci, as a state machine. Its state is the ledger's record
(Record: the step, and each function's driver and driver_override before the switch); its next move is a pure
function, decide(), of that record, of what the node's sysfs shows now (Facts) and of the mode wanted.

Nothing here reads or changes the host: stages/vfio.py observes the facts, records the step, takes the move and
asks again. So a switch cut short (kill -9, a crash, a reboot) goes on from where sysfs shows it is, in either
direction, and a function is never left without a driver: each move that unbinds one is followed, in the same
decision, by the move that binds it (to vfio-pci going out, to its own driver coming back).

The invariants:
- no record: nothing of the agent's is under way; a GPU is switched only when nothing holds it (Facts.blockers)
  and its IOMMU group exists;
- to-vfio: the agent's own MPS control daemons serving the GPU quit first (their servers hold it open), and its
  compute mode from before them is set again (the ledger forgets it); then driver_override to vfio-pci (a
  reprobe then finds vfio-pci, not nvidia), then unbind, then bind;
  once every function is vfio-pci's and /dev/vfio/<group> exists: on-vfio;
- on-vfio: while the mode stays vm-passthrough, a function found on its own driver again (a reboot forgets
  bindings) is switched again, when nothing holds it;
- to-host (the mode changed back, uninstall, or a failure going out): unbind from vfio-pci, driver_override as
  it was, bind to the driver it had (drivers_probe where it had none known); then the record goes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

VFIO_DRIVER = "vfio-pci"
VFIO_MODULE = "vfio_pci"

TO_VFIO = "to-vfio"
ON_VFIO = "on-vfio"
TO_HOST = "to-host"
STEPS = (TO_VFIO, ON_VFIO, TO_HOST)

# The moves.
IDLE = "idle"  # nothing to do
REFUSE = "refuse"  # arg: why the GPU cannot be switched now
START = "start"  # record the functions' drivers and overrides, step to-vfio
LOAD = "load"  # modprobe vfio_pci
OVERRIDE = "override"  # address, value: write driver_override
UNBIND = "unbind"  # address, driver: write the driver's unbind
BIND = "bind"  # address, driver: write the driver's bind ("" : drivers_probe)
QUIT_MPS = "quit-mps"  # address: the resource: the agent's MPS control daemon serving the GPU quits
RELEASE_MODE = "release-mode"  # value: the compute mode the GPU had before an MPS daemon of the agent's, set again
VERIFY = "verify"  # every function is vfio-pci's: /dev/vfio/<group> must exist; then on-vfio
BACK = "back"  # step to-host
FORGET = "forget"  # every function is back: the record goes
MOVES = (IDLE, REFUSE, START, LOAD, QUIT_MPS, RELEASE_MODE, OVERRIDE, UNBIND, BIND, VERIFY, BACK, FORGET)


@dataclass(frozen=True)
class Function:
    """One function of the GPU's IOMMU group as sysfs shows it now."""

    address: str
    driver: Optional[str]  # the driver bound to it, None: no driver
    override: str  # driver_override, "" for (null)


@dataclass
class Record:
    """The ledger's entry for one GPU."""

    step: str
    functions: dict[str, dict[str, Any]]  # by address: {"driver": before, "override": before}
    index: int = -1
    uuid: Optional[str] = None
    group: Optional[str] = None
    failure: Optional[str] = None  # why a switch out was put back

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "functions": self.functions, "index": self.index, "uuid": self.uuid,
                "group": self.group, "failure": self.failure}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Record:
        index = data.get("index")
        return cls(step=str(data["step"]), functions={k: dict(v) for k, v in data["functions"].items()},
                   index=index if isinstance(index, int) else -1,
                   uuid=data.get("uuid") if isinstance(data.get("uuid"), str) else None,
                   group=data.get("group") if isinstance(data.get("group"), str) else None,
                   failure=data.get("failure") if isinstance(data.get("failure"), str) else None)


@dataclass(frozen=True)
class Facts:
    functions: tuple[Function, ...]  # the GPU first, then the other functions of its group
    group: Optional[str]  # its IOMMU group; None: no IOMMU
    group_node: bool  # /dev/vfio/<group> exists
    vfio_loaded: bool  # the vfio-pci driver is there (/sys/bus/pci/drivers/vfio-pci)
    blockers: tuple[str, ...] = ()  # what holds the GPU (processes, pods) or makes the switch unsafe
    mps: tuple[tuple[str, int], ...] = ()  # (resource, pid) of the agent's MPS control daemons serving the GPU
    compute_mode: Optional[str] = None  # its compute mode before an MPS daemon of the agent's (the ledger's)


@dataclass(frozen=True)
class Move:
    kind: str
    address: str = ""
    value: str = ""
    reasons: tuple[str, ...] = field(default=())


NO_IOMMU = ("no IOMMU group: the kernel runs without an IOMMU, so vfio-pci cannot take the GPU; boot it with "
            "intel_iommu=on (Intel CPUs) or amd_iommu=on (AMD; on by default), and iommu=pt, then reboot")


def decide(record: Optional[Record], want_vm: bool, facts: Facts) -> Move:
    if record is None:
        if not want_vm:
            return Move(IDLE)
        if all(function.driver == VFIO_DRIVER for function in facts.functions):
            return Move(IDLE)  # someone else's passthrough (the GPU Operator's vfio-manager): served, never undone
        return _out(facts) or Move(START)
    if record.step in (TO_VFIO, ON_VFIO) and not want_vm:
        return Move(BACK)
    if record.step == TO_HOST:
        return _home(record, facts)
    if record.step == ON_VFIO and any(function.driver not in (None, VFIO_DRIVER) for function in facts.functions):
        refused = _out(facts)  # back on its drivers (a reboot): switched again only when nothing holds it
        if refused is not None:
            return refused
    if not facts.vfio_loaded:
        return Move(LOAD)
    if facts.functions[0].driver not in (None, VFIO_DRIVER):
        if facts.mps:
            return Move(QUIT_MPS, facts.mps[0][0])
        if facts.compute_mode is not None:
            return Move(RELEASE_MODE, value=facts.compute_mode)
    for function in facts.functions:
        if function.override != VFIO_DRIVER:
            return Move(OVERRIDE, function.address, VFIO_DRIVER)
        if function.driver not in (None, VFIO_DRIVER):
            return Move(UNBIND, function.address, function.driver)
        if function.driver is None:
            return Move(BIND, function.address, VFIO_DRIVER)
    if record.step == TO_VFIO:
        return Move(VERIFY)
    return Move(IDLE)


def _out(facts: Facts) -> Optional[Move]:
    if facts.group is None:
        return Move(REFUSE, value=NO_IOMMU)
    if facts.blockers:
        return Move(REFUSE, value="; ".join(facts.blockers))
    return None


def _home(record: Record, facts: Facts) -> Move:
    for function in facts.functions:
        before = record.functions.get(function.address, {"driver": None, "override": ""})
        if function.driver is not None and function.driver != before["driver"]:
            return Move(UNBIND, function.address, function.driver)
        if function.override != before["override"]:
            return Move(OVERRIDE, function.address, before["override"])
        if function.driver is None and before["driver"] is not None:
            return Move(BIND, function.address, before["driver"])
    return Move(FORGET)


def after(move: Move, record: Optional[Record], facts: Facts) -> tuple[Optional[Record], Facts]:
    """What the node and the record would be after `move` succeeds: for a dry run's plan, and tests."""
    functions = facts.functions
    if move.kind in (OVERRIDE, UNBIND, BIND):
        functions = tuple(
            function if function.address != move.address else
            Function(function.address, function.driver, move.value) if move.kind == OVERRIDE else
            Function(function.address, None, function.override) if move.kind == UNBIND else
            Function(function.address, move.value or None, function.override) for function in functions)
    daemons = tuple(daemon for daemon in facts.mps if move.kind != QUIT_MPS or daemon[0] != move.address)
    facts = Facts(functions, facts.group, facts.group_node or move.kind == VERIFY, facts.vfio_loaded or
                  move.kind == LOAD, facts.blockers, daemons,
                  None if move.kind == RELEASE_MODE else facts.compute_mode)
    if move.kind == START:
        record = Record(TO_VFIO, {f.address: {"driver": f.driver, "override": f.override} for f in functions},
                        group=facts.group)
    elif record is not None and move.kind == VERIFY:
        record = Record(ON_VFIO, record.functions, record.index, record.uuid, record.group)
    elif record is not None and move.kind == BACK:
        record = Record(TO_HOST, record.functions, record.index, record.uuid, record.group, record.failure)
    elif move.kind == FORGET:
        record = None
    return record, facts
