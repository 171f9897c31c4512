"""What GPUs there are: their identity, MIG geometry and topology in one reading, and the driver's
own view (version, bus ids, persistence mode), each GPU's compute processes and its compute mode."""
from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple, Optional

from gpu_agent.errors import AgentError
from gpu_agent.host.driver_gpus import DriverGpu, driver_gpus
from gpu_agent.host.paths import Root
from gpu_agent.host.pci import Vgpu, numa_node, pci_class, vgpu
from gpu_agent.nvml.mig import NvmlMig
from gpu_agent.nvml.model import Gpu, GpuLink, Inventory
from gpu_agent.plan import COMPUTE_MODES
from gpu_agent.nvml.session import NvmlSession, describe, short_bus_id, text_of
from gpu_agent.nvml.unreadable import Unread, stand_ins

log = logging.getLogger(__name__)

# nvmlDeviceGetTopologyCommonAncestor's levels in nvidia-smi topo's words.
_PCIE_LEVELS = {0: "BOARD", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


class _GpuIdentity(NamedTuple):
    uuid: str
    pci_bus_id: str
    product: str
    compute_capability: tuple[int, int]
    minor_number: int
    pci_device_id: int
    pci_subsystem_id: int
    numa_node: Optional[int]
    pci_class: Optional[int]
    vgpu: Optional[Vgpu]
    mig_mode: Optional[tuple[int, int]]  # as it was read with the rest


class DriverView(NamedTuple):
    version: str
    bus_ids: list[str]  # of the GPUs that answer
    persistence: Optional[list[bool]]  # by GPU index, when asked for
    lost: tuple[tuple[int, str], ...] = ()  # (index, NVML's error) of each GPU NVML answers no bus id for
    # (GPU_IS_LOST: off the bus): gpu-health's to report


class NvmlInventory:
    def __init__(self, session: NvmlSession, mig: NvmlMig, root: Optional[Root] = None) -> None:
        """`root`: where the GPUs' NUMA nodes, PCI classes and config space are read (sysfs); without it they
        are unknown."""
        self.session = session
        self.mig = mig
        self.root = root
        # The inventory read last in this reconcile pass with the session's generation it was read in,
        # kept for the next stage that wants one (discovery after the mig stage) while nothing changed
        # the GPUs since.
        self._reading: Optional[tuple[int, Inventory]] = None
        self._reading_lock = threading.Lock()
        # By GPU index: what cannot change while NVML is initialised (the board, its bus id and minor
        # number), read once rather than at every pass; a MIG change or reset by this agent reads it
        # again. Kept for the session's `changes` count it was read under.
        self._identities: dict[int, _GpuIdentity] = {}
        self._identities_of = 0
        self._last_read: dict[int, Gpu] = {}  # by index: each GPU as last read whole (what is known of it when lost)
        self._links: dict[tuple[str, ...], tuple[GpuLink, ...]] = {}  # by the GPUs' bus ids: hardware, read once
        self._links_complete = True  # no unexpected NVML error while reading them (else read again next time)

    def read(self) -> Inventory:
        """Every GPU and its MIG geometry, read now."""
        self.session.init()
        generation = self.session.generation
        # Its queries (hundreds with MIG) go to an NVML worker as one batch, under one timeout that names
        # the call that hung: a thread hop per GPU or per call cost more than the queries.
        inventory = self.session.batch("nvmlDevice*(inventory)", self._inventory)
        with self._reading_lock:
            if generation and generation == self.session.generation:
                self._reading = (generation, inventory)
        return inventory

    def pass_reading(self) -> Inventory:
        """The inventory read earlier in this reconcile pass (the mig stage reads it just before discovery)
        when nothing the agent did has changed the GPUs since; else one read now. With MIG, a reading is
        hundreds of NVML calls."""
        reading = self._reading
        if reading is not None and reading[0] == self.session.generation:
            return reading[1]
        return self.read()

    def begin_pass(self) -> None:
        """A reconcile pass starts: what was read before it is not reused (another tool may have changed
        the GPUs between passes)."""
        self.session.forget_readings()

    def forget(self) -> None:
        """The GPUs changed (a GPU reset): the next pass_reading() reads them again."""
        self.session.forget_readings()

    def _inventory(self) -> Inventory:
        call = self.session.call
        driver = call("nvmlSystemGetDriverVersion")
        cuda = call("nvmlSystemGetCudaDriverVersion")
        read: dict[int, Gpu] = {}
        unread: list[Unread] = []
        for index in range(self.session.count()):
            try:
                read[index] = self._gpu(index)
            except self.session.lib.NVMLError as exc:  # that GPU's fact: the others are read on
                unread.append(self._unread(index, exc))
        self._last_read.update(read)
        stand_in, unidentified = stand_ins(unread, read, self._last_read, self._driver_gpus(),
                                           self.root) if unread else ([], [])
        gpus = tuple(sorted((*read.values(), *stand_in), key=lambda gpu: gpu.index))
        return Inventory(driver_version=driver, cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}", gpus=gpus,
                         links=self.links(gpus), unidentified=tuple(unidentified))

    def _unread(self, index: int, exc: Exception) -> Unread:
        """A GPU NVML could not read whole: why, and what NVML may still answer of its identity."""
        log.debug("GPU %d: %s", index, describe(exc))
        try:
            handle = self.session.handle(index)
        except self.session.lib.NVMLError:
            return Unread(index, describe(exc))
        uuid, pci, name, minor = (self._answer(call, handle) for call in (
            "nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetName", "nvmlDeviceGetMinorNumber"))
        return Unread(index, describe(exc), uuid=uuid if isinstance(uuid, str) and uuid else None,
                      bus_id=short_bus_id(text_of(pci.busId)) if pci is not None else None,
                      product=name if isinstance(name, str) and name else None,
                      minor=minor if isinstance(minor, int) else None)

    def _answer(self, name: str, *args: Any) -> Any:
        """NVML's answer, or None where it has none."""
        try:
            return self.session.call(name, *args)
        except self.session.lib.NVMLError:
            return None

    def _driver_gpus(self) -> list[DriverGpu]:
        """The driver's own list of its GPUs (under the root), or none where it cannot be read."""
        if self.root is None:
            return []
        try:
            return driver_gpus(self.root)
        except AgentError as exc:
            log.warning("what the driver knows of the GPUs NVML cannot read is unknown: %s", exc)
            return []

    def _gpu(self, index: int) -> Gpu:
        handle = self.session.handle(index)
        mode = self.mig.mode(handle)
        if self._identities_of != self.session.changes:
            self._identities, self._identities_of = {}, self.session.changes
        identity = self._identities.get(index)
        if identity is None or identity.mig_mode != mode:  # a MIG mode change may rebind the GPU (a new minor)
            identity = self._identities[index] = self._identity(handle, mode)
        memory = self.session.call("nvmlDeviceGetMemoryInfo", handle)
        return Gpu(
            index=index,
            uuid=identity.uuid,
            pci_bus_id=identity.pci_bus_id,
            product=identity.product,
            memory_mib=memory.total // (1024 * 1024),
            compute_capability=identity.compute_capability,
            minor_number=identity.minor_number,
            mig=self.mig.read(handle, identity.uuid, mode),
            pci_device_id=identity.pci_device_id,
            pci_subsystem_id=identity.pci_subsystem_id,
            numa_node=identity.numa_node,
            pci_class=identity.pci_class,
            vgpu=identity.vgpu,
        )

    def _identity(self, handle: Any, mig_mode: Optional[tuple[int, int]]) -> _GpuIdentity:
        call = self.session.call
        uuid = call("nvmlDeviceGetUUID", handle)
        pci = call("nvmlDeviceGetPciInfo", handle)
        major, minor = call("nvmlDeviceGetCudaComputeCapability", handle)
        bus_id = short_bus_id(pci.busId)
        return _GpuIdentity(
            uuid=uuid, pci_bus_id=bus_id, product=call("nvmlDeviceGetName", handle),
            compute_capability=(major, minor), minor_number=call("nvmlDeviceGetMinorNumber", handle),
            pci_device_id=pci.pciDeviceId, pci_subsystem_id=pci.pciSubSystemId,
            numa_node=numa_node(self.root, bus_id) if self.root else None,
            pci_class=pci_class(self.root, bus_id) if self.root else None,
            vgpu=vgpu(self.root, bus_id) if self.root else None, mig_mode=mig_mode,
        )

    # --- topology --------------------------------------------------------------------------------

    def links(self, gpus: tuple[Gpu, ...]) -> tuple[GpuLink, ...]:
        """How each pair of GPUs is connected: NVLinks (direct, or through NVSwitch where NVML says the
        pair can talk over NVLink) and their nearest common PCIe ancestor. Read once per set of GPUs,
        as it changes only with the hardware; what NVML does not support stays unknown, and so do the links
        of a GPU NVML cannot read (those read before it was lost are kept)."""
        key = tuple(gpu.pci_bus_id for gpu in gpus)
        if key in self._links:
            return self._links[key]
        readable = tuple(gpu for gpu in gpus if not gpu.unreadable)
        partial = (*key, "readable:", *(gpu.pci_bus_id for gpu in readable))  # the links among those read
        if len(readable) < len(gpus) and partial in self._links:
            return self._links[partial]
        self._links_complete = True
        handles = [self.session.handle(gpu.index) for gpu in readable]
        reach = [self._nvlink_reach(handle) for handle in handles]
        links = []
        for i, a in enumerate(readable):
            for j in range(i + 1, len(readable)):
                b = readable[j]
                nvlinks = reach[i][0].get(b.pci_bus_id, 0)
                if reach[i][1] and reach[j][1] and self._p2p_over_nvlink(handles[i], handles[j]):
                    nvlinks += min(reach[i][1], reach[j][1])
                level = self._optional("nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
                links.append(GpuLink(a.index, b.index, nvlinks, _PCIE_LEVELS.get(level, "")))
        if self._links_complete:
            self._links[key if len(readable) == len(gpus) else partial] = tuple(links)
        return tuple(links)

    def _nvlink_reach(self, handle: Any) -> tuple[dict[str, int], int]:
        """A GPU's active NVLinks: (links by the peer GPU's bus id, links into NVSwitches)."""
        lib = self.session.lib
        direct: dict[str, int] = {}
        switched = 0
        for link in range(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active = self.session.call("nvmlDeviceGetNvLinkState", handle, link)
            except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound, lib.NVMLError_InvalidArgument):
                break  # no NVLink, or past this GPU's last link (they are numbered from 0)
            except lib.NVMLError:
                self._links_complete = False
                break
            if active != lib.NVML_FEATURE_ENABLED:
                continue
            kind = self._optional("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
            if kind == getattr(lib, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2):
                switched += 1
            elif kind == getattr(lib, "NVML_NVLINK_DEVICE_TYPE_GPU", 0):
                remote = self._optional("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
                if remote is not None:
                    peer = short_bus_id(text_of(remote.busId))
                    direct[peer] = direct.get(peer, 0) + 1
        return direct, switched

    def _p2p_over_nvlink(self, a: Any, b: Any) -> bool:
        """Whether NVML says two GPUs can talk over NVLink (through NVSwitch this needs the fabric up);
        a driver that cannot say is taken at its links' word."""
        lib = self.session.lib
        status = self._optional("nvmlDeviceGetP2PStatus", a, b, getattr(lib, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
        return status is None or status == getattr(lib, "NVML_P2P_STATUS_OK", 0)

    def _optional(self, name: str, *args: Any) -> Any:
        """A topology answer, or None where NVML does not have one (an unexpected error also leaves the
        topology unread for next time)."""
        lib = self.session.lib
        try:
            return self.session.call(name, *args)
        except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound, lib.NVMLError_InvalidArgument):
            return None
        except lib.NVMLError as exc:
            log.debug("%s", describe(exc))
            self._links_complete = False
            return None

    # --- the driver's view -----------------------------------------------------------------------

    def driver_version(self) -> str:
        self.session.init()
        return self.session.call("nvmlSystemGetDriverVersion")

    def bus_ids(self) -> list[str]:
        """PCI bus id of every GPU NVML sees: a few calls (one batch), where read() makes dozens."""
        return self.session.batch("nvmlDeviceGetPciInfo(every GPU)", self._bus_ids)

    def _bus_ids(self) -> list[str]:
        handles = [self.session.handle(i) for i in range(self.session.count())]
        return [short_bus_id(self.session.call("nvmlDeviceGetPciInfo", handle).busId) for handle in handles]

    def bus_id(self, index: int) -> Optional[str]:
        """The PCI bus id NVML answers for GPU `index` now; None where it answers none (a GPU off the bus)."""
        return self.session.batch(f"nvmlDeviceGetPciInfo(GPU {index})", self._bus_id, index)

    def _bus_id(self, index: int) -> Optional[str]:
        try:
            return short_bus_id(self.session.call("nvmlDeviceGetPciInfo", self.session.handle(index)).busId)
        except self.session.lib.NVMLError:
            return None

    def driver_view(self, persistence: bool) -> DriverView:
        """What the driver stage asks NVML, in one batch: the driver's version, every GPU's bus id, and
        (when `persistence`) their persistence modes."""
        return self.session.batch("nvmlSystemGetDriverVersion, nvmlDeviceGetPciInfo(every GPU)", self._driver_view,
                                  persistence)

    def _driver_view(self, persistence: bool) -> DriverView:
        version = self.session.call("nvmlSystemGetDriverVersion")
        bus_ids, lost, errors = [], {}, []
        for index in range(self.session.count()):
            try:  # a GPU NVML cannot answer for is that GPU's fact (gpu-health's), not the driver's...
                bus_ids.append(short_bus_id(self.session.call("nvmlDeviceGetPciInfo",
                                                              self.session.handle(index)).busId))
            except self.session.lib.NVMLError as exc:
                lost[index] = describe(exc)
                errors.append(exc)
        lib = self.session.lib
        if errors and not bus_ids and not any(getattr(e, "value", None) == lib.NVML_ERROR_GPU_IS_LOST for e in errors):
            raise errors[0]  # ...but NVML failing alike for every GPU, none of them lost, is the driver's
        if persistence and not lost:
            return DriverView(version, bus_ids, self._persistence_modes())
        return DriverView(version, bus_ids, None, tuple(lost.items()))

    def persistence_modes(self) -> list[bool]:
        """Persistence mode of each GPU, by index (one batch)."""
        return self.session.batch("nvmlDeviceGetPersistenceMode(every GPU)", self._persistence_modes)

    def _persistence_modes(self) -> list[bool]:
        enabled = self.session.lib.NVML_FEATURE_ENABLED
        handles = [self.session.handle(i) for i in range(self.session.count())]
        return [self.session.call("nvmlDeviceGetPersistenceMode", h) == enabled for h in handles]

    def enable_persistence(self, index: int) -> None:
        self.session.init()
        handle = self.session.handle(index)
        self.session.call("nvmlDeviceSetPersistenceMode", handle, self.session.lib.NVML_FEATURE_ENABLED)

    def compute_mode(self, uuid: str) -> str:
        """The GPU's compute mode, named as nvidia-smi names it (DEFAULT, EXCLUSIVE_PROCESS, ...); an
        AgentError names the GPU and NVML's error."""
        value = self._on_gpu(uuid, "nvmlDeviceGetComputeMode")
        if not (isinstance(value, int) and 0 <= value < len(COMPUTE_MODES)):
            raise AgentError(f"GPU {uuid}: nvmlDeviceGetComputeMode: {value!r} is not a compute mode NVML defines")
        return COMPUTE_MODES[value]

    def set_compute_mode(self, uuid: str, mode: str) -> None:
        self._on_gpu(uuid, "nvmlDeviceSetComputeMode", COMPUTE_MODES.index(mode))

    def _on_gpu(self, uuid: str, call: str, *args: Any) -> Any:
        self.session.init()
        try:
            return self.session.call(call, self.session.call("nvmlDeviceGetHandleByUUID", uuid), *args)
        except self.session.lib.NVMLError as exc:
            raise AgentError(f"GPU {uuid}: {describe(exc)}") from None

    def process_details(self, index: int, utilization: bool) -> list[tuple[int, float, Optional[int], Optional[int]]]:
        """(pid, MiB used, GPU instance id on a MIG GPU or None, SM utilisation % or None) of each compute
        process; the utilisation (NVML's last sample of each process) only when asked, and only where NVML
        keeps it (not in MIG mode)."""
        self.session.init()
        handle = self.session.handle(index)
        lib = self.session.lib
        found = self.session.call("nvmlDeviceGetComputeRunningProcesses", handle)
        sm: dict[int, int] = {}
        if utilization:
            try:
                for sample in self.session.call("nvmlDeviceGetProcessUtilization", handle, 0):
                    sm[sample.pid] = sample.smUtil  # the last sample of each process wins, as dcgm-exporter reads them
            except (lib.NVMLError_NotFound, lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound):
                pass  # no sample since the driver started keeping them, or none in this mode
        no_instance = 0xFFFFFFFF
        return [(p.pid, (p.usedGpuMemory or 0) / (1024 * 1024),
                 None if getattr(p, "gpuInstanceId", no_instance) == no_instance else p.gpuInstanceId, sm.get(p.pid))
                for p in found]

    def p2p_status(self, gpus: tuple[Gpu, ...]) -> dict[str, tuple[tuple[int, int], ...]]:
        """By GPU UUID: NVML's NVLink P2P status towards every other GPU (peer index, nvmlGpuP2PStatus_t); a
        pair NVML cannot say for is NOT_SUPPORTED (5), as DCGM reports it."""
        self.session.init()
        lib = self.session.lib
        readable = [gpu for gpu in gpus if not gpu.unreadable]
        handles = {gpu.index: self.session.handle(gpu.index) for gpu in readable}
        found: dict[str, tuple[tuple[int, int], ...]] = {}
        for gpu in readable:
            peers = []
            for peer in readable:
                if peer.index == gpu.index:
                    continue
                try:
                    status = int(self.session.call("nvmlDeviceGetP2PStatus", handles[gpu.index], handles[peer.index],
                                                   getattr(lib, "NVML_P2P_CAPS_INDEX_NVLINK", 2)))
                except (lib.NVMLError_NotSupported, lib.NVMLError_FunctionNotFound, lib.NVMLError_InvalidArgument):
                    status = 5
                peers.append((peer.index, status))
            found[gpu.uuid] = tuple(peers)
        return found

    def processes(self, index: int) -> list[tuple[int, float]]:
        """(pid, MiB of GPU memory used) of each compute process on the GPU."""
        self.session.init()
        handle = self.session.handle(index)
        found = self.session.call("nvmlDeviceGetComputeRunningProcesses", handle)
        return [(p.pid, (p.usedGpuMemory or 0) / (1024 * 1024)) for p in found]
