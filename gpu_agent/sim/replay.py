"""`--simulate DIR`: a captured node (gpu_agent/capture.py) as a simulated machine.

What the node showed is replayed as it was: its /proc, /sys and /dev files, its device nodes and
/dev/char links, its /etc/modprobe.d, its ld.so cache and the NVML answers it gave (names, PCI info,
memory v1 and v2, BAR1, clocks, thresholds, ECC and remapped rows, MIG profiles and placements,
driver and CUDA versions). What changes while the agent runs is simulated on top, as on any
simulated machine: MIG instances, processes, persistence mode, faults and XID events, the device
nodes and links the agent creates, and the modules it loads.

Loading a module on a captured node: a node without modprobe (the capture's manifest says where it
was, or null) fails exactly as the real one does ("cannot run modprobe: not installed or not on
PATH"). With modprobe, a module loaded at capture time is already there, the driver's own modules
(nvidia, nvidia_uvm, nvidia_modeset, nvidia_drm, nvidia_peermem) load when the nvidia module was
loaded (they ship together), and any other module is not found. A loaded module appears in
/proc/modules (in the captured kernel's style) and /sys/module; the captured /proc/devices and
/proc/driver/nvidia stay as captured. NVML answers stay those recorded: a capture taken while NVML
failed keeps failing the same way. A query the capture did not record answers NotSupported.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import posixpath
import re
import stat
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Literal, Optional

import pynvml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpu_agent.errors import AgentError
from gpu_agent.host import ldcache
from gpu_agent.host import jsontext
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.sim.files import publish
from gpu_agent.host.paths import Root, followed, link_text, place
from gpu_agent.nvml import answers
from gpu_agent.capture import FORMAT, MANIFEST, PARTS
from gpu_agent.sim.fake import FakeNvml, SimComputeInstance, SimGpuInstance, SimHandle, _nvml
from gpu_agent.sim.kernel import (
    NVIDIA_MODULES,
    SIZES,
    loaded_names,
    mig_capability_files,
)
from gpu_agent.sim.profiles import GiProfile, GpuModel

MIB = 1024 * 1024
MAX_GPUS = 256
NO_ID = 0xFFFFFFFF  # NVML's "no GPU or compute instance" in a process's ids
MAX_PART_BYTES = 16 << 20  # a real node's parts are KiBs to a few MiB; parsing one costs about 4x its size
LOAD_PER_PROCESS = 35  # % utilisation a simulated process adds, as on built-in machines
FILE_TREES = ("/proc/", "/sys/", "/etc/modprobe.d/")
HOST_FILES = ("/etc/os-release",)
NVIDIA_MAJOR = 195
DYNAMIC_MAJORS = ((234, 254), (384, 511))  # Linux's dynamically allocated character majors (nvidia-uvm, -caps)
LINK_TREES = ("/sys/bus/pci/devices/", "/dev/char/", "/dev/nvidia")
_MIG_CAPABILITY = re.compile(r"^proc/driver/nvidia/capabilities/gpu\d+/mig/gi\d+/")


# --- the capture on disk -------------------------------------------------------------------------


def _host_path(value: str) -> str:
    if not value.startswith("/") or os.path.normpath(value) != value or "\0" in value:
        raise ValueError(f"{value!r} is not a normalised absolute path")
    return value


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HostInfo(_Part):
    kernel_release: Optional[str] = None
    modprobe: Optional[str] = None


class Manifest(_Part):
    format: str
    created: str
    gpu_agent_version: str
    source: str
    host: HostInfo
    parts: dict[str, str]
    problems: list[str] = []

    @field_validator("format")
    @classmethod
    def _known(cls, value: str) -> str:
        if value != FORMAT:
            raise ValueError(f"unknown capture format {value!r}; this gpu-agent reads {FORMAT}")
        return value


class Files(_Part):
    files: dict[str, str]
    directories: list[str] = []

    @field_validator("files")
    @classmethod
    def _paths(cls, files: dict[str, str]) -> dict[str, str]:
        for path in files:
            _host_path(path)
            if not (path.startswith(FILE_TREES) or path in HOST_FILES):
                raise ValueError(f"{path}: a capture holds files under /proc, /sys and /etc/modprobe.d, "
                                 f"and {', '.join(HOST_FILES)}")
        return files

    @field_validator("directories")
    @classmethod
    def _directories(cls, directories: list[str]) -> list[str]:
        for path in directories:
            if not _host_path(path).startswith(("/proc/", "/sys/")):
                raise ValueError(f"{path}: directories are under /proc and /sys")
        return directories


class DeviceNode(_Part):
    path: str
    type: Literal["char", "directory"]  # the driver makes no block device
    major: int = Field(0, ge=0, lt=1 << 12)
    minor: int = Field(0, ge=0, lt=1 << 20)
    mode: str
    uid: int = Field(ge=0, lt=1 << 32)
    gid: int = Field(ge=0, lt=1 << 32)

    @field_validator("path")
    @classmethod
    def _nvidia(cls, value: str) -> str:
        if not _host_path(value).startswith("/dev/nvidia"):
            raise ValueError(f"{value}: a capture holds the /dev/nvidia* device nodes only")
        return value

    @field_validator("major")
    @classmethod
    def _driver_major(cls, value: int) -> int:
        if not (value in (0, NVIDIA_MAJOR) or any(low <= value <= high for low, high in DYNAMIC_MAJORS)):
            raise ValueError(f"major {value} is neither NVIDIA's ({NVIDIA_MAJOR}) nor one the kernel hands "
                             "out to a driver (234-254, 384-511): a replay makes no other device")
        return value

    @field_validator("mode")
    @classmethod
    def _octal(cls, value: str) -> str:
        if not re.fullmatch(r"0?[0-7]{3,4}", value):
            raise ValueError(f"mode {value!r} is not an octal permission such as 0666")
        return value


class Library(_Part):
    key: str
    path: str
    flags: int = Field(ge=-(1 << 31), lt=1 << 31)
    hwcap: int = Field(0, ge=0, lt=1 << 64)
    target: Optional[str] = None

    @field_validator("path", "target")
    @classmethod
    def _absolute(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and _host_path(value).startswith(("/proc/", "/sys/", "/dev/")):
            raise ValueError(f"{value}: a library is not under /proc, /sys or /dev")
        return value


class NvmlCall(_Part):
    call: str
    args: list[Any]
    ok: Any = None
    error: Optional[str] = None
    code: Optional[int] = None


class Capture:
    """A capture directory, read and checked; every error names the file, the entry and the reason."""

    _cache: ClassVar[dict[str, tuple[float, Capture]]] = {}

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.manifest: Manifest = self._part(MANIFEST, Manifest)
        files = self._part("files.json", Files)
        self.files, self.directories = files.files, files.directories
        for path, text in self.files.items():
            try:  # a capture escapes the bytes of a file that is not UTF-8, and nothing else
                text.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raise AgentError(f"{directory / 'files.json'}: {path!r}: text no file can hold (a lone surrogate "
                                 "that is not an escaped byte); capture the node again") from None
        links = self._part("links.json", dict)
        self.links: dict[str, str] = {}
        for path, target in links.items():
            if not isinstance(target, str) or not target or "\0" in target or not _safe(path, LINK_TREES):
                raise AgentError(f"{directory / 'links.json'}: {path!r}: expected a link under "
                                 f"{' or '.join(LINK_TREES)} and its target")
            self.links[path] = target
        self.devices: list[DeviceNode] = self._list("devices.json", DeviceNode)
        self.libraries: list[Library] = self._list("ldcache.json", Library)
        self.calls: dict[str, NvmlCall] = {}
        for n, entry in enumerate(self._list("nvml.json", NvmlCall)):
            if (entry.error is None) == ("ok" not in entry.model_fields_set):
                raise AgentError(f"{directory / 'nvml.json'}: [{n}] {entry.call}: needs either ok or error")
            problem = _answer_problem(entry) if entry.error is None else None
            if problem:
                raise AgentError(f"{directory / 'nvml.json'}: [{n}] {entry.call}: {problem}")
            self.calls[json.dumps([entry.call, entry.args], sort_keys=True)] = entry
        self.recorded_names = {entry.call for entry in self.calls.values()}
        self._check_layout()

    def _check_layout(self) -> None:
        """No file, link, device node or library of the capture is also a directory of another entry
        (/opt a link, then /opt/lib/x): what a replay lays out is a tree, each path one thing."""
        leaves: dict[str, str] = {}
        for path in self.files:
            leaves.setdefault(path, "files.json")
        for path in self.links:
            leaves.setdefault(path, "links.json")
        for node in self.devices:
            if node.type != "directory":
                leaves.setdefault(node.path, "devices.json")
        for library in self.libraries:
            for path in (library.path, library.target):
                if path is not None:
                    leaves.setdefault(path, "ldcache.json")
        parents: dict[str, str] = {}
        for path in [*leaves, *self.directories, *(node.path for node in self.devices)]:
            parent = posixpath.dirname(path)
            while parent != "/" and parent not in parents:
                parents[parent] = path
                parent = posixpath.dirname(parent)
        for path, part in leaves.items():
            if path in parents:
                raise AgentError(f"{self.directory / part}: {path}: one entry of the capture, and the directory "
                                 f"of another ({parents[path]}); not a capture this agent wrote")

    @classmethod
    def load(cls, directory: Path) -> Capture:
        """The capture in `directory`, read once per process (a capture never changes)."""
        directory = Path(directory).resolve()
        manifest = directory / MANIFEST
        try:
            stamp = manifest.stat().st_mtime
        except OSError:
            raise AgentError(f"{directory}: not a gpu-agent capture (no {MANIFEST}); make one with "
                             "`gpu-agent capture DIR`") from None
        cached = cls._cache.get(str(directory))
        if cached is None or cached[0] != stamp:
            cached = (stamp, cls(directory))
            cls._cache[str(directory)] = cached
        return cached[1]

    @contextlib.contextmanager
    def entry_error(self, name: str, entry: str) -> Iterator[None]:
        """Laying out `entry` of part `name` on the root: what stops it, as a refusal naming both."""
        try:
            yield
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            filename = getattr(exc, "filename", None)
            where = f" ({filename})" if filename else ""
            raise AgentError(f"{self.directory / name}: {entry}: cannot lay it out under the root: "
                             f"{reason}{where}; nothing outside the root was touched") from None

    def _json(self, name: str) -> Any:
        path = self.directory / name
        try:  # a part is a regular file of the capture's directory: a link to anywhere is not followed
            data = read_bounded(path, MAX_PART_BYTES, follow=False)
            if data is None:
                raise AgentError(f"{path}: missing; a capture has {MANIFEST} and {', '.join(PARTS)}")
            return jsontext.loads(data.decode("utf-8"), max_digits=jsontext.OWN_DIGITS)
        except jsontext.NumberTooLong as exc:
            raise AgentError(f"{path}: an integer of {exc.digits} digits (at most {exc.limit}) at line:column "
                             f"{exc.where}; not a capture this agent wrote") from None
        except TooLarge:
            raise AgentError(f"{path}: larger than {MAX_PART_BYTES >> 20} MiB; "
                             "not a capture this agent wrote") from None
        except NotRegular as exc:
            raise AgentError(f"{path}: {exc.kind}, not a file; not a capture this agent wrote") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise AgentError(f"{path}: a symbolic link; a capture's parts are files in its directory, "
                                 "and a link is not followed") from None
            raise AgentError(f"{path}: cannot read: {exc.strerror}") from None
        except RecursionError:
            raise AgentError(f"{path}: nested too deeply; not a capture this agent wrote") from None
        except UnicodeDecodeError:
            raise AgentError(f"{path}: not UTF-8 text") from None
        except json.JSONDecodeError as exc:
            raise AgentError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None

    def _part(self, name: str, kind: Any) -> Any:
        document = self._json(name)
        if kind is dict:
            if not isinstance(document, dict):
                raise AgentError(f"{self.directory / name}: expected a JSON object")
            return document
        try:
            return kind.model_validate(document)
        except ValidationError as exc:
            raise AgentError(f"{self.directory / name}: {_problems(exc)}") from None

    def _list(self, name: str, kind: Any) -> list[Any]:
        document = self._json(name)
        if not isinstance(document, list):
            raise AgentError(f"{self.directory / name}: expected a JSON list")
        entries = []
        for n, item in enumerate(document):
            try:
                entries.append(kind.model_validate(item))
            except ValidationError as exc:
                raise AgentError(f"{self.directory / name}: [{n}] {_problems(exc)}") from None
        return entries

    # --- NVML answers ----------------------------------------------------------------------------

    def entry(self, name: str, args: tuple[Any, ...], kwargs: Optional[dict[str, Any]] = None) -> Optional[NvmlCall]:
        return self.calls.get(answers.call_key(name, args, kwargs or {}, ref_of))

    def answer(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The recorded answer as pynvml returns it; the recorded NVMLError raised; NotSupported when
        the capture did not record this call."""
        entry = self.entry(name, args, kwargs)
        if entry is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if entry.error is not None:
            answers.raise_recorded({"error": entry.error, "code": entry.code})
        try:
            return answers.decode(entry.ok, handle_of)
        except (ValueError, TypeError, AttributeError) as exc:
            raise AgentError(f"{self.directory / 'nvml.json'}: {name}: cannot replay the recorded answer: "
                             f"{exc}") from None

    def field_values(self, ref: str) -> dict[tuple[int, int], Any]:
        """Every field value the node answered for handle `ref`, in any nvmlDeviceGetFieldValues call,
        by (field id, scope id)."""
        found: dict[tuple[int, int], Any] = {}
        for entry in self.calls.values():
            asked = entry.call == "nvmlDeviceGetFieldValues" and entry.args[:1] == [{"handle": ref}]
            if not asked or entry.error is not None:
                continue
            for value in answers.decode(entry.ok, handle_of) or ():
                found[(value.fieldId, value.scopeId)] = value
        return found

    def value(self, name: str, *args: Any, default: Any = None) -> Any:
        """The recorded answer, or `default` when it was an error or not recorded."""
        try:
            return self.answer(name, *args)
        except pynvml.NVMLError:
            return default

    # --- what the node is ------------------------------------------------------------------------

    def gpu_count(self) -> int:
        count = self.value("nvmlDeviceGetCount", default=0)
        if not 0 <= count <= MAX_GPUS:
            raise AgentError(f"{self.directory / 'nvml.json'}: nvmlDeviceGetCount: {count} GPUs; "
                             f"a node has 0 to {MAX_GPUS}")
        return count

    def model(self, index: int) -> GpuModel:
        """GPU `index` as a simulator model: name, memory, PCI id and its MIG profile table."""
        handle = SimHandle(index)
        memory = self.value("nvmlDeviceGetMemoryInfo", handle)
        pci = self.value("nvmlDeviceGetPciInfo", handle)
        power = self.value("nvmlDeviceGetPowerUsage", handle, default=0) or 0
        limit = self.value("nvmlDeviceGetPowerManagementLimit", handle, default=power) or power
        return GpuModel(
            key=f"captured:{index}",
            name=str(self.value("nvmlDeviceGetName", handle, default=f"captured GPU {index}")),
            memory_mib=int(memory.total // MIB) if memory is not None else 0,
            compute_capability=tuple(self.value("nvmlDeviceGetCudaComputeCapability", handle, default=(0, 0))),
            pci_device_id=int(pci.pciDeviceId) if pci is not None else 0,
            idle_temp_c=int(self.value("nvmlDeviceGetTemperature", handle, pynvml.NVML_TEMPERATURE_GPU, default=0)),
            idle_power_w=int(power) // 1000,
            max_power_w=int(limit) // 1000,
            mig_profiles=self._profiles(handle),
        )

    def _profiles(self, handle: SimHandle) -> tuple[GiProfile, ...]:
        names = {value: name for name, value in vars(pynvml).items()
                 if name.startswith("NVML_GPU_INSTANCE_PROFILE_") and not name.endswith("_COUNT")}
        device = [{"handle": ref_of(handle)}]
        asked = [entry.args[1] for entry in self.calls.values()  # in the order the agent asked, nvidia-smi's
                 if entry.call == "nvmlDeviceGetGpuInstanceProfileInfo" and entry.args[:1] == device
                 and len(entry.args) > 1 and entry.args[1] in names]
        profiles = []
        for constant in dict.fromkeys(asked):
            info = self.value("nvmlDeviceGetGpuInstanceProfileInfo", handle, constant)
            if info is None:
                continue
            entry = self.entry(answers.PLACEMENTS_CALL, (handle, info.id))
            placements = entry.ok if entry is not None and entry.error is None and isinstance(entry.ok, list) else []
            starts = tuple(int(p[0]) for p in placements)
            size = int(placements[0][1]) if placements else 0
            profiles.append(GiProfile(names[constant], info.id, info.name, info.sliceCount, info.instanceCount,
                                      info.multiprocessorCount, info.memorySizeMB, info.copyEngineCount,
                                      info.decoderCount, info.encoderCount, info.jpegCount, info.ofaCount,
                                      starts, size))
        return tuple(profiles)


_INT, _STR, _PAIR = "an integer", "a string", "a list of two integers"
# What the answers the agent and the replay rely on must be; a recorded structure must also be one
# of these pynvml classes.
ANSWER_SHAPES: dict[str, Any] = {
    "nvmlSystemGetDriverVersion": _STR, "nvmlSystemGetCudaDriverVersion": _INT, "nvmlDeviceGetCount": _INT,
    "nvmlDeviceGetName": _STR, "nvmlDeviceGetUUID": _STR, "nvmlDeviceGetMinorNumber": _INT,
    "nvmlDeviceGetIndex": _INT, "nvmlDeviceGetPersistenceMode": _INT, "nvmlDeviceGetTemperature": _INT,
    "nvmlDeviceGetPowerUsage": _INT, "nvmlDeviceGetPowerManagementLimit": _INT,
    "nvmlDeviceGetMaxMigDeviceCount": _INT, "nvmlDeviceGetGpuInstanceId": _INT,
    "nvmlDeviceGetComputeInstanceId": _INT, "nvmlDeviceGetMigMode": _PAIR, "nvmlDeviceGetCudaComputeCapability": _PAIR,
    "nvmlDeviceGetPciInfo": ("nvmlPciInfo_t",), "nvmlDeviceGetMemoryInfo": ("c_nvmlMemory_t", "c_nvmlMemory_v2_t"),
    "nvmlDeviceGetUtilizationRates": ("c_nvmlUtilization_t",),
    "nvmlDeviceGetGpuInstanceProfileInfo": ("c_nvmlGpuInstanceProfileInfo_v2_t", "c_nvmlGpuInstanceProfileInfo_t"),
    "nvmlGpuInstanceGetInfo": ("c_nvmlGpuInstanceInfo_t",),
    answers.PLACEMENTS_CALL: "a list of [start, size] pairs",
    "nvmlDeviceGetComputeRunningProcesses": "a list of processes",
}


def _answer_problem(entry: NvmlCall) -> Optional[str]:
    """What is wrong with a recorded answer, or None."""
    try:
        answers.decode(entry.ok, handle_of)
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:
        return f"cannot replay the recorded answer: {exc}"
    shape, value = ANSWER_SHAPES.get(entry.call), entry.ok
    if shape is None:
        return None
    if isinstance(shape, tuple):
        ok = isinstance(value, dict) and value.get("struct") in shape
        shape = f"a {' or '.join(shape)} structure"
    elif shape == _INT:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif shape == _STR:
        ok = isinstance(value, str)
    elif shape == _PAIR:
        ok = isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)
    elif entry.call == answers.PLACEMENTS_CALL:
        ok = isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) and v >= 0 for v in p) for p in value)
    else:
        ok = isinstance(value, list) and all(
            isinstance(p, dict) and isinstance(p.get("object", {}).get("pid"), int)
            and isinstance(p["object"].get("usedGpuMemory", 0), (int, type(None))) for p in value)
    return None if ok else f"expected {shape}, the capture has {json.dumps(value)[:60]}"


def _safe(path: Any, trees: tuple[str, ...]) -> bool:
    try:
        return isinstance(path, str) and _host_path(path).startswith(trees)
    except ValueError:
        return False


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or '(document)'}: "
        f"{'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}"
        for err in exc.errors()
    )


def ref_of(value: Any) -> Optional[str]:
    """The capture's reference of a simulated handle: gpu0, gpu0/mig1, gpu0/gi3, gpu0/gi3/ci0."""
    if isinstance(value, SimHandle):
        return f"gpu{value.gpu}" if value.mig is None else f"gpu{value.gpu}/mig{value.mig}"
    if isinstance(value, SimGpuInstance):
        return f"gpu{value.gpu}/gi{value.gi_id}"
    if isinstance(value, SimComputeInstance):
        return f"gpu{value.gpu}/gi{value.gi_id}/ci{value.ci_id}"
    return None


def handle_of(ref: str) -> Any:
    match = re.fullmatch(r"gpu([0-9]{1,9})(?:/(mig|gi)([0-9]{1,9})(?:/ci([0-9]{1,9}))?)?", ref)
    if match is None or (match.group(4) is not None and match.group(2) != "gi"):
        raise ValueError(f"unknown handle reference {ref!r}")
    gpu = int(match.group(1))
    if match.group(4) is not None:
        return SimComputeInstance(gpu, int(match.group(3)), int(match.group(4)))
    if match.group(2) == "gi":
        return SimGpuInstance(gpu, int(match.group(3)))
    return SimHandle(gpu, int(match.group(3)) if match.group(2) else None)


# --- the machine state ---------------------------------------------------------------------------


def capture_state(source: str, capture: Capture) -> dict[str, Any]:
    """The simulated machine's initial state: the node as captured."""
    gpus = []
    for index in range(capture.gpu_count()):
        handle = SimHandle(index)
        pci = capture.value("nvmlDeviceGetPciInfo", handle)
        mode = capture.value("nvmlDeviceGetMigMode", handle, default=[0, 0])
        processes = [
            {"pid": p.pid, "name": "", "used_mib": int((getattr(p, "usedGpuMemory", 0) or 0) // MIB),
             **({"gpu_instance_id": p.gpuInstanceId} if getattr(p, "gpuInstanceId", NO_ID) != NO_ID else {})}
            for p in capture.value("nvmlDeviceGetComputeRunningProcesses", handle, default=[])
        ]
        gpus.append({
            "model": capture.model(index).name, "capture_index": index,
            "pci_bus_id": pci.busId if pci is not None else f"00000000:{index:02X}:00.0",
            "uuid": capture.value("nvmlDeviceGetUUID", handle, default=f"GPU-captured-{index}"),
            "minor": capture.value("nvmlDeviceGetMinorNumber", handle, default=index),
            "persistence": capture.value("nvmlDeviceGetPersistenceMode", handle, default=0),
            "mig": {"current": mode[0], "pending": mode[1], "captured_mode": mode[0],
                    "gpu_instances": _gpu_instances(capture, index) if mode[0] else []},
            "processes": processes,
            "captured_processes": len(processes),
            "captured_process_mib": sum(p["used_mib"] for p in processes),
        })
    cuda = capture.value("nvmlSystemGetCudaDriverVersion", default=0)
    product = capture.files.get("/sys/class/dmi/id/product_name")
    return {
        "source": source, "machine": capture.directory.name, "capture": str(capture.directory),
        "driver_version": capture.value("nvmlSystemGetDriverVersion"), "cuda_version": cuda,
        "gpus": gpus, "faults": [], "xids": [], "next_seq": 1,
        "pci": {"nvswitches": [], "mellanox_nics": []},
        "product_name": product.strip() if product else None,
        "kernel": _kernel(capture),
    }


def _gpu_instances(capture: Capture, index: int) -> list[dict[str, Any]]:
    """The captured GPU instances, each with its compute instances and their MIG device UUIDs: from the
    GPU instance walk where the capture has it (a GPU instance without a compute instance included),
    else from the MIG devices (compute instances as large as their GPU instance, or as their recorded
    attributes say)."""
    from gpu_agent.sim.mig import CI_PROFILE_IDS

    model = capture.model(index)
    slices = {p.id: p.slices for p in model.mig_profiles}
    instances: dict[int, dict[str, Any]] = {}

    def gpu_instance(gi_id: int) -> Optional[dict[str, Any]]:
        if gi_id not in instances:
            info = capture.value("nvmlGpuInstanceGetInfo", SimGpuInstance(index, gi_id))
            if info is None:
                return None
            instances[gi_id] = {"id": gi_id, "profile_id": info.profileId, "start": info.placement.start,
                                "size": info.placement.size, "compute_instances": []}
        return instances[gi_id]

    for profile in model.mig_profiles:
        for handle in capture.value(answers.GPU_INSTANCES_CALL, SimHandle(index), profile.id, default=[]) or []:
            if isinstance(handle, SimGpuInstance):
                gpu_instance(handle.gi_id)
    for slot in range(64):
        if capture.value("nvmlDeviceGetMigDeviceHandleByIndex", SimHandle(index), slot) is None:
            continue
        mig = SimHandle(index, slot)
        gi_id = capture.value("nvmlDeviceGetGpuInstanceId", mig)
        gi = gpu_instance(gi_id) if gi_id is not None else None
        if gi is None:
            continue
        ci_id = capture.value("nvmlDeviceGetComputeInstanceId", mig, default=0)
        info = capture.value("nvmlComputeInstanceGetInfo", SimComputeInstance(index, gi_id, ci_id))
        if info is not None:
            start, size = info.placement.start, info.placement.size
        else:
            attributes = capture.value("nvmlDeviceGetAttributes", mig)
            size = getattr(attributes, "computeInstanceSliceCount", 0) or slices.get(gi["profile_id"], 1)
            start = sum(ci["size"] for ci in gi["compute_instances"])
        gi["compute_instances"].append({"id": ci_id, "profile_id": CI_PROFILE_IDS.get(size, 0), "start": start,
                                        "size": size, "uuid": capture.value("nvmlDeviceGetUUID", mig)})
    return sorted(instances.values(), key=lambda gi: gi["id"])


def _kernel(capture: Capture) -> dict[str, Any]:
    """Loaded modules from the captured /proc/modules, newest last (the kernel lists the newest first)."""
    lines = [line for line in capture.files.get("/proc/modules", "").splitlines() if line.split()]
    loaded = []
    for line in reversed(lines):
        name = line.split()[0]
        version = capture.files.get(f"/sys/module/{name}/version")
        loaded.append({"name": name, "version": version.strip() if version else None, "params": {}, "line": line})
    names = {module["name"] for module in loaded}
    installed: dict[str, Optional[str]] = {m["name"]: m["version"] for m in loaded}
    if "nvidia" in names:
        version = next(m["version"] for m in loaded if m["name"] == "nvidia")
        installed.update({name: installed.get(name, version) for name in NVIDIA_MODULES})
    return {
        "release": capture.manifest.host.kernel_release or "unknown",
        "modprobe": capture.manifest.host.modprobe,
        "refcounts": not any(line.split()[2:3] == ["-"] for line in lines),
        "taint": next((f" {w}" for line in lines if line.split()[0] == "nvidia" for w in line.split()[6:7]), ""),
        "installed": installed,
        "loaded": loaded,
    }


# --- the simulated kernel of a captured node -----------------------------------------------------


def captured_kernel(state: dict[str, Any]) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(files, links, directories) of the simulated kernel, relative to its directory: the captured
    ones, with what the simulation changed on top."""
    capture = Capture.load(Path(state["capture"]))
    files = {path.lstrip("/"): text for path, text in capture.files.items() if path.startswith(("/proc/", "/sys/"))}
    files = {path: text for path, text in files.items() if not _MIG_CAPABILITY.match(path)}
    for path, text in mig_capability_files(state).items():
        files[path] = capture.files.get(f"/{path}", text)
    links = {path.lstrip("/"): target for path, target in capture.links.items() if path.startswith("/sys/")}
    directories = [path.lstrip("/") for path in capture.directories]
    kernel = state["kernel"]
    lines = []
    for module in reversed(kernel["loaded"]):
        if "line" in module:
            lines.append(module["line"])
            continue
        name = module["name"]
        usage = "0 -" if kernel.get("refcounts", True) else "- -"
        lines.append(f"{name} {SIZES.get(name, 65536)} {usage} Live 0x0000000000000000{kernel.get('taint', '')}")
        directories.append(f"sys/module/{name}")
        if module["version"]:
            files[f"sys/module/{name}/version"] = f"{module['version']}\n"
    files["proc/modules"] = "".join(line + "\n" for line in lines)
    files.setdefault("proc/sys/kernel/osrelease", f"{kernel['release']}\n")
    for gpu in state["gpus"]:
        for process in gpu["processes"]:
            if process["name"]:  # a captured process's name was not captured
                files[f"proc/{process['pid']}/comm"] = process["name"][:15] + "\n"
    return files, links, directories


def modprobe_missing(state: dict[str, Any]) -> bool:
    """A captured node without modprobe cannot load a module at all."""
    return bool(state.get("capture")) and state["kernel"].get("modprobe") is None


# --- the rest of the captured host ---------------------------------------------------------------


def install_captured_host(root: Root, kernel_dir: Path, capture: Capture) -> None:
    """The captured /dev (device nodes, /dev/char links) and /etc/modprobe.d in the simulated kernel;
    on a sandbox root also the driver's libraries as the ld.so cache lists them, and /etc/os-release.

    Every place is resolved as in a chroot at the root (host.paths.place and followed), so a link in
    the root, or one an earlier entry of the capture made, is read under the root; every link is
    written relative to where it is (host.paths.link_text), so the OS, following it later for anyone,
    stays under the root too. A capture entry that cannot be laid out is refused by file and entry."""
    kernel_root = Root(root.path, kernel_dir)
    for node in sorted(capture.devices, key=lambda n: n.path):
        with capture.entry_error("devices.json", node.path):
            _device_node(kernel_root, node)
    for path, target in capture.links.items():
        if path.startswith("/dev/"):
            with capture.entry_error("links.json", path):
                _link(kernel_root, path, target)
    for path, text in capture.files.items():
        if path.startswith("/etc/modprobe.d/"):
            with capture.entry_error("files.json", path):
                _file(kernel_root, path, text)
    if str(root.path) == "/":
        return  # the real root's userspace stays as it is
    for path in HOST_FILES:
        if path in capture.files:
            with capture.entry_error("files.json", path):
                _file(root, path, capture.files[path])
    _libraries(root, capture)


def _file(root: Root, path: str, text: str) -> None:
    """A regular file at `path`: where its directory's links lead under the root, replacing a link
    there (the rename does not follow it)."""
    where = root(place(root, path))
    if where.is_dir() and not where.is_symlink():
        raise IsADirectoryError(errno.EISDIR, "a directory is there", path)
    publish(where, text.encode("utf-8", "surrogateescape"))


def _link(root: Root, path: str, target: str) -> None:
    """The link `path` -> `target`, the target read as in a chroot at the root and written relative."""
    at = place(root, path)
    link = root(at)
    if link.is_dir() and not link.is_symlink():
        raise IsADirectoryError(errno.EISDIR, "a directory is there", path)
    link.parent.mkdir(parents=True, exist_ok=True)
    text = link_text(root, at, target)
    if os.path.lexists(link):
        link.unlink()
    os.symlink(text, link)


def _device_node(root: Root, node: DeviceNode) -> None:
    mode = int(node.mode, 8)
    path = root(place(root, node.path))
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink()
    elif path.is_dir() and node.type != "directory":
        raise IsADirectoryError(errno.EISDIR, "a directory is there", node.path)
    if node.type == "directory":
        path.mkdir(mode=mode, exist_ok=True)
    else:
        try:
            os.mknod(path, stat.S_IFCHR | mode, os.makedev(node.major, node.minor))
        except PermissionError:
            raise AgentError(f"cannot create the captured device node {node.path} ({node.major}:{node.minor}): "
                             "replaying a capture needs root (CAP_MKNOD)") from None
    os.chown(path, node.uid, node.gid, follow_symlinks=False)
    os.chmod(path, mode)  # what was just made there: neither a link nor someone else's file


def _libraries(root: Root, capture: Capture) -> None:
    """Placeholder files where the cache's entries lead, the entries' paths linked to them, and the cache."""
    for n, library in enumerate(capture.libraries):
        if library.target is None:
            continue
        with capture.entry_error("ldcache.json", f"[{n}] {library.path}"):
            target = root(followed(root, library.target))
            if not os.path.lexists(target):
                publish(target, f"placeholder {posixpath.basename(library.target)} (replayed capture)\n")
            if library.target != library.path:
                _link(root, library.path, library.target)
    with capture.entry_error("ldcache.json", ldcache.PATH):
        ldcache.write_cache(root(place(root, ldcache.PATH)),
                            [ldcache.CacheEntry(lib.key, lib.path, lib.flags, lib.hwcap) for lib in capture.libraries])


# --- NVML ----------------------------------------------------------------------------------------


def _recorded(name: str) -> Callable[..., Any]:
    def call(self: ReplayNvml, *args: Any, **kwargs: Any) -> Any:
        return self.capture.answer(name, *args, **kwargs)

    call.__name__ = name
    return _nvml(call)


class ReplayNvml(FakeNvml):
    """The simulator's NVML on a captured node: recorded answers for what does not change, the
    simulated machine's state for what does."""

    # Answered from the capture for whole GPUs; a MIG device's are simulated (instances change).
    WHOLE_GPU = ("nvmlDeviceGetName", "nvmlDeviceGetUUID")

    def __init__(self, state: Any, capture: Capture) -> None:
        super().__init__(state)
        self.capture = capture
        self._models: dict[int, GpuModel] = {}

    def __getattr__(self, name: str) -> Any:
        capture = self.__dict__.get("capture")
        if capture is not None and name in capture.recorded_names:
            return _recorded(name).__get__(self)
        return super().__getattr__(name)

    def _model(self, gpu: dict[str, Any]) -> GpuModel:
        index = gpu["capture_index"]
        if index not in self._models:
            self._models[index] = self.capture.model(index)
        return self._models[index]

    def _load(self, gpu: dict[str, Any]) -> int:
        """Utilisation the processes simulated since the capture add."""
        return min(100, LOAD_PER_PROCESS * max(0, len(gpu["processes"]) - gpu["captured_processes"]))

    def nvmlInit(self) -> None:
        entry = self.capture.entry("nvmlInit", ())
        if entry is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if entry.error is not None:
            answers.raise_recorded({"error": entry.error, "code": entry.code})
        state = self._state.read()
        if "nvidia" not in loaded_names(state):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        module = next(m["version"] for m in state["kernel"]["loaded"] if m["name"] == "nvidia")
        if module is not None and state["driver_version"] is not None and module != state["driver_version"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH)
        self._fault("nvmlInit", None)
        with self._lock:
            self._init_count += 1

    nvmlSystemGetDriverVersion = _recorded("nvmlSystemGetDriverVersion")
    nvmlSystemGetNVMLVersion = _recorded("nvmlSystemGetNVMLVersion")
    nvmlSystemGetCudaDriverVersion = _recorded("nvmlSystemGetCudaDriverVersion")
    # Topology is the hardware's: as recorded (a one-GPU capture has no pairs: NotSupported).
    nvmlDeviceGetNvLinkState = _recorded("nvmlDeviceGetNvLinkState")
    nvmlDeviceGetNvLinkRemoteDeviceType = _recorded("nvmlDeviceGetNvLinkRemoteDeviceType")
    nvmlDeviceGetNvLinkRemotePciInfo = _recorded("nvmlDeviceGetNvLinkRemotePciInfo")
    nvmlDeviceGetTopologyCommonAncestor = _recorded("nvmlDeviceGetTopologyCommonAncestor")
    nvmlDeviceGetP2PStatus = _recorded("nvmlDeviceGetP2PStatus")
    nvmlDeviceGetCount = _recorded("nvmlDeviceGetCount")
    nvmlDeviceGetIndex = _recorded("nvmlDeviceGetIndex")
    nvmlDeviceGetMinorNumber = _recorded("nvmlDeviceGetMinorNumber")
    nvmlDeviceGetPciInfo = _recorded("nvmlDeviceGetPciInfo")
    nvmlDeviceGetCudaComputeCapability = _recorded("nvmlDeviceGetCudaComputeCapability")
    nvmlDeviceGetGpuInstanceProfileInfo = _recorded("nvmlDeviceGetGpuInstanceProfileInfo")
    nvmlDeviceGetVirtualizationMode = _recorded("nvmlDeviceGetVirtualizationMode")
    # Metrics the fake simulates on built-in machines: here as the node answered, or NotSupported.
    nvmlDeviceGetClockInfo = _recorded("nvmlDeviceGetClockInfo")
    nvmlDeviceGetTotalEnergyConsumption = _recorded("nvmlDeviceGetTotalEnergyConsumption")
    nvmlDeviceGetPcieReplayCounter = _recorded("nvmlDeviceGetPcieReplayCounter")
    nvmlDeviceGetEncoderUtilization = _recorded("nvmlDeviceGetEncoderUtilization")
    nvmlDeviceGetDecoderUtilization = _recorded("nvmlDeviceGetDecoderUtilization")
    nvmlDeviceGetRemappedRows = _recorded("nvmlDeviceGetRemappedRows")
    nvmlDeviceGetRetiredPagesPendingStatus = _recorded("nvmlDeviceGetRetiredPagesPendingStatus")
    nvmlDeviceGetTemperatureThreshold = _recorded("nvmlDeviceGetTemperatureThreshold")
    # GPM is not captured (its samples are opaque buffers): a replayed node says why its PROF series are missing.
    nvmlGpmQueryDeviceSupport = _recorded("nvmlGpmQueryDeviceSupport")

    @_nvml
    def nvmlDeviceGetFieldValues(self, handle: SimHandle, field_ids: list[Any]) -> Any:
        """Each field as the node answered it when it was asked for it; NotSupported for one it was not."""
        recorded = self.capture.field_values(ref_of(handle) or "")
        values = (pynvml.c_nvmlFieldValue_t * len(field_ids))()
        for n, wanted in enumerate(field_ids):
            field_id, scope = wanted if isinstance(wanted, (list, tuple)) else (wanted, 0)
            if (field_id, scope) in recorded:
                values[n] = recorded[(field_id, scope)]
            else:
                values[n].fieldId, values[n].scopeId = field_id, scope
                values[n].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return values

    @_nvml
    def nvmlDeviceGetName(self, handle: SimHandle) -> str:
        if isinstance(handle, SimHandle) and handle.mig is not None:
            return FakeNvml.nvmlDeviceGetName.__wrapped__(self, handle)  # type: ignore[attr-defined]
        return self.capture.answer("nvmlDeviceGetName", handle)

    @_nvml
    def nvmlDeviceGetUUID(self, handle: SimHandle) -> str:
        if isinstance(handle, SimHandle) and handle.mig is not None:
            return FakeNvml.nvmlDeviceGetUUID.__wrapped__(self, handle)  # type: ignore[attr-defined]
        return self.capture.answer("nvmlDeviceGetUUID", handle)

    @_nvml
    def nvmlDeviceGetMemoryInfo(self, handle: SimHandle, version: Any = None) -> Any:
        if isinstance(handle, SimHandle) and handle.mig is not None:
            return FakeNvml.nvmlDeviceGetMemoryInfo.__wrapped__(self, handle, version)  # type: ignore[attr-defined]
        memory = self.capture.answer("nvmlDeviceGetMemoryInfo", handle, version)
        gpu = self._gpu(handle)
        extra = (sum(p["used_mib"] for p in gpu["processes"]) - gpu["captured_process_mib"]) * MIB
        extra = max(-int(memory.used), min(extra, int(memory.free)))
        memory.used, memory.free = memory.used + extra, memory.free - extra
        return memory

    @_nvml
    def nvmlDeviceGetUtilizationRates(self, handle: SimHandle) -> Any:
        gpu = self._whole_gpu(handle)
        if gpu["mig"]["current"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        rates = self.capture.answer("nvmlDeviceGetUtilizationRates", handle)
        load = self._load(gpu)
        rates.gpu, rates.memory = min(100, rates.gpu + load), min(100, rates.memory + load // 2)
        return rates

    @_nvml
    def nvmlDeviceGetTemperature(self, handle: SimHandle, sensor: int) -> int:
        gpu = self._whole_gpu(handle)
        return int(self.capture.answer("nvmlDeviceGetTemperature", handle, sensor)) + self._load(gpu) * 2 // 5

    @_nvml
    def nvmlDeviceGetPowerUsage(self, handle: SimHandle) -> int:
        gpu = self._whole_gpu(handle)
        milliwatts = int(self.capture.answer("nvmlDeviceGetPowerUsage", handle))
        model = self._model(gpu)
        headroom = max(0, model.max_power_w * 1000 - milliwatts)
        return milliwatts + int(headroom * self._load(gpu) * 0.8 / 100)

    @_nvml
    def nvmlDeviceGetMaxMigDeviceCount(self, handle: SimHandle) -> int:
        gpu, model = self._mig_capable(handle)
        if gpu["mig"]["current"] == gpu["mig"].get("captured_mode"):
            return self.capture.answer("nvmlDeviceGetMaxMigDeviceCount", handle)
        return max(p.instances for p in model.mig_profiles) if gpu["mig"]["current"] else 0

    @_nvml
    def nvmlDeviceGetGpuInstancePossiblePlacements(self, handle: SimHandle, profile_id: int,
                                                   placements: Any, count: Any) -> int:
        entry = self.capture.entry(answers.PLACEMENTS_CALL, (handle, profile_id))
        if entry is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if entry.error is not None:
            answers.raise_recorded({"error": entry.error, "code": entry.code})
        found = entry.ok if isinstance(entry.ok, list) else []
        size = count._obj if hasattr(count, "_obj") else count
        if placements is None or size.value < len(found):
            size.value = len(found)
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, (start, length) in enumerate(found):
            placements[i].start, placements[i].size = start, length
        size.value = len(found)
        return pynvml.NVML_SUCCESS


def simulated_calls(state: dict[str, Any]) -> set[str]:
    """The NVML functions the simulated machine answers (what `gpu-agent sim fail` can make fail)."""
    calls = {name for name, value in vars(FakeNvml).items() if name.startswith("nvml") and callable(value)}
    if state.get("capture"):
        calls |= Capture.load(Path(state["capture"])).recorded_names
    return calls


def simulated_nvml(machine: Any) -> FakeNvml:
    """The NVML of a simulated machine: the fake, or the replay of a capture."""
    state = machine.read()
    if state.get("capture"):
        return ReplayNvml(machine, Capture.load(Path(state["capture"])))
    return FakeNvml(machine)
