"""gpu-agent run: the daemon."""
from __future__ import annotations

import argparse

from gpu_agent.cli.common import config_location, root_of
from gpu_agent.errors import ConfigError, EXIT_ERROR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    import logging  # here: every command's parser imports this module, and `status` needs no logging

    from gpu_agent.config import validate

    path, required = config_location(args)
    # A forked child validates while this process imports the daemon (single-threaded still).
    loading = validate.start(path, required, root_of(args), fork=True)
    from gpu_agent.daemon.app import run_daemon

    try:
        loaded = loading.result()
    except ConfigError as exc:
        logging.getLogger("gpu_agent").error("refusing to start: %s", exc)
        return EXIT_ERROR
    logging.getLogger().setLevel(loaded.config.log_level.upper())
    return run_daemon(root_of(args), loaded, path, required, args.simulate)
