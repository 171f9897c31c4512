"""The labels stage: node labels, the GPUAgentReady condition and the NFD feature file.

Labels go as a JSON merge patch of metadata: it sets our keys, deletes stale ones with null and
cannot touch anyone else's. The condition goes as a strategic merge patch of status, which merges
conditions by type, as node-problem-detector does, so the kubelet's own conditions stay.

Each patch is made from the Node as last read (which of our labels differ, the keys our annotation
lists, the condition's transition time) and carries that read's resourceVersion: the API server
answers 409 Conflict when the Node changed since, and the patch is made anew from a fresh read and
sent at once, a few times at most (kube/retry.py). A conflict is no failure: it costs one read and
one write. The API's faults are retried on the API's own schedule (kube/api_state.py), not on the
stage's backoff.

The NFD feature file is a local output: it is written from the computed labels whether or not the
API server answers, and with the API off (kubernetes.enabled false, or auto without a kubeconfig) it
is all the stage does, for clusters where Node Feature Discovery publishes the labels.
"""
from __future__ import annotations

import functools
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

from gpu_agent.config.kubernetes import KubernetesConfig
from gpu_agent.config.text import shown
from gpu_agent.errors import StageError, TransientError
from gpu_agent.host import owned
from gpu_agent.host.bounded import read_text
from gpu_agent.host.ledger import Ledger
from gpu_agent.host.paths import Root
from gpu_agent.kube import labels as gfd
from gpu_agent.kube import retry
from gpu_agent.kube.api_state import ApiState
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.client import MERGE_PATCH, STRATEGIC_MERGE_PATCH, ApiError, KubeClient
from gpu_agent.kube.labels import machine_name, node_labels
from gpu_agent.kube.names import node_name_problem
from gpu_agent.kube.node_info import KeptNodeInfo
from gpu_agent.nvml.model import Inventory
from gpu_agent.plan import PatchNode, WriteFile
from gpu_agent.stages.base import OUTCOMES, Action, Stage
from gpu_agent.state import Check, Outcome

if TYPE_CHECKING:
    from gpu_agent.config import AgentConfig

    Readiness = Callable[[Mapping[str, Outcome], Optional[Inventory]], tuple[bool, Optional[Check]]]

MANAGED = "nvidia.com/gpu-agent.managed-labels"
CONDITION = "GPUAgentReady"
NFD_FILE = "/etc/kubernetes/node-feature-discovery/features.d/gpu-agent"
MAX_NFD_BYTES = 1 << 20  # the agent writes a few dozen labels there
NODE_REFRESH_S = 300.0  # GET the node at most this often (and after a 409)
MIG_STATE = "nvidia.com/mig.config.state"
UPGRADE_STATE = "nvidia.com/gpu-driver-upgrade-state"


@dataclass
class SinkState:
    labels: dict[str, str]
    condition: dict[str, str]  # status, reason, message
    node: Optional[dict[str, Any]]  # None: the API is off, or failed (api_error)
    api_error: Optional[StageError] = None  # a TransientError where the API's schedule retries it


class KubeSink(Stage):
    name = "labels"
    consumes = ("inventory", "last_inventory", "pci_gpus", "mig", "driver_upgrade", "workload", OUTCOMES)
    gates_readiness = False  # /readyz speaks for the GPUs; a failing sink only marks the agent degraded

    def __init__(self, root: Root, readiness: Readiness, config: Callable[[], AgentConfig],
                 settings: KubernetesConfig, budget: RequestBudget, api: bool = True,
                 api_state: Optional[ApiState] = None) -> None:
        """`readiness`: the state model's verdict on this pass's outcomes (AgentState.readiness_of);
        `config`: the agent's config now (mig.strategy, the plugin's sharing); `budget` and `api_state`:
        the node's, shared with every client the agent builds (None: one of this stage's own)."""
        self.root = root
        self.readiness = readiness
        self.config = config
        self.settings = settings
        self.api = api  # False: the NFD feature file alone
        self.client = KubeClient(root, settings.kubeconfig, settings.request_timeout_seconds, budget, api_state)
        self.node_name = settings.node_name or _hostname()
        self._node: Optional[dict[str, Any]] = None
        self._node_read = 0.0
        self._pass_failure: Optional[StageError] = None  # why the node could not be read in this pass
        self._kept_info = KeptNodeInfo(root)
        self._info_failed_at: Optional[float] = None  # when node_info's own read last failed
        self._info_failure: Optional[StageError] = None  # and why, until this stage's next pass starts

    def start_pass(self) -> None:
        # A read of node_info() that failed earlier in this pass is this pass's answer: not asked again.
        self._pass_failure, self._info_failure = self._info_failure, None

    # --- observe ---------------------------------------------------------------------------------

    def observe(self) -> SinkState:
        # Readiness as this pass found it, never as the model has recorded it so far (the outcomes of
        # this pass's stages land there on the event loop, maybe after this runs).
        ready, failing = self.readiness(self.inputs.get(OUTCOMES, {}), self.inputs.get("inventory"))
        # A failing discovery (an NVML hiccup) must not strip the GPU labels nodeSelectors match on:
        # they stay as last seen, with gpu-agent.ready=false, until the GPUs are seen again.
        inventory = self.inputs.get("inventory") or self.inputs.get("last_inventory")
        node = None
        if self.api and self._pass_failure is None:  # after a failure, not asked again in the same pass
            try:
                node = self._current_node()
            except StageError as exc:  # the labels are still computed: the NFD file needs no API server
                self._pass_failure = exc
        wanted = node_labels(self.config(), inventory, ready, machine_name(self.root), self.inputs.get("workload"))
        if inventory is None and self.inputs.get("pci_gpus") != 0:
            # GPUs on the bus, not seen yet: keep what the node has (or, without it, the NFD file)
            wanted = {**(_owned_labels(node) if node is not None else self._nfd_labels()), **wanted}
        mig = self.inputs.get("mig")
        if mig is not None and mig.config is not None:
            wanted[MIG_STATE] = mig.state  # pending | success | failed, as k8s-mig-manager sets it
        upgrade = self.inputs.get("driver_upgrade")
        if upgrade:
            wanted[UPGRADE_STATE] = upgrade  # the GPU Operator's upgrade state (stages/driver_reload.py)
        wanted = gfd.with_timestamp(wanted, _owned_labels(node) if node is not None else self._nfd_labels(),
                                    time.time())
        if ready:
            condition = {"status": "True", "reason": "GPUsReady",
                         "message": inventory.summary() if inventory else "ready"}
        else:
            condition = {"status": "False", "reason": _reason(failing.name if failing else "startup"),
                         "message": f"{failing.name}: {failing.reason}" if failing else "first reconcile in progress"}
        return SinkState(wanted, condition, node, self._pass_failure)

    def _current_node(self, force: bool = False) -> dict[str, Any]:
        if force or self._node is None or time.monotonic() - self._node_read > NODE_REFRESH_S:
            try:
                self._node = self.client.get_node(self._checked_node_name())
            except ApiError as exc:
                raise self._failure(exc) from None
            self._node_read = time.monotonic()
        return self._node

    def _checked_node_name(self) -> str:
        if self.settings.node_name is None:
            problem = node_name_problem(self.node_name)
            if problem:
                raise StageError(f"this host's name {shown(self.node_name)}, the default Node name, {problem}: "
                                 "set kubernetes.node_name in the config to this node's name as "
                                 "`kubectl get nodes` shows it")
        return self.node_name

    def _nfd_labels(self) -> dict[str, str]:
        """Our labels as the NFD feature file has them (none when the file is not ours to write)."""
        text = self._nfd_text() if self.settings.nfd_feature_file else None
        pairs = (line.partition("=") for line in (text or "").splitlines())
        return {key: value for key, sep, value in pairs if sep and key.startswith(gfd.PREFIX)}

    def _nfd_text(self) -> Optional[str]:
        return read_text(self.root(NFD_FILE), NFD_FILE, MAX_NFD_BYTES, errors="replace")

    def node_label(self, key: str) -> Optional[str]:
        """A label of this node as the API server has it now (the mig stage's nvidia.com/mig.config)."""
        labels = (self._current_node(force=True).get("metadata") or {}).get("labels") or {}
        value = labels.get(key)
        return value if isinstance(value, str) else None

    def node_info(self) -> Optional[dict[str, Any]]:
        """The Node's status.nodeInfo (kubeletVersion, containerRuntimeVersion), for the device-path stage,
        which runs before this one: read now where this process has not read the Node yet (or not for
        NODE_REFRESH_S), so that the first pass after a restart decides as the passes before it did; the
        labels' own observe then uses that read, and a pass still asks the API once. Where the Node cannot
        be read, the versions it last gave (kube/node_info.py); None when it never answered. After a failed
        read it asks again only NODE_REFRESH_S later: retrying is this stage's, on its own backoff."""
        node = self._node
        if self._info_failed_at is None or time.monotonic() - self._info_failed_at > NODE_REFRESH_S:
            try:
                node = self._current_node()
                self._info_failed_at = None
            except StageError as exc:  # this stage reports it when it runs, in the same pass
                self._info_failure = exc
                self._info_failed_at = time.monotonic()
        if node is None:
            return self._kept_info.read()
        info = (node.get("status") or {}).get("nodeInfo")
        if not isinstance(info, dict):
            return None
        self._kept_info.keep(info)
        return info

    def publish_label(self, key: str, value: str) -> None:
        """Set one of our labels now, between passes' full patches (the mig stage's state label going
        pending before a change starts); the next pass owns it like every other label."""
        def change(node: dict[str, Any]) -> Optional[dict[str, Any]]:
            metadata = node.get("metadata") or {}
            owned = _owned_keys(metadata)
            if (metadata.get("labels") or {}).get(key) == value and key in owned:
                return None
            return {"metadata": {"labels": {key: value}, "annotations": {MANAGED: ",".join(sorted(owned | {key}))}}}

        self._write(change, status=False)

    def cached_labels(self) -> dict[str, str]:
        """This node's labels as last read, none before a read: never a request of its own."""
        return dict(((self._node or {}).get("metadata") or {}).get("labels") or {})

    def node_metadata(self, fresh: bool = True) -> tuple[dict[str, str], dict[str, str], bool]:
        """(labels, annotations, spec.unschedulable) of this node, read now (`fresh`) or as last read."""
        node = self._current_node(force=fresh)
        metadata = node.get("metadata") or {}
        return (dict(metadata.get("labels") or {}), dict(metadata.get("annotations") or {}),
                bool((node.get("spec") or {}).get("unschedulable")))

    def patch_node(self, unschedulable: Optional[bool], labels: dict[str, str]) -> None:
        """Cordon or uncordon (spec.unschedulable, which NodeRestriction lets a node change on its own Node,
        unlike its taints) and set some of our labels, in one merge patch."""
        def change(node: dict[str, Any]) -> dict[str, Any]:
            owned = _owned_keys(node.get("metadata") or {})
            patch: dict[str, Any] = {"metadata": {"labels": labels,
                                                  "annotations": {MANAGED: ",".join(sorted(owned | set(labels)))}}}
            if unschedulable is not None:
                patch["spec"] = {"unschedulable": True if unschedulable else None}
            return patch

        self._write(change, status=False)

    # --- plan and apply --------------------------------------------------------------------------

    def _write_nfd(self, text: str) -> None:
        try:
            owned.write(self.root, Ledger(self.root), self.name, NFD_FILE, text)
        except OSError as exc:  # NFD's directory read-only (host/sandbox.py), or the disk full
            raise StageError(f"cannot write the NFD features file {NFD_FILE}: {exc.strerror or exc}") from None

    def plan(self, state: SinkState) -> list[Action]:
        actions = []
        if self.settings.nfd_feature_file:  # first: a failing API request must not keep the local file back
            text = "".join(f"{key}={value}\n" for key, value in sorted(state.labels.items()))
            current = self._nfd_text()
            if current != text:
                actions.append(Action.of(WriteFile.of(NFD_FILE, text, current), lambda: self._write_nfd(text)))
        if state.node is None:
            return actions
        # Each patch is made again when it is sent, from the Node as then last read (the labels' answer,
        # or a fresh read after a conflict): what this plan shows is what the observed Node needed.
        patch = _labels_patch(state.labels, state.node)
        if patch:
            changed = sorted(patch["metadata"]["labels"])
            actions.append(Action.of(PatchNode(self.node_name, "labels", ", ".join(changed)),
                                     lambda: self._write(functools.partial(_labels_patch, state.labels), status=False)))
        condition = _condition_patch(state.condition, state.node)
        if condition:
            new = condition["status"]["conditions"][0]
            change = PatchNode(self.node_name, "condition", f"{CONDITION}={new['status']} ({new['reason']})")
            actions.append(Action.of(change, lambda: self._write(functools.partial(_condition_patch, state.condition),
                                                                 status=True)))
        return actions

    def claims(self, state: SinkState) -> set[str]:
        return {NFD_FILE} if self.settings.nfd_feature_file else set()

    def _write(self, change: Callable[[dict[str, Any]], Optional[dict[str, Any]]], status: bool) -> None:
        """Send what `change` makes of the Node as last read (None: nothing, the Node shows it already),
        with that read's resourceVersion as the precondition. A 409 Conflict says the Node changed since:
        it is read again and the patch made anew, at once, retry.CONFLICT_RETRIES times at most."""
        conflicts = 0
        while True:
            node = self._current_node(force=conflicts > 0)
            patch = change(node)
            if patch is None:
                return
            version = (node.get("metadata") or {}).get("resourceVersion")
            if isinstance(version, str) and version:
                patch = {**patch, "metadata": {**patch.get("metadata", {}), "resourceVersion": version}}
            try:
                self._node = self.client.patch_node(self.node_name, patch, status=status, conflicts=conflicts,
                                                    content_type=STRATEGIC_MERGE_PATCH if status else MERGE_PATCH)
            except ApiError as exc:
                # After a 409 the read is stale. After another failure it stays: were it stale (a timed-out
                # write that took), the next write's precondition says so with a 409.
                if exc.status == 409:
                    self._node = None
                if exc.next.action != retry.REREAD:
                    raise self._failure(exc) from None
                conflicts += 1
                continue
            self._node_read = time.monotonic()
            return

    def _failure(self, exc: ApiError) -> StageError:
        """The stage's error for a failed request: a TransientError, due when the API's schedule says,
        for a fault that passes; else a StageError, on the stage's backoff."""
        message = f"node {self.node_name}: {exc}"
        if exc.next.action == retry.WAIT and exc.next.at is not None:
            return TransientError(message, exc.next.at)
        return StageError(message)

    # --- verify ----------------------------------------------------------------------------------

    def verify(self, state: SinkState) -> str:
        nfd = f"; the NFD feature file {NFD_FILE} has the labels" if self.settings.nfd_feature_file else ""
        error = state.api_error
        if error is not None:
            if isinstance(error, TransientError):
                raise TransientError(str(error) + nfd, error.retry_at)
            raise StageError(str(error) + nfd)
        if state.node is None:
            return (f"NFD feature file {NFD_FILE}: {len(state.labels)} labels (the Kubernetes API is off: "
                    "kubernetes.enabled, or no kubeconfig)")
        if _labels_patch(state.labels, state.node) or _condition_patch(state.condition, state.node):
            raise StageError(f"node {self.node_name} does not show the labels and condition just written")
        return f"node {self.node_name}: {len(state.labels)} labels, {CONDITION}={state.condition['status']}{nfd}"


def _hostname() -> str:
    """The default Node name, as the kubelet makes it from the hostname: trimmed, in lower case."""
    return socket.gethostname().strip().lower()


def _owned_keys(metadata: dict[str, Any]) -> set[str]:
    """The label keys our annotation says are ours."""
    return {key for key in (metadata.get("annotations") or {}).get(MANAGED, "").split(",") if key}


def _owned_labels(node: dict[str, Any]) -> dict[str, str]:
    owned = _owned_keys(node.get("metadata") or {})
    return {key: value for key, value in (node.get("metadata", {}).get("labels") or {}).items() if key in owned}


def _labels_patch(labels: dict[str, str], node: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The merge patch that gives `node` our `labels` (and removes our stale ones); None: it has them."""
    metadata = node.get("metadata") or {}
    current = metadata.get("labels") or {}
    changes: dict[str, Optional[str]] = {k: v for k, v in labels.items() if current.get(k) != v}
    changes.update({key: None for key in _owned_keys(metadata) - set(labels) if key in current})
    managed = ",".join(sorted(labels))
    if not changes and (metadata.get("annotations") or {}).get(MANAGED) == managed:
        return None
    return {"metadata": {"labels": changes, "annotations": {MANAGED: managed}}}


def _condition_patch(wanted: dict[str, str], node: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The strategic merge patch that gives `node` our condition as `wanted`; None: it has it."""
    conditions = (node.get("status") or {}).get("conditions") or []
    current = next((c for c in conditions if c.get("type") == CONDITION), None)
    if current and all(current.get(key) == value for key, value in wanted.items()):
        return None
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    previous = (current or {}).get("lastTransitionTime")
    transition = previous if current and current.get("status") == wanted["status"] and previous else now
    entry = {"type": CONDITION, **wanted, "lastHeartbeatTime": now, "lastTransitionTime": transition}
    return {"status": {"conditions": [entry]}}


def _reason(check: str) -> str:
    """CamelCase condition reason from a check name: driver -> DriverFailed, gpu-health -> GpuHealthFailed."""
    return "".join(part.capitalize() for part in check.replace("_", "-").split("-")) + "Failed"

