"""gpu-agent check: preflight. Validates the config, observes every stage, reports; changes nothing."""
from __future__ import annotations

import argparse
import asyncio

from gpu_agent.cli.common import config_of, plan_json, root_of
from gpu_agent.errors import EXIT_NOT_READY, EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the findings and the typed plan as JSON")


def main(args: argparse.Namespace) -> int:
    from gpu_agent.daemon.app import Runtime

    root = root_of(args)
    loaded = config_of(args)
    runtime = Runtime.build(root, loaded, args.simulate)
    try:
        runs = asyncio.run(runtime.engine.reconcile(dry_run=True))
    finally:
        runtime.nvml.close()
    problems = sum(run.state != "ok" for run in runs)
    if args.json:
        print(plan_json(runs, loaded, root, dry_run=True))
        return EXIT_OK if not problems else EXIT_NOT_READY
    print(f"config: {loaded.source} ({loaded.digest[:19]}) ok")
    print(f"root: {root.path}")
    for run in runs:
        if run.state == "ok":
            print(f"[+] {run.stage}: {run.message}")
            continue
        print(f"[-] {run.stage}: {run.message}")
        for action in run.planned:
            print(f"    needs: {action.summary}")
    print("check passed" if not problems else f"check found {problems} problem(s); nothing was changed")
    return EXIT_OK if not problems else EXIT_NOT_READY
