"""The agent's own capture of a real H200 node (tests/data/captures/h200-580-vm: `gpu-agent capture` run there
on 2026-11-27 by bench/real_gpu_checklist.sh; one NVIDIA H200 in a Firecracker VM, driver 580.159.04, MIG
disabled), replayed: `check --json`, `mig export` and `mig apply --dry-run` must say what they said on the
real node (h200-580-vm-outputs/: check.json from a second machine of the same kind, the MIG outputs from the
captured one, and driver reload --dry-run --json)."""
from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.cli import build_parser

DATA = Path(__file__).parent / "data" / "captures"
CAPTURE = DATA / "h200-580-vm"
OUTPUTS = DATA / "h200-580-vm-outputs"


def command(capsys: Any, root: Path, *argv: str) -> tuple[int, str]:
    args = build_parser().parse_args(["--root", str(root), "--simulate", str(CAPTURE), *argv])
    capsys.readouterr()
    code = importlib.import_module(f"gpu_agent.cli.{args.command}").main(args)
    return code, capsys.readouterr().out


def real_mig_outputs() -> dict[str, tuple[str, int]]:
    """mig.txt's sections: `--- mig export` and `--- mig apply --dry-run -c NAME`, each (output, exit status)."""
    sections = re.split(r"^--- (.*)\n", (OUTPUTS / "mig.txt").read_text(), flags=re.M)[1:]
    found = {}
    for title, body in zip(sections[::2], sections[1::2]):
        if title.startswith("mig "):
            output, status = body.rsplit("rc=", 1)
            found[title] = (output, int(status))
    return found


def test_check_on_the_replayed_h200_says_what_the_real_node_said(tmp_path: Path, capsys: Any) -> None:
    real = json.loads((OUTPUTS / "check.json").read_text())
    code, out = command(capsys, tmp_path, "check", "--json")
    replayed = json.loads(out)
    assert code == 2 and replayed["stages"] == real["stages"] and replayed["device_path"] == real["device_path"]
    assert replayed["changes"] == real["changes"] == 6  # the /dev/char links the node lacks


@pytest.mark.parametrize("title", sorted(real_mig_outputs()))
def test_mig_export_and_dry_runs_on_the_replayed_h200_match_the_real_node(title: str, tmp_path: Path,
                                                                         capsys: Any) -> None:
    real, status = real_mig_outputs()[title]
    argv = title.split()[1:]
    if "-c" in argv:
        argv = ["apply", "--dry-run", "--json", "-f", str(OUTPUTS / "mig-configs.yaml"), "-c", argv[-1]]
    code, out = command(capsys, tmp_path, "mig", *argv)
    if "--json" in argv:
        out, real = json.loads(out), json.loads(real)
        assert out.pop("file") == str(OUTPUTS / "mig-configs.yaml")
        real.pop("file")
    assert (code, out) == (status, real)


def test_driver_reload_dry_run_on_the_replayed_h200_finds_what_the_real_node_did(tmp_path: Path, capsys: Any) -> None:
    """Issue 26, point 5: on the real node the loaded and installed drivers agree (580.159.04): nothing to
    reload; the replay says the same, word for word."""
    real = json.loads((OUTPUTS / "driver-reload-dry-run.json").read_text())
    code, out = command(capsys, tmp_path, "driver", "reload", "--dry-run", "--json")
    assert (code, json.loads(out)) == (0, real) and real["reload_required"] is None and real["plan"] == []
