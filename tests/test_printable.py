"""Text from the driver, NVML and files reaches logs, stage messages, /readyz, sd_notify and the CLI with
its control characters escaped: a GPU name cannot forge a line, a status assignment or a terminal escape."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.cli import setup_logging
from gpu_agent.daemon.engine import StageRun
from gpu_agent.daemon.notify import Notifier
from gpu_agent.printable import printable

FORGED = "NVIDIA H100\n[+]fake ok\x1b[31m"


@pytest.mark.parametrize("text, shown", [
    ("plain text, unicode too: café 1g.10gb", "plain text, unicode too: café 1g.10gb"),
    (FORGED, "NVIDIA H100\\n[+]fake ok\\x1b[31m"),
    ("tab\tand\rreturn\0nul\x7f", "tab\\tand\\rreturn\\x00nul\\x7f"),
    ("c1 \x85 \x9b", "c1 \\x85 \\x9b"),
    ("bidi \u202eevil\u202c \u2066x\u2069", "bidi \\u202eevil\\u202c \\u2066x\\u2069"),
    ("caf\udce9", "caf\\xe9"),  # a byte that was not UTF-8, kept by surrogateescape
    ("lone \ud800", "lone \\ud800"),
])
def test_control_characters_are_escaped_and_the_rest_kept(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_a_stage_message_is_one_printable_line() -> None:
    assert StageRun("discovery", "ok", f"1x {FORGED}").message == "1x NVIDIA H100\\n[+]fake ok\\x1b[31m"


def test_a_log_record_is_one_line(capsys: Any) -> None:
    setup_logging()
    try:
        logging.getLogger("gpu_agent.test").warning("GPU %s found", FORGED)
    finally:
        logging.getLogger().handlers.clear()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "GPU NVIDIA H100\\n[+]fake ok\\x1b[31m found" in err


def test_a_status_line_cannot_add_an_assignment(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    notifier = Notifier()
    monkeypatch.setattr(notifier, "_sd", type("Sd", (), {"notify": staticmethod(sent.append)})())
    notifier.status("degraded: driver\nREADY=1")
    assert sent == ["STATUS=degraded: driver\\nREADY=1"]


def test_a_gpu_name_from_nvml_reaches_the_cli_escaped(tmp_path: Path, capsys: Any) -> None:
    from test_capture import CAPTURE, command

    directory = tmp_path / "capture"
    shutil.copytree(CAPTURE, directory)
    nvml = directory / "nvml.json"
    calls = json.loads(nvml.read_text())
    next(entry for entry in calls if entry["call"] == "nvmlDeviceGetName")["ok"] = FORGED
    nvml.write_text(json.dumps(calls))
    _, out = command(capsys, tmp_path / "root", "--simulate", str(directory), "check")
    assert "\x1b" not in out and "\n[+]fake" not in out
    assert "[+] discovery: 1x H100\\n[+]fake ok\\x1b[31m, driver" in out, out
