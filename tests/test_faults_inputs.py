"""Outside input of the wrong shape or size is a clear error naming where it came from, never an
internal error: a Node of the wrong types from the API (not cached either), a redirect from the API,
integers too long to convert in an API answer or a runtime config."""
from __future__ import annotations

import json
import socketserver
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from gpu_agent.config import load_config
from gpu_agent.config.kubernetes import KubernetesConfig
from gpu_agent.errors import StageError
from gpu_agent.host import jsontext
from gpu_agent.host.paths import Root
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.client import ApiError, KubeClient
from gpu_agent.stages.labels import KubeSink
from gpu_agent.state import AgentState
from gpu_agent.toolkit import docker

NODE = "gpu-node-1"
KUBECONFIG = "/etc/kubernetes/kubelet.conf"
GOOD = {"metadata": {"name": NODE, "labels": {"a": "b"}, "annotations": {}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
LONG = "9" * 5000


class ApiStandIn(socketserver.ThreadingTCPServer):
    """A plain-HTTP API server answering every request with `self.answer` (raw HTTP) and counting them."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.answer = b""
        self.requests = 0
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while self.rfile.readline(65536) not in (b"\r\n", b"\n", b""):
                    pass
                outer.requests += 1
                self.wfile.write(outer.answer)

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def body(self, text: str) -> None:
        data = text.encode()
        self.answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(data) + data)


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[tuple[ApiStandIn, KubeClient]]:
    server = ApiStandIn()
    config = tmp_path / KUBECONFIG.lstrip("/")
    config.parent.mkdir(parents=True)
    config.write_text(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: k\n  cluster:\n"
        f"    server: http://127.0.0.1:{server.server_address[1]}\n"
        "contexts:\n- name: c\n  context: {cluster: k, user: u}\ncurrent-context: c\n"
        "users:\n- name: u\n  user:\n    token: t0ken-for-the-stand-in\n")
    yield server, KubeClient(Root(tmp_path), KUBECONFIG, 5, RequestBudget(per_minute=1000))
    server.shutdown()
    server.server_close()


def node_with(change: Callable[[dict[str, Any]], None]) -> str:
    node = json.loads(json.dumps(GOOD))
    change(node)
    return json.dumps(node)


def put(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(node: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for part in parents:
            node = node[part] if not isinstance(node, list) else node[int(part)]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return change


# --- a Node of the wrong shape: an API error naming the field -----------------------------------

SHAPES = [
    ("metadata-string", put("metadata", "x"), "metadata is a string"),
    ("metadata-missing", lambda node: node.pop("metadata"), "metadata is null"),
    ("annotations-string", put("metadata.annotations", "x"), "metadata.annotations is a string"),
    ("labels-list", put("metadata.labels", ["a"]), "metadata.labels is a list"),
    ("label-value-number", put("metadata.labels", {"a": 1}), 'metadata.labels["a"] is a number'),
    ("annotation-value-mapping", put("metadata.annotations", {"k": {}}), 'metadata.annotations["k"] is a mapping'),
    ("status-list", put("status", []), "status is a list"),
    ("conditions-mapping", put("status.conditions", {}), "status.conditions is a mapping"),
    ("condition-string", put("status.conditions.0", "Ready"), "status.conditions[0] is a string"),
    ("condition-type-number", put("status.conditions.0.type", 3), "status.conditions[0].type is a number"),
    ("condition-time-null", put("status.conditions.0.lastTransitionTime", None),
     "status.conditions[0].lastTransitionTime is null"),
]


@pytest.mark.parametrize("change,says", [row[1:] for row in SHAPES], ids=[row[0] for row in SHAPES])
def test_a_node_of_the_wrong_shape_is_an_api_error_naming_the_field(
        api: tuple[ApiStandIn, KubeClient], change: Callable[[dict[str, Any]], None], says: str) -> None:
    server, client = api
    server.body(node_with(change))
    with pytest.raises(ApiError, match="the answer is not a well-formed Node") as raised:
        client.get_node(NODE)
    assert says in str(raised.value)
    with pytest.raises(ApiError, match="not a well-formed Node"):
        client.patch_node(NODE, {"metadata": {"labels": {"x": "y"}}})
    server.body(json.dumps(GOOD))
    assert client.get_node(NODE) == GOOD


def test_a_malformed_node_is_not_kept_after_the_api_recovers(
        api: tuple[ApiStandIn, KubeClient], tmp_path: Path) -> None:
    server, _ = api
    state = AgentState(load_config(tmp_path / "missing.yaml", required=False))
    settings = KubernetesConfig(node_name=NODE, kubeconfig=KUBECONFIG, request_timeout_seconds=2)
    sink = KubeSink(Root(tmp_path), state.readiness_of, lambda: state.config.config, settings, RequestBudget())
    server.body(node_with(put("metadata.annotations", "x")))
    with pytest.raises(StageError, match="metadata.annotations is a string"):
        sink.verify(sink.observe())
    server.body(json.dumps(GOOD))
    sink.start_pass()  # the next pass: the API has recovered
    observed = sink.observe()
    assert observed.api_error is None and observed.node == GOOD


# --- a redirect is an error, never followed --------------------------------------------------------

@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_an_error_naming_status_and_location(api: tuple[ApiStandIn, KubeClient], status: int) -> None:
    server, client = api
    server.answer = (f"HTTP/1.1 {status} Elsewhere\r\nLocation: https://other.example/api/v1/nodes/x\r\n"
                     "Content-Length: 2\r\nConnection: close\r\n\r\n{}").encode()
    with pytest.raises(ApiError) as raised:
        client.get_node(NODE)
    message = str(raised.value)
    assert f"HTTP {status}, a redirect to https://other.example/api/v1/nodes/x" in message, message
    assert "does not follow" in message and raised.value.status == status and server.requests == 1


# --- integers too long to convert ---------------------------------------------------------------------

def test_an_api_answer_with_an_over_long_integer_is_an_api_error(api: tuple[ApiStandIn, KubeClient]) -> None:
    server, client = api
    server.body('{"metadata": {"name": "n", "generation": ' + LONG + "}}")
    with pytest.raises(ApiError, match="an integer of 5000 digits at 1:42"):
        client.get_node(NODE)


DAEMON_JSON_NUMBERS = [
    ("top-level", '{"x": ' + LONG + "}", "1:7"),
    ("negative", '{"x": -' + LONG + "}", "1:7"),
    ("in-an-array", '{"runtimes": {"a": {"path": "/x", "args": [\n ' + LONG + "]}}}", "2:2"),
    ("after-a-string-of-digits", '{"s": "' + LONG + '",\n "x": ' + LONG + "}", "2:7"),
]


@pytest.mark.parametrize("text,where", [row[1:] for row in DAEMON_JSON_NUMBERS],
                         ids=[row[0] for row in DAEMON_JSON_NUMBERS])
def test_an_over_long_integer_in_daemon_json_is_refused_by_line_and_column(text: str, where: str) -> None:
    with pytest.raises(StageError) as raised:
        docker.parse(text)
    assert f"/etc/docker/daemon.json:{where}: an integer of 5000 digits" in str(raised.value)


def test_digits_in_strings_and_integers_up_to_the_bound_are_read() -> None:
    longest = "9" * jsontext.MAX_DIGITS
    assert jsontext.loads(f'{{"s": "{LONG}", "n": -{longest}}}') == {"s": LONG, "n": -int(longest)}
    with pytest.raises(jsontext.NumberTooLong, match="an integer of 101 digits"):
        jsontext.loads(f"[1, {longest}9]")


# --- digits: a number of 5,000 digits, or digits of another script, wherever the agent reads one ----------

LONG_DIGITS = ("9" * 5000, "\u00b2", "\u0663\u0660")  # Python's int() raised ValueError for each


@pytest.mark.parametrize("digits", LONG_DIGITS[1:] + ("9" * 200,))  # a file name has at most 255 bytes
def test_a_proc_entry_named_by_odd_digits_is_no_process(tmp_path: Path, digits: str) -> None:
    from gpu_agent.host.processes import device_users

    (tmp_path / "proc" / digits / "fd").mkdir(parents=True)
    assert device_users(Root(tmp_path)) == []


@pytest.mark.parametrize("digits", LONG_DIGITS)
def test_a_module_line_with_an_odd_refcount_is_a_format_error(digits: str) -> None:
    from gpu_agent.errors import HostFormatError
    from gpu_agent.host.procfs import parse_char_majors, parse_key_values, parse_modules

    with pytest.raises(HostFormatError, match=r"^/proc/modules:1: cannot read"):
        parse_modules("/proc/modules", f"nvidia 56807424 {digits} - Live 0x0\n")
    with pytest.raises(HostFormatError, match=r"^/proc/devices:2: cannot read"):
        parse_char_majors("/proc/devices", f"Character devices:\n{digits} nvidia\n")
    with pytest.raises(HostFormatError, match=r"DeviceFileMinor to be a decimal number"):
        parse_key_values("/proc/x", f"DeviceFileMinor: {digits}\n").integer("DeviceFileMinor", 0)


def test_odd_digits_in_the_environment_config_and_answers_are_refused_by_name(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from gpu_agent.cli.local_http import BadResponse, _head
    from gpu_agent.config.plugin import _device_ref
    from gpu_agent.daemon.notify import Notifier
    from gpu_agent.sim.replay import handle_of

    for digits in LONG_DIGITS:
        monkeypatch.setenv("WATCHDOG_USEC", digits)
        notifier = Notifier.__new__(Notifier)
        notifier.enabled = True
        assert notifier.watchdog_interval() is None
        with pytest.raises(BadResponse, match="Content-Length is not a number"):
            _head(b"HTTP/1.1 200 OK\r\nContent-Length: " + digits.encode() + b"\r\n")
        with pytest.raises(ValueError, match="unsupported device"):
            _device_ref(digits)
        with pytest.raises(ValueError, match="unknown handle reference"):
            handle_of(f"gpu{digits}")
    with pytest.raises(ValueError, match="unsupported device"):
        _device_ref("9" * 5000 + ":0")  # as a MIG index
