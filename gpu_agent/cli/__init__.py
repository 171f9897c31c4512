"""The gpu-agent command line. One module per subcommand; each imports its heavy parts (pydantic,
pynvml, the daemon) inside its main(), so `gpu-agent status` starts fast."""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

from gpu_agent import __version__
from gpu_agent.errors import EXIT_ERROR, AgentError

_SUBCOMMANDS = {
    "run": "run the daemon (what systemd starts)",
    "apply": "reconcile every stage once and exit",
    "status": "show the running daemon's status",
    "check": "preflight: report what is wrong or would change; changes nothing",
    "labels": "print the Kubernetes node labels the agent would set",
    "mig": "apply, assert or export MIG geometry (mig-parted's config files)",
    "driver": "reload the NVIDIA driver now (driver reload)",
    "uninstall": "undo every change gpu-agent made (the package's purge runs it)",
    "sim": "inspect and rehearse failures on a simulated node",
    "capture": "write what the agent reads from this node to a directory that --simulate replays",
}


class _Formatter(argparse.HelpFormatter):
    """argparse's, sized as shutil.get_terminal_size() would without importing shutil: argparse makes a
    formatter for every add_argument, and shutil (with its compression modules) cost `status` 5 ms."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: Optional[int] = None) -> None:
        super().__init__(prog, indent_increment, max_help_position, width or _columns() - 2)


def _columns() -> int:
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns if sys.__stdout__ else 0
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Parser(argparse.ArgumentParser):
    """Usage errors exit 1 (error): exit 2 means degraded or not ready everywhere in gpu-agent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser, its defaults from the environment as it is now. Built once per environment: each
    build asks gettext for every help text (10 ms), and the tests call main() thousands of times."""
    return _parser_for(*(os.environ.get(name) for name in _ENVIRONMENT))


_ENVIRONMENT = ("GPU_AGENT_CONFIG", "GPU_AGENT_ROOT", "GPU_AGENT_SIMULATE")


@functools.lru_cache(maxsize=4)
def _parser_for(*environment: Optional[str]) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gpu-agent",
        description="Make this machine's NVIDIA GPUs ready for Kubernetes and containers, and keep them that way.",
        epilog="Exit codes: 0 ok, 1 error, 2 degraded or not ready.",
    )
    parser.add_argument("--version", action="version", version=f"gpu-agent {__version__}")
    _global_options(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in _SUBCOMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        _global_options(sub, defaults=False)
        importlib.import_module(f"gpu_agent.cli.{name}").add_arguments(sub)
    return parser


def _global_options(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--config, --root and --simulate, accepted before the subcommand and after it
    (`gpu-agent run --simulate dgx-h100 --root DIR`). After it they win; the subcommand's parser
    leaves them unset when not given, so they do not mask the ones given before it."""
    def default(value: Optional[str]) -> Optional[str]:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--config", default=default(os.environ.get("GPU_AGENT_CONFIG")), metavar="PATH",
                        help="config file (env GPU_AGENT_CONFIG; default /etc/gpu-agent/config.yaml under --root, "
                             "built-in defaults when that file is missing)")
    parser.add_argument("--root", default=default(os.environ.get("GPU_AGENT_ROOT", "/")), metavar="DIR", type=_root,
                        help="resolve every host path under DIR (env GPU_AGENT_ROOT; default /)")
    parser.add_argument("--simulate", default=default(os.environ.get("GPU_AGENT_SIMULATE") or None),
                        metavar="PROFILE|FILE|DIR",
                        help="simulated hardware: dgx-a100, dgx-h100, dgx-h200, a30, t4, none, a machine YAML file, "
                             "or a directory written by `gpu-agent capture` (env GPU_AGENT_SIMULATE)")


def _root(value: str) -> str:
    """--root (or GPU_AGENT_ROOT): never empty, which every path join would read as the current directory."""
    if not value:
        raise argparse.ArgumentTypeError("must name a directory (/ for this machine); an empty one would put "
                                         "every host path under the current directory: write --root . for that")
    return value


def setup_logging(level: str = "INFO") -> None:
    import logging  # here: `gpu-agent status` logs nothing, and logging costs it 9 ms of imports

    class JournalFormatter(logging.Formatter):
        _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

        def format(self, record: logging.LogRecord) -> str:
            return f"<{self._PRIORITY.get(record.levelno, 6)}>{super().format(record)}"

    from gpu_agent.printable import printable

    def one_line(record: logging.LogRecord) -> bool:
        """Each record one line: what the driver, NVML or a file says cannot forge another line of the log
        or reach the terminal as an escape sequence (a traceback, formatted apart, keeps its lines)."""
        message = record.getMessage()
        escaped = printable(message)
        if escaped is not message:
            record.msg, record.args = escaped, ()
        return True

    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(one_line)
    if os.environ.get("JOURNAL_STREAM"):
        # journald reads the <N> prefix as the syslog priority and adds its own timestamps.
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


_SILENT = {"status"}  # commands that only print: no log handler to set up
# One-shot commands that read the machine: under a sandbox root without --simulate, the simulated machine
# living there (as `sim` finds it), not the host next to it.
_FIND_SIMULATED = {"apply", "check", "labels", "mig", "uninstall"}


def _simulated_machine(root: str) -> Optional[str]:
    from gpu_agent.host.paths import Root
    from gpu_agent.sim.machine import found_in

    found = found_in(Root(root))
    if found is not None:
        print(f"gpu-agent: using the simulated machine found in {root} ({found}), as no --simulate was given; "
              "--simulate PROFILE picks another", file=sys.stderr)
    return found


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in _SILENT:
        setup_logging()
    module = importlib.import_module(f"gpu_agent.cli.{args.command}")
    if args.command in _FIND_SIMULATED and not args.simulate:
        args.simulate = _simulated_machine(args.root)
    try:
        return int(module.main(args))
    except AgentError as exc:
        print(f"gpu-agent: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_ERROR
