"""The kubelet's kubeconfig, read under --root: server, CA, and the node's own credentials.

The file holds secrets (a bearer token, a client key), and so may a token file. Nothing read from
them is ever shown: an error names the file, the line and column or the key path, and a reason of
our own, never the text around the mistake (PyYAML's own messages quote the line) nor a value.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.parser import ParserError
from yaml.reader import ReaderError
from yaml.scanner import ScannerError

from gpu_agent.errors import AgentError
from gpu_agent.host.bounded import NotRegular, TooLarge, read_bounded
from gpu_agent.host.paths import Root, followed

MAX_KUBECONFIG_BYTES = 1 << 20  # one with embedded certificates is a few KiB
MAX_TOKEN_BYTES = 64 << 10  # a service account token is about 1 KiB

NOT_SHOWN = "(nothing of the file is shown: it holds credentials)"

_YAML_REASONS: tuple[tuple[type[yaml.YAMLError], str], ...] = (
    (ScannerError, "a value cannot be read here: look for an unclosed quote, a tab, a stray ':' or a bad '\\' escape"),
    (ParserError, "the structure is broken here: look at the indentation and at the '-' and ':' up to this point"),
    (ComposerError, "an anchor or alias ('&' or '*') is wrong here"),
    (ConstructorError, "a value no kubeconfig holds: a tag ('!') or a list or mapping used as a key"),
)


@dataclass(frozen=True)
class Credentials:
    server: str  # scheme://host[:port][/path]: load() refuses a user name, password, query or fragment
    ca_file: Optional[str] = None  # host paths
    ca_data: Optional[bytes] = None
    insecure: bool = False
    cert_file: Optional[str] = None
    key_file: Optional[str] = None
    cert_data: Optional[bytes] = None
    key_data: Optional[bytes] = field(default=None, repr=False)
    token: Optional[str] = field(default=None, repr=False)
    token_file: Optional[str] = None
    user: str = "?"

    def identity(self) -> str:
        """Which credential is used, for error messages."""
        if self.cert_file:
            return f"user {self.user!r} with client certificate {self.cert_file}"
        if self.cert_data:
            return f"user {self.user!r} with the client certificate embedded in the kubeconfig"
        if self.token_file:
            return f"user {self.user!r} with the token in {self.token_file}"
        if self.token:
            return f"user {self.user!r} with a bearer token"
        return f"user {self.user!r} without credentials"


def load(root: Root, path: str) -> Credentials:
    """The credentials of the kubeconfig's current context; AgentError naming the file and key."""
    document = _parse(_read(root, path, "kubeconfig", MAX_KUBECONFIG_BYTES), path)
    fields = _Fields(path)
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise fields.error("(top level)", f"expected a mapping, found {_kind(document)}")
    current = fields.get(document, "current-context", str, "")
    contexts = fields.entries(document, "contexts")
    if not contexts:
        raise fields.error("contexts", "no context: add one, and current-context naming it")
    where, entry = fields.named(contexts, "contexts", current) if current else ("contexts[0]", contexts[0])
    context = fields.get(entry, "context", dict, where) or {}
    where += ".context"
    cluster_name = fields.get(context, "cluster", str, where)
    if not cluster_name:
        raise fields.error(f"{where}.cluster", "missing: name the cluster of this context")
    user_name = fields.get(context, "user", str, where)

    where, entry = fields.named(fields.entries(document, "clusters"), "clusters", cluster_name)
    cluster = fields.get(entry, "cluster", dict, where) or {}
    where += ".cluster"
    server = fields.get(cluster, "server", str, where)
    if not server:
        raise fields.error(f"{where}.server", "missing: the API server's URL, https://HOST:PORT")
    user: dict[str, Any] = {}
    user_where = "users"
    if user_name:
        user_where, entry = fields.named(fields.entries(document, "users"), "users", user_name)
        user = fields.get(entry, "user", dict, user_where) or {}
        user_where += ".user"
    token = fields.get(user, "token", str, user_where)
    if token is not None:
        check_token(token, f"kubeconfig {path}: {user_where}.token")
    base = str(PurePosixPath(path).parent)
    return Credentials(
        server=fields.server(server, f"{where}.server"),
        ca_file=fields.path(cluster, "certificate-authority", where, base),
        ca_data=fields.base64(cluster, "certificate-authority-data", where),
        insecure=bool(fields.get(cluster, "insecure-skip-tls-verify", bool, where)),
        cert_file=fields.path(user, "client-certificate", user_where, base),
        key_file=fields.path(user, "client-key", user_where, base),
        cert_data=fields.base64(user, "client-certificate-data", user_where),
        key_data=fields.base64(user, "client-key-data", user_where),
        token=token or None,
        token_file=fields.path(user, "tokenFile", user_where, base),
        user=user_name or "(none)",
    )


def read_token(root: Root, credentials: Credentials) -> Optional[str]:
    """The bearer token to send: the token file's, read again each time (tokens rotate), else the
    kubeconfig's."""
    if not credentials.token_file:
        return credentials.token
    data = _read(root, credentials.token_file, "token file", MAX_TOKEN_BYTES).strip()
    if not data:
        raise AgentError(f"token file {credentials.token_file} is empty")
    return check_token(data.decode("latin-1"), f"token file {credentials.token_file}")


def check_token(token: str, where: str) -> str:
    """A token an HTTP header can carry: visible ASCII only. The error says where, never what."""
    for index, char in enumerate(token):
        if not "!" <= char <= "~":
            kind = "a non-ASCII character" if ord(char) > 127 else "a space or a control character"
            raise AgentError(f"{where}: not usable as a bearer token: character {index + 1} is {kind} "
                             "(the token is not shown)")
    return token


class _Fields:
    """Typed reads from the parsed kubeconfig. Errors name the file and the key path, never a value."""

    def __init__(self, path: str) -> None:
        self.file = path

    def error(self, where: str, reason: str) -> AgentError:
        return AgentError(f"kubeconfig {self.file}: {where}: {reason}")

    def get(self, mapping: dict[Any, Any], key: str, kind: type, where: str) -> Any:
        value = mapping.get(key)
        if value is None or isinstance(value, kind):
            return value
        expected = {str: "a string", dict: "a mapping", list: "a list", bool: "true or false"}[kind]
        raise self.error(f"{where}.{key}".lstrip("."), f"expected {expected}, found {_kind(value)}")

    def entries(self, document: dict[Any, Any], section: str) -> list[dict[Any, Any]]:
        entries = self.get(document, section, list, "") or []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                raise self.error(f"{section}[{index}]", f"expected a mapping with name and {section[:-1]}, "
                                 f"found {_kind(entry)}")
        return entries

    def named(self, entries: list[dict[Any, Any]], section: str, name: str) -> tuple[str, dict[Any, Any]]:
        for index, entry in enumerate(entries):
            if entry.get("name") == name:
                return f"{section}[{index}]", entry
        raise self.error(section, f"no entry named {name!r}")

    def path(self, mapping: dict[Any, Any], key: str, where: str, base: str) -> Optional[str]:
        """A host path; a relative one is relative to the kubeconfig's directory, as for kubectl."""
        value = self.get(mapping, key, str, where)
        if not value:
            return None
        if "\0" in value:
            raise self.error(f"{where}.{key}", "a path cannot hold a NUL character")
        return value if value.startswith("/") else f"{base}/{value}"

    def base64(self, mapping: dict[Any, Any], key: str, where: str) -> Optional[bytes]:
        value = self.get(mapping, key, str, where)
        if not value:
            return None
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise self.error(f"{where}.{key}", "not base64 (the value is not shown)") from None

    def server(self, value: str, where: str) -> str:
        """The URL without a trailing '/'. One carrying a user name or password is refused: nothing
        would send them (Kubernetes has had no basic authentication since 1.19) and a password must
        never reach a message."""
        try:
            url = urlsplit(value.strip())
            url.port  # noqa: B018 - raises ValueError for a port that is not a number
            host = url.hostname or ""
            host.encode("idna")
        except ValueError:  # UnicodeError included
            raise self.error(where, "not a URL the agent can use; expected https://HOST[:PORT] "
                             "(the value is not shown)") from None
        if url.scheme not in ("https", "http") or not url.netloc:
            raise self.error(where, "expected https://HOST[:PORT] (the value is not shown)")
        if "@" in url.netloc:
            raise self.error(where, f"{url.scheme}://...@{url.netloc.rpartition('@')[2]} carries a user name or "
                             "password, which the agent refuses: Kubernetes has no basic authentication since "
                             "1.19; remove USER:PASSWORD@ and give the node's credentials under users")
        if not host:
            raise self.error(where, "the URL has no host name")
        if url.query or url.fragment:
            raise self.error(where, "a query ('?') or fragment ('#') has no place in a server URL; remove it "
                             "(the value is not shown)")
        return urlunsplit((url.scheme, url.netloc, url.path.rstrip("/"), "", ""))


def shown_path(path: str, real: str) -> str:
    """A credential file's path for a message, and where its links lead (under the root)."""
    return path if path == real else f"{path} (a link to {real})"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number (quote it to make it a string)"
    names: dict[type, str] = {str: "a string", list: "a list", dict: "a mapping"}
    return names.get(type(value), f"a {type(value).__name__}")


def _parse(data: bytes, path: str) -> Any:
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise AgentError(f"kubeconfig {path}:{line}: not UTF-8 text {NOT_SHOWN}") from None
    try:
        return yaml.safe_load(text)
    except ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise AgentError(f"kubeconfig {path}:{line}: not valid YAML: a control character YAML does not "
                         f"allow {NOT_SHOWN}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        reason = next((reason for kind, reason in _YAML_REASONS if isinstance(exc, kind)), "a syntax error")
        raise AgentError(f"kubeconfig {where}: not valid YAML: {reason} {NOT_SHOWN}") from None
    except yaml.YAMLError:
        raise AgentError(f"kubeconfig {path}: not valid YAML {NOT_SHOWN}") from None
    except RecursionError:
        raise AgentError(f"kubeconfig {path}: not valid YAML: nested too deeply {NOT_SHOWN}") from None


def _read(root: Root, path: str, what: str, limit: int) -> bytes:
    """At most `limit` bytes of a regular file, its links followed under the root (never on the real
    host); a FIFO or device never blocks the reader."""
    real = path
    try:
        real = followed(root, path)
        data = read_bounded(root(real), limit, follow=False)
    except NotRegular:
        raise AgentError(f"{what} {shown_path(path, real)} is not a regular file") from None
    except TooLarge:
        raise AgentError(f"{what} {shown_path(path, real)} is larger than {limit >> 10} KiB; "
                         "is it the right file?") from None
    except FileNotFoundError:  # a link on the way leads nowhere
        data = None
    except OSError as exc:
        raise AgentError(f"cannot read {what} {path}: {exc.strerror}") from None
    except ValueError:  # a NUL in the path
        raise AgentError(f"cannot read {what} {path!r}: not a valid path") from None
    if data is None:
        raise AgentError(f"{what} {shown_path(path, real)} not found")
    return data
