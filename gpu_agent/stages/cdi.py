"""CDI stage: the Container Device Interface spec for the GPUs and MIG devices discovery found, written
only when its content changes (a driver update, a MIG change, device numbers after a driver reload).

It consumes the inventory, so a MIG change made earlier in the same pass reaches the spec in that pass,
and the device path: the spec is written whenever anything will name its devices (a runtime whose CDI
switch the toolkit writes, a CDI consumer such as Podman, or the device plugin with a CDI strategy),
and only then. Without a device
path (its stage off), whenever the toolkit stage found a container runtime. The device names the spec
holds once written go to the device plugin, which names no other.
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
from gpu_agent.plan import RemoveFile, WriteFile
from gpu_agent.stages.base import Action, Stage
from gpu_agent.toolkit import cdi, configfile
from gpu_agent.toolkit.devicepath import DevicePath


@dataclass(frozen=True)
class CdiState:
    path: str  # where the spec goes (a link's target)
    current: Optional[str]
    desired: Optional[str]  # None: nothing names a CDI device here
    strays: tuple[str, ...] = ()  # temp files of a write a crash interrupted
    devices: frozenset[str] = frozenset()  # the spec's device names (nvidia.com/gpu=GPU-...)
    why_none: str = ""  # why no spec is needed


class Cdi(Stage):
    name = "cdi"
    requires = ("discovery",)
    produces = ("cdi_devices",)
    consumes = ("inventory", "runtimes", "device_path")

    def __init__(self, root: Root, settings: CdiConfig) -> None:
        self.root = root
        self.settings = settings
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
            built = cdi.build_spec(inventory, self.root, files)
            spec = cdi.render(built)
            current = configfile.read(self.root, self.settings.path)
        except AgentError as exc:
            raise StageError(f"CDI spec: {exc}") from None
        directory, name = posixpath.split(current.target)
        strays = tuple(posixpath.join(directory, path.name) for path in stray_temps(self.root(directory), [name]))
        devices = frozenset(f"{built['kind']}={device['name']}" for device in built["devices"])
        return CdiState(current.target, current.text, spec, strays, devices)

    def plan(self, state: CdiState) -> list[Action]:
        actions = [Action.of(RemoveFile(path), functools.partial(remove, self.root(path))) for path in state.strays]
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
            return state.why_none
        if state.current != state.desired:
            raise StageError(f"the CDI spec {state.path} is not as generated")
        return f"CDI spec {state.path} is up to date"

    def outputs(self, state: CdiState) -> dict[str, Any]:
        """The spec's device names once the file is as generated; none before, or without a spec."""
        written = state.desired is not None and state.current == state.desired
        return {"cdi_devices": state.devices if written else frozenset()}

    def claims(self, state: CdiState) -> set[str]:
        return {state.path} if state.desired is not None else set()

    def watched(self) -> list[str]:
        return [self.settings.path]
