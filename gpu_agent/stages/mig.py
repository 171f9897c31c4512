"""The mig stage: keep the GPUs' MIG geometry as the selected mig-parted config says.

It runs before discovery, so the inventory, the CDI spec and the labels of the same pass see the new
MIG devices. Its result ("mig") carries nvidia.com/mig.config.state for the labels stage: pending while
a change is under way or waits for a GPU reset the agent will make, rebooting when only a reboot applies
a pending mode change, success, or failed; the reasons go to /status. Every pass compares the GPUs with
the config again, so a geometry lost with a driver reload (Hopper forgets MIG mode) is made again.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from gpu_agent.config.mig import MigConfig
from gpu_agent.errors import AgentError, StageError
from gpu_agent.host.paths import Root
from gpu_agent.mig.apply import FAILED, PENDING, SUCCESS, Applier, GpuResult, awaits_reset, node_state
from gpu_agent.mig.checkpoint import CheckpointStore
from gpu_agent.mig.config import load_mig_config
from gpu_agent.mig.hooks import Hooks, UnitControl
from gpu_agent.mig.planner import GpuPlan, not_applied, plans_for
from gpu_agent.mig.reset import GpuReset
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlUnavailable, describe
from gpu_agent.nvml.model import Inventory
from gpu_agent.stages.base import Action, Stage

log = logging.getLogger(__name__)

CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"


@dataclass(frozen=True)
class MigObservation:
    config: Optional[str]  # the config name in force, None when nothing selects one
    source: str  # where the name came from
    inventory: Optional[Inventory]
    plans: tuple[GpuPlan, ...] = ()
    error: str = ""  # the config file or name cannot be used


@dataclass(frozen=True)
class MigResult:
    """What the stage hands on: the node's state label and each GPU's outcome."""

    config: Optional[str]
    state: str  # pending | rebooting | success | failed
    reason: str
    gpus: tuple[GpuResult, ...] = ()


class Mig(Stage):
    name = "mig"
    produces = ("mig",)

    def __init__(self, root: Root, nvml: Nvml, reset: GpuReset, units: UnitControl, settings: MigConfig,
                 node_label: Optional[Callable[[str], Optional[str]]] = None,
                 announce: Optional[Callable[[str], None]] = None) -> None:
        self.root = root
        self.nvml = nvml
        self.settings = settings
        self.node_label = node_label  # reads a label of this node (mig.follow_node_label)
        self.announce = announce  # publishes the state label at once (before a change starts)
        self.applier = Applier(nvml, reset, CheckpointStore(root), root, force=settings.force)
        self.units = units
        self._results: Optional[tuple[GpuResult, ...]] = None  # what this pass applied
        self._failure = ""  # why this pass's change stopped before every GPU had its outcome
        self._planned: Optional[tuple[Inventory, tuple[GpuPlan, ...]]] = None  # this pass's plans, all GPUs

    def start_pass(self) -> None:
        self._results, self._planned, self._failure = None, None, ""

    # --- observe ---------------------------------------------------------------------------------

    def observe(self) -> MigObservation:
        name, source = self._selected()
        try:
            inventory = self.nvml.inventory.read()
        except (NvmlUnavailable, self.nvml.lib.NVMLError) as exc:
            reason = str(exc) if isinstance(exc, NvmlUnavailable) else f"NVML query failed: {describe(exc)}"
            if name is None:
                raise StageError(reason) from None
            # A selected config that cannot be compared with the GPUs has failed: the state label says so
            # (never left as an earlier pass's success or pending).
            return MigObservation(name, source, None, error=f"MIG config {name}: {reason}")
        if name is None:
            return MigObservation(None, source, inventory)
        try:
            entries = load_mig_config(self.root(self.settings.config_file), "mig.config_file").select(name)
        except AgentError as exc:
            return MigObservation(name, source, inventory, error=f"{exc} (config from {source})")
        # A GPU NVML cannot read has no geometry to compare or change: left as it is (verify notes it).
        return MigObservation(name, source, inventory, tuple(plans_for(inventory.readable, entries)))

    def _selected(self) -> tuple[Optional[str], str]:
        if self.settings.follow_node_label and self.node_label is not None:
            try:
                label = self.node_label(CONFIG_LABEL)
            except AgentError as exc:
                log.warning("cannot read node label %s (%s); using mig.config", CONFIG_LABEL, exc)
            else:
                if label:
                    return label, f"node label {CONFIG_LABEL}"
        return self.settings.config, "mig.config"

    # --- plan and apply --------------------------------------------------------------------------

    def plan(self, observed: MigObservation) -> list[Action]:
        """One action per GPU that needs changes; apply() carries them out together (the hooks once)."""
        if self._results is not None or observed.error or observed.inventory is None:
            return []  # a change is tried once per pass; what did not take is reported by verify
        inventory = observed.inventory
        self._planned = (inventory, observed.plans)
        return [Action(plan.changes, functools.partial(self._apply, inventory, (plan,)))
                for plan in observed.plans if plan.changes and not plan.refused]

    def apply(self, actions: Sequence[Action]) -> None:
        if actions and self._planned is not None:
            inventory, plans = self._planned
            self._apply(inventory, plans)  # every GPU's outcome, refused ones included

    def _apply(self, inventory: Inventory, plans: tuple[GpuPlan, ...]) -> None:
        by_index = {gpu.index: gpu for gpu in inventory.gpus}
        changing = [plan for plan in plans if plan.changes and not plan.refused]
        # Only retrying the reset of a mode already pending changes nothing the node's users see: the state
        # label stays what it is (rebooting) instead of flapping through pending every pass.
        if self.announce is not None and not all(awaits_reset(by_index[p.gpu], p.changes[0]) for p in changing):
            try:
                self.announce(PENDING)
            except AgentError as exc:
                log.warning("cannot set %s=pending before the MIG change: %s", STATE_LABEL, exc)
        hooks = Hooks(self.settings.stop_units, self.units) if self.settings.stop_units else None
        try:
            self._results = tuple(self.applier.apply_all(inventory.readable, plans, hooks=hooks))
        except AgentError as exc:  # the state label goes failed, not left pending (outputs() after the error)
            self._failure = str(exc)
            raise
        except Exception as exc:
            log.exception("MIG change; this is a gpu-agent bug")
            self._failure = f"internal error: {type(exc).__name__}: {exc}"
            raise StageError(self._failure) from exc
        finally:
            self.nvml.inventory.forget()  # a GPU reset changes MIG outside NVML's calls
        for result in self._results:
            if result.changes or result.state != SUCCESS:
                log.log(logging.INFO if result.state == SUCCESS else logging.ERROR, "GPU %d: %s: %s",
                        result.gpu, result.action, result.reason)

    # --- verify and results ----------------------------------------------------------------------

    def verify(self, observed: MigObservation) -> str:
        if observed.error:
            raise StageError(observed.error)
        if observed.config is None:
            return "no MIG config selected (mig.config); MIG geometry left as it is"
        if self._results is not None:
            problems = [r.reason for r in self._results if r.state != SUCCESS]
            if problems:
                raise StageError("; ".join(problems))
        reasons = not_applied(observed.plans)
        if reasons:
            raise StageError(f"MIG config {observed.config}: " + "; ".join(reasons))
        skipped = [plan.skipped for plan in observed.plans if plan.skipped]
        if observed.inventory is not None:
            skipped += [f"{note}: its MIG geometry is left as it is" for note in observed.inventory.unreadable_notes()]
        return (f"MIG config {observed.config} applied ({len(observed.plans)} GPUs)"
                + "".join(f"; {reason}" for reason in skipped))

    def outputs(self, observed: MigObservation) -> dict[str, Any]:
        return {"mig": self._result(observed)}

    def facts(self, observed: MigObservation) -> dict[str, Any]:
        result = self._result(observed)
        return {"config": result.config, "source": observed.source, "state": result.state, "reason": result.reason,
                "gpus": [gpu.to_json() for gpu in result.gpus]}

    def _result(self, observed: MigObservation) -> MigResult:
        if observed.config is None:
            return MigResult(None, SUCCESS, "no MIG config selected")
        if observed.error:
            return MigResult(observed.config, FAILED, observed.error)
        if self._failure:
            return MigResult(observed.config, FAILED, self._failure)
        if self._results is not None:
            state = node_state(self._results)
            reasons = "; ".join(r.reason for r in self._results if r.state != SUCCESS)
            return MigResult(observed.config, state, reasons or "applied", self._results)
        refused = [plan.refused for plan in observed.plans if plan.refused]
        if refused:
            return MigResult(observed.config, FAILED, "; ".join(refused))
        if any(plan.changes for plan in observed.plans):
            return MigResult(observed.config, PENDING, "changes planned, not yet made")
        return MigResult(observed.config, SUCCESS, "applied")

    def watched(self) -> list[str]:
        return [self.settings.config_file]
