"""The agent against a real kube-apiserver and kubelet (issue 34): etcd, the apiserver (Node,RBAC authorization,
NodeRestriction admission) and the kubelet built from upstream at the versions tests/e2e/cluster/modules/
pins, Debian 13's containerd 1.7, the agent from its .deb simulating a DGX H100 with the kubelet's
kubeconfig as its credentials. rig.py says how the machine is set up and what stands in."""
from __future__ import annotations

import base64
import http.client
import json
import os
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import yaml
import rig
from components import KUBERNETES, missing

from gpu_agent.kube.budget import RATE
from kube_emulator import MERGE_PATCH, STRATEGIC_MERGE_PATCH, KubeEmulator

# Each check waits on the real daemons' own periods (the kubelet posts a changed Node status on its 10 s
# tick, a pod starts, the apiserver answers through nsenter and curl): slow, so no wall-clock limit of
# the suite's fast tests applies (tests/conftest.py); the waits themselves are bounded (Cluster.wait).
pytestmark = pytest.mark.slow

NODE = "gpu-node"
CRICTL = (f"{rig.BIN}/crictl", "--runtime-endpoint", "unix:///run/containerd/containerd.sock")
SIM_MACHINE = "/var/lib/gpu-agent/sim/machine.json"  # the simulated GPUs' state, under the agent's --root
ONE_SHOT = ("gpu-agent", "--root", "/node", "--simulate", "dgx-h100")  # as the unit runs it (rig.AGENT_DROP_IN)
AGENT = "gpu-agent"  # the User-Agent of the agent's requests


@pytest.fixture(scope="module", params=list(rig.RUNTIMES))
def cluster(request: pytest.FixtureRequest, packages: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[rig.Cluster]:
    lacking = missing(rig.NEEDED)
    if lacking:
        reason = "the cluster rig's components are not built:\n  " + "\n  ".join(lacking)
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    work = tmp_path_factory.mktemp(f"cluster-{request.param}")
    container, directory, pki = rig.boot(work, packages["deb13"], NODE, request.param)
    try:
        booted = rig.start(container, directory, NODE, pki)
        booted.runtime = request.param
        rig.install_agent(container)
        yield booted
    finally:
        rig.stop(container, directory)
        pki.cleanup()


def _writes_by(cluster: rig.Cluster, agent: str) -> list[dict[str, Any]]:
    return [event for event in cluster.audit() if event.get("userAgent", "").startswith(agent)
            and event.get("objectRef", {}).get("name") == cluster.node]


def _condition(node: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in node["status"].get("conditions", []) if c["type"] == kind), None)


def _room_for(cluster: rig.Cluster, requests: int) -> None:
    """Until the agent's budget (12 requests a minute, node-wide, docs/kubernetes.md), which the checks
    before spent some of, has room for `requests` more: a check of what the agent sends must not see
    its requests held back."""
    def room() -> bool:
        text = cluster.container.exec("cat", "/var/lib/gpu-agent/kube-requests.json", check=False).stdout
        sent = json.loads(text or "{}").get("sent", [])
        return RATE - sum(1 for at in sent if at > time.time() - 60) >= requests
    cluster.wait(f"room for {requests} of the agent's requests", room, timeout=240)


def test_the_kubelet_registers_the_node_with_its_certificate(cluster: rig.Cluster) -> None:
    node = cluster.node_object()
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == KUBERNETES.version
    assert info["containerRuntimeVersion"] == f"containerd://{rig.RUNTIMES[cluster.runtime]}", info
    assert {a["type"]: a["address"] for a in node["status"]["addresses"]}["InternalIP"] == rig.ADDRESS
    registered = [e for e in cluster.audit() if e["verb"] == "create" and e["objectRef"].get("name") == NODE]
    assert registered and registered[0]["user"]["username"] == f"system:node:{NODE}", registered
    assert "system:nodes" in registered[0]["user"]["groups"]


def test_labels_and_the_condition_land_on_the_real_node(cluster: rig.Cluster) -> None:
    def labelled() -> dict[str, Any] | None:
        node = cluster.node_object()
        ready = _condition(node, "GPUAgentReady")
        done = node["metadata"]["labels"].get("nvidia.com/gpu.count") == "8" and ready and ready["status"] == "True"
        return node if done else None

    node = cluster.wait("the agent's labels and GPUAgentReady", labelled)
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/gpu-agent.ready"] == "true"
    managed = node["metadata"]["annotations"]["nvidia.com/gpu-agent.managed-labels"].split(",")
    assert sorted(managed) == sorted(k for k in labels if k.startswith("nvidia.com/")), managed
    # The kubelet's own conditions stay beside the agent's (a strategic merge by type).
    kinds = [c["type"] for c in node["status"]["conditions"]]
    assert {"MemoryPressure", "DiskPressure", "PIDPressure", "Ready", "GPUAgentReady"} <= set(kinds), kinds
    writes = _writes_by(cluster, AGENT)
    assert writes and {w["user"]["username"] for w in writes} == {f"system:node:{NODE}"}
    assert all(w["responseStatus"]["code"] == 200 for w in writes), writes


def test_a_pass_with_nothing_to_change_sends_nothing(cluster: rig.Cluster) -> None:
    """A one-shot pass, then the daemon's first pass after a restart: the Node read, nothing written."""
    _room_for(cluster, 4)
    ours, kubelets = len(_writes_by(cluster, AGENT)), len(_writes_by(cluster, "kubelet"))
    version = cluster.node_object()["metadata"]["resourceVersion"]
    c = cluster.container
    c.exec("systemctl", "stop", "gpu-agent")
    once = c.exec(*ONE_SHOT, "apply", "--once", timeout=300).stdout
    assert f"[+] labels: ok: node {NODE}: 28 labels, GPUAgentReady=True" in once, once
    c.exec("systemctl", "start", "gpu-agent", timeout=180)  # Type=notify: back once its first pass is done
    journal = c.exec("journalctl", "-u", "gpu-agent", "-o", "cat", "--no-pager", "-n", "30").stdout
    assert "first reconcile done" in journal.rsplit("Stopped gpu-agent", 1)[-1], journal
    after = _writes_by(cluster, AGENT)
    assert len(after) == ours, after[ours:]
    if len(_writes_by(cluster, "kubelet")) == kubelets:  # the kubelet, too, may write its status meanwhile
        assert cluster.node_object()["metadata"]["resourceVersion"] == version


def test_the_kubelet_registers_the_device_plugin(cluster: rig.Cluster) -> None:
    """Capacity and allocatable: after the agent's restart (the test before) the kubelet keeps the capacity
    and shows 0 allocatable until the new registration's first ListAndWatch answer."""
    def counted() -> dict[str, Any] | None:
        status = cluster.node_object()["status"]
        gpus = (status["capacity"].get("nvidia.com/gpu"), status["allocatable"].get("nvidia.com/gpu"))
        return status if gpus == ("8", "8") else None

    cluster.wait("nvidia.com/gpu: 8 in the Node's capacity and allocatable", counted)
    # The kubelet's own record of the plugin's devices: the agent's eight GPUs by UUID.
    c = cluster.container
    checkpoint = json.loads(c.exec("cat", "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint").stdout)
    status = json.loads(c.exec("curl", "-fsS", "127.0.0.1:9445/status").stdout)
    registered = checkpoint["Data"]["RegisteredDevices"]
    assert sorted(registered) == ["nvidia.com/gpu"], registered
    assert sorted(registered["nvidia.com/gpu"]) == sorted(gpu["uuid"] for gpu in status["gpus"]), registered



def _gpus(cluster: rig.Cluster) -> tuple[str, str]:
    status = cluster.node_object()["status"]
    return status["capacity"].get("nvidia.com/gpu", ""), status["allocatable"].get("nvidia.com/gpu", "")


def test_an_xid_takes_its_gpu_out_of_allocatable_and_recovery_brings_it_back(cluster: rig.Cluster) -> None:
    """XID 79 (fallen off the bus) on GPU 3: the plugin reports it unhealthy, the kubelet's allocatable
    drops to 7 with the capacity kept; `sim clear` brings it back to 8."""
    cluster.wait("nvidia.com/gpu: 8", lambda: _gpus(cluster) == ("8", "8"))
    cluster.container.exec(*ONE_SHOT, "sim", "inject-xid", "--gpu", "3", "--xid", "79")
    try:
        cluster.wait("allocatable 7 after XID 79", lambda: _gpus(cluster) == ("8", "7"))
    finally:
        cluster.container.exec(*ONE_SHOT, "sim", "clear")
    cluster.wait("allocatable 8 after sim clear", lambda: _gpus(cluster) == ("8", "8"))


def test_a_restarted_kubelet_gets_the_plugin_registered_again(cluster: rig.Cluster) -> None:
    c = cluster.container
    said = "device plugin: registered nvidia.com/gpu (8 devices) with the kubelet"

    def registrations() -> int:
        return c.exec("journalctl", "-u", "gpu-agent", "-o", "cat", "--no-pager").stdout.count(said)

    before = registrations()
    c.exec("systemctl", "restart", "kubelet", timeout=180)
    cluster.wait("the plugin registered again", lambda: registrations() > before)
    cluster.wait("nvidia.com/gpu: 8 again", lambda: _gpus(cluster) == ("8", "8"))


def test_the_kubelet_stand_ins_claims_hold_for_the_real_kubelet(cluster: rig.Cluster) -> None:
    """What tests/kubelet_standin/main.go claims of the kubelet, checked once against it: a restarted kubelet
    deletes every socket in its device-plugins folder and makes kubelet.sock anew; after each registration it
    asks GetDevicePluginOptions and opens one ListAndWatch; for a pod it asks GetPreferredAllocation (the
    plugin offers it: the stand-in's "preferred") and then Allocate, and never PreStartContainer."""
    c = cluster.container
    folder = "/var/lib/kubelet/device-plugins"

    def calls() -> dict[str, int]:
        resources = _status(cluster)["plugin"]["resources"]
        return next((r.get("calls") or {} for r in resources if r["name"] == "nvidia.com/gpu"), {})

    def inodes() -> dict[str, str]:
        """Each socket's inode change time, to the nanosecond: a socket made anew has a later one (its inode
        number may be the deleted one's, reused)."""
        listed = c.exec("sh", "-c", f"cd {folder} && stat -c '%n|%z' *.sock").stdout.splitlines()
        return dict(line.split("|", 1) for line in listed)

    def registrations() -> int:
        return c.exec("journalctl", "-u", "gpu-agent", "-o", "cat", "--no-pager").stdout.count(
            "device plugin: registered nvidia.com/gpu")

    def since(base: dict[str, int]) -> dict[str, int]:
        return {method: count - base.get(method, 0) for method, count in calls().items() if count > base.get(method, 0)}

    cluster.wait("nvidia.com/gpu: 8", lambda: _gpus(cluster) == ("8", "8"))  # its socket served and registered
    base = calls()
    before, registered = inodes(), registrations()
    c.exec("systemctl", "restart", "kubelet", timeout=180)
    cluster.wait("the plugin registered again", lambda: registrations() > registered, timeout=240)
    after = cluster.wait("the plugin's socket served anew (the kubelet deleted it)", lambda: (
        lambda now: now if now.get("nvidia-gpu.sock", before["nvidia-gpu.sock"]) != before["nvidia-gpu.sock"]
        else None)(inodes()), timeout=240)
    assert after["kubelet.sock"] != before["kubelet.sock"], (before, after)
    # The agent serves its socket anew on the same service (the counts go on)
    once = cluster.wait("the new registration's ListAndWatch", lambda: (
        lambda now: now if now.get("ListAndWatch") else None)(since(base)), timeout=240)
    assert once == {"GetDevicePluginOptions": 1, "ListAndWatch": 1}, once
    base = calls()
    cluster.wait("nvidia.com/gpu: 8", lambda: _gpus(cluster) == ("8", "8"))
    rig.import_images(c)
    _finished_pod(cluster, "parity-pod", "nvidia.com/gpu")
    pod = cluster.wait("the pod's calls", lambda: (lambda now: now if now.get("Allocate") else None)(since(base)),
                       timeout=240)
    assert pod == {"GetPreferredAllocation": 1, "Allocate": 1}, pod


def test_what_the_nodes_credentials_may_not_do_the_agent_reports_clearly(cluster: rig.Cluster) -> None:
    """The agent told another Node's name than its credentials' (kubernetes.node_name): the Node
    authorizer's 403 in the agent's words, with the identity it used; nothing written."""
    c = cluster.container
    c.sh("printf 'version: v1\\nkubernetes:\\n  node_name: gpu-node-3\\n' > /root/other-node.yaml")
    _room_for(cluster, 4)
    c.exec("systemctl", "stop", "gpu-agent")
    writes = len(cluster.audit())  # counted with the daemon stopped: the kubelet's own status patches go on
    try:
        done = c.exec(*ONE_SHOT, "--config", "/root/other-node.yaml", "apply", "--once", check=False, timeout=300)
        written = [event for event in cluster.audit()[writes:] if event.get("userAgent", "").startswith(AGENT)
                   or event.get("objectRef", {}).get("name") == "gpu-node-3"]
    finally:
        c.exec("systemctl", "start", "gpu-agent", timeout=180)
    line = next((x for x in done.stdout.splitlines() if x.startswith("[-] labels")), done.stdout + done.stderr)
    assert ('GET /api/v1/nodes/gpu-node-3: 403 Forbidden: nodes "gpu-node-3" is forbidden: User '
            f'"system:node:{NODE}" cannot get resource "nodes" in API group "" at the cluster scope: node '
            f"'{NODE}' cannot read 'gpu-node-3', only its own Node object") in line, line
    assert f"system:node:{NODE}" in line.rsplit("(as ", 1)[-1], line  # who the agent was
    assert written == [], written


def test_the_agents_containerd_drop_in_loads_and_the_admins_settings_stay(cluster: rig.Cluster) -> None:
    """The agent's drop-in (version 2, like Debian's root config) on each containerd: the toolkit stage is
    ok, containerd restarts on it, its effective config has the nvidia runtime and keeps the CRI settings
    the root config holds."""
    c = cluster.container
    status = json.loads(c.exec("curl", "-fsS", "127.0.0.1:9445/status").stdout)
    toolkit = next(stage for stage in status["stages"] if stage["name"] == "toolkit")
    assert toolkit["state"] == "ok", toolkit
    c.exec("systemctl", "restart", "containerd", timeout=180)
    assert c.exec("systemctl", "is-active", "containerd", check=False).stdout.strip() == "active"
    dump = c.exec("containerd", "config", "dump").stdout
    assert re.search(r"""BinaryName = ['"]/usr/bin/nvidia-container-runtime['"]""", dump), dump
    assert "restrict_oom_score_adj = true" in dump, dump
    plugin = "io.containerd.cri.v1.runtime" if cluster.runtime == "containerd-2" else "io.containerd.grpc.v1.cri"
    assert f"[plugins.{plugin!r}.containerd.runtimes.nvidia]".replace("'", '"') in dump.replace("'", '"'), dump


PROBE = ("for n in /dev/nvidia* /dev/nvidia-caps/*; do [ -c $n ] && echo char $n; done; env | grep ^NVIDIA_; "
         f"cat {rig.LIBCUDA} 2>&1; nvidia-smi 2>&1; true")


def test_a_pod_with_one_gpu_runs_and_sees_it_through_cdi(cluster: rig.Cluster) -> None:
    """A pod asking nvidia.com/gpu: 1, bound by nodeName: the kubelet allocates a GPU of the agent's device
    plugin, which answers CDI names (the agent's choice on containerd 1.7 and 2.x: cdi-cri), the kubelet
    passes them through the CRI and containerd applies the agent's spec."""
    status = json.loads(cluster.container.exec("curl", "-fsS", "127.0.0.1:9445/status").stdout)
    assert status["device_path"]["strategy"] == "cdi-cri", status["device_path"]
    rig.import_images(cluster.container)
    _run_gpu_pod(cluster, "gpu-pod")


DRA = "/apis/resource.k8s.io/v1"
AGENT_CONFIG = "/etc/gpu-agent/config.yaml"  # the agent's root is /node, which is / bound again


def _agent_status(cluster: rig.Cluster) -> dict[str, Any]:
    return json.loads(cluster.container.exec("curl", "-fsS", "127.0.0.1:9445/status").stdout)  # type: ignore[no-any-return]


def _pool(cluster: rig.Cluster) -> list[dict[str, Any]]:
    listed = cluster.get(f"{DRA}/resourceslices")["items"]
    return [s for s in listed if s["spec"]["nodeName"] == NODE and s["spec"]["driver"] == "gpu.nvidia.com"]


DEVICE_CLASS = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu.nvidia.com"},
                "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}}


def _pool_of(cluster: rig.Cluster, count: int) -> list[dict[str, Any]]:
    """The node's pool once it holds `count` devices: its slices."""
    return cluster.wait(f"the pool of {count} devices", lambda: (
        lambda found: found if found and sum(len(s["spec"]["devices"]) for s in found) == count else None)(
            _pool(cluster)))  # type: ignore[no-any-return]


def _claimed_pod(cluster: rig.Cluster, name: str, selector: str, device: dict[str, Any],
                 opaque: Optional[dict[str, Any]] = None, probe: str = PROBE,
                 during: Callable[[], Any] = lambda: None) -> str:
    """A ResourceClaim `name` for one device of class gpu.nvidia.com matching `selector` (with the `opaque`
    config for driver gpu.nvidia.com, if any), and a pod of that claim running `probe`, bound to the node.
    There is no scheduler: the claim is allocated `device` (which the test chose as the scheduler would) and
    reserved for the pod; the kubelet asks the agent to prepare it (the claim's own CDI spec written, which
    gives the pod the device); `during()` is called then. Once the pod succeeded, the kubelet unprepares the
    claim (the agent's checkpoint forgets it, the spec goes). The pod's log."""
    assert cluster.api("POST", f"{DRA}/deviceclasses", DEVICE_CLASS).status in (201, 409)
    configs = [{"requests": ["gpu"], "opaque": {"driver": "gpu.nvidia.com", "parameters": opaque}}] if opaque else []
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": name, "namespace": "default"},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": selector}}]}}],
                 "config": configs}}}
    path = f"/api/v1/namespaces/default/pods/{name}"
    try:
        made = cluster.api("POST", f"{DRA}/namespaces/default/resourceclaims", claim)
        assert made.status == 201, made
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
               "spec": {"nodeName": NODE, "hostNetwork": True, "automountServiceAccountToken": False,
                        "restartPolicy": "Never", "tolerations": [{"operator": "Exists"}],
                        "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                        "containers": [{"name": "gpu", "image": rig.IMAGE, "imagePullPolicy": "Never",
                                        "command": ["/bin/sh", "-c", probe],
                                        "resources": {"claims": [{"name": "gpu"}]}}]}}
        created = cluster.api("POST", "/api/v1/namespaces/default/pods", pod)
        assert created.status == 201, created
        stored = made.body
        stored["status"] = {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE,
                                                    "device": device["name"]}],
                                       "config": [{"source": "FromClaim", **config} for config in configs]},
                           "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                               {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}},
            "reservedFor": [{"resource": "pods", "name": name, "uid": created.body["metadata"]["uid"]}]}
        allocated = cluster.api("PUT", f"{DRA}/namespaces/default/resourceclaims/{name}/status", stored)
        assert allocated.status == 200, allocated
        during()
        done = cluster.wait(f"the pod {name} to finish", lambda: (
            lambda p: p if p["status"].get("phase") in ("Succeeded", "Failed") else None)(cluster.get(path)))
        log = cluster.api("GET", path + "/log")
        assert done["status"]["phase"] == "Succeeded", (done["status"], log)
        cluster.wait("the claim unprepared", lambda: _agent_status(cluster)["dra"]["prepared_claims"] == {})
        cluster.wait("its CDI spec gone", lambda: "k8s.gpu.nvidia.com-claim_" not in cluster.container.exec(
            "ls", "/var/run/cdi", check=False).stdout)
        journal = cluster.container.exec("journalctl", "--no-pager", "-o", "cat", "-u", "gpu-agent").stdout
        uid = made.body["metadata"]["uid"]
        assert f"DRA: prepared claim default/{name} ({uid}): {device['name']}" in journal, journal[-3000:]
        assert f"DRA: claim default/{name}: its CDI spec written" in journal, journal[-3000:]  # given its devices
        return str(log.body)
    finally:
        cluster.api("DELETE", path + "?gracePeriodSeconds=0")
        cluster.api("DELETE", f"{DRA}/namespaces/default/resourceclaims/{name}")


def test_a_resource_claim_for_a_gpu_is_prepared_and_its_pod_sees_that_gpu(cluster: rig.Cluster) -> None:
    """dra.enabled: the agent registers with the real kubelet as driver gpu.nvidia.com and publishes the node's
    pool with the node's credentials (the real Node authorizer and NodeRestriction); a ResourceClaim selects a
    GPU by productName and memory (the CEL selector evaluated here on the published attributes, as the
    scheduler would), and its pod's container sees that GPU and no other. DRA turned off again, the device
    plugin comes back and the pool goes."""
    c = cluster.container
    rig.import_images(c)
    c.sh(f"printf 'version: v1\\ndra:\\n  enabled: true\\n' > {AGENT_CONFIG}")
    c.exec("systemctl", "reload", "gpu-agent")
    try:
        slices = _pool_of(cluster, 8)
        assert slices[0]["spec"]["pool"]["name"] == NODE and slices[0]["spec"]["pool"]["resourceSliceCount"] == 1
        cluster.wait("the device plugin off", lambda: _agent_status(cluster)["plugin"]["resources"] == [])
        selector = ("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3' && "
                    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80G')) >= 0")
        matching = [d for d in slices[0]["spec"]["devices"]
                    if d["attributes"]["productName"]["string"] == "NVIDIA H100 80GB HBM3"
                    and int(d["capacity"]["memory"]["value"]) >= 80 * 10 ** 9]
        chosen = matching[3]  # not the first: the pod must see the one allocated
        log = _claimed_pod(cluster, "one-gpu", selector, chosen)
        minor = chosen["name"].removeprefix("gpu-")
        assert re.findall(r"^char /dev/nvidia(\d+)$", log, re.M) == [minor], log
    finally:
        c.sh(f"printf 'version: v1\\n' > {AGENT_CONFIG}")
        c.exec("systemctl", "reload", "gpu-agent")
    cluster.wait("nvidia.com/gpu: 8 with DRA off", lambda: _gpus(cluster) == ("8", "8"))
    cluster.wait("the pool withdrawn", lambda: _pool(cluster) == [], timeout=120)


def test_a_restarted_kubelet_gets_the_pool_again_and_a_restarted_agent_unprepares_its_claims(
        cluster: rig.Cluster) -> None:
    """plugin.api dra on the real kubelet: a restarted kubelet deletes the node's slices when it starts and
    registers the plugin again, and the agent publishes the pool again (a new slice). A claim prepared, the
    agent restarted while its pod runs: the new agent still holds the claim (its checkpoint) and, once the
    pod ended, the kubelet's unprepare reaches it and the claim and its CDI spec go."""
    c = cluster.container
    original = c.exec("cat", AGENT_CONFIG, check=False).stdout
    rig.import_images(c)
    try:
        c.sh(f"printf 'version: v1\\nplugin:\\n  api: dra\\n' > {AGENT_CONFIG}")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        before = _pool_of(cluster, 8)[0]["metadata"]["uid"]
        c.exec("systemctl", "restart", "kubelet", timeout=180)
        cluster.wait("the pool published again by the agent", lambda: (
            lambda found: found if found and found[0]["metadata"]["uid"] != before
            and len(found[0]["spec"]["devices"]) == 8 else None)(_pool(cluster)), timeout=240)
        chosen = [d for s in _pool(cluster) for d in s["spec"]["devices"]][1]
        uuid = chosen["attributes"]["uuid"]["string"]

        def restart_while_it_runs() -> None:
            cluster.wait("the claim prepared", lambda: _agent_status(cluster)["dra"]["prepared_claims"])
            c.exec("systemctl", "restart", "gpu-agent", timeout=300)
            claims = cluster.wait("the restarted agent's /status", lambda: (_agent_status(cluster)["dra"] or {}).get(
                "prepared_claims"))
            assert [d["device"] for claim in claims.values() for d in claim["devices"]] == [chosen["name"]], claims

        log = _claimed_pod(cluster, "kept", f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'", chosen,
                           probe=PROBE + "; sleep 30", during=restart_while_it_runs)
        assert re.findall(r"^char /dev/nvidia(\d+)$", log, re.M) == [chosen["name"].removeprefix("gpu-")], log
    finally:
        c.sh(f"cat > {AGENT_CONFIG} <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait("nvidia.com/gpu: 8 with DRA off", lambda: _gpus(cluster) == ("8", "8"))


def test_a_resource_claim_for_a_mig_device_is_prepared_and_its_pod_sees_it(cluster: rig.Cluster) -> None:
    """plugin.api dra with mig.config all-balanced: the pool holds the 32 MIG devices (no whole GPU), each
    with its profile; a claim selecting a 1g.10gb by profile is prepared, and its pod sees the parent GPU's
    node and the two access capabilities of that MIG device, nothing else. Then MIG off and the config as
    it was: nvidia.com/gpu 8 from the device plugin again."""
    c = cluster.container
    original = c.exec("cat", AGENT_CONFIG, check=False).stdout
    rig.import_images(c)
    try:
        c.sh(f"printf 'version: v1\\nplugin:\\n  api: dra\\nmig:\\n  strategy: mixed\\n  config: all-balanced\\n' "
             f"> {AGENT_CONFIG}")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        devices = [d for s in _pool_of(cluster, 32) for d in s["spec"]["devices"]]
        profiles = Counter(d["attributes"]["profile"]["string"] for d in devices)
        assert profiles == {"1g.10gb": 16, "2g.20gb": 8, "3g.40gb": 8}, profiles
        matching = [d for d in devices if d["attributes"]["profile"]["string"] == "1g.10gb"]
        chosen = matching[5]
        log = _claimed_pod(cluster, "one-mig", "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'", chosen)
        parent = chosen["name"].split("-")[1]  # gpu-<parent minor>-mig-<profile>-<GI profile>-<placement>
        assert re.findall(r"^char /dev/nvidia(\d+)$", log, re.M) == [parent], log
        caps = re.findall(r"^char /dev/nvidia-caps/nvidia-cap(\d+)$", log, re.M)
        assert len(caps) == 2, log
    finally:
        _mig_off_and_config_back(cluster, original)
    cluster.wait("the pool withdrawn", lambda: _pool(cluster) == [], timeout=120)


def test_a_claim_shared_by_time_slicing_sets_its_gpus_time_slice_until_it_is_unprepared(
        cluster: rig.Cluster) -> None:
    """plugin.api dra; a claim for one GPU whose opaque config shares it by TimeSlicing with interval Long:
    at prepare the agent sets that GPU's compute time-slice to Long (nvidia-smi's level 3; on the simulated
    GPU) and no other's, while its pod runs; the pod ended, the kubelet unprepares the claim and the
    time-slice is Default again, the ledger holding nothing of it."""
    c = cluster.container
    original = c.exec("cat", AGENT_CONFIG, check=False).stdout
    rig.import_images(c)

    def timeslices() -> dict[str, int]:
        machine = json.loads(c.exec("cat", f"/node{SIM_MACHINE}").stdout)
        return {gpu["uuid"]: gpu["timeslice"] for gpu in machine["gpus"] if "timeslice" in gpu}

    try:
        c.sh(f"printf 'version: v1\\nplugin:\\n  api: dra\\n' > {AGENT_CONFIG}")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        chosen = [d for s in _pool_of(cluster, 8) for d in s["spec"]["devices"]][5]
        uuid = chosen["attributes"]["uuid"]["string"]
        assert timeslices() == {}
        long = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig",
                "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}}
        _claimed_pod(cluster, "sliced", f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'", chosen, long,
                     probe=PROBE + "; sleep 20",
                     during=lambda: cluster.wait("the GPU's time-slice Long", lambda: timeslices() == {uuid: 3}))
        cluster.wait("the time-slice Default again", lambda: timeslices() == {})
        ledger = json.loads(c.exec("cat", "/node/var/lib/gpu-agent/ledger.json").stdout)
        assert "timeslices" not in ledger, ledger
    finally:
        c.sh(f"cat > {AGENT_CONFIG} <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait("nvidia.com/gpu: 8 with DRA off", lambda: _gpus(cluster) == ("8", "8"))


# Each pod marks the daemon's pipe directory (shared through the claim's CDI spec) and waits for the other's
# mark: the two run at once, whatever the runtime's pace.
MPS_PROBE = ("echo pipe=$CUDA_MPS_PIPE_DIRECTORY; [ -d \"$CUDA_MPS_PIPE_DIRECTORY\" ] && echo pipe-mounted; "
             "grep -q ' /dev/shm ' /proc/mounts && echo shm-mounted; "
             "for n in /dev/nvidia[0-9]*; do [ -c $n ] && echo char $n; done; "
             "touch \"$CUDA_MPS_PIPE_DIRECTORY/$0.here\"; i=0; "
             "while [ $(ls \"$CUDA_MPS_PIPE_DIRECTORY\" | grep -c '[.]here$') -lt 2 ] && [ $i -lt 150 ]; "
             "do sleep 1; i=$((i+1)); done; echo together=$(ls \"$CUDA_MPS_PIPE_DIRECTORY\" | grep -c '[.]here$')")


def test_a_claim_shared_by_mps_runs_two_pods_on_one_gpu_with_its_limits(cluster: rig.Cluster) -> None:
    """plugin.api dra; a ResourceClaim for one GPU whose opaque config shares it by MPS (50 % of the threads,
    10Gi of pinned memory), reserved for two pods: the agent starts the claim's MPS control daemon with those
    limits before it answers the kubelet; both pods run at once on that GPU (each marks the daemon's pipe
    directory and sees the other's mark) with its shared memory, through the claim's own CDI spec; the pods
    ended, the kubelet unprepares the claim and the daemon and the spec go."""
    c = cluster.container
    original = c.exec("cat", AGENT_CONFIG, check=False).stdout
    rig.import_images(c)
    names = ("mps-a", "mps-b")
    try:
        c.sh(f"printf 'version: v1\\nplugin:\\n  api: dra\\n' > {AGENT_CONFIG}")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        chosen = [d for s in _pool_of(cluster, 8) for d in s["spec"]["devices"]][2]
        assert cluster.api("POST", f"{DRA}/deviceclasses", DEVICE_CLASS).status in (201, 409)
        opaque = {"driver": "gpu.nvidia.com", "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {
                "strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
                                                 "defaultPinnedDeviceMemoryLimit": "10Gi"}}}}
        claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                 "metadata": {"name": "shared", "namespace": "default"},
                 "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}],
                                      "config": [{"requests": ["gpu"], "opaque": opaque}]}}}
        made = cluster.api("POST", f"{DRA}/namespaces/default/resourceclaims", claim)
        assert made.status == 201, made
        uid = made.body["metadata"]["uid"]
        reserved = []
        for name in names:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
                   "spec": {"nodeName": NODE, "hostNetwork": True, "automountServiceAccountToken": False,
                            "restartPolicy": "Never", "tolerations": [{"operator": "Exists"}],
                            "resourceClaims": [{"name": "gpu", "resourceClaimName": "shared"}],
                            "containers": [{"name": "gpu", "image": rig.IMAGE, "imagePullPolicy": "Never",
                                            "command": ["/bin/sh", "-c", MPS_PROBE, name],
                                            "resources": {"claims": [{"name": "gpu"}]}}]}}
            created = cluster.api("POST", "/api/v1/namespaces/default/pods", pod)
            assert created.status == 201, created
            reserved.append({"resource": "pods", "name": name, "uid": created.body["metadata"]["uid"]})
        stored = made.body
        stored["status"] = {
            "allocation": {"devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE,
                                                    "device": chosen["name"]}],
                                       "config": [{"source": "FromClaim", "requests": ["gpu"], "opaque": opaque}]},
                           "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                               {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}},
            "reservedFor": reserved}
        allocated = cluster.api("PUT", f"{DRA}/namespaces/default/resourceclaims/shared/status", stored)
        assert allocated.status == 200, allocated
        resource = f"k8s.gpu.nvidia.com/claim/{uid}"

        def daemon() -> Any:
            found = [d for d in (_agent_status(cluster)["mps"] or {}).get("daemons", []) if d["resource"] == resource]
            return found if found and found[0]["state"] == "running" else None

        daemons = cluster.wait("the claim's MPS control daemon running", daemon)
        assert daemons[0]["active_thread_percentage"] == 50 and daemons[0]["pinned_memory_limits"] == {
            str(daemons[0]["gpus"][0]): "10240M"}, daemons
        minor = chosen["name"].removeprefix("gpu-")
        for name in names:
            path = f"/api/v1/namespaces/default/pods/{name}"
            done = cluster.wait(f"the pod {name} to finish", lambda path=path: (
                lambda p: p if p["status"].get("phase") in ("Succeeded", "Failed") else None)(cluster.get(path)))
            log = str(cluster.api("GET", path + "/log").body)
            assert done["status"]["phase"] == "Succeeded", (done["status"], log)
            assert f"pipe=/mps/{resource}/pipe" in log and "pipe-mounted" in log and "shm-mounted" in log, log
            assert "together=2" in log, log
            assert re.findall(r"^char /dev/nvidia(\d+)$", log, re.M) == [minor], log
        cluster.wait("the claim unprepared", lambda: _agent_status(cluster)["dra"]["prepared_claims"] == {})
        cluster.wait("its MPS control daemon gone", lambda: not [
            d for d in (_agent_status(cluster)["mps"] or {}).get("daemons", []) if d["resource"] == resource])
        assert c.exec("ls", "/var/run/cdi", check=False).stdout.count("k8s.gpu.nvidia.com-claim_") == 0
    finally:
        for name in names:
            cluster.api("DELETE", f"/api/v1/namespaces/default/pods/{name}?gracePeriodSeconds=0")
        cluster.api("DELETE", f"{DRA}/namespaces/default/resourceclaims/shared")
        c.sh(f"cat > {AGENT_CONFIG} <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait("nvidia.com/gpu: 8 with DRA off", lambda: _gpus(cluster) == ("8", "8"))


def _with_device_taints(cluster: rig.Cluster, on: bool) -> None:
    """kube-apiserver restarted with DRADeviceTaints on (a drop-in adding the gate), or as the rig made it."""
    _with_feature_gate(cluster, "DRADeviceTaints" if on else None)


def _with_feature_gate(cluster: rig.Cluster, gate: Optional[str]) -> None:
    """kube-apiserver restarted with `gate` on (a drop-in adding it), or as the rig made it (None)."""
    c = cluster.container
    dropin = "/etc/systemd/system/kube-apiserver.service.d/feature-gate.conf"
    if gate is not None:
        start = next(line for line in rig._apiserver_unit().splitlines() if line.startswith("ExecStart="))
        c.sh(f"mkdir -p {Path(dropin).parent} && printf '%s\\n' '[Service]' 'ExecStart=' "
             f"'{start} --feature-gates={gate}=true' > {dropin}")
    else:
        c.exec("rm", "-f", dropin)
    c.exec("systemctl", "daemon-reload")
    c.exec("systemctl", "restart", "kube-apiserver", timeout=180)
    cluster.wait("the apiserver's /readyz", lambda: cluster.api("GET", "/readyz").status == 200, timeout=240)


GRANT = Path(__file__).resolve().parents[3] / "packaging" / "kubernetes" / "gpu-agent-deviceclass-reader.yaml"
RBAC = "/apis/rbac.authorization.k8s.io/v1"


def test_plugin_api_both_holds_only_where_a_device_class_serves_nvidia_com_gpu(cluster: rig.Cluster) -> None:
    """plugin.api both on the real apiserver: without the shipped grant the node may not list DeviceClasses,
    and both is refused (device-plugin serves nvidia.com/gpu: 8); with it, a cluster without a class for
    nvidia.com/gpu still refuses it. kube-apiserver 1.34 as built (DRAExtendedResource off) stores a class
    without its spec.extendedResourceName; with the gate on it keeps it, and the node then serves both: the
    pool of eight, the device plugin's nvidia.com/gpu gone. The config as it was: device-plugin again."""
    c = cluster.container
    original = c.exec("cat", AGENT_CONFIG, check=False).stdout
    extended = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "gpu-extended"},
                "spec": {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}],
                         "extendedResourceName": "nvidia.com/gpu"}}
    role, binding = yaml.safe_load_all(GRANT.read_text())

    def both() -> Any:
        return _agent_status(cluster)["api"]

    try:
        made = cluster.api("POST", f"{DRA}/deviceclasses", extended)
        assert made.status == 201 and "extendedResourceName" not in made.body["spec"], made  # the gate is off
        assert cluster.api("DELETE", f"{DRA}/deviceclasses/gpu-extended").status == 200
        c.sh(f"printf 'version: v1\\nplugin:\\n  api: both\\n' > {AGENT_CONFIG}")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        refused = cluster.wait("both refused: no grant", lambda: (lambda a: a if a["both"] else None)(both()))
        assert refused["serving"] == "device-plugin" and "may not list DeviceClasses" in refused["both"]["refused"] \
            and "gpu-agent-deviceclass-reader.yaml" in refused["both"]["refused"], refused
        cluster.wait("nvidia.com/gpu: 8 from the device plugin", lambda: _gpus(cluster) == ("8", "8"))
        assert cluster.api("POST", f"{RBAC}/clusterroles", role).status == 201
        assert cluster.api("POST", f"{RBAC}/clusterrolebindings", binding).status == 201
        c.exec("systemctl", "reload", "gpu-agent")  # a reload looks again at once
        refused = cluster.wait("both refused: no class", lambda: (
            lambda a: a if (a["both"]["refused"] or "").startswith("no DeviceClass") else None)(both()))
        assert refused["serving"] == "device-plugin", refused
        _with_feature_gate(cluster, "DRAExtendedResource")
        made = cluster.api("POST", f"{DRA}/deviceclasses", extended)
        assert made.status == 201 and made.body["spec"]["extendedResourceName"] == "nvidia.com/gpu", made
        c.exec("systemctl", "reload", "gpu-agent")
        held = cluster.wait("both holds", lambda: (lambda a: a if a["serving"] == "both" else None)(both()))
        assert held["both"] == {"device_class": "gpu-extended", "refused": None}, held
        _pool_of(cluster, 8)
        cluster.wait("the device plugin off", lambda: _agent_status(cluster)["plugin"]["resources"] == [])
    finally:
        cluster.api("DELETE", f"{DRA}/deviceclasses/gpu-extended")
        cluster.api("DELETE", f"{RBAC}/clusterrolebindings/{binding['metadata']['name']}")
        cluster.api("DELETE", f"{RBAC}/clusterroles/{role['metadata']['name']}")
        _with_feature_gate(cluster, None)
        c.sh(f"cat > {AGENT_CONFIG} <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait("nvidia.com/gpu: 8 with DRA off", lambda: _gpus(cluster) == ("8", "8"))
    cluster.wait("the pool withdrawn", lambda: _pool(cluster) == [], timeout=120)


def test_an_xid_withdraws_or_taints_the_gpus_device_and_recovery_clears_it(cluster: rig.Cluster) -> None:
    """plugin.api dra, XID 79 on GPU 3 (`sim inject-xid`): kube-apiserver 1.34 as it comes (DRADeviceTaints
    off) drops the taints the agent writes, and the agent withdraws gpu-3 from the pool instead; with the
    gate on, gpu-3 stays, tainted gpu.nvidia.com/xid=79 and gpu.nvidia.com/gpu-lost (NoSchedule) at the
    times the server gave them, and the pool is not written again while nothing changes. `sim clear`: all
    eight, untainted."""
    c = cluster.container
    original = c.exec("cat", AGENT_CONFIG, check=False).stdout

    def devices() -> dict[str, Any]:
        return {d["name"]: d.get("taints") for s in _pool(cluster) for d in s["spec"]["devices"]}

    try:
        c.sh(f"printf 'version: v1\\nplugin:\\n  api: dra\\n' > {AGENT_CONFIG}")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        _pool_of(cluster, 8)
        c.exec(*ONE_SHOT, "sim", "inject-xid", "--gpu", "3", "--xid", "79")
        try:
            cluster.wait("gpu-3 withdrawn (the API server drops device taints)", lambda: (
                lambda found: len(found) == 7 and "gpu-3" not in found and not any(found.values()))(devices()))
            assert _agent_status(cluster)["dra"]["device_taints"] is False
        finally:
            c.exec(*ONE_SHOT, "sim", "clear")
        cluster.wait("all eight again", lambda: len(devices()) == 8)

        _with_device_taints(cluster, True)
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)  # what it learnt of the server is not kept
        _pool_of(cluster, 8)
        c.exec(*ONE_SHOT, "sim", "inject-xid", "--gpu", "3", "--xid", "79")
        try:
            found = cluster.wait("gpu-3 tainted in place", lambda: (
                lambda got: got if len(got) == 8 and got.get("gpu-3") else None)(devices()))
            assert [(t["key"], t.get("value"), t["effect"]) for t in found["gpu-3"]] == [
                ("gpu.nvidia.com/xid", "79", "NoSchedule"), ("gpu.nvidia.com/gpu-lost", None, "NoSchedule")]
            assert all(t["timeAdded"] for t in found["gpu-3"]), found
            assert [name for name, taints in found.items() if taints] == ["gpu-3"]
            assert _agent_status(cluster)["dra"]["device_taints"] is True
            version = _pool(cluster)[0]["metadata"]["resourceVersion"]
            time.sleep(5)  # the agent's syncs meanwhile find the stored pool as wanted, timeAdded and all
            assert _pool(cluster)[0]["metadata"]["resourceVersion"] == version
        finally:
            c.exec(*ONE_SHOT, "sim", "clear")
        cluster.wait("gpu-3 untainted", lambda: (lambda got: len(got) == 8 and not any(got.values()))(devices()))
    finally:
        _with_device_taints(cluster, False)
        c.sh(f"cat > {AGENT_CONFIG} <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait("nvidia.com/gpu: 8 with DRA off", lambda: _gpus(cluster) == ("8", "8"))
    cluster.wait("the pool withdrawn", lambda: _pool(cluster) == [], timeout=120)


def test_containerd_2_with_its_own_version_4_config(cluster: rig.Cluster) -> None:
    """containerd v2.4.2's default config (version 4) as the root config, an admin's CRI setting in it: the
    agent's drop-in is version 4 too, containerd loads both, and a GPU pod runs on the result."""
    if cluster.runtime != "containerd-2":
        pytest.skip("containerd 1.7 reads config versions up to 2")
    c = cluster.container
    c.sh("containerd config default | sed 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' "
         "> /etc/containerd/config.toml.new && mv /etc/containerd/config.toml.new /etc/containerd/config.toml")
    assert c.exec("head", "-1", "/etc/containerd/config.toml").stdout == "version = 4\n"
    c.exec("systemctl", "restart", "gpu-agent", timeout=180)
    status = json.loads(c.exec("curl", "-fsS", "127.0.0.1:9445/status").stdout)
    toolkit = next(stage for stage in status["stages"] if stage["name"] == "toolkit")
    assert toolkit["state"] == "ok", toolkit
    assert c.exec("head", "-3", "/etc/containerd/conf.d/99-nvidia.toml").stdout.splitlines()[1] == "version = 4"
    rig.import_images(c)  # restarts containerd on the new files
    dump = c.exec("containerd", "config", "dump").stdout
    assert "restrict_oom_score_adj = true" in dump and "/usr/bin/nvidia-container-runtime" in dump, dump
    _run_gpu_pod(cluster, "gpu-pod-v4")


def _pod(name: str, resource: str, command: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": NODE, "hostNetwork": True, "automountServiceAccountToken": False,
                     "restartPolicy": "Never", "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "gpu", "image": rig.IMAGE, "imagePullPolicy": "Never",
                                     "command": ["/bin/sh", "-c", command],
                                     "resources": {"limits": {resource: "1"}}}]}}


def _finished_pod(cluster: rig.Cluster, name: str, resource: str) -> tuple[dict[str, Any], str]:
    """The pod run to its end: the Pod object and its container's log."""
    created = cluster.api("POST", "/api/v1/namespaces/default/pods", _pod(name, resource, PROBE))
    assert created.status == 201, created
    path = f"/api/v1/namespaces/default/pods/{name}"
    done = cluster.wait(f"the pod {name} to finish", lambda: (
        lambda p: p if p["status"].get("phase") in ("Succeeded", "Failed") else None)(cluster.get(path)))
    log = cluster.api("GET", path + "/log")  # through the apiserver, from the kubelet
    assert done["status"]["phase"] == "Succeeded", (done["status"], log)
    assert log.status == 200, log
    return done, str(log.body)


def _run_gpu_pod(cluster: rig.Cluster, name: str) -> None:
    c = cluster.container
    status = json.loads(c.exec("curl", "-fsS", "127.0.0.1:9445/status").stdout)
    done, output = _finished_pod(cluster, name, "nvidia.com/gpu")
    gpus = re.findall(r"^char /dev/nvidia(\d+)$", output, re.M)
    assert len(gpus) == 1, output  # one GPU of eight
    for node in ("/dev/nvidiactl", "/dev/nvidia-uvm"):
        assert f"char {node}\n" in output, output
    assert f"placeholder libcuda {rig.DRIVER}" in output and f"nvidia-smi {rig.DRIVER} (simulated" in output, output
    # containerd's own record (crictl, built with the rig): the container's OCI spec got that GPU's device
    # node and no other GPU's, from the CDI spec, not from a volume or a privileged container.
    found = c.exec(*CRICTL, "ps", "-a", "-q", "--label", f"io.kubernetes.pod.name={name}").stdout.split()
    assert len(found) == 1, found
    spec = json.loads(c.exec(*CRICTL, "inspect", found[0]).stdout)["info"]["runtimeSpec"]
    devices = sorted(d["path"] for d in spec["linux"]["devices"] if re.fullmatch(r"/dev/nvidia\d+", d["path"]))
    assert devices == [f"/dev/nvidia{gpus[0]}"], spec["linux"]["devices"]
    # The kubelet's own record: the device it gave the container is the agent's GPU of that index.
    checkpoint = json.loads(c.exec("cat", "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint").stdout)
    entries = [e for e in checkpoint["Data"]["PodDeviceEntries"] if e["PodUID"] == done["metadata"]["uid"]]
    assert [e["ResourceName"] for e in entries] == ["nvidia.com/gpu"], checkpoint
    given = [d for ids in entries[0]["DeviceIDs"].values() for d in ids]
    gpu = next(g for g in status["gpus"] if g["uuid"] in given) if len(given) == 1 else None
    assert gpu is not None and str(gpu["index"]) == gpus[0], (given, status["gpus"])


def _status(cluster: rig.Cluster) -> dict[str, Any]:
    return json.loads(cluster.container.exec("curl", "-fsS", "127.0.0.1:9445/status").stdout)


def _capacity(cluster: rig.Cluster) -> dict[str, str]:
    status = cluster.node_object()["status"]
    return {k: v for k, v in status["allocatable"].items() if k.startswith("nvidia.com/")
            and status["capacity"].get(k) == v}


def _configured(cluster: rig.Cluster, text: str, wanted: Callable[[dict[str, str]], bool], what: str) -> None:
    """The agent restarted on `text` as its config; then the kubelet's allocatable as `wanted` says."""
    c = cluster.container
    c.sh(f"cat > /etc/gpu-agent/config.yaml <<'EOF'\n{text}EOF")
    c.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait(what, lambda: wanted(_capacity(cluster)), timeout=300)


def _mig_off_and_config_back(cluster: rig.Cluster, original: str) -> None:
    """MIG disabled on every GPU (nvidia.com/gpu: 8 from the device plugin), then the agent's config as it was."""
    _configured(cluster, "version: v1\nmig:\n  strategy: mixed\n  config: all-disabled\n",
                lambda found: found.get("nvidia.com/gpu") == "8", "nvidia.com/gpu: 8 with MIG off")
    cluster.container.sh(f"cat > {AGENT_CONFIG} <<'EOF'\n{original}EOF")
    cluster.container.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait("nvidia.com/gpu: 8", lambda: _gpus(cluster) == ("8", "8"))


BALANCED = {"nvidia.com/mig-1g.10gb": "16", "nvidia.com/mig-2g.20gb": "8", "nvidia.com/mig-3g.40gb": "8"}


def test_mig_mixed_advertises_each_profile_and_a_pod_gets_one_mig_device(cluster: rig.Cluster) -> None:
    """mig.config all-balanced (the packaged mig.yaml: on an H100 80GB two 1g.10gb, one 2g.20gb and one
    3g.40gb) under mig.strategy mixed: the kubelet shows each profile's count and no nvidia.com/gpu; a pod
    asking nvidia.com/mig-1g.10gb gets that MIG device's parent GPU node and its two access capabilities
    (GPU instance and compute instance) through the agent's CDI spec, and no other GPU. Then all-disabled
    and the config as it was: nvidia.com/gpu 8 again."""
    c = cluster.container
    original = c.exec("cat", "/etc/gpu-agent/config.yaml", check=False).stdout
    try:
        _configured(cluster, "version: v1\nmig:\n  strategy: mixed\n  config: all-balanced\n",
                    lambda found: found == BALANCED, f"{BALANCED} in the Node's capacity and allocatable")
        rig.import_images(c)
        done, output = _finished_pod(cluster, "mig-pod", "nvidia.com/mig-1g.10gb")
        gpus = re.findall(r"^char /dev/nvidia(\d+)$", output, re.M)
        caps = re.findall(r"^char /dev/nvidia-caps/nvidia-cap(\d+)$", output, re.M)
        assert len(gpus) == 1 and len(caps) == 2, output
        status = _status(cluster)
        checkpoint = json.loads(c.exec("cat", "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint").stdout)
        entries = [e for e in checkpoint["Data"]["PodDeviceEntries"] if e["PodUID"] == done["metadata"]["uid"]]
        assert [e["ResourceName"] for e in entries] == ["nvidia.com/mig-1g.10gb"], checkpoint
        given = [d for ids in entries[0]["DeviceIDs"].values() for d in ids]
        parents = [g for g in status["gpus"] for m in (g["mig"] or {}).get("instances", []) if m.get("uuid") in given]
        assert len(given) == 1 and [str(g["index"]) for g in parents] == gpus, (given, gpus, status["gpus"])
    finally:
        _mig_off_and_config_back(cluster, original)


def test_time_slicing_advertises_the_replicas(cluster: rig.Cluster) -> None:
    """NVIDIA's sharing block, 4 replicas: the kubelet shows 32 nvidia.com/gpu; a pod gets one replica, and
    with it one GPU's device node. The config as it was after: 8 again."""
    c = cluster.container
    original = c.exec("cat", "/etc/gpu-agent/config.yaml", check=False).stdout
    try:
        _configured(cluster, "version: v1\nplugin:\n  sharing:\n    timeSlicing:\n      resources:\n"
                    "      - name: nvidia.com/gpu\n        replicas: 4\n",
                    lambda found: found.get("nvidia.com/gpu") == "32", "nvidia.com/gpu: 32 replicas")
        cluster.wait("the nvidia.com/gpu.replicas label at 4 (the agent's label writes have a budget of their own)",
                     lambda: cluster.node_object()["metadata"]["labels"].get("nvidia.com/gpu.replicas") == "4",
                     timeout=240)
        rig.import_images(c)
        _, output = _finished_pod(cluster, "shared-pod", "nvidia.com/gpu")
        assert len(re.findall(r"^char /dev/nvidia(\d+)$", output, re.M)) == 1, output
    finally:
        c.sh(f"cat > /etc/gpu-agent/config.yaml <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
    cluster.wait("nvidia.com/gpu: 8", lambda: _gpus(cluster) == ("8", "8"))


def test_the_nvidia_runtimes_environment_path_where_cdi_is_off(cluster: rig.Cluster) -> None:
    """plugin.device_list_strategy: envvar (what the agent chooses where the runtime cannot apply CDI): nvidia
    becomes containerd's default runtime (toolkit.set_as_default: auto), Allocate answers NVIDIA_VISIBLE_DEVICES
    with the GPU's UUID and no CDI name; the pod's container runs through /usr/bin/nvidia-container-runtime (here
    the stand-in that hands it to runc: the injection is the real runtime's) with that variable."""
    c = cluster.container
    original = c.exec("cat", "/etc/gpu-agent/config.yaml", check=False).stdout
    try:
        _configured(cluster, "version: v1\nplugin:\n  device_list_strategy: envvar\n",
                    lambda found: found.get("nvidia.com/gpu") == "8", "nvidia.com/gpu: 8 on the envvar path")
        assert _status(cluster)["device_path"]["strategy"] == "envvar"
        rig.import_images(c)  # containerd restarted on the agent's drop-in: nvidia its default runtime now
        dump = c.exec("containerd", "config", "dump").stdout
        assert re.search(r"""default_runtime_name = ['"]nvidia['"]""", dump), dump
        done, output = _finished_pod(cluster, "envvar-pod", "nvidia.com/gpu")
        visible = re.findall(r"^NVIDIA_VISIBLE_DEVICES=(\S+)$", output, re.M)
        checkpoint = json.loads(c.exec("cat", "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint").stdout)
        entries = [e for e in checkpoint["Data"]["PodDeviceEntries"] if e["PodUID"] == done["metadata"]["uid"]]
        given = [d for ids in entries[0]["DeviceIDs"].values() for d in ids]
        assert visible == given and len(given) == 1, (visible, given, output)
        found = c.exec(*CRICTL, "ps", "-a", "-q", "--label", "io.kubernetes.pod.name=envvar-pod").stdout.split()
        inspected = c.exec(*CRICTL, "inspect", found[0]).stdout
        assert "/usr/bin/nvidia-container-runtime" in inspected, inspected
        spec = json.loads(inspected)["info"]["runtimeSpec"]
        assert not [d for d in spec["linux"].get("devices", []) if re.fullmatch(r"/dev/nvidia\d+", d["path"])], spec
    finally:
        c.sh(f"cat > /etc/gpu-agent/config.yaml <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        rig.import_images(c)  # containerd back on CDI
    cluster.wait("nvidia.com/gpu: 8", lambda: _gpus(cluster) == ("8", "8"))


def test_a_running_pod_keeps_its_gpu_across_an_agent_restart_and_metrics_name_it(cluster: rig.Cluster) -> None:
    """A pod holding a GPU (sleeping), the agent restarted under it: the pod runs on with its device, the
    kubelet's allocation stays, and /metrics carries the pod's namespace, name and container on that GPU's
    series (the kubelet's pod-resources API, read by the agent with metrics.pod_labels)."""
    c = cluster.container
    original = c.exec("cat", "/etc/gpu-agent/config.yaml", check=False).stdout
    _configured(cluster, "version: v1\nmetrics:\n  pod_labels: true\n",
                lambda found: found.get("nvidia.com/gpu") == "8", "nvidia.com/gpu: 8 with pod labels on")
    rig.import_images(c)
    name = "long-pod"
    created = cluster.api("POST", "/api/v1/namespaces/default/pods",
                          _pod(name, "nvidia.com/gpu", "ls /dev/nvidia[0-9]*; sleep 100000"))
    assert created.status == 201, created
    path = f"/api/v1/namespaces/default/pods/{name}"
    try:
        pod = cluster.wait("the pod running", lambda: (
            lambda p: p if p["status"].get("phase") == "Running" else None)(cluster.get(path)))
        checkpoint = json.loads(c.exec("cat", "/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint").stdout)
        entries = [e for e in checkpoint["Data"]["PodDeviceEntries"] if e["PodUID"] == pod["metadata"]["uid"]]
        given = [d for ids in entries[0]["DeviceIDs"].values() for d in ids]
        gpu = next(g for g in _status(cluster)["gpus"] if g["uuid"] in given)
        series = re.compile(r"^DCGM_FI_DEV_GPU_TEMP\{[^}]*gpu=\"" + str(gpu["index"]) + r"\"[^}]*\}", re.M)

        def attributed() -> Optional[str]:
            text = c.exec("curl", "-fsS", "127.0.0.1:9445/metrics").stdout
            line = next((m.group(0) for m in series.finditer(text)), "")
            return line if f'pod="{name}"' in line else None

        line = cluster.wait("the pod on its GPU's series", attributed, timeout=240)
        assert 'namespace="default"' in line and 'container="gpu"' in line, line
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)
        cluster.wait("nvidia.com/gpu: 8 after the restart", lambda: _gpus(cluster) == ("8", "8"))
        after = cluster.get(path)
        assert after["status"]["phase"] == "Running", after["status"]
        assert [s["restartCount"] for s in after["status"]["containerStatuses"]] == [0], after["status"]
        listed = c.exec(*CRICTL, "exec", "-s", next(iter(c.exec(*CRICTL, "ps", "-q", "--label",
                        f"io.kubernetes.pod.name={name}").stdout.split())), "ls", "/dev").stdout
        assert f"nvidia{gpu['index']}" in listed.split(), listed
        assert cluster.wait("the pod on its GPU's series again", attributed, timeout=240)
    finally:
        cluster.api("DELETE", path + "?gracePeriodSeconds=0")
        c.sh(f"cat > /etc/gpu-agent/config.yaml <<'EOF'\n{original}EOF")
        c.exec("systemctl", "restart", "gpu-agent", timeout=300)


SHIM = Path(__file__).parents[3] / "packaging/kubernetes/gpu-agent-shim.yaml"


def test_the_shim_runs_as_a_pod_and_its_readiness_is_the_agents(cluster: rig.Cluster) -> None:
    """packaging/kubernetes/gpu-agent-shim.yaml applied as the admin; its pod made as the DaemonSet
    controller would (no controller-manager here: the template with the node's name), with the sandbox
    image standing in for pause (nothing is pulled). The kubelet's readiness probe is the agent's /readyz:
    Ready, then not ready while an NVML call hangs (the agent's readiness fails), then Ready again."""
    import yaml

    documents = {d["kind"]: d for d in yaml.safe_load_all(SHIM.read_text())}
    namespace = documents["Namespace"]["metadata"]["name"]
    for path, body in (("/api/v1/namespaces", documents["Namespace"]),
                       (f"/api/v1/namespaces/{namespace}/serviceaccounts",
                        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}),
                       ("/apis/node.k8s.io/v1/runtimeclasses", documents["RuntimeClass"]),
                       (f"/apis/apps/v1/namespaces/{namespace}/daemonsets", documents["DaemonSet"])):
        made = cluster.api("POST", path, body)
        assert made.status in (201, 409), (path, made)
    c = cluster.container
    pause = rig.import_images(c)
    template = documents["DaemonSet"]["spec"]["template"]
    spec = {**template["spec"], "nodeName": NODE}
    spec["containers"] = [{**spec["containers"][0], "image": pause, "imagePullPolicy": "Never"}]
    name = "gpu-agent-shim-" + NODE
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": name}, "spec": spec}
    made = cluster.api("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    assert made.status == 201, made
    path = f"/api/v1/namespaces/{namespace}/pods/{name}"

    def ready(want: str) -> Callable[[], Optional[dict[str, Any]]]:
        def check() -> Optional[dict[str, Any]]:
            found = cluster.get(path)
            condition = next((c for c in found["status"].get("conditions", []) if c["type"] == "Ready"), None)
            return found if condition and condition["status"] == want else None
        return check

    try:
        cluster.wait("the shim's pod Ready", ready("True"), timeout=240)
        c.exec(*ONE_SHOT, "sim", "fail", "nvmlDeviceGetTemperature", "--error", "hang")
        try:
            cluster.wait("the shim's pod not ready with the agent", ready("False"), timeout=120)
            assert c.exec("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "127.0.0.1:9445/readyz",
                          check=False).stdout == "503"
        finally:
            c.exec(*ONE_SHOT, "sim", "clear")
        cluster.wait("the shim's pod Ready again", ready("True"), timeout=120)
    finally:
        cluster.api("DELETE", path + "?gracePeriodSeconds=0")


# ---- parity: the emulator (tests/kube_emulator.py) and the real apiserver answer alike ------------------

OTHER = "gpu-node-2"  # a Node the admin makes: another node's, to the node's credentials


@dataclass(frozen=True)
class Ask:
    """One request, sent as `who` (node: the kubelet's certificate; admin: system:masters; foreign: a
    certificate of another CA; anonymous: none) to both servers; `keep` picks what of a 2xx answer is compared."""

    why: str
    who: str
    method: str
    path: str
    body: Any = None
    content_type: str = STRATEGIC_MERGE_PATCH
    keep: Optional[Callable[[Any], Any]] = None
    mask: str = ""  # a pattern of the error message that holds each server's own data, left out of the comparison


def _labels(*keys: str) -> Callable[[Any], Any]:
    return lambda node: {key: node["metadata"].get("labels", {}).get(key) for key in keys}


def _gpu_condition(node: Any) -> Any:
    found = _condition(node, "GPUHealthy")
    return found and {k: v for k, v in found.items() if k != "lastHeartbeatTime" or v is not None}


PARITY = (
    Ask("reads another node", "node", "GET", f"/api/v1/nodes/{OTHER}"),
    Ask("lists all nodes", "node", "GET", "/api/v1/nodes"),
    Ask("patches another node", "node", "PATCH", f"/api/v1/nodes/{OTHER}",
        {"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}}),
    Ask("patches another node's status", "node", "PATCH", f"/api/v1/nodes/{OTHER}/status",
        {"status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}}),
    Ask("sets labels NodeRestriction lets a node set", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"nvidia.com/parity": "1", "feature.node.kubernetes.io/pci-10de.present": "true",
                                 "kubelet.kubernetes.io/x": "y", "topology.kubernetes.io/zone": "z1",
                                 "node.kubernetes.io/instance-type": "p5"}}}, MERGE_PATCH,
        _labels("nvidia.com/parity", "topology.kubernetes.io/zone", "node.kubernetes.io/instance-type")),
    Ask("sets labels NodeRestriction refuses", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"node-role.kubernetes.io/gpu": "", "example.k8s.io/a": "b",
                                 "node-restriction.kubernetes.io/pool": "x", "nvidia.com/ok": "1"}}}, MERGE_PATCH),
    Ask("a refused patch applies nothing of itself", "node", "GET", f"/api/v1/nodes/{NODE}",
        keep=_labels("nvidia.com/ok")),
    Ask("sets a beta.kubernetes.io label not the kubelet's", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"beta.kubernetes.io/fluentd-ds-ready": "true"}}}),
    Ask("the admin sets a node-role label", "admin", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"node-role.kubernetes.io/worker": ""}}}, MERGE_PATCH,
        _labels("node-role.kubernetes.io/worker")),
    Ask("removes the node-role label", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"node-role.kubernetes.io/worker": None}}}, MERGE_PATCH),
    Ask("removes its taints", "node", "PATCH", f"/api/v1/nodes/{NODE}", {"spec": {"taints": None}}, MERGE_PATCH),
    Ask("removes its taints through /status", "node", "PATCH", f"/api/v1/nodes/{NODE}/status",
        {"spec": {"taints": []}}, MERGE_PATCH),
    Ask("cordons itself", "node", "PATCH", f"/api/v1/nodes/{NODE}", {"spec": {"unschedulable": True}},
        STRATEGIC_MERGE_PATCH, lambda node: node["spec"].get("unschedulable")),
    Ask("uncordons itself", "node", "PATCH", f"/api/v1/nodes/{NODE}", {"spec": {"unschedulable": None}},
        STRATEGIC_MERGE_PATCH, lambda node: node["spec"].get("unschedulable")),
    Ask("a condition's times, RFC 3339 with an offset and a fraction", "node", "PATCH",
        f"/api/v1/nodes/{NODE}/status",
        {"status": {"conditions": [{"type": "GPUHealthy", "status": "False", "reason": "XidError",
                                    "message": "Xid 79 on GPU 3",
                                    "lastHeartbeatTime": "2025-01-02T03:04:05.123456+01:00",
                                    "lastTransitionTime": "2025-01-02T03:04:05Z"}]}},
        keep=_gpu_condition),
    Ask("a condition merged by type, a field set to null", "node", "PATCH", f"/api/v1/nodes/{NODE}/status",
        {"status": {"conditions": [{"type": "GPUHealthy", "status": "True", "reason": "AllGood", "message": None}]}},
        keep=_gpu_condition),
    Ask("a condition without its merge key", "node", "PATCH", f"/api/v1/nodes/{NODE}/status",
        {"status": {"conditions": [{"status": "True"}]}}),
    Ask("a condition sent to the main resource is dropped", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"status": {"conditions": [{"type": "GPUParity", "status": "True"}]}},
        keep=lambda node: _condition(node, "GPUParity")),
    Ask("a label sent through /status is kept", "node", "PATCH", f"/api/v1/nodes/{NODE}/status",
        {"metadata": {"labels": {"nvidia.com/via-status": "yes"}}}, keep=_labels("nvidia.com/via-status")),
    Ask("a condition deleted by $patch", "node", "PATCH", f"/api/v1/nodes/{NODE}/status",
        {"status": {"conditions": [{"type": "GPUHealthy", "$patch": "delete"}]}}, keep=_gpu_condition),
    Ask("an invalid label value", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"nvidia.com/bad": "-x-"}}}, MERGE_PATCH),
    Ask("an invalid label key", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"nvidia.com/-bad-": "x"}}}, MERGE_PATCH),
    Ask("an invalid annotation key", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"annotations": {"nvidia.com/-bad-": "x"}}}, MERGE_PATCH),
    Ask("an unknown directive in a strategic merge patch", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"$foo": "x"}}),
    Ask("an unknown $patch in a strategic merge patch", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"$patch": "foo"}}}),
    Ask("a list element that is not an object", "node", "PATCH", f"/api/v1/nodes/{NODE}/status",
        {"status": {"conditions": ["x"]}}, mask=r"(?<=identical: \[)\[.*\](?= \[x\]\]$)"),
    Ask("a merge patch with a resourceVersion that is no longer the Node's", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"resourceVersion": "1", "labels": {"nvidia.com/stale": "1"}}}, MERGE_PATCH),
    Ask("a strategic merge patch of the status with a stale resourceVersion", "node", "PATCH",
        f"/api/v1/nodes/{NODE}/status",
        {"metadata": {"resourceVersion": "1"}, "status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}}),
    Ask("a stale patch applies nothing of itself", "node", "GET", f"/api/v1/nodes/{NODE}",
        keep=_labels("nvidia.com/stale")),
    Ask("a patch in plain JSON", "node", "PATCH", f"/api/v1/nodes/{NODE}",
        {"metadata": {"labels": {"a": "b"}}}, "application/json"),
    Ask("a node that does not exist, to the admin", "admin", "GET", "/api/v1/nodes/no-such-node"),
    Ask("a certificate of another CA", "foreign", "GET", f"/api/v1/nodes/{NODE}"),
    Ask("no credentials", "anonymous", "GET", f"/api/v1/nodes/{NODE}"),
)


def _answer(status: int, body: Any, ask: Ask) -> Any:
    if 200 <= status < 300:
        return (status, ask.keep(body) if ask.keep else None)
    if isinstance(body, dict):
        message = re.sub(ask.mask, "...", str(body.get("message"))) if ask.mask else body.get("message")
        return (status, body.get("reason"), message, body.get("details"))
    return (status, body)


def _ask_emulator(emulator: KubeEmulator, who: dict[str, Any], ask: Ask) -> Any:
    connection = http.client.HTTPSConnection("127.0.0.1", emulator.port, timeout=30,
                                             context=emulator.client_ssl_context(who[ask.who]))
    try:
        headers = {"Accept": "application/json"}
        data = None
        if ask.body is not None:
            data, headers["Content-Type"] = json.dumps(ask.body).encode(), ask.content_type
        connection.request(ask.method, ask.path, body=data, headers=headers)
        response = connection.getresponse()
        raw = response.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode(errors="replace")
        return _answer(response.status, body, ask)
    finally:
        connection.close()


def _ask_cluster(cluster: rig.Cluster, who: dict[str, Any], ask: Ask) -> Any:
    credentials = who[ask.who]
    answer = cluster.api(ask.method, ask.path, ask.body, ask.content_type,
                         cert=credentials.combined_path if credentials else None, anonymous=credentials is None)
    return _answer(answer.status, answer.body, ask)


def test_the_emulator_answers_as_the_real_apiserver(cluster: rig.Cluster) -> None:
    """Each request of PARITY to the emulator and to the apiserver, in turn; every answer that differs is
    listed (tests/kube_emulator.py's claims, checked once against the real thing)."""
    other = cluster.api("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": OTHER}})
    assert other.status in (201, 409), other
    with KubeEmulator(pki=cluster.pki, nodes=(NODE, OTHER), anonymous_auth=True) as emulator:
        who = {"node": cluster.pki.node_cert(NODE), "admin": cluster.admin, "anonymous": None,
               "foreign": cluster.pki.node_cert(NODE, untrusted=True)}
        differences = []
        for ask in PARITY:
            real, emulated = _ask_cluster(cluster, who, ask), _ask_emulator(emulator, who, ask)
            if real != emulated:
                differences.append(f"{ask.why} ({ask.who} {ask.method} {ask.path}):\n"
                                   f"    apiserver {real}\n    emulator  {emulated}")
    assert not differences, "\n".join(differences)



# ---- parity: a request kube-apiserver's priority and fairness refuses (429) ---------------------------------

FLOW = "gpu-agent-parity"  # the FlowSchema, its priority level, and the namespace of the seat holder's list
FLOWCONTROL = "/apis/flowcontrol.apiserver.k8s.io/v1"
# A level with no seats of its own, none borrowed, that rejects rather than queues: a request is let in
# while nothing of the level executes (queueset.canAccommodateSeatsLocked), and refused while one does.
PRIORITY_LEVEL = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
                  "metadata": {"name": FLOW},
                  "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 0, "lendablePercent": 0,
                                                          "borrowingLimitPercent": 0,
                                                          "limitResponse": {"type": "Reject"}}}}
HOLDER_OBJECTS, HOLDER_BYTES = 16, 900_000  # a list of ~14 MiB: more than the kernel buffers between the two


def _flow_schema(user: str) -> dict[str, Any]:
    return {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": FLOW},
            "spec": {"priorityLevelConfiguration": {"name": FLOW}, "matchingPrecedence": 90,
                     "distinguisherMethod": {"type": "ByUser"},
                     "rules": [{"subjects": [{"kind": "User", "user": {"name": user}}],
                                "resourceRules": [{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"],
                                                   "clusterScope": True, "namespaces": ["*"]}]}]}}


@dataclass(frozen=True)
class RawAnswer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes

    def wire(self) -> tuple[Any, ...]:
        """What a client reads of a refusal: the status, the headers that say what the body is and when to
        come back, and the body."""
        return (self.status, *(self.headers.get(name) for name in ("content-type", "x-content-type-options",
                                                                  "retry-after")), self.body)


def _raw_cluster(cluster: rig.Cluster, method: str, path: str, cert: Path) -> RawAnswer:
    argv = ["nsenter", "-t", str(cluster.container.init_pid), "-n", "curl", "-sS", "--http1.1", "-i",
            "--cacert", str(cluster.pki.ca_path), "--cert", str(cert), "-X", method, rig.API + path]
    done = subprocess.run(argv, capture_output=True, timeout=60, stdin=subprocess.DEVNULL, check=True)
    head, _, body = done.stdout.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return RawAnswer(int(status_line.split()[1]), headers, body)


def _raw_emulator(emulator: KubeEmulator, method: str, path: str, credentials: Any) -> RawAnswer:
    connection = http.client.HTTPSConnection("127.0.0.1", emulator.port, timeout=30,
                                             context=emulator.client_ssl_context(credentials))
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return RawAnswer(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()


def _make_blobs(cluster: rig.Cluster, work: Path) -> None:
    blob = base64.b64encode(os.urandom(HOLDER_BYTES * 3 // 4)).decode()
    for n in range(HOLDER_OBJECTS):
        body = work / "configmap.json"
        body.write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": f"blob-{n}", "namespace": FLOW}, "data": {"blob": blob}}))
        done = rig.run(["nsenter", "-t", str(cluster.container.init_pid), "-n", "curl", "-sS", "-o", "/dev/null",
                        "-w", "%{http_code}", "--cacert", str(cluster.pki.ca_path), "--cert",
                        str(cluster.admin.combined_path), "-H", "Content-Type: application/json",
                        "--data-binary", f"@{body}", f"{rig.API}/api/v1/namespaces/{FLOW}/configmaps"],
                       timeout=60, check=False)
        assert done.stdout in ("201", "409"), done


def _slow_list(cluster: rig.Cluster, cert: Path) -> subprocess.Popen[str]:
    """The large ConfigMaps listed and read at 1 KiB/s: the handler blocks writing the answer, and so keeps
    its seat of the priority level, until the reader is killed."""
    return subprocess.Popen(["nsenter", "-t", str(cluster.container.init_pid), "-n", "curl", "-sS", "--http1.1",
                             "--limit-rate", "1K", "-o", "/dev/null", "-w", "%{http_code} %{size_download}",
                             "--cacert", str(cluster.pki.ca_path), "--cert", str(cert),
                             f"{rig.API}/api/v1/namespaces/{FLOW}/configmaps"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_request_priority_and_fairness_refuses_is_answered_as_the_emulator_answers_429(
        cluster: rig.Cluster, tmp_path: Path) -> None:
    """The emulator's 429 (fail_next(status=429)) is what kube-apiserver's priority and fairness sends:
    a FlowSchema puts another node's user on a level with no seats that rejects; one list of that user
    reads its answer slowly and so keeps executing; that user's next request is refused. Its status, the
    headers a client reads and its body, from both servers."""
    user = f"system:node:{OTHER}"
    cert = cluster.pki.node_cert(OTHER)
    made = [cluster.api("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": OTHER}}),
            cluster.api("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                       "metadata": {"name": FLOW}}),
            cluster.api("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{FLOW}/roles",
                        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": FLOW},
                         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}]}),
            cluster.api("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{FLOW}/rolebindings",
                        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                         "metadata": {"name": FLOW},
                         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": FLOW},
                         "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}),
            cluster.api("POST", f"{FLOWCONTROL}/prioritylevelconfigurations", PRIORITY_LEVEL),
            cluster.api("POST", f"{FLOWCONTROL}/flowschemas", _flow_schema(user))]
    assert all(answer.status in (201, 409) for answer in made), made
    schema = cluster.get(f"{FLOWCONTROL}/flowschemas/{FLOW}")["metadata"]["uid"]

    def classified() -> bool:  # the apiserver's flow control takes a new schema up on its own time
        answer = _raw_cluster(cluster, "GET", f"/api/v1/nodes/{OTHER}", cert.combined_path)
        return answer.headers.get("x-kubernetes-pf-flowschema-uid") == schema

    cluster.wait("the other node's requests classified by the new FlowSchema", classified, timeout=60)
    _make_blobs(cluster, tmp_path)
    holders = [_slow_list(cluster, cert.combined_path)]
    try:
        def refused() -> Optional[RawAnswer]:
            # A list refused itself (a request of the level had not yet finished when it came) is sent again.
            if holders[-1].poll() is not None:
                holders.append(_slow_list(cluster, cert.combined_path))
                return None
            answer = _raw_cluster(cluster, "GET", f"/api/v1/nodes/{OTHER}", cert.combined_path)
            return answer if answer.status == 429 else None

        real = cluster.wait("the other node's requests refused while its list holds the level's seat", refused,
                            timeout=60)
        assert isinstance(real, RawAnswer), real
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
        for path in (f"{FLOWCONTROL}/flowschemas/{FLOW}", f"{FLOWCONTROL}/prioritylevelconfigurations/{FLOW}",
                     f"/api/v1/namespaces/{FLOW}/configmaps"):
            cluster.api("DELETE", path)
    with KubeEmulator(pki=cluster.pki, nodes=(NODE, OTHER)) as emulator:
        emulator.fail_next("*", 429)
        emulated = _raw_emulator(emulator, "GET", f"/api/v1/nodes/{OTHER}", cert)
    assert real.wire() == emulated.wire(), f"apiserver {real}\nemulator  {emulated}"
    # Priority and fairness also names the schema and level that refused (their UIDs); the agent reads neither.
    assert {"x-kubernetes-pf-flowschema-uid", "x-kubernetes-pf-prioritylevel-uid"} <= set(real.headers), real.headers

# Last of the module: a reload holds the device plugin off while it runs, and its requests spend the agent's
# budget; nothing after it depends on either.
UPGRADE_STATE = "nvidia.com/gpu-driver-upgrade-state"


def test_a_driver_reload_cordons_and_uncordons_with_the_nodes_credentials(cluster: rig.Cluster) -> None:
    """A driver upgraded on disk under the loaded module (`sim install-driver`), then `gpu-agent driver
    reload`: the agent's own patches, as the apiserver logged them, cordon the Node, move the upgrade-state
    label through its values and uncordon it; the plugin registers again and the GPUs come back."""
    c = cluster.container
    _room_for(cluster, RATE)
    ours = len(_writes_by(cluster, AGENT))
    c.exec(*ONE_SHOT, "sim", "install-driver", "570.124.06")
    done = c.exec(*ONE_SHOT, "driver", "reload", "--json", check=False, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    patches = [w.get("requestObject") or {} for w in _writes_by(cluster, AGENT)[ours:]]
    states = [p["metadata"]["labels"][UPGRADE_STATE] for p in patches
              if UPGRADE_STATE in (p.get("metadata") or {}).get("labels", {})]
    cordons = [p["spec"].get("unschedulable") for p in patches if "unschedulable" in (p.get("spec") or {})]
    assert states and states[-1] == "upgrade-done", (states, patches)
    assert "cordon-required" in states and states.index("cordon-required") < states.index("upgrade-done"), states
    assert cordons[:1] == [True] and cordons[-1] in (False, None), (cordons, patches)
    assert [e["user"]["username"] for e in _writes_by(cluster, AGENT)[ours:]] == [f"system:node:{NODE}"] * len(patches)
    node = cluster.node_object()
    assert not node["spec"].get("unschedulable") and node["metadata"]["labels"][UPGRADE_STATE] == "upgrade-done"
    cluster.wait("nvidia.com/gpu: 8 after the reload", lambda: _gpus(cluster) == ("8", "8"))

