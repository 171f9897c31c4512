"""The Kubernetes API server emulator behaves like kube-apiserver for a node's credentials.

Plain http.client + ssl requests, so these tests prove the emulator rather than the agent's client.
"""
from __future__ import annotations

import base64
import datetime as dt
import http.client
import json
import socket
import ssl
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import yaml
from kube_emulator import (
    JSON_PATCH,
    MERGE_PATCH,
    STRATEGIC_MERGE_PATCH,
    Credentials,
    KubeEmulator,
    KubePKI,
    write_kubeconfig,
)

NODE = "gpu-node-1"
OTHER = "gpu-node-2"
UNAUTHORIZED = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "Unauthorized", "reason": "Unauthorized", "code": 401}


@pytest.fixture(scope="module")
def pki() -> Iterator[KubePKI]:
    pki = KubePKI()
    yield pki
    pki.cleanup()


@pytest.fixture
def emu(pki: KubePKI) -> Iterator[KubeEmulator]:
    with KubeEmulator(pki=pki, hang_seconds=3.0) as emulator:
        yield emulator
        assert emulator.errors == []


@dataclass
class Response:
    status: int
    headers: http.client.HTTPMessage
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


class Client:
    """One keep-alive HTTPS connection with optional client certificate and token."""

    def __init__(self, emu: KubeEmulator, creds: Optional[Credentials] = None, token: Optional[str] = None,
                 timeout: float = 5.0, context: Optional[ssl.SSLContext] = None) -> None:
        self.context = context or emu.client_ssl_context(creds)
        self.emu, self.token, self.timeout = emu, token, timeout
        self.conn: Optional[http.client.HTTPSConnection] = None

    def request(self, method: str, path: str, body: Any = None, content_type: Optional[str] = None) -> Response:
        if self.conn is None:
            self.conn = http.client.HTTPSConnection("127.0.0.1", self.emu.port, context=self.context,
                                                    timeout=self.timeout)
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers["Content-Type"] = content_type or "application/json"
        try:
            self.conn.request(method, path, body=data, headers=headers)
            resp = self.conn.getresponse()
            return Response(resp.status, resp.headers, resp.read())
        except BaseException:
            self.close()
            raise

    def get(self, name: str = NODE, sub: str = "") -> Response:
        return self.request("GET", f"/api/v1/nodes/{name}" + (f"/{sub}" if sub else ""))

    def patch(self, body: Any, name: str = NODE, sub: str = "", content_type: str = STRATEGIC_MERGE_PATCH) -> Response:
        return self.request("PATCH", f"/api/v1/nodes/{name}" + (f"/{sub}" if sub else ""), body, content_type)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


@pytest.fixture
def kubelet(emu: KubeEmulator) -> Iterator[Client]:
    client = Client(emu, emu.node_credentials(NODE))
    yield client
    client.close()


@pytest.fixture
def admin(emu: KubeEmulator) -> Iterator[Client]:
    client = Client(emu, token=emu.admin_token())
    yield client
    client.close()


def conditions(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in node["status"]["conditions"]}


def condition(emu: KubeEmulator, ctype: str) -> dict[str, Any]:
    found = emu.condition(ctype)
    assert found is not None, f"no {ctype} condition on the node"
    return found


# ---- authentication -------------------------------------------------------------------------

def test_node_certificate_reads_its_own_node(emu: KubeEmulator, kubelet: Client) -> None:
    resp = kubelet.get()
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/json"
    node = resp.json
    assert (node["kind"], node["apiVersion"], node["metadata"]["name"]) == ("Node", "v1", NODE)
    assert isinstance(node["metadata"]["resourceVersion"], str) and node["metadata"]["resourceVersion"].isdigit()
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == NODE
    assert node["metadata"]["labels"]["node-role.kubernetes.io/worker"] == ""
    assert node["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]
    conds = node["status"]["conditions"]
    assert [c["type"] for c in conds] == ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready"]
    for cond in conds:
        assert list(cond) == ["type", "status", "lastHeartbeatTime", "lastTransitionTime", "reason", "message"]
    assert conditions(node)["Ready"]["status"] == "True" and conditions(node)["Ready"]["reason"] == "KubeletReady"
    record = emu.requests[-1]
    assert (record.user, record.groups) == (f"system:node:{NODE}", ("system:nodes", "system:authenticated"))


def test_no_credentials_is_401_with_a_status_body(emu: KubeEmulator) -> None:
    resp = Client(emu).get()
    assert resp.status == 401
    assert resp.headers["Content-Type"] == "application/json"
    assert resp.json == UNAUTHORIZED
    assert emu.requests[-1].user is None and emu.requests[-1].status == 401


def test_certificate_from_another_ca_and_expired_certificate_are_401(emu: KubeEmulator, pki: KubePKI) -> None:
    foreign = pki.node_cert(NODE, untrusted=True)
    assert Client(emu, foreign).get().status == 401
    now = dt.datetime.now(dt.timezone.utc)
    expired = pki.node_cert(NODE, not_before=now - dt.timedelta(days=2), not_after=now - dt.timedelta(days=1))
    resp = Client(emu, expired).get()
    assert (resp.status, resp.json) == (401, UNAUTHORIZED)


def test_bearer_tokens(emu: KubeEmulator) -> None:
    assert Client(emu, token="not-registered").get().status == 401
    emu.add_token("kubelet-token", f"system:node:{NODE}", ["system:nodes"])
    assert Client(emu, token="kubelet-token").get().status == 200
    assert Client(emu, token="kubelet-token").get(OTHER).status == 403
    admin = emu.admin_token()
    assert Client(emu, token=admin).get(OTHER).status == 200
    emu.remove_token("kubelet-token")
    assert Client(emu, token="kubelet-token").get().status == 401


def test_anonymous_access_when_enabled_is_forbidden_not_unauthorized(pki: KubePKI) -> None:
    with KubeEmulator(pki=pki, anonymous_auth=True) as emu:
        resp = Client(emu).get()
        assert resp.status == 403
        assert resp.json["message"] == (f'nodes "{NODE}" is forbidden: User "system:anonymous" cannot get resource '
                                        f'"nodes" in API group "" at the cluster scope')
        assert Client(emu, token="bogus").get().status == 401  # a bad credential is never anonymous


# ---- authorization and NodeRestriction ------------------------------------------------------

def test_node_cannot_read_another_node(kubelet: Client) -> None:
    resp = kubelet.get(OTHER)
    assert resp.status == 403
    assert resp.json == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": (f'nodes "{OTHER}" is forbidden: User "system:node:{NODE}" cannot get resource "nodes" in API '
                    f'group "" at the cluster scope: node \'{NODE}\' cannot read \'{OTHER}\', '
                    "only its own Node object"),
        "reason": "Forbidden", "details": {"name": OTHER, "kind": "nodes"}, "code": 403,
    }


def test_node_cannot_list_all_nodes(kubelet: Client) -> None:
    resp = kubelet.request("GET", "/api/v1/nodes")
    assert resp.status == 403 and "cannot read all nodes, only its own Node object" in resp.json["message"]


def test_node_cannot_patch_another_node(emu: KubeEmulator, kubelet: Client) -> None:
    before = emu.resource_version(OTHER)
    resp = kubelet.patch({"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}}, name=OTHER)
    assert resp.status == 403
    assert resp.json["message"] == (
        f'nodes "{OTHER}" is forbidden: node "{NODE}" is not allowed to modify node "{OTHER}"'
    )
    resp = kubelet.patch({"status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}},
                         name=OTHER, sub="status")
    assert resp.status == 403
    assert emu.resource_version(OTHER) == before
    assert "nvidia.com/gpu.present" not in emu.labels(OTHER)


def test_node_restriction_label_rules(emu: KubeEmulator, kubelet: Client, admin: Client) -> None:
    allowed = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
               "feature.node.kubernetes.io/pci-10de.present": "true",
               "kubelet.kubernetes.io/x": "y", "topology.kubernetes.io/zone": "z1",
               "node.kubernetes.io/instance-type": "p5"}
    resp = kubelet.patch({"metadata": {"labels": allowed}}, content_type=MERGE_PATCH)
    assert resp.status == 200, resp.json
    assert all(emu.labels()[k] == v for k, v in allowed.items())

    resp = kubelet.patch({"metadata": {"labels": {"node-role.kubernetes.io/gpu": "", "example.k8s.io/a": "b",
                                                  "node-restriction.kubernetes.io/pool": "x", "nvidia.com/ok": "1"}}},
                         content_type=MERGE_PATCH)
    assert resp.status == 403
    assert resp.json["message"] == (f'nodes "{NODE}" is forbidden: is not allowed to modify labels: example.k8s.io/a, '
                                    'node-restriction.kubernetes.io/pool, node-role.kubernetes.io/gpu')
    assert resp.json["details"] == {"name": NODE, "kind": "nodes"}
    assert "nvidia.com/ok" not in emu.labels()  # nothing of a refused patch is applied

    resp = kubelet.patch({"metadata": {"labels": {"node-role.kubernetes.io/worker": None}}}, content_type=MERGE_PATCH)
    assert resp.status == 403 and "node-role.kubernetes.io/worker" in resp.json["message"]
    resp = kubelet.patch({"metadata": {"labels": {"beta.kubernetes.io/fluentd-ds-ready": "true"}}})
    assert resp.status == 403  # only beta.kubernetes.io/os, arch and instance-type are the kubelet's

    # the same label set by a cluster admin is fine
    assert admin.patch({"metadata": {"labels": {"node-role.kubernetes.io/gpu": ""}}}).status == 200
    assert emu.labels()["node-role.kubernetes.io/gpu"] == ""


def test_node_cannot_change_its_taints(emu: KubeEmulator, kubelet: Client, admin: Client) -> None:
    resp = kubelet.patch({"spec": {"taints": None}}, content_type=MERGE_PATCH)
    assert resp.status == 403
    assert resp.json["message"] == f'nodes "{NODE}" is forbidden: node "{NODE}" is not allowed to modify taints'
    # even through /status, where spec would be dropped anyway: admission sees the patched object
    assert kubelet.patch({"spec": {"taints": []}}, sub="status", content_type=MERGE_PATCH).status == 403
    assert emu.get_node()["spec"]["taints"]
    assert admin.patch({"spec": {"taints": None}}, content_type=MERGE_PATCH).status == 200
    assert "taints" not in emu.get_node()["spec"]


# ---- patch semantics --------------------------------------------------------------------------

def test_merge_patch_null_deletes_and_maps_merge(emu: KubeEmulator, kubelet: Client) -> None:
    emu.set_labels({"nvidia.com/gpu.count": "8", "nvidia.com/mig.strategy": "single"})
    resp = kubelet.patch({"metadata": {"labels": {"nvidia.com/gpu.count": None, "nvidia.com/gpu.memory": "81559"},
                                       "annotations": {"nvidia.com/agent": "v1"}}}, content_type=MERGE_PATCH)
    assert resp.status == 200
    labels = resp.json["metadata"]["labels"]
    assert "nvidia.com/gpu.count" not in labels
    assert labels["nvidia.com/gpu.memory"] == "81559"
    assert labels["nvidia.com/mig.strategy"] == "single"  # untouched keys stay
    assert labels["kubernetes.io/hostname"] == NODE
    assert resp.json["metadata"]["annotations"]["nvidia.com/agent"] == "v1"
    assert emu.labels() == labels


def test_merge_patch_replaces_lists_so_it_drops_the_kubelets_conditions(emu: KubeEmulator, kubelet: Client) -> None:
    resp = kubelet.patch({"status": {"conditions": [{"type": "GPUHealthy", "status": "True", "reason": "AllGood"}]}},
                         sub="status", content_type=MERGE_PATCH)
    assert resp.status == 200
    assert [c["type"] for c in emu.get_node()["status"]["conditions"]] == ["GPUHealthy"]


def test_strategic_merge_of_conditions_keeps_the_kubelets(emu: KubeEmulator, kubelet: Client) -> None:
    ready_before = condition(emu, "Ready")
    resp = kubelet.patch({"status": {"conditions": [
        {"type": "GPUHealthy", "status": "False", "reason": "XidError", "message": "Xid 79 on GPU 3",
         "lastHeartbeatTime": "2025-01-02T03:04:05.123456+01:00", "lastTransitionTime": "2025-01-02T03:04:05Z"}]}},
        sub="status")
    assert resp.status == 200, resp.json
    conds = conditions(emu.get_node())
    assert list(conds) == ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready", "GPUHealthy"]
    assert conds["Ready"] == ready_before
    assert conds["GPUHealthy"]["lastHeartbeatTime"] == "2025-01-02T02:04:05Z"  # RFC 3339, seconds, UTC
    # merge by type: only the named fields of the existing entry change
    assert kubelet.patch({"status": {"conditions": [{"type": "GPUHealthy", "status": "True", "reason": "AllGood",
                                                     "message": None}]}}, sub="status").status == 200
    gpu = condition(emu, "GPUHealthy")
    assert (gpu["status"], gpu["reason"], "message" in gpu) == ("True", "AllGood", False)
    assert gpu["lastTransitionTime"] == "2025-01-02T03:04:05Z"
    # $patch: delete removes one entry by key
    assert kubelet.patch({"status": {"conditions": [{"type": "GPUHealthy", "$patch": "delete"}]}},
                         sub="status").status == 200
    assert list(conditions(emu.get_node())) == ["MemoryPressure", "DiskPressure", "PIDPressure", "Ready"]
    # an entry without the merge key is refused the way kube refuses it
    resp = kubelet.patch({"status": {"conditions": [{"status": "True"}]}}, sub="status")
    assert resp.status == 500 and "does not contain declared merge key: type" in resp.json["message"]


def test_condition_without_times_reads_back_null_times(kubelet: Client) -> None:
    resp = kubelet.patch({"status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}}, sub="status")
    gpu = conditions(resp.json)["GPUHealthy"]
    assert gpu == {"type": "GPUHealthy", "status": "True", "lastHeartbeatTime": None, "lastTransitionTime": None}


def test_main_resource_ignores_status_and_status_ignores_spec(emu: KubeEmulator, kubelet: Client,
                                                              admin: Client) -> None:
    rv = emu.resource_version()
    resp = kubelet.patch({"status": {"conditions": [{"type": "GPUHealthy", "status": "True"}]}})
    assert resp.status == 200
    assert emu.condition("GPUHealthy") is None and emu.resource_version() == rv
    resp = admin.patch({"spec": {"unschedulable": True}, "status": {"phase": "Running"}}, sub="status")
    assert resp.status == 200
    assert "unschedulable" not in emu.get_node()["spec"] and emu.get_node()["status"]["phase"] == "Running"
    # as in kube-apiserver, metadata written through /status is kept
    assert kubelet.patch({"metadata": {"labels": {"nvidia.com/via-status": "yes"}}}, sub="status").status == 200
    assert emu.labels()["nvidia.com/via-status"] == "yes"


def test_unsupported_content_type_is_415(kubelet: Client) -> None:
    # JSON patch is a real server's, but the agent never sends it: the emulator does not serve it.
    ops = [{"op": "add", "path": "/metadata/labels/a", "value": "b"}]
    assert kubelet.patch(ops, content_type=JSON_PATCH).status == 415
    resp = kubelet.patch({"metadata": {"labels": {"a": "b"}}}, content_type="application/json")
    assert resp.status == 415
    assert resp.json["reason"] == "UnsupportedMediaType"
    # kube-apiserver v1.34.4's words for a content type that is no patch type (tests/e2e/cluster)
    assert (resp.json["message"], resp.json["details"]) == ("415: Unsupported Media Type", {})


def test_unknown_node_is_404(admin: Client) -> None:
    for resp in (admin.get("no-such-node"), admin.patch({"metadata": {"labels": {"a": "b"}}}, name="no-such-node")):
        assert resp.status == 404
        assert resp.json == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                             "message": 'nodes "no-such-node" not found', "reason": "NotFound",
                             "details": {"name": "no-such-node", "kind": "nodes"}, "code": 404}


def test_invalid_label_value_is_422(emu: KubeEmulator, kubelet: Client) -> None:
    rv = emu.resource_version()
    resp = kubelet.patch({"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA H100 80GB HBM3"}}})
    assert resp.status == 422
    body = resp.json
    assert body["reason"] == "Invalid"
    assert body["message"].startswith(f'Node "{NODE}" is invalid: metadata.labels: Invalid value: '
                                      '"NVIDIA H100 80GB HBM3": a valid label must be an empty string')
    assert body["details"]["causes"][0]["field"] == "metadata.labels"
    assert kubelet.patch({"metadata": {"labels": {"nvidia.com/n": 8}}}).status == 422  # not a string
    assert emu.resource_version() == rv


def test_unknown_fields_warn_or_fail_when_strict(emu: KubeEmulator, kubelet: Client) -> None:
    resp = kubelet.patch({"metadata": {"lables": {"a": "b"}}})
    assert resp.status == 200
    assert resp.headers["Warning"] == '299 - "unknown field \\"metadata.lables\\""'
    resp = kubelet.request("PATCH", f"/api/v1/nodes/{NODE}?fieldValidation=Strict",
                           {"metadata": {"lables": {"a": "b"}}}, STRATEGIC_MERGE_PATCH)
    assert resp.status == 400 and resp.json["message"] == 'strict decoding error: unknown field "metadata.lables"'


# ---- resourceVersion ---------------------------------------------------------------------------

def test_stale_resource_version_is_409(emu: KubeEmulator, kubelet: Client) -> None:
    stale = emu.resource_version()
    emu.set_labels({"example.com/other-actor": "was-here"})  # someone else writes first
    current = emu.resource_version()
    assert int(current) > int(stale)
    resp = kubelet.patch({"metadata": {"resourceVersion": stale, "labels": {"nvidia.com/x": "1"}}})
    assert resp.status == 409
    assert resp.json == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": (f'Operation cannot be fulfilled on nodes "{NODE}": the object has been modified; please apply '
                    'your changes to the latest version and try again'),
        "reason": "Conflict", "details": {"name": NODE, "kind": "nodes"}, "code": 409,
    }
    assert "nvidia.com/x" not in emu.labels()
    resp = kubelet.patch({"metadata": {"resourceVersion": current, "labels": {"nvidia.com/x": "1"}}})
    assert resp.status == 200 and int(resp.json["metadata"]["resourceVersion"]) > int(current)


def test_noop_patch_keeps_resource_version_and_a_change_bumps_it(emu: KubeEmulator, kubelet: Client) -> None:
    rv = emu.resource_version()
    hostname = {"metadata": {"labels": {"kubernetes.io/hostname": NODE}}}
    for body, ctype in ((hostname, MERGE_PATCH), (hostname, STRATEGIC_MERGE_PATCH), ({}, MERGE_PATCH),
                        ({"metadata": {"labels": {"no-such-label": None}}}, MERGE_PATCH)):
        resp = kubelet.patch(body, content_type=ctype)
        assert resp.status == 200 and resp.json["metadata"]["resourceVersion"] == rv
    ready = condition(emu, "Ready")
    same = {"status": {"conditions": [dict(ready)]}}
    assert kubelet.patch(same, sub="status").json["metadata"]["resourceVersion"] == rv
    resp = kubelet.patch({"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}})
    assert int(resp.json["metadata"]["resourceVersion"]) > int(rv)


def test_direct_modifications_bump_resource_version(emu: KubeEmulator) -> None:
    rv = int(emu.resource_version())
    emu.set_condition("Ready", "False", "KubeletNotReady", "container runtime is down")
    ready = condition(emu, "Ready")
    assert int(emu.resource_version()) > rv
    assert (ready["status"], ready["reason"]) == ("False", "KubeletNotReady")
    rv = int(emu.resource_version())
    emu.set_labels({"kubernetes.io/hostname": NODE})  # no change
    assert int(emu.resource_version()) == rv
    emu.kubelet_heartbeat(at=dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc))
    assert condition(emu, "Ready")["lastHeartbeatTime"] == "2030-01-01T00:00:00Z"
    assert int(emu.resource_version()) > rv
    with pytest.raises(ValueError):
        emu.modify_node(NODE, lambda n: n["metadata"].update(lables={}))


# ---- faults and the request log ----------------------------------------------------------------

def test_injected_errors_then_recovery(emu: KubeEmulator, kubelet: Client) -> None:
    fault = emu.fail_next(f"/api/v1/nodes/{NODE}", 500, count=2)
    first, second, third = kubelet.get(), kubelet.get(), kubelet.get()
    assert (first.status, second.status, third.status) == (500, 500, 200)
    assert first.json["reason"] == "InternalError" and first.json["kind"] == "Status"
    assert fault.hits == 2 and fault.remaining == 0
    emu.fail_next("/api/v1/nodes/*", 503, method="PATCH", retry_after=7)
    assert kubelet.get().status == 200  # method filter: GET passes
    resp = kubelet.patch({"metadata": {"labels": {"a.example.com/b": "c"}}})
    assert resp.status == 503 and resp.headers["Retry-After"] == "7"
    assert "a.example.com/b" not in emu.labels()
    assert [r.fault for r in emu.requests] == ["status", "status", None, None, "status"]


def test_a_conflict_comes_only_from_a_resource_version_another_writer_made_stale(emu: KubeEmulator,
                                                                                 kubelet: Client) -> None:
    """kube-apiserver's registry Store.Update (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/
    store.go, commit 0021a864) answers 409 only where the object the patch makes carries a resourceVersion
    other than the stored one: a patch without one is applied to the Node as stored, never a conflict."""
    with pytest.raises(ValueError, match="write_next"):
        emu.fail_next("*", 409)
    fault = emu.write_next(f"/api/v1/nodes/{NODE}*", count=2)
    read = emu.resource_version()
    resp = kubelet.patch({"metadata": {"resourceVersion": read, "labels": {"nvidia.com/x": "1"}}})
    assert resp.status == 409 and resp.json["reason"] == "Conflict" and "nvidia.com/x" not in emu.labels()
    assert emu.annotations()["emulator.example.com/concurrent-writer"] == "1"
    resp = kubelet.patch({"metadata": {"labels": {"nvidia.com/x": "1"}}})  # no precondition: no conflict
    assert resp.status == 200 and emu.labels()["nvidia.com/x"] == "1"
    assert emu.annotations()["emulator.example.com/concurrent-writer"] == "2"  # written on top of the other
    assert fault.remaining == 0 and kubelet.get().status == 200  # reads never meet the other writer
    current = emu.resource_version()
    assert kubelet.patch({"metadata": {"resourceVersion": current, "labels": {"nvidia.com/x": "2"}}},
                         sub="status").status == 200
    assert [r.fault for r in emu.requests] == [None] * 4


def test_a_429_is_sent_as_the_apiservers_filters_send_it(emu: KubeEmulator, kubelet: Client) -> None:
    """max-in-flight and priority-and-fairness: `Retry-After: 1` and a plain-text line (maxinflight.go,
    tooManyRequests); the shutdown filter: `Retry-After: 5` (with_retry_after.go); both in
    staging/src/k8s.io/apiserver/pkg/server/filters/ of kubernetes/kubernetes, commit 04791b49."""
    emu.fail_next(f"/api/v1/nodes/{NODE}", 429)
    resp = kubelet.get()
    assert (resp.status, resp.headers["Retry-After"], resp.raw) == (429, "1",
                                                                   b"Too many requests, please try again later.\n")
    assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
    emu.fail_next(f"/api/v1/nodes/{NODE}", 429, retry_after=5,
                  message="The apiserver is shutting down, please try again later.")
    resp = kubelet.get()
    assert (resp.status, resp.headers["Retry-After"]) == (429, "5") and b"shutting down" in resp.raw
    assert kubelet.get().status == 200


def test_hang_times_the_client_out_then_the_server_recovers(emu: KubeEmulator, pki: KubePKI) -> None:
    emu.hang_next("/api/v1/nodes/*", seconds=30.0)  # ends in a closed connection, or at stop(): never a timeout
    slow = Client(emu, emu.node_credentials(), timeout=0.3)
    with pytest.raises((socket.timeout, TimeoutError)):  # the client's own timeout fired
        slow.get()
    assert emu.requests[-1].fault == "hang" and emu.requests[-1].status is None
    assert Client(emu, emu.node_credentials()).get().status == 200  # other connections are served meanwhile


def test_hang_after_apply_changes_the_node_without_an_answer(emu: KubeEmulator) -> None:
    emu.hang_next(method="PATCH", seconds=1.0, apply=True)
    client = Client(emu, emu.node_credentials(), timeout=0.3)
    with pytest.raises((socket.timeout, TimeoutError)):
        client.patch({"metadata": {"labels": {"nvidia.com/applied": "yes"}}})
    assert emu.labels()["nvidia.com/applied"] == "yes"


def test_reset_closes_the_connection(emu: KubeEmulator, kubelet: Client) -> None:
    emu.reset_next()
    with pytest.raises((http.client.RemoteDisconnected, ConnectionError, ssl.SSLError)):
        kubelet.get()
    assert kubelet.get().status == 200


def test_request_log_records_what_was_sent(emu: KubeEmulator, kubelet: Client) -> None:
    assert emu.requests == []  # nothing was sent yet
    body = {"metadata": {"labels": {"nvidia.com/gpu.present": "true"}}}
    kubelet.patch(body, content_type=MERGE_PATCH)
    kubelet.get(OTHER)
    patch, get = emu.requests
    assert (patch.method, patch.path, patch.content_type, patch.json, patch.status) == (
        "PATCH", f"/api/v1/nodes/{NODE}", MERGE_PATCH, body, 200)
    assert patch.user == f"system:node:{NODE}" and patch.time <= time.time()
    assert (get.method, get.path, get.body, get.status) == ("GET", f"/api/v1/nodes/{OTHER}", b"", 403)
    assert len(emu.requests_for(method="PATCH")) == 1 and len(emu.requests_for(path="*/gpu-node-2")) == 1
    emu.clear_requests()
    assert emu.requests == []


def test_rate_window_counts_the_busiest_minute(emu: KubeEmulator, kubelet: Client) -> None:
    for _ in range(5):
        kubelet.get()
    assert emu.max_requests_in_window(60) == 5
    assert emu.max_requests_in_window(60, method="PATCH") == 0
    records = emu.requests
    for i, record in enumerate(records):  # pretend they were spread out 20 s apart
        record.monotonic = 1000.0 + 20 * i
    with emu._log_cond:
        emu._log[:] = records
    assert emu.max_requests_in_window(60) == 3


def test_wait_for_requests_from_another_thread(emu: KubeEmulator) -> None:
    creds = emu.node_credentials()
    threading.Timer(0.2, lambda: Client(emu, creds).get()).start()
    got = emu.wait_for_requests(1, method="GET", timeout=5)
    assert got[0].status == 200
    with pytest.raises(AssertionError):
        emu.wait_for_requests(2, method="GET", timeout=0.3)


# ---- kubeconfig and lifecycle --------------------------------------------------------------------

def _context_from_kubeconfig(path: Path, workdir: Path) -> tuple[str, ssl.SSLContext, Optional[str]]:
    config = yaml.safe_load(path.read_text())
    cluster = config["clusters"][0]["cluster"]
    user = config["users"][0]["user"]
    assert config["current-context"] == config["contexts"][0]["name"]
    if "certificate-authority-data" in cluster:
        ctx = ssl.create_default_context(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    else:
        ctx = ssl.create_default_context(cafile=cluster["certificate-authority"])
    if "client-certificate-data" in user:
        cert, key = workdir / "c.crt", workdir / "c.key"
        cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
        key.write_bytes(base64.b64decode(user["client-key-data"]))
        ctx.load_cert_chain(cert, key)
    elif "client-certificate" in user:
        ctx.load_cert_chain(user["client-certificate"], user["client-key"])
    return cluster["server"], ctx, user.get("token")


@pytest.mark.parametrize("mode,combined", [("cert-data", False), ("cert-files", False), ("cert-files", True),
                                           ("token", False)])
def test_kubeconfig_modes_authenticate_as_the_node(emu: KubeEmulator, tmp_path: Path, mode: str,
                                                   combined: bool) -> None:
    path = write_kubeconfig(tmp_path / "kubelet.conf", emu, user=f"system:node:{NODE}", mode=mode,
                            combined_pem=combined)
    server, ctx, token = _context_from_kubeconfig(path, tmp_path)
    assert server == emu.url
    user = yaml.safe_load(path.read_text())["users"][0]["user"]
    if mode == "cert-files":
        assert (user["client-certificate"] == user["client-key"]) is combined
        assert b"PRIVATE KEY" in Path(user["client-key"]).read_bytes()
    client = Client(emu, token=token, context=ctx)
    assert client.get().status == 200
    assert client.get(OTHER).status == 403
    assert emu.requests[-1].user == f"system:node:{NODE}"
    assert (path.stat().st_mode & 0o777) == 0o600


def test_kubeconfig_for_an_admin_certificate(emu: KubeEmulator, tmp_path: Path) -> None:
    creds = emu.client_credentials("kubernetes-admin", ["system:masters"])
    _, ctx, _ = _context_from_kubeconfig(emu.write_kubeconfig(tmp_path / "admin.conf", user=creds), tmp_path)
    assert Client(emu, context=ctx).get(OTHER).status == 200


def test_grants_for_other_users(emu: KubeEmulator) -> None:
    reader = emu.add_token("reader", "jane", ["dev"])
    assert Client(emu, token=reader).get(OTHER).status == 403
    emu.grant("dev", verbs=["get"], resources=["nodes"])
    assert Client(emu, token=reader).get(OTHER).status == 200
    resp = Client(emu, token=reader).patch({"metadata": {"labels": {"a": "b"}}}, name=OTHER)
    assert resp.status == 403
    assert resp.json["message"] == (f'nodes "{OTHER}" is forbidden: User "jane" cannot patch resource "nodes" in '
                                    'API group "" at the cluster scope')


def test_stop_is_prompt_with_a_hanging_request_and_frees_the_port(pki: KubePKI) -> None:
    emu = KubeEmulator(pki=pki, hang_seconds=30).start()
    port = emu.port
    emu.hang_next()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            Client(emu, emu.node_credentials(), timeout=20).get()
        except BaseException as exc:  # the hang ends with a closed connection
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    emu.wait_for_requests(1, completed=False)
    emu.stop()
    thread.join(10)  # the client would wait 20 s, the hang 30 s: only stop() ends it sooner
    assert not thread.is_alive() and errors
    assert not isinstance(errors[0], (socket.timeout, TimeoutError)), errors  # cut off, not timed out
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_pki_files_and_separate_directory() -> None:
    with tempfile.TemporaryDirectory() as tmp, KubeEmulator(tmp, nodes=["n1"]) as emu:
        creds = emu.node_credentials()
        assert creds.common_name == "system:node:n1" and creds.organizations == ("system:nodes",)
        assert emu.ca_path.read_bytes() == emu.ca_pem and emu.ca_path.parent == Path(tmp)
        assert creds.combined_path.read_bytes() == creds.cert_pem + creds.key_pem
        assert Client(emu, creds).get("n1").status == 200
        assert emu.node_names() == ["n1"]
