"""The toolkit package's own CDI refresh, and how the agent takes it over while it writes the spec.

Since nvidia-container-toolkit 1.18.0 its package ships nvidia-cdi-refresh.path and nvidia-cdi-refresh.service
(NVIDIA/nvidia-container-toolkit deployments/systemd/, enabled by the package's preset; at v1.20.0, commit
f0c382c8): the path unit watches the kernel's modules.dep and nvidia-ctk, the service runs
`nvidia-ctk cdi generate` into /var/run/cdi/nvidia.yaml, the agent's default spec path (the service's
NVIDIA_CTK_CDI_OUTPUT_FILE_PATH, which /etc/nvidia-container-toolkit/nvidia-cdi-refresh.env may change).
After v1.20.0 the release-1.20 branch adds deployments/udev/99-nvidia-cdi-refresh.rules (commit cc6af05a,
cherry-picked from 8269969f): the service is wanted whenever the nvidia module loads. The RPM's %posttrans
(v1.20.0) starts both units on every install and upgrade.

Two writers of one spec take turns overwriting it, and two specs naming the same devices make those
devices ambiguous to every CDI reader. So while the agent writes the spec it takes the units over: each
is recorded in the ledger (its UnitFileState and whether it was active), then stopped, disabled and
masked. Disabling alone would not hold: the udev rule and the RPM's scripts start the service whatever
its enablement; only a mask stops them. When the agent stops writing the spec, and at uninstall, each is
unmasked, enabled again if it was, and started again if it was active (owned_files).
"""
from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Optional

from gpu_agent.errors import AgentError, StageError
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.ledger import Ledger, OwnedUnit
from gpu_agent.host.paths import Root, resolve
from gpu_agent.mig.hooks import UnitControl
from gpu_agent.toolkit.services import ServiceControl, UnitState

UNITS = ("nvidia-cdi-refresh.path", "nvidia-cdi-refresh.service")  # the path unit first: it starts the service


def give_back_order(unit: str) -> int:
    """Units are given back in the reverse of their take-over: systemd refuses to start a path unit whose
    service is still masked ("Refusing to start, unit ... to trigger not loaded"), so the service comes first."""
    return -UNITS.index(unit) if unit in UNITS else 1
# systemd's unit search path for the system manager (systemd.unit(5)), highest priority first.
UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system",
             "/lib/systemd/system")
UDEV_RULE = "99-nvidia-cdi-refresh.rules"
UDEV_DIRS = ("/etc/udev/rules.d", "/run/udev/rules.d", "/usr/lib/udev/rules.d", "/lib/udev/rules.d")  # udev(7)
ENV_FILE = "/etc/nvidia-container-toolkit/nvidia-cdi-refresh.env"
OUTPUT_VARIABLE = "NVIDIA_CTK_CDI_OUTPUT_FILE_PATH"
DEFAULT_OUTPUT = "/var/run/cdi/nvidia.yaml"  # the service's Environment= line at v1.20.0
_ENV_BYTES = 64 << 10
_ASSIGNMENT = re.compile(rf"^\s*{OUTPUT_VARIABLE}\s*=\s*(['\"]?)(.*?)\1\s*$")


@dataclass(frozen=True)
class Refresh:
    """What of the toolkit's CDI refresh the node has."""

    units: tuple[str, ...] = ()  # unit files found, in UNITS order
    states: tuple[Optional[UnitState], ...] = ()  # each as systemd shows it; None where nothing runs the root's units
    udev_rule: Optional[str] = None  # the rule udev would use, by its path
    output: str = DEFAULT_OUTPUT  # where its service writes the spec

    def found(self) -> str:
        """`nvidia-cdi-refresh.path (enabled, active), ... writing /var/run/cdi/nvidia.yaml; udev rule ...`"""
        units = ", ".join(f"{unit} ({_shown(state)})" for unit, state in zip(self.units, self.states))
        rule = f"; udev rule {self.udev_rule} starts the service when the nvidia module loads" if self.udev_rule else ""
        return f"the toolkit package's {units}, writing {self.output}{rule}"


def _shown(state: Optional[UnitState]) -> str:
    if state is None:
        return "state unknown: this root's units are not the running system's"
    return f"{state.file_state or 'unit file state unknown'}, {state.active}"


def find(root: Root, services: ServiceControl) -> Refresh:
    """The refresh units whose unit file is under the root, their state, the udev rule and the output path."""
    units = tuple(unit for unit in UNITS if any(root(f"{d}/{unit}").is_file() for d in UNIT_DIRS))
    rule = next((f"{d}/{UDEV_RULE}" for d in UDEV_DIRS if root(f"{d}/{UDEV_RULE}").exists()), None)
    if not units and rule is None:
        return Refresh()
    states = []
    for unit in units:
        try:
            states.append(services.state(unit))
        except AgentError as exc:
            raise StageError(f"cannot tell whether {unit} (the toolkit package's CDI refresh) runs: {exc}") from None
    return Refresh(units, tuple(states), rule, output(root))


def output(root: Root) -> str:
    """Where the refresh service writes: the env file's last NVIDIA_CTK_CDI_OUTPUT_FILE_PATH, else the default."""
    try:
        real = resolve(root, ENV_FILE)  # its links followed under the root, never on this machine
        raw = read_bounded(root(real), _ENV_BYTES) if real is not None else None
    except (OSError, NotRegular, TooLarge):
        return DEFAULT_OUTPUT
    found = DEFAULT_OUTPUT
    for line in (raw or b"").decode("utf-8", "replace").splitlines():
        match = _ASSIGNMENT.match(line)
        if match and match.group(2).startswith("/"):
            found = posixpath.normpath(match.group(2))
    return found


def to_take_over(refresh: Refresh, ledger: Ledger) -> list[tuple[str, UnitState]]:
    """The units still to take over: not masked yet, or taken over but running again."""
    taken = ledger.units()
    return [(unit, state) for unit, state in zip(refresh.units, refresh.states)
            if state is not None and (state.file_state != "masked" or unit in taken and state.running)]


def take_over(ledger: Ledger, units: UnitControl, owner: str, found: list[tuple[str, UnitState]]) -> None:
    """Each unit recorded (before anything changes it), then stopped, disabled where enabled, and masked."""
    for unit, state in found:
        ledger.own_unit(OwnedUnit(unit, owner, state.file_state, state.running))
    for unit, state in found:
        try:
            if state.running:
                units("stop", unit)
            if state.file_state == "enabled":
                units("disable", unit)
            if state.file_state != "masked":
                units("mask", unit)
        except AgentError as exc:
            raise StageError(f"cannot take over {unit}, the toolkit package's CDI refresh that writes the spec "
                             f"gpu-agent writes: {exc}") from None


def give_back(ledger: Ledger, units: UnitControl, entry: OwnedUnit) -> None:
    """Unmasked, enabled again if it was, started again if it was active; then forgotten."""
    units("unmask", entry.unit)
    if entry.file_state == "enabled":
        units("enable", entry.unit)
    if entry.active:
        units("start", entry.unit)
    ledger.disown_unit(entry.unit)
