"""CDI stage: the Container Device Interface spec for the GPUs and MIG devices discovery found, written
only when its content changes (a driver update, a MIG change, device numbers after a driver reload).

It consumes the inventory, so a MIG change made earlier in the same pass reaches the spec in that pass,
and the device path: the spec is written whenever anything will name its devices (a runtime whose CDI
switch the toolkit writes, a CDI consumer such as Podman, or the device plugin with a CDI strategy),
and only then. Without a device
path (its stage off), whenever the toolkit stage found a container runtime. The device names the spec
holds once written go to the device plugin, which names no other.

While it writes the spec it takes over the toolkit package's own nvidia-cdi-refresh units, which write
the same spec (toolkit/cdi_refresh.py), and it fails while another spec in the CDI directories defines
a device its spec defines (toolkit/cdi_duplicates.py), naming the files.
"""
from __future__ import annotations

import functools
import posixpath
from dataclasses import dataclass
from typing import Any, Optional

from gpu_agent.config.toolkit import CdiConfig
from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import owned
from gpu_agent.host.files import remove, stray_temps, unified_diff
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.nvml.model import Inventory
from gpu_agent.mig.hooks import UnitControl
from gpu_agent.plan import RemoveFile, TakeOverUnit, WriteFile
from gpu_agent.stages.base import Action, Stage
from gpu_agent.toolkit import cdi, cdi_duplicates, cdi_readers, cdi_refresh, configfile
from gpu_agent.toolkit.cdi_refresh import Refresh
from gpu_agent.toolkit.devicepath import DevicePath
from gpu_agent.toolkit.services import ServiceControl, UnitState


@dataclass(frozen=True)
class CdiState:
    path: str  # where the spec goes (a link's target)
    current: Optional[str]
    desired: Optional[str]  # None: nothing names a CDI device here
    strays: tuple[str, ...] = ()  # temp files of a write a crash interrupted
    devices: frozenset[str] = frozenset()  # the spec's device names (nvidia.com/gpu=GPU-...)
    why_none: str = ""  # why no spec is needed
    refresh: Refresh = Refresh()  # the toolkit package's CDI refresh units, as found
    take_over: tuple[tuple[str, UnitState], ...] = ()  # those of its units still to take over
    duplicates: tuple[tuple[str, tuple[str, ...]], ...] = ()  # devices other specs define too, with their files
    groups: str = ""  # what became of additionalGids, for the message: "" when no device node needs a group


class Cdi(Stage):
    name = "cdi"
    requires = ("discovery",)
    produces = ("cdi_devices",)
    consumes = ("inventory", "runtimes", "device_path")

    def __init__(self, root: Root, settings: CdiConfig, services: ServiceControl, units: Optional[UnitControl]) -> None:
        self.root = root
        self.settings = settings
        self.services = services
        self.units = units  # None: nothing here can stop a unit, so none is taken over
        self.ledger = Ledger(root)

    def observe(self) -> CdiState:
        inventory: Optional[Inventory] = self.inputs.get("inventory")
        path: Optional[DevicePath] = self.inputs.get("device_path")
        if path is not None and not path.spec_needed:
            return CdiState(self.settings.path, None, None, why_none="no CDI spec needed: no runtime here gets CDI "
                            "switched on, no CDI consumer (Podman 4.1+, nerdctl 2.1+) is installed and the device "
                            f"plugin names no CDI device ({path.strategy})")
        if path is None and not self.inputs.get("runtimes"):
            return CdiState(self.settings.path, None, None, why_none="no container runtime found: no CDI spec needed")
        if inventory is None:
            raise StageError("no GPU inventory for the CDI spec")
        try:
            files = cdi.discover(self.root, inventory.driver_version)
            if files.missing:
                raise StageError(f"driver {inventory.driver_version}'s userspace libraries are missing from the "
                                 f"ld.so cache ({', '.join(files.missing)}): reinstall the driver's userspace, "
                                 "or run ldconfig")
            gids, why_not = self._additional_gids(path)
            built = cdi.build_spec(inventory, self.root, files, additional_gids=gids)
            spec = cdi.render(built)
            groups = cdi.group_ids(self.root, cdi.device_node_paths(built))
            note = "" if not groups else (f"; additionalGids {', '.join(map(str, groups))} (cdiVersion "
                                          f"{built['cdiVersion']})" if gids else f"; no additionalGids: {why_not}")
            current = configfile.read(self.root, self.settings.path)
        except AgentError as exc:
            raise StageError(f"CDI spec: {exc}") from None
        directory, name = posixpath.split(current.target)
        strays = tuple(posixpath.join(directory, path.name) for path in stray_temps(self.root(directory), [name]))
        devices = frozenset(cdi_duplicates.device_names(built))
        refresh = cdi_refresh.find(self.root, self.services)
        take_over = cdi_refresh.to_take_over(refresh, self.ledger) if self.units is not None else []
        return CdiState(current.target, current.text, spec, strays, devices, refresh=refresh,
                        take_over=tuple(take_over), duplicates=self._duplicates(current.target, devices), groups=note)

    def _additional_gids(self, path: Optional[DevicePath]) -> tuple[bool, str]:
        """Whether the spec gives containers their device nodes' groups, and if not why: only where every CDI
        reader here takes a cdiVersion 0.7.0 spec (one that does not would refuse the whole file)."""
        setting = self.settings.additional_gids
        if setting != "auto":
            return bool(setting), "toolkit.cdi.additional_gids is false"
        if path is None or not path.readers:
            return False, ("no CDI reader whose version says it reads cdiVersion 0.7.0 "
                           "(toolkit.cdi.additional_gids: auto)")
        refusing = cdi_readers.refusing_070(path.readers)
        if refusing:
            return False, (f"cdiVersion 0.7.0 would be refused by {'; '.join(refusing)}: the spec stays at the "
                           "version without them (toolkit.cdi.additional_gids: auto)")
        return True, ""

    def _duplicates(self, path: str, devices: frozenset[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Devices defined by more than one spec: the agent's as it will be written, and every other spec in
        the CDI directories but those the ledger says this stage wrote (undone later in the pass)."""
        mine = {entry.path for entry in self.ledger.owned().values() if entry.owner == self.name}
        others = cdi_duplicates.other_specs(self.root, {path, *mine}, (*cdi_duplicates.SPEC_DIRS,
                                                                       posixpath.dirname(path)))
        found = cdi_duplicates.duplicates({path: set(devices), **others})
        return tuple((device, tuple(paths)) for device, paths in found.items())

    def plan(self, state: CdiState) -> list[Action]:
        actions = [Action.of(RemoveFile(path), functools.partial(remove, self.root(path))) for path in state.strays]
        if state.desired is not None and state.take_over and self.units is not None:  # before the spec: no rewrite
            units = self.units
            actions.append(Action(tuple(TakeOverUnit(unit, found.file_state, found.running)
                                        for unit, found in state.take_over),
                                  lambda: cdi_refresh.take_over(self.ledger, units, self.name, list(state.take_over))))
        if state.desired is not None and state.current != state.desired:
            actions.append(Action.of(WriteFile.of(state.path, state.desired, state.current), lambda: self._write(state),
                                     diff=unified_diff(state.path, state.current, state.desired)))
        return actions

    def _write(self, state: CdiState) -> None:
        assert state.desired is not None
        try:
            owned.write(self.root, self.ledger, self.name, state.path, state.desired)
        except OSError as exc:
            raise StageError(f"cannot write the CDI spec {state.path}: {exc.strerror or exc}") from None

    def verify(self, state: CdiState) -> str:
        if state.desired is None:
            return state.why_none + self._refresh_note(state)
        problems = [f"the CDI spec {state.path} is not as generated"] if state.current != state.desired else []
        if state.take_over:
            problems.append(f"found {state.refresh.found()}: not taken over"
                            + ("" if self.units is not None else " (no service manager here)"))
        if state.duplicates:
            found = {device: list(paths) for device, paths in state.duplicates}
            problems.append(f"devices defined by more than one CDI spec, which CDI readers cannot tell apart: "
                            f"{cdi_duplicates.describe(found)}; remove the specs gpu-agent did not write (it writes "
                            f"{state.path})")
        if problems:
            raise StageError("; ".join(problems))
        return f"CDI spec {state.path} is up to date{state.groups}{self._refresh_note(state)}"

    def _refresh_note(self, state: CdiState) -> str:
        """What the stage found of the toolkit package's CDI refresh, and did with it."""
        if not state.refresh.units and state.refresh.udev_rule is None:
            return ""
        taken = sorted(set(self.ledger.units()) & set(state.refresh.units))
        did = (f"; taken over: {', '.join(taken)} stopped, disabled and masked (put back at uninstall)" if taken
               else "; left alone: gpu-agent writes no spec" if state.desired is None else "")
        return f"; found {state.refresh.found()}{did}"

    def outputs(self, state: CdiState) -> dict[str, Any]:
        """The spec's device names once the file is as generated; none before, or without a spec."""
        written = state.desired is not None and state.current == state.desired
        return {"cdi_devices": state.devices if written else frozenset()}

    def claims(self, state: CdiState) -> set[str]:
        """The spec's path, and the names of the units taken over for it (never a path: no clash)."""
        return {state.path, *state.refresh.units} if state.desired is not None else set()

    def watched(self) -> list[str]:
        return [self.settings.path]
