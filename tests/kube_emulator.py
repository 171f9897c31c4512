"""A Kubernetes API server emulator for the agent's tests.

It serves the calls the agent makes with its kubelet's credentials: GET and PATCH of
/api/v1/nodes/{name} and PATCH of /api/v1/nodes/{name}/status, over TLS with client-certificate or
bearer-token authentication; anything else a kube-apiserver serves (PUT, lists and watches, JSON
patch and server-side apply, discovery) is answered 404, 405 or 415. It reproduces what a
kube-apiserver with --authorization-mode=Node,RBAC and the NodeRestriction admission plugin does:

* authentication: x509 client certificates (CN is the user, each O a group) verified against the
  cluster CA, bearer tokens, optional anonymous access; failures are 401 with a Status body.
* authorization: the Node authorizer as of Kubernetes 1.32 (AuthorizeNodeWithSelectors on): a node
  may get/list/watch only its own Node, may patch/update any Node and nodes/status (admission
  narrows that); system:masters may do anything; other users only what `grant()` gives them.
* NodeRestriction: a node may modify only its own Node, not its taints, and not labels under
  kubernetes.io / k8s.io (and their subdomains) other than the kubelet's own set.
* the Node registry strategy: a PATCH/PUT of the Node resets status to the stored status, a
  PATCH/PUT of nodes/status resets spec (metadata changes made through /status are kept, as the
  real server keeps them); uid is immutable, creationTimestamp and generation are the server's.
* patches: application/merge-patch+json (RFC 7386) and application/strategic-merge-patch+json with
  the Node's merge keys (status.conditions and status.addresses by "type", ownerReferences by
  "uid"; other lists replace; the $patch directive), what the agent sends for labels, annotations
  and conditions.
* optimistic concurrency: a body whose metadata.resourceVersion differs from the stored one gets
  409 Conflict; a change that leaves the object as it was does not bump resourceVersion. A patch
  without a resourceVersion never conflicts: the server applies it to the Node as stored
  (kube-apiserver's registry Store.Update checks only a version the object carries).
* validation: label keys and values, annotation keys and size (422 Invalid); unknown fields are
  dropped with a Warning header (or refused with ?fieldValidation=Strict).

Everything a test needs to drive and observe it is on `KubeEmulator`: the PKI and kubeconfigs,
tokens and grants, fault injection (`fail_next`, `write_next`, `hang_next`, `delay_next`, `reset_next`;
each as a real server would show it: a 409 only where a resourceVersion no longer matches, a 429 with
Retry-After), the
request log (`requests`, `wait_for_requests`, `max_requests_in_window`) and direct access to the
stored nodes (`get_node`, `modify_node`, `set_labels`, `set_condition`, `kubelet_heartbeat`).
"""
from __future__ import annotations

import base64
import copy
import datetime as _dt
import fnmatch
import http.server
import ipaddress
import json
import re
import secrets
import shutil
import socket
import socketserver
import ssl
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Pattern, Sequence, Union
from urllib.parse import parse_qs, urlsplit

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "ApiError", "Credentials", "Fault", "KubeEmulator", "KubePKI", "RequestRecord", "User",
    "status_body", "write_kubeconfig",
]

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

NODE_USER_PREFIX = "system:node:"
NODES_GROUP = "system:nodes"
MASTERS_GROUP = "system:masters"
AUTHENTICATED_GROUP = "system:authenticated"

OPTIMISTIC_LOCK_MSG = "the object has been modified; please apply your changes to the latest version and try again"
CONCURRENT_WRITER = "emulator.example.com/concurrent-writer"  # the annotation write_next's other writer sets

# k8s.io/kubelet/pkg/apis: the labels a kubelet may set on its own Node, and the namespaces
# ([*.]kubelet.kubernetes.io, [*.]node.kubernetes.io) it may set labels under.
KUBELET_LABELS = frozenset({
    "kubernetes.io/hostname",
    "failure-domain.beta.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/arch",
    "kubernetes.io/os",
    "kubernetes.io/arch",
})
KUBELET_LABEL_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")
NODE_RESTRICTION_NAMESPACE = "node-restriction.kubernetes.io"

_X509_V_FLAG_NO_CHECK_TIME = 0x200000  # expiry is checked by the authenticator (401), not the handshake


# --------------------------------------------------------------------------------------------
# Status bodies and errors
# --------------------------------------------------------------------------------------------

_REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
    406: "NotAcceptable", 409: "Conflict", 410: "Expired", 413: "RequestEntityTooLarge",
    415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests", 500: "InternalError",
    503: "ServiceUnavailable", 504: "Timeout",
}


def status_body(code: int, message: str, reason: Optional[str] = None,
                details: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A metav1.Status failure, keys in the order kube-apiserver writes them."""
    body: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message}
    reason = reason if reason is not None else _REASONS.get(code, "")
    if reason:
        body["reason"] = reason
    if details is not None:
        body["details"] = details
    body["code"] = code
    return body


class ApiError(Exception):
    """An error the emulator answers with a Status body (or, as a filter before the handlers does, text)."""

    def __init__(self, code: int, message: str, reason: Optional[str] = None,
                 details: Optional[dict[str, Any]] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.code = code
        self.body: Union[dict[str, Any], bytes] = status_body(code, message, reason, details)
        self.headers = headers or {}


def _not_found(name: str) -> ApiError:
    return ApiError(404, f'nodes "{name}" not found', "NotFound", {"name": name, "kind": "nodes"})


def _forbidden(name: str, message: str) -> ApiError:
    # apierrors.NewForbidden(nodes, name, err)
    prefix = f'nodes "{name}" is forbidden' if name else "nodes is forbidden"
    details: dict[str, Any] = {"kind": "nodes"}
    if name:
        details = {"name": name, "kind": "nodes"}
    return ApiError(403, f"{prefix}: {message}", "Forbidden", details)


def _conflict(name: str, message: str = OPTIMISTIC_LOCK_MSG) -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on nodes "{name}": {message}', "Conflict",
                    {"name": name, "kind": "nodes"})


def _bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")


@dataclass(frozen=True)
class _FieldError:
    field: str
    kind: str  # FieldValueInvalid, FieldValueTooLong, ...
    body: str  # what follows "<field>: "

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"


# How often kube-apiserver v1.34.4 lists one metadata error of a Node update among the causes: its update
# validates the object's metadata four times over (tests/e2e/cluster), while the message names it once.
METADATA_CAUSE_REPEATS = 4


def _invalid(name: str, errors: Sequence[_FieldError], kind: str = "Node", repeats: int = 1) -> ApiError:
    # apierrors.NewInvalid(GroupKind{Kind: "Node"}, name, errs)
    joined = str(errors[0]) if len(errors) == 1 else "[" + ", ".join(str(e) for e in errors) + "]"
    kind_prefix = kind if kind else ""
    details: dict[str, Any] = {}
    if name:
        details["name"] = name
    if kind:
        details["kind"] = kind
    details["causes"] = [{"reason": e.kind, "message": e.body, "field": e.field} for e in errors] * repeats
    return ApiError(422, f'{kind_prefix} "{name}" is invalid: {joined}', "Invalid", details)


# --------------------------------------------------------------------------------------------
# PKI
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Credentials:
    """A certificate and its key, as PEM and as files. `combined_path` holds both, the way the
    kubelet's /var/lib/kubelet/pki/kubelet-client-current.pem does."""

    common_name: str
    organizations: tuple[str, ...]
    cert_pem: bytes
    key_pem: bytes
    cert_path: Path
    key_path: Path
    combined_path: Path

    @property
    def user(self) -> str:
        return self.common_name


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


# An RSA 2048 key takes about 40 ms of CPU to make, and the suite starts hundreds of emulators. A CA's
# key goes back to this pool when its PKI is cleaned up, so two PKIs alive at once never share one (a
# certificate one CA signed must not verify against the other); a leaf's key is the same for every
# certificate of a process, since trust comes from the CA's signature, not from the leaf's key.
_FREE_CA_KEYS: list[Any] = []
_LEAF_RSA_KEYS: list[Any] = []
_KEYS_LOCK = threading.Lock()


def _rsa_key() -> Any:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _take_ca_key() -> Any:
    with _KEYS_LOCK:
        if _FREE_CA_KEYS:
            return _FREE_CA_KEYS.pop()
    return _rsa_key()


def _give_back_ca_key(key: Any) -> None:
    with _KEYS_LOCK:
        _FREE_CA_KEYS.append(key)


def _new_key(key_type: str) -> Any:
    if key_type == "rsa":
        with _KEYS_LOCK:
            if not _LEAF_RSA_KEYS:
                _LEAF_RSA_KEYS.append(_rsa_key())
            return _LEAF_RSA_KEYS[0]
    if key_type == "ec":
        return ec.generate_private_key(ec.SECP256R1())
    raise ValueError(f"key_type must be 'rsa' or 'ec', not {key_type!r}")


def _key_pem(key: Any) -> bytes:
    fmt = serialization.PrivateFormat.TraditionalOpenSSL
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _safe_filename(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "cert"


class KubePKI:
    """The cluster CA (kubeadm's shape: RSA 2048, CN=kubernetes), the API server's certificate
    (SANs 127.0.0.1, ::1, localhost, kubernetes.default.svc...) and client certificates on demand.

    A second CA ("untrusted") is accepted by the TLS layer but not by the authenticator, so a
    certificate it signs gets the API server's 401, as a certificate from another cluster would.
    Files are written under `directory` (a temporary directory when none is given)."""

    def __init__(self, directory: Union[str, Path, None] = None) -> None:
        self._owns_directory = directory is None
        self.directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="kube-pki-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._counter = 0
        self._ca_key = _take_ca_key()
        self.ca_cert = self._make_ca(self._ca_key, "kubernetes")
        self.ca_pem = _cert_pem(self.ca_cert)
        self.ca_path = self.directory / "ca.crt"
        self.ca_path.write_bytes(self.ca_pem)
        self._untrusted_key = _new_key("ec")
        self.untrusted_ca_cert = self._make_ca(self._untrusted_key, "some-other-cluster-ca")
        self.untrusted_ca_pem = _cert_pem(self.untrusted_ca_cert)
        self.server = self._issue(
            "kube-apiserver", (), key_type="rsa", server=True, stem="apiserver",
            sans=[x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1")),
                  x509.IPAddress(ipaddress.ip_address("10.96.0.1")), x509.DNSName("localhost"),
                  x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default"),
                  x509.DNSName("kubernetes.default.svc"), x509.DNSName("kubernetes.default.svc.cluster.local")],
        )

    @staticmethod
    def _make_ca(key: Any, cn: str) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        now = _now()
        return (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(hours=1)).not_valid_after(now + _dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=True,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )

    def _issue(self, common_name: str, organizations: Iterable[str], *, key_type: str = "ec", server: bool = False,
               sans: Optional[list[x509.GeneralName]] = None, not_before: Optional[_dt.datetime] = None,
               not_after: Optional[_dt.datetime] = None, untrusted: bool = False,
               stem: Optional[str] = None) -> Credentials:
        orgs = tuple(organizations)
        key = _new_key(key_type)
        ca_key, ca_cert = (self._untrusted_key, self.untrusted_ca_cert) if untrusted else (self._ca_key, self.ca_cert)
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = _now()
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before or now - _dt.timedelta(minutes=5))
            .not_valid_after(not_after or now + _dt.timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                         key_encipherment=key_type == "rsa", data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False, crl_sign=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server
                                                  else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        with self._lock:
            self._counter += 1
            base = stem or f"{self._counter:03d}-{_safe_filename(common_name)}"
        cert_pem, key_pem = _cert_pem(cert), _key_pem(key)
        cert_path, key_path = self.directory / f"{base}.crt", self.directory / f"{base}.key"
        combined = self.directory / f"{base}.pem"
        cert_path.write_bytes(cert_pem)
        key_path.write_bytes(key_pem)
        key_path.chmod(0o600)
        combined.write_bytes(cert_pem + key_pem)
        combined.chmod(0o600)
        return Credentials(common_name, orgs, cert_pem, key_pem, cert_path, key_path, combined)

    def client_cert(self, common_name: str, organizations: Iterable[str] = (), *, key_type: str = "ec",
                    not_before: Optional[_dt.datetime] = None, not_after: Optional[_dt.datetime] = None,
                    untrusted: bool = False) -> Credentials:
        """A client certificate: CN is the user name, each organization a group. ECDSA P-256 by
        default, like the kubelet's rotated certificate; `key_type="rsa"` for RSA 2048."""
        return self._issue(common_name, organizations, key_type=key_type, not_before=not_before,
                           not_after=not_after, untrusted=untrusted)

    def serving_cert(self, name: str, addresses: Iterable[str], dns_names: Iterable[str] = ()) -> Credentials:
        """A server certificate (RSA 2048) for these IP addresses and DNS names: an API server on
        another address than the emulator's (tests/e2e/cluster)."""
        sans: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
        sans += [x509.DNSName(d) for d in dns_names]
        return self._issue(name, (), key_type="rsa", server=True, sans=sans, stem=_safe_filename(name))

    def node_cert(self, node_name: str, **kwargs: Any) -> Credentials:
        """CN=system:node:<name>, O=system:nodes: what the kubelet's certificate carries."""
        return self.client_cert(NODE_USER_PREFIX + node_name, (NODES_GROUP,), **kwargs)

    def verify_client_cert(self, cert: x509.Certificate) -> None:
        """Raise ValueError unless the cluster CA signed `cert` and it is valid now (what the x509
        authenticator checks)."""
        if cert.issuer != self.ca_cert.subject:
            raise ValueError("x509: certificate signed by unknown authority")
        try:
            cert.verify_directly_issued_by(self.ca_cert)
        except Exception as exc:  # signature mismatch, wrong key type
            raise ValueError("x509: certificate signed by unknown authority") from exc
        now = _now()
        if now < cert.not_valid_before_utc or now > cert.not_valid_after_utc:
            raise ValueError(f"x509: certificate has expired or is not yet valid: current time "
                             f"{now.strftime('%Y-%m-%dT%H:%M:%SZ')} is after "
                             f"{cert.not_valid_after_utc.strftime('%Y-%m-%dT%H:%M:%SZ')}")
        try:
            eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            return
        if ExtendedKeyUsageOID.CLIENT_AUTH not in eku and ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE not in eku:
            raise ValueError("x509: certificate specifies an incompatible key usage")

    def cleanup(self) -> None:
        if self._owns_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        if self._ca_key is not None:
            _give_back_ca_key(self._ca_key)
            self._ca_key = None


# --------------------------------------------------------------------------------------------
# Users, request log, faults
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class User:
    name: str
    groups: tuple[str, ...] = ()

    @property
    def node_name(self) -> Optional[str]:
        """The node this user is (nodeidentifier: name system:node:<n> and group system:nodes)."""
        if self.name.startswith(NODE_USER_PREFIX) and NODES_GROUP in self.groups:
            return self.name[len(NODE_USER_PREFIX):]
        return None


@dataclass
class RequestRecord:
    """One request as the server saw it. `status` is None while it is in flight and for a request
    answered by a hang or a reset (see `fault`)."""

    method: str
    path: str
    query: dict[str, list[str]]
    content_type: Optional[str]
    body: bytes
    headers: dict[str, str]
    time: float
    monotonic: float
    user: Optional[str] = None
    groups: tuple[str, ...] = ()
    status: Optional[int] = None
    response: Optional[Any] = None
    fault: Optional[str] = None
    error: Optional[str] = None

    @property
    def json(self) -> Any:
        if not self.body:
            return None
        try:
            return json.loads(self.body)
        except ValueError:
            return None


PathPattern = Union[str, Pattern[str]]


@dataclass
class Fault:
    """A queued fault: the next `count` requests (None: every one until cleared) whose path
    matches `pattern` (an fnmatch glob over the path without its query, or a compiled regex
    searched in it) and whose method matches `method` (None: any) get it instead of a normal answer."""

    pattern: PathPattern
    kind: str  # "status", "write", "hang", "delay", "reset"
    count: Optional[int] = 1
    method: Optional[str] = None
    status: int = 500
    message: Optional[str] = None
    retry_after: Optional[int] = None
    seconds: float = 0.0
    apply: bool = False
    hits: int = 0

    @property
    def remaining(self) -> Optional[int]:
        return None if self.count is None else self.count - self.hits

    def matches(self, method: str, path: str) -> bool:
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if isinstance(self.pattern, str):
            return fnmatch.fnmatchcase(path, self.pattern)
        return self.pattern.search(path) is not None


# --------------------------------------------------------------------------------------------
# Node schema: type conformance, unknown fields, omitempty
# --------------------------------------------------------------------------------------------

_STR, _REQSTR, _INT, _BOOL, _TIME, _MAPSTR, _QUANT, _STRLIST, _ANY = (
    "string", "required-string", "int64", "bool", "Time", "map[string]string", "ResourceList", "[]string", "any")

_CONDITION = {"type": _REQSTR, "status": _REQSTR, "lastHeartbeatTime": _TIME, "lastTransitionTime": _TIME,
              "reason": _STR, "message": _STR}
_NODE_SCHEMA: dict[str, Any] = {
    "apiVersion": _STR, "kind": _STR,
    "metadata": {
        "name": _STR, "generateName": _STR, "namespace": _STR, "selfLink": _STR, "uid": _STR,
        "resourceVersion": _STR, "generation": _INT, "creationTimestamp": _TIME, "deletionTimestamp": _TIME,
        "deletionGracePeriodSeconds": _INT, "labels": _MAPSTR, "annotations": _MAPSTR,
        "ownerReferences": [_ANY], "finalizers": _STRLIST, "managedFields": [_ANY],
    },
    "spec": {
        "podCIDR": _STR, "podCIDRs": _STRLIST, "providerID": _STR, "unschedulable": _BOOL,
        "taints": [{"key": _REQSTR, "value": _STR, "effect": _REQSTR, "timeAdded": _TIME}],
        "configSource": _ANY, "externalID": _STR,
    },
    "status": {
        "capacity": _QUANT, "allocatable": _QUANT, "phase": _STR, "conditions": [_CONDITION],
        "addresses": [{"type": _REQSTR, "address": _REQSTR}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": _INT}},
        "nodeInfo": {k: _REQSTR for k in ("machineID", "systemUUID", "bootID", "kernelVersion", "osImage",
                                          "containerRuntimeVersion", "kubeletVersion", "kubeProxyVersion",
                                          "operatingSystem", "architecture")} | {"swap": _ANY},
        "images": [{"names": _STRLIST, "sizeBytes": _INT}], "volumesInUse": _STRLIST,
        "volumesAttached": [_ANY], "config": _ANY, "runtimeHandlers": [_ANY], "features": _ANY,
        "declaredFeatures": _STRLIST,
    },
}
_GO_STRUCT = {("metadata",): "ObjectMeta", ("spec",): "NodeSpec", ("status",): "NodeStatus",
              ("spec", "taints"): "Taint", ("status", "conditions"): "NodeCondition",
              ("status", "addresses"): "NodeAddress", ("status", "nodeInfo"): "NodeSystemInfo",
              ("status", "images"): "ContainerImage", ("status", "daemonEndpoints"): "NodeDaemonEndpoints"}
_ALWAYS_PRESENT = {("metadata",), ("spec",), ("status",)}
_ALWAYS_PRESENT_TIMES = {("metadata", "creationTimestamp"), ("status", "conditions", "lastHeartbeatTime"),
                         ("status", "conditions", "lastTransitionTime")}


class _DecodeError(Exception):
    pass


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _format_time(value: _dt.datetime) -> str:
    return value.astimezone(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str) -> str:
    candidate = text.strip()
    if candidate.endswith(("Z", "z")):
        candidate = candidate[:-1] + "+00:00"
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d+)?([+-]\d{2}:\d{2})", candidate)
    if not match:
        raise _DecodeError(f'parsing time "{text}" as "2006-01-02T15:04:05Z07:00": cannot parse "{text}" as "2006"')
    parsed = _dt.datetime.fromisoformat(match.group(1) + match.group(3))
    return _format_time(parsed)


class _Conformer:
    """Decode a JSON document into the Node's shape the way the typed Go decoder would: refuse
    wrong types, normalize times to RFC 3339 seconds in UTC, note unknown fields, drop what
    `omitempty` drops and add the null times Go writes for zero metav1.Time values."""

    def __init__(self) -> None:
        self.unknown: list[str] = []

    def node(self, doc: Any) -> dict[str, Any]:
        if not isinstance(doc, dict):
            raise _DecodeError(f"json: cannot unmarshal {_json_kind(doc)} into Go value of type v1.Node")
        return self._struct(doc, _NODE_SCHEMA, ())

    def _err(self, value: Any, path: tuple[str, ...], gotype: str) -> _DecodeError:
        struct = "Node"
        for i in range(len(path) - 1, 0, -1):
            if path[:i] in _GO_STRUCT:
                struct = _GO_STRUCT[path[:i]]
                break
        dotted = ".".join(path)
        return _DecodeError(
            f"json: cannot unmarshal {_json_kind(value)} into Go struct field {struct}.{dotted} of type {gotype}"
        )

    def _struct(self, doc: dict[str, Any], schema: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        for key in doc:
            if key not in schema:
                self.unknown.append(".".join(path + (key,)))
        out: dict[str, Any] = {}
        for key, spec in schema.items():  # Go writes struct fields in declaration order
            sub = path + (key,)
            converted = self._value(doc[key], spec, sub) if key in doc else _OMIT
            if converted is not _OMIT:
                out[key] = converted
            elif spec == _TIME and sub in _ALWAYS_PRESENT_TIMES:
                out[key] = None  # a zero metav1.Time is written as null despite omitempty
            elif isinstance(spec, dict) and sub in _ALWAYS_PRESENT:
                out[key] = {}
        return out

    def _value(self, value: Any, spec: Any, path: tuple[str, ...]) -> Any:
        if value is None:
            return _OMIT
        if spec == _ANY:
            return value
        if isinstance(spec, dict):
            if not isinstance(value, dict):
                raise self._err(value, path, "struct")
            converted = self._struct(value, spec, path)
            if not converted and path not in _ALWAYS_PRESENT:
                return _OMIT
            return converted
        if isinstance(spec, list):
            if not isinstance(value, list):
                raise self._err(value, path, "[]" + _GO_STRUCT.get(path, "object"))
            items = []
            for item in value:
                if spec[0] == _ANY:
                    items.append(item)
                elif item is None:
                    items.append(self._struct({}, spec[0], path))
                elif not isinstance(item, dict):
                    raise self._err(item, path, _GO_STRUCT.get(path, "struct"))
                else:
                    items.append(self._struct(item, spec[0], path))
            return items if items else _OMIT
        if spec in (_STR, _REQSTR):
            if not isinstance(value, str):
                raise self._err(value, path, "string")
            return value if (value or spec == _REQSTR) else _OMIT
        if spec == _INT:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
                raise self._err(value, path, "int64")
            return int(value) if (value or path[-1] == "Port") else _OMIT
        if spec == _BOOL:
            if not isinstance(value, bool):
                raise self._err(value, path, "bool")
            return value if value else _OMIT
        if spec == _TIME:
            if not isinstance(value, str):
                raise self._err(value, path, "Time")
            return _parse_time(value)
        if spec in (_MAPSTR, _QUANT):
            if not isinstance(value, dict):
                raise self._err(value, path, "map[string]string")
            out = {}
            for k, v in value.items():
                if v is None:
                    v = ""
                if spec == _QUANT and isinstance(v, (int, float)) and not isinstance(v, bool):
                    v = str(v)
                if not isinstance(v, str):
                    raise self._err(v, path, "string" if spec == _MAPSTR else "Quantity")
                out[k] = v
            return out if out else _OMIT
        if spec == _STRLIST:
            if not isinstance(value, list):
                raise self._err(value, path, "[]string")
            for item in value:
                if not isinstance(item, str):
                    raise self._err(item, path, "string")
            return list(value) if value else _OMIT
        raise AssertionError(f"unknown schema type {spec!r}")


class _Omit:
    def __repr__(self) -> str:
        return "<omit>"


_OMIT: Any = _Omit()


# --------------------------------------------------------------------------------------------
# Validation (apimachinery's IsQualifiedName / IsValidLabelValue)
# --------------------------------------------------------------------------------------------

_QNAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_QNAME_MSG = ("must consist of alphanumeric characters, '-', '_' or '.', "
              "and must start and end with an alphanumeric character")
_LABEL_VALUE_FMT = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                    "and must start and end with an alphanumeric character")
_DNS1123_SUBDOMAIN_FMT = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_DNS1123_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
                          "'-' or '.', and must start and end with an alphanumeric character")


def _regex_error(msg: str, fmt: str, *examples: str) -> str:
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    # apimachinery's RegexError writes "'<e>', " per example and " or " between them: two spaces before "or"
    # (what kube-apiserver v1.34.4 answered, tests/e2e/cluster).
    return msg + " (e.g. " + " or ".join(f"'{e}', " for e in examples) + f"regex used for validation is '{fmt}')"


def qualified_name_errors(value: str) -> list[str]:
    errors: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            if len(prefix) > 253:
                errors.append("prefix part must be no more than 253 characters")
            if not re.fullmatch(_DNS1123_SUBDOMAIN_FMT, prefix):
                errors.append(
                    "prefix part " + _regex_error(_DNS1123_SUBDOMAIN_MSG, _DNS1123_SUBDOMAIN_FMT, "example.com")
                )
    else:
        return ["a qualified name " + _regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name", "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    if not re.fullmatch(_QNAME_FMT, name):
        errors.append("name part " + _regex_error(_QNAME_MSG, _QNAME_FMT, "MyName", "my.name", "123-abc"))
    return errors


def label_value_errors(value: str) -> list[str]:
    errors: list[str] = []
    if len(value) > 63:
        errors.append("must be no more than 63 characters")
    if not re.fullmatch(_LABEL_VALUE_FMT, value):
        errors.append(_regex_error(_LABEL_VALUE_MSG, _LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errors


def _validate_metadata(node: dict[str, Any]) -> list[_FieldError]:
    errors: list[_FieldError] = []
    meta = node.get("metadata", {})
    for key, value in sorted(meta.get("labels", {}).items()):
        for msg in qualified_name_errors(key):
            errors.append(
                _FieldError("metadata.labels", "FieldValueInvalid", f"Invalid value: {json.dumps(key)}: {msg}")
            )
        for msg in label_value_errors(value):
            errors.append(
                _FieldError("metadata.labels", "FieldValueInvalid", f"Invalid value: {json.dumps(value)}: {msg}")
            )
    annotations = meta.get("annotations", {})
    for key in sorted(annotations):
        for msg in qualified_name_errors(key.lower()):
            errors.append(
                _FieldError("metadata.annotations", "FieldValueInvalid", f"Invalid value: {json.dumps(key)}: {msg}")
            )
    size = sum(len(k) + len(v) for k, v in annotations.items())
    if size > 256 * 1024:
        errors.append(
            _FieldError("metadata.annotations", "FieldValueTooLong", "Too long: must have at most 262144 bytes")
        )
    return errors


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Strategic merge patch metadata for v1.Node (patchStrategy / patchMergeKey struct tags).
_SMP_MERGE_KEYS: dict[tuple[str, ...], str] = {("metadata", "ownerReferences"): "uid", ("status", "conditions"): "type",
                   ("status", "addresses"): "type"}
_DIRECTIVE = "$patch"


class _SMPError(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.body["message"])
        self.error = error


def _go_map(value: Any) -> str:
    """fmt's %v of a decoded JSON value, roughly (used in error messages)."""
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{_go_map(v)}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, list):
        return "[" + " ".join(_go_map(v) for v in value) + "]"
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items()
                if not k.startswith("$") and v is not None}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def strategic_merge_patch(original: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Strategic merge patch of a v1.Node."""
    result = _smp_map(original, patch, ())
    return result if result is not _SMP_DELETE else {}


class _SmpDelete:
    pass


_SMP_DELETE: Any = _SmpDelete()


def _smp_map(original: Any, patch: dict[str, Any], path: tuple[str, ...]) -> Any:
    original = dict(original) if isinstance(original, dict) else {}
    directive = patch.get(_DIRECTIVE)
    if directive is not None:
        if directive == "delete":
            return _SMP_DELETE
        if directive == "replace":
            return _strip_directives({k: v for k, v in patch.items() if k != _DIRECTIVE})
        if directive != "merge":
            # The patch's errors are plain errors to the apiserver: 500 with the message alone, no reason.
            raise _SMPError(ApiError(500, f"unknown patch type: {directive} in map: {_go_map(patch)}", ""))
    for key, value in patch.items():
        if key == _DIRECTIVE:
            continue
        # Another "$" key is no directive to the apiserver: a field like any other, dropped where unknown.
        sub = path + (key,)
        if value is None:
            original.pop(key, None)
        elif isinstance(value, dict):
            merged = _smp_map(original.get(key), value, sub)
            if merged is _SMP_DELETE:
                original.pop(key, None)
            else:
                original[key] = merged
        elif isinstance(value, list):
            original[key] = _smp_list(original.get(key), value, sub)
        else:
            original[key] = value
    return original


def _smp_list(original: Any, patch: list[Any], path: tuple[str, ...]) -> list[Any]:
    current = list(original) if isinstance(original, list) else []
    merge_key = _SMP_MERGE_KEYS.get(path)
    if merge_key is not None:
        if any(isinstance(i, dict) and i.get(_DIRECTIVE) == "replace" for i in patch):
            return [_strip_directives(i) for i in patch if not (isinstance(i, dict) and i.get(_DIRECTIVE) == "replace")]
        for item in patch:
            if not isinstance(item, dict):
                raise _SMPError(ApiError(500, "list element types are not identical: "
                                              f"{_go_map([current, patch])}", ""))
            if merge_key not in item:
                raise _SMPError(ApiError(500, f"map: {_go_map(item)} does not contain declared merge key: {merge_key}",
                                         ""))
            key_value = item[merge_key]
            index = next(
                (i for i, cur in enumerate(current) if isinstance(cur, dict) and cur.get(merge_key) == key_value), None
            )
            if item.get(_DIRECTIVE) == "delete":
                current = [cur for cur in current if not (isinstance(cur, dict) and cur.get(merge_key) == key_value)]
                continue
            if index is None:
                merged = _smp_map({}, item, path)
                current.append(merged)
            else:
                current[index] = _smp_map(current[index], item, path)
        return current
    return [_strip_directives(i) for i in patch]


# --------------------------------------------------------------------------------------------
# Nodes
# --------------------------------------------------------------------------------------------

_CONDITION_DEFAULTS = {
    "MemoryPressure": ("False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    "DiskPressure": ("False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    "PIDPressure": ("False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    "Ready": ("True", "KubeletReady", "kubelet is posting ready status"),
}
KUBELET_CONDITIONS = tuple(_CONDITION_DEFAULTS)


def make_node(name: str, *, index: int = 0, labels: Optional[Mapping[str, str]] = None,
              annotations: Optional[Mapping[str, str]] = None, taints: Optional[Sequence[Mapping[str, Any]]] = None,
              kubelet_version: str = "v1.32.2", created: Optional[_dt.datetime] = None) -> dict[str, Any]:
    """A Node as a kubeadm-joined GPU worker's kubelet registers it (no resourceVersion yet)."""
    created = created or _now() - _dt.timedelta(days=12)
    stamp = _format_time(created)
    beat = _format_time(_now() - _dt.timedelta(seconds=30))
    node_labels = {
        "beta.kubernetes.io/arch": "amd64",
        "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "node-role.kubernetes.io/worker": "",
    }
    node_labels.update(labels or {})
    node_annotations = {
        "kubeadm.alpha.kubernetes.io/cri-socket": "unix:///var/run/containerd/containerd.sock",
        "node.alpha.kubernetes.io/ttl": "0",
        "volumes.kubernetes.io/controller-managed-attach-detach": "true",
    }
    node_annotations.update(annotations or {})
    conditions = [
        {"type": ctype, "status": status, "lastHeartbeatTime": beat, "lastTransitionTime": stamp,
         "reason": reason, "message": message}
        for ctype, (status, reason, message) in _CONDITION_DEFAULTS.items()
    ]
    ip = f"10.0.0.{11 + index}"
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": str(uuid.uuid4()),
            "creationTimestamp": stamp,
            "labels": node_labels,
            "annotations": node_annotations,
        },
        "spec": {
            "podCIDR": f"10.244.{index + 1}.0/24",
            "podCIDRs": [f"10.244.{index + 1}.0/24"],
            "taints": [dict(t) for t in taints] if taints is not None else
            [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        },
        "status": {
            "capacity": {"cpu": "64", "ephemeral-storage": "1919260024Ki", "hugepages-1Gi": "0",
                         "hugepages-2Mi": "0", "memory": "527978920Ki", "pods": "110"},
            "allocatable": {"cpu": "64", "ephemeral-storage": "1768789445942", "hugepages-1Gi": "0",
                            "hugepages-2Mi": "0", "memory": "527876520Ki", "pods": "110"},
            "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
            "nodeInfo": {
                "machineID": uuid.uuid4().hex, "systemUUID": str(uuid.uuid4()).upper(), "bootID": str(uuid.uuid4()),
                "kernelVersion": "6.1.0-28-amd64", "osImage": "Debian GNU/Linux 12 (bookworm)",
                "containerRuntimeVersion": "containerd://1.7.24", "kubeletVersion": kubelet_version,
                "kubeProxyVersion": kubelet_version, "operatingSystem": "linux", "architecture": "amd64",
            },
            "images": [
                {"names": ["registry.k8s.io/kube-proxy@sha256:" + "0" * 64,
                           f"registry.k8s.io/kube-proxy:{kubelet_version}"],
                 "sizeBytes": 30229924},
                {"names": ["registry.k8s.io/pause@sha256:" + "1" * 64, "registry.k8s.io/pause:3.10"],
                 "sizeBytes": 320368},
            ],
        },
    }


def _label_namespace(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def is_kubelet_label(key: str) -> bool:
    if key in KUBELET_LABELS:
        return True
    namespace = _label_namespace(key)
    return any(namespace == ns or namespace.endswith("." + ns) for ns in KUBELET_LABEL_NAMESPACES)


def is_kubernetes_label(key: str) -> bool:
    namespace = _label_namespace(key)
    return (namespace in ("kubernetes.io", "k8s.io") or namespace.endswith(".kubernetes.io")
            or namespace.endswith(".k8s.io"))


def forbidden_node_labels(modified: Iterable[str]) -> list[str]:
    """The labels NodeRestriction refuses to let a node add, change or remove."""
    forbidden = set()
    for key in modified:
        namespace = _label_namespace(key)
        if namespace == NODE_RESTRICTION_NAMESPACE or namespace.endswith("." + NODE_RESTRICTION_NAMESPACE):
            forbidden.add(key)
        if is_kubernetes_label(key) and not is_kubelet_label(key):
            forbidden.add(key)
    return sorted(forbidden)


def _modified_labels(new: Mapping[str, str], old: Mapping[str, str]) -> set[str]:
    return {k for k in set(new) | set(old) if new.get(k) != old.get(k) or (k in new) != (k in old)}


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------

@dataclass
class _Grant:
    subject: str
    verbs: frozenset[str]
    resources: frozenset[str]

    def allows(self, user: User, verb: str, resource: str) -> bool:
        if self.subject != user.name and self.subject not in user.groups:
            return False
        return ("*" in self.verbs or verb in self.verbs) and ("*" in self.resources or resource in self.resources)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, emulator: KubeEmulator) -> None:
        self.emulator = emulator
        super().__init__(("127.0.0.1", 0), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:  # runs in the request's thread
        emulator = self.emulator
        emulator._track(request)
        try:
            request.settimeout(10)
            try:
                tls = emulator._server_context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                emulator._note_tls_error(exc)
                return
            emulator._track(tls)
            try:
                tls.settimeout(emulator.idle_timeout)
                _Handler(tls, client_address, self)
            finally:
                emulator._untrack(tls)
                try:
                    tls.close()
                except OSError:
                    pass
        finally:
            emulator._untrack(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.emulator._errors.append(traceback.format_exc())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # the stdlib names it format
        pass

    def send_response(self, code: int, message: Optional[str] = None) -> None:
        # Go's net/http sends Date, no Server header
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def do_GET(self) -> None:
        self.server.emulator._handle(self)

    do_PATCH = do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        except (ConnectionError, ssl.SSLError, socket.timeout, TimeoutError):
            self.close_connection = True


class _Hangup(Exception):
    """Close the connection without an answer."""


class KubeEmulator:
    """A kube-apiserver for the nodes API, on https://127.0.0.1:<free port>.

    Use it as a context manager or call start() and stop(). `nodes` seeds Node objects by name
    (the first is `node_name`, the default identity for kubeconfigs)."""

    def __init__(self, directory: Union[str, Path, None] = None, *, pki: Optional[KubePKI] = None,
                 nodes: Sequence[str] = ("gpu-node-1", "gpu-node-2"), anonymous_auth: bool = False,
                 authorize_node_with_selectors: bool = True, device_taints: bool = False,
                 hang_seconds: float = 10.0, idle_timeout: float = 30.0) -> None:
        self._owns_pki = pki is None
        self.pki = pki or KubePKI(directory)
        self.anonymous_auth = anonymous_auth
        self.authorize_node_with_selectors = authorize_node_with_selectors
        self.device_taints = device_taints  # the DRADeviceTaints feature gate (alpha in 1.34: off by default)
        self.hang_seconds = hang_seconds
        self.idle_timeout = idle_timeout
        self._lock = threading.RLock()
        self._log_cond = threading.Condition(threading.Lock())
        self._log: list[RequestRecord] = []
        self._faults: list[Fault] = []
        self._tokens: dict[str, User] = {}
        self._grants: list[_Grant] = []
        self._nodes: dict[str, dict[str, Any]] = {}
        self._pods: list[dict[str, Any]] = []
        self._slices: dict[str, dict[str, Any]] = {}  # resource.k8s.io/v1 ResourceSlices by name
        self._claims: dict[tuple[str, str], tuple[dict[str, Any], str]] = {}  # (ns, name): (claim, its pod's node)
        self._device_classes: dict[str, dict[str, Any]] = {}  # resource.k8s.io/v1 DeviceClasses by name
        self._rv = 1000
        self._errors: list[str] = []
        self.tls_errors: list[str] = []
        self._conns: set[Any] = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None
        self._node_creds: dict[str, Credentials] = {}
        for index, name in enumerate(nodes):
            self.add_node(name, index=index)
        self.node_name = nodes[0] if nodes else None
        self._server_context = self._make_server_context()

    # ---- lifecycle ------------------------------------------------------------------------

    def _make_server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.pki.server.cert_path, self.pki.server.key_path)
        ctx.load_verify_locations(cadata=(self.pki.ca_pem + self.pki.untrusted_ca_pem).decode())
        ctx.verify_mode = ssl.CERT_OPTIONAL
        ctx.verify_flags = ctx.verify_flags | _X509_V_FLAG_NO_CHECK_TIME
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def start(self) -> KubeEmulator:
        if self._server is not None:
            return self
        self._stopping.clear()
        self._server = _Server(self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"kube-emulator:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: cut hangs short, close every connection, release the port."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                conn.close()
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(5)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with self._conns_lock:
                if not self._conns:
                    break
            time.sleep(0.01)

    def close(self) -> None:
        """stop() and remove the PKI directory when the emulator made it."""
        self.stop()
        if self._owns_pki:
            self.pki.cleanup()

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _track(self, conn: Any) -> None:
        with self._conns_lock:
            self._conns.add(conn)

    def _untrack(self, conn: Any) -> None:
        with self._conns_lock:
            self._conns.discard(conn)

    def _note_tls_error(self, exc: BaseException) -> None:
        self.tls_errors.append(f"{type(exc).__name__}: {exc}")

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the emulator is not running")
        return self._server.server_address[1]

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def errors(self) -> list[str]:
        """Tracebacks of the emulator's own failures (answered with 500). Should stay empty."""
        return list(self._errors)

    # ---- identities -----------------------------------------------------------------------

    @property
    def ca_pem(self) -> bytes:
        return self.pki.ca_pem

    @property
    def ca_path(self) -> Path:
        return self.pki.ca_path

    def node_credentials(self, node_name: Optional[str] = None) -> Credentials:
        """The kubelet client certificate for `node_name` (cached)."""
        node_name = node_name or self._default_node()
        with self._lock:
            if node_name not in self._node_creds:
                self._node_creds[node_name] = self.pki.node_cert(node_name)
            return self._node_creds[node_name]

    def client_credentials(self, common_name: str, groups: Iterable[str] = (), **kwargs: Any) -> Credentials:
        """A client certificate for any user (see KubePKI.client_cert for kwargs)."""
        return self.pki.client_cert(common_name, groups, **kwargs)

    def add_token(self, token: str, user: str, groups: Iterable[str] = ()) -> str:
        """Accept `Authorization: Bearer <token>` as `user` with `groups` (system:authenticated added)."""
        groups = tuple(groups)
        if AUTHENTICATED_GROUP not in groups:
            groups = groups + (AUTHENTICATED_GROUP,)
        with self._lock:
            self._tokens[token] = User(user, groups)
        return token

    def remove_token(self, token: str) -> None:
        with self._lock:
            self._tokens.pop(token, None)

    def admin_token(self) -> str:
        """A new token for kubernetes-admin in system:masters (may do anything)."""
        return self.add_token(secrets.token_urlsafe(24), "kubernetes-admin", (MASTERS_GROUP,))

    def grant(self, subject: str, verbs: Iterable[str] = ("*",), resources: Iterable[str] = ("*",)) -> None:
        """An RBAC-style grant to a user or group name: verbs (get, list, watch, patch, update)
        on resources ("nodes", "nodes/status"); "*" for all."""
        with self._lock:
            self._grants.append(_Grant(subject, frozenset(verbs), frozenset(resources)))

    def client_ssl_context(self, credentials: Optional[Credentials] = None) -> ssl.SSLContext:
        """An SSL context that trusts the cluster CA and presents `credentials` (if any)."""
        ctx = ssl.create_default_context(cadata=self.pki.ca_pem.decode())
        if credentials is not None:
            ctx.load_cert_chain(credentials.cert_path, credentials.key_path)
        return ctx

    def write_kubeconfig(self, path: Union[str, Path], user: Union[str, Credentials, None] = None,
                         mode: str = "cert-data", **kwargs: Any) -> Path:
        """See the module-level write_kubeconfig; the server is this emulator."""
        return write_kubeconfig(path, self, user=user, mode=mode, **kwargs)

    def _default_node(self) -> str:
        if self.node_name is None:
            raise ValueError("no node name given and the emulator was seeded with no nodes")
        return self.node_name

    # ---- faults and the request log ---------------------------------------------------------

    def _add_fault(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def fail_next(self, pattern: PathPattern = "*", status: int = 500, *, count: Optional[int] = 1,
                  method: Optional[str] = None, message: Optional[str] = None,
                  retry_after: Optional[int] = None) -> Fault:
        """Answer the next `count` matching requests with `status` and a Status body; 503 may carry
        Retry-After. A 429 comes as kube-apiserver's max-in-flight and priority-and-fairness filters send
        it: a plain-text body and `Retry-After: 1` (`retry_after=5` and a message: its shutdown filter,
        with_retry_after.go). 409 is refused: a real server answers it only to a write whose
        resourceVersion is no longer the Node's; `write_next` makes one."""
        if status == 409:
            raise ValueError("kube-apiserver answers 409 only to a write whose resourceVersion no longer matches: "
                             "use write_next(), another writer changing the Node first")
        if status == 429 and retry_after is None:
            retry_after = 1
        return self._add_fault(Fault(pattern, "status", count, method, status=status, message=message,
                                     retry_after=retry_after))

    def write_next(self, pattern: PathPattern = "*", *, count: Optional[int] = 1,
                   method: Optional[str] = "PATCH") -> Fault:
        """Before each of the next `count` matching requests, another writer changes the Node (an
        annotation of its own, resourceVersion bumped), as a controller or kubectl would between a
        client's read and its write. The request is then handled as usual: a write carrying the
        resourceVersion it read is answered 409 Conflict, one without applies to the changed Node."""
        return self._add_fault(Fault(pattern, "write", count, method))

    def hang_next(self, pattern: PathPattern = "*", *, count: Optional[int] = 1, method: Optional[str] = None,
                  seconds: Optional[float] = None, apply: bool = False) -> Fault:
        """Read the next `count` matching requests, answer nothing for `seconds` (default
        `hang_seconds`; cut short by stop()), then close the connection. With apply=True the request
        takes effect first (the client times out although the change was made)."""
        return self._add_fault(Fault(pattern, "hang", count, method, seconds=self.hang_seconds if seconds is None
                                     else seconds, apply=apply))

    def delay_next(self, pattern: PathPattern = "*", seconds: float = 1.0, *, count: Optional[int] = 1,
                   method: Optional[str] = None) -> Fault:
        """Wait `seconds` before handling the next `count` matching requests normally."""
        return self._add_fault(Fault(pattern, "delay", count, method, seconds=seconds))

    def reset_next(self, pattern: PathPattern = "*", *, count: Optional[int] = 1,
                   method: Optional[str] = None) -> Fault:
        """Close the connection without an answer as soon as the next matching request is read."""
        return self._add_fault(Fault(pattern, "reset", count, method))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, method: str, path: str) -> Optional[Fault]:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, path) and (fault.count is None or fault.hits < fault.count):
                    fault.hits += 1
                    if fault.count is not None and fault.hits >= fault.count:
                        self._faults.remove(fault)
                    return fault
        return None

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request received so far, oldest first (a copy of the list)."""
        with self._log_cond:
            return list(self._log)

    def requests_for(self, method: Optional[str] = None, path: Optional[PathPattern] = None,
                     since: Optional[float] = None) -> list[RequestRecord]:
        """Requests filtered by method, path pattern (as for faults) and monotonic time."""
        probe = Fault(path if path is not None else "*", "match", method=method)
        return [r for r in self.requests if probe.matches(r.method, r.path)
                and (since is None or r.monotonic >= since)]

    def clear_requests(self) -> None:
        with self._log_cond:
            self._log.clear()

    def wait_for_requests(self, count: int = 1, *, method: Optional[str] = None, path: Optional[PathPattern] = None,
                          timeout: float = 10.0, completed: bool = True) -> list[RequestRecord]:
        """Block until at least `count` matching requests have been received (and, with
        completed=True, answered or faulted); return them. Raises AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            found = [r for r in self.requests_for(method, path)
                     if not completed or r.status is not None or r.fault is not None]
            if len(found) >= count:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                seen = [(r.method, r.path, r.status) for r in self.requests]
                raise AssertionError(f"expected {count} request(s) matching {method or '*'} {path or '*'} within "
                                     f"{timeout} s, got {len(found)}: {seen}")
            with self._log_cond:
                self._log_cond.wait(min(remaining, 0.1))

    def max_requests_in_window(self, window: float = 60.0, *, method: Optional[str] = None,
                               path: Optional[PathPattern] = None) -> int:
        """The largest number of matching requests received within any `window` seconds."""
        times = sorted(r.monotonic for r in self.requests_for(method, path))
        best, start = 0, 0
        for end, t in enumerate(times):
            while t - times[start] >= window:
                start += 1
            best = max(best, end - start + 1)
        return best

    def _record(self, record: RequestRecord) -> None:
        with self._log_cond:
            self._log.append(record)
            self._log_cond.notify_all()

    def _finish_record(self, record: RequestRecord, **changes: Any) -> None:
        with self._log_cond:
            for key, value in changes.items():
                setattr(record, key, value)
            self._log_cond.notify_all()

    # ---- direct access to the store -----------------------------------------------------------

    def _bump(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _store(self, name: str, node: dict[str, Any]) -> dict[str, Any]:
        node["metadata"]["resourceVersion"] = self._bump()
        self._nodes[name] = node
        return copy.deepcopy(node)

    @staticmethod
    def _canonical(node: dict[str, Any]) -> dict[str, Any]:
        conformer = _Conformer()
        out = conformer.node(node)
        if conformer.unknown:
            raise ValueError(f"unknown Node fields: {', '.join(conformer.unknown)}")
        ordered: dict[str, Any] = {"kind": "Node", "apiVersion": "v1"}
        for key in ("metadata", "spec", "status"):
            ordered[key] = out.get(key, {})
        return ordered

    def add_node(self, name: str, node: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> dict[str, Any]:
        """Add a Node: `node` as given, or make_node(name, **kwargs) (labels, annotations, taints,
        kubelet_version, index)."""
        body = copy.deepcopy(dict(node)) if node is not None else make_node(name, **kwargs)
        body.setdefault("metadata", {})["name"] = name
        body["metadata"].setdefault("uid", str(uuid.uuid4()))
        body["metadata"].setdefault("creationTimestamp", _format_time(_now()))
        canonical = self._canonical(body)
        with self._lock:
            return self._store(name, canonical)

    def delete_node(self, name: str) -> None:
        with self._lock:
            if self._nodes.pop(name, None) is None:
                raise KeyError(name)
            self._bump()

    def node_names(self) -> list[str]:
        with self._lock:
            return sorted(self._nodes)

    def get_node(self, name: Optional[str] = None) -> dict[str, Any]:
        """A copy of the stored Node."""
        name = name or self._default_node()
        with self._lock:
            if name not in self._nodes:
                raise KeyError(name)
            return copy.deepcopy(self._nodes[name])

    def resource_version(self, name: Optional[str] = None) -> str:
        return self.get_node(name)["metadata"]["resourceVersion"]

    def labels(self, name: Optional[str] = None) -> dict[str, str]:
        return dict(self.get_node(name)["metadata"].get("labels", {}))

    def annotations(self, name: Optional[str] = None) -> dict[str, str]:
        return dict(self.get_node(name)["metadata"].get("annotations", {}))

    def condition(self, ctype: str, name: Optional[str] = None) -> Optional[dict[str, Any]]:
        for cond in self.get_node(name)["status"].get("conditions", []):
            if cond.get("type") == ctype:
                return dict(cond)
        return None

    def modify_node(self, name: Optional[str], change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        """Change a stored Node as another actor would: `change` edits a copy in place (or returns
        a replacement); resourceVersion is bumped when the result differs."""
        name = name or self._default_node()
        with self._lock:
            if name not in self._nodes:
                raise KeyError(name)
            current = self._nodes[name]
            working = copy.deepcopy(current)
            returned = change(working)
            candidate = self._canonical(returned if isinstance(returned, dict) else working)
            candidate["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            if candidate == current:
                return copy.deepcopy(current)
            return self._store(name, candidate)

    def set_labels(self, labels: Mapping[str, Optional[str]], name: Optional[str] = None) -> dict[str, Any]:
        """Set labels (None removes one) as an administrator or another controller would."""
        def change(node: dict[str, Any]) -> None:
            current = node["metadata"].setdefault("labels", {})
            for key, value in labels.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = value
        return self.modify_node(name, change)

    def set_annotations(self, annotations: Mapping[str, Optional[str]], name: Optional[str] = None) -> dict[str, Any]:
        def change(node: dict[str, Any]) -> None:
            current = node["metadata"].setdefault("annotations", {})
            for key, value in annotations.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = value
        return self.modify_node(name, change)

    def set_taints(self, taints: Sequence[Mapping[str, Any]], name: Optional[str] = None) -> dict[str, Any]:
        def change(node: dict[str, Any]) -> None:
            node["spec"]["taints"] = [dict(t) for t in taints]
        return self.modify_node(name, change)

    def set_condition(self, ctype: str, status: str, reason: str = "", message: str = "", *,
                      name: Optional[str] = None, heartbeat: bool = True) -> dict[str, Any]:
        """Set a condition the way the kubelet does: lastTransitionTime moves only when status
        changes, lastHeartbeatTime on every write (heartbeat=False leaves it)."""
        now = _format_time(_now())

        def change(node: dict[str, Any]) -> None:
            conditions = node["status"].setdefault("conditions", [])
            for cond in conditions:
                if cond.get("type") == ctype:
                    if cond.get("status") != status:
                        cond["lastTransitionTime"] = now
                    cond.update(status=status, reason=reason, message=message)
                    if heartbeat:
                        cond["lastHeartbeatTime"] = now
                    return
            conditions.append({"type": ctype, "status": status, "lastHeartbeatTime": now if heartbeat else None,
                               "lastTransitionTime": now, "reason": reason, "message": message})
        return self.modify_node(name, change)

    def remove_condition(self, ctype: str, name: Optional[str] = None) -> dict[str, Any]:
        def change(node: dict[str, Any]) -> None:
            node["status"]["conditions"] = [c for c in node["status"].get("conditions", []) if c.get("type") != ctype]
        return self.modify_node(name, change)

    def kubelet_heartbeat(self, name: Optional[str] = None, at: Optional[_dt.datetime] = None) -> dict[str, Any]:
        """The kubelet's periodic status update: lastHeartbeatTime of its four conditions."""
        stamp = _format_time(at or _now())

        def change(node: dict[str, Any]) -> None:
            for cond in node["status"].get("conditions", []):
                if cond.get("type") in KUBELET_CONDITIONS:
                    cond["lastHeartbeatTime"] = stamp
        return self.modify_node(name, change)

    # ---- HTTP -----------------------------------------------------------------------------

    def _read_body(self, handler: _Handler) -> bytes:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                line = handler.rfile.readline(65537)
                size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while handler.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                chunks.append(handler.rfile.read(size))
                handler.rfile.readline(65537)
            return b"".join(chunks)
        length = int(handler.headers.get("Content-Length") or 0)
        if length > 3 * 1024 * 1024:
            raise ApiError(413, "Request entity too large: limit is 3145728", "RequestEntityTooLarge")
        return handler.rfile.read(length) if length else b""

    def _handle(self, handler: _Handler) -> None:
        method = handler.command
        split = urlsplit(handler.path)
        path, query = split.path, parse_qs(split.query, keep_blank_values=True)
        try:
            body = self._read_body(handler)
        except ApiError as err:
            handler.close_connection = True
            self._send(handler, err.code, err.body, err.headers, None)
            return
        record = RequestRecord(method=method, path=path, query=query, content_type=handler.headers.get("Content-Type"),
                               body=body, headers={k: v for k, v in handler.headers.items()}, time=time.time(),
                               monotonic=time.monotonic())
        user, auth_error = self._authenticate(handler)
        if user is not None:
            record.user, record.groups = user.name, user.groups
        self._record(record)
        fault = self._take_fault(method, path)
        try:
            if fault is not None and fault.kind == "write":
                self._write_concurrently(path, fault)
                fault = None
            if fault is not None:
                record.fault = fault.kind
                if fault.kind == "reset":
                    raise _Hangup()
                if fault.kind == "delay":
                    self._stopping.wait(fault.seconds)
                elif fault.kind == "hang":
                    if fault.apply:
                        try:
                            self._process(method, path, query, body, handler, user, auth_error)
                        except ApiError:
                            pass
                    self._stopping.wait(fault.seconds)
                    raise _Hangup()
                elif fault.kind == "status":
                    injected = self._injected(fault)
                    self._send(handler, injected.code, injected.body, injected.headers, record)
                    return
            code, payload, headers = self._process(method, path, query, body, handler, user, auth_error)
            self._send(handler, code, payload, headers, record)
        except _Hangup:
            handler.close_connection = True
            self._finish_record(record)
            try:
                handler.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except ApiError as err:
            self._send(handler, err.code, err.body, err.headers, record)
        except (ConnectionError, ssl.SSLError, socket.timeout, TimeoutError):
            handler.close_connection = True
            self._finish_record(record)
        except Exception:  # the emulator's own bug: answer like kube would, keep the traceback
            tb = traceback.format_exc()
            self._errors.append(tb)
            failure = ApiError(
                500, "Internal error occurred: emulator failure (see KubeEmulator.errors)", "InternalError"
            )
            self._finish_record(record, error=tb)
            self._send(handler, failure.code, failure.body, {}, record)

    def _write_concurrently(self, path: str, fault: Fault) -> None:
        name = _node_name_from_path(path)
        if name is None or name not in self.node_names():
            return
        writes = fault.hits

        def change(node: dict[str, Any]) -> None:
            node["metadata"].setdefault("annotations", {})[CONCURRENT_WRITER] = str(writes)

        self.modify_node(name, change)

    def _injected(self, fault: Fault) -> ApiError:
        headers = {"Retry-After": str(fault.retry_after)} if fault.retry_after is not None else {}
        code = fault.status
        if code == 500:
            message = fault.message or "injected fault"
            return ApiError(500, f"Internal error occurred: {message}", "InternalError",
                            {"causes": [{"message": message}]}, headers)
        if code == 503:
            return ApiError(503, fault.message or "the server is currently unable to handle the request",
                            "ServiceUnavailable", None, headers)
        if code == 429:  # Go's http.Error: text, its line ended, and nosniff
            err = ApiError(429, fault.message or "Too many requests, please try again later.", "TooManyRequests",
                           None, {**headers, "X-Content-Type-Options": "nosniff"})
            err.body = f"{err}\n".encode()
            return err
        if code == 504:
            return ApiError(504, fault.message or "Timeout: request did not complete within requested timeout - "
                            "context deadline exceeded", "Timeout", None, headers)
        if code == 401:
            return ApiError(401, "Unauthorized", "Unauthorized", None, headers)
        return ApiError(code, fault.message or f"injected {code}", _REASONS.get(code, ""), None, headers)

    def _send(self, handler: _Handler, code: int, payload: Any, headers: Mapping[str, str],
              record: Optional[RequestRecord]) -> None:
        if isinstance(payload, bytes):  # a filter's plain text, before any handler writes a Status
            data = payload
        else:
            data = b"" if payload is None else (json.dumps(payload, separators=(",", ":")) + "\n").encode()
        if record is not None:
            self._finish_record(record, status=code, response=payload)
        try:
            handler.send_response(code)
            handler.send_header("Audit-Id", str(uuid.uuid4()))
            handler.send_header("Cache-Control", "no-cache, private")
            if isinstance(payload, bytes):
                handler.send_header("Content-Type", "text/plain; charset=utf-8")
            elif payload is not None:
                handler.send_header("Content-Type", JSON)
            for key, value in headers.items():
                handler.send_header(key, value)
            handler.send_header("Content-Length", str(len(data)))
            if handler.close_connection:
                handler.send_header("Connection", "close")
            handler.end_headers()
            if handler.command != "HEAD":
                handler.wfile.write(data)
            handler.wfile.flush()
        except (ConnectionError, ssl.SSLError, socket.timeout, TimeoutError, OSError):
            handler.close_connection = True

    # ---- authentication and authorization ----------------------------------------------------

    def _authenticate(self, handler: _Handler) -> tuple[Optional[User], Optional[str]]:
        errors: list[str] = []
        try:
            der = handler.connection.getpeercert(binary_form=True)
        except (AttributeError, ValueError):
            der = None
        if der:
            try:
                cert = x509.load_der_x509_certificate(der)
                self.pki.verify_client_cert(cert)
                cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
                orgs = tuple(str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME))
                name = str(cns[0].value) if cns else ""
                if name:
                    return User(name, orgs + (AUTHENTICATED_GROUP,)), None
                errors.append("x509: certificate has no common name")
            except ValueError as exc:
                errors.append(str(exc))
        authorization = handler.headers.get("Authorization", "")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            with self._lock:
                user = self._tokens.get(token.strip())
            if user is not None:
                return user, None
            errors.append("invalid bearer token")
        if errors:
            return None, "; ".join(errors)
        if self.anonymous_auth:
            return User("system:anonymous", ("system:unauthenticated",)), None
        return None, "no credentials"

    def _authorize(self, user: User, verb: str, resource: str, subresource: str, name: str) -> tuple[bool, str]:
        if MASTERS_GROUP in user.groups:
            return True, ""
        reasons: list[str] = []
        node = user.node_name
        full = resource + ("/" + subresource if subresource else "")
        if node is not None and node != "" and resource == "nodes":
            if self.authorize_node_with_selectors:
                allowed, reason = _authorize_node(node, verb, subresource, name)
                if allowed:
                    return True, ""
                if reason:
                    reasons.append(reason)
            elif (verb in ("create", "get", "list", "watch") and full == "nodes") or \
                    (verb in ("update", "patch") and full in ("nodes", "nodes/status")):
                return True, ""
        with self._lock:
            grants = list(self._grants)
        if any(g.allows(user, verb, full) for g in grants):
            return True, ""
        return False, "\n".join(reasons)

    def _forbid(self, user: User, verb: str, subresource: str, name: str, reason: str) -> ApiError:
        resource = "nodes" + ("/" + subresource if subresource else "")
        message = f'User "{user.name}" cannot {verb} resource "{resource}" in API group "" at the cluster scope'
        if reason:
            message += ": " + reason
        return _forbidden(name, message)

    # ---- request processing --------------------------------------------------------------------

    def _process(self, method: str, path: str, query: dict[str, list[str]], body: bytes, handler: _Handler,
                 user: Optional[User], auth_error: Optional[str]) -> tuple[int, Any, dict[str, str]]:
        if user is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        parts = [p for p in path.split("/") if p]
        if parts == ["api", "v1", "pods"] and method == "GET":
            return self._list_pods(user, query)
        if parts[:3] == ["apis", "resource.k8s.io", "v1"]:
            return self._resource_api(method, parts[3:], query, body, user)
        if parts[:3] != ["api", "v1", "nodes"] or len(parts) > 5 or (len(parts) == 5 and parts[4] != "status"):
            raise ApiError(404, "the server could not find the requested resource", "NotFound", {})
        name = parts[3] if len(parts) >= 4 else ""
        subresource = parts[4] if len(parts) == 5 else ""
        verb = {"GET": "get", "HEAD": "get", "PATCH": "patch", "PUT": "update", "POST": "create",
                "DELETE": "delete"}.get(method, method.lower())
        if verb == "get" and not name:
            verb = "list"
        allowed, reason = self._authorize(user, verb, "nodes", subresource, name)
        if not allowed:
            raise self._forbid(user, verb, subresource, name, reason)
        if verb == "get":
            with self._lock:
                node = self._nodes.get(name)
                if node is None:
                    raise _not_found(name)
                return 200, copy.deepcopy(node), {}
        if verb == "patch":
            return self._write(name, subresource, query, body, handler, user)
        raise ApiError(405, "the server does not allow this method on the requested resource "
                            "(the emulator serves what the agent sends: get and patch of a node)",
                       "MethodNotAllowed", {})

    def add_pod(self, namespace: str, name: str, node: str, uid: str,
                labels: Optional[Mapping[str, str]] = None) -> None:
        """A pod bound to `node`, for the pods list (metadata and spec.nodeName only)."""
        with self._lock:
            self._pods.append({"metadata": {"namespace": namespace, "name": name, "uid": uid,
                                            "labels": dict(labels or {})}, "spec": {"nodeName": node}})

    def _list_pods(self, user: User, query: dict[str, list[str]]) -> tuple[int, Any, dict[str, str]]:
        """GET /api/v1/pods with a spec.nodeName field selector: the Node authorizer lets a node list the
        pods bound to it, and no others (a list without that selector is refused)."""
        selector = query.get("fieldSelector", [""])[-1]
        node = selector[len("spec.nodeName="):] if selector.startswith("spec.nodeName=") else None
        if MASTERS_GROUP not in user.groups and (node is None or node != user.node_name):
            raise _forbidden("", f'User "{user.name}" cannot list resource "pods" in API group "" at the cluster '
                                 "scope: can only list/watch pods with spec.nodeName field selector")
        with self._lock:
            items = [copy.deepcopy(pod) for pod in self._pods if node is None or pod["spec"]["nodeName"] == node]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)},
                     "items": items}, {}

    # ---- resource.k8s.io/v1: ResourceSlices and ResourceClaims (DRA, Kubernetes 1.34) ---------------------
    # As kube-apiserver 1.34 with the Node authorizer (AuthorizeNodeWithSelectors) and NodeRestriction: a node
    # creates slices whose spec.nodeName is its own, gets, replaces and deletes only such slices, lists them only
    # with the field selector spec.nodeName=<itself>, and gets a ResourceClaim only of a pod bound to it. The
    # slice validation the agent's slices meet: at most 128 devices, at most 32 attributes and capacities per
    # device, device names DNS labels, one value per attribute; quantities come back in canonical form. A
    # device's taints are dropped while DRADeviceTaints is off, unless the stored slice holds taints already
    # (the ResourceSlice strategy's dropDisabledDRADeviceTaintsFields); kept while it is on, a taint without
    # timeAdded given the time of the write. DeviceClasses are listed by masters and by a grant only (the
    # system:node role has none); the rig's test holds the 403 and the gate's dropped field to the real server.

    def add_resource_claim(self, namespace: str, name: str, uid: str, node: str,
                           results: Sequence[Mapping[str, str]] = (), config: Sequence[Any] = ()) -> None:
        """A ResourceClaim reserved for a pod on `node`, allocated `results` (driver, pool, device, request)
        with the allocation's `config` (each as the scheduler copies it from the class or the claim: source,
        requests, opaque driver and parameters); no results: not allocated."""
        claim: dict[str, Any] = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                 "metadata": {"namespace": namespace, "name": name, "uid": uid,
                                              "resourceVersion": self._bump()},
                                 "spec": {"devices": {"requests": []}}, "status": {}}
        if results:
            claim["status"]["allocation"] = {"devices": {"results": [dict(result) for result in results]}}
            if config:
                claim["status"]["allocation"]["devices"]["config"] = copy.deepcopy(list(config))
        with self._lock:
            self._claims[(namespace, name)] = (claim, node)

    def add_device_class(self, name: str, extended_resource_name: Optional[str] = None) -> None:
        """A DeviceClass of driver gpu.nvidia.com's devices, as the apiserver stores it (with DRAExtendedResource
        on where `extended_resource_name` is given: off, the apiserver drops the field)."""
        spec: dict[str, Any] = {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}
        if extended_resource_name is not None:
            spec["extendedResourceName"] = extended_resource_name
        with self._lock:
            self._device_classes[name] = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                          "metadata": {"name": name, "resourceVersion": self._bump()}, "spec": spec}

    def resource_slices(self, node: Optional[str] = None) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(item) for _, item in sorted(self._slices.items())
                    if node is None or item["spec"].get("nodeName") == node]

    def delete_resource_slices(self, node: str) -> None:
        """What a kubelet does when it starts: its node's slices are deleted."""
        with self._lock:
            for name in [name for name, item in self._slices.items() if item["spec"].get("nodeName") == node]:
                del self._slices[name]

    def _resource_api(self, method: str, parts: list[str], query: dict[str, list[str]], body: bytes,
                      user: User) -> tuple[int, Any, dict[str, str]]:
        masters = MASTERS_GROUP in user.groups
        node = user.node_name
        if len(parts) == 4 and parts[0] == "namespaces" and parts[2] == "resourceclaims" and method == "GET":
            with self._lock:
                found = self._claims.get((parts[1], parts[3]))
            if not masters and (found is None or found[1] != node):
                raise _forbidden(parts[3], f'User "{user.name}" cannot get resource "resourceclaims" in API group '
                                           f'"resource.k8s.io" in the namespace "{parts[1]}": no relationship found '
                                           f"between node '{node}' and this object")
            if found is None:
                raise ApiError(404, f'resourceclaims.resource.k8s.io "{parts[3]}" not found', "NotFound",
                               {"name": parts[3], "group": "resource.k8s.io", "kind": "resourceclaims"})
            return 200, copy.deepcopy(found[0]), {}
        if parts == ["deviceclasses"] and method == "GET":
            # RBAC: the system:node role grants no DeviceClasses; a grant(group, ["list"], ["deviceclasses"]) does
            with self._lock:
                granted = any(g.allows(user, "list", "deviceclasses") for g in self._grants)
                items = [copy.deepcopy(item) for _, item in sorted(self._device_classes.items())]
            if not masters and not granted:
                raise ApiError(403, f'deviceclasses.resource.k8s.io is forbidden: User "{user.name}" cannot list '
                                    'resource "deviceclasses" in API group "resource.k8s.io" at the cluster scope',
                               "Forbidden", {"group": "resource.k8s.io", "kind": "deviceclasses"})
            return 200, {"kind": "DeviceClassList", "apiVersion": "resource.k8s.io/v1",
                         "metadata": {"resourceVersion": str(self._rv)}, "items": items}, {}
        if not parts or parts[0] != "resourceslices" or len(parts) > 2:
            raise ApiError(404, "the server could not find the requested resource", "NotFound", {})
        name = parts[1] if len(parts) == 2 else ""
        with self._lock:
            if method == "GET" and not name:
                return self._list_slices(user, query)
            if method == "POST" and not name:
                return self._create_slice(user, body)
            existing = self._slices.get(name)
            if not masters and (existing is None or existing["spec"].get("nodeName") != node):
                verb = {"GET": "get", "PUT": "update", "DELETE": "delete", "PATCH": "patch"}.get(method, method)
                raise _forbidden(name, f'User "{user.name}" cannot {verb} resource "resourceslices" in API group '
                                       f'"resource.k8s.io" at the cluster scope: no relationship found between '
                                       f"node '{node}' and this object")
            if existing is None:
                raise ApiError(404, f'resourceslices.resource.k8s.io "{name}" not found', "NotFound",
                               {"name": name, "group": "resource.k8s.io", "kind": "resourceslices"})
            if method == "GET":
                return 200, copy.deepcopy(existing), {}
            if method == "DELETE":
                del self._slices[name]
                return 200, copy.deepcopy(existing), {}
            if method == "PUT":
                return self._replace_slice(user, name, existing, body)
        raise ApiError(405, "the server does not allow this method on the requested resource", "MethodNotAllowed", {})

    def _list_slices(self, user: User, query: dict[str, list[str]]) -> tuple[int, Any, dict[str, str]]:
        wanted: dict[str, str] = {}
        for requirement in filter(None, query.get("fieldSelector", [""])[-1].split(",")):
            key, _, value = requirement.partition("=")
            if key not in ("spec.nodeName", "spec.driver", "spec.pool.name"):
                raise _bad_request(f'field label not supported: {key}')
            wanted[key] = value
        if MASTERS_GROUP not in user.groups and wanted.get("spec.nodeName") != user.node_name:
            raise _forbidden("", f'User "{user.name}" cannot list resource "resourceslices" in API group '
                                 '"resource.k8s.io" at the cluster scope: can only list/watch/deletecollection '
                                 "resourceslices with nodeName field selector")
        fields = {"spec.nodeName": ("nodeName",), "spec.driver": ("driver",), "spec.pool.name": ("pool", "name")}
        items = []
        for _, item in sorted(self._slices.items()):
            values = {key: _field_at(item["spec"], path) for key, path in fields.items()}
            if all(values[key] == value for key, value in wanted.items()):
                items.append(copy.deepcopy(item))
        return 200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                     "metadata": {"resourceVersion": str(self._rv)}, "items": items}, {}

    def _decoded_slice(self, body: bytes) -> dict[str, Any]:
        try:
            document = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise _bad_request(f"error decoding the body: {exc}") from None
        if not isinstance(document, dict) or not isinstance(document.get("spec"), dict) or \
                not isinstance(document.get("metadata"), dict):
            raise _bad_request("the body is not a ResourceSlice")
        errors = _slice_errors(document["spec"])
        if errors:
            name = document["metadata"].get("name") or document["metadata"].get("generateName", "")
            raise _invalid(name, errors, kind="ResourceSlice")
        _canonical_quantities(document["spec"])
        return document

    def _create_slice(self, user: User, body: bytes) -> tuple[int, Any, dict[str, str]]:
        document = self._decoded_slice(body)
        node = user.node_name
        if node is not None and MASTERS_GROUP not in user.groups and document["spec"].get("nodeName") != node:
            raise _forbidden("", "can only create ResourceSlice with the same NodeName as the requesting node")
        metadata = document["metadata"]
        name = metadata.get("name") or (metadata.get("generateName", "") + secrets.token_hex(3)[:5])
        if name in self._slices:
            raise ApiError(409, f'resourceslices.resource.k8s.io "{name}" already exists', "AlreadyExists",
                           {"name": name, "group": "resource.k8s.io", "kind": "resourceslices"})
        metadata.update(name=name, uid=str(uuid.uuid4()), generation=1, resourceVersion=self._bump(),
                        creationTimestamp=_format_time(_now()))
        self._taints_as_gated(document["spec"], None)
        document.update(apiVersion="resource.k8s.io/v1", kind="ResourceSlice")
        self._slices[name] = document
        return 201, copy.deepcopy(document), {}

    def _replace_slice(self, user: User, name: str, existing: dict[str, Any],
                       body: bytes) -> tuple[int, Any, dict[str, str]]:
        document = self._decoded_slice(body)
        metadata, old = document["metadata"], existing["metadata"]
        if metadata.get("name") != name:
            raise _bad_request(f"the name of the object ({metadata.get('name')}) does not match the name on the URL "
                               f"({name})")
        version = metadata.get("resourceVersion")
        if version and version != old["resourceVersion"]:
            raise _conflict(name, OPTIMISTIC_LOCK_MSG)
        if document["spec"].get("nodeName") != existing["spec"].get("nodeName"):
            raise _invalid(name, [_FieldError("spec.nodeName", "FieldValueInvalid", "field is immutable")],
                           kind="ResourceSlice")
        self._taints_as_gated(document["spec"], existing["spec"])
        if document["spec"] == existing["spec"]:
            return 200, copy.deepcopy(existing), {}
        stored = {**existing, "spec": document["spec"],
                  "metadata": {**old, "resourceVersion": self._bump(), "generation": old.get("generation", 1) + 1}}
        self._slices[name] = stored
        return 200, copy.deepcopy(stored), {}

    def _taints_as_gated(self, spec: dict[str, Any], old: Optional[dict[str, Any]]) -> None:
        devices = [device for device in spec.get("devices") or () if isinstance(device, dict)]
        in_use = old is not None and any(isinstance(d, dict) and d.get("taints") for d in old.get("devices") or ())
        for device in devices:
            if not self.device_taints and not in_use:
                device.pop("taints", None)
            for taint in device.get("taints") or ():
                if isinstance(taint, dict) and not taint.get("timeAdded"):
                    taint["timeAdded"] = _format_time(_now())

    def _write(self, name: str, subresource: str, query: dict[str, list[str]], body: bytes,
               handler: _Handler, user: User) -> tuple[int, Any, dict[str, str]]:
        content_type = (handler.headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if content_type in (JSON_PATCH, APPLY_PATCH):  # a real server's patch types the agent never sends
            raise ApiError(415, "the body of the request was in an unknown format - accepted media types include: "
                                f"{JSON_PATCH}, {MERGE_PATCH}, {APPLY_PATCH}, {STRATEGIC_MERGE_PATCH}",
                           "UnsupportedMediaType")
        if content_type not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH):  # kube-apiserver v1.34.4's answer
            raise ApiError(415, "415: Unsupported Media Type", "UnsupportedMediaType", {})
        try:
            document = json.loads(body.decode("utf-8")) if body else None
        except (UnicodeDecodeError, ValueError) as exc:
            if content_type == MERGE_PATCH:
                raise _bad_request("Invalid JSON Patch") from exc
            raise _bad_request(f"error decoding patch: {exc}") from exc
        if not isinstance(document, dict):
            raise _bad_request("invalid JSON document" if content_type == STRATEGIC_MERGE_PATCH
                               else "Invalid JSON Patch")
        field_validation = query.get("fieldValidation", ["Warn"])[-1]
        warnings: list[str] = []
        with self._lock:
            existing = self._nodes.get(name)
            if existing is None:
                raise _not_found(name)
            if content_type == MERGE_PATCH:
                patched = merge_patch(copy.deepcopy(existing), document)
            else:
                try:
                    patched = strategic_merge_patch(copy.deepcopy(existing), document)
                except _SMPError as exc:
                    raise exc.error from None
            conformer = _Conformer()
            try:
                candidate = conformer.node(patched)
            except _DecodeError as exc:
                compact = json.dumps(patched, separators=(",", ":"))
                raise _invalid("", [_FieldError("patch", "FieldValueInvalid",
                                                f"Invalid value: {json.dumps(compact)}: {exc}")], kind="") from None
            if conformer.unknown:
                if field_validation == "Strict":
                    unknown = ", ".join(f'unknown field "{u}"' for u in conformer.unknown)
                    raise _bad_request("strict decoding error: " + unknown)
                if field_validation != "Ignore":
                    warnings.extend(f'unknown field "{u}"' for u in conformer.unknown)
            new_name = candidate["metadata"].get("name", "")
            if new_name != name:
                raise _bad_request(f"the name of the object ({new_name}) does not match the name on the URL ({name})")
            node_identity = user.node_name
            if node_identity is not None:
                self._admit(node_identity, name, existing, candidate)
            new_rv = candidate["metadata"].get("resourceVersion", "")
            if new_rv and new_rv != existing["metadata"]["resourceVersion"]:
                if not new_rv.isdigit():
                    raise _bad_request(f'invalid resource version "{new_rv}"')
                raise _conflict(name)
            # registry strategy: the main resource cannot write status, the status subresource cannot write spec
            if subresource == "status":
                candidate["spec"] = copy.deepcopy(existing.get("spec", {}))
            else:
                candidate["status"] = copy.deepcopy(existing.get("status", {}))
            meta, old_meta = candidate["metadata"], existing["metadata"]
            errors: list[_FieldError] = []
            if not meta.get("uid"):
                meta["uid"] = old_meta["uid"]
            elif meta["uid"] != old_meta["uid"]:
                errors.append(_FieldError("metadata.uid", "FieldValueInvalid",
                                          f"Invalid value: {json.dumps(meta['uid'])}: field is immutable"))
            meta["creationTimestamp"] = old_meta.get("creationTimestamp")
            for key in ("generation", "namespace", "selfLink", "managedFields"):
                meta.pop(key, None)
                if key in old_meta:
                    meta[key] = copy.deepcopy(old_meta[key])
            meta["resourceVersion"] = old_meta["resourceVersion"]
            invalid = _validate_metadata(candidate)
            if errors or invalid:  # the repeats are known for metadata errors alone
                raise _invalid(name, errors + invalid, repeats=1 if errors else METADATA_CAUSE_REPEATS)
            candidate = self._canonical(candidate)
            headers = {"Warning": ", ".join(f'299 - {json.dumps(w)}' for w in warnings)} if warnings else {}
            if candidate == existing:
                return 200, copy.deepcopy(existing), headers
            return 200, self._store(name, candidate), headers

    def _admit(self, node_name: str, requested: str, old: dict[str, Any], new: dict[str, Any]) -> None:
        """NodeRestriction's admitNode for an update."""
        if requested != node_name:
            raise _forbidden(requested, f'node "{node_name}" is not allowed to modify node "{requested}"')
        new_source, old_source = new.get("spec", {}).get("configSource"), old.get("spec", {}).get("configSource")
        if new_source is not None and new_source != old_source:
            raise _forbidden(
                requested, f'node "{node_name}" is not allowed to update configSource to a new non-nil configSource'
            )
        if (new.get("spec", {}).get("taints") or []) != (old.get("spec", {}).get("taints") or []):
            raise _forbidden(requested, f'node "{node_name}" is not allowed to modify taints')
        modified = _modified_labels(new["metadata"].get("labels", {}), old["metadata"].get("labels", {}))
        forbidden = forbidden_node_labels(modified)
        if forbidden:
            raise _forbidden(requested, "is not allowed to modify labels: " + ", ".join(forbidden))


def _authorize_node(node: str, verb: str, subresource: str, name: str) -> tuple[bool, str]:
    """The Node authorizer's authorizeNode (AuthorizeNodeWithSelectors)."""
    if subresource == "":
        if verb in ("create", "update", "patch"):
            return True, ""
        if verb in ("get", "list", "watch"):
            if name == node:
                return True, ""
            if name == "":
                return False, f"node '{node}' cannot read all nodes, only its own Node object"
            return False, f"node '{node}' cannot read '{name}', only its own Node object"
    elif subresource == "status" and verb in ("update", "patch"):
        return True, ""
    return False, ""


# ---- ResourceSlice validation and quantities (resource.k8s.io/v1, Kubernetes 1.34) -----------------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_SEMVER = re.compile(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?")
_DECIMAL_SUFFIXES = {"": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SUFFIXES = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


def _field_at(value: Any, path: Sequence[str]) -> Any:
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _slice_errors(spec: dict[str, Any]) -> list[_FieldError]:
    errors = []
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        return [_FieldError("spec.devices", "FieldValueTypeInvalid", "must be a list")]
    if len(devices) > 128:
        errors.append(_FieldError("spec.devices", "FieldValueTooMany", f"Too many: {len(devices)}: must have at most "
                                                                       "128 items"))
    pool = spec.get("pool") if isinstance(spec.get("pool"), dict) else {}
    if not pool.get("name"):
        errors.append(_FieldError("spec.pool.name", "FieldValueRequired", "Required value"))
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] < 1:
        errors.append(_FieldError("spec.pool.resourceSliceCount", "FieldValueInvalid", "must be greater than zero"))
    if not spec.get("driver"):
        errors.append(_FieldError("spec.driver", "FieldValueRequired", "Required value"))
    for number, device in enumerate(devices[:128]):
        where = f"spec.devices[{number}]"
        name = device.get("name", "") if isinstance(device, dict) else ""
        if not (len(name) <= 63 and _DNS_LABEL.fullmatch(name)):
            errors.append(_FieldError(f"{where}.name", "FieldValueInvalid", "a lowercase RFC 1123 label must consist "
                                      "of lower case alphanumeric characters or '-'"))
        attributes = device.get("attributes") or {}
        capacity = device.get("capacity") or {}
        if len(attributes) + len(capacity) > 32:
            errors.append(_FieldError(where, "FieldValueTooMany", f"Too many: {len(attributes) + len(capacity)}: "
                                      "must have at most 32 attributes and capacities combined"))
        for key, value in attributes.items():
            kinds = [kind for kind in ("int", "bool", "string", "version") if kind in (value or {})]
            if len(kinds) != 1:
                errors.append(_FieldError(f"{where}.attributes[{key}]", "FieldValueInvalid",
                                          "exactly one value must be specified"))
            elif kinds == ["version"] and not _SEMVER.fullmatch(str(value["version"])):
                errors.append(_FieldError(f"{where}.attributes[{key}].version", "FieldValueInvalid",
                                          "must be a string compatible with semver.org spec 2.0.0"))
        for key, value in capacity.items():
            if _quantity(str((value or {}).get("value", ""))) is None:
                errors.append(_FieldError(f"{where}.capacity[{key}].value", "FieldValueInvalid",
                                          "quantities must match the regular expression"))
    return errors


def _quantity(text: str) -> Optional[tuple[int, bool]]:
    """A whole quantity's value and whether its suffix is binary; None for what the emulator cannot read."""
    match = re.fullmatch(r"([0-9]+)([a-zA-Z]*)", text)
    if match is None:
        return None
    digits, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(digits) * 10 ** _DECIMAL_SUFFIXES[suffix], False
    if suffix in _BINARY_SUFFIXES:
        return int(digits) << _BINARY_SUFFIXES[suffix], True
    return None


def canonical_quantity(text: str) -> str:
    """apimachinery's canonical form of a whole quantity: the format its suffix chose, the largest suffix
    that keeps the number whole (DecimalSI by thousands, BinarySI by 1024s)."""
    parsed = _quantity(text)
    if parsed is None:
        return text
    value, binary = parsed
    if binary:
        for suffix, shift in sorted(_BINARY_SUFFIXES.items(), key=lambda item: -item[1]):
            if value and value % (1 << shift) == 0:
                return f"{value >> shift}{suffix}"
        return str(value)
    for suffix, exponent in sorted(_DECIMAL_SUFFIXES.items(), key=lambda item: -item[1]):
        if exponent and value and value % 10 ** exponent == 0:
            return f"{value // 10 ** exponent}{suffix}"
    return str(value)


def _canonical_quantities(spec: dict[str, Any]) -> None:
    for device in spec.get("devices") or []:
        for value in (device.get("capacity") or {}).values():
            value["value"] = canonical_quantity(str(value["value"]))


def _node_name_from_path(path: str) -> Optional[str]:
    parts = [p for p in path.split("/") if p]
    if parts[:3] == ["api", "v1", "nodes"] and len(parts) >= 4:
        return parts[3]
    return None


# --------------------------------------------------------------------------------------------
# kubeconfig
# --------------------------------------------------------------------------------------------

def write_kubeconfig(path: Union[str, Path], server: Union[KubeEmulator, str],
                     user: Union[str, Credentials, None] = None,
                     mode: str = "cert-data", *, groups: Optional[Iterable[str]] = None, token: Optional[str] = None,
                     ca_pem: Optional[bytes] = None, ca_path: Optional[Path] = None, combined_pem: bool = False,
                     cluster_name: str = "kubernetes", context_name: Optional[str] = None) -> Path:
    """Write a kubeconfig for `user` against `server` and return its path.

    server: a KubeEmulator (its URL and CA), or a URL (then give ca_pem or ca_path, and
        credentials as `user` or `token`).
    user: a Credentials; or a user name (a node's "system:node:<n>" gets group system:nodes, other
        names `groups`); None means the emulator's first node.
    mode: "cert-data": certificate-authority-data, client-certificate-data, client-key-data;
          "cert-files": certificate-authority, client-certificate, client-key file paths
              (combined_pem=True points both at one cert+key file, like the kubelet's
              kubelet-client-current.pem);
          "token": certificate-authority-data and a bearer token (`token`, or one registered now
              for the user on the emulator).
    """
    path = Path(path)
    if isinstance(server, KubeEmulator):
        url = server.url
        ca_pem = ca_pem or server.pki.ca_pem
        ca_path = ca_path or server.pki.ca_path
    else:
        url = server
    if ca_pem is None and ca_path is not None:
        ca_pem = Path(ca_path).read_bytes()
    if ca_pem is None:
        raise ValueError("the CA is unknown: give ca_pem or ca_path")
    if user is None:
        if not isinstance(server, KubeEmulator):
            raise ValueError("user is required when server is a URL")
        user = NODE_USER_PREFIX + server._default_node()
    user_name = user.common_name if isinstance(user, Credentials) else user
    if groups is None:
        groups = (NODES_GROUP,) if user_name.startswith(NODE_USER_PREFIX) else ()
    groups = tuple(groups)

    cluster: dict[str, Any] = {"server": url}
    entry: dict[str, Any] = {}
    if mode in ("cert-data", "cert-files"):
        if isinstance(user, Credentials):
            creds = user
        elif isinstance(server, KubeEmulator):
            if user_name.startswith(NODE_USER_PREFIX) and groups == (NODES_GROUP,):
                creds = server.node_credentials(user_name[len(NODE_USER_PREFIX):])
            else:
                creds = server.client_credentials(user_name, groups)
        else:
            raise ValueError("give Credentials as user when server is a URL")
        if mode == "cert-data":
            cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
            entry["client-certificate-data"] = base64.b64encode(creds.cert_pem).decode()
            entry["client-key-data"] = base64.b64encode(creds.key_pem).decode()
        else:
            if ca_path is None:
                ca_path = path.parent / f"{path.stem}-ca.crt"
                ca_path.write_bytes(ca_pem)
            cluster["certificate-authority"] = str(ca_path)
            entry["client-certificate"] = str(creds.combined_path if combined_pem else creds.cert_path)
            entry["client-key"] = str(creds.combined_path if combined_pem else creds.key_path)
    elif mode == "token":
        if token is None:
            if not isinstance(server, KubeEmulator):
                raise ValueError("give token when server is a URL")
            token = server.add_token(secrets.token_urlsafe(24), user_name, groups)
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
        entry["token"] = token
    else:
        raise ValueError(f"mode must be 'cert-data', 'cert-files' or 'token', not {mode!r}")

    context = context_name or f"{user_name}@{cluster_name}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": cluster_name, "cluster": cluster}],
        "users": [{"name": user_name, "user": entry}],
        "contexts": [{"name": context, "context": {"cluster": cluster_name, "user": user_name}}],
        "current-context": context,
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
