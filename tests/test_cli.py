"""The command line's shape: global options before or after the subcommand."""
from __future__ import annotations

import pytest

from gpu_agent.cli import build_parser


@pytest.mark.parametrize("argv", [
    ["run", "--simulate", "dgx-h100", "--root", "/srv/node"],
    ["--simulate", "dgx-h100", "--root", "/srv/node", "run"],
    ["--root", "/srv/node", "run", "--simulate", "dgx-h100"],
])
def test_global_options_go_before_or_after_the_subcommand(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.command, args.simulate, args.root) == ("run", "dgx-h100", "/srv/node")


def test_an_option_after_the_subcommand_wins_and_defaults_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("GPU_AGENT_ROOT", "GPU_AGENT_CONFIG", "GPU_AGENT_SIMULATE"):
        monkeypatch.delenv(variable, raising=False)
    args = build_parser().parse_args(["--root", "/a", "check", "--root", "/b"])
    assert (args.root, args.config, args.simulate) == ("/b", None, None)
    assert build_parser().parse_args(["status"]).root == "/"
