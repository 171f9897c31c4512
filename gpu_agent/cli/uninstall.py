"""gpu-agent uninstall [--dry-run] [--json]: undo everything the ledger says the agent changed.

Every file it created is removed and every file it replaced gets its original back, unless someone
changed it since (then it is left, and named); each runtime that reads one is restarted once; each MPS
control daemon it started is sent `quit` (SIGTERM if it does not exit) before its directories go; each
time-slice and compute mode set for a DRA claim is put back. It asks
no question: the package's purge script runs it. Device nodes, /dev/char links and loaded modules
stay: they are the running driver's, and the GPUs' users need them.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gpu_agent.cli.common import changes_in, one_pass, plan_json, settled
from gpu_agent.errors import EXIT_NOT_READY, EXIT_OK

if TYPE_CHECKING:
    from gpu_agent.daemon.app import Runtime
    from gpu_agent.stages.base import Stage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="print what would be undone and change nothing")
    parser.add_argument("--json", action="store_true", help="print the typed plan as JSON")


def stages(runtime: Runtime) -> list[Stage]:
    """The owned-files stage with nothing claimed."""
    from gpu_agent.stages.owned_files import OwnedFiles

    mps = (runtime.mps_control(), runtime.nvml.inventory)
    vfio = runtime.vfio_stage(runtime.state.config.config, uninstall=True)  # GPUs back on their drivers first
    return [*([vfio] if vfio is not None else []), OwnedFiles(runtime.root, runtime.services, set(), uninstall=True,
                                                              mps=mps, units=runtime.units,
                                                              timeslices=runtime.timeslices)]


def main(args: argparse.Namespace) -> int:
    runs, runtime = one_pass(args, dry_run=args.dry_run, stages=stages)
    loaded = runtime.state.config
    if args.json:
        print(plan_json(runs, loaded, runtime.root, dry_run=args.dry_run))
    else:
        for run in runs:
            for action in run.planned:
                for change in action.changes:
                    print(f"{'would' if args.dry_run else 'did'}: {change.describe()}")
            print(f"[{'+' if settled(run) else '-'}] {run.message}")
        if args.dry_run:
            print(f"dry run: {sum(map(changes_in, runs))} change(s) planned, nothing changed")
    return EXIT_OK if all(map(settled, runs)) else EXIT_NOT_READY
