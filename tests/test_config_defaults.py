"""The shipped config file documents every setting at exactly its built-in default."""
from __future__ import annotations

import dataclasses

from gpu_agent.config.defaults import render_defaults
from gpu_agent.config.loader import parse_config
from gpu_agent.config.schema import AgentConfig


def uncomment(text: str) -> str:
    """What a user gets by uncommenting every setting (description comments stay comments)."""
    lines, body = [], False
    for line in text.splitlines():
        if body and line.startswith("#") and not line[1:].lstrip().startswith("#"):
            line = line[1:]
        body = body or line == "version: v1"
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_shipped_file_as_is_gives_the_defaults() -> None:
    assert parse_config(render_defaults(), "config.yaml") == AgentConfig()


def test_every_setting_uncommented_gives_the_defaults_too() -> None:
    text = uncomment(render_defaults())
    assert "\ninterval_seconds" not in text and "\n  interval_seconds: 60\n" in text
    assert parse_config(text, "config.yaml") == AgentConfig()


def test_every_setting_is_in_the_file() -> None:
    text = render_defaults()
    for field in dataclasses.fields(AgentConfig):
        assert f"{field.name}:" in text
        value = getattr(AgentConfig(), field.name)
        for key in dataclasses.fields(value) if dataclasses.is_dataclass(value) else ():
            assert f"#  {key.name}:" in text, key.name
