"""gpu-agent apply --once [--dry-run]: one reconcile pass in this process, then exit."""
from __future__ import annotations

import argparse
import sys

from gpu_agent.cli.common import changes_in, one_pass, plan_json
from gpu_agent.errors import EXIT_ERROR, EXIT_NOT_READY, EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", required=True,
                        help="run every stage once and exit (the daemon is `gpu-agent run`)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print every change (file diffs included) and change nothing")
    parser.add_argument("--json", action="store_true", help="print each stage's outcome and typed changes as JSON")


def main(args: argparse.Namespace) -> int:
    runs, runtime = one_pass(args, dry_run=args.dry_run)
    loaded, root = runtime.state.config, runtime.root
    converged = all(run.state == "ok" or (args.dry_run and run.state == "pending" and not changes_in(run))
                    for run in runs) and not (args.dry_run and sum(map(changes_in, runs)))
    if args.json:
        print(plan_json(runs, loaded, root, dry_run=args.dry_run))
        return EXIT_OK if converged else EXIT_NOT_READY if runs else EXIT_ERROR
    for run in runs:
        mark = "+" if run.state == "ok" else "-"
        print(f"[{mark}] {run.stage}: {run.state}: {run.message}")
        for action in run.planned:
            verb = "would" if args.dry_run else "did"
            for change in action.changes:
                print(f"    {verb}: {change.describe()}")
            if args.dry_run and action.diff:
                sys.stdout.write("".join(f"    {line}\n" for line in action.diff.splitlines()))
    if args.dry_run:
        print(f"dry run: {sum(map(changes_in, runs))} change(s) planned, nothing changed")
    return EXIT_OK if converged else EXIT_NOT_READY if runs else EXIT_ERROR
