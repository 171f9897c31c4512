"""The device plugin as a long-lived service of the daemon, fed from the state model.

Each sync computes what to advertise (devices.py) and makes the served set match it: a new resource
gets a server and a registration, a vanished one is stopped (its socket removed, which is how the
kubelet learns), a changed one streams its new list. It also watches the kubelet: a new kubelet.sock
(the kubelet restarted and deleted our sockets) brings new sockets and a new registration. The daemon
wakes it on every publish of the model (health, MIG, inventory), inotify on the kubelet's directory when
kubelet.sock or one of our sockets comes or goes; it looks again every second only while something it
wants is not done yet (a registration or a socket that failed), so an idle node's plugin sleeps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import time
from typing import Any, Optional

from gpu_agent.config.plugin import PluginConfig, device_plugin_dir, mig_strategy, plugin_wanted, serves_dra
from gpu_agent.host import sandbox
from gpu_agent.host.watch import FileChanges
from gpu_agent.host.paths import Root
from gpu_agent.plugin.gate import PluginGate
from gpu_agent.nvml.model import Inventory
from gpu_agent.nvml.session import short_bus_id
from gpu_agent.plugin.devices import Advertised, PluginDevice, Resource, advertised
from gpu_agent.plugin.shared_policy import preferred_allocation
from gpu_agent.plugin.server import PluginEndpoint
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

POLL_S = 1.0  # the retry of what failed; and the look at the directory where inotify cannot be had
KUBELET_SOCKET = "kubelet.sock"


class DevicePluginManager:
    def __init__(self, root: Root, state: AgentState, gate: Optional[PluginGate] = None) -> None:
        self.root = root
        self.gate = gate
        self.state = state
        self.host_directory = device_plugin_dir(root)
        self.directory = root(self.host_directory)
        self.endpoints: dict[str, PluginEndpoint] = {}
        self.registered: dict[str, float] = {}  # resource: when the kubelet accepted it
        self.errors: dict[str, str] = {}  # resource: the last registration or serving error
        self._ignored: dict[str, str] = {}  # the timeSlicing resources last logged as matching nothing
        self._retry: Optional[asyncio.TimerHandle] = None  # the next sync after a failure
        self._registrations: dict[str, asyncio.Task[None]] = {}  # resource: its registration under way
        self._kubelet: Optional[tuple[int, int]] = None  # kubelet.sock (inode, ctime) at our registrations
        self._wake: Optional[asyncio.Event] = None  # made in run(): asyncio objects belong to the loop (3.9)
        self._last: Optional[Advertised] = None
        self._closures = 0  # the gate's closures this plugin has unregistered for

    @property
    def settings(self) -> PluginConfig:
        return self.state.config.config.plugin

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        self._wake = wake = asyncio.Event()
        changes = FileChanges("device plugin", POLL_S)
        if self.gate is not None:
            self.gate.serving(True)
        try:
            while True:
                wake.clear()
                try:
                    await self.sync()
                except Exception:  # a bug: log it, keep serving what is served
                    log.exception("device plugin sync failed; this is a gpu-agent bug")
                changes.watch_for([self.directory / KUBELET_SOCKET, *(e.path for e in self.endpoints.values())])
                await self._sleep(wake, changes)
        finally:
            changes.close()
            if self._retry is not None:
                self._retry.cancel()
                self._retry = None
            await self.stop_all()
            if self.gate is not None:
                self.gate.serving(False)

    async def _sleep(self, wake: asyncio.Event, changes: FileChanges) -> None:
        """Until the daemon or a retry wakes it, or the kubelet's directory changes."""
        waiters = [asyncio.ensure_future(wake.wait()), asyncio.ensure_future(changes.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def stop_all(self) -> None:
        for name in list(self.endpoints):
            await self._remove(name)

    # --- one sync ----------------------------------------------------------------------------------

    async def sync(self) -> None:
        withdrawn = self.gate.withdrawn if self.gate is not None else frozenset()
        await self._sync(withdrawn)
        if self.gate is not None:  # served without them, or nothing served at all
            self.gate.applied(withdrawn)

    async def _sync(self, withdrawn: frozenset[str]) -> None:
        held = self.gate.closed if self.gate is not None else None
        # Closed since the last sync, maybe open again already (a reload within one pass): the sockets
        # still go and come back, so the kubelet sees the new driver's devices registered anew.
        reloaded = self.gate is not None and self.gate.closures != self._closures
        if held is not None or reloaded:
            self._closures = self.gate.closures if self.gate is not None else 0
            if self.endpoints:
                log.info("device plugin: unregistering: %s", held or "the driver was reloaded")
            await self.stop_all()
            self.registered.clear()
        if held is not None:
            self._publish(None, f"off: {held}")
            return
        serving = self.state.serving()
        if serves_dra(serving):  # one API per node: no GPU is handed out twice
            await self.stop_all()
            self._publish(None, f"off: plugin.api is {serving}: this node's GPUs are served through DRA (docs/dra.md)")
            return
        if not plugin_wanted(self.root, self.settings):
            await self.stop_all()
            self._publish(None, "off: plugin.enabled is false" if self.settings.enabled is False else
                          f"off: {self.host_directory} does not exist (no kubelet on this node)")
            return
        if not self.directory.is_dir():
            await self.stop_all()
            missing = "is not a directory" if self.directory.exists() else "does not exist"
            self._publish(None, f"waiting for the kubelet: {self.host_directory} {missing}")
            return
        wanted = self.compute(withdrawn)
        for name in [name for name in self.endpoints if name not in wanted.resources]:
            log.info("device plugin: %s no longer advertised; unregistering", name)
            await self._remove(name)
        kubelet = self._kubelet_stamp()
        kubelet_restarted = kubelet is not None and self._kubelet is not None and kubelet != self._kubelet
        if kubelet_restarted:
            log.info("device plugin: kubelet.sock was recreated (kubelet restarted); registering again")
            self.registered.clear()
        for name, resource in wanted.resources.items():
            endpoint = self.endpoints.get(name)
            try:
                if endpoint is None:
                    endpoint = PluginEndpoint(self.directory, resource, self._service_args())
                    await endpoint.start()
                    self.endpoints[name] = endpoint
                elif endpoint.socket_gone():
                    log.info("device plugin: socket %s was removed; serving it again", endpoint.path)
                    await endpoint.restart()
                    self.registered.pop(name, None)
                await endpoint.feed.update(resource)
            except OSError as exc:
                where = f"{self.host_directory}/{resource.socket_name}"
                if exc.errno == errno.EISDIR:
                    reason = "a directory is where its socket goes; remove it"
                elif exc.errno == errno.EROFS:  # made after the agent started, in its sandbox: it restarts
                    reason = sandbox.current().read_only(self.directory / resource.socket_name)
                else:
                    reason = exc.strerror or str(exc)
                self._fail(name, f"cannot serve {name} on {where}: {reason}")
                continue
            if kubelet is None:
                self.errors[name] = f"waiting for the kubelet: no {self.host_directory}/{KUBELET_SOCKET}"
            elif name not in self.registered and not self._registering(name):
                # In the background: a kubelet that does not answer must not hold up the others' lists.
                self._registrations[name] = asyncio.create_task(self._register(endpoint), name=f"register {name}")
        if kubelet is None:
            self.registered.clear()
        self._kubelet = kubelet
        self._publish(wanted, "")

    def compute(self, withdrawn: frozenset[str] = frozenset()) -> Advertised:
        """What to serve; `withdrawn`: the PCI addresses of GPUs the vfio stage takes from the container path
        now, left out of it before their mode is published."""
        wanted = self._container_path(withdrawn)
        workload = self.state.workload
        if workload is None or not workload.vm_gpus():
            return wanted
        from gpu_agent.plugin.vfio import names, read_pci_ids

        vm = workload.vm_gpus()
        resources = dict(wanted.resources)
        by_name: dict[str, list[Any]] = {}
        named = names((gpu.device_id for gpu in vm), read_pci_ids(self.root))
        for gpu in vm:
            by_name.setdefault(named[gpu.device_id], []).append(gpu)
        for name, gpus in sorted(by_name.items()):
            devices = tuple(PluginDevice(gpu.address, gpu.address, gpu.uuid or gpu.address, gpu.index, gpu.numa_node,
                                         gpu.passed_through, "" if gpu.passed_through else
                                         gpu.reason or f"not bound to vfio-pci yet (driver {gpu.driver})")
                            for gpu in gpus)
            resources[name] = Resource(name, devices, groups=tuple((gpu.address, gpu.group) for gpu in gpus))
        return Advertised(resources, wanted.withheld, wanted.ignored, "")

    def _container_path(self, withdrawn: frozenset[str]) -> Advertised:
        """nvidia.com/gpu and the MIG resources, without the GPUs whose mode is vm-passthrough: a GPU is never
        advertised by both paths (one on its way to vfio-pci, or refused, is neither's to give to a container)."""
        state = self.state
        if state.nvml_error:
            return advertised(None, state.health, mig_strategy(state.config.config), self.settings, state.nvml_error,
                              state.mps_down, state.mps_running)
        inventory, unavailable = self._inventory(), ""
        workload = state.workload
        vm_gpus = workload.vm_gpus() if workload is not None else ()
        if inventory is not None and (vm_gpus or withdrawn):
            vm = {gpu.uuid for gpu in vm_gpus} | {gpu.address for gpu in vm_gpus} | withdrawn
            inventory = dataclasses.replace(inventory, gpus=tuple(
                gpu for gpu in inventory.gpus if gpu.uuid not in vm and short_bus_id(gpu.pci_bus_id) not in vm))
        discovery = state.stages.get("discovery")
        if inventory is None and discovery is not None and discovery.state == "failed":
            unavailable = f"discovery failed: {discovery.message}"
        return advertised(inventory, state.health_of(inventory), mig_strategy(state.config.config), self.settings,
                          unavailable, state.mps_down, state.mps_running)

    def _inventory(self) -> Optional[Inventory]:
        """The GPUs to serve: discovery's (a GPU NVML cannot read among them, Unhealthy by its health, the
        others serving), or, while discovery fails with NVML answering, the GPUs it last found."""
        return self.state.inventory or self.state.last_inventory

    def _service_args(self) -> dict[str, Any]:
        return {"list_strategy": self._strategy, "cdi_spec": self._cdi_spec, "called": self.wake,
                "fail_greater_than_one": lambda: self.settings.sharing.fail_requests_greater_than_one,
                "prefer": lambda resource, available, must, size: preferred_allocation(
                    resource, available, must, size, self.settings.shared_devices_allocation_policy,
                    self._inventory())}

    def _strategy(self) -> str:
        """plugin.device_list_strategy, or what the device-path stage chose for auto ("" before it has)."""
        if self.settings.device_list_strategy != "auto":
            return self.settings.device_list_strategy
        path = self.state.device_path
        return path.strategy if path is not None else ""

    def _cdi_spec(self) -> Optional[frozenset[str]]:
        """The device names of the CDI spec the agent writes (empty until it is written); None when the agent
        writes none (toolkit or toolkit.cdi off): someone else's spec, which the plugin cannot read."""
        toolkit = self.state.config.config.toolkit
        if not (toolkit.enabled and toolkit.cdi.enabled):
            return None
        return self.state.cdi_devices or frozenset()

    async def _register(self, endpoint: PluginEndpoint) -> None:
        try:
            await endpoint.register(self.directory / KUBELET_SOCKET)
        except Exception as exc:  # any failure of the kubelet's side: retried on the next sync
            self._fail(endpoint.name, f"registration with the kubelet failed: {_describe(exc)}; retrying")
            return
        log.info("device plugin: registered %s (%d devices) with the kubelet", endpoint.name,
                 len(endpoint.feed.resource.devices))
        self.registered[endpoint.name] = time.time()
        self.errors.pop(endpoint.name, None)
        self.wake()  # /status shows it

    def _registering(self, name: str) -> bool:
        task = self._registrations.get(name)
        return task is not None and not task.done()

    async def _remove(self, name: str) -> None:
        task = self._registrations.pop(name, None)
        if task is not None:
            task.cancel()
        endpoint = self.endpoints.pop(name)
        self.registered.pop(name, None)
        self.errors.pop(name, None)
        await endpoint.stop()

    def _fail(self, name: str, message: str) -> None:
        if self.errors.get(name) != message:
            log.warning("device plugin: %s", message)
        self.errors[name] = message
        if self._retry is None:  # one retry armed at a time
            self._retry = asyncio.get_running_loop().call_later(POLL_S, self._retry_now)

    def _retry_now(self) -> None:
        self._retry = None
        self.wake()

    def _kubelet_stamp(self) -> Optional[tuple[int, int]]:
        try:
            info = (self.directory / KUBELET_SOCKET).stat()
        except OSError:
            return None
        return info.st_ino, info.st_ctime_ns

    def _publish(self, wanted: Optional[Advertised], off: str) -> None:
        """The /status `plugin` section."""
        resources: list[dict[str, Any]] = []
        for name in sorted(set(wanted.resources if wanted else ()) - set(self.endpoints)):
            resources.append({"name": name, "socket": None, "devices": 0, "healthy": 0, "registered": False,
                              "error": self.errors.get(name)})  # wanted, not served
        for name, endpoint in sorted(self.endpoints.items()):
            devices = endpoint.feed.resource.devices
            resources.append({
                "name": name, "socket": f"{self.host_directory}/{endpoint.path.name}",
                "devices": len(devices), "healthy": sum(1 for device in devices if device.healthy),
                "replicas": endpoint.feed.resource.replicas,
                "registered": name in self.registered, "registered_at": self.registered.get(name),
                "refused": dict(endpoint.service.refused),  # by reason, as of this publish
                "calls": dict(endpoint.service.calls),  # by method, as of this publish
                "error": self.errors.get(name)})
        section: dict[str, Any] = {"enabled": plugin_wanted(self.root, self.settings), "resources": resources}
        if wanted is None:
            section["reason"] = off
        else:
            section["mig_strategy"] = mig_strategy(self.state.config.config)
            section["device_list_strategy"] = self._strategy() or "auto (not chosen yet)"
            section["withheld"] = dict(wanted.withheld)
            section["ignored"] = dict(wanted.ignored)
            if wanted.ignored != self._ignored:
                for name, why in wanted.ignored.items():
                    log.warning("device plugin: timeSlicing resource %s %s", name, why)
                self._ignored = dict(wanted.ignored)
            section["reason"] = wanted.reason or None
        self.state.publish_plugin(section)  # when changed, the endpoints render /status again


def _describe(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {message}" if not isinstance(exc, OSError) else str(exc)
