"""The driver reload as a state machine. Its state is the ledger's record (Progress: the step, and what the
agent took away so far); its next move is a pure function, decide(), of that record, of what the node shows
now (Facts: the loaded and the installed driver, the boot, the modules, who uses the GPUs, ...), of what was
asked (Request: `gpu-agent driver reload [--force|--abort]`) and of the config (Rules).

Nothing here reads the host or changes it: stages/driver_reload.py observes the facts, takes the move,
records it and asks again. tests/test_driver_reload_transitions.py goes over every state with every
combination of the facts that decide it.

The invariants decide() keeps (docs/driver-upgrades.md):
- a driver whose loaded version is the installed one is never unloaded, unless asked (`--force`, or the
  module options the operator asked `gpu-agent driver reload` to apply);
- the next step follows what the node shows, not only the record: a reboot (a new boot id), a driver loaded
  by someone else, a target that moved (a second upgrade, a rollback) are each a move of their own;
- every end (done, abandoned by the agent, aborted) puts back what the agent took away and uncordons a node
  the agent cordoned; a failure puts back what can be put back while the reload is tried again;
- the agent's own MPS control daemons and their servers are never GPU users to wait for: they are quit before
  the unload (recorded first), and started again, their GPUs in EXCLUSIVE_PROCESS, once the reload is validated
  (or at any end).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gpu_agent.errors import AgentError

# The steps (the GPU Operator's upgrade states, k8s-operator-libs pkg/upgrade/consts.go, commit 11e747a5), and
# the agent's own end for a reload given up (aborted, or with nothing left to reload).
UPGRADE_REQUIRED = "upgrade-required"
CORDON_REQUIRED = "cordon-required"
WAIT_FOR_JOBS = "wait-for-jobs-required"
POD_DELETION = "pod-deletion-required"
DRAIN = "drain-required"
POD_RESTART = "pod-restart-required"
VALIDATION = "validation-required"
UNCORDON = "uncordon-required"
DONE = "upgrade-done"
FAILED = "upgrade-failed"
ABANDONED = "upgrade-abandoned"
ORDER = (UPGRADE_REQUIRED, CORDON_REQUIRED, WAIT_FOR_JOBS, POD_DELETION, DRAIN, POD_RESTART, VALIDATION,
         UNCORDON, DONE)
FINAL = (DONE, ABANDONED)
STEPS = (*ORDER, FAILED, ABANDONED)
RELOADING = (CORDON_REQUIRED, WAIT_FOR_JOBS, POD_DELETION, DRAIN, POD_RESTART)  # the driver stage's steps
FINISHING = (VALIDATION, UNCORDON)  # the driver-upgrade stage's, after this pass's MIG, discovery and CDI

# Why a reload runs: the installed driver is not the loaded one; the operator asked for the changed options of
# a loaded module to apply; or `--force` on a driver that needed nothing.
VERSION = "version"
OPTIONS = "options"
FORCED = "forced"
REASONS = (VERSION, OPTIONS, FORCED)

UNLOAD_ORDER = ("nvidia_drm", "nvidia_peermem", "nvidia_fs", "gdrdrv", "nvidia_modeset", "nvidia_uvm", "nvidia")
LOAD_ORDER = UNLOAD_ORDER[::-1]
CORE = ("nvidia", "nvidia_uvm")

# The moves.
IDLE = "idle"  # no reload under way and none to start; arg: why (one of the IDLE_ reasons)
LATER = "later"  # the next step is the driver-upgrade stage's, after this pass's validated stages
START = "start"  # arg: the reason
RELEASE = "release"  # an ended reload whose uncordon failed: uncordon
ABORT = "abort"  # arg: who asked
NEW_BOOT = "new-boot"  # arg: the boot id now
RETARGET = "retarget"  # arg: the version installed now
MOOT = "moot"  # nothing left to reload and the loaded driver is the one the reload began with; arg: why
FINISH = "finish"  # the target is loaded without the agent's unload (a reboot, by hand): on to its load phase
RETRY = "retry"  # arg: the failed step
CORDON = "cordon"
WAIT = "wait"
GIVE_UP = "give-up"  # waited reload_wait_seconds
ADVANCE = "advance"  # arg: the next step
REFUSE = "refuse"  # arg: REFUSE_DISPLAY or REFUSE_BUSY
HOLD_PLUGIN = "hold-plugin"
STOP_UNIT = "stop-unit"  # arg: the unit
UNBIND_CONSOLE = "unbind-console"  # arg: the vtconsole
QUIT_MPS = "quit-mps"  # arg: the resource whose MPS control daemon (the agent's own) is quit for the unload
UNLOAD = "unload"  # arg: the module
MISLOADED = "misloaded"  # the agent loaded nvidia and it is not the installed version; arg: the version loaded
LOAD = "load"  # arg: the module
BIND_CONSOLE = "bind-console"  # arg: the vtconsole
VERIFY = "verify"  # NVML's version, the units started, then validation
INVALID = "invalid"  # a validated stage failed
START_MPS = "start-mps"  # validated: arg: a resource whose daemon the agent quit, its GPUs EXCLUSIVE_PROCESS again
UNCORDON_NODE = "uncordon"  # validated: the plugin back, uncordon if the agent cordoned, done
MOVES = (IDLE, LATER, START, RELEASE, ABORT, NEW_BOOT, RETARGET, MOOT, FINISH, RETRY, CORDON, WAIT, GIVE_UP,
         ADVANCE, REFUSE, HOLD_PLUGIN, STOP_UNIT, QUIT_MPS, UNBIND_CONSOLE, UNLOAD, MISLOADED, LOAD, BIND_CONSOLE,
         VERIFY, INVALID, START_MPS, UNCORDON_NODE)

IDLE_NOTHING = "nothing"  # the installed driver is loaded, with the configured options
IDLE_NOT_LOADED = "not-loaded"  # no nvidia module loaded: the driver stage loads the installed one
IDLE_NEVER = "never"  # driver.reload: never
IDLE_SKIP = "skip"  # the node's label or annotation says not to
IDLE_ABANDONED = "abandoned"  # this target's reload was abandoned: only a request starts it again
IDLE_OPTIONS = "options"  # a module option changed: only a request applies it
IDLE_NO_ABORT = "no-abort"  # --abort with nothing under way
REFUSE_DISPLAY = "display"
REFUSE_BUSY = "busy"


@dataclass
class Progress:
    """The ledger's driver_reload entry: the state, and what the agent took away that it owes back."""

    step: str
    target: str  # the version being loaded: the installed one (for OPTIONS and FORCED: the loaded one)
    loaded: str  # the version loaded when the sequence began
    started: float = field(default_factory=time.time)
    modules: list[str] = field(default_factory=list)  # the NVIDIA modules loaded then, loaded again after
    cordoned: bool = False  # the agent cordoned the node (so it uncordons it)
    notes: list[str] = field(default_factory=list)
    stopped_units: list[str] = field(default_factory=list)  # the units the agent stopped, started at every end
    # The resources whose MPS control daemons the agent quit for the unload: held off (the MPS watch starts none of
    # them) until the agent starts them again, after validation or at any end; empty in every ended record.
    stopped_mps: list[str] = field(default_factory=list)
    waiting_since: Optional[float] = None
    failed_step: Optional[str] = None
    failure: Optional[str] = None
    forced: bool = False
    plugin_stopped: bool = False  # the device plugin is held off until the reload is validated
    reason: str = VERSION
    boot_id: Optional[str] = None  # the boot the agent's unloads and stops were made in
    unloaded: list[str] = field(default_factory=list)  # the modules the agent unloaded and has not loaded again
    consoles: list[str] = field(default_factory=list)  # the vtconsoles the agent unbound from nvidia-drm's fb
    reloaded: bool = False  # the agent loaded nvidia in this sequence (or, for OPTIONS and FORCED, a boot did)
    ended_by: Optional[str] = None  # who ended it (ABANDONED: `--abort`'s caller, or gpu-agent)
    ended_at: Optional[float] = None
    ended_why: Optional[str] = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Progress:
        """From the ledger; AgentError naming the key of a value of the wrong type."""
        defaults = cls(step=DONE, target="", loaded="")
        known = {}
        for key in cls.__dataclass_fields__:
            if key not in data:
                continue
            value, default = data[key], getattr(defaults, key)
            if not _same_type(value, default, key):
                raise AgentError(f"ledger driver_reload.{key}: {value!r} is not a {_type_name(default, key)}")
            known[key] = value
        for key in ("step", "target", "loaded"):
            if key not in known:
                raise AgentError(f"ledger driver_reload: no {key}")
        progress = cls(**known)
        if progress.step not in STEPS:
            raise AgentError(f"ledger driver_reload.step {progress.step!r} is no upgrade state")
        if progress.reason not in REASONS:
            raise AgentError(f"ledger driver_reload.reason {progress.reason!r} is none of {', '.join(REASONS)}")
        return progress

    def load_order(self) -> list[str]:
        """The modules to have loaded at the end: those loaded when it began, the core ones at least."""
        wanted = set(self.modules) | set(CORE)
        return [module for module in LOAD_ORDER if module in wanted]

    def what(self) -> str:
        """`reload of 550.90.07 to 570.124.06`, as messages name the sequence."""
        if self.reason == OPTIONS:
            return f"reload of {self.loaded} to apply changed module options"
        if self.reason == FORCED:
            return f"forced reload of {self.loaded}"
        return f"reload of {self.loaded} to {self.target}"


_OPTIONAL_STR = ("target", "loaded", "waiting_since", "failed_step", "failure", "boot_id", "ended_by", "ended_at",
                 "ended_why")
_NUMBERS = ("started", "waiting_since", "ended_at")


def _same_type(value: Any, default: Any, key: str) -> bool:
    if key in _NUMBERS:
        return (value is None and key != "started") or (isinstance(value, (int, float)) and not isinstance(value, bool))
    if isinstance(default, list):
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if isinstance(default, bool):
        return isinstance(value, bool)
    if key in _OPTIONAL_STR and value is None:
        return key not in ("target", "loaded")
    return isinstance(value, str)


def _type_name(default: Any, key: str) -> str:
    if key in _NUMBERS:
        return "number of seconds"
    return {list: "list of strings", bool: "true or false"}.get(type(default), "string")


@dataclass(frozen=True)
class Facts:
    """What the node shows now, as far as the next move depends on it."""

    loaded: Optional[str]  # the loaded nvidia module's version; None: not loaded
    installed: Optional[str]  # the driver modprobe would load (its module on disk, else its library); None: unknown
    boot_id: Optional[str] = None  # /proc/sys/kernel/random/boot_id
    modules: frozenset[str] = frozenset()  # the NVIDIA modules (UNLOAD_ORDER) loaded now
    busy: tuple[str, ...] = ()  # what uses a GPU: pods, processes (looked at while waiting or unloading)
    active_units: frozenset[str] = frozenset()  # of driver.reload_units and the stopped units, those running
    mps: tuple[str, ...] = ()  # the resources whose MPS control daemons (the agent's own) run now
    display: Optional[str] = None  # what holds nvidia_drm that the agent never takes away (a display server)
    consoles: tuple[str, ...] = ()  # vtconsoles bound to nvidia-drm's framebuffer (fbdev), which it may unbind
    drift: tuple[str, ...] = ()  # NVIDIA modules' options that are not the configured ones, described
    skip: Optional[str] = None  # the node's label or annotation that says not to reload
    now: float = 0.0
    validation: Optional[tuple[str, ...]] = None  # the validated stages that failed; None: not known (driver stage)

    @property
    def mismatch(self) -> bool:
        return self.loaded is not None and self.installed is not None and self.loaded != self.installed


@dataclass(frozen=True)
class Request:
    """What `gpu-agent driver reload` asked of this pass."""

    reload: bool = False  # run the sequence whatever driver.reload says
    force: bool = False  # reload while GPUs are used; reload a driver that needs nothing
    abort: Optional[str] = None  # end the unfinished reload: who asked


@dataclass(frozen=True)
class Rules:
    """The config's say."""

    mode: str = "never"  # driver.reload
    wait_seconds: float = 3600.0  # driver.reload_wait_seconds, or the request's --timeout
    units: tuple[str, ...] = ()  # driver.reload_units


@dataclass(frozen=True)
class Move:
    kind: str
    arg: str = ""


def decide(record: Optional[Progress], facts: Facts, request: Request, rules: Rules) -> Move:
    """The next move."""
    if record is None or record.step in FINAL:
        return _between(record, facts, request, rules)
    if request.abort is not None:
        return Move(ABORT, request.abort)
    if record.boot_id is not None and facts.boot_id is not None and record.boot_id != facts.boot_id:
        return Move(NEW_BOOT, facts.boot_id)
    settled = _settled(record, facts)
    if settled is not None:
        return settled
    if record.step == FAILED:
        return Move(RETRY, record.failed_step if record.failed_step in (*RELOADING, *FINISHING) else CORDON_REQUIRED)
    return _BY_STEP[record.step](record, facts, request, rules)


def _between(record: Optional[Progress], facts: Facts, request: Request, rules: Rules) -> Move:
    """No reload under way: start one, or say why not."""
    if record is not None and record.cordoned:
        return Move(RELEASE)
    if request.abort is not None:
        return Move(IDLE, IDLE_NO_ABORT)
    if facts.loaded is None:
        return Move(IDLE, IDLE_NOT_LOADED)
    if facts.mismatch:
        if request.reload:
            return Move(START, VERSION)
        if rules.mode != "when-idle":
            return Move(IDLE, IDLE_NEVER)
        if facts.skip is not None:
            return Move(IDLE, IDLE_SKIP)
        if record is not None and record.step == ABANDONED and record.target == facts.installed:
            return Move(IDLE, IDLE_ABANDONED)
        return Move(START, VERSION)
    if request.reload and request.force:
        return Move(START, FORCED)
    if facts.drift:
        return Move(START, OPTIONS) if request.reload else Move(IDLE, IDLE_OPTIONS)
    return Move(IDLE, IDLE_NOTHING)


def _settled(record: Progress, facts: Facts) -> Optional[Move]:
    """What the node shows that the record does not: a target that moved, or a reload no longer needed."""
    installed, loaded = facts.installed, facts.loaded
    if installed is not None and installed != record.target:
        if record.reason == VERSION and loaded == installed == record.loaded and not record.reloaded:
            return Move(MOOT, f"the installed driver is {installed} again, the one loaded")
        return Move(RETARGET, installed)
    if record.step in FINISHING or record.reloaded:
        return None
    if record.reason == VERSION and loaded is not None and loaded == record.target:
        return Move(FINISH, f"{loaded} is loaded (by a reboot, or by hand)")
    if record.reason == OPTIONS and not facts.drift and not record.unloaded and loaded is not None:
        return Move(MOOT, "the loaded modules have the configured options")
    return None


def _cordon(record: Progress, facts: Facts, request: Request, rules: Rules) -> Move:
    return Move(CORDON)


def _wait(record: Progress, facts: Facts, request: Request, rules: Rules) -> Move:
    if facts.busy and not (record.forced or request.force):
        if record.waiting_since is not None and facts.now - record.waiting_since > rules.wait_seconds:
            return Move(GIVE_UP)
        return Move(WAIT)
    return Move(ADVANCE, POD_DELETION)


def _pass_through(following: str) -> Callable[[Progress, Facts, Request, Rules], Move]:
    """The agent deletes and drains no pods: what runs on the node was waited for."""
    return lambda record, facts, request, rules: Move(ADVANCE, following)


def _restart(record: Progress, facts: Facts, request: Request, rules: Rules) -> Move:
    """Unload what is loaded (what the agent would take away first), then load, then verify."""
    loaded, target = facts.loaded, facts.installed or record.target
    if loaded is not None and not record.reloaded and (record.reason != VERSION or loaded != target):
        if facts.display is not None:
            return Move(REFUSE, REFUSE_DISPLAY)
        if not record.plugin_stopped:
            return Move(HOLD_PLUGIN)
        for unit in rules.units:
            if unit in facts.active_units and unit not in record.stopped_units:
                return Move(STOP_UNIT, unit)
        if facts.busy and not (record.forced or request.force) and not record.unloaded:
            return Move(REFUSE, REFUSE_BUSY)
        if facts.mps:  # its server holds the GPUs after its last client: never counted busy, quit here
            return Move(QUIT_MPS, facts.mps[0])
        if "nvidia_drm" in facts.modules and facts.consoles:
            return Move(UNBIND_CONSOLE, facts.consoles[0])
        return Move(UNLOAD, next(module for module in UNLOAD_ORDER if module in facts.modules or module == "nvidia"))
    if loaded is not None and record.reason == VERSION and loaded != target:
        return Move(MISLOADED, loaded)
    for module in record.load_order():
        if module not in facts.modules:
            return Move(LOAD, module)
    if record.consoles:
        return Move(BIND_CONSOLE, record.consoles[0])
    return Move(VERIFY)


def _validate(record: Progress, facts: Facts, request: Request, rules: Rules) -> Move:
    if facts.validation is None:
        return Move(LATER)
    if facts.validation:
        return Move(INVALID, "; ".join(facts.validation))
    if record.stopped_mps:
        return Move(START_MPS, record.stopped_mps[0])
    return Move(UNCORDON_NODE)


_BY_STEP: dict[str, Callable[[Progress, Facts, Request, Rules], Move]] = {
    CORDON_REQUIRED: _cordon, WAIT_FOR_JOBS: _wait, POD_DELETION: _pass_through(DRAIN),
    DRAIN: _pass_through(POD_RESTART), POD_RESTART: _restart, VALIDATION: _validate, UNCORDON: _validate,
    UPGRADE_REQUIRED: _cordon,  # recorded only by an agent killed between the two records of a start
}


def label(record: Optional[Progress], facts_mismatch: bool, installed: Optional[str]) -> Optional[str]:
    """The node's nvidia.com/gpu-driver-upgrade-state: the step under way; after an end, upgrade-required
    while the installed driver is not the loaded one (upgrade-abandoned while that is the abandoned target),
    else the end."""
    if record is None:
        return UPGRADE_REQUIRED if facts_mismatch else None
    if record.step not in FINAL:
        return record.step
    if facts_mismatch:
        return ABANDONED if record.step == ABANDONED and record.target == installed else UPGRADE_REQUIRED
    return DONE
