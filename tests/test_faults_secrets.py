"""No secret in any output: a canary planted in every credential-bearing place of a kubeconfig.

Each row plants a unique canary (a token, a token file's content, key material, a password in the
server URL, a key of the YAML), takes one error path of the kubeconfig reader or the API client,
and checks that the error really happened (its message says so) and that the canary is in none of:
the exception, the log, /status's JSON, the readiness checks and the summary line. The daemon and
the one-shot commands are then checked the same way, as processes, on what they print and serve.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import secrets
import socketserver
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional
from urllib.parse import unquote

import pytest
from conftest import free_port
from harness import run_cli
from cryptography.hazmat.primitives import serialization
from kube_emulator import KubeEmulator

from gpu_agent.config import load_config
from gpu_agent.config.kubernetes import KubernetesConfig
from gpu_agent.config.schema import ReconcileConfig
from gpu_agent.daemon.engine import Engine
from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.stages.labels import KubeSink
from gpu_agent.state import AgentState

NODE = "gpu-node-1"
KUBECONFIG = "/etc/kubernetes/kubelet.conf"
TOKEN_FILE = "/var/lib/kubelet/token"
KEY_FILE = "/etc/kubernetes/pki/client.key"
CERT_FILE = "/etc/kubernetes/pki/client.crt"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEmulator]:
    emulator = KubeEmulator(tmp_path_factory.mktemp("pki"), nodes=(NODE,), hang_seconds=3).start()
    yield emulator
    emulator.close()


class EchoServer(socketserver.ThreadingTCPServer):
    """A plain-HTTP server that answers with the request's own Authorization header, as a careless
    proxy's error page would: `answer` turns that header into the raw response."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, answer: Callable[[str], str]) -> None:
        self.answer = answer

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                authorization = ""
                while True:
                    line = self.rfile.readline(65536).decode("latin-1")
                    if line in ("\r\n", "\n", ""):
                        break
                    if line.lower().startswith("authorization:"):
                        authorization = line.split(":", 1)[1].strip()
                self.wfile.write(answer(authorization).encode("latin-1"))

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@dataclass
class Env:
    """One row's world: a sandbox root, the emulator, and the canary (plus other forms of secrets
    the row plants, such as base64 of key material) that must not show anywhere."""

    root: Path
    api: KubeEmulator
    canary: str = field(default_factory=lambda: "canary" + secrets.token_hex(16))
    secrets: list[str] = field(default_factory=list)
    servers: list[EchoServer] = field(default_factory=list)

    def host(self, path: str) -> Path:
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def write(self, path: str, data: bytes | str) -> None:
        self.host(path).write_bytes(data.encode() if isinstance(data, str) else data)

    def kubeconfig(self, user: str, server: Optional[str] = None, users: Optional[str] = None,
                   cluster: str = "") -> None:
        """A kubelet.conf whose user entry is `user` (lines indented by four), or whose users
        section is `users`; `{c}` in any of them becomes the canary."""
        ca = base64.b64encode(self.api.ca_pem).decode()
        users = users if users is not None else f"- name: node\n  user:\n{user}\n"
        text = (
            "apiVersion: v1\nkind: Config\nclusters:\n- name: kubernetes\n  cluster:\n"
            f"    server: {server or self.api.url}\n    certificate-authority-data: {ca}\n{cluster}"
            "contexts:\n- name: node@kubernetes\n  context: {cluster: kubernetes, user: node}\n"
            f"current-context: node@kubernetes\nusers:\n{users}"
        )
        self.write(KUBECONFIG, text.replace("{c}", self.canary))

    def node_pem(self, node: str = NODE) -> tuple[str, str]:
        """(certificate, key) of a node's client identity, base64 as a kubeconfig holds them; the
        key's PEM lines count as secrets."""
        credentials = self.api.node_credentials(node)
        self.secret_pem(credentials.key_pem)
        return base64.b64encode(credentials.cert_pem).decode(), base64.b64encode(credentials.key_pem).decode()

    def secret_pem(self, pem: bytes) -> None:
        self.secrets += [line for line in pem.decode().splitlines() if not line.startswith("-----")]

    def echo(self, answer: Callable[[str], str]) -> str:
        server = EchoServer(answer)
        self.servers.append(server)
        return server.url


# --- the rows --------------------------------------------------------------------------------------

def token_line(line: str) -> Callable[[Env], None]:
    """A token-mode kubeconfig whose token line is `line`."""
    return lambda env: env.kubeconfig(line)


def token_file(content: bytes, also: str = "") -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        env.write(TOKEN_FILE, content.replace(b"{c}", env.canary.encode()))
        env.kubeconfig(f"    tokenFile: {TOKEN_FILE}\n{also}")
    return setup


def registered_token(fault: Callable[[Env], None]) -> Callable[[Env], None]:
    """A valid token for the node, and a fault of the emulator that may echo it."""
    def setup(env: Env) -> None:
        env.api.add_token(env.canary, f"system:node:{NODE}", ["system:nodes"])
        fault(env)
        env.kubeconfig("    token: {c}")
    return setup


def echoed(answer: Callable[[str], str]) -> Callable[[Env], None]:
    return lambda env: env.kubeconfig("    token: {c}", server=env.echo(answer))


def echoed_as(encode: Callable[[str], str], status: int = 403) -> Callable[[Env], None]:
    """A valid token, and an API server whose error message holds the header it got, encoded."""
    return registered_token(lambda env: env.api.fail_next(
        "*", status, count=None, message=f"denied {encode(f'Authorization: Bearer {env.canary}')}"))


def b64(prefix: str = "", alphabet: Callable[[bytes], bytes] = base64.b64encode) -> Callable[[str], str]:
    return lambda text: alphabet((prefix + text).encode()).decode()


def every_byte_percent(text: str) -> str:
    return "".join(f"%{byte:02X}" for byte in text.encode())


def key_data(make: Callable[[Env], bytes]) -> Callable[[Env], None]:
    """The node's certificate with client-key-data made by `make` (which may plant the canary)."""
    def setup(env: Env) -> None:
        cert, _ = env.node_pem()
        data = base64.b64encode(make(env)).decode()
        env.secrets.append(data[:40])
        env.kubeconfig(f"    client-certificate-data: {cert}\n    client-key-data: {data}")
    return setup


def pem(label: str, body: str) -> bytes:
    return f"-----BEGIN {label}-----\n{body}\n-----END {label}-----\n".encode()


def bad_cert(env: Env) -> None:
    _, key = env.node_pem()
    cert = base64.b64encode(pem("CERTIFICATE", env.canary)).decode()
    env.kubeconfig(f"    client-certificate-data: {cert}\n    client-key-data: {key}")


def mismatched_key(env: Env) -> None:
    cert, _ = env.node_pem()
    _, other = env.node_pem("gpu-node-2")
    env.kubeconfig(f"    client-certificate-data: {cert}\n    client-key-data: {other}\n    token: {{c}}")


def key_file(content: Callable[[Env], bytes]) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        env.write(CERT_FILE, env.api.node_credentials(NODE).cert_pem)
        data = content(env)
        if data:
            env.write(KEY_FILE, data)
        env.kubeconfig(f"    client-certificate: {CERT_FILE}\n    client-key: {KEY_FILE}\n    token: {{c}}")
    return setup


def encrypted_key(env: Env) -> bytes:
    """The node's key, encrypted with the canary as its passphrase."""
    credentials = env.api.node_credentials(NODE)
    key = serialization.load_pem_private_key(credentials.key_pem, password=None)
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(env.canary.encode()))
    env.secret_pem(data)
    env.secret_pem(credentials.key_pem)
    return data


def server(url: str, user: str = "    token: {c}") -> Callable[[Env], None]:
    """`{port}` is the emulator's port, `{closed}` one nothing listens on."""
    return lambda env: env.kubeconfig(user, server=url.replace("{port}", str(env.api.port))
                                      .replace("{closed}", str(free_port())))


def not_utf8(env: Env) -> None:
    env.kubeconfig("    token: {c}")
    path = env.host(KUBECONFIG)
    path.write_bytes(path.read_bytes().replace(env.canary.encode(), env.canary.encode() + b"\xff"))


def numeric_token(env: Env) -> None:
    env.canary = str(secrets.randbelow(10 ** 17) + 10 ** 18)
    env.kubeconfig("    token: {c}")


ROWS: list[tuple[str, Callable[[Env], None], str]] = [
    # A YAML error on the token line: PyYAML's own message would quote it.
    ("yaml-colon-in-token", token_line("    token: {c}: x"), f"{KUBECONFIG}:15:50:"),
    ("yaml-unclosed-quote", token_line('    token: "{c}'), "not valid YAML"),
    ("yaml-text-after-quote", token_line("    token: '{c}' trailing"), "not valid YAML"),
    ("yaml-undefined-alias", token_line("    token: *{c}"), "anchor or alias"),
    ("yaml-tag", token_line("    token: !{c} x"), "a tag"),
    ("yaml-list-as-key", token_line("    token: {[{c}]: x}"), "used as a key"),
    ("yaml-duplicate-anchor", token_line("    token: &{c} a\n    tokenFile: &{c} b"), "anchor or alias"),
    ("yaml-bad-escape", token_line('    token: "{c}\\q"'), "escape"),
    ("yaml-tab", token_line("\ttoken: {c}"), "not valid YAML"),
    ("yaml-control-character", token_line('    token: "{c}\x01"'), "control character"),
    ("yaml-not-utf8", not_utf8, "not UTF-8"),
    ("yaml-nested-too-deep", token_line("    token: " + "[" * 3000 + "{c}" + "]" * 3000), "nested too deeply"),
    # Wrong types, the secret in the value or as a key.
    ("type-token-list", token_line("    token: [{c}]"), "users[0].user.token: expected a string, found a list"),
    ("type-token-mapping", token_line("    token: {{c}: x}"), "found a mapping"),
    ("type-token-number", numeric_token, "found a number"),
    ("type-user-string", lambda env: env.kubeconfig("", users="- name: node\n  user: {c}\n"),
     "users[0].user: expected a mapping"),
    ("type-users-strings", lambda env: env.kubeconfig("", users="- {c}\n"), "users[0]: expected a mapping"),
    ("type-key-data-list", token_line("    client-key-data: [{c}]"), "client-key-data: expected a string"),
    # Tokens an HTTP header cannot carry (a newline would inject a header).
    ("token-newline", token_line('    token: "abc\\n{c}"'), "not usable as a bearer token"),
    ("token-non-ascii", token_line('    token: "{c}\u20ac"'), "non-ASCII"),
    ("token-space", token_line('    token: "{c} more"'), "not usable as a bearer token"),
    ("token-rejected-401", token_line("    token: {c}"), "401"),
    ("basic-auth-password", token_line("    username: admin\n    password: {c}"), "without credentials"),
    # The server (or a proxy) echoes the Authorization header back.
    ("echo-403-json", registered_token(lambda env: env.api.fail_next(
        "*", 403, count=None, message=f"Authorization: Bearer {env.canary} is not allowed")), "403"),
    ("echo-500-json", registered_token(lambda env: env.api.fail_next(
        "*", 500, count=None, message=f"proxy saw {env.canary}")), "500"),
    ("echo-401-text", echoed(lambda auth: "HTTP/1.1 401 Unauthorized\r\nContent-Type: text/plain\r\n"
                             f"Connection: close\r\n\r\nbad header Authorization: {auth}\n"), "401"),
    ("echo-401-long-text", echoed(lambda auth: "HTTP/1.1 401 Unauthorized\r\nConnection: close\r\n\r\n"
                                  + "x" * 190 + auth), "401"),
    ("echo-status-line", echoed(lambda auth: f"BOGUS {auth}\r\n\r\n"), "<token>"),
    ("echo-200-list", echoed(lambda auth: f'HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n["{auth}"]'),
     "not a JSON object"),
    ("echo-200-text", echoed(lambda auth: f"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{auth}"),
     "not a JSON object"),
    # ... encoded (a hostile server), in each form; the leak check decodes them all.
    ("echo-upper-case", echoed_as(str.upper), "403"),
    ("echo-base64", echoed_as(b64()), "403"),
    ("echo-base64-shifted-1", echoed_as(b64("x")), "403"),
    ("echo-base64-shifted-2", echoed_as(b64("xy")), "403"),
    ("echo-base64url", echoed_as(b64("x", base64.urlsafe_b64encode)), "403"),
    ("echo-percent-every-byte", echoed_as(every_byte_percent), "403"),
    ("echo-percent-lower-case", echoed_as(lambda text: every_byte_percent(text).lower()), "403"),
    ("echo-hex", echoed_as(lambda text: text.encode().hex(), 500), "500"),
    ("echo-text-base64", echoed(lambda auth: "HTTP/1.1 401 Unauthorized\r\nConnection: close\r\n\r\n"
                                + base64.b64encode(auth.encode()).decode()), "401"),
    ("echo-control-characters", echoed(lambda auth: "HTTP/1.1 401 Unauthorized\r\nConnection: close\r\n\r\n"
                                       + "\x1b[2J" + auth.replace(" ", "\x00")), "401"),
    # A redirect is an error naming its status and Location, never followed with the token.
    ("redirect-307-location", echoed(lambda auth: "HTTP/1.1 307 Temporary Redirect\r\nLocation: "
                                     f"https://elsewhere.example/?{auth.replace(' ', '=')}\r\n"
                                     "Connection: close\r\n\r\n"), "307, a redirect to https://elsewhere.example/"),
    ("redirect-301-no-location", echoed(lambda auth: "HTTP/1.1 301 Moved Permanently\r\nConnection: close\r\n\r\n"),
     "301, a redirect without a Location"),
    # Token files.
    ("tokenfile-rejected-401", token_file(b"{c}\n"), "401"),
    ("tokenfile-inner-newline", token_file(b"abc\n{c}\n"), "not usable as a bearer token"),
    ("tokenfile-not-utf8", token_file(b"{c}\xff\n"), "non-ASCII"),
    ("tokenfile-too-large", token_file(b"{c}" * 4000), "larger than"),
    ("tokenfile-empty", token_file(b"\n", also="    token: {c}"), "is empty"),
    ("tokenfile-missing", lambda env: env.kubeconfig(f"    tokenFile: {TOKEN_FILE}\n    token: {{c}}"),
     "not found"),
    ("tokenfile-directory", lambda env: (env.host(TOKEN_FILE).mkdir(),
                                         env.kubeconfig(f"    tokenFile: {TOKEN_FILE}\n    token: {{c}}")),
     "not a regular file"),
    # Key material: base64, PEM, files.
    ("keydata-not-base64", token_line("    client-key-data: '{c}!!'"), "client-key-data: not base64"),
    ("keydata-bad-padding", lambda env: env.kubeconfig(
        "    client-key-data: " + base64.b64encode(pem("PRIVATE KEY", env.canary)).decode()[:-1]), "not base64"),
    ("keydata-bad-pem", key_data(lambda env: pem("PRIVATE KEY", env.canary)), "cannot load the TLS files"),
    ("keydata-not-pem", key_data(lambda env: env.canary.encode()), "cannot load the TLS files"),
    ("keydata-other-nodes-key", mismatched_key, "cannot load the TLS files"),
    ("certdata-bad-pem", bad_cert, "cannot load the TLS files"),
    ("keyfile-bad-pem", key_file(lambda env: pem("PRIVATE KEY", env.canary)), "cannot load the TLS files"),
    ("keyfile-encrypted", key_file(encrypted_key), "encrypted"),
    ("keyfile-missing", key_file(lambda env: b""), f"{KEY_FILE} not found"),
    ("cadata-not-text", lambda env: env.kubeconfig("    token: {c}", cluster="    certificate-authority-data: "
                                                   + base64.b64encode(b"\xff" + env.canary.encode()).decode()
                                                   + "\n"), "not PEM text"),
    # The server URL.
    ("url-password", server("https://node:{c}@127.0.0.1:{port}"), "carries a user name or password"),
    ("url-password-unreachable", server("https://node:{c}@127.0.0.1:{closed}"), "carries a user name or password"),
    ("url-user", server("https://{c}@127.0.0.1:{port}"), "carries a user name or password"),
    ("url-bad-port", server("https://node:{c}@127.0.0.1:x{c}"), "not a URL"),
    ("url-no-scheme", server("node:{c}@127.0.0.1:{port}"), "expected https://"),
    ("url-query", server("https://127.0.0.1:{port}/?token={c}"), "query"),
    ("url-host-too-long", server("https://{c}{c}{c}.example:{port}"), "not a URL"),
    ("server-unreachable", server("https://127.0.0.1:{closed}"), "refused"),
    ("server-hangs", registered_token(lambda env: env.api.hang_next("*", count=None)), "timed out"),
]


def run_sink(env: Env, caplog: pytest.LogCaptureFixture) -> tuple[Optional[AgentError], AgentState]:
    """The sink's own calls (observe, then verify, which raises the API error: observe computes the
    labels whatever the API server does), then a whole engine pass (what it records)."""
    state = AgentState(load_config(env.root / "missing.yaml", required=False))
    settings = KubernetesConfig(node_name=NODE, kubeconfig=KUBECONFIG, request_timeout_seconds=1)
    sink = KubeSink(Root(env.root), state.readiness_of, lambda: state.config.config, settings, RequestBudget())
    error = None
    with caplog.at_level(logging.DEBUG):
        try:
            sink.verify(sink.observe())
        except AgentError as exc:
            error = exc
        asyncio.run(Engine([sink], state, ReconcileConfig()).reconcile(force=True))
    return error, state


def leaks(env: Env, text: str) -> list[str]:
    """The planted secrets found in `text`: the canary or either half of it, or another form, as it
    is or in any letter case, percent-encoded, hex or base64 (decoded here, at every alignment)."""
    half = len(env.canary) // 2
    readings = [text.lower(), unquote(text).lower()]
    for run in re.findall(r"[0-9a-fA-F]{16,}", text):
        readings += [bytes.fromhex(run[offset:offset + (len(run) - offset) // 2 * 2]).decode("latin-1").lower()
                     for offset in (0, 1)]
    for run in re.findall(r"[A-Za-z0-9+/_=-]{16,}", text):
        for offset in range(4):
            part = run[offset:].rstrip("=")
            part = part[:len(part) // 4 * 4]
            readings += [base64.b64decode(part.translate(str.maketrans("-_", "+/")) + "==").decode("latin-1").lower()]
    wanted = (env.canary[:half], env.canary[half:], *env.secrets)
    return [s for s in wanted if s and any(s.lower() in reading for reading in readings)]


@pytest.mark.parametrize("name,setup,expected", ROWS, ids=[row[0] for row in ROWS])
def test_no_canary_in_any_output(name: str, setup: Callable[[Env], None], expected: str, api: KubeEmulator,
                                 root: Path, caplog: pytest.LogCaptureFixture) -> None:
    env = Env(root, api)
    api.clear_faults()
    try:
        setup(env)
        error, state = run_sink(env, caplog)
    finally:
        api.clear_faults()
        for echo in env.servers:
            echo.shutdown()
            echo.server_close()
    assert error is not None, f"{name}: the sink did not fail"
    status = state.stages["labels"]
    assert status.state == "failed" and expected in status.message, status.message
    formatter = logging.Formatter("%(message)s")
    outputs = {
        "exception": f"{error}\n{error!r}\n" + "".join(traceback.format_exception(type(error), error,
                                                                                error.__traceback__)),
        "log": "\n".join(formatter.format(record) for record in caplog.records),
        "/status": json.dumps(state.to_json()),
        "readiness checks": "\n".join(f"{check.name}: {check.reason}" for check in state.checks()),
        "summary": state.summary_line(),
    }
    for where, text in outputs.items():
        assert not leaks(env, text), f"{name}: a secret shows in the {where}:\n{text[:2000]}"


# --- the processes ---------------------------------------------------------------------------------

@pytest.mark.subprocess
def test_no_canary_from_the_daemon_or_the_commands(agent, api: KubeEmulator, root: Path, write_config) -> None:
    """The daemon serves and logs, `check`, `labels`, `status` and `apply --once` print, while the
    kubeconfig goes through a token-line YAML error, a password in the URL and an echoing server."""
    env = Env(root, api)
    settings = {"kubernetes": {"node_name": NODE}, "reconcile": {"backoff_initial_seconds": 0.2}}
    variants = [
        (token_line("    token: {c}: x"), "not valid YAML"),
        (server("https://node:{c}@127.0.0.1:{port}"), "carries a user name or password"),
        (registered_token(lambda env: env.api.fail_next(
            "*", 403, count=None, message=f"Authorization: Bearer {env.canary}")), "403"),
    ]
    seen: list[tuple[str, str]] = []
    variants[0][0](env)
    daemon = agent("t4", settings=settings)
    try:
        daemon.wait_ready()
        for setup, expected in variants:
            setup(env)
            def failing(_: int, body: str, expected: str = expected) -> bool:
                return "[-]labels failed" in body and expected in body

            _, body = daemon.wait_http("/readyz?verbose", failing, timeout=15)
            seen.append(("/readyz?verbose", body))
            for path in ("/status", "/metrics", "/"):
                seen.append((path, daemon.get(path)[1]))
            for command in (("status",), ("status", "--json"), ("--simulate", "t4", "check"),
                            ("--simulate", "t4", "check", "--json"), ("--simulate", "t4", "labels")):
                result = run_cli(*command, root=root, config=daemon.config)  # in-process: its output is the same
                seen.append((" ".join(command), result.stdout + result.stderr))
    finally:
        api.clear_faults()
        daemon.stop()
    log = daemon.output()
    assert "labels failed: kubeconfig" in log  # the log was really looked at
    seen.append(("the daemon's log", log))
    for setup, expected in variants:
        setup(env)
        for json_flag in ((), ("--json",)):
            result = run_cli("--simulate", "t4", "apply", "--once", *json_flag, root=root, config=daemon.config)
            assert result.returncode == 2 and expected in result.stdout, result.stdout + result.stderr
            seen.append(("apply --once", result.stdout + result.stderr))
        api.clear_faults()
    for where, text in seen:
        assert not leaks(env, text), f"a secret shows in {where}:\n{text[:2000]}"


def test_the_leak_this_guards_against_is_real(root: Path, api: KubeEmulator) -> None:
    """PyYAML's own message quotes the token line: the reason the reader never shows it, and the
    reason leaks() looks for half a canary."""
    import yaml

    env = Env(root, api)
    token_line("    token: {c}: x")(env)
    with pytest.raises(yaml.YAMLError) as raised:
        yaml.safe_load(env.host(KUBECONFIG).read_text())
    assert leaks(env, str(raised.value))  # PyYAML cuts the line, so half a canary counts as a leak
