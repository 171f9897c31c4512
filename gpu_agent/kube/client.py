"""A small Kubernetes API client for one Node: GET and PATCH, with the node's own credentials.

Synchronous (stages run on worker threads), every request with a timeout, TLS verification on,
the client certificate re-read when the kubelet rotates it, requests counted against the node's
RequestBudget, and each outcome told to the node's ApiState, which says what follows a failure
(kube/retry.py) and holds requests back until a retry is due. Nothing the server answers reaches a
message with the token in it.
"""
from __future__ import annotations

import base64
import errno
import functools
import json
import os
import re
import socket
import ssl
import stat
import tempfile
from typing import Any, Optional
from urllib.parse import quote, urlsplit

import h11

from gpu_agent.config.text import shown
from gpu_agent.errors import AgentError
from gpu_agent.host import jsontext
from gpu_agent.host.paths import Root, followed
from gpu_agent.kube import retry
from gpu_agent.kube.api_state import ApiState, Next
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.exchange import Answer, Redirected, exchange
from gpu_agent.kube.kubeconfig import Credentials, load, read_token, shown_path
from gpu_agent.kube.names import node_name_problem, object_name_problem

MERGE_PATCH = "application/merge-patch+json"
JSON = "application/json"
RESOURCE_API = "/apis/resource.k8s.io/v1"  # DRA, GA in Kubernetes 1.34
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
MAX_RESPONSE_BYTES = 4 << 20  # etcd keeps objects up to 1.5 MiB
MAX_MESSAGE_CHARS = 300  # of the server's own message, in ours


class ApiError(AgentError):
    def __init__(self, message: str, status: int = 0, reason: str = "", cause: str = "",
                 retry_after: Optional[float] = None) -> None:
        """`cause`: why there was no answer (retry.TIMEOUT, retry.CONNECTION, retry.BUDGET), "" otherwise;
        `retry_after`: the seconds the server's Retry-After asked for."""
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.cause = cause
        self.retry_after = retry_after
        self.next = Next(retry.GIVE_UP)  # what follows, as the node's ApiState decided

    @property
    def failure(self) -> retry.Failure:
        return retry.Failure(self.status, self.cause, self.retry_after)


class KubeClient:
    def __init__(self, root: Root, kubeconfig: str, timeout: float, budget: RequestBudget,
                 api: Optional[ApiState] = None) -> None:
        """`api`: the node's ApiState, shared like the budget (None: one of this client's own)."""
        self.root = root
        self.kubeconfig = kubeconfig
        self.timeout = timeout
        self.budget = budget  # the node's, shared with every client the agent builds
        self.api = api or ApiState(budget)
        self._credentials: Optional[Credentials] = None
        self._kubeconfig_stamp: Optional[tuple[int, int]] = None
        self._context: Optional[ssl.SSLContext] = None
        self._context_key: Optional[tuple[Any, ...]] = None

    @property
    def credentials(self) -> Credentials:
        """The kubeconfig's, read again whenever the file changes (a new server, CA or user)."""
        stamp = _stamp(self.root, self.kubeconfig)
        if self._credentials is None or stamp != self._kubeconfig_stamp:
            self._credentials = load(self.root, self.kubeconfig)
            self._kubeconfig_stamp = stamp
            self._context = None
        return self._credentials

    def get_node(self, name: str) -> dict[str, Any]:
        """The Node, its fields the agent reads checked for shape (a malformed one is an ApiError)."""
        path = _node_path(name)
        return _checked_node(self._request("GET", path), f"GET {path}")

    def list_pods(self, node: str, limit: int) -> dict[str, Any]:
        """The PodList of the pods bound to `node` (the Node authorizer lets a node list those), at most
        `limit` of them; the caller reads their metadata."""
        query = f"fieldSelector={quote('spec.nodeName=' + node, safe='')}&limit={limit}"
        return self._request("GET", f"/api/v1/pods?{query}")

    def patch_node(self, name: str, patch: dict[str, Any], status: bool = False,
                   content_type: str = MERGE_PATCH, conflicts: int = 0) -> dict[str, Any]:
        """`conflicts`: the 409s this write met before (the ApiState re-reads after at most a few)."""
        path = _node_path(name) + ("/status" if status else "")
        return _checked_node(self._request("PATCH", path, json.dumps(patch).encode(), content_type, conflicts),
                             f"PATCH {path}")

    # --- DRA: the node's ResourceSlices (the Node authorizer and NodeRestriction let a node write those whose
    # spec.nodeName is its own, and list them with that field selector) and the claims of its pods ---------

    def list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        selector = quote(f"spec.nodeName={node},spec.driver={driver}", safe="")
        listed = self._request("GET", f"{RESOURCE_API}/resourceslices?fieldSelector={selector}")
        items = listed.get("items")
        if not isinstance(items, list) or not all(isinstance(item, dict) and isinstance(item.get("metadata"), dict)
                                                  for item in items):
            raise ApiError(f"GET {RESOURCE_API}/resourceslices: the answer is not a ResourceSliceList")
        return items

    def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", f"{RESOURCE_API}/resourceslices", json.dumps(body).encode(), JSON)

    def replace_resource_slice(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("PUT", _named(f"{RESOURCE_API}/resourceslices", name), json.dumps(body).encode(), JSON)

    def delete_resource_slice(self, name: str) -> dict[str, Any]:
        return self._request("DELETE", _named(f"{RESOURCE_API}/resourceslices", name))

    def list_device_classes(self, limit: int) -> list[Any]:
        """The cluster's DeviceClasses, at most `limit` (the node needs a grant: dra/extended.py)."""
        listed = self._request("GET", f"{RESOURCE_API}/deviceclasses?limit={limit}")
        items = listed.get("items")
        if not isinstance(items, list):
            raise ApiError(f"GET {RESOURCE_API}/deviceclasses: the answer is not a DeviceClassList")
        return items

    def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """A ResourceClaim of a pod bound to this node (the Node authorizer allows a node no other)."""
        return self._request("GET", _named(_named(f"{RESOURCE_API}/namespaces", namespace) + "/resourceclaims", name))

    # --- transport -------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: Optional[bytes] = None,
                 content_type: Optional[str] = None, conflicts: int = 0) -> dict[str, Any]:
        credentials = self.credentials  # everything a request needs is read before the budget is spent
        token = read_token(self.root, credentials)
        context = self._ssl(credentials) if credentials.server.startswith("https:") else None
        held = self.api.held()
        if held is not None:  # a failed request's retry is not due: nothing is sent, nothing spent
            at, error = held
            exc = ApiError(f"{method} {path} not sent: the next attempt is due in {at - self.api.now():.1f} s, "
                           f"after {error}")
            exc.next = Next(retry.WAIT, at)
            raise exc
        if not self.budget.take():
            raise self._failed(ApiError(f"{method} {path} not sent: {self.budget.per_minute} requests to the API "
                                        "server in the last minute already (the agent's limit)", cause=retry.BUDGET),
                               method, conflicts)
        try:
            answer = self._send(credentials, token, context, method, path, body, content_type)
        except ApiError as exc:  # whatever the server sent back, the token it was sent never shows
            raise self._failed(ApiError(_without(str(exc), token), exc.status, _without(exc.reason, token),
                                        exc.cause), method, conflicts) from None
        status, payload = answer.status, answer.body
        try:
            document = jsontext.loads(payload) if payload else {}
        except jsontext.NumberTooLong as exc:
            raise self._failed(ApiError(
                f"{method} {credentials.server}{path}: HTTP {status} with an integer of {exc.digits} digits at "
                f"{exc.where} of its body; no Kubernetes object holds one", status), method, conflicts) from None
        except (ValueError, RecursionError):
            document = None
        if status >= 400:
            raise self._failed(self._error(method, path, answer, document, credentials, token), method, conflicts)
        if not isinstance(document, dict):
            raise self._failed(ApiError(f"{method} {credentials.server}{path}: HTTP {status} with a body that is "
                                        "not a JSON object; is the kubeconfig's server a Kubernetes API server?",
                                        status), method, conflicts)
        self.api.answered(f"{method} {path}", write=method != "GET")
        return document

    def _failed(self, exc: ApiError, method: str, conflicts: int) -> ApiError:
        """`exc`, with what follows it as the node's ApiState decides (which logs it once)."""
        exc.next = self.api.failed(exc.failure, str(exc), write=method != "GET", conflicts=conflicts)
        return exc

    def _send(self, credentials: Credentials, token: Optional[str], context: Optional[ssl.SSLContext], method: str,
              path: str, body: Optional[bytes], content_type: Optional[str]) -> Answer:
        headers = [("Accept", "application/json"), ("User-Agent", "gpu-agent")]
        if content_type:
            headers.append(("Content-Type", content_type))
        if token:
            headers.append(("Authorization", f"Bearer {token}"))
        where = f"{method} {credentials.server}{path}"
        url = urlsplit(credentials.server)
        try:
            answer = exchange(url, context, method, url.path.rstrip("/") + path, headers, body, self.timeout,
                              MAX_RESPONSE_BYTES)
        except (OSError, h11.RemoteProtocolError) as exc:  # TLS verification failures included
            raise ApiError(f"{where}: {exc}", cause=_cause(exc)) from None
        except Redirected as exc:  # following would send the credentials on: never
            to = f" to {_excerpt(exc.location, token)}" if exc.location else " without a Location"
            raise ApiError(f"{where}: HTTP {exc.status}, a redirect{to}, which the agent does not follow; set the "
                           "kubeconfig's server to the API server's own address", exc.status) from None
        except ValueError:  # CannotForm, a host name IDNA cannot encode: the values stay unsaid
            raise ApiError(f"{where}: the request cannot be formed from the kubeconfig's values") from None
        if len(answer.body) > MAX_RESPONSE_BYTES:
            raise ApiError(f"{where}: the answer is larger than {MAX_RESPONSE_BYTES >> 20} MiB", answer.status)
        return answer

    @staticmethod
    def _error(method: str, path: str, answer: Answer, document: Any, credentials: Credentials,
               token: Optional[str]) -> ApiError:
        status = answer.status
        retry_after = retry.retry_after_seconds(answer.retry_after)
        if isinstance(document, dict):
            message = str(document.get("message") or f"HTTP {status}")
            reason = str(document.get("reason") or "")
            seconds = (document.get("details") or {}).get("retryAfterSeconds") \
                if isinstance(document.get("details"), dict) else None
            if retry_after is None and isinstance(seconds, int) and not isinstance(seconds, bool):
                retry_after = retry.retry_after_seconds(str(seconds))
        else:  # a filter's plain text (429 from max-in-flight), or a proxy's page
            message, reason = answer.body[:_EXCERPT_BYTES].decode(errors="replace"), ""
        message = _excerpt(message, token)
        reason = _excerpt(reason, token)
        if status in (401, 403):
            return ApiError(f"{method} {path}: {status} {reason or 'Forbidden'}: {message} (as "
                            f"{credentials.identity()} from the kubeconfig)", status, reason)
        return ApiError(f"{method} {path}: {status} {reason}: {message}".replace("  ", " "), status, reason,
                        retry_after=retry_after)

    def _ssl(self, credentials: Credentials) -> ssl.SSLContext:
        """The TLS context, rebuilt when a certificate file changes (the kubelet rotates its own)."""
        files = [f for f in (credentials.ca_file, credentials.cert_file, credentials.key_file) if f]
        key = tuple(_stamp(self.root, f) for f in files)
        if self._context is None or key != self._context_key:
            try:
                self._context = self._build_ssl(credentials)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise ApiError(f"cannot load the TLS files of {credentials.identity()} "
                               f"(kubeconfig {self.kubeconfig}): {exc}") from None
            self._context_key = key
        return self._context

    def _build_ssl(self, credentials: Credentials) -> ssl.SSLContext:
        local: dict[str, str] = {}  # host path: where to open it, its links followed under the root
        for path in filter(None, (credentials.ca_file, credentials.cert_file, credentials.key_file)):
            real = followed(self.root, path)
            shown = shown_path(path, real)
            if not os.path.lexists(self.root(real)):
                raise ValueError(f"{shown} not found")
            if not stat.S_ISREG(os.lstat(self.root(real)).st_mode):  # OpenSSL would wait forever on a FIFO
                raise ValueError(f"{shown} is not a regular file")
            local[path] = str(self.root(real))
        if credentials.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif credentials.ca_data:
            context = _cluster_ca_only()
            context.load_verify_locations(cadata=_pem_text(credentials.ca_data))
        elif credentials.ca_file:
            context = _cluster_ca_only()
            context.load_verify_locations(cafile=local[credentials.ca_file])
        else:
            context = ssl.create_default_context()
        if credentials.cert_file:
            key = local[credentials.key_file] if credentials.key_file else None
            context.load_cert_chain(local[credentials.cert_file], key, password=_encrypted_key)
        elif credentials.cert_data:
            # ssl reads certificates from files only: a private temporary file, removed at once.
            with tempfile.NamedTemporaryFile("wb", delete=False) as chain:
                os.chmod(chain.name, 0o600)
                chain.write(credentials.cert_data + b"\n" + (credentials.key_data or b""))
            try:
                context.load_cert_chain(chain.name, password=_encrypted_key)
            finally:
                os.unlink(chain.name)
        return context


_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def _cause(exc: BaseException) -> str:
    """Why a request got no answer, as the retry policy tells faults apart: retry.TIMEOUT, retry.CONNECTION
    (refused, reset, closed mid-answer, unreachable: the API server restarting, or the way to it), or ""
    for what is no passing fault (a certificate that does not verify, a name that does not resolve)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ""
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return retry.TIMEOUT
    if isinstance(exc, ssl.SSLError):  # the peer closed during the handshake: as a reset; else TLS itself
        return retry.CONNECTION if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError,
                                                    ssl.SSLSyscallError)) else ""
    if isinstance(exc, (ConnectionError, h11.RemoteProtocolError)) or getattr(exc, "errno", None) in _UNREACHABLE:
        return retry.CONNECTION
    return ""


def _cluster_ca_only() -> ssl.SSLContext:
    """A context trusting only the CA loaded into it next, as client-go does: a certificate from any
    public CA for the API server's name is not the cluster (and the system bundle is a MiB held in memory)."""
    return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)


def _node_path(name: str) -> str:
    """The Node's API path. The name is validated where it is read (config, hostname), and here again,
    and quoted: no name can ever reach another path ('..'), a query ('?') or a fragment ('#')."""
    problem = node_name_problem(name)
    if problem:
        raise ApiError(f"node name {shown(name)} {problem}; set kubernetes.node_name to the Node's name")
    return f"/api/v1/nodes/{quote(name, safe='')}"


def _named(collection: str, name: str) -> str:
    """An object's path in `collection`; its name must be a DNS subdomain (every name these objects can
    have), so that nothing given can reach another path."""
    problem = object_name_problem(name)
    if problem:
        raise ApiError(f"{collection}: the name {shown(name)} {problem}")
    return f"{collection}/{quote(name, safe='')}"


def _stamp(root: Root, path: str) -> tuple[int, int]:
    """What tells a changed file: inode and mtime of what the path leads to under the root."""
    try:
        st = os.lstat(root(followed(root, path)))
        return (st.st_ino, st.st_mtime_ns)
    except OSError:
        return (0, 0)


def _encrypted_key() -> bytes:
    """Asked for a key's passphrase (OpenSSL would prompt on the terminal): there is none."""
    raise ValueError("the client key is encrypted; the agent reads unencrypted keys only, as the kubelet writes them")


def _pem_text(data: bytes) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("certificate-authority-data is not PEM text") from None


_EXCERPT_BYTES = 16 * 1024  # of a body that is not JSON: the message shows MAX_MESSAGE_CHARS of it at most


def _excerpt(text: str, token: Optional[str]) -> str:
    """What a message may quote of the server's own words: the token cut out in any form, printable
    characters only, white space collapsed, at most MAX_MESSAGE_CHARS."""
    text = _without(text[:_EXCERPT_BYTES], token)
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())[:MAX_MESSAGE_CHARS]


def _without(text: str, secret: Optional[str]) -> str:
    """`text` with `secret` cut out in every form a server or proxy may echo it in (they echo the
    headers they got, and a hostile one would encode them): as it is, in any letter case,
    percent-encoded (where needed or every byte), hex, and base64 (standard or URL-safe) at any of
    its three alignments."""
    return _forms_of(secret).sub("<token>", text) if secret else text


@functools.lru_cache(maxsize=4)
def _forms_of(secret: str) -> re.Pattern[str]:
    raw = secret.encode()
    forms = {secret, quote(secret, safe=""), "".join(f"%{byte:02x}" for byte in raw), raw.hex()}
    for shift in range(3):  # the characters that encode the secret's bits alone, whatever surrounds it
        encoded = base64.b64encode(bytes(shift) + raw).decode()
        core = encoded[-(-8 * shift // 6):8 * (shift + len(raw)) // 6]
        if len(core) >= 6:  # shorter, it would match ordinary words
            forms |= {core, core.translate(str.maketrans("+/", "-_"))}
    return re.compile("|".join(re.escape(form) for form in sorted(forms, key=len, reverse=True)), re.IGNORECASE)


def _checked_node(node: dict[str, Any], where: str) -> dict[str, Any]:
    """`node` if the fields the agent reads have their API types: metadata a mapping with labels and
    annotations mappings of strings to strings, status a mapping whose conditions are a list of
    mappings whose fields are strings. Anything else is an API error naming the field."""
    problem = _node_problem(node)
    if problem:
        raise ApiError(f"{where}: the answer is not a well-formed Node: {problem}")
    return node


def _node_problem(node: dict[str, Any]) -> Optional[str]:
    metadata = node.get("metadata")
    if not isinstance(metadata, dict):
        return f"metadata is {_kind(metadata)}, not a mapping"
    for field in ("labels", "annotations"):
        values = metadata.get(field)
        if values is None:
            continue
        if not isinstance(values, dict):
            return f"metadata.{field} is {_kind(values)}, not a mapping"
        wrong = next((key for key, value in values.items() if not isinstance(value, str)), None)
        if wrong is not None:
            return f"metadata.{field}[{_excerpt(json.dumps(wrong), None)}] is {_kind(values[wrong])}, not a string"
    status = node.get("status")
    if status is None:
        return None
    if not isinstance(status, dict):
        return f"status is {_kind(status)}, not a mapping"
    conditions = status.get("conditions")
    if conditions is None:
        return None
    if not isinstance(conditions, list):
        return f"status.conditions is {_kind(conditions)}, not a list"
    for number, condition in enumerate(conditions):
        if not isinstance(condition, dict):
            return f"status.conditions[{number}] is {_kind(condition)}, not a mapping"
        wrong = next((key for key, value in condition.items() if not isinstance(value, str)), None)
        if wrong is not None:
            return f"status.conditions[{number}].{_excerpt(wrong, None)} is {_kind(condition[wrong])}, not a string"
    return None


def _kind(value: Any) -> str:
    kinds = ((type(None), "null"), (bool, "a boolean"), (str, "a string"), (int, "a number"), (float, "a number"),
             (list, "a list"), (dict, "a mapping"))
    return next(name for kind, name in kinds if isinstance(value, kind))
