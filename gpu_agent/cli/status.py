"""gpu-agent status: ask the running daemon (unix socket, then TCP) and print a compact table."""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import stat
import sys
import time
from typing import Any, Optional, Union

from gpu_agent.cli import local_http
from gpu_agent.cli.common import endpoint_of, root_of
from gpu_agent.config.endpoint import DEFAULT_SOCKET
from gpu_agent.errors import EXIT_ERROR, EXIT_NOT_READY, EXIT_OK

_POLL_S = 0.5
_REQUEST_TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the daemon's /status document")
    parser.add_argument("--wait", action="store_true", help="wait until the agent is ready")
    parser.add_argument("--timeout", type=seconds, default=None, metavar="S",
                        help="with --wait: give up after S seconds (exit 2, or 1 if the daemon never answered)")


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


def fetch_status(args: argparse.Namespace, unix_only: bool = False) -> tuple[Optional[dict[str, Any]], str]:
    """The daemon's /status, or None and why it could not be read. `unix_only`: ask only the unix
    socket under --root, which belongs to the daemon of that root (a TCP port may be anyone's)."""
    def ask(address: Union[str, tuple[str, int]]) -> Optional[dict[str, Any]]:
        with _connect(address) as sock:
            _, body = local_http.get(sock, "/status", "localhost", _REQUEST_TIMEOUT_S)
        document = json.loads(body)
        return document if isinstance(document, dict) else None

    # The socket at its default path answers for the daemon of this root (one per root: its lock):
    # asked first, it spares reading the config (YAML) in the common case.
    default = str(root_of(args)(DEFAULT_SOCKET))
    if stat.S_ISSOCK(_mode(default)):
        try:
            answer = ask(default)
        except (OSError, ValueError):  # local_http.BadResponse and JSON errors are ValueErrors
            answer = None
        if answer is not None:
            return answer, default
    endpoint = endpoint_of(args)
    endpoints: list[tuple[str, Union[str, tuple[str, int]]]] = []
    if endpoint.socket:
        path = str(root_of(args)(endpoint.socket))
        endpoints.append((path, path))
    if endpoint.listen and not unix_only:
        endpoints.append((endpoint.listen, (endpoint.host, endpoint.port)))
    errors = []
    for where, address in endpoints:
        try:
            answer = ask(address)
        except (OSError, ValueError) as exc:
            errors.append(f"{where}: {exc}")
            continue
        if answer is not None:
            return answer, where
        errors.append(f"{where}: the answer is not a status document")
    return None, "; ".join(errors) or "http.listen and http.socket are both off"


def _connect(address: Union[str, tuple[str, int]]) -> socket.socket:
    """A connection to a unix socket's path, or to a (host, port)."""
    if not isinstance(address, str):
        return socket.create_connection(address, _REQUEST_TIMEOUT_S)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_REQUEST_TIMEOUT_S)
        sock.connect(address)
    except BaseException:
        sock.close()
        raise
    return sock


def _mode(path: str) -> int:
    try:
        return os.stat(path).st_mode
    except OSError:
        return 0


def main(args: argparse.Namespace) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while True:
        status, where = fetch_status(args)
        done = status is not None and (status["ready"] or not args.wait)
        if done or not args.wait or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(_POLL_S)
    if status is None:
        print(f"gpu-agent is not running or not answering ({where}); see `systemctl status gpu-agent`",
              file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print_table(status)
    return EXIT_OK if status["ready"] and not status["degraded"] else EXIT_NOT_READY


def print_table(status: dict[str, Any]) -> None:
    print(f"gpu-agent {status['version']}: {status['summary']}")
    config = status["config"]
    print(f"config: {config['source']} ({config['digest'][:19]})")
    if config["reload_error"]:
        print(f"config reload rejected: {config['reload_error']}")
    rows: list[tuple[str, ...]] = [("STAGE", "STATE", "MESSAGE")]
    rows += [(s["name"], s["state"], s["message"]) for s in status["stages"]]
    _table(rows)
    if status["gpus"]:
        print()
        rows = [("GPU", "UUID", "PCI", "PRODUCT", "MEMORY", "MIG", "HEALTH", "LAST XID", "RECOVERS")]
        for gpu in status["gpus"]:
            mig = gpu["mig"]
            mig_text = "n/a" if not mig["capable"] else (
                f"on ({len(mig['instances'])} instances)" if mig["mode"] == "enabled" else "off")
            last = gpu.get("last_xid")
            rows.append((str(gpu["index"]), gpu["uuid"], gpu["pci_bus_id"], gpu["product"],
                         f"{gpu['memory_mib']} MiB", mig_text, gpu["health"],
                         f"{last['xid']} ({last['meaning']})" if last else "-", _recovery(gpu)))
        _table(rows)
        for gpu in status["gpus"]:
            if gpu["health_reason"]:
                print(f"GPU {gpu['index']} {gpu['health']}: {gpu['health_reason']}")
            for device in gpu["mig"]["instances"]:
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
        rows.append((daemon["resource"], ",".join(map(str, daemon["gpus"])),
                     str(daemon["pid"]) if daemon["pid"] is not None else "-",
                     f"{daemon['active_thread_percentage']}%", memory, str(daemon["restarts"]),
                     "up" if daemon["up"] else "down"))
    _table(rows)
    for daemon in mps["daemons"]:
        if not daemon["up"]:
            print(f"MPS {daemon['resource']} down: {daemon['error'] or 'not started yet'}")
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
