"""The simulated machine's state, kept under --root so CLI calls and a running daemon share one machine.

The state is a JSON document under <root>/var/lib/gpu-agent/sim/. Readers reload it when its
mtime changes; writers take an flock, edit, and replace it atomically. Beside it, a write counter that
readers map into memory tells them that nothing changed without a system call: a simulated NVML call
looks at the state, and a sample of 8 GPUs x 7 MIG devices makes hundreds of them.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import re
import shutil
import struct
import threading
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.files import atomic_write
from gpu_agent.host.paths import Root
from gpu_agent.sim.kernel import NVIDIA_MODULES, OLD_VERSION, RELEASE, break_kernel, initial_kernel, render
from gpu_agent.sim.mig import add_device
from gpu_agent.sim.profiles import BUILT_IN, MODELS, GpuModel, Machine
from gpu_agent.sim.services import install_unit
from gpu_agent.sim.topology import UNKNOWN_NUMA, gpu_topology
from gpu_agent.sim.userspace import install_driver_modules, install_driver_userspace

if TYPE_CHECKING:
    from gpu_agent.sim.machine_file import MigSpec

STATE_DIR = "/var/lib/gpu-agent/sim"
_WRITES = struct.Struct("=Q")  # the write counter: one native unsigned 64-bit number


def load_machine_file(path: Path) -> tuple[Machine, dict[int, MigSpec]]:
    """A custom machine from YAML; errors name the file, the key and the reason."""
    from pydantic import ValidationError

    from gpu_agent.config.safe_yaml import line_of, load_yaml
    from gpu_agent.config.text import read_config_text
    from gpu_agent.sim.machine_file import MAX_GPUS, MachineSpec

    text = read_config_text(path, "--simulate")  # bounded, regular files only, UTF-8 or a message with the line
    if text is None:
        raise AgentError(f"{path}: cannot read simulated machine: no such file")
    node, data = load_yaml(text, str(path))
    try:
        spec = MachineSpec.model_validate(data or {})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            line = line_of(node, err["loc"])
            key = ".".join(str(p) for p in err["loc"]) or "the file"
            reason = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{path}{f':{line}' if line else ''}: {key}: {reason}")
        raise AgentError("; ".join(problems)) from None
    gpus: list[tuple[GpuModel, str]] = []
    mig: dict[int, MigSpec] = {}
    numa: list[int] = []
    paths: list[tuple[str, ...]] = []
    audio: list[bool] = []
    for n, gpu in enumerate(spec.gpus):
        model = MODELS.get(gpu.model)
        if model is None:
            raise AgentError(f"{path}: gpus.{n}.model: unknown model {gpu.model!r}; known: {', '.join(MODELS)}")
        if gpu.pci_bus_ids is not None and len(gpu.pci_bus_ids) != gpu.count:
            raise AgentError(f"{path}: gpus.{n}.pci_bus_ids: {gpu.count} GPUs need {gpu.count} bus ids")
        for i in range(gpu.count):
            bus = gpu.pci_bus_ids[i] if gpu.pci_bus_ids else _default_bus_id(len(gpus))
            if gpu.mig.enabled or gpu.mig.devices:
                if not model.mig_capable:
                    raise AgentError(f"{path}: gpus.{n}.mig: {model.name} is not MIG-capable")
                mig[len(gpus)] = gpu.mig
            nvml_bus = _nvml_bus_id(bus)
            if nvml_bus is None:
                raise AgentError(f"{path}: gpus.{n}.pci_bus_ids.{i}: {bus!r} is not a PCI address: expected "
                                 "[DOMAIN:]BUS:DEVICE.FUNCTION in hex, bus at most ff, device 1f, function 7")
            if nvml_bus in (b for _, b in gpus):
                raise AgentError(f"{path}: gpus.{n}.pci_bus_ids.{i}: {bus} is already another GPU's")
            gpus.append((model, nvml_bus))
            numa.append(UNKNOWN_NUMA if gpu.numa_node is None else gpu.numa_node)
            paths.append(tuple(gpu.pcie_switch.split("/")) if gpu.pcie_switch else ())
            audio.append(gpu.audio)
    if len(gpus) > MAX_GPUS:
        raise AgentError(f"{path}: gpus: {len(gpus)} GPUs in all; at most {MAX_GPUS}, as device minors 254 and 255 "
                         "belong to nvidia-modeset and nvidiactl")
    if spec.nvlinks and not spec.nvswitches:
        raise AgentError(f"{path}: nvlinks: NVLink all-to-all goes through NVSwitches; set nvswitches too")
    machine = Machine(spec.name, spec.driver_version, spec.cuda, tuple(gpus),
                      nvswitches=tuple(f"0000:{0xc0 + n:02x}:00.0" for n in range(spec.nvswitches)),
                      mellanox_nics=tuple(f"0000:{0xe0 + n:02x}:00.0" for n in range(spec.mellanox_nics)),
                      nouveau=spec.nouveau, product_name=spec.product_name,
                      numa_nodes=tuple(numa), pcie_paths=tuple(paths), nvlinks=spec.nvlinks,
                      passthrough=spec.passthrough, audio=tuple(audio))
    return machine, mig


_PCI_ADDRESS = re.compile(r"(?:([0-9A-F]{1,8}):)?([0-9A-F]{1,2}):([0-9A-F]{1,2})\.([0-7])")
_GPUS_PER_DOMAIN = 11  # buses 10 ... B0 of a PCI domain (c0-df NVSwitches, e0-ff NICs); more GPUs span domains


def _default_bus_id(index: int) -> str:
    """The index-th GPU's address when the file names none: 0000:10:00.0, 0000:20:00.0 ... 0000:B0:00.0,
    then 0001:10:00.0, as large machines spread GPUs over PCI domains (a bus number never exceeds ff)."""
    domain, slot = divmod(index, _GPUS_PER_DOMAIN)
    return f"{domain:04X}:{0x10 * (slot + 1):02X}:00.0"


def _nvml_bus_id(bus: str) -> Optional[str]:
    """Any of 18:00.0, 0000:18:00.0, 00000000:18:00.0 as NVML writes it: 00000000:18:00.0; None when `bus`
    is no PCI address (a bus above ff, a device above 1f, a function above 7)."""
    match = _PCI_ADDRESS.fullmatch(bus.strip().upper())
    if match is None or int(match.group(3), 16) > 0x1F:
        return None
    domain, number, device, function = match.groups()
    return f"{int(domain or '0', 16):08X}:{int(number, 16):02X}:{int(device, 16):02X}.{function}"


def _gpu_uuid(machine: str, index: int, bus: str) -> str:
    return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"gpu-agent-sim/{machine}/{index}/{bus}"))


def new_state(source: str, machine: Machine, mig: dict[int, MigSpec]) -> dict[str, Any]:
    gpus = []
    for index, (model, bus) in enumerate(machine.gpus):
        uuid = _gpu_uuid(machine.name, index, bus)
        spec = mig.get(index)
        devices = spec.devices if spec is not None else []
        enabled = int(spec is not None and (spec.enabled or bool(devices)))
        gpu = {
            "model": model.key, "pci_bus_id": bus, "uuid": uuid, "minor": index,
            "mig": {"current": enabled, "pending": enabled, "gpu_instances": []},
            "processes": [],
            "topology": gpu_topology(
                machine.numa_nodes[index] if index < len(machine.numa_nodes) else UNKNOWN_NUMA,
                machine.pcie_paths[index] if index < len(machine.pcie_paths) else (), machine.nvlinks),
        }
        if machine.passthrough:
            gpu["passthrough"] = True
        if index < len(machine.audio) and machine.audio[index]:
            gpu["audio"] = True
        for profile in devices:
            add_device(gpu, model, profile)
        gpus.append(gpu)
    return {
        "source": source, "machine": machine.name, "driver_version": machine.driver_version,
        "cuda_version": machine.cuda_version, "gpus": gpus, "faults": [], "xids": [], "next_seq": 1,
        "pci": {"nvswitches": list(machine.nvswitches), "mellanox_nics": list(machine.mellanox_nics)},
        "product_name": machine.product_name,
        "kernel": initial_kernel(machine.driver_version, bool(machine.mellanox_nics), machine.nouveau),
    }


def found_in(root: Root) -> Optional[str]:
    """The --simulate spec of the simulated machine that lives under a sandbox root (what `--simulate`
    made there), or None: never for the running system's own root, whose hardware is real."""
    if root.is_running_system or os.path.realpath(root.path) == "/":
        return None
    try:
        source = json.loads(root(f"{STATE_DIR}/machine.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) and source else None


class MachineState:
    """The persisted state of one simulated machine under a root."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self.dir = root(STATE_DIR)
        self.path = self.dir / "machine.json"
        self.kernel_dir = self.dir / "kernel"  # proc/, sys/ and dev/ of the simulated kernel
        self._cache: Optional[dict[str, Any]] = None
        self._cache_key: Optional[tuple[int, int, int]] = None
        self._path = str(self.path)  # os.stat is faster on a str than on a Path
        self._held = threading.local()  # a thread's reading while it holds one (holding())
        self.writes_path = self.dir / "machine.writes"  # changes with every write, as `path` does
        self._writes: Optional[mmap.mmap] = None  # the write counter, mapped (None: not there yet)
        self._cache_writes: Optional[int] = None  # its value when _cache was read

    def exists(self) -> bool:
        return self.path.exists()

    def ensure(self, spec: str) -> None:
        """Create the machine for `spec` (a built-in name or a YAML file) unless it already runs here."""
        source = spec if spec in BUILT_IN else str(Path(spec).resolve())
        with self._locked():
            if self.path.exists():
                state = json.loads(self.path.read_text())
                if state.get("source") == source:
                    # A writer killed between rendering the kernel's files and committing the state left files
                    # the state does not hold (its mark says so): the kernel's files follow its state, again.
                    if self._rendering.exists():
                        render(self.kernel_dir, state)
                        self._rendering.unlink()
                    return
            shutil.rmtree(self.kernel_dir, ignore_errors=True)  # a new machine boots a fresh kernel
            mig: dict[int, MigSpec] = {}
            if spec in BUILT_IN:
                machine = BUILT_IN[spec]
            elif Path(spec).is_file():
                machine, mig = load_machine_file(Path(spec))
            elif Path(spec).is_dir():
                self._replay(source, Path(spec))
                return
            else:
                raise AgentError(
                    f"--simulate {spec}: neither a built-in profile ({', '.join(BUILT_IN)}), a machine file, "
                    "nor a capture directory"
                )
            self._write(new_state(source, machine, mig))
            if machine.driver_version:  # its modules beside the simulated kernel's files (/lib/modules is its)
                install_driver_modules(self.kernel_dir, RELEASE, machine.driver_version)
            if machine.driver_version and str(self.root.path) != "/":
                # The driver's userspace (libraries, nvidia-smi, firmware, ld.so cache) on a sandbox
                # root; on / the OS's files are real and stay as they are.
                install_driver_userspace(self.root.path, machine.driver_version)
                install_unit(self.root, "nvidia-persistenced.service", "/usr/bin/nvidia-persistenced")
                if machine.nvswitches:
                    install_unit(self.root, "nvidia-fabricmanager.service", "/usr/bin/nv-fabricmanager")

    def install_driver(self, version: str) -> bool:
        """Another driver version installed as a package upgrade does it: the userspace (NVML) and the
        modules on disk change, the loaded module stays, so NVML answers LIB_RM_VERSION_MISMATCH. Over the
        real root the simulated NVML and the simulated kernel's modules change, never the host's files:
        returns whether the userspace's placeholder files were written (a sandbox root)."""
        with self.edit() as state:
            if state.get("capture"):
                raise AgentError("sim install-driver: a captured node's driver is what was captured")
            state["driver_version"] = version
            state["kernel"]["installed"].update({name: version for name in NVIDIA_MODULES})
            release = state["kernel"]["release"]
        install_driver_modules(self.kernel_dir, release, version)
        if self.root.is_running_system or os.path.realpath(self.root.path) == "/":
            return False
        install_driver_userspace(self.root.path, version)
        return True

    def break_kernel(self, how: str) -> None:
        """`sim fail modprobe --error nouveau|version-mismatch|display`, with the files on disk to match: after
        version-mismatch the nvidia module on disk is the older one too (the new driver's module was never
        built for this kernel), so what modprobe would load is what is loaded."""
        with self.edit() as state:
            break_kernel(state, how)
            release = state["kernel"]["release"]
            files = not state.get("capture") and (self.kernel_dir / f"lib/modules/{release}/modules.dep").exists()
        if how == "version-mismatch" and files:
            install_driver_modules(self.kernel_dir, release, OLD_VERSION)

    def _replay(self, source: str, directory: Path) -> None:
        """A captured node (`gpu-agent capture DIR`) as this machine."""
        from gpu_agent.sim.replay import Capture, capture_state, install_captured_host

        capture = Capture.load(directory)
        self._write(capture_state(source, capture))
        install_captured_host(self.root, self.kernel_dir, capture)

    def read(self) -> dict[str, Any]:
        """The current state; cheap when nothing changed (a look at the mapped write counter, or one
        stat). While this thread holds a reading (hold()), that one."""
        held = getattr(self._held, "state", None)
        if held is not None:
            return held
        writes = self._writes
        if writes is not None and self._cache is not None and _WRITES.unpack_from(writes)[0] == self._cache_writes:
            return self._cache
        count = self._count_of_writes()
        key = self.stamp()
        if key is None:
            raise AgentError(
                f"no simulated machine under {self.root.path}: start the agent with --simulate PROFILE"
            )
        if self._cache is None or key != self._cache_key:
            self._cache = json.loads(self.path.read_text())
            self._cache_key = key
        self._cache_writes = count
        return self._cache

    def _count_of_writes(self) -> Optional[int]:
        """The write counter, mapped on first use; None where there is none yet (a state written before
        it existed: its next write makes one)."""
        if self._writes is None:
            try:
                with open(self.writes_path, "rb") as counter:
                    self._writes = mmap.mmap(counter.fileno(), _WRITES.size, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # missing, or shorter than a counter
                return None
        return int(_WRITES.unpack_from(self._writes)[0])

    def hold(self, state: dict[str, Any]) -> None:
        """This thread's reads see `state` (a reading) until it writes or release(): one simulated NVML
        call sees one state, and checks the file once instead of at every read."""
        self._held.state = state

    def release(self) -> None:
        self._held.state = None

    @contextlib.contextmanager
    def edit(self) -> Iterator[dict[str, Any]]:
        """Read, let the caller change, and write back, holding the lock throughout."""
        with self._locked():
            if not self.path.exists():
                self.read()  # says that no simulated machine lives here
            state = json.loads(self.path.read_text())
            yield state
            self._write(state)

    @property
    def _rendering(self) -> Path:
        """Made before the kernel's files are rendered and removed once the state they follow is committed."""
        return self.path.with_name(self.path.name + ".rendering")

    def _write(self, state: dict[str, Any]) -> None:
        self._rendering.touch()
        render(self.kernel_dir, state)
        # Counted before and after: a reader that looked between the count and the rename read the old
        # state under the first count, and the second makes it look again.
        self._count_write()
        # One line: json's C encoder writes it (indent= takes the Python one, several times slower on
        # every simulated MIG call); `python -m json.tool` shows it indented.
        atomic_write(self.path, json.dumps(state, sort_keys=True) + "\n")
        self._rendering.unlink()
        self._count_write()
        self._cache = None
        self._held.state = None  # what this thread reads next includes its own write

    def _count_write(self) -> None:
        """Add one to the write counter, in place: readers map the file, so it is never replaced (a new
        file would leave their mappings on the old one). Called with the machine's lock held."""
        fd = os.open(self.writes_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            before = os.pread(fd, _WRITES.size, 0)
            count = _WRITES.unpack(before)[0] + 1 if len(before) == _WRITES.size else 1
            os.pwrite(fd, _WRITES.pack(count), 0)
        finally:
            os.close(fd)

    def stamp(self) -> Optional[tuple[int, int, int]]:
        """Identity of the current state file; changes with every write."""
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "machine.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
