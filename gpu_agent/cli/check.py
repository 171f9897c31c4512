"""gpu-agent check: preflight. Validates the config, observes every stage, reports; changes nothing."""
from __future__ import annotations

import argparse
import asyncio

from gpu_agent.cli.common import config_of, root_of
from gpu_agent.errors import EXIT_NOT_READY, EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    from gpu_agent.daemon.app import Runtime

    root = root_of(args)
    loaded = config_of(args)
    print(f"config: {loaded.source} ({loaded.digest[:19]}) ok")
    print(f"root: {root.path}")
    runtime = Runtime.build(root, loaded, args.simulate)
    try:
        runs = asyncio.run(runtime.engine.reconcile(dry_run=True))
    finally:
        runtime.nvml.close()
    problems = 0
    for run in runs:
        if run.state == "ok":
            print(f"[+] {run.stage}: {run.message}")
            continue
        problems += 1
        print(f"[-] {run.stage}: {run.message}")
        for action in run.planned:
            print(f"    needs: {action.summary}")
    print("check passed" if not problems else f"check found {problems} problem(s); nothing was changed")
    return EXIT_OK if not problems else EXIT_NOT_READY
