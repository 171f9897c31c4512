"""The DRA kubelet plugin for driver gpu.nvidia.com, beside the device plugin, fed from the same state model.

Two gRPC servers (grpclib, the device plugin's limits: plugin/server.py): the plugin watcher's Registration
on <kubelet>/plugins_registry/gpu.nvidia.com-reg.sock, which the kubelet finds by inotify and asks GetInfo,
and the DRAPlugin service (v1 and v1beta1) on <kubelet>/plugins/gpu.nvidia.com/dra.sock. Each sync computes
the node's devices (devices.py) and, when they changed or the kubelet registered the plugin again (a kubelet
that starts deletes its node's slices), publishes the pool (slices.py) on a worker thread; a failure is
retried after 10 s, doubling to 5 minutes.

NodePrepareResources reads each claim from the API (a node may get the claims of its pods), answers every
claim of the request (a claim past MAX_CLAIMS, or past the kubelet's deadline, with an error; it asks again),
and keeps what it gave in the checkpoint (claims.py): a claim prepared before is answered from there, and
NodeUnprepareResources forgets it, a claim it does not know included (idempotent).
"""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Optional

from grpclib.server import Server, Stream

from gpu_agent.config.plugin import kubelet_dir
from gpu_agent.dra import api
from gpu_agent.dra import claim_cdi, timeslice
from gpu_agent.dra.claims import (CHECKPOINT, Checkpoint, ClaimError, PreparedClaim, claim_daemons, devices_for,
                                    mps_resources, timeslice_levels)
from gpu_agent.dra.params import ConfigError
from gpu_agent.dra.devices import DRIVER, DraDevice, published
from gpu_agent.dra.slices import SlicePublisher
from gpu_agent.dra.timeslice import TimeSlices
from gpu_agent.errors import AgentError
from gpu_agent.host import sandbox
from gpu_agent.host.files import stamp_of
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root, followed
from gpu_agent.host.sockets import socket_address
from gpu_agent.mps.control import ComputeModes
from gpu_agent.nvml.model import Inventory
from gpu_agent.plugin.server import CappedServer, request_of
from gpu_agent.proto3 import Codec
from gpu_agent.state import AgentState

log = logging.getLogger(__name__)

MAX_CLAIMS = 256  # prepared in one call; the kubelet sends a pod's claims, a handful
PREPARE_BUDGET_S = 40.0  # of the kubelet's 45 s per call: claims left after it are answered "asked again"
RETRY_FIRST_S, RETRY_MAX_S = 10.0, 300.0
MPS_POLL_S = 0.1  # how often a prepare waiting for a claim's MPS control daemon looks again


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class DraManager:
    def __init__(self, root: Root, state: AgentState, client: Any, node: str,
                 mps_wanted: Callable[[], Any] = lambda: None,
                 gpus: Optional[tuple[ComputeModes, TimeSlices]] = None) -> None:
        """`client`: a kube.client.KubeClient with the node's credentials; `node`: the Node's name (the pool's);
        `mps_wanted`: called (from any thread) when the claims ask for other MPS control daemons, so that the
        daemon's MPS watch starts or looks again; `gpus`: what sets a GPU's compute mode and time-slice, for
        claims shared by TimeSlicing (None: such a claim is not prepared)."""
        self.root = root
        self.state = state
        self.client = client
        self.node = node
        kubelet = kubelet_dir(root)
        self.host_registration = f"{kubelet}/plugins_registry/{DRIVER}-reg.sock"
        self.host_endpoint = f"{kubelet}/plugins/{DRIVER}/dra.sock"
        self.checkpoint = Checkpoint(root(CHECKPOINT))
        self.ledger = Ledger(root)
        self.mps_wanted = mps_wanted
        self.gpus = gpus
        self.boot = timeslice.boot_id(root)
        self.publisher = SlicePublisher(client, node)
        self.refused: Counter[str] = Counter()
        self.devices: tuple[DraDevice, ...] = ()
        self.registered: Optional[float] = None  # when the kubelet last said the registration succeeded
        self.registration_error: Optional[str] = None
        self.publish_error: Optional[str] = None
        self.serve_error: Optional[str] = None  # why the sockets cannot be served (retried every 10 s)
        self._published: Optional[tuple[DraDevice, ...]] = None  # what the API holds, as last written or found
        self._retry_s = RETRY_FIRST_S
        self._retry_at = 0.0
        self._servers: list[Server] = []
        self._wake: Optional[asyncio.Event] = None
        self._publishing: Optional[asyncio.Task[None]] = None
        self._claims = threading.Lock()  # prepare and unprepare run on worker threads: one at a time
        self._node_spec_read: Optional[tuple[Any, claim_cdi.NodeSpec]] = None  # (path and stamp, what it held)

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def run(self) -> None:
        self._wake = wake = asyncio.Event()
        self.checkpoint.load()
        self._publish_claim_mps()
        await asyncio.to_thread(self._put_back_timeslices)  # of claims unprepared while the agent was down
        try:
            while True:
                wake.clear()
                if not self._servers:
                    await self._serve()
                self.sync()
                timeout = RETRY_FIRST_S if self.serve_error else \
                    max(self._retry_at - time.monotonic(), 0.1) if self.publish_error else None
                try:
                    await asyncio.wait_for(wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.stop()

    async def _serve(self) -> None:
        try:
            await self._start_servers()
        except OSError as exc:
            failed = Path(exc.filename) if isinstance(exc.filename, str) else self.root(self.host_endpoint)
            reason = sandbox.current().read_only(failed) if exc.errno == errno.EROFS else exc.strerror or str(exc)
            if self.serve_error is None:
                log.warning("DRA: cannot serve the kubelet plugin sockets: %s; retrying", reason)
            self.serve_error = reason
            await self.stop()
            return
        self.serve_error = None

    async def _start_servers(self) -> None:
        for host_path, service in ((self.host_endpoint, _DraService(self)), (self.host_registration,
                                                                           _Registration(self))):
            path = self.root(host_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.unlink(missing_ok=True)  # ours from an earlier run: the name is ours
            server = CappedServer([service], codec=Codec(), refused=self.refused)
            address, fd = socket_address(path)
            try:
                await server.start(path=address)
            finally:
                if fd is not None:
                    os.close(fd)
            self._servers.append(server)
        log.info("DRA: serving %s on %s, registering through %s", DRIVER, self.host_endpoint, self.host_registration)

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
            try:
                await asyncio.wait_for(server.wait_closed(), timeout=1.0)
            except asyncio.TimeoutError:
                log.warning("DRA: a kubelet connection did not close within 1 s")
        self._servers.clear()
        for host_path in (self.host_registration, self.host_endpoint):
            try:
                self.root(host_path).unlink(missing_ok=True)  # the kubelet deregisters the plugin, drops its slices
            except OSError as exc:
                log.warning("DRA: cannot remove %s: %s", host_path, exc.strerror or exc)

    def sync_devices(self) -> Optional[Inventory]:
        """The pool's devices from the inventory as read now (or last read) and its health."""
        inventory = self.state.inventory or self.state.last_inventory
        self.devices = published(inventory, self.state.health_of(inventory))
        return inventory

    def sync(self) -> None:
        inventory = self.sync_devices()
        due = not self.publish_error or time.monotonic() >= self._retry_at
        if (self.devices != self._published and due and inventory is not None
                and (self._publishing is None or self._publishing.done())):
            self._publishing = asyncio.ensure_future(self._publish(self.devices))
        self._status()

    def republish(self) -> None:
        """The kubelet registered the plugin (again): it may have deleted the node's slices when it started."""
        self._published = None
        self.wake()

    async def _publish(self, devices: tuple[DraDevice, ...]) -> None:
        try:
            wrote = await asyncio.to_thread(self.publisher.sync, devices)
        except Exception as exc:  # the API's refusal or silence (ApiError), or a bug: retried either way
            self.publish_error = f"publishing the ResourceSlices of pool {self.node} failed: {_describe(exc)}"
            log.warning("DRA: %s; retrying in %.0f s", self.publish_error, self._retry_s)
            self._retry_at = time.monotonic() + self._retry_s
            self._retry_s = min(self._retry_s * 2, RETRY_MAX_S)
        else:
            if wrote:
                log.info("DRA: pool %s generation %d published: %d devices", self.node, self.publisher.generation,
                         len(devices))
            self._published, self.publish_error, self._retry_s = devices, None, RETRY_FIRST_S
        self.wake()

    # --- the kubelet's calls --------------------------------------------------------------------------

    def prepare(self, claims: list[api.Claim], deadline: float,
                now: Callable[[], float] = time.monotonic) -> dict[str, api.NodePrepareResourceResponse]:
        """Every claim's answer (run on a worker thread: it reads claims from the API)."""
        with self._claims:
            return self._prepare(claims, deadline, now)

    def _prepare(self, claims: list[api.Claim], deadline: float,
                 now: Callable[[], float]) -> dict[str, api.NodePrepareResourceResponse]:
        by_name = {device.name: device for device in self.devices}
        spec = self._cdi_spec()
        answers: dict[str, api.NodePrepareResourceResponse] = {}
        for number, claim in enumerate(claims):
            if claim.uid in answers:
                continue
            if number >= MAX_CLAIMS:
                answers[claim.uid] = api.NodePrepareResourceResponse(
                    error=f"not prepared: more than {MAX_CLAIMS} claims in one call")
                continue
            known = self.checkpoint.claims.get(claim.uid)
            if known is not None:
                answers[claim.uid] = self._answer_when_served(claim, known, deadline, now)
                continue
            if now() >= deadline:
                answers[claim.uid] = api.NodePrepareResourceResponse(
                    error="not prepared within the kubelet's deadline; it asks again")
                continue
            try:
                found = self.client.get_resource_claim(claim.namespace, claim.name)
                devices = devices_for(found, claim.uid, self.node, by_name, spec)
                prepared = PreparedClaim(claim.namespace, claim.name, devices)
                self.checkpoint.put(claim.uid, prepared)
                self._publish_claim_mps()
            except ClaimError as exc:
                answers[claim.uid] = api.NodePrepareResourceResponse(
                    error=f"claim {claim.namespace}/{claim.name}: {exc}")
                continue
            except Exception as exc:  # the API's answer (ApiError), the checkpoint's write (OSError)
                answers[claim.uid] = api.NodePrepareResourceResponse(
                    error=f"claim {claim.namespace}/{claim.name}: {_describe(exc)}")
                continue
            log.info("DRA: prepared claim %s/%s (%s): %s", claim.namespace, claim.name, claim.uid,
                     ", ".join(device.device for device in devices))
            answers[claim.uid] = self._answer_when_served(claim, prepared, deadline, now)
        return answers

    def _answer_when_served(self, claim: api.Claim, prepared: PreparedClaim, deadline: float,
                            now: Callable[[], float]) -> api.NodePrepareResourceResponse:
        """The claim's devices, once the MPS control daemons it asks for run as asked (none for most claims);
        an error naming why not when the kubelet's deadline comes first (the claim stays prepared: its daemon
        goes on starting, and the kubelet asks again)."""
        try:
            resources = set(claim_daemons({claim.uid: prepared}))
        except ConfigError as exc:
            return api.NodePrepareResourceResponse(error=f"claim {claim.namespace}/{claim.name}: {exc}")
        if resources - self.state.mps_running:
            self.mps_wanted()
        while resources - self.state.mps_running:
            if now() >= deadline:
                waiting = sorted(resources - self.state.mps_running)
                why = "; ".join(self.state.mps_down.get(resource, "not started yet") for resource in waiting)
                return api.NodePrepareResourceResponse(
                    error=f"claim {claim.namespace}/{claim.name}: its MPS control daemon does not run yet ({why}); "
                          "the kubelet asks again")
            time.sleep(MPS_POLL_S)
        problem = self._apply_timeslices(claim.uid, prepared)
        if problem:
            return api.NodePrepareResourceResponse(error=f"claim {claim.namespace}/{claim.name}: {problem}")
        try:
            node = self._node_spec()
            edits = _claim_edits(claim.uid, prepared, node)
        except claim_cdi.ClaimSpecError as exc:
            return api.NodePrepareResourceResponse(error=f"claim {claim.namespace}/{claim.name}: {exc}")
        if edits:
            try:
                if claim_cdi.write(self.root, self.ledger, claim.uid, edits, node.common if node else None):
                    log.info("DRA: claim %s/%s: its CDI spec written", claim.namespace, claim.name)
            except (OSError, AgentError, claim_cdi.ClaimSpecError) as exc:
                return api.NodePrepareResourceResponse(
                    error=f"claim {claim.namespace}/{claim.name}: its CDI spec cannot be written: "
                          f"{getattr(exc, 'strerror', None) or exc}")
        return _answer(claim.uid, prepared, own_spec=node is not None)

    def unprepare(self, claims: list[api.Claim]) -> dict[str, api.NodeUnprepareResourceResponse]:
        answers: dict[str, api.NodeUnprepareResourceResponse] = {}
        with self._claims:
            for claim in claims:
                answers[claim.uid] = self._unprepare(claim)
        return answers

    def _unprepare(self, claim: api.Claim) -> api.NodeUnprepareResourceResponse:
        try:
            claim_cdi.remove(self.root, self.ledger, claim.uid)
        except claim_cdi.ClaimSpecError:
            pass  # no spec was ever written under such a name
        except (OSError, AgentError) as exc:
            return api.NodeUnprepareResourceResponse(
                error=f"claim {claim.namespace}/{claim.name}: its CDI spec cannot be removed: "
                      f"{getattr(exc, 'strerror', None) or exc}")
        try:
            self.checkpoint.drop(claim.uid)
        except OSError as exc:
            return api.NodeUnprepareResourceResponse(
                error=f"claim {claim.namespace}/{claim.name}: the checkpoint cannot be written: {exc}")
        self._publish_claim_mps()
        self._put_back_timeslices()
        return api.NodeUnprepareResourceResponse()

    def _apply_timeslices(self, uid: str, prepared: PreparedClaim) -> Optional[str]:
        """Why the claim's GPUs shared by TimeSlicing cannot have its interval; None when they have it."""
        levels = timeslice_levels(prepared)
        if not levels:
            return None
        if self.gpus is None:
            return "its time-slice cannot be set here (no NVML)"
        try:
            timeslice.apply(self.ledger, *self.gpus, self.boot, uid, levels)
        except AgentError as exc:
            return str(exc)
        return None

    def _put_back_timeslices(self) -> None:
        """The time-slices and compute modes set for claims no longer prepared put back; what fails stays in
        the ledger, tried again at the next unprepare and at uninstall."""
        if self.gpus is None:
            return
        if self.checkpoint.error is not None:  # which claims are prepared cannot be told: nothing is put back
            log.warning("DRA: the time-slices set for claims are left as they are: %s", self.checkpoint.error)
            return
        try:
            problems = timeslice.put_back(self.ledger, *self.gpus, self.boot, set(self.checkpoint.claims))
        except AgentError as exc:  # the ledger's
            problems = [str(exc)]
        for problem in problems:
            log.warning("DRA: %s", problem)

    def _publish_claim_mps(self) -> None:
        """The MPS control daemons the checkpoint's claims ask for (a checkpoint's claim whose limits no longer
        resolve asks for none, and says so)."""
        try:
            daemons = claim_daemons(self.checkpoint.claims)
        except ConfigError as exc:  # only a checkpoint edited by hand: each claim was checked at prepare
            log.warning("DRA: the checkpoint's MPS claims cannot be read: %s", exc)
            daemons = {}
        if self.state.publish_claim_mps(daemons):
            self.mps_wanted()

    def _node_spec(self) -> Optional[claim_cdi.NodeSpec]:
        """The agent's node CDI spec as the cdi stage last wrote it (read again when the file changed); None where
        the agent writes none (toolkit.cdi off). ClaimSpecError when it cannot be read."""
        if self._cdi_spec() is None:
            return None
        path = self.root(followed(self.root, self.state.config.config.toolkit.cdi.path))
        key = (path, stamp_of(path))
        if self._node_spec_read is None or self._node_spec_read[0] != key:
            self._node_spec_read = (key, claim_cdi.read_node_spec(path))
        return self._node_spec_read[1]

    def _cdi_spec(self) -> Optional[frozenset[str]]:
        toolkit = self.state.config.config.toolkit
        if not (toolkit.enabled and toolkit.cdi.enabled):
            return None
        return self.state.cdi_devices or frozenset()

    def _status(self) -> None:
        self.state.publish_dra({
            "driver": DRIVER, "pool": self.node, "running": True, "generation": self.publisher.generation,
            "registration_socket": self.host_registration, "endpoint": self.host_endpoint,
            "registered_at": self.registered, "registration_error": self.registration_error,
            "serve_error": self.serve_error,
            "published": self._published is not None and self._published == self.devices,
            "publish_error": self.publish_error,
            "device_taints": self.publisher.taints,
            "devices": [device.to_json() for device in self.devices],
            "prepared_claims": self.checkpoint.to_json(),
            "checkpoint_error": self.checkpoint.error,
            "refused": dict(self.refused),
        })


def _claim_edits(uid: str, claim: PreparedClaim, node: Optional[claim_cdi.NodeSpec]) -> dict[str, dict[str, Any]]:
    """The container edits of each device the claim's own spec holds: all of them, the node spec's edits of
    its GPU or MIG device (and its MPS daemon's); without the agent's node spec, only its MPS devices', with
    the MPS edits alone. ClaimSpecError for a device the node spec no longer has."""
    mps = mps_resources(uid, claim)
    if node is None:
        return {device: claim_cdi.mps_edits(resource) for device, resource in mps.items()}
    edits = {}
    for device in claim.devices:
        found = node.devices.get(device.gpu)
        if found is None:
            raise claim_cdi.ClaimSpecError(f"the node's CDI spec has no device {device.gpu} now (see the cdi stage); "
                                           "the kubelet asks again")
        extra = [claim_cdi.mps_edits(mps[device.device])] if device.device in mps else []
        edits[device.device] = claim_cdi.merged(found, *extra)
    return edits


def _answer(uid: str, claim: PreparedClaim, own_spec: bool) -> api.NodePrepareResourceResponse:
    """Each device's CDI devices: the claim's own where its spec holds them all (`own_spec`), else those the
    checkpoint holds (the node spec's, and the claim's for an MPS device)."""
    return api.NodePrepareResourceResponse(devices=[
        api.Device(request_names=list(device.requests), pool_name=device.pool, device_name=device.device,
                   cdi_device_ids=[claim_cdi.device_id(uid, device.device)] if own_spec else list(device.cdi_ids))
        for device in claim.devices])


class _Registration(api.RegistrationBase):
    def __init__(self, manager: DraManager) -> None:
        self.manager = manager

    async def GetInfo(self, stream: Stream[api.InfoRequest, api.PluginInfo]) -> None:
        await request_of(stream, self.manager.refused)
        await stream.send_message(api.PluginInfo(type=api.PLUGIN_TYPE, name=DRIVER,
                                                 endpoint=self.manager.host_endpoint,
                                                 supported_versions=list(api.SUPPORTED_VERSIONS)))

    async def NotifyRegistrationStatus(
            self, stream: Stream[api.RegistrationStatus, api.RegistrationStatusResponse]) -> None:
        status = await request_of(stream, self.manager.refused)
        manager = self.manager
        if status.plugin_registered:
            log.info("DRA: the kubelet registered %s", DRIVER)
            manager.registered, manager.registration_error = time.time(), None
            manager.republish()
        else:
            manager.registration_error = status.error[:500] or "the kubelet refused the registration"
            log.warning("DRA: registration refused by the kubelet: %s", manager.registration_error)
            manager.wake()
        await stream.send_message(api.RegistrationStatusResponse())


class _DraService(api.DRAPluginBase):
    def __init__(self, manager: DraManager) -> None:
        self.manager = manager

    async def NodePrepareResources(
            self, stream: Stream[api.NodePrepareResourcesRequest, api.NodePrepareResourcesResponse]) -> None:
        request = await request_of(stream, self.manager.refused)
        deadline = time.monotonic() + PREPARE_BUDGET_S
        answers = await asyncio.to_thread(self.manager.prepare, list(request.claims), deadline)
        self.manager.wake()  # /status shows the claims
        await stream.send_message(api.NodePrepareResourcesResponse(claims=answers))

    async def NodeUnprepareResources(
            self, stream: Stream[api.NodeUnprepareResourcesRequest, api.NodeUnprepareResourcesResponse]) -> None:
        request = await request_of(stream, self.manager.refused)
        answers = await asyncio.to_thread(self.manager.unprepare, list(request.claims))
        self.manager.wake()
        await stream.send_message(api.NodeUnprepareResourcesResponse(claims=answers))
