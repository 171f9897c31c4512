"""What the subcommands share: the root, the config they run with. The config loader (pydantic) is
imported only by the commands that load the config: `--help` and `status` go without it."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from gpu_agent.config.endpoint import Endpoint, read_endpoint
from gpu_agent.config.text import DEFAULT_CONFIG_PATH
from gpu_agent.host.paths import Root

if TYPE_CHECKING:
    from gpu_agent.config import LoadedConfig
    from gpu_agent.daemon.app import Runtime
    from gpu_agent.daemon.engine import StageRun
    from gpu_agent.stages.base import Stage


def root_of(args: argparse.Namespace) -> Root:
    return Root(args.root)


def config_location(args: argparse.Namespace) -> tuple[Path, bool]:
    """(path, required): an explicit --config must exist; the default may be missing (built-in defaults)."""
    if args.config:
        return Path(args.config), True
    return root_of(args)(DEFAULT_CONFIG_PATH), False


def config_of(args: argparse.Namespace) -> LoadedConfig:
    from gpu_agent.config import load_config

    path, required = config_location(args)
    return load_config(path, required)


def endpoint_of(args: argparse.Namespace) -> Endpoint:
    """Where the daemon answers, as the config says: read cheaply, or (when the http section needs a
    closer look) from the whole config, which raises ConfigError naming what is wrong."""
    endpoint = read_endpoint(*config_location(args))
    if endpoint is None:
        http = config_of(args).config.http
        endpoint = Endpoint(http.listen, http.socket)
    return endpoint


def changes_in(run: StageRun) -> int:
    """The typed changes a stage made or would make (an action may hold several, or none but the
    agent's own records), as --json counts them."""
    return sum(len(action.changes) for action in run.planned)


def settled(run: StageRun) -> bool:
    """ok, or a dry run's pending stage that would change nothing on the host."""
    return run.state == "ok" or (run.state == "pending" and not changes_in(run))


def plan_json(runs: Sequence[StageRun], loaded: LoadedConfig, root: Root, dry_run: bool) -> str:
    """What `check --json` and `apply --once [--dry-run] --json` print: each stage's outcome and its
    typed changes (planned, or made)."""
    stages: list[dict[str, Any]] = [{
        "stage": run.stage,
        "state": run.state,
        "message": run.message,
        "changes": [change for action in run.planned for change in action.to_json()],
        "diff": "".join(action.diff for action in run.planned),
    } for run in runs]
    document = {
        "root": str(root.path),
        "config": {"source": loaded.source, "digest": loaded.digest},
        "dry_run": dry_run,
        "stages": stages,
        "changes": sum(len(stage["changes"]) for stage in stages),
        # Which way a pod's GPU reaches its container, and why (the device-path stage's choice).
        "device_path": next((run.outputs["device_path"].to_json() for run in runs
                             if run.outputs.get("device_path") is not None), None),
    }
    return json.dumps(document, indent=2)


def one_pass(args: argparse.Namespace, dry_run: bool, locked: bool = True,
             stages: Callable[[Runtime], list[Stage]] | None = None) -> tuple[list[StageRun], Runtime]:
    """One reconcile pass in this process, as `apply --once`, `check`, `labels` and `uninstall` run it:
    under the agent's lock unless a dry run (or `locked` is False), over `stages(runtime)` when given."""
    import asyncio

    from gpu_agent.daemon.app import Runtime, take_lock

    root = root_of(args)
    loaded = config_of(args)
    lock = take_lock(root) if locked and not dry_run else None
    try:
        runtime = Runtime.build(root, loaded, args.simulate)
        try:
            if stages is not None:
                runtime.engine.set_stages(stages(runtime))
            runs = asyncio.run(runtime.engine.reconcile(force=True, dry_run=dry_run))
        finally:
            runtime.nvml.close()
    finally:
        if lock is not None:
            lock.close()
    return runs, runtime
