"""gpu-agent driver reload [--dry-run] [--json] [--timeout S] [--force | --abort]: reload the NVIDIA driver now
(the sequence of stages/driver_reload.py), whatever driver.reload says, or end the reload under way. With a daemon
running on the root it is the daemon's to do (daemon/reload_request.py); otherwise this process does it, under
the agent's lock."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any, Optional

from gpu_agent.cli.common import config_of, root_of
from gpu_agent.errors import EXIT_ERROR, EXIT_OK, AgentError
from gpu_agent.host.bounded import NotRegular, read_head
from gpu_agent.numbers import decimal
from gpu_agent.printable import printable

CMDLINE_HEAD = 4096  # of /proc/PID/cmdline: enough for `python -m gpu_agent run`
_POLL_S = 0.2  # how often the daemon's answer is looked for
_LOOK_EVERY_S = 1.0  # in this process, while the GPUs are waited for: how often their users are looked at
_MARGIN_S = 600.0  # past the wait for idle GPUs: the unload, load, verification and the passes after


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="driver_command", metavar="ACTION", required=True)
    reload = actions.add_parser(
        "reload", help="reload the NVIDIA kernel modules now (cordon, wait for idle GPUs, unload, load, verify, "
                       "MIG and CDI back, uncordon)",
        description="Reload the installed NVIDIA driver now, as driver.reload: when-idle would, whatever "
                    "driver.reload says. A running agent on this root does it; otherwise this command does, "
                    "under the agent's lock. Exit 0 when the driver was reloaded or nothing needed it, 1 with "
                    "the cause otherwise (the node then stays cordoned and /status says why).")
    reload.add_argument("--dry-run", action="store_true", help="print the plan and change nothing")
    reload.add_argument("--json", action="store_true", help="print the outcome (or the plan) as JSON")
    reload.add_argument("--timeout", type=_seconds, metavar="S",
                        help="wait at most S seconds for the GPUs to be idle (default: driver.reload_wait_seconds)")
    either = reload.add_mutually_exclusive_group()
    either.add_argument("--force", action="store_true",
                        help="unload even while a process uses a GPU (never while a display holds nvidia_drm), and "
                             "reload a driver that needs nothing")
    either.add_argument("--abort", action="store_true",
                        help="end the reload under way: put back what it took away (units, modules, the console, "
                             "the device plugin), uncordon the node if the agent cordoned it, record "
                             "upgrade-abandoned with who and when")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value <= 86400:
        raise argparse.ArgumentTypeError(f"{text} is not within 0 to 86400 seconds")
    return value


def requester() -> str:
    """Who runs this command, for the record of an abort: the user (and who became them with sudo)."""
    import pwd

    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = f"uid {uid}"
    sudo = os.environ.get("SUDO_USER")
    via = f" (sudo from {sudo})" if sudo and sudo != name else ""
    return f"{name}{via}, with `gpu-agent driver reload --abort` (pid {os.getpid()})"


def main(args: argparse.Namespace) -> int:
    args.abort_by = requester() if args.abort else None
    if args.dry_run:
        return _plan(args)
    from gpu_agent.daemon.app import take_lock

    root = root_of(args)
    try:
        lock = take_lock(root)
    except AgentError as exc:
        return _ask_the_daemon(args, str(exc))
    try:
        ok, message, record = _reload_here(args)
    finally:
        lock.close()
    return _report(args, ok, message, "in-process", record)


def _plan(args: argparse.Namespace) -> int:
    import asyncio

    from gpu_agent.daemon.app import Runtime
    from gpu_agent.plan import DriverReloadStep

    runtime = Runtime.build(root_of(args), config_of(args), args.simulate)
    try:
        reload = runtime.request_reload(args.force, args.timeout, args.abort_by)
        runs = asyncio.run(runtime.engine.reconcile(force=True, dry_run=True))
        record, facts, move = reload.next_move()
    finally:
        runtime.nvml.close()
    driver = next((run for run in runs if run.stage == "driver"), None)
    steps = [change for run in runs for action in run.planned for change in action.changes
             if isinstance(change, DriverReloadStep)]
    heading = _heading(record, facts, move) if steps else _nothing(move, driver.message if driver else None)
    if args.json:
        required = (f"loaded {facts.loaded}, installed {facts.installed}" if facts.mismatch else
                    "; ".join(facts.drift) if facts.drift and driver is not None else None)
        print(json.dumps({"reload_required": required, "message": driver.message if driver else None,
                          "plan": [{"step": s.step, "action": s.action} for s in steps]}, indent=2))
        return EXIT_OK
    print(heading)
    for change in steps:
        print(f"    would: {change.describe()}")
    return EXIT_OK


def _heading(record: Any, facts: Any, move: Any) -> str:
    """What the plan is for, as the driver stage would say it."""
    from gpu_agent.stages import reload_transitions as rt

    if move.kind == rt.START:
        if move.arg == rt.OPTIONS:
            return f"reload required to apply the configured options: {'; '.join(facts.drift)}"
        if move.arg == rt.FORCED:
            return f"forced reload of {facts.loaded}, which needs none (--force)"
        return f"reload required: loaded {facts.loaded}, installed {facts.installed}"
    if move.kind == rt.ABORT:
        return f"would abort the driver {record.what()} at {record.failed_step or record.step}"
    return f"a driver {record.what()} is under way at {record.step}: it would go on"


def _nothing(move: Any, message: Optional[str]) -> str:
    from gpu_agent.stages import reload_transitions as rt

    if move.kind == rt.IDLE and move.arg == rt.IDLE_NO_ABORT:
        return "no driver reload is under way: nothing to abort"
    return f"nothing to reload: {message or 'the driver stage is off'}"


def _reload_here(args: argparse.Namespace) -> tuple[bool, str, Optional[dict[str, Any]]]:
    import asyncio

    from gpu_agent.daemon.app import Runtime
    from gpu_agent.daemon.reload_request import outcome, progress_of

    runtime = Runtime.build(root_of(args), config_of(args), args.simulate)
    try:
        reload = runtime.request_reload(args.force, args.timeout, args.abort_by)
        before = progress_of(reload)
        deadline = time.monotonic() + reload.wait_seconds + _MARGIN_S
        force = True
        while True:
            runs = asyncio.run(runtime.engine.reconcile(force=force))
            over = outcome(reload, runs, before, abort=args.abort)
            if over is not None:
                return over.ok, over.message, progress_of(reload)
            if time.monotonic() > deadline:
                limit = reload.wait_seconds + _MARGIN_S
                return False, f"the reload did not end within {limit:g} s", progress_of(reload)
            force = _until_next_pass(runtime, reload, deadline)
    finally:
        runtime.nvml.close()


def _until_next_pass(runtime: Any, reload: Any, deadline: float) -> bool:
    """Wait for the next pass: the engine's next retry (a pass of the stages due, not forced), or, while the
    reload waits for idle GPUs, the moment they are idle (forced: the driver stage's backoff would hold the
    news back). True for a forced pass."""
    from gpu_agent.stages.reload_transitions import WAIT_FOR_JOBS

    while time.monotonic() < deadline:
        retry = runtime.engine.next_retry()
        if retry is not None and time.time() >= retry:
            return False
        if _idle_now(reload, WAIT_FOR_JOBS):
            return True
        time.sleep(_LOOK_EVERY_S if retry is None else max(0.0, min(_LOOK_EVERY_S, retry - time.time())))
    return True


def _idle_now(reload: Any, waiting: str) -> bool:
    """The reload waits for the GPUs and nothing uses them now (a kubelet that does not answer: not known)."""
    try:
        record = reload.progress()
        return record is not None and record.step == waiting and not reload.consumers()
    except AgentError:
        return False


def _ask_the_daemon(args: argparse.Namespace, locked: str) -> int:
    from gpu_agent.daemon.app import LOCK_PATH
    from gpu_agent.daemon.reload_request import (
        REQUEST_TTL_S,
        ReloadRequest,
        read_result,
        waiting,
        withdraw_request,
        write_request,
    )

    root = root_of(args)
    pid = _daemon_pid(root(LOCK_PATH))
    if pid is None:
        print(f"gpu-agent: {locked}; it is no running daemon (`gpu-agent run`) to hand the reload to: try again "
              "once it has finished", file=sys.stderr)
        return EXIT_ERROR
    wait = args.timeout if args.timeout is not None else config_of(args).config.driver.reload_wait_seconds
    request = ReloadRequest(args.force, args.timeout, abort=args.abort_by)
    write_request(root, request)
    os.kill(pid, signal.SIGHUP)
    taken = False
    deadline = time.monotonic() + REQUEST_TTL_S
    try:
        while (result := read_result(root, request.id)) is None:
            if not taken:
                if not waiting(root, request.id) or (time.monotonic() > deadline
                                                     and not withdraw_request(root, request.id)):
                    taken, deadline = True, time.monotonic() + wait + _MARGIN_S
                elif time.monotonic() > deadline:
                    return _report(args, False, f"the agent (pid {pid}) did not take the request within "
                                                f"{REQUEST_TTL_S:g} s (its reconcile loop may be stuck: see "
                                                "`gpu-agent status` and its log); nothing was done, the request is "
                                                "withdrawn", "daemon", None)
            elif time.monotonic() > deadline:
                return _report(args, False, f"the agent (pid {pid}) gave no outcome within {wait + _MARGIN_S:g} s; "
                                            "the reload may go on: see `gpu-agent status`", "daemon", None)
            if not os.path.exists(f"/proc/{pid}"):
                if not taken and withdraw_request(root, request.id):
                    return _report(args, False, f"the agent (pid {pid}) exited before it took the request; nothing "
                                                "was done, the request is withdrawn", "daemon", None)
                return _report(args, False, f"the agent (pid {pid}) exited before the reload ended; its next start "
                                            "finds the reload where it stopped", "daemon", None)
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        if withdraw_request(root, request.id):
            print("gpu-agent driver reload: interrupted; the request is withdrawn", file=sys.stderr)
        raise
    return _report(args, result.ok, result.message, f"daemon (pid {pid})", None)


def _daemon_pid(lock: Any) -> Optional[int]:
    """The lock holder's pid when it is `gpu-agent ... run` (a SIGHUP would end another holder, apply --once)."""
    try:
        pid = decimal((read_head(lock, 32) or b"").decode("ascii", errors="replace"))
        argv = (read_head(f"/proc/{pid}/cmdline", CMDLINE_HEAD) or b"").split(b"\0") if pid else []
    except (OSError, NotRegular):
        return None
    return pid if b"run" in argv and any(b"gpu_agent" in arg or b"gpu-agent" in arg for arg in argv) else None


def _report(args: argparse.Namespace, ok: bool, message: str, via: str, record: Optional[dict[str, Any]]) -> int:
    """The outcome: its message (the agent's words, or a module's name from the node) made printable."""
    if args.json:  # JSON escapes every control character itself
        print(json.dumps({"ok": ok, "message": message, "via": via, "reload": record}, indent=2))
    elif ok:
        print(printable(message))
    else:
        print(f"gpu-agent driver reload: {printable(message)}", file=sys.stderr)
    return EXIT_OK if ok else EXIT_ERROR
