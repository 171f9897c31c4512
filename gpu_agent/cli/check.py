"""gpu-agent check: preflight. Validates the config, observes every stage, reports; changes nothing."""
from __future__ import annotations

import argparse

from gpu_agent.cli.common import changes_in, one_pass, plan_json, settled
from gpu_agent.errors import EXIT_NOT_READY, EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the findings and the typed plan as JSON")


def main(args: argparse.Namespace) -> int:
    runs, runtime = one_pass(args, dry_run=True)
    loaded, root = runtime.state.config, runtime.root
    problems = sum(not settled(run) for run in runs)
    if args.json:
        print(plan_json(runs, loaded, root, dry_run=True))
        return EXIT_OK if not problems else EXIT_NOT_READY
    print(f"config: {loaded.source} ({loaded.digest[:19]}) ok")
    print(f"root: {root.path}")
    for run in runs:
        if settled(run):
            print(f"[+] {run.stage}: {run.message}")
            continue
        print(f"[-] {run.stage}: {run.message}")
        for action in run.planned:
            for change in action.changes:
                print(f"    needs: {change.describe()}")
    changes = sum(map(changes_in, runs))
    print("check passed" if not problems else f"check found {problems} problem(s), {changes} change(s) to make; "
          "nothing was changed")
    return EXIT_OK if not problems else EXIT_NOT_READY
