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


def test_one_shot_commands_under_a_sandbox_root_find_its_simulated_machine(tmp_path) -> None:
    import json

    from harness import run_cli

    from gpu_agent.host.paths import Root
    from gpu_agent.sim.machine import found_in

    root = tmp_path / "root"
    root.mkdir()
    assert found_in(Root(root)) is None and found_in(Root("/")) is None  # the real host is never simulated
    assert run_cli("--simulate", "dgx-h100", "apply", "--once", root=root).returncode == 0  # as `make run` leaves it
    said = "gpu-agent: using the simulated machine found in"
    checked = run_cli("check", root=root)
    assert checked.returncode == 0 and "check passed" in checked.stdout
    assert checked.stderr.count(said) == 1 and "(dgx-h100)" in checked.stderr
    labels = run_cli("labels", root=root)
    assert "nvidia.com/gpu.present=true" in labels.stdout and said in labels.stderr
    planned = run_cli("apply", "--once", "--dry-run", "--json", root=root)
    assert planned.returncode == 0 and json.loads(planned.stdout)["changes"] == 0 and said in planned.stderr
    exported = run_cli("mig", "export", root=root)
    assert exported.returncode == 0 and "mig-enabled: false" in exported.stdout and said in exported.stderr
    text, plan = run_cli("uninstall", "--dry-run", root=root), run_cli("uninstall", "--dry-run", "--json", root=root)
    changes = json.loads(plan.stdout)["changes"]  # the /dev/char links apply made: one change each
    assert changes > 1 and text.stdout.count("would: ") == changes
    assert f"would make {changes} change(s)" in text.stdout and f"dry run: {changes} change(s)" in text.stdout
    assert said not in run_cli("--simulate", "dgx-h100", "check", root=root).stderr  # --simulate given: no guess
