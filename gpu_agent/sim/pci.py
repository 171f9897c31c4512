"""The simulated PCI bus's drivers: which driver each function is bound to, its IOMMU group, driver_override,
and the sysfs writes that move a function between drivers (unbind, bind, drivers_probe), as Linux takes them.

A function's binding is what probing gives (the driver that matches it and is loaded, or the driver its
driver_override names) until a write says otherwise; the state keeps only what writes changed
(`pci.bound`, `pci.override`, by sysfs address), and a reboot forgets both, as the kernel does.
"""
from __future__ import annotations

import errno
import os
import re
from typing import Any, Optional

NVIDIA_DRIVER = "nvidia"
VFIO_DRIVER = "vfio-pci"
AUDIO_DRIVER = "snd_hda_intel"
# The kernel module that provides each driver the simulator knows; None: built in, always there.
DRIVER_MODULES: dict[str, Optional[str]] = {NVIDIA_DRIVER: "nvidia", "nouveau": "nouveau", VFIO_DRIVER: "vfio_pci",
                                            AUDIO_DRIVER: None}
AUDIO_CLASS = 0x040300  # multimedia, high definition audio
AUDIO_DEVICE_ID = 0x22BA  # the HD audio function NVIDIA puts beside a GPU that has one
FIRST_GROUP = 16  # the groups below are the platform's own (root ports, the chipset)
FAULTS = {"unbind": ("busy",), "bind": ("refused",), "iommu": ("off",)}

_DEVICE_ATTRIBUTE = re.compile(r"/sys/bus/pci/devices/([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7])/driver_override")
_DRIVER_FILE = re.compile(r"/sys/bus/pci/drivers/([A-Za-z0-9_-]+)/(bind|unbind)")
_PROBE = "/sys/bus/pci/drivers_probe"


def sysfs_address(nvml_bus_id: str) -> str:
    """00000000:18:00.0 (NVML) or 0000:18:00.0 to sysfs' 0000:18:00.0."""
    domain, rest = nvml_bus_id.split(":", 1)
    return f"{domain[-4:]}:{rest}".lower()


def audio_address(gpu: dict[str, Any]) -> Optional[str]:
    """The GPU's HD audio function (function 1 of its slot), where it has one."""
    return sysfs_address(gpu["pci_bus_id"])[:-1] + "1" if gpu.get("audio") else None


def functions(state: dict[str, Any]) -> dict[str, tuple[Optional[int], str]]:
    """Every function the simulator models, by address: (the GPU's index or None, its kind: gpu, audio, nvswitch,
    nic)."""
    found: dict[str, tuple[Optional[int], str]] = {}
    for index, gpu in enumerate(state["gpus"]):
        found[sysfs_address(gpu["pci_bus_id"])] = (index, "gpu")
        audio = audio_address(gpu)
        if audio:
            found[audio] = (index, "audio")
    for address in state.get("pci", {}).get("nvswitches", ()):
        found[address] = (None, "nvswitch")
    for address in state.get("pci", {}).get("mellanox_nics", ()):
        found[address] = (None, "nic")
    return found


def iommu_on(state: dict[str, Any]) -> bool:
    """The kernel runs with an IOMMU (intel_iommu=on, or an AMD one) unless `sim fail iommu` said otherwise."""
    return not any(fault["call"] == "iommu" for fault in state["faults"])


def iommu_groups(state: dict[str, Any]) -> dict[str, int]:
    """By address, its IOMMU group: a GPU and its audio function share one (they are one slot), each other
    function has its own (the platform's PCIe switches isolate them: ACS); none without an IOMMU."""
    if not iommu_on(state):
        return {}
    known = functions(state)
    heads = sorted(address for address, (_, kind) in known.items() if kind != "audio")
    groups = {address: FIRST_GROUP + n for n, address in enumerate(heads)}
    for address, (index, kind) in known.items():
        if kind == "audio" and index is not None:
            groups[address] = groups[sysfs_address(state["gpus"][index]["pci_bus_id"])]
    return groups


def loaded(state: dict[str, Any], driver: str) -> bool:
    if driver not in DRIVER_MODULES:
        return False
    module = DRIVER_MODULES[driver]
    return module is None or any(m["name"] == module and m.get("state", "live") == "live"
                                 for m in state["kernel"]["loaded"])


def probed(state: dict[str, Any], address: str) -> Optional[str]:
    """The driver probing gives the function now: the one driver_override names, if loaded; else the first
    loaded driver that matches it (a GPU: nvidia, else nouveau; its audio function: snd_hda_intel)."""
    override = state.get("pci", {}).get("override", {}).get(address)
    if override:
        return override if loaded(state, override) and (override != VFIO_DRIVER or iommu_on(state)) else None
    kind = functions(state).get(address, (None, ""))[1]
    candidates = {"gpu": (NVIDIA_DRIVER, "nouveau"), "audio": (AUDIO_DRIVER,)}.get(kind, ())
    return next((driver for driver in candidates if loaded(state, driver)), None)


def bound_driver(state: dict[str, Any], address: str) -> Optional[str]:
    bound = state.get("pci", {}).get("bound", {})
    return bound[address] if address in bound else probed(state, address)


def gpu_driver(state: dict[str, Any], gpu: dict[str, Any]) -> Optional[str]:
    return bound_driver(state, sysfs_address(gpu["pci_bus_id"]))


def on_nvidia(state: dict[str, Any], gpu: dict[str, Any]) -> bool:
    """NVML sees the GPU: the nvidia driver holds it."""
    return gpu_driver(state, gpu) == NVIDIA_DRIVER


def module_removed(state: dict[str, Any], module: str) -> None:
    """rmmod unbinds the module's driver from every function it held."""
    drivers = [driver for driver, owner in DRIVER_MODULES.items() if owner == module]
    bound = state.get("pci", {}).get("bound", {})
    for address, driver in list(bound.items()):
        if driver in drivers:
            bound[address] = None


def module_inserted(state: dict[str, Any]) -> None:
    """A module that loads probes the functions no driver holds: those it matches are its now."""
    bound = state.get("pci", {}).get("bound", {})
    for address in [address for address, driver in bound.items() if driver is None]:
        if probed(state, address) is not None:
            del bound[address]


def forget(state: dict[str, Any]) -> None:
    """A reboot: every function is probed afresh, and driver_override is empty again."""
    state.get("pci", {}).pop("bound", None)
    state.get("pci", {}).pop("override", None)


def render(files: dict[str, str], links: dict[str, str], state: dict[str, Any]) -> list[str]:
    """The bindings, groups and write-only attributes under sys/, and /dev/vfio's nodes (returned: the files of
    dev/vfio, which the kernel makes when a group's functions are all vfio-pci's)."""
    known = functions(state)
    groups = iommu_groups(state)
    drivers = {driver for driver in DRIVER_MODULES if loaded(state, driver)}
    for driver in drivers:
        files[f"sys/bus/pci/drivers/{driver}/bind"] = ""
        files[f"sys/bus/pci/drivers/{driver}/unbind"] = ""
    files["sys/bus/pci/drivers_probe"] = ""
    overrides = state.get("pci", {}).get("override", {})
    for address, (_, kind) in known.items():
        base = f"sys/bus/pci/devices/{address}"
        if kind in ("gpu", "audio"):
            files[f"{base}/driver_override"] = f"{overrides.get(address) or '(null)'}\n"
        holder = bound_driver(state, address)
        if holder is not None:
            links[f"{base}/driver"] = f"/bus/pci/drivers/{holder}"
            links[f"sys/bus/pci/drivers/{holder}/{address}"] = f"/bus/pci/devices/{address}"
        if address in groups:
            links[f"{base}/iommu_group"] = f"/kernel/iommu_groups/{groups[address]}"
            links[f"sys/kernel/iommu_groups/{groups[address]}/devices/{address}"] = f"/bus/pci/devices/{address}"
    for gpu in state["gpus"]:
        audio = audio_address(gpu)
        if audio:
            files[f"sys/bus/pci/devices/{audio}/vendor"] = "0x10de\n"
            files[f"sys/bus/pci/devices/{audio}/device"] = f"0x{AUDIO_DEVICE_ID:04x}\n"
            files[f"sys/bus/pci/devices/{audio}/class"] = f"0x{AUDIO_CLASS:06x}\n"
    return vfio_nodes(state) if VFIO_DRIVER in drivers else []


def vfio_nodes(state: dict[str, Any]) -> list[str]:
    """/dev/vfio/vfio, and /dev/vfio/<group> for each group whose functions vfio-pci holds (a group is viable only
    when each of its functions is vfio-pci's or no driver's)."""
    members: dict[int, list[str]] = {}
    for address, group in iommu_groups(state).items():
        members.setdefault(group, []).append(address)
    nodes = ["vfio"]
    for group, addresses in sorted(members.items()):
        drivers = [bound_driver(state, address) for address in addresses]
        if VFIO_DRIVER in drivers and all(driver in (VFIO_DRIVER, None) for driver in drivers):
            nodes.append(str(group))
    return nodes


def _error(code: int, path: str) -> OSError:
    return OSError(code, os.strerror(code), path)


class SimPciControl:
    """Writes to the simulated kernel's PCI attributes, taken as Linux takes them: driver_override, a driver's
    bind and unbind, drivers_probe. OSError with the kernel's errno where it refuses."""

    def __init__(self, machine: Any) -> None:
        self.machine = machine

    def write(self, path: str, value: str) -> None:
        refused: Optional[OSError] = None
        with self.machine.edit() as state:  # written back after a refusal too: a fault counts down
            if state.get("capture"):
                raise _error(errno.EROFS, path)  # a captured node's bus is what was captured
            try:
                self._write(state, path, value.strip())
            except OSError as exc:
                refused = exc
        if refused is not None:
            raise refused

    def _write(self, state: dict[str, Any], path: str, value: str) -> None:
        known = functions(state)
        pci = state["pci"]
        override = _DEVICE_ATTRIBUTE.fullmatch(path)
        if override is not None:
            if override.group(1) not in known:
                raise _error(errno.ENOENT, path)
            pci.setdefault("bound", {})[override.group(1)] = bound_driver(state, override.group(1))  # probes later
            overrides = pci.setdefault("override", {})
            if value:
                overrides[override.group(1)] = value
            else:
                overrides.pop(override.group(1), None)
            return
        if value not in known:
            raise _error(errno.ENODEV, path)
        index = known[value][0]
        if path == _PROBE:
            if bound_driver(state, value) is None:
                pci.setdefault("bound", {})[value] = probed(state, value)
                if pci["bound"][value] is None or self._faulted(state, "bind", index):
                    pci["bound"][value] = None
            return
        attribute = _DRIVER_FILE.fullmatch(path)
        if attribute is None or not loaded(state, attribute.group(1)):
            raise _error(errno.ENOENT, path)
        driver, action = attribute.groups()
        if action == "unbind":
            if bound_driver(state, value) != driver:
                raise _error(errno.ENODEV, path)
            gpu = state["gpus"][index] if index is not None else None
            if self._faulted(state, "unbind", index) or (driver == NVIDIA_DRIVER and gpu and gpu["processes"]):
                raise _error(errno.EBUSY, path)  # the driver's remove waits for the GPU's users; shown as refused
            pci.setdefault("bound", {})[value] = None
            return
        if bound_driver(state, value) is not None:
            raise _error(errno.EBUSY, path)
        wanted = pci.get("override", {}).get(value)
        if (wanted and wanted != driver) or self._faulted(state, "bind", index):
            raise _error(errno.ENODEV, path)
        if driver == VFIO_DRIVER and not iommu_on(state):
            raise _error(errno.EINVAL, path)  # vfio-pci's probe: no IOMMU group
        if driver == VFIO_DRIVER or (driver, known[value][1]) in (("nvidia", "gpu"), ("nouveau", "gpu"),
                                                                   (AUDIO_DRIVER, "audio")):
            pci.setdefault("bound", {})[value] = driver
            return
        raise _error(errno.ENODEV, path)

    @staticmethod
    def _faulted(state: dict[str, Any], call: str, gpu: Optional[int]) -> bool:
        """A `sim fail bind|unbind [--gpu N] [--times K]` fault fires (and counts down)."""
        for fault in state["faults"]:
            if fault["call"] == call and fault.get("gpu") in (None, gpu) and (fault.get("times") is None
                                                                               or fault["times"] > 0):
                if fault.get("times") is not None:
                    fault["times"] -= 1
                    if fault["times"] <= 0:
                        state["faults"].remove(fault)
                return True
        return False
