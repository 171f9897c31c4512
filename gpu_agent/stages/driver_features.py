"""Driver features: the optional NVIDIA modules (nvidia_modeset, nvidia_peermem, nvidia_fs, gdrdrv,
nvidia_drm), loaded when configured or when `auto` applies. The GPUs are usable without them, so a
feature that cannot be loaded degrades the agent and names the module; it never gates readiness."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from gpu_agent.config.driver import DriverModules
from gpu_agent.errors import AgentError, StageError
from gpu_agent.host import pci
from gpu_agent.host.modules import KernelModules, ModuleLoader
from gpu_agent.host.paths import Root
from gpu_agent.plan import LoadModule
from gpu_agent.stages.base import Action, Stage
from gpu_agent.stages.driver import load_module

FEATURES = ("nvidia_modeset", "nvidia_peermem", "nvidia_fs", "gdrdrv", "nvidia_drm")


@dataclass(frozen=True)
class FeatureState:
    wanted: tuple[str, ...]
    loaded: frozenset[str]

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(module for module in self.wanted if module not in self.loaded)


class DriverFeatures(Stage):
    name = "driver-features"
    requires = ("driver",)
    consumes = ("mellanox_nics",)
    gates_readiness = False

    def __init__(self, root: Root, loader: ModuleLoader, settings: DriverModules) -> None:
        self.root = root
        self.loader = loader
        self.settings = settings
        self.kernel = KernelModules(root)
        self._failures: dict[str, str] = {}  # this pass's load failures, by module

    def start_pass(self) -> None:
        self._failures = {}

    def observe(self) -> FeatureState:
        nics = self.inputs.get("mellanox_nics")  # the driver stage's scan of the bus, this pass
        if nics is None:
            nics = len(pci.scan(self.root).mellanox_nics)
        return FeatureState(self.wanted(nics), frozenset(self.kernel.loaded()))

    def wanted(self, mellanox_nics: int) -> tuple[str, ...]:
        settings = self.settings
        drm = settings.nvidia_drm
        wanted = {
            "nvidia_modeset": settings.nvidia_modeset is True or (settings.nvidia_modeset == "auto" and drm),
            "nvidia_peermem": settings.nvidia_peermem is True
            or (settings.nvidia_peermem == "auto" and mellanox_nics > 0),
            "nvidia_fs": settings.nvidia_fs,
            "gdrdrv": settings.gdrdrv,
            "nvidia_drm": drm,
        }
        return tuple(module for module in FEATURES if wanted[module])

    def plan(self, observed: FeatureState) -> list[Action]:
        return [Action.of(LoadModule(module), functools.partial(self._load, module))
                for module in observed.missing if module not in self._failures]

    def apply(self, actions: Sequence[Action]) -> None:
        """Every feature is tried: one that fails does not keep the others from loading."""
        for action in actions:
            action.execute()

    def _load(self, module: str) -> None:
        try:
            load_module(self.loader, module)
        except AgentError as exc:
            self._failures[module] = str(exc)

    def verify(self, observed: FeatureState) -> str:
        if observed.missing:
            reasons = [f"{module}: {self._failures.get(module, 'not loaded')}" for module in observed.missing]
            raise StageError(f"feature module{'s' if len(reasons) > 1 else ''} not loaded, the GPUs stay usable "
                             f"without {'them' if len(reasons) > 1 else 'it'}: {'; '.join(reasons)}")
        if not observed.wanted:
            return "no feature module configured (driver.modules)"
        return f"{', '.join(observed.wanted)} loaded"
