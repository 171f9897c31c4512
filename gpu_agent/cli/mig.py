"""gpu-agent mig apply|assert|export: mig-parted's verbs over mig-parted's files, so runbooks translate.

  mig apply [-f FILE] -c NAME [--dry-run] [--json] make the GPUs' MIG geometry what NAME says
  mig assert [-f FILE] -c NAME                      exit 0 when it already is, 1 otherwise
FILE defaults to the agent config's mig.config_file under --root (the daemon's file).
  mig export [-c NAME]                              the current geometry as a mig-parted config
  mig generate-config [-o yaml|json]                the configs mig-parted generates from the GPUs' profiles

apply holds the agent's lock (a running daemon makes it wait its turn); --dry-run, assert, export and
generate-config only read, so they are safe on any node.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gpu_agent.cli.common import config_of, root_of
from gpu_agent.errors import EXIT_ERROR, EXIT_NOT_READY, EXIT_OK, AgentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    verbs = parser.add_subparsers(dest="mig_command", metavar="VERB", required=True)
    apply = verbs.add_parser("apply", help="apply a MIG config to the GPUs it selects",
                             description="Per GPU: unchanged, created, destroyed, mode-changed, failed, restored "
                                         "or skipped (a GPU that cannot do MIG, selected by devices: all); a "
                                         "failure puts that GPU's previous geometry back; a dry run says "
                                         "would-create, would-destroy or would-change-mode. Exit 0 applied, 1 failed, "
                                         "2 pending a GPU reset (the agent's or a reboot's).")
    _file_and_config(apply)
    apply.add_argument("--dry-run", action="store_true", help="print the plan; make no NVML change")
    apply.add_argument("--json", action="store_true", help="per GPU: action, NVML mutation count, reason, changes")
    apply.add_argument("--force", action="store_true", help="change GPUs that run compute processes (mig.force)")
    check = verbs.add_parser("assert", help="exit 0 when the MIG config is applied, 1 otherwise")
    _file_and_config(check)
    export = verbs.add_parser("export", help="print the current MIG geometry as a mig-parted config")
    export.add_argument("-c", "--config-name", default="current", metavar="NAME",
                        help="the config's name in the output (default current)")
    generate = verbs.add_parser(
        "generate-config", help="print all-disabled, all-enabled, all-<profile> and all-balanced for these GPUs",
        description="The configs nvidia-mig-parted generate-config (v0.15) prints for the same GPUs, from the "
                    "MIG profiles NVML reports: the same names, entries, device filters (on a node with more "
                    "than one kind of GPU) and order. Read-only.")
    generate.add_argument("-o", "--output-format", choices=("yaml", "json"), default="yaml",
                          help="yaml (default) or json, as mig-parted writes them")


def _file_and_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--config-file", metavar="FILE",
                        help="a mig-parted version v1 file, as given (default: the agent config's mig.config_file, "
                             "/etc/gpu-agent/mig.yaml, under --root, as the daemon reads it)")
    parser.add_argument("-c", "--selected-config", metavar="NAME",
                        help="the mig-configs entry to use (may be left out when the file has only one)")


def main(args: argparse.Namespace) -> int:
    from gpu_agent.daemon.app import Runtime, take_lock

    root = root_of(args)
    loaded = config_of(args)
    writes = args.mig_command == "apply" and not args.dry_run
    lock = take_lock(root) if writes else None
    try:
        runtime = Runtime.build(root, loaded, args.simulate)
        try:
            if args.mig_command == "export":
                return _export(runtime, args)
            if args.mig_command == "generate-config":
                return _generate(runtime, args)
            if writes and not (runtime.root.is_running_system or runtime.machine is not None):
                raise AgentError(f"mig apply changes real GPUs: refusing while --root is {root.path}; "
                                 "use --dry-run, or --simulate")
            return _apply_or_assert(runtime, args, loaded.config.mig, writes)
        finally:
            runtime.nvml.close()
    finally:
        if lock is not None:
            lock.close()


def _export(runtime: Any, args: argparse.Namespace) -> int:
    from gpu_agent.mig.export import export

    inventory = runtime.nvml.inventory.read()
    _warn_unreadable(inventory, "left out of the export")
    sys.stdout.write(export(inventory.readable, args.config_name))
    return EXIT_OK


def _generate(runtime: Any, args: argparse.Namespace) -> int:
    from gpu_agent.mig.generate import GenerateError, discover, generate, render

    inventory = runtime.nvml.inventory.read()
    for gpu in inventory.unidentified:  # mig-parted stops at a GPU NVML cannot read, as the agent does
        raise GenerateError(f"GPU {gpu.index}: cannot read its MIG profiles: {gpu.reason}")
    configs, notes = generate(discover(inventory.gpus))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    sys.stdout.write(render(configs, args.output_format))
    return EXIT_OK


def _warn_unreadable(inventory: Any, what: str) -> list[str]:
    """One stderr line per GPU NVML cannot read (it has no geometry to read or change); those notes."""
    notes = inventory.unreadable_notes()
    for note in notes:
        print(f"warning: {note}: {what}", file=sys.stderr)
    return notes


def _apply_or_assert(runtime: Any, args: argparse.Namespace, settings: Any, writes: bool) -> int:
    from gpu_agent.mig.apply import FAILED, PENDING, REBOOTING, Applier, node_state
    from gpu_agent.mig.checkpoint import CheckpointStore
    from gpu_agent.mig.config import load_mig_config
    from gpu_agent.mig.hooks import Hooks
    from gpu_agent.mig.planner import gpu_name, not_applied, plans_for

    file = load_mig_config(Path(args.config_file)) if args.config_file else \
        load_mig_config(runtime.root(settings.config_file), "mig.config_file")
    name = args.selected_config
    if name is None:
        if len(file.configs) != 1:
            raise AgentError(f"{file.source} has {len(file.configs)} configs: name one with -c")
        name = next(iter(file.configs))
    entries = file.select(name)
    inventory = runtime.nvml.inventory.read()
    plans = plans_for(inventory.readable, entries)
    if args.mig_command == "assert":
        reasons = not_applied(plans) + [f"{note}: its geometry cannot be checked" for note in
                                        inventory.unreadable_notes()]
        if reasons:
            print(f"MIG config {name} is not applied:")
            for reason in reasons:
                print(f"  {reason}")
            return EXIT_ERROR
        print(f"MIG config {name} is applied")
        return EXIT_OK
    applier = Applier(runtime.nvml, runtime.gpu_reset, CheckpointStore(runtime.root), runtime.root,
                      force=args.force or settings.force)
    hooks = Hooks(settings.stop_units, runtime.units) if settings.stop_units and writes else None
    unreadable = _warn_unreadable(inventory, "its geometry is left as it is")
    results = applier.apply_all(inventory.readable, plans, dry_run=not writes, hooks=hooks)
    state = FAILED if unreadable else node_state(results)
    if args.json:
        print(json.dumps({"config": name, "file": file.source, "dry_run": not writes, "state": state,
                          "gpus": [result.to_json() for result in results]}, indent=2))
    else:
        for result in results:
            mark = {FAILED: "-", PENDING: "~", REBOOTING: "~"}.get(result.state, "+")
            gpu = gpu_name(result.gpu, result.product)
            reason = result.reason.removeprefix(f"{gpu}: ")  # the line starts with the GPU already
            print(f"[{mark}] {gpu}: {result.action}, {result.mutations} NVML mutation(s): {reason}")
            for change in result.changes:
                print(f"    {'would' if not writes else 'did'}: {change.describe()}")
        print(f"MIG config {name}: {state}{' (dry run, nothing changed)' if not writes else ''}")
    return {FAILED: EXIT_ERROR, PENDING: EXIT_NOT_READY, REBOOTING: EXIT_NOT_READY}.get(state, EXIT_OK)
