"""gpu-agent labels: the node labels the agent would set, without an API server: the running daemon's
(asked on its unix socket, so no config model or event loop is loaded here), or, when none answers,
computed in this process by a dry-run pass."""
from __future__ import annotations

import argparse
import json

from gpu_agent.cli.status import fetch_status
from gpu_agent.errors import EXIT_OK
from gpu_agent.printable import printable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of key=value lines")


def main(args: argparse.Namespace) -> int:
    status, _ = fetch_status(args)  # the unix socket
    labels = status.get("labels") if isinstance(status, dict) else None
    if not isinstance(labels, dict):
        labels = _computed_here(args)
    if args.json:
        print(json.dumps(labels, indent=2, sort_keys=True))
    else:
        print("".join(f"{printable(str(key))}={printable(str(value))}\n" for key, value in sorted(labels.items())),
              end="")
    return EXIT_OK


def _computed_here(args: argparse.Namespace) -> dict[str, str]:
    from gpu_agent.cli.common import one_pass
    from gpu_agent.kube.labels import node_labels

    runs, runtime = one_pass(args, dry_run=True)
    runtime.engine.record_dry_run(runs)
    state = runtime.state
    ready, _ = state.readiness(one_shot=True)
    return node_labels(state.config.config, state.inventory, ready, state.machine, state.workload)
