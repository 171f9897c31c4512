"""The simulated kernel: PCI sysfs, /proc/modules, /sys/module, /proc/devices and /proc/driver/nvidia,
rendered from the machine state, and a module loader that behaves like modprobe on a real kernel.

The files live in the machine's kernel directory (proc/, sys/, dev/), which the agent's Root maps
/proc, /sys and /dev to when simulating.
"""
from __future__ import annotations

import collections
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.bounded import Unreadable, read_text
from gpu_agent.sim.files import publish
from gpu_agent.host.modules import ModuleLoadError, ModuleUnloadError
from gpu_agent.host.paths import Root, link_text, place
from gpu_agent.sim import listing, pci
from gpu_agent.sim.mps import SERVER as MPS_SERVER
from gpu_agent.sim.mps import servers as mps_servers

RELEASE = "6.1.0-18-amd64"
MAX_CONF_BYTES = 1 << 20  # of a modprobe.d file read by the simulated modprobe
NVIDIA_MODULES = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_drm", "nvidia_peermem")
DEPENDS = {
    "nvidia_uvm": ("nvidia",),
    "nvidia_modeset": ("nvidia",),
    "nvidia_drm": ("nvidia_modeset", "drm_kms_helper"),
    "drm_kms_helper": ("drm",),
    "nvidia_peermem": ("nvidia", "ib_core"),
    "mlx5_ib": ("ib_core",),
    "vfio_pci": ("vfio_pci_core",),
    "vfio_pci_core": ("vfio",),
    "vfio_iommu_type1": ("vfio",),
}
VFIO_MODULES = ("vfio", "vfio_iommu_type1", "vfio_pci_core", "vfio_pci")  # in the kernel's tree: always installed
SIZES = {"nvidia": 56807424, "nvidia_uvm": 4890624, "nvidia_modeset": 1355776, "nvidia_drm": 77824,
         "nvidia_peermem": 16384, "nouveau": 2433024, "drm": 614400, "drm_kms_helper": 204800,
         "ib_core": 454656, "mlx5_ib": 446464, "vfio": 69632, "vfio_iommu_type1": 49152, "vfio_pci_core": 94208,
         "vfio_pci": 16384}
CHAR_MAJORS = {"nvidia": (195, "nvidia"), "nvidia_uvm": (510, "nvidia-uvm"),
               "nvidia_caps": (237, "nvidia-caps")}
BASE_CHAR_DEVICES = ((1, "mem"), (4, "/dev/vc/0"), (4, "tty"), (5, "/dev/tty"), (5, "/dev/console"),
                     (10, "misc"), (13, "input"), (136, "pts"), (226, "drm"))
OLD_VERSION = "550.54.15"  # what a half-finished upgrade leaves loaded
# hang: until `sim clear` or modprobe's timeout; stuck: the module's init never returns (listed as Loading until a
# reboot), its modprobe killed after the timeout
MODPROBE_ERRORS = ("not-found", "key-rejected", "hang", "stuck")
KERNEL_STATE_ERRORS = ("nouveau", "version-mismatch", "display")  # change the kernel's state at once
RMMOD_ERRORS = ("in-use",)
GPU_FILE_MODULES = ("nvidia", "nvidia_uvm")  # a process using a GPU holds /dev/nvidia* (and nvidia-uvm) open
LOAD_ORDER = ("nvidia", "nvidia_uvm", "nvidia_modeset", "nvidia_peermem", "nvidia_drm")
DISPLAY_SERVER = {"pid": 1400, "name": "Xorg"}  # `sim fail modprobe --error display`: what holds nvidia_drm
FRAMEBUFFER_CONSOLE = "vtcon1"


def new_boot_id() -> str:
    return str(uuid.uuid4())


def initial_kernel(driver_version: Optional[str], nics: bool, nouveau: bool) -> dict[str, Any]:
    installed: dict[str, Optional[str]] = {"nouveau": None, "drm": None, "drm_kms_helper": None,
                                           **{module: None for module in VFIO_MODULES}}
    if driver_version:
        installed.update({module: driver_version for module in NVIDIA_MODULES})
    loaded: list[dict[str, Any]] = []
    if nics:
        installed.update({"ib_core": None, "mlx5_ib": None})
        loaded += [{"name": "ib_core", "version": None, "params": {}},
                   {"name": "mlx5_ib", "version": None, "params": {}}]
    if nouveau:
        loaded += [{"name": n, "version": None, "params": {}} for n in ("drm", "drm_kms_helper", "nouveau")]
    return {"release": RELEASE, "installed": installed, "loaded": loaded, "boot_id": new_boot_id()}


def loaded_names(state: dict[str, Any]) -> list[str]:
    return [module["name"] for module in state["kernel"]["loaded"]]


def loaded_version(state: dict[str, Any], name: str) -> Optional[str]:
    return next((m["version"] for m in state["kernel"]["loaded"] if m["name"] == name), None)


def break_kernel(state: dict[str, Any], how: str) -> None:
    """`sim fail modprobe --error nouveau|version-mismatch`: put the kernel in that state now."""
    kernel = state["kernel"]
    if how == "nouveau":
        for name in ("drm", "drm_kms_helper", "nouveau"):
            if name not in loaded_names(state):
                kernel["loaded"].append({"name": name, "version": None, "params": {}})
    elif how == "display":
        # A display server (Xorg) holds nvidia_drm: it has an NVIDIA DRM device (/dev/dri/card*) open.
        kernel["display"] = dict(DISPLAY_SERVER)
        for name in ("drm", "drm_kms_helper", "nvidia_modeset", "nvidia_drm"):
            if name not in loaded_names(state):
                kernel["loaded"].append({"name": name, "version": kernel["installed"].get(name), "params": {}})
    elif how == "version-mismatch":
        # The userspace (NVML) was upgraded; the module files on disk and in the kernel are older.
        for name in NVIDIA_MODULES:
            if name in kernel["installed"]:
                kernel["installed"][name] = OLD_VERSION
        for module in kernel["loaded"]:
            if module["name"] in NVIDIA_MODULES:
                module["version"] = OLD_VERSION


def users(state: dict[str, Any], module: str) -> int:
    """Open files that hold `module` (its refcount beyond the modules that depend on it): each GPU
    process, and each MPS server, holds nvidia and nvidia_uvm; a display server, and the framebuffer console
    bound to nvidia-drm's framebuffer, hold nvidia_drm."""
    if module in GPU_FILE_MODULES:
        return sum(len(gpu["processes"]) for gpu in state["gpus"]) + len(mps_servers(state))
    if module == "nvidia_drm":
        return int(display_server(state) is not None) + int(console_bound(state))
    return 0


def display_server(state: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The display server holding an NVIDIA DRM device, while nvidia_drm is loaded."""
    display = state["kernel"].get("display")
    if not display or "nvidia_drm" not in loaded_names(state):
        return None
    return display if isinstance(display, dict) else dict(DISPLAY_SERVER)


def fbdev(state: dict[str, Any]) -> bool:
    """nvidia_drm is loaded with fbdev=1 (an `options nvidia-drm fbdev=1` line in modprobe.d): its framebuffer
    exists, and the framebuffer console takes it over."""
    drm = next((m for m in state["kernel"]["loaded"] if m["name"] == "nvidia_drm" and _live(m)), None)
    return drm is not None and str(drm["params"].get("fbdev", "0")).lower() in ("1", "y")


def console_bound(state: dict[str, Any]) -> bool:
    return fbdev(state) and not state["kernel"].get("console_unbound")


def _live(module: dict[str, Any]) -> bool:
    return module.get("state", "live") == "live"


def reload_modules(state: dict[str, Any], modprobe: SimModprobe) -> Optional[str]:
    """What `sim reload-driver` does (rmmod every loaded NVIDIA module, modprobe them again): the installed
    version is what loads. rmmod's or modprobe's words when one refuses."""
    names = [name for name in LOAD_ORDER if name in loaded_names(state)]
    for name in names[::-1]:
        error = SimModprobe.remove(state, name, False)
        if error:
            return error
    for name in names:
        error = modprobe.insert(state, name, None)
        if error:
            return error
    return None


def boot(state: dict[str, Any], modprobe: SimModprobe) -> list[str]:
    """A new boot's kernel: a new boot id, the framebuffer console bound, nvidia (udev loads the GPUs' driver)
    and the NVIDIA modules that were loaded (modules-load.d, the units that load them) loaded at their installed
    version, each that modprobe's faults let load. modprobe's words for each that did not."""
    kernel = state["kernel"]
    before = set(loaded_names(state))
    if state["gpus"] and kernel["installed"].get("nvidia"):
        before.add("nvidia")  # udev loads the driver of the GPUs it finds (their modalias)
    names = [name for name in LOAD_ORDER if name in before]
    kernel["loaded"] = [dict(m, state="live") for m in kernel["loaded"] if m["name"] not in NVIDIA_MODULES]
    kernel["boot_id"] = new_boot_id()
    kernel.pop("console_unbound", None)
    kernel["loaded"] = [m for m in kernel["loaded"] if m["name"] not in VFIO_MODULES]  # nothing loads them at boot
    pci.forget(state)
    failed = []
    for name in names:
        fault = next((f for f in state["faults"] if f["call"] == "modprobe" and f.get("module") in (None, name)
                      and f["error"] in ("not-found", "key-rejected")), None)
        error = modprobe.insert(state, name, fault["error"] if fault else None)
        if error:
            failed.append(error)
    return failed


def _modprobe_missing(state: dict[str, Any]) -> bool:
    from gpu_agent.sim.replay import modprobe_missing  # captures only: the module costs the others 20 ms

    return modprobe_missing(state)


class SimModprobe:
    """modprobe against the simulated kernel: dependencies first, options from /etc/modprobe.d."""

    def __init__(self, machine: Any, root: Root, timeout: float = 60.0) -> None:
        self.machine = machine
        self.root = root
        self.timeout = timeout  # driver.modprobe_timeout_seconds: a hung modprobe is killed after it

    def load(self, module: str) -> None:
        state = self.machine.read()
        if state.get("capture") and _modprobe_missing(state):
            # What running modprobe on a host that has none does (gpu_agent.host.proc.run).
            raise AgentError("cannot run modprobe: not installed or not on PATH")
        error = None
        with self.machine.edit() as state:
            fault = next((f for f in state["faults"] if f["call"] == "modprobe"
                          and f.get("module") in (None, module) and (f.get("times") is None or f["times"] > 0)), None)
            if fault is not None and fault.get("times") is not None:
                fault["times"] -= 1
                if fault["times"] <= 0 and fault["error"] != "hang":
                    state["faults"].remove(fault)
            if fault is None or fault["error"] != "hang":
                error = self.insert(state, module, fault["error"] if fault else None)
        if fault is not None and fault["error"] == "hang":
            self._hang(fault["id"], module)
            self.load(module)
            return
        if fault is not None and fault["error"] == "stuck" and not error:
            time.sleep(self.timeout)  # the module's init never returns: modprobe is killed
            raise AgentError(f"modprobe {module} did not finish within {self.timeout:g} s and was killed")
        if error:
            raise ModuleLoadError(module, error)

    def _hang(self, fault_id: int, module: str) -> None:
        """Until the fault is cleared; past the timeout, what proc.run says of a modprobe it killed."""
        deadline = time.monotonic() + self.timeout
        while any(f["id"] == fault_id for f in self.machine.read()["faults"]):
            if time.monotonic() > deadline:
                raise AgentError(f"modprobe {module} did not finish within {self.timeout:g} s and was killed")
            time.sleep(0.05)

    def unload(self, module: str) -> None:
        """rmmod: refused while another module holds it, a process has the GPUs open, or a display holds
        nvidia_drm, with rmmod's words; unloading nvidia loses what only the driver kept (MIG instances,
        Hopper's MIG mode)."""
        with self.machine.edit() as state:
            fault = next((f for f in state["faults"] if f["call"] == "rmmod"
                          and f.get("module") in (None, module) and (f.get("times") is None or f["times"] > 0)), None)
            if fault is not None and fault.get("times") is not None:
                fault["times"] -= 1
                if fault["times"] <= 0:
                    state["faults"].remove(fault)
            error = self.remove(state, module, fault is not None)
        if error:
            raise ModuleUnloadError(module, error)

    @staticmethod
    def remove(state: dict[str, Any], module: str, faulted: bool) -> Optional[str]:
        names = loaded_names(state)
        if module not in names:
            return f"rmmod: ERROR: Module {module} is not currently loaded"
        if not _live(next(m for m in state["kernel"]["loaded"] if m["name"] == module)):
            return f"rmmod: ERROR: could not remove module {module}: Device or resource busy"
        holders = [m for m in names if module in DEPENDS.get(m, ())]
        if holders:
            return f"rmmod: ERROR: Module {module} is in use by: {' '.join(holders)}"
        if faulted or users(state, module):
            return f"rmmod: ERROR: Module {module} is in use"
        state["kernel"]["loaded"] = [m for m in state["kernel"]["loaded"] if m["name"] != module]
        pci.module_removed(state, module)
        if module == "nvidia":
            from gpu_agent.sim.mig import reload_driver
            from gpu_agent.sim.profiles import MODELS

            for gpu in state["gpus"]:
                gpu.pop("compute_mode", None)  # the driver's, as a captured node's GPUs show too
                gpu.pop("timeslice", None)
                if gpu.get("model") in MODELS:
                    reload_driver(gpu, MODELS[gpu["model"]])
        return None

    def insert(self, state: dict[str, Any], module: str, fault: Optional[str]) -> Optional[str]:
        """Insert `module` and what it depends on into the kernel `state`; modprobe's words when it fails."""
        kernel = state["kernel"]
        present = next((m for m in kernel["loaded"] if m["name"] == module), None)
        if present is not None:
            return None if _live(present) else f"modprobe: ERROR: could not insert '{module}': Device or resource busy"
        if fault == "not-found" or module not in kernel["installed"]:
            return f"modprobe: FATAL: Module {module} not found in directory /lib/modules/{kernel['release']}"
        if fault == "key-rejected":
            return f"modprobe: ERROR: could not insert '{module}': Key was rejected by service"
        for dependency in DEPENDS.get(module, ()):
            error = self.insert(state, dependency, None)
            if error:
                return f"modprobe: ERROR: could not insert '{module}': Unknown symbol in module, or unknown parameter"
        if module == "nvidia" and "nouveau" in loaded_names(state):
            return "modprobe: ERROR: could not insert 'nvidia': No such device"
        if module in NVIDIA_MODULES and module != "nvidia" and kernel["installed"][module] != loaded_version(state,
                                                                                                             "nvidia"):
            # NVIDIA's modules refuse an nvidia module of another version (dmesg: "NVRM: API mismatch").
            return f"modprobe: ERROR: could not insert '{module}': Invalid argument"
        entry = {"name": module, "version": kernel["installed"][module], "params": self._options(module)}
        if fault == "stuck":
            entry["state"] = "coming"
        kernel["loaded"].append(entry)
        pci.module_inserted(state)
        return None

    def _options(self, module: str) -> dict[str, str]:
        """`options MODULE key=value ...` lines of modprobe.d (/etc's, then /usr/lib's and /lib's, as modprobe
        reads them: a later line's value wins)."""
        options: dict[str, str] = {}
        for base in ("/lib/modprobe.d", "/usr/lib/modprobe.d", "/etc/modprobe.d"):
            options.update(self._options_in(base, module))
        return options

    def _options_in(self, base: str, module: str) -> dict[str, str]:
        options: dict[str, str] = {}
        directory = self.root(base)
        for conf in sorted(directory.glob("*.conf")) if directory.is_dir() else ():
            try:
                text = read_text(conf, f"/etc/modprobe.d/{conf.name}", MAX_CONF_BYTES, errors="replace") or ""
            except Unreadable:  # modprobe skips what it cannot read
                continue
            for line in text.splitlines():
                words = line.split("#", 1)[0].split()
                if len(words) >= 3 and words[0] == "options" and words[1].replace("-", "_") == module:
                    options.update(word.partition("=")[::2] for word in words[2:] if "=" in word)
        return options


class SimConsole:
    """/sys/class/vtconsole/<vtcon>/bind on the simulated kernel: the framebuffer console unbound from (or
    bound again to) nvidia-drm's framebuffer."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine

    def bind(self, vtcon: str, bound: bool) -> None:
        with self.machine.edit() as state:
            known = fbdev(state) and vtcon == FRAMEBUFFER_CONSOLE
            if known:
                state["kernel"]["console_unbound"] = not bound
        if not known:
            raise AgentError(f"cannot write /sys/class/vtconsole/{vtcon}/bind: No such file or directory")


# --- rendering -----------------------------------------------------------------------------------


def render(kernel_dir: Path, state: dict[str, Any]) -> None:
    """Write the kernel's files for `state`; /dev is left alone (device nodes are userspace's job)."""
    if state.get("capture"):
        from gpu_agent.sim.replay import captured_kernel

        files, links, directories = captured_kernel(state)
    else:
        files, links, directories = _built_in(state), {}, []
        _pci(files, links, state)
        vfio = pci.render(files, links, state)
        for gpu in state["gpus"]:  # a process using a GPU holds its device file open
            for process in gpu["processes"]:
                links[f"proc/{process['pid']}/fd/3"] = f"/dev/nvidia{gpu['minor']}"
        for pid, _, minors in mps_servers(state):  # an MPS server, each of its daemon's GPUs
            for fd, target in enumerate(["/dev/nvidiactl", "/dev/nvidia-uvm", *(f"/dev/nvidia{m}" for m in minors)], 3):
                links[f"proc/{pid}/fd/{fd}"] = target
        _display(files, links, state)
        _vfio_nodes(kernel_dir / "dev" / "vfio", vfio)
    for tree in ("proc", "sys"):
        _replace_tree(kernel_dir / tree, {k[len(tree) + 1:]: v for k, v in files.items() if k.startswith(tree + "/")},
                      {k[len(tree) + 1:]: v for k, v in links.items() if k.startswith(tree + "/")},
                      [d[len(tree) + 1:] for d in directories if d.startswith(tree + "/")])


def _vfio_nodes(directory: Path, nodes: list[str]) -> None:
    """/dev/vfio as the kernel keeps it (devtmpfs): the container node and one per viable group, while vfio-pci
    is loaded. Plain files here: what the agent and the device plugin look for is that they exist."""
    if not nodes:
        if directory.is_dir():
            shutil.rmtree(directory, ignore_errors=True)
        return
    _replace_tree(directory, {node: "" for node in nodes}, {})


BOOT_TIME = 1736150000  # 2025-01-06 07:53:20 UTC


def _process_stat(pid: int, name: str, parent: int = 1) -> str:
    """/proc/PID/stat of a sleeping process started 100 s after boot: 52 fields, as Linux writes them."""
    after = ["S", str(parent), str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 8 + ["20", "0", "1", "0", "10000"]
    after += ["0"] * (50 - len(after))
    return f"{pid} ({name[:15]}) {' '.join(after)}\n"


def _process_cgroup(pod_uid: Optional[str]) -> str:
    """/proc/PID/cgroup under cgroup v2: a pod's container as the kubelet's systemd driver names it, or a
    login session's process."""
    if not pod_uid:
        return "0::/user.slice/user-1000.slice/session-1.scope\n"
    slice_ = f"kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice"
    return f"0::/kubepods.slice/kubepods-besteffort.slice/{slice_}/cri-containerd-{'0' * 64}.scope\n"


def _built_in(state: dict[str, Any]) -> dict[str, str]:
    """The files of a built-in or machine-file kernel."""
    files: dict[str, str] = {"proc/sys/kernel/osrelease": f"{state['kernel']['release']}\n"}
    files["sys/class/dmi/id/product_name"] = state.get("product_name", "Standard PC") + "\n"
    files["proc/stat"] = f"cpu  0 0 0 0 0 0 0 0 0 0\nbtime {BOOT_TIME}\n"  # what psutil needs: the boot time
    for gpu in state["gpus"]:
        for process in gpu["processes"]:
            files[f"proc/{process['pid']}/comm"] = process["name"][:15] + "\n"  # the kernel keeps 15 characters
            files[f"proc/{process['pid']}/cmdline"] = f"/usr/bin/{process['name']}\0"
            files[f"proc/{process['pid']}/stat"] = _process_stat(process["pid"], process["name"])
            files[f"proc/{process['pid']}/cgroup"] = _process_cgroup(process.get("pod_uid"))
    for pid, parent, _ in mps_servers(state):
        files[f"proc/{pid}/comm"] = MPS_SERVER[:15] + "\n"
        files[f"proc/{pid}/cmdline"] = f"/usr/bin/{MPS_SERVER}\0"
        files[f"proc/{pid}/stat"] = _process_stat(pid, MPS_SERVER, parent)
    if state["kernel"].get("boot_id"):
        files["proc/sys/kernel/random/boot_id"] = f"{state['kernel']['boot_id']}\n"
    loaded = state["kernel"]["loaded"]
    names = [m["name"] for m in loaded]
    holders = {name: [m["name"] for m in loaded if name in DEPENDS.get(m["name"], ())] for name in names}
    lines = []
    for module in reversed(loaded):  # the kernel lists the newest first
        name = module["name"]
        by = ",".join(holders[name]) + "," if holders[name] else "-"
        taint = " (POE)" if name in NVIDIA_MODULES else ""
        refcnt = len(holders[name]) + users(state, name)
        live = _live(module)
        lines.append(f"{name} {SIZES.get(name, 65536)} {refcnt} {by} {'Live' if live else 'Loading'} "
                     f"0x0000000000000000{taint}")
        base = f"sys/module/{name}"
        files[f"{base}/refcnt"] = f"{refcnt}\n"
        files[f"{base}/initstate"] = "live\n" if live else "coming\n"
        for holder in holders[name]:
            files[f"{base}/holders/{holder}"] = ""
        if module["version"]:
            files[f"{base}/version"] = f"{module['version']}\n"
        for key, value in module["params"].items():
            if not key.startswith("NVreg_"):  # the nvidia module keeps those out of sysfs (mode 0)
                files[f"{base}/parameters/{key}"] = f"{value}\n"
    files["proc/modules"] = "".join(line + "\n" for line in lines)
    char = list(BASE_CHAR_DEVICES)
    if "nvidia" in names:
        char += [CHAR_MAJORS["nvidia"], CHAR_MAJORS["nvidia_caps"]]
        _proc_driver(files, state, next(m for m in loaded if m["name"] == "nvidia")["version"])
    if "nvidia_uvm" in names:
        char.append(CHAR_MAJORS["nvidia_uvm"])
    files["proc/devices"] = "Character devices:\n" + "".join(
        f"{major:3d} {name}\n" for major, name in sorted(char)) + "\nBlock devices:\n  8 sd\n259 blkext\n"
    return files


def _display(files: dict[str, str], links: dict[str, str], state: dict[str, Any]) -> None:
    """nvidia-drm's DRM devices (a card and a render node per GPU), the display server that holds one open,
    and with fbdev its framebuffer and the framebuffer console on it."""
    if "nvidia_drm" not in loaded_names(state):
        return
    for gpu in state["gpus"]:
        device = f"../../../bus/pci/devices/{_sysfs_address(gpu['pci_bus_id'])}"
        links[f"sys/class/drm/card{gpu['minor']}/device"] = device
        links[f"sys/class/drm/renderD{128 + gpu['minor']}/device"] = device
    server = display_server(state)
    if server is not None and state["gpus"]:
        pid = server["pid"]
        files[f"proc/{pid}/comm"] = f"{server['name'][:15]}\n"
        files[f"proc/{pid}/cmdline"] = f"/usr/lib/xorg/{server['name']}\0"
        files[f"proc/{pid}/stat"] = _process_stat(pid, server["name"])
        links[f"proc/{pid}/fd/12"] = f"/dev/dri/card{state['gpus'][0]['minor']}"
    if fbdev(state):
        files["sys/class/graphics/fb0/name"] = "nvidia-drmdrmfb\n"
        bound = console_bound(state)
        files["sys/class/vtconsole/vtcon0/name"] = "(S) dummy device\n"
        files["sys/class/vtconsole/vtcon0/bind"] = "0\n" if bound else "1\n"
        files[f"sys/class/vtconsole/{FRAMEBUFFER_CONSOLE}/name"] = "(M) frame buffer device\n"
        files[f"sys/class/vtconsole/{FRAMEBUFFER_CONSOLE}/bind"] = "1\n" if bound else "0\n"


def _pci(files: dict[str, str], links: dict[str, str], state: dict[str, Any]) -> None:
    from gpu_agent.sim import topology
    from gpu_agent.sim.profiles import MODELS

    devices = [(gpu["pci_bus_id"], 0x10DE, MODELS[gpu["model"]].pci_device_id >> 16, 0x030200)
               for gpu in state["gpus"]]
    devices += [(address, 0x10DE, 0x22A3, 0x068000) for address in state["pci"]["nvswitches"]]
    devices += [(address, 0x15B3, 0x1021, 0x020700) for address in state["pci"]["mellanox_nics"]]
    for address, vendor, device, pci_class in devices:
        base = f"sys/bus/pci/devices/{_sysfs_address(address)}"
        files[f"{base}/vendor"] = f"0x{vendor:04x}\n"
        files[f"{base}/device"] = f"0x{device:04x}\n"
        files[f"{base}/class"] = f"0x{pci_class:06x}\n"
        if vendor == 0x10DE and pci_class >> 8 == 0x0302:
            files[f"{base}/config"] = _config_space(vendor, device, pci_class).decode("utf-8", "surrogateescape")
    for gpu in state["gpus"]:
        files[f"sys/bus/pci/devices/{_sysfs_address(gpu['pci_bus_id'])}/numa_node"] = \
            f"{topology.of(gpu)['numa_node']}\n"


def _config_space(vendor: int, device: int, pci_class: int) -> bytes:
    """The first 256 bytes of a bare-metal GPU's PCI config space, as root reads sysfs `config`: the ids, a
    capability list (power management, MSI, PCIe) and NVIDIA's vendor-specific capability, not signed
    "VF" as a vGPU's is (GFD's vgpu labeler reads it: vgpu.present=false)."""
    space = bytearray(256)
    space[0:4] = vendor.to_bytes(2, "little") + device.to_bytes(2, "little")
    space[0x06] = 0x10  # status: a capability list
    space[0x09:0x0C] = pci_class.to_bytes(3, "little")
    space[0x34] = 0x60
    space[0x60:0x62], space[0x68:0x6A], space[0x78:0x7A] = b"\x01\x68", b"\x05\x78", b"\x10\xb4"
    space[0xB4:0xB7] = b"\x09\x00\x14"  # id 9, the end of the list, 20 bytes
    return bytes(space)


def _proc_driver(files: dict[str, str], state: dict[str, Any], version: str) -> None:
    from gpu_agent.sim.profiles import MODELS

    params = next(m for m in state["kernel"]["loaded"] if m["name"] == "nvidia")["params"]
    values = {"ResmanDebugLevel": "4294967295", "DeviceFileUID": "0", "DeviceFileGID": "0", "DeviceFileMode": "438",
              "ModifyDeviceFiles": "1", "EnableGpuFirmware": "18"}
    values.update({key[len("NVreg_"):]: str(value) for key, value in params.items() if key.startswith("NVreg_")})
    files["proc/driver/nvidia/params"] = "".join(f"{key}: {value}\n" for key, value in values.items())
    files["proc/driver/nvidia/version"] = (
        f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Fri May 31 09:35:42 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    for gpu in state["gpus"]:
        if not pci.on_nvidia(state, gpu):
            continue  # another driver's (vfio-pci), or no driver's: outside the nvidia driver
        files[f"proc/driver/nvidia/gpus/{_sysfs_address(gpu['pci_bus_id'])}/information"] = (
            f"Model: \t\t {MODELS[gpu['model']].name}\nIRQ:   \t\t 0\nGPU UUID: \t {gpu['uuid']}\n"
            f"Video BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
            f"Device Minor: \t {gpu['minor']}\nGPU Excluded:\t No\n")
    for minor, cap in ((1, "config"), (2, "monitor")):
        files[f"proc/driver/nvidia/capabilities/mig/{cap}"] = (
            f"DeviceFileMinor: {minor}\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
    files.update(mig_capability_files(state))


def mig_capability_files(state: dict[str, Any]) -> dict[str, str]:
    """/proc/driver/nvidia/capabilities/gpuN/mig/giG[/ciC]/access of every MIG instance."""
    access = "DeviceFileMinor: {}\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    files = {}
    for gpu in state["gpus"]:
        for instance in gpu["mig"]["gpu_instances"]:
            gi = instance["id"]
            base = f"proc/driver/nvidia/capabilities/gpu{gpu['minor']}/mig/gi{gi}"
            files[f"{base}/access"] = access.format(mig_cap_minor(gpu["minor"], gi))
            for compute in instance["compute_instances"]:
                ci = compute["id"]
                files[f"{base}/ci{ci}/access"] = access.format(mig_cap_minor(gpu["minor"], gi, ci))
    return files


# nv-caps.c numbers its capabilities once, in table order: nvlink fabric-mgmt 0, mig/config 1,
# mig/monitor 2, then for each GPU minor 0-31 and each GPU instance gi0-gi14: gi<G>/access followed by
# gi<G>/ci0-ci7/access. So gpu0/gi1/access is 12 and gpu0/gi1/ci0/access 13, as on a real node.
MIG_CAP_FIRST = 3
MIG_CIS_PER_GI = 8
MIG_GIS_PER_GPU = 15


def mig_cap_minor(gpu_minor: int, gi: int, ci: Optional[int] = None) -> int:
    """The /dev/nvidia-caps minor of a GPU instance's access capability, or of one of its compute instances'."""
    per_gi = 1 + MIG_CIS_PER_GI
    return MIG_CAP_FIRST + gpu_minor * MIG_GIS_PER_GPU * per_gi + gi * per_gi + (0 if ci is None else 1 + ci)


def _sysfs_address(nvml_bus_id: str) -> str:
    """00000000:18:00.0 (NVML) or 0000:18:00.0 to sysfs' 0000:18:00.0."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{domain[-4:]}:{rest}".lower()


_Stamp = tuple[int, int, int, int]
_Shape = tuple[tuple[str, ...], tuple[tuple[str, str], ...], tuple[str, ...]]  # files, links, directories
_Texts = dict[tuple[str, str], str]  # (link, target as given) -> the text written for it
_KNOWN_TREES = 16  # the trees of the last few machines this process drove


@dataclass
class _Tree:
    """What this process knows of a kernel tree it rendered.

    `known`: what each file held when this process last wrote or read it, with its stat stamp: a file
    whose stamp is unchanged still holds that content, so a MIG call that changes two files of the tree
    neither reads nor rewrites the other hundreds. Any other writer (a test, another process) changes the
    stamp: a rename gives a new inode, an edit in place a new mtime or size.
    `shape`: the last render's that completed (None while one is under way), with the wanted entries and
    directories worked out from it and the text it wrote in each link."""
    known: dict[str, tuple[str, _Stamp]] = field(default_factory=dict)
    shape: Optional[_Shape] = None
    wanted: set[str] = field(default_factory=set)
    wanted_dirs: set[str] = field(default_factory=set)
    texts: _Texts = field(default_factory=dict)


_TREES: collections.OrderedDict[str, _Tree] = collections.OrderedDict()  # by the tree's path
# Where each link of a tree rendered afresh went (relative to the tree, its parents' links followed) and what it
# says, by the tree's shape: an empty tree given the same entries in the same order ends the same, wherever
# it is, so each test's new machine writes them without working them out again.
_FRESH_LINKS: collections.OrderedDict[_Shape, tuple[tuple[str, str], ...]] = collections.OrderedDict()


def _stamp(path: str) -> Optional[_Stamp]:
    try:
        st = os.stat(path)  # what a reader of the file sees, through a link too
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def _tree(base: str) -> _Tree:
    tree = _TREES.pop(base, None) or _Tree()
    _TREES[base] = tree
    while len(_TREES) > _KNOWN_TREES:
        _TREES.popitem(last=False)
    return tree


def _replace_tree(directory: Path, files: dict[str, str], links: dict[str, str],
                  directories: Optional[list[str]] = None) -> None:
    """Make `directory` hold exactly `files`, `links` and `directories` (which may be empty);
    unchanged entries are not rewritten.

    The tree is a chroot for what it holds (a captured node's links included): what is not wanted
    goes first, a link left by anyone with it; then each link is written relative to where it is,
    its target read as in a chroot at the tree (host.paths.link_text), so that every link in the tree
    leads into the tree, and files and directories written through one stay there.

    Most renders change no file of the tree (an NVML reading, a fault, a counter changed): where the
    tree has the shape of its last render and no directory of it changed since, its links and
    directories are the ones that render left, and only its files are looked at (a file can be edited
    in place without its directory showing it)."""
    base = str(directory)
    shape = (tuple(files), tuple(links.items()), tuple(directories or ()))
    record = _tree(base)
    same_shape, record.shape = record.shape == shape, None
    if same_shape:
        wanted, wanted_dirs = record.wanted, record.wanted_dirs
    else:
        wanted = {os.path.normpath(relative) for relative in [*files, *links]}
        wanted_dirs = {os.path.normpath(relative) for relative in directories or ()}
        for relative in list(wanted | wanted_dirs):
            parent = os.path.dirname(relative)
            while parent and parent not in wanted_dirs:
                wanted_dirs.add(parent)
                parent = os.path.dirname(parent)
    # What else is there goes, compared as relative path strings (pathlib's parents of every file, on
    # every write of the machine, were most of a MIG change's time).
    settled = fresh = False
    if os.path.isdir(base):
        settled = listing.remove_unwanted(base, wanted, wanted_dirs) and same_shape
    else:
        fresh = True
        listing.forget(base)
    texts = record.texts
    if fresh and shape in _FRESH_LINKS:
        _FRESH_LINKS.move_to_end(shape)
        placed = _FRESH_LINKS[shape]
        for at, text in placed:
            os.makedirs(os.path.dirname(base + at), exist_ok=True)
            os.symlink(text, base + at)
        texts = {link: text for link, (_, text) in zip(links.items(), placed)}
    elif not settled:
        root = Root(directory)
        before, texts = ({} if fresh else texts), {}
        found = [(_link(root, base, relative, target, before, texts), texts[relative, target])
                 for relative, target in links.items()]
        placed = tuple((at, text) for at, text in found if at is not None)
        if fresh and len(placed) == len(found):  # each placed by a walk of the tree: nothing before to find
            _FRESH_LINKS[shape] = placed
            while len(_FRESH_LINKS) > _KNOWN_TREES:
                _FRESH_LINKS.popitem(last=False)
    if not settled:
        for relative in directories or ():
            (directory / relative).mkdir(parents=True, exist_ok=True)
    known = record.known
    for gone in [relative for relative in known if relative not in files]:
        del known[gone]
    wrote = False
    for relative, content in files.items():
        name = os.path.join(base, relative)
        if not fresh and _holds(known, relative, name, content):
            continue
        publish(Path(name), content.encode("utf-8", "surrogateescape"))
        wrote = True
        written = _stamp(name)
        if written is not None:
            known[relative] = (content, written)
    if not settled or wrote:  # else every directory still has the stamp the listing keeps
        listing.remember(base, wanted, wanted_dirs)
    record.shape, record.wanted, record.wanted_dirs, record.texts = shape, wanted, wanted_dirs, texts


def _holds(known: dict[str, tuple[str, _Stamp]], relative: str, name: str, content: str) -> bool:
    """Whether the file `name` holds `content`: by its stamp where this process knows what it held, else
    read (and then known)."""
    stamp = _stamp(name)
    if stamp is None:
        return False
    if known.get(relative) == (content, stamp):
        return True
    try:
        with open(name, encoding="utf-8", errors="surrogateescape") as current:  # as a capture reads bytes
            if current.read() != content:
                return False
    except (FileNotFoundError, NotADirectoryError):
        return False
    known[relative] = (content, stamp)
    return True


def _link(root: Root, base: str, relative: str, target: str, before: _Texts, texts: _Texts) -> Optional[str]:
    """Make the link `relative` lead to `target` (see _replace_tree), its text added to `texts`; where it is
    (a host path in the tree, its parents' links followed), or None where the text the tree's last render
    wrote (`before`) was found there, without walking the tree."""
    text = before.get((relative, target))
    if text is not None:
        try:
            if os.readlink(os.path.join(base, relative)) == text:
                texts[relative, target] = text
                return None
        except OSError:  # not there, or not a link
            pass
    at = place(root, "/" + relative)
    text = texts[relative, target] = link_text(root, at, target)
    path = root(at)
    if path.is_symlink() and os.readlink(path) == text:
        return at
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    os.symlink(text, path)
    return at
