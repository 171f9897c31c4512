"""Diffs shown by `check` and `apply --dry-run` never carry a credential from the file they change:
runtime configs hold registry passwords and tokens, and a diff's context lines quote the file."""
from __future__ import annotations

from pathlib import Path

import pytest
from harness import SimNode

from gpu_agent.host.files import MASK, unified_diff

# Fixed, not random: pytest-xdist workers must collect the same parametrized test ids.
CANARY = "canary5f0c1d2e9a7b4c31"


LINES = [
    f'  password = "{CANARY}"',                      # containerd's registry auth, TOML
    f"  identitytoken = '{CANARY}'",
    f'  auth = {{ username = "u", password = "{CANARY}" }}',
    f'    "r.example": {{"auth": "{CANARY}"}},',      # JSON, nested on one line
    f'  "registry-token": "{CANARY}"',
    f"token: {CANARY} and more",                       # YAML, bare value with spaces
    f'  password = "a\\"{CANARY}"',                    # an escaped quote inside the value
    f"client_secret={CANARY}",
]


@pytest.mark.parametrize("line", LINES, ids=[f"line{number}" for number in range(len(LINES))])
def test_a_credential_in_a_changed_or_context_line_is_masked(line: str) -> None:
    before = f"a = 1\n{line}\nb = 2\n"
    for current, desired in ((before, before.replace("a = 1", "a = 3")), (None, before), (before, "")):
        diff = unified_diff("/etc/x", current, desired)
        assert MASK in diff and CANARY not in diff, diff


def test_keys_that_open_a_table_and_other_keys_are_shown() -> None:
    diff = unified_diff("/etc/docker/daemon.json", '{\n  "auths": {\n  "x": 1\n}\n', '{\n  "auths": {\n  "x": 2\n}\n')
    assert '"auths": {' in diff and '-  "x": 1' in diff and '+  "x": 2' in diff and MASK not in diff


@pytest.mark.subprocess  # the real containerd validates the planned config
def test_check_on_a_containerd_config_with_registry_auth_shows_no_password(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for binary in ("/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-container-runtime-hook",
                   "/usr/bin/nvidia-ctk", "/usr/bin/nvidia-cdi-hook"):
        (root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    status = root / "var/lib/dpkg/status"
    status.parent.mkdir(parents=True)
    status.write_text("Package: nvidia-container-toolkit\nStatus: install ok installed\nVersion: 1.17.8-1\n\n")
    config = root / "etc/containerd/config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".registry.configs."r.example".auth]\n'
        f'  username = "robot"\n  password = "{CANARY}"\n'
    )
    node = SimNode(root, "dgx-h100")
    diff = "".join(action.diff for action in node.check().stage("toolkit").planned)
    assert "+imports" in diff and 'username = "robot"' in diff  # the context really is shown
    assert CANARY not in diff and f"password = {MASK}" in diff
