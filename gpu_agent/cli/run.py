"""gpu-agent run: the daemon."""
from __future__ import annotations

import argparse

from gpu_agent.cli.common import config_location, root_of
from gpu_agent.errors import ConfigError, EXIT_ERROR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    import logging  # here: every command's parser imports this module, and `status` needs no logging

    from gpu_agent.host.openssl import import_without_openssl

    import_without_openssl(root_of(args))  # not on a FIPS host
    from gpu_agent.config import load_config

    path, required = config_location(args)
    try:
        loaded = load_config(path, required)
    except ConfigError as exc:
        logging.getLogger("gpu_agent").error("refusing to start: %s", exc)
        return EXIT_ERROR
    from gpu_agent.daemon.app import run_daemon

    logging.getLogger().setLevel(loaded.config.log_level.upper())
    return run_daemon(root_of(args), loaded, path, required, args.simulate)
