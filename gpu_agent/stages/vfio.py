"""The vfio stage: GPUs whose workload mode is vm-passthrough are unbound from nvidia and bound to vfio-pci, with
every function of their IOMMU group; those whose mode is container (again) get their drivers back, exactly as
they were. `gpu-agent uninstall` gives every GPU back.

Each GPU's switch is a state machine (stages/vfio_transitions.py): the ledger records the step and what each
function had before every sysfs write, and the next move is decided from that record and what sysfs shows now,
so a switch cut short (kill -9) is finished or put back by the next pass, never left with a GPU bound to no
driver. It runs before discovery: the same pass's inventory, CDI spec, labels and device plugin see the result.
"""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from gpu_agent.config.workload import CONTAINER, MODES, VGPU_REFUSED, VM_PASSTHROUGH, VM_VGPU, WorkloadConfig
from gpu_agent.dra.devices import DRIVER as DRA_DRIVER
from gpu_agent.dra.devices import gpu_device_name
from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import pci as pci_bus
from gpu_agent.host import processes
from gpu_agent.host import vfio as sysfs
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.modules import ModuleLoader
from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import Gpu, Inventory
from gpu_agent.mps.reload import ReloadMps
from gpu_agent.plan import (BindPciFunction, Change, LoadModule, SetComputeMode, SetDriverOverride, StopMpsDaemon,
                            UnbindPciFunction, VfioStep)
from gpu_agent.plugin.gate import PluginGate
from gpu_agent.stages.base import Action, Stage
from gpu_agent.stages.driver_reload import pods_holding
from gpu_agent.stages.vfio_transitions import (BACK, BIND, FORGET, IDLE, LOAD, ON_VFIO, OVERRIDE, QUIT_MPS, REFUSE,
                                               RELEASE_MODE, START, TO_HOST, TO_VFIO, UNBIND, VERIFY, VFIO_DRIVER,
                                               VFIO_MODULE, Facts, Function, Move, Record, after, decide)

log = logging.getLogger(__name__)

WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"
_MOVES_PER_GPU = 32  # a group of a few functions takes a dozen moves each way
WITHDRAW_WAIT_S = 10.0  # how long the device plugin may take to send the kubelet lists without a GPU


@dataclass(frozen=True)
class GpuWorkload:
    """One NVIDIA GPU on the PCI bus, its mode and where it is now: what the stage hands on."""

    index: int  # its place among the node's NVIDIA GPUs in PCI order
    address: str  # 0000:9a:00.0
    uuid: Optional[str]  # from NVML, or the record while it is outside NVML; None: not known
    mode: str  # container | vm-passthrough
    driver: Optional[str]  # bound now
    group: Optional[str]
    device_id: int  # the PCI device id, 0x2330
    numa_node: Optional[int]
    functions: tuple[str, ...] = ()  # its IOMMU group's functions, itself first
    step: Optional[str] = None  # the switch's step, from the ledger
    reason: str = ""  # why it is not where its mode wants it

    @property
    def passed_through(self) -> bool:
        return self.mode == VM_PASSTHROUGH and self.driver == VFIO_DRIVER and self.step in (None, ON_VFIO)

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "pci_bus_id": self.address, "uuid": self.uuid, "mode": self.mode,
                "driver": self.driver, "iommu_group": self.group, "functions": list(self.functions),
                "step": self.step, "reason": self.reason or None}


@dataclass(frozen=True)
class WorkloadResult:
    mode: str  # the node's mode
    source: str  # where it came from
    gpus: tuple[GpuWorkload, ...] = ()

    def vm_gpus(self) -> tuple[GpuWorkload, ...]:
        return tuple(gpu for gpu in self.gpus if gpu.mode == VM_PASSTHROUGH)


@dataclass
class _Gpu:
    view: GpuWorkload
    record: Optional[Record]
    facts: Facts
    want_vm: bool
    nvml: Optional[Gpu] = None  # as NVML showed it when the pass observed it


@dataclass
class WorkloadObservation:
    mode: str
    source: str
    error: str = ""
    gpus: list[_Gpu] = field(default_factory=list)
    nvswitches: int = 0  # NVIDIA NVSwitches on the PCI bus: an HGX board, whose NVLinks Fabric Manager sets up


class Vfio(Stage):
    name = "vfio"
    produces = ("workload",)

    def __init__(self, root: Root, nvml: Nvml, loader: ModuleLoader, pci: sysfs.PciControl, settings: WorkloadConfig,
                 node_label: Optional[Callable[[str], Optional[str]]] = None, uninstall: bool = False,
                 gate: Optional[PluginGate] = None, mps: Optional[ReloadMps] = None) -> None:
        self.root = root
        self.nvml = nvml
        self.loader = loader
        self.pci = pci
        self.settings = settings
        self.node_label = node_label
        self.uninstall = uninstall  # every GPU back on its drivers
        self.gate = gate  # the device plugin's: the GPUs taken from the container path are withdrawn first
        self.mps = mps  # the agent's own MPS control daemons: quit before their GPU is unbound, never blockers
        self.ledger = Ledger(root)
        self._failures: list[str] = []
        self._warned = ""  # the Fabric Manager warning last logged

    def start_pass(self) -> None:
        self._failures = []

    # --- observe ---------------------------------------------------------------------------------

    def observe(self) -> WorkloadObservation:
        mode, source, error = self._mode()
        found = WorkloadObservation(mode, source, error)
        inventory = self._inventory()
        by_address = {sysfs.pci_address(gpu.pci_bus_id): gpu for gpu in (inventory.gpus if inventory else ())}
        records = {address: Record.from_json(entry) for address, entry in self.ledger.vfio().items()}
        bus = pci_bus.scan(self.root)
        found.nvswitches = len(bus.nvswitches)
        for index, device in enumerate(bus.gpus):
            record = records.get(device.address)
            nvml_gpu = by_address.get(device.address)
            uuid = nvml_gpu.uuid if nvml_gpu is not None else record.uuid if record is not None else None
            wanted = CONTAINER if self.uninstall else self._wanted(mode, index, uuid, device.address)
            if wanted not in MODES:
                found.error = found.error or f"GPU {index} ({device.address}): {VGPU_REFUSED}"
                wanted = CONTAINER
            facts = self._facts(device.address, record, wanted == VM_PASSTHROUGH, nvml_gpu)
            view = GpuWorkload(index, device.address, uuid, wanted, facts.functions[0].driver, facts.group,
                               device.device, pci_bus.numa_node(self.root, device.address),
                               tuple(f.address for f in facts.functions), record.step if record else None)
            found.gpus.append(_Gpu(view, record, facts, wanted == VM_PASSTHROUGH, nvml_gpu))
        if self.gate is not None:  # before any of them is switched: see _switch
            self.gate.withdraw(gpu.view.address for gpu in found.gpus if gpu.want_vm or gpu.record is not None)
            self.gate.leaving = frozenset(gpu.view.address for gpu in found.gpus if gpu.record is not None)
        return found

    def _mode(self) -> tuple[str, str, str]:
        if self.uninstall:
            return CONTAINER, "gpu-agent uninstall", ""
        if self.settings.follow_node_label and self.node_label is not None:
            try:
                label = self.node_label(WORKLOAD_LABEL)
            except AgentError as exc:
                log.warning("cannot read node label %s (%s); using workload.mode", WORKLOAD_LABEL, exc)
            else:
                if label == VM_VGPU:
                    return self.settings.mode, f"node label {WORKLOAD_LABEL}", f"node label {WORKLOAD_LABEL}: " \
                                                                                 f"{VGPU_REFUSED}"
                if label in MODES:
                    return label, f"node label {WORKLOAD_LABEL}", ""
                if label:
                    return self.settings.mode, "workload.mode", (f"node label {WORKLOAD_LABEL}={label!r} is no mode "
                                                                 f"(one of {', '.join(MODES)})")
        return self.settings.mode, "workload.mode", ""

    def _wanted(self, mode: str, index: int, uuid: Optional[str], address: str) -> str:
        for key, value in self.settings.gpus.items():
            if key == str(index) or (uuid is not None and key == uuid) or (":" in key and _same_bus(key, address)):
                return value
        return mode

    def _inventory(self) -> Optional[Inventory]:
        try:
            return self.nvml.inventory.read()
        except Exception:  # NVML down: the GPUs are still on the bus, and their records say who they are
            return None

    def _facts(self, address: str, record: Optional[Record], want_vm: bool, gpu: Optional[Gpu]) -> Facts:
        group = sysfs.group_of(self.root, address)
        members = sysfs.group_members(self.root, group) if group is not None else []
        ordered = [address] + [member for member in members if member != address]
        if record is not None:
            ordered += [member for member in record.functions if member not in ordered]
        functions = tuple(Function(member, sysfs.driver_of(self.root, member), sysfs.override_of(self.root, member))
                          for member in ordered)
        blockers: tuple[str, ...] = ()
        daemons: tuple[tuple[str, int], ...] = ()
        mode = None
        on_host = functions[0].driver not in (None, VFIO_DRIVER)
        if want_vm and on_host and (record is None or record.step == ON_VFIO):
            blockers = tuple(self._blockers(functions, gpu))
        uuid = gpu.uuid if gpu is not None else record.uuid if record is not None else None
        if want_vm and on_host and uuid is not None and self.mps is not None:
            daemons, mode = tuple(self.mps.serving(uuid)), self.mps.recorded_mode(uuid)
        return Facts(functions, group, group is not None and sysfs.group_node(self.root, group),
                     sysfs.driver_present(self.root, VFIO_DRIVER), blockers, daemons, mode)

    def _blockers(self, functions: Sequence[Function], gpu: Optional[Gpu]) -> list[str]:
        """What holds the GPU, or makes taking it from the host unsafe: refused with the reason."""
        found = []
        foreign = [f.address for f in functions if sysfs.vendor_of(self.root, f.address) != pci_bus.NVIDIA]
        if foreign:
            found.append(f"its IOMMU group also holds {', '.join(foreign)}, not NVIDIA's: passing it through would "
                         "take them from the host")
        if gpu is None:
            found.append("NVML does not see it: the nvidia driver does not hold it (or NVML fails), so whether a "
                         "process or MIG uses it cannot be told")
            return found
        if gpu.mig.enabled:
            found.append("MIG mode is on: turn it off first (mig.config), the MIG devices are the container path's")
        held = processes.holding(self.root, re.compile(rf"/dev/nvidia{gpu.minor_number}$"))
        own = self.mps.own(held) if self.mps is not None else set()  # quit before the unbind (QUIT_MPS)
        found += [f"process {process.describe()} has it open" for process in held if process.pid not in own]
        name = gpu_device_name(gpu)
        pods = pods_holding(self.root, lambda device: any(i.split("::")[0] == gpu.uuid for i in device.device_ids),
                            lambda claimed: claimed.driver_name == DRA_DRIVER and claimed.device_name == name)
        found += [f"pod {pod} holds it" for pod in pods]
        if self._persistence(gpu):
            found.append("persistence mode is on (the driver keeps it initialised): turn it off (nvidia-smi -i "
                         f"{gpu.index} -pm 0) or stop nvidia-persistenced first")
        return found

    def _persistence(self, gpu: Gpu) -> bool:
        try:
            modes = self.nvml.inventory.driver_view(persistence=True).persistence or []
        except Exception:  # NVML cannot say: the process check above still holds
            return False
        return gpu.index < len(modes) and modes[gpu.index]

    # --- plan and apply --------------------------------------------------------------------------

    def plan(self, observed: WorkloadObservation) -> list[Action]:
        actions = []
        for gpu in observed.gpus:
            changes = self._changes(gpu)
            if changes:
                actions.append(Action(tuple(changes), functools.partial(self._switch, gpu.view.address, gpu.want_vm,
                                                                     gpu.nvml)))
        return actions

    def _changes(self, gpu: _Gpu) -> list[Change]:
        """What the switch would write, move by move, as a dry run shows it."""
        record, facts, changes = gpu.record, gpu.facts, []
        for _ in range(_MOVES_PER_GPU):
            move = decide(record, gpu.want_vm, facts)
            if move.kind in (IDLE, REFUSE):
                break
            changes.append(_change(move, gpu.view.address, gpu.view.uuid, dict(facts.mps)))
            record, facts = after(move, record, facts)
            if move.kind == FORGET:
                break
        return changes

    def _switch(self, address: str, want_vm: bool, nvml_gpu: Optional[Gpu]) -> None:
        """Take the moves for one GPU until it is where its mode wants it, or refused; a failure on the way out
        puts it back and is raised."""
        failure = None
        if want_vm and self.gate is not None and not self.gate.wait_withdrawn(address, WITHDRAW_WAIT_S):
            raise StageError(f"GPU {address} not passed through: the device plugin has not withdrawn it from the "
                             f"container path's resources within {WITHDRAW_WAIT_S:g} s; tried again next pass")
        if self.gate is not None:  # NVML stops (or starts) seeing it before this pass's discovery
            self.gate.leaving = self.gate.leaving | {address}
        for _ in range(_MOVES_PER_GPU):
            gpu = self._fresh(address, want_vm, nvml_gpu)  # after the withdrawal: no pod is given it meanwhile
            move = decide(gpu.record, want_vm, gpu.facts)
            if move.kind in (IDLE, REFUSE):
                break
            try:
                self._take(gpu, move)
            except (OSError, AgentError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                what = f"GPU {gpu.view.index} ({address}): {_doing(move)}: {reason}"
                record = gpu.record
                if record is None or record.step == TO_HOST or failure is not None:
                    raise StageError(what + ("" if failure is None else f" (while putting it back after: {failure})")) \
                        from None
                failure = what
                log.error("%s; putting it back on its drivers", what)
                record.step, record.failure = TO_HOST, what
                self.ledger.save_vfio(address, record.to_json())
            if move.kind == FORGET:
                if self.gate is not None:  # back on its drivers: the container path's again
                    self.gate.withdraw(self.gate.withdrawn - {address})
                break
        self.nvml.session.gpus_changed()  # NVML's GPUs and their indices changed under it
        if failure is not None:
            raise StageError(f"{failure}; it is back on its drivers")

    def _fresh(self, address: str, want_vm: bool, nvml_gpu: Optional[Gpu]) -> _Gpu:
        """The GPU's record and sysfs now; NVML's view as the pass observed it (NVML's indices move as GPUs leave
        it, and what it says of users matters only before the first write)."""
        entry = self.ledger.vfio().get(address)
        record = Record.from_json(entry) if entry is not None else None
        facts = self._facts(address, record, want_vm, nvml_gpu)
        uuid = nvml_gpu.uuid if nvml_gpu else record.uuid if record is not None else None
        view = GpuWorkload(-1, address, uuid, VM_PASSTHROUGH if want_vm else CONTAINER,
                           facts.functions[0].driver, facts.group, 0, None)
        return _Gpu(view, record, facts, want_vm)

    def _take(self, gpu: _Gpu, move: Move) -> None:
        address = gpu.view.address
        log.info("vfio: GPU %s: %s", address, _doing(move))
        if move.kind == START:
            index = next((n for n, d in enumerate(pci_bus.scan(self.root).gpus) if d.address == address), -1)
            record, _ = after(move, None, gpu.facts)
            assert record is not None
            record.index, record.uuid = index, gpu.view.uuid
            self.ledger.save_vfio(address, record.to_json())  # before the first write
        elif move.kind == LOAD:
            self.loader.load(VFIO_MODULE)
        elif move.kind in (QUIT_MPS, RELEASE_MODE):
            assert self.mps is not None and gpu.view.uuid is not None  # facts name none without them
            problem = self.mps.quit(move.address) if move.kind == QUIT_MPS else self.mps.release(gpu.view.uuid)
            if problem is not None:
                raise AgentError(problem)
        elif move.kind == OVERRIDE:
            self.pci.write(sysfs.override_path(move.address), move.value or "\n")
        elif move.kind == UNBIND:
            self.pci.write(sysfs.driver_file(move.value, "unbind"), move.address)
        elif move.kind == BIND:
            self.pci.write(sysfs.driver_file(move.value, "bind"), move.address)
        elif move.kind == VERIFY:
            if not gpu.facts.group or not sysfs.group_node(self.root, gpu.facts.group):
                raise AgentError(f"no /dev/vfio/{gpu.facts.group} after binding its group to vfio-pci: the kernel made "
                                 "no VFIO group device (is the IOMMU on? intel_iommu=on or amd_iommu=on, iommu=pt)")
            self._step(gpu, ON_VFIO)
        elif move.kind == BACK:
            self._step(gpu, TO_HOST)
        elif move.kind == FORGET:
            self.ledger.save_vfio(address, None)

    def _step(self, gpu: _Gpu, step: str) -> None:
        record = gpu.record
        assert record is not None
        record.step = step
        self.ledger.save_vfio(gpu.view.address, record.to_json())

    # --- verify and results ----------------------------------------------------------------------

    def verify(self, observed: WorkloadObservation) -> str:
        if observed.error:
            raise StageError(observed.error)
        problems, passed, waiting = [], 0, 0
        for gpu in observed.gpus:
            move = decide(gpu.record, gpu.want_vm, gpu.facts)
            if move.kind == REFUSE:
                problems.append(f"GPU {gpu.view.index} ({gpu.view.address}) not passed through: {move.value}")
            elif move.kind != IDLE:
                waiting += 1
            elif gpu.want_vm and gpu.facts.functions[0].driver == VFIO_DRIVER:
                passed += 1
                if gpu.facts.group is None or not gpu.facts.group_node:
                    problems.append(f"GPU {gpu.view.index} ({gpu.view.address}): no /dev/vfio/{gpu.facts.group}")
        if problems:
            raise StageError("; ".join(problems))
        if waiting:
            raise StageError(f"{waiting} GPU(s) not yet where their workload mode wants them")
        if not passed:
            return f"every GPU serves containers ({observed.source}: {observed.mode})"
        served = ", ".join(f"{name}: {count}" for name, count in self._resources(observed).items())
        warning = fabric_warning(observed)
        if warning and warning != self._warned:  # once, not every pass
            log.warning("vfio: %s", warning)
        self._warned = warning
        return (f"{passed} GPU(s) passed through to VMs on vfio-pci ({served}), {len(observed.gpus) - passed} serve "
                "containers" + (f"; warning: {warning}" if warning else ""))

    def _resources(self, observed: WorkloadObservation) -> dict[str, int]:
        """The VM path's resources, as the device plugin names them (KubeVirt's rule), and their GPUs."""
        from gpu_agent.plugin.vfio import names, read_pci_ids

        vm = [gpu.view for gpu in observed.gpus if gpu.want_vm]
        named = names((gpu.device_id for gpu in vm), read_pci_ids(self.root)) if vm else {}
        counts: dict[str, int] = {}
        for gpu in vm:
            counts[named[gpu.device_id]] = counts.get(named[gpu.device_id], 0) + 1
        return dict(sorted(counts.items()))

    def outputs(self, observed: WorkloadObservation) -> dict[str, Any]:
        return {"workload": self._result(observed)}

    def facts(self, observed: WorkloadObservation) -> dict[str, Any]:
        result = self._result(observed)
        return {"mode": result.mode, "source": result.source, "gpus": [gpu.to_json() for gpu in result.gpus],
                "resources": self._resources(observed), "nvswitches": observed.nvswitches,
                "fabric_warning": fabric_warning(observed) or None}

    def _result(self, observed: WorkloadObservation) -> WorkloadResult:
        gpus = []
        for gpu in observed.gpus:
            move = decide(gpu.record, gpu.want_vm, gpu.facts)
            reason = move.value if move.kind == REFUSE else gpu.record.failure if gpu.record and gpu.record.failure \
                else ""
            gpus.append(GpuWorkload(**{**gpu.view.__dict__, "reason": reason}))
        return WorkloadResult(observed.mode, observed.source, tuple(gpus))


def fabric_warning(observed: WorkloadObservation) -> str:
    """On an NVSwitch (HGX) board, what passing GPUs through gives up: the agent binds GPUs (and their IOMMU
    group's functions) only, as the GPU Operator's vfio-manager does without BIND_NVSWITCHES, and sets up no
    Fabric Manager model for VMs (docs/vfio.md). Empty where no GPU of such a board is passed through."""
    vm = [gpu.view for gpu in observed.gpus if gpu.want_vm]
    if not observed.nvswitches or not vm:
        return ""
    which = ", ".join(str(gpu.index) for gpu in vm)
    if len(vm) < len(observed.gpus):
        return (f"GPUs {which} are passed through from an NVSwitch board ({observed.nvswitches} NVSwitches) whose "
                "other GPUs stay with the host: the host's Fabric Manager keeps the NVSwitches, so the VMs get no "
                "NVLink among those GPUs (PCIe only); Fabric Manager's models for VMs (full passthrough, shared "
                "NVSwitch partitions) are not set up by gpu-agent")
    return (f"every GPU is passed through, the {observed.nvswitches} NVSwitches stay with the host: a VM gets no "
            "NVLink fabric unless the NVSwitches are passed through too (Fabric Manager's full passthrough model), "
            "which gpu-agent does not do")


def _same_bus(key: str, address: str) -> bool:
    try:
        return sysfs.pci_address(key if key.count(":") == 2 else f"0000:{key}") == address
    except ValueError:
        return False


def _change(move: Move, address: str, uuid: Optional[str], daemons: dict[str, int]) -> Change:
    if move.kind in STEP_OF:
        return VfioStep(address, STEP_OF[move.kind])
    if move.kind == LOAD:
        return LoadModule(VFIO_MODULE)
    if move.kind == QUIT_MPS:
        return StopMpsDaemon(move.address, daemons[move.address])
    if move.kind == RELEASE_MODE:
        return SetComputeMode(uuid or address, move.value)
    if move.kind == OVERRIDE:
        return SetDriverOverride(move.address, move.value)
    if move.kind == UNBIND:
        return UnbindPciFunction(move.address, move.value)
    return BindPciFunction(move.address, move.value)


STEP_OF = {START: TO_VFIO, VERIFY: ON_VFIO, BACK: TO_HOST, FORGET: "done"}


def _doing(move: Move) -> str:
    return {START: "switch to vfio-pci begins", LOAD: f"modprobe {VFIO_MODULE}", VERIFY: "verify /dev/vfio",
            BACK: "back to its drivers", QUIT_MPS: f"quit the MPS control daemon for {move.address}",
            RELEASE_MODE: f"compute mode {move.value} again (MPS no longer serves it)", FORGET: "back on its drivers",
            OVERRIDE: f"driver_override of {move.address} := {move.value or '(null)'}",
            UNBIND: f"unbind {move.address} from {move.value}",
            BIND: f"bind {move.address} to {move.value or 'its probed driver'}"}.get(move.kind, move.kind)

