"""Driver stage: load, verify and repair the NVIDIA kernel driver, as the GPU Operator's driver
container and validator do, natively on the host and with a diagnosis for every failure."""
from __future__ import annotations

import functools
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from gpu_agent.config.driver import DriverConfig
from gpu_agent.errors import StageError
from gpu_agent.host import devnodes, pci, procfs
from gpu_agent.host import driver_version, owned
from gpu_agent.host.bounded import NotRegular, read_head, read_text
from gpu_agent.host.files import unified_diff
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.modules import KernelModules, LoadedModule, ModuleLoader, ModuleLoadError
from gpu_agent.host.paths import Root
from gpu_agent.host.pci import PciDevice
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlUnavailable, describe
from gpu_agent.plan import CreateDeviceNode, CreateLink, LoadModule, SetPersistenceMode, WriteFile
from gpu_agent.stages.base import Action, Stage
from gpu_agent.stages import cuda_check
from gpu_agent.stages import module_options
from gpu_agent.stages.driver_reload import Reload, abandoned
from gpu_agent.stages.reload_transitions import (FAILED, FINISHING, IDLE, IDLE_ABANDONED, IDLE_NEVER, IDLE_SKIP, LATER,
                                                 RELOADING, Move, Progress)

_VERSION = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}")
UNFINISHED = (*RELOADING, *FINISHING, FAILED)  # a failed step is tried again, whatever driver.reload says now

BLACKLIST_NOUVEAU = "/etc/modprobe.d/blacklist-nouveau.conf"
MAX_CONF_BYTES = 1 << 20  # a modprobe.d file the agent writes is one or two lines
CMDLINE_HEAD = 4096  # of /proc/PID/cmdline: the program's path (PATH_MAX) and its NUL
BLACKLIST_CONTENT = (
    "# Written by gpu-agent (driver.blacklist_nouveau): nouveau must not claim the NVIDIA GPUs.\n"
    "blacklist nouveau\noptions nouveau modeset=0\n"
)
# What every GPU node needs. Feature modules (nvidia_modeset, nvidia_peermem, ...) are the
# driver-features stage's: their failure degrades the agent instead of making the GPUs unready.
CORE_MODULES = ("nvidia", "nvidia_uvm")
PRELOADED = "preloaded"  # already loaded when gpu-agent started: the OS image, the cloud, a driver container
LOADED_BY_AGENT = "gpu-agent"
_LOADED_BY = {PRELOADED: "already loaded when gpu-agent started", LOADED_BY_AGENT: "loaded by gpu-agent"}


@dataclass
class DriverState:
    """What the stage saw; plan() and verify() work from this alone."""

    pci: pci.PciInventory
    loaded: dict[str, LoadedModule]
    wanted: list[str]
    files: dict[str, tuple[Optional[str], str]]  # host path -> (current, desired)
    nodes: list[devnodes.DeviceNode] = field(default_factory=list)
    node_problems: dict[str, str] = field(default_factory=dict)  # by node path
    link_problems: dict[str, str] = field(default_factory=dict)  # by node path
    module_version: Optional[str] = None
    kernel_module: Optional[procfs.DriverVersion] = None  # /proc/driver/nvidia/version
    nvml_version: Optional[str] = None
    nvml_error: Optional[str] = None
    nvml_bus_ids: list[str] = field(default_factory=list)
    nvml_lost: tuple[tuple[int, str], ...] = ()  # (index, NVML's error) of each GPU NVML answers no bus id for
    persistence: Optional[list[bool]] = None
    persistenced: bool = False
    installed: Optional[driver_version.Installed] = None
    reload_step: Optional[str] = None  # the ledger's driver reload step, when one is recorded
    reload_target: Optional[str] = None  # and the version it loads
    passing: frozenset[str] = frozenset()  # the GPUs the vfio stage is switching (its ledger records), by address

    @property
    def mismatch(self) -> Optional[str]:
        """`loaded X, installed Y` when the installed driver is not the loaded one."""
        target = self.installed.version if self.installed else None
        if self.module_version and _VERSION.fullmatch(self.module_version) and target and target != self.module_version:
            return f"loaded {self.module_version}, installed {target}"
        return None

    @property
    def managed_gpus(self) -> tuple[PciDevice, ...]:  # the field self.pci hides the module here
        """GPUs passed through to VMs (bound to vfio-pci), or on their way there or back (the vfio stage's), are not
        the host driver's to manage."""
        return tuple(gpu for gpu in self.pci.gpus if gpu.driver != "vfio-pci" and gpu.address not in self.passing)

    @property
    def nouveau(self) -> bool:
        """nouveau holds a GPU, or is loaded where nvidia is not and will take the GPUs first."""
        bound = any(gpu.driver == "nouveau" for gpu in self.pci.gpus)
        return bound or ("nouveau" in self.loaded and "nvidia" not in self.loaded)


class Driver(Stage):
    name = "driver"
    produces = ("pci_gpus", "mellanox_nics", "driver_mismatch")

    def __init__(self, root: Root, nvml: Nvml, loader: ModuleLoader, settings: DriverConfig,
                 may_change_gpus: bool = True, reload: Optional[Reload] = None) -> None:
        self.reload = reload
        self._move: Optional[Move] = None  # the reload's move as this pass planned it
        self._record: Optional[Progress] = None
        self.root = root
        self.may_change_gpus = may_change_gpus  # False when NVML's GPUs are not the ones behind the root
        self.nvml = nvml
        self.loader = loader
        self.settings = settings
        self.kernel = KernelModules(root)
        self.ledger = Ledger(root)
        self.loaded_by: Optional[str] = None  # who loaded nvidia: PRELOADED or LOADED_BY_AGENT

    # --- observe ---------------------------------------------------------------------------------

    def observe(self) -> DriverState:
        inventory = pci.scan(self.root)
        state = DriverState(inventory, self.kernel.loaded(), list(CORE_MODULES), self._files())
        state.passing = frozenset(Ledger(self.root).vfio())
        if self.reload is not None:
            progress = self.reload.progress()
            state.reload_step = progress.step if progress is not None else None
            state.reload_target = progress.target if progress is not None else None
        if "nvidia" not in state.loaded:
            if state.reload_step in UNFINISHED:  # unloaded by the reload: what it will load
                state.installed = driver_version.installed(self.root)
            return state
        if self.loaded_by is None:
            self.loaded_by = PRELOADED
        state.kernel_module = self.kernel.driver_version()
        majors = self.kernel.char_majors()
        minors = list(devnodes.gpu_minors(self.root).values())
        state.nodes = devnodes.expected(self.root, majors, minors, set(state.loaded))
        state.node_problems = {n.path: p for n in state.nodes if (p := devnodes.node_problem(self.root, n))}
        state.link_problems = {n.path: p for n in state.nodes if (p := devnodes.link_problem(self.root, n))}
        state.module_version = self.kernel.version("nvidia")
        state.installed = driver_version.installed(self.root)
        try:
            view = self.nvml.inventory.driver_view(persistence=self.settings.persistence)
            state.nvml_version, state.nvml_bus_ids, state.nvml_lost = view.version, view.bus_ids, view.lost
            if view.persistence is not None:
                state.persistence = view.persistence
                state.persistenced = self._persistenced_running()
        except NvmlUnavailable as exc:
            state.nvml_error = str(exc)
        except self.nvml.lib.NVMLError as exc:
            state.nvml_error = f"NVML query failed: {describe(exc)}"
        return state

    def _files(self) -> dict[str, tuple[Optional[str], str]]:
        desired = {}
        if self.settings.blacklist_nouveau:
            desired[BLACKLIST_NOUVEAU] = BLACKLIST_CONTENT
        for module, options in sorted(self.settings.parameters.items()):
            line = " ".join(f"{key}={value}" for key, value in sorted(options.items()))
            desired[f"/etc/modprobe.d/gpu-agent-{module}.conf"] = (
                f"# Written by gpu-agent from driver.parameters.{module}; edit the agent's config, not this file.\n"
                f"options {module} {line}\n")
        return {path: (read_text(self.root(path), path, MAX_CONF_BYTES, errors="replace"), content)
                for path, content in desired.items()}

    def _persistenced_running(self) -> bool:
        """By program name: /proc/PID/comm keeps only 15 characters, cmdline has the path."""
        proc = self.root("/proc")
        for entry in proc.iterdir() if proc.is_dir() else ():
            if entry.name.isdigit():
                try:
                    argv0 = (read_head(entry / "cmdline", CMDLINE_HEAD) or b"").split(b"\0", 1)[0]
                except (OSError, NotRegular):  # the process ended, or is not ours to read
                    continue
                if os.path.basename(argv0) == b"nvidia-persistenced":
                    return True
        return False

    # --- plan and apply --------------------------------------------------------------------------

    def plan(self, state: DriverState) -> list[Action]:
        actions = [self._write(path, current, desired)
                   for path, (current, desired) in state.files.items() if current != desired]
        if not state.managed_gpus or state.nouveau:
            return actions  # nothing to load: verify() says why
        actions += self._reload_actions(state)
        # Beside an nvidia module that is not the installed one, the others on disk do not load (NVRM's API
        # mismatch): verify() says the reload it takes.
        loadable = [m for m in state.wanted if m not in state.loaded and not (state.mismatch and m != "nvidia")]
        actions += [Action.of(LoadModule(module), functools.partial(self._load, module)) for module in loadable]
        nodes = {node.path: node for node in state.nodes}
        actions += [Action.of(CreateDeviceNode(path, nodes[path].major, nodes[path].minor, nodes[path].mode,
                                               nodes[path].uid, nodes[path].gid, problem),
                              functools.partial(self._device_file, devnodes.create_node, nodes[path]))
                    for path, problem in state.node_problems.items()]
        actions += [Action.of(CreateLink(nodes[path].char_link, path, problem),
                              functools.partial(self._device_file, self._create_link, nodes[path]))
                    for path, problem in state.link_problems.items()]
        if state.persistence is not None and not state.persistenced:
            actions += [Action.of(SetPersistenceMode(index, True), functools.partial(self._persist, index))
                        for index, enabled in enumerate(state.persistence) if not enabled]
        return actions

    def _write(self, path: str, current: Optional[str], desired: str) -> Action:
        def write() -> None:
            try:
                owned.write(self.root, self.ledger, self.name, path, desired)
            except OSError as exc:
                raise StageError(f"cannot write {path}: {exc.strerror or exc}") from None

        return Action.of(WriteFile.of(path, desired, current), write, diff=unified_diff(path, current, desired))

    def _device_file(self, create: Callable[[Root, devnodes.DeviceNode], None], node: devnodes.DeviceNode) -> None:
        try:
            create(self.root, node)
        except PermissionError as exc:
            raise StageError(f"cannot create {node.describe()}: {exc.strerror} "
                             "(the agent needs root with CAP_MKNOD and CAP_CHOWN)") from None
        except OSError as exc:
            raise StageError(f"cannot create {node.describe()}: {exc.strerror or exc}") from None

    def _create_link(self, root: Root, node: devnodes.DeviceNode) -> None:
        """The /dev/char link, recorded in the ledger so that `gpu-agent uninstall` removes it."""
        owned.make_link(self.ledger, self.name, node.char_link, devnodes.link_target(node),
                        functools.partial(devnodes.create_link, root, node))

    def _persist(self, index: int) -> None:
        if not self.may_change_gpus:
            raise StageError(f"refusing to change the real GPUs' persistence mode while --root is {self.root.path}")
        try:
            self.nvml.inventory.enable_persistence(index)
        except self.nvml.lib.NVMLError as exc:
            raise StageError(f"cannot enable persistence mode on GPU {index}: {describe(exc)}; "
                             "start nvidia-persistenced instead") from None

    def _load(self, module: str) -> None:
        load_module(self.loader, module)
        if module == "nvidia":
            self.loaded_by = LOADED_BY_AGENT

    # --- verify ----------------------------------------------------------------------------------

    def verify(self, state: DriverState) -> str:
        """The loaded driver checked; the module options a reload would apply are said whether the checks pass
        or not (`gpu-agent driver reload --dry-run` says so in both cases)."""
        try:
            message = self._verify(state)
        except StageError as exc:
            drift = self._parameters_drift(state)
            if not drift:
                raise
            raise StageError("; ".join([str(exc), *drift])) from None
        return "; ".join([message, *self._parameters_drift(state)])

    def _verify(self, state: DriverState) -> str:
        if not state.pci.gpus:
            raise StageError("no NVIDIA GPU was found on the PCI bus (no vendor 0x10de display device "
                             "under /sys/bus/pci/devices)")
        if not state.managed_gpus:
            if all(gpu.address in state.passing for gpu in state.pci.gpus):  # the vm-passthrough mode of the node
                return (f"every NVIDIA GPU ({len(state.pci.gpus)}) is passed through to VMs by the vfio stage: the "
                        "nvidia driver serves none")
            raise StageError(f"all {len(state.pci.gpus)} NVIDIA GPUs are bound to vfio-pci (passed through to VMs)")
        if state.nouveau:
            fix = (f"{BLACKLIST_NOUVEAU} is written: reboot (after updating the initramfs) to finish"
                   if self.settings.blacklist_nouveau and BLACKLIST_NOUVEAU in state.files else
                   "set driver.blacklist_nouveau: true (or blacklist nouveau yourself) and reboot")
            raise StageError(f"the nouveau driver is loaded and holds the GPUs, so nvidia cannot load: {fix}")
        missing = [m for m in state.wanted if m not in state.loaded or not self.kernel.present(m)]
        self._reload_required(state, missing)
        if missing:
            raise StageError(f"modules not loaded: {', '.join(missing)}")
        notes = self._verify_loaded(state)
        if self.settings.validate_cuda:
            notes.append(cuda_check.run(self.root, expected_gpus=len(state.pci.gpus)))
        gpus = len(state.managed_gpus)
        flavour = f" ({state.kernel_module.flavour})" if state.kernel_module else ""
        message = (f"driver {state.module_version}{flavour}, {gpus} GPU{'s' if gpus != 1 else ''}, "
                   f"{', '.join(state.wanted)} {_LOADED_BY[self.loaded_by or PRELOADED]}")
        if state.pci.nvswitches:
            message += f", {len(state.pci.nvswitches)} NVSwitches (fabric manager needed)"
        return "; ".join([message, *notes])

    def _verify_loaded(self, state: DriverState) -> list[str]:
        """The loaded driver against NVML, the GPUs, the device nodes and persistence mode: the GPUs lost to NVML,
        noted; a StageError for the rest."""
        self._verify_versions(state)
        lost = self._verify_gpus(state)
        if state.node_problems or state.link_problems:
            problems = [*state.node_problems.values(), *state.link_problems.values()]
            raise StageError("device nodes: " + "; ".join(problems))
        if state.persistence is not None and not state.persistenced and not all(state.persistence):
            off = [str(i) for i, on in enumerate(state.persistence) if not on]
            raise StageError(f"persistence mode is off on GPU {', '.join(off)} and nvidia-persistenced is not running")
        return lost

    def claims(self, state: DriverState) -> set[str]:
        return set(state.files)

    def outputs(self, state: DriverState) -> dict[str, object]:
        return {"pci_gpus": len(state.pci.gpus), "mellanox_nics": len(state.pci.mellanox_nics),
                "driver_mismatch": state.mismatch}

    def facts(self, state: DriverState) -> dict[str, object]:
        return {
            "loaded_by": self.loaded_by if "nvidia" in state.loaded else None,
            "kernel_module": state.kernel_module.flavour if state.kernel_module else None,
            "module_version": state.module_version,
            "modules": sorted(name for name in state.loaded if name.startswith("nvidia") or name == "gdrdrv"),
            "installed": asdict(state.installed) if state.installed else None,
            "reload_required": state.mismatch,
        }

    def _reload_actions(self, state: DriverState) -> list[Action]:
        reload = self.reload
        self._move = self._record = None
        if reload is None or not self.may_change_gpus:
            return []
        record, facts, move = reload.next_move()
        self._move, self._record = move, record
        if move.kind in (IDLE, LATER):
            return []
        return [Action(tuple(reload.planned(record, facts, move)), reload.run)]

    def _reload_required(self, state: DriverState, missing: list[str]) -> None:
        if not state.mismatch:
            return
        move, record = self._move, self._record
        why = move.arg if move is not None and move.kind == IDLE else None
        if why == IDLE_SKIP and self.reload is not None:
            what = (f"not reloaded: {self.reload.skipped()} says not to; drain the node and reload the driver or "
                    "reboot")
        elif why == IDLE_ABANDONED and record is not None:
            what = f"{abandoned(record)}; `gpu-agent driver reload` starts it again, or reboot"
        elif why == IDLE_NEVER or self.reload is None:
            what = ("driver.reload is never: drain the node, then `gpu-agent driver reload` (or set driver.reload: "
                    "when-idle), or reboot")
        else:
            what = "the agent reloads it once no pod or process uses a GPU"
        unloaded = (f"; {', '.join(missing)} not loaded (the modules on disk are the installed driver's)"
                    if missing else "")
        raise StageError(f"reload required: {state.mismatch} (the GPUs cannot serve new work){unloaded}; {what}")

    def _verify_versions(self, state: DriverState) -> None:
        pin = self.settings.version
        if pin and state.module_version != pin:
            raise StageError(f"driver version pin (driver.version) is {pin} but the loaded kernel module "
                             f"is {state.module_version}")
        if state.nvml_error:
            raise StageError(f"kernel module {state.module_version} is loaded but NVML fails: {state.nvml_error}"
                             f"{self._library_ahead(state)}")
        if state.nvml_version != state.module_version:
            raise StageError(f"kernel module is {state.module_version} but the NVML library is {state.nvml_version} "
                             "(half-finished driver upgrade): reload the nvidia modules or reboot")

    @staticmethod
    def _library_ahead(state: DriverState) -> str:
        """What an NVML failure's message adds about the driver on disk: a library newer than the module
        modprobe would load is an upgrade whose kernel module was never installed for this kernel (a
        failed DKMS build), which no reload fixes."""
        installed = state.installed
        library = installed.library if installed else None
        if not library:
            return ""
        if installed and installed.module and installed.module != library:
            return (f"; the NVML library on disk is {library} but the nvidia module for this kernel is "
                    f"{installed.module} ({installed.module_path}): the {library} module was never installed for "
                    "the running kernel (its DKMS build?), so a reload would load "
                    f"{installed.module} again: install it, then reload the driver or reboot")
        return f"; the NVML library on disk is {library}"

    def _verify_gpus(self, state: DriverState) -> list[str]:
        """The GPUs NVML sees are those on the PCI bus. A GPU NVML cannot answer for (GPU_IS_LOST: fell off
        the bus, XID 79) is that GPU's fault, not the driver's: gpu-health reports it, and it is only noted here."""
        on_bus = {device.address for device in state.managed_gpus}
        in_nvml = set(state.nvml_bus_ids) - state.passing  # one the vfio stage is switching is its to judge
        notes = []
        if state.nvml_lost and in_nvml <= on_bus and len(on_bus - in_nvml) <= len(state.nvml_lost):
            notes += [f"GPU {index} lost to NVML ({why}; gpu-health reports it)" for index, why in state.nvml_lost]
            on_bus = in_nvml
        if on_bus != in_nvml:
            lost = ", ".join(sorted(on_bus - in_nvml)) or "none"
            extra = ", ".join(sorted(in_nvml - on_bus)) or "none"
            raise StageError(f"{len(on_bus)} GPUs on the PCI bus but {len(in_nvml)} in NVML; missing from NVML: "
                             f"{lost}; unknown to PCI: {extra} (check dmesg for NVRM errors)")
        return notes

    def _parameters_drift(self, state: DriverState) -> list[str]:
        found = module_options.drift(self.root, self.kernel, self.settings.parameters, state.loaded)
        if not found:
            return []
        under_way = self._move is not None and self._move.kind not in (IDLE, LATER)
        if under_way and not (self._record is not None and self._record.reloaded):
            applied = "being applied: the reload under way loads them"
        elif under_way:
            applied = ("the reload under way loaded the modules before they changed: `gpu-agent driver reload` "
                       "applies them once it has ended")
        else:
            applied = ("`gpu-agent driver reload` applies them (drain the node first, or it waits for idle GPUs); "
                       "driver.reload never reloads a driver for its options alone")
        held = []
        for module in sorted({d.module for d in found}):
            used = state.loaded[module]
            holders = f", used by {', '.join(used.holders)}" if used.holders else ""
            held.append(f"{module} refcnt {'unknown' if used.refcnt is None else used.refcnt}{holders}")
        return [f"reload required to apply the configured options: {'; '.join(d.text for d in found)} "
                f"({', '.join(held)}); {applied}"]


def load_module(loader: ModuleLoader, module: str) -> None:
    """Load `module`; a failure is a StageError saying what the kernel's words mean."""
    try:
        loader.load(module)
    except ModuleLoadError as exc:
        raise StageError(diagnose(exc)) from None


def diagnose(error: ModuleLoadError) -> str:
    """The kernel's words, with what they mean and what to do."""
    text = error.output
    module = error.module
    if "not found in directory" in text:
        remedy = (f"no {module} module for the running kernel: install the NVIDIA driver for this kernel "
                  "(its DKMS build may have failed) or boot the kernel it was built for")
    elif "Key was rejected by service" in text or "Required key not available" in text:
        remedy = (f"Secure Boot rejected the unsigned {module} module: sign it and enroll the key "
                  "(mokutil --import), or disable Secure Boot")
    elif "Operation not permitted" in text:
        remedy = (f"the kernel refused to load {module}: kernel lockdown (Secure Boot) or a missing "
                  "CAP_SYS_MODULE")
    elif "No such device" in text:
        remedy = (f"{module} found no GPU it can drive: is nouveau or vfio-pci bound to the GPUs, or are "
                  "they older than the driver supports (open kernel modules need Turing or newer)?")
    elif "Exec format error" in text:
        remedy = f"{module} was built for another kernel: rebuild it (DKMS) for the running kernel"
    elif "Unknown symbol" in text:
        remedy = f"{module} does not match the running kernel or a module it needs is missing: see dmesg"
    elif "Invalid argument" in text:
        remedy = f"{module} rejected its options: check /etc/modprobe.d and dmesg"
    else:
        remedy = "see dmesg"
    return f"{remedy} ({text})"

