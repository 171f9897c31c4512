"""What the subcommands share: the root, the config they run with."""
from __future__ import annotations

import argparse
from pathlib import Path

from gpu_agent.config import DEFAULT_CONFIG_PATH, LoadedConfig, load_config
from gpu_agent.host.paths import Root


def root_of(args: argparse.Namespace) -> Root:
    return Root(args.root)


def config_location(args: argparse.Namespace) -> tuple[Path, bool]:
    """(path, required): an explicit --config must exist; the default may be missing (built-in defaults)."""
    if args.config:
        return Path(args.config), True
    return root_of(args)(DEFAULT_CONFIG_PATH), False


def config_of(args: argparse.Namespace) -> LoadedConfig:
    path, required = config_location(args)
    return load_config(path, required)
