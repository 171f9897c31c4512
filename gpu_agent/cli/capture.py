"""gpu-agent capture DIR: write what the agent reads from this node (files and NVML answers) to DIR,
changing nothing; `gpu-agent --simulate DIR` replays it anywhere."""
from __future__ import annotations

import argparse
from pathlib import Path

from gpu_agent.cli.common import config_of, root_of
from gpu_agent.errors import EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="a new (or empty) directory to write the capture to")


def main(args: argparse.Namespace) -> int:
    from gpu_agent.daemon.app import Runtime
    from gpu_agent.capture import capture, find_modprobe

    loaded = config_of(args)
    runtime = Runtime.build(root_of(args), loaded, args.simulate)
    runtime.nvml.close()  # the capture drives NVML through its own recording client
    source = f"--simulate {args.simulate}" if args.simulate else f"--root {runtime.root.path}"
    # A simulated node's modules are loaded by the simulated kernel's own loader.
    modprobe = "simulated" if runtime.machine is not None else find_modprobe(runtime.root)
    manifest = capture(runtime.root, runtime.nvml.lib, Path(args.directory), loaded.config.nvml.call_timeout_seconds,
                       source, modprobe)
    print(f"captured {source} into {args.directory}")
    for problem in manifest["problems"]:
        print(f"  not captured: {problem}")
    print(f"replay it with: gpu-agent --simulate {args.directory} --root SANDBOX check")
    return EXIT_OK
