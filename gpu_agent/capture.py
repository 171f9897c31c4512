"""`gpu-agent capture DIR`: what the agent reads from a node, written read-only to a directory that
`--simulate DIR` replays (gpu_agent/sim/replay.py).

Everything is read through the agent's own Root and NVML client, so a simulated node captures like a
real one. Nothing on the node changes: files are only read, and NVML answers are recorded by a
wrapper around the module the client uses that refuses every call that could change a GPU. Only the
files listed here are read; never another process's environment or command line.

A capture directory holds:
  manifest.json  format version, when, gpu-agent version, the host's kernel release and modprobe, the parts
  files.json     text files under /proc, /sys and /etc, and the directories that exist without files
  links.json     symbolic links: PCI functions' driver links, /dev/char links to NVIDIA device nodes
  devices.json   /dev/nvidia* device nodes: type, major, minor, mode, owner
  ldcache.json   /etc/ld.so.cache entries of the driver's libraries, with the file each leads to
  nvml.json      every NVML call the agent's read paths made, with its answer or NVML error
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable, Optional

from gpu_agent import __version__
from gpu_agent.errors import AgentError
from gpu_agent.host import ldcache
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded, read_head
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root, resolve
from gpu_agent.nvml import answers
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.session import NvmlHung, NvmlUnavailable, describe

log = logging.getLogger(__name__)

FORMAT = "gpu-agent-capture/1"
MANIFEST = "manifest.json"
PARTS = {
    "files.json": "text files the agent reads under /proc, /sys and /etc, by host path, and directories "
                  "that exist without files (a loaded module's /sys/module entry)",
    "links.json": "symbolic links by host path: PCI functions' driver links, /dev/char links to NVIDIA device nodes",
    "devices.json": "/dev/nvidia* device nodes and directories: type, major, minor, mode, uid, gid",
    "ldcache.json": "/etc/ld.so.cache entries of the NVIDIA driver's libraries and the file each leads to",
    "nvml.json": "NVML calls the agent's read paths made (pynvml function, arguments, handles by reference) "
                 "with their answers or NVML errors",
}

TEXT_FILES = ("/proc/modules", "/proc/devices", "/proc/driver/nvidia/version", "/proc/driver/nvidia/params",
              "/etc/os-release", "/sys/class/dmi/id/product_name")
CAPABILITIES = "/proc/driver/nvidia/capabilities"
GPU_INFORMATION = "/proc/driver/nvidia/gpus"
MODULE_PREFIXES = ("nvidia", "gdrdrv")
PCI_DEVICES = "/sys/bus/pci/devices"
PCI_VENDORS = ("0x10de", "0x15b3")  # NVIDIA, Mellanox (GPUDirect RDMA NICs)
PCI_ATTRIBUTES = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node")
MODPROBE_D = "/etc/modprobe.d"
MODPROBE_PATHS = ("/usr/sbin/modprobe", "/sbin/modprobe", "/usr/bin/modprobe", "/bin/modprobe")
OSRELEASE = "/proc/sys/kernel/osrelease"
DRIVER_LIBRARY = re.compile(r"^(libcuda|libcudadebugger|libnvidia-|libnvcuvid|libnvoptix|lib\w+_nvidia)")
MAX_FILE_BYTES = 1 << 20  # /proc and /sys files are small; anything bigger is not what we think it is

# Words in a pynvml function name that change a GPU or the driver's state; the recorder refuses them.
MUTATING_WORDS = frozenset({"Set", "Create", "Destroy", "Reset", "Register", "Clear", "Modify", "Remove",
                            "Discover"})

# Read-only answers worth having beyond the agent's own read paths: what a replay reports as static
# (memory v2, BAR1, NUMA, clocks, thresholds, power limits, ECC and row remapping). Arguments
# that are strings name pynvml constants.
STATIC_QUERIES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("nvmlDeviceGetMemoryInfo", ("nvmlMemory_v2",)),
    ("nvmlDeviceGetBAR1MemoryInfo", ()),
    ("nvmlDeviceGetNumaNodeId", ()),
    ("nvmlDeviceGetArchitecture", ()),
    ("nvmlDeviceGetPowerManagementLimit", ()),
    ("nvmlDeviceGetPowerManagementDefaultLimit", ()),
    ("nvmlDeviceGetEnforcedPowerLimit", ()),
    ("nvmlDeviceGetEccMode", ()),
    ("nvmlDeviceGetRemappedRows", ()),
    ("nvmlDeviceGetRetiredPagesPendingStatus", ()),
    *(("nvmlDeviceGetRetiredPages", (cause,)) for cause in ("NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
                                                             "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")),
    *(("nvmlDeviceGetTotalEccErrors", (error, counter))
      for error in ("NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED")
      for counter in ("NVML_VOLATILE_ECC", "NVML_AGGREGATE_ECC")),
    *((call, (clock,)) for clock in ("NVML_CLOCK_GRAPHICS", "NVML_CLOCK_SM", "NVML_CLOCK_MEM", "NVML_CLOCK_VIDEO")
      for call in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo")),
    *(("nvmlDeviceGetTemperatureThreshold", (threshold,)) for threshold in (
        "NVML_TEMPERATURE_THRESHOLD_SHUTDOWN", "NVML_TEMPERATURE_THRESHOLD_SLOWDOWN",
        "NVML_TEMPERATURE_THRESHOLD_MEM_MAX", "NVML_TEMPERATURE_THRESHOLD_GPU_MAX")),
)
SYSTEM_QUERIES = ("nvmlSystemGetNVMLVersion",)


class MutationRefused(AgentError):
    """A call that could change the node was attempted while capturing."""


def mutating(name: str) -> bool:
    return bool(MUTATING_WORDS.intersection(re.findall(r"[A-Z][a-z0-9]*", name)))


class RecordingNvml:
    """Stands in for the NVML module (pynvml, or the simulator's fake): read-only calls go through
    and are recorded with their answers; a call that could change the GPU is refused, not made."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.calls: dict[str, dict[str, Any]] = {}  # by call key, in call order
        self.problems: list[str] = []  # answers that could not be written down
        self._refs: dict[Any, str] = {}  # handle identity -> reference

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._lib, name)
        if not (name.startswith("nvml") and callable(value) and not isinstance(value, type)):
            return value
        if mutating(name):
            def refused(*args: Any, **kwargs: Any) -> Any:
                raise MutationRefused(f"capture is read-only: {name} was not called")
            return refused

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                result = value(*args, **kwargs)
            except self._lib.NVMLError as exc:
                self._record(name, args, kwargs, answers.error_of(exc))
                raise
            self._name_handle(name, args, result)
            if name == answers.PLACEMENTS_CALL:
                placements, count = args[2], args[3]
                count = count._obj if hasattr(count, "_obj") else count
                answer: Any = [[placements[i].start, placements[i].size] for i in range(count.value)]
            elif name in (answers.GPU_INSTANCES_CALL, answers.COMPUTE_INSTANCES_CALL):
                answer = self._name_instances(name, args)
            elif name == "nvmlShutdown":
                return result
            else:
                try:
                    answer = answers.encode(result, self.ref_of)
                except TypeError as exc:
                    self.problems.append(f"{name}: {exc}")
                    return result
            self._record(name, args, kwargs, {"ok": answer})
            return result

        return call

    def ref_of(self, value: Any) -> Optional[str]:
        return self._refs.get(_identity(value))

    def _record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], answer: dict[str, Any]) -> None:
        try:
            key = answers.call_key(name, args, kwargs, self.ref_of)
        except TypeError as exc:
            self.problems.append(f"{name}: {exc}")
            return
        self.calls.pop(key, None)  # the latest answer, in the order calls were last made
        self.calls[key] = answer

    def _name_handle(self, name: str, args: tuple[Any, ...], result: Any) -> None:
        if name == "nvmlDeviceGetHandleByIndex":
            ref = f"gpu{args[0]}"
        elif name == "nvmlDeviceGetMigDeviceHandleByIndex":
            ref = f"{self.ref_of(args[0])}/mig{args[1]}"
        elif name == "nvmlDeviceGetGpuInstanceById":
            ref = f"{self.ref_of(args[0])}/gi{args[1]}"
        else:
            return
        self._refs[_identity(result)] = ref

    def _name_instances(self, name: str, args: tuple[Any, ...]) -> list[Any]:
        """Name the GPU or compute instances an instance list call filled in by their ids (asked of
        the module directly, unrecorded), so later calls on them are keyed as a replay finds them."""
        handles, count = args[2], args[3]
        count = count._obj if hasattr(count, "_obj") else count
        info = "nvmlGpuInstanceGetInfo" if name == answers.GPU_INSTANCES_CALL else "nvmlComputeInstanceGetInfo"
        kind = "gi" if name == answers.GPU_INSTANCES_CALL else "ci"
        found = []
        for handle in list(handles[: count.value]):
            ref = f"{self.ref_of(args[0])}/{kind}{getattr(self._lib, info)(handle).id}"
            self._refs[_identity(handle)] = ref
            found.append({"handle": ref})
        return found

    def recorded(self) -> list[dict[str, Any]]:
        """The calls as nvml.json lists them."""
        entries = []
        for key, answer in self.calls.items():
            name, arguments = json.loads(key)
            entries.append({"call": name, "args": arguments, **answer})
        return entries


def _identity(value: Any) -> Any:
    """What makes two handles the same handle: a ctypes pointer's address, or the object itself."""
    if isinstance(value, ctypes._Pointer):
        return ("pointer", ctypes.cast(value, ctypes.c_void_p).value)
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value


class CapturingNvml(Nvml):
    """The agent's NVML client over a RecordingNvml: its read paths run as they do in the agent."""

    def __init__(self, lib: Any, call_timeout: float) -> None:
        self.recorder = RecordingNvml(lib)
        super().__init__(self.recorder, call_timeout)

    def ask(self, name: str, *args: Any) -> None:
        """One more read-only query, recorded; an NVML error is an answer like any other."""
        if getattr(self.lib, name, None) is None:
            return  # this pynvml has no such function
        try:
            self.session.call(name, *args)
        except self.lib.NVMLError:
            pass

    def static_queries(self, index: int) -> None:
        """STATIC_QUERIES on GPU `index`."""
        self.session.init()
        handle = self.session.call("nvmlDeviceGetHandleByIndex", index)
        for call, arguments in STATIC_QUERIES:
            values = tuple(getattr(self.lib, a, None) if isinstance(a, str) else a for a in arguments)
            if None not in values:
                self.ask(call, handle, *values)


def drive_nvml(nvml: CapturingNvml) -> list[str]:
    """Run every NVML read path the agent has, so the recorder sees each call; returns what failed."""
    problems: list[str] = []
    try:
        nvml.session.init()
    except NvmlUnavailable as exc:
        return [f"nvmlInit: {exc}"]

    def attempt(what: str, read: Callable[..., Any], *args: Any) -> Any:
        try:
            return read(*args)
        except (NvmlHung, NvmlUnavailable) as exc:
            problems.append(f"{what}: {exc}")
        except nvml.lib.NVMLError as exc:
            problems.append(f"{what}: {describe(exc)}")
        return None

    inventory = attempt("inventory", nvml.inventory.read)
    attempt("driver version", nvml.inventory.driver_version)
    attempt("bus ids", nvml.inventory.bus_ids)
    attempt("persistence modes", nvml.inventory.persistence_modes)
    for name in SYSTEM_QUERIES:
        attempt(name, nvml.ask, name)
    for gpu in inventory.gpus if inventory else ():
        attempt(f"GPU {gpu.index} sample", nvml.sampling.sample, gpu.index)
        attempt(f"GPU {gpu.index} processes", nvml.inventory.processes, gpu.index)
        attempt(f"GPU {gpu.index} health reading", nvml.health.reading, gpu.index)
        attempt(f"GPU {gpu.index} static queries", nvml.static_queries, gpu.index)
    return problems


# --- files ---------------------------------------------------------------------------------------


class HostReader:
    """Reads the listed host paths under a root into the capture's parts; notes what it could not read."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.files: dict[str, str] = {}
        self.directories: list[str] = []
        self.links: dict[str, str] = {}
        self.devices: list[dict[str, Any]] = []
        self.problems: list[str] = []

    def read_all(self) -> None:
        for path in TEXT_FILES:
            self.text(path)
        self.tree(CAPABILITIES)
        for entry in self.entries(GPU_INFORMATION):
            self.text(f"{entry}/information")
        for entry in self.entries("/sys/module"):
            if os.path.basename(entry).startswith(MODULE_PREFIXES):
                self.directories.append(entry)
                self.text(f"{entry}/version")
                for parameter in self.entries(f"{entry}/parameters"):
                    self.text(parameter)
        self.pci()
        for entry in self.entries(MODPROBE_D):
            self.text(entry)
        self.dev()

    def entries(self, host_dir: str) -> list[str]:
        directory = self.root(host_dir)
        try:
            names = sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            self.problems.append(f"{host_dir}: cannot list: {exc.strerror}")
            return []
        return [f"{host_dir.rstrip('/')}/{name}" for name in names]

    def text(self, host_path: str) -> None:
        try:
            data = read_bounded(self.root(host_path), MAX_FILE_BYTES)
        except NotRegular:
            return
        except TooLarge:
            self.problems.append(f"{host_path}: larger than {MAX_FILE_BYTES} bytes, left out")
            return
        except OSError as exc:
            self.problems.append(f"{host_path}: cannot read: {exc.strerror}")
            return
        if data is None:
            return
        self.files[host_path] = data.decode("utf-8", "surrogateescape")

    def tree(self, host_dir: str) -> None:
        for entry in self.entries(host_dir):
            if self.root(entry).is_dir() and not self.root(entry).is_symlink():
                self.tree(entry)
            else:
                self.text(entry)

    def pci(self) -> None:
        for entry in self.entries(PCI_DEVICES):
            try:
                vendor = read_head(self.root(f"{entry}/vendor"), 64) or b""
            except (OSError, NotRegular):
                continue
            if vendor.decode("ascii", errors="replace").strip() not in PCI_VENDORS:
                continue
            self.directories.append(entry)
            for attribute in PCI_ATTRIBUTES:
                self.text(f"{entry}/{attribute}")
            driver = self.root(f"{entry}/driver")
            if driver.is_symlink():
                self.links[f"{entry}/driver"] = os.readlink(driver)

    def dev(self) -> None:
        for entry in self.entries("/dev"):
            if os.path.basename(entry).startswith("nvidia"):
                self.node(entry)
        for entry in self.entries("/dev/char"):
            link = self.root(entry)
            if link.is_symlink() and os.path.basename(os.readlink(link)).startswith("nvidia"):
                self.links[entry] = os.readlink(link)

    def node(self, host_path: str) -> None:
        path = self.root(host_path)
        try:
            st = os.lstat(path)
        except OSError as exc:
            self.problems.append(f"{host_path}: cannot stat: {exc.strerror}")
            return
        owner = {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "uid": st.st_uid, "gid": st.st_gid}
        if stat.S_ISLNK(st.st_mode):
            self.links[host_path] = os.readlink(path)
        elif stat.S_ISDIR(st.st_mode):
            self.devices.append({"path": host_path, "type": "directory", **owner})
            for entry in self.entries(host_path):
                self.node(entry)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            self.devices.append({"path": host_path, "type": "char" if stat.S_ISCHR(st.st_mode) else "block",
                                 "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev), **owner})


def driver_libraries(root: Root) -> tuple[list[dict[str, Any]], Optional[str]]:
    """The ld.so cache entries of the driver's libraries, each with the file it leads to under the root."""
    try:
        entries = ldcache.read_cache(root(ldcache.PATH))
    except AgentError as exc:
        return [], str(exc)
    return [{"key": e.key, "path": e.path, "flags": e.flags, "hwcap": e.hwcap, "target": resolve(root, e.path)}
            for e in entries if DRIVER_LIBRARY.match(e.key)], None


def find_modprobe(root: Root) -> Optional[str]:
    """Where modprobe is on the host, or None: a host without it cannot load a module."""
    return next((path for path in MODPROBE_PATHS if os.access(root(path), os.X_OK)), None)


# --- the capture ---------------------------------------------------------------------------------


def capture(root: Root, lib: Any, directory: Path, call_timeout: float, source: str,
            modprobe: Optional[str]) -> dict[str, Any]:
    """Read the node under `root` and its NVML (`lib`) into `directory`; returns the manifest.
    `modprobe` is where the node's module loader is (find_modprobe), None where it has none."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise AgentError(f"{directory}: not empty; capture into a new directory")
    reader = HostReader(root)
    reader.read_all()
    libraries, ldcache_problem = driver_libraries(root)
    nvml = CapturingNvml(lib, call_timeout)
    try:
        nvml_problems = drive_nvml(nvml) + nvml.recorder.problems
    finally:
        nvml.close()
    release = _read(root(OSRELEASE))
    manifest = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gpu_agent_version": __version__,
        "source": source,
        "host": {"kernel_release": release.strip() if release else None, "modprobe": modprobe},
        "parts": PARTS,
        "problems": reader.problems + ([ldcache_problem] if ldcache_problem else []) + nvml_problems,
    }
    write_part(directory, "files.json", {"files": reader.files, "directories": sorted(set(reader.directories))})
    write_part(directory, "links.json", reader.links)
    write_part(directory, "devices.json", reader.devices)
    write_part(directory, "ldcache.json", libraries)
    write_part(directory, "nvml.json", nvml.recorder.recorded())
    write_part(directory, MANIFEST, manifest)  # last: a directory with a manifest is a complete capture
    return manifest


def write_part(directory: Path, name: str, document: Any) -> None:
    """A part as JSON; nvml.json one call per line, in the order the calls were made."""
    if name == "nvml.json":
        text = "[\n" + ",\n".join(json.dumps(entry) for entry in document) + "\n]\n"
    else:
        text = json.dumps(document, indent=1, sort_keys=True) + "\n"
    atomic_write(Path(directory) / name, text)


def _read(path: Path) -> Optional[str]:
    try:
        data = read_bounded(path, MAX_FILE_BYTES)
    except (OSError, NotRegular, TooLarge):
        return None
    return None if data is None else data.decode("utf-8", errors="replace")
