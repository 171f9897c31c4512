"""gpu-agent status: ask the running daemon on its unix socket (or, with --tcp, on its TCP address,
proving it is the agent) and print a compact table."""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import stat
import struct
import sys
import time
from typing import Any, Optional

from gpu_agent.cli import local_http
from gpu_agent.cli.common import endpoint_of, root_of
from gpu_agent.config.endpoint import DEFAULT_SOCKET
from gpu_agent.errors import EXIT_ERROR, EXIT_NOT_READY, EXIT_OK
from gpu_agent.printable import printable

_POLL_S = 0.5
_REQUEST_TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the daemon's /status document")
    parser.add_argument("--wait", action="store_true", help="wait until the agent is ready")
    parser.add_argument("--timeout", type=seconds, default=None, metavar="S",
                        help="with --wait: give up after S seconds (exit 2, or 1 if the daemon never answered)")
    parser.add_argument("--tcp", action="store_true",
                        help="ask on http.listen instead of the unix socket, and accept only an answer that "
                             "proves it comes from the agent (its token in /run/gpu-agent: root only)")


def seconds(value: str) -> float:
    """A command line's duration: a finite number of seconds, 0 or more (nan, inf and -1 would wait forever
    or make no sense)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, such as 30 or 2.5; got {value!r}")
    return number


class NotTheAgent(ValueError):
    """What answered is not this root's gpu-agent."""


def fetch_status(args: argparse.Namespace) -> tuple[Optional[dict[str, Any]], str]:
    """The daemon's /status, or None and why it could not be read. The unix socket under --root, whose
    directory is root's and whose server must run as root (or as this user); with --tcp, http.listen,
    whose answer must carry the agent's proof (endpoint_proof.py): any local user may listen on a TCP port
    while the agent is down, and answer as it would."""
    if getattr(args, "tcp", False):
        return _over_tcp(args)
    # The socket at its default path answers for the daemon of this root (one per root: its lock):
    # asked first, it spares reading the config (YAML) in the common case.
    default = str(root_of(args)(DEFAULT_SOCKET))
    if stat.S_ISSOCK(_mode(default)):
        try:
            return _ask_unix(default), default
        except (OSError, ValueError, RecursionError):  # BadResponse, NotTheAgent and JSON errors are ValueErrors
            pass
    endpoint = endpoint_of(args)
    if not endpoint.socket:
        return None, "http.socket is off in the config; ask on http.listen with --tcp"
    path = str(root_of(args)(endpoint.socket))
    try:
        return _ask_unix(path), path
    except PermissionError as exc:
        return None, f"{path}: {exc.strerror or exc}: the socket is root's; run as root (sudo)"
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{path}: {exc}"


def _over_tcp(args: argparse.Namespace) -> tuple[Optional[dict[str, Any]], str]:
    from gpu_agent import endpoint_proof  # hashlib and hmac: only for --tcp

    endpoint = endpoint_of(args)
    if not endpoint.listen:
        return None, "http.listen is off in the config"
    where = endpoint.listen
    token_path = root_of(args)(endpoint_proof.TOKEN_PATH)
    try:
        token = endpoint_proof.read_token(token_path)
    except OSError as exc:
        return None, (f"{where}: cannot read the agent's token {token_path} ({exc.strerror or exc}), so no answer "
                      "there could be told from another process's; run as root, or ask the unix socket "
                      "(without --tcp)")
    challenge = os.urandom(16).hex()
    try:
        with socket.create_connection((endpoint.host, endpoint.port), _REQUEST_TIMEOUT_S) as sock:
            answer = local_http.request(sock, "/status", "localhost", _REQUEST_TIMEOUT_S,
                                        {endpoint_proof.CHALLENGE_HEADER: challenge})
        if not endpoint_proof.proven(token, challenge, answer.body, answer.headers.get(endpoint_proof.PROOF_HEADER)):
            raise NotTheAgent("what answers there is not the gpu-agent of this root: its answer does not carry "
                              f"the proof of the token in {token_path}")
        return _document(answer.body), where
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{where}: {exc}"


def _ask_unix(path: str) -> dict[str, Any]:
    with _unix_connection(path) as sock:
        uid = _peer_uid(sock)
        if uid not in (0, os.geteuid()):
            raise NotTheAgent(f"the process serving {path} runs as uid {uid}, neither root nor you: not gpu-agent")
        _, body = local_http.get(sock, "/status", "localhost", _REQUEST_TIMEOUT_S)
    return _document(body)


def _document(body: bytes) -> dict[str, Any]:
    document = json.loads(body)
    if not isinstance(document, dict):
        raise ValueError("the answer is not a status document")
    return document


def _unix_connection(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_REQUEST_TIMEOUT_S)
        sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return sock


def _peer_uid(sock: socket.socket) -> int:
    """The user the process at the other end of a unix socket runs as (SO_PEERCRED: pid, uid, gid)."""
    credentials = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", credentials)[1])


def _mode(path: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError:
        return 0


def main(args: argparse.Namespace) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while True:
        status, where = fetch_status(args)
        done = status is not None and (status.get("ready") is True or not args.wait)
        if done or not args.wait or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(_POLL_S)
    if status is None:
        print(f"gpu-agent is not running or not answering ({printable(where)}); see `systemctl status gpu-agent`",
              file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(status, indent=2))  # every character outside ASCII, controls too, escaped
        return _exit_status(status)
    shown = printable_document(status)
    try:
        print_table(shown)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        print(f"the status document from {printable(where)} lacks what this gpu-agent reads "
              f"({type(exc).__name__}: {printable(str(exc))}); `gpu-agent status --json` shows it whole",
              file=sys.stderr)
        return EXIT_ERROR
    return _exit_status(status)


def _exit_status(status: dict[str, Any]) -> int:
    return EXIT_OK if status.get("ready") is True and status.get("degraded") is False else EXIT_NOT_READY


def printable_document(value: Any) -> Any:
    """A JSON document with each string in it (keys too) through printable(): nothing a peer sends reaches
    the terminal as an escape sequence or a line of its own."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(str(key)): printable_document(item) for key, item in value.items()}
    if isinstance(value, list):
        return [printable_document(item) for item in value]
    return value


def print_table(status: dict[str, Any]) -> None:
    print(f"gpu-agent {status['version']}: {status['summary']}")
    config = status["config"]
    print(f"config: {config['source']} ({config['digest'][:19]})")
    if config["reload_error"]:
        print(f"config reload rejected: {config['reload_error']}")
    http = status.get("http") or {}
    if http.get("error"):
        print(f"http: {http['error']}")
    rows: list[tuple[str, ...]] = [("STAGE", "STATE", "MESSAGE")]
    rows += [(s["name"], s["state"], s["message"]) for s in status["stages"]]
    _table(rows)
    if status["gpus"]:
        print()
        rows = [("GPU", "UUID", "PCI", "PRODUCT", "MEMORY", "MIG", "MODE", "DRIVER", "HEALTH", "LAST XID",
                 "RECOVERS")]
        for gpu in status["gpus"]:
            mig = gpu["mig"]  # None: not known (NVML cannot read the GPU, and never could since the agent started)
            mig_text = "?" if mig is None else "n/a" if not mig["capable"] else (
                f"on ({len(mig['instances'])} instances)" if mig["mode"] == "enabled" else "off")
            last = gpu.get("last_xid")
            memory = gpu["memory_mib"]
            binding = gpu.get("binding") or {}  # an older agent's /status has none
            rows.append(("-" if gpu["index"] is None else str(gpu["index"]), gpu["uuid"] or "?",
                         gpu["pci_bus_id"] or "?", gpu["product"] or "?", "?" if memory is None else f"{memory} MiB",
                         mig_text, gpu.get("mode") or "?", binding.get("driver") or "none", gpu["health"],
                         f"{last['xid']} ({last['meaning']})" if last else "-",
                         "-" if gpu["health"] == "n/a" else _recovery(gpu)))
        _table(rows)
        for gpu in status["gpus"]:
            if gpu["health_reason"]:
                print(f"GPU {gpu['index']} {gpu['health']}: {gpu['health_reason']}")
            if (gpu.get("binding") or {}).get("reason"):
                print(f"GPU {gpu['pci_bus_id']} not as its mode ({gpu['mode']}) wants it: {gpu['binding']['reason']}")
            for device in gpu["mig"]["instances"] if gpu["mig"] else ():
                if device.get("health_reason"):
                    print(f"GPU {gpu['index']} MIG device {device['uuid']} {device['health']}: "
                          f"{device['health_reason']}; recovers {_recovery(device)}")
    if status.get("mps"):
        print_mps(status["mps"])
    api = status.get("kubernetes_api")
    if api and api["state"] != "ok":
        print_kube_api(api)


def print_kube_api(api: dict[str, Any]) -> None:
    """The Kubernetes API while it is not ok: since when, how many requests failed, when the next goes."""
    def at(when: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(when))

    since = f" since {at(api['since'])}" if api.get("since") else ""
    attempt = f", next attempt at {at(api['next_attempt'])}" if api.get("next_attempt") else ""
    print()
    print(f"Kubernetes API {api['state']}{since}: {api['failed_requests']} failed request(s) in a row{attempt}; "
          f"last: {api['last_error']}")


def print_mps(mps: dict[str, Any]) -> None:
    """The MPS control daemons as /status `mps` has them: one row each, then why each down one is down and
    which MPS resources are withheld."""
    print()
    rows: list[tuple[str, ...]] = [("MPS RESOURCE", "GPUS", "PID", "THREADS", "MEMORY LIMIT", "RESTARTS", "STATE")]
    for daemon in mps["daemons"]:
        limits = daemon["pinned_memory_limits"]
        same = set(limits.values())
        memory = (f"{same.pop()} per GPU" if len(same) == 1 else
                  ", ".join(f"GPU {index}: {limit}" for index, limit in limits.items()) or "none")
        threads = daemon["active_thread_percentage"]
        rows.append((daemon["resource"], ",".join(map(str, daemon["gpus"] or ())) or "-",
                     str(daemon["pid"]) if daemon["pid"] is not None else "-",
                     f"{threads}%" if threads is not None else "-", memory, str(daemon["restarts"]),
                     daemon.get("state") or ("up" if daemon["up"] else "down")))
    _table(rows)
    for daemon in mps["daemons"]:
        if not daemon["up"]:
            print(f"MPS {daemon['resource']} {daemon.get('state') or 'down'}: {daemon['error'] or 'not started yet'}")
    for resource, why in sorted(mps["withheld"].items()):
        print(f"MPS {resource} withheld: {why}")


def _recovery(gpu: dict[str, Any]) -> str:
    """When an unhealthy GPU (or MIG device) will be considered healthy again: every reason has its own."""
    if gpu["health"] == "healthy":
        return "-"
    when = []
    if gpu.get("lost"):
        when.append(f"when NVML sees it again at {gpu['pci_bus_id']}")
    elif gpu.get("recovers_at") is not None:
        when.append(time.strftime("at %Y-%m-%d %H:%M:%S %Z", time.localtime(gpu["recovers_at"])))
    if gpu.get("failing_checks"):
        when.append("when its checks pass")
    if gpu.get("query_error"):
        when.append("when NVML answers for it again")
    return " and ".join(when) or "when NVML answers for it again"


def _table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
