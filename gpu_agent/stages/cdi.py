"""CDI stage: the Container Device Interface spec for the GPUs and MIG devices discovery found, written
only when its content changes (a driver update, a MIG change, device numbers after a driver reload).

It consumes the inventory, so a MIG change made earlier in the same pass reaches the spec in that pass,
and the container runtimes the toolkit stage found: with none, no spec is needed and none is written.
"""
from __future__ import annotations

import functools
import posixpath
from dataclasses import dataclass
from typing import Optional

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


@dataclass(frozen=True)
class CdiState:
    path: str  # where the spec goes (a link's target)
    current: Optional[str]
    desired: Optional[str]  # None: no container runtime to read a spec
    strays: tuple[str, ...] = ()  # temp files of a write a crash interrupted


class Cdi(Stage):
    name = "cdi"
    requires = ("discovery",)
    consumes = ("inventory", "runtimes")

    def __init__(self, root: Root, settings: CdiConfig) -> None:
        self.root = root
        self.settings = settings
        self.ledger = Ledger(root)

    def observe(self) -> CdiState:
        inventory: Optional[Inventory] = self.inputs.get("inventory")
        if not self.inputs.get("runtimes"):
            return CdiState(self.settings.path, None, None)
        if inventory is None:
            raise StageError("no GPU inventory for the CDI spec")
        try:
            files = cdi.discover(self.root, inventory.driver_version)
            if files.missing:
                raise StageError(f"driver {inventory.driver_version}'s userspace libraries are missing from the "
                                 f"ld.so cache ({', '.join(files.missing)}): reinstall the driver's userspace, "
                                 "or run ldconfig")
            spec = cdi.render(cdi.build_spec(inventory, self.root, files))
            current = configfile.read(self.root, self.settings.path)
        except AgentError as exc:
            raise StageError(f"CDI spec: {exc}") from None
        directory, name = posixpath.split(current.target)
        strays = tuple(posixpath.join(directory, path.name) for path in stray_temps(self.root(directory), [name]))
        return CdiState(current.target, current.text, spec, strays)

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
            return "no container runtime found: no CDI spec needed"
        if state.current != state.desired:
            raise StageError(f"the CDI spec {state.path} is not as generated")
        return f"CDI spec {state.path} is up to date"

    def claims(self, state: CdiState) -> set[str]:
        return {state.path} if state.desired is not None else set()

    def watched(self) -> list[str]:
        return [self.settings.path]
