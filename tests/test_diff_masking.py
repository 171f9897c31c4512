"""Diffs shown by `check` and `apply --dry-run` never carry a credential from the file they change:
runtime configs hold registry passwords and tokens, and a diff's context lines quote the file."""
from __future__ import annotations

from pathlib import Path

import pytest
from harness import SimNode

from gpu_agent.host.files import unified_diff
from gpu_agent.host.masking import MASK, masked

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


# --- the class of credential places, not just the keys named password or token -------------------

PLACES = [
    ("array-value", 'headers.Authorization = ["Bearer {c}", "{c}"]'),
    ("array-over-lines", '[host."https://m.example".header]\n  Authorization = [\n    "Bearer {c}",\n  ]'),
    ("array-nested", '"auth": [["{c}"], {{"x": "{c}"}}]'),
    ("url-userinfo", 'endpoint = ["https://robot:{c}@mirror.example/v2"]'),
    ("url-user-only", "mirror: http://{c}@mirror.example"),
    ("x-api-key", '"X-Api-Key": "{c}"'),
    ("private_key", "private_key = '{c}'"),
    ("apikey", "apikey: {c}"),
    ("api-key", '"api-key" = "{c}"'),
    ("access_key", "AWS_ACCESS_KEY_ID = {c}"),
    ("client_secret", '"client_secret":"{c}"'),
    ("bearer-anywhere", 'note = "send Bearer {c} to it"'),
    ("basic-anywhere", "curl -H 'X: Basic {c}'"),
    ("cookie", "Cookie: sid={c}"),
    ("session", 'session_id = "{c}"'),
    ("passphrase", "passphrase: {c}"),
    ("pem-lines", "-----BEGIN RSA PRIVATE KEY-----\n{c}\n{c}\n-----END RSA PRIVATE KEY-----"),
    ("pem-in-a-string", '"key": "-----BEGIN EC PRIVATE KEY-----\\n{c}\\n-----END EC PRIVATE KEY-----\\n"'),
    ("pem-unclosed", "-----BEGIN PRIVATE KEY-----\n{c}"),
    ("yaml-sequence", "token:\n  - {c}\n  - {c}"),
    ("yaml-sequence-same-column", "token:\n- {c}"),
    ("yaml-block-scalar", "password: |\n  {c}\n  {c}"),
    ("toml-multiline-string", 'password = """\n{c}\n{c}"""'),
    ("json-crlf", '{{\r\n  "auth": "{c}"\r\n}}'),
    ("escaped-quotes", r'password = "\"\\{c}\""'),
    ("dotted-toml-key", 'plugins."io.containerd.grpc.v1.cri".registry.configs."r".auth.password = "{c}"'),
]


@pytest.mark.parametrize("text", [text for _, text in PLACES], ids=[name for name, _ in PLACES])
def test_every_credential_place_is_masked(text: str) -> None:
    before = "a = 1\n" + text.replace("{c}", CANARY) + "\nb = 2\n"
    assert CANARY not in masked(before) and MASK in masked(before)
    for current, desired in ((before, before.replace("a = 1", "a = 3")), (None, before), (before, "")):
        diff = unified_diff("/etc/x", current, desired)
        assert CANARY not in diff and MASK in diff, diff


def test_what_holds_no_credential_is_shown_as_it_is() -> None:
    text = ('[plugins."io.containerd.grpc.v1.cri".registry.mirrors."docker.io"]\n'
            '  endpoint = ["https://mirror.example:5000/v2"]\n'
            '"auths": {"auth.docker.io": {}}\n'
            "auth:\n  username: robot\n  password: x\n"
            'runtime = "nvidia"  # the key of a table\n'
            "key_file = \"/etc/pki/client.key\"\n")
    shown = masked(text)
    assert shown == text.replace("password: x", f"password: {MASK}"), shown


def test_a_change_in_a_masked_value_only_is_said_not_shown() -> None:
    diff = unified_diff("/etc/x", f'password = "{CANARY}"\n', 'password = "other"\n')
    assert "masked values only" in diff and CANARY not in diff and "other" not in diff


# --- bounded work: inputs that a quadratic step would take minutes over -----------------------------
#
# 50 KB to 250 KB each: the regex this replaced took 14 s over 20 KB, minutes over these. The 10 s per test
# (conftest) is what fails a quadratic step here; the assertions are about the result.

ADVERSARIAL = [
    ("word-characters", "a" * 250_000),
    ("credential-word-runs", "password" * 25_000),
    ("credential-prefixes", "password_" * 25_000 + " = x"),
    ("quotes", '"' * 125_000),
    ("backslashes", "\\" * 125_000),
    ("quotes-and-backslashes", '"\\' * 62_500),
    ("keys-without-values", "token:\n" * 15_000),
    ("crlf", "a = 1\r\n" * 15_000),
    ("deep-nesting", "token = " + "[" * 50_000 + "]" * 50_000),
    ("open-braces", "{" * 125_000),
    ("colons", "a:" * 62_500),
    ("url-schemes", "://" * 50_000),
    ("one-long-userinfo", "://" + "u" * 125_000),
    ("spaces-after-a-key", "password" + " " * 125_000),
    ("pem-begins", "-----BEGIN PRIVATE KEY-----" * 5_000),
    ("bearers", "bearer " * 25_000),
    ("a-60KB-comment-line-then-a-secret", "#" + "x" * 60_000 + f'\npassword = "{CANARY}"'),
]


@pytest.mark.parametrize("text", [text for _, text in ADVERSARIAL], ids=[name for name, _ in ADVERSARIAL])
def test_masking_and_diffing_any_large_input(text: str) -> None:
    secret = f'\n  password = "{CANARY}"\n'
    assert CANARY not in masked(text + secret)
    diff = unified_diff("/etc/x", text + secret, "changed = 1\n" + text + secret)
    assert diff.startswith("--- /etc/x\n+++ /etc/x\n@@ -1,") and "+changed = 1\n" in diff
    assert CANARY not in diff and len(diff) < 20_000  # long lines are cut


def test_a_change_past_a_cut_line_still_shows() -> None:
    old = "x = " + "a" * 300_000 + "\n"
    diff = unified_diff("/etc/x", old, old.replace("a\n", "b\n"))
    lines = diff.splitlines()
    assert lines[3].startswith("-x = aaa") and lines[4].startswith("+x = aaa") and lines[3] != lines[4]
    assert "300004 characters" in lines[3]


def test_many_changed_lines_make_one_bounded_hunk() -> None:
    # difflib's matching of 20,000 lines repeating 150 values is quadratic (half a minute)
    old = "".join(f"a{i % 150}\n" for i in range(20_000))
    new = "".join(f"a{i % 150}\n" for i in reversed(range(20_000)))
    diff = unified_diff("/etc/x", old, new)
    assert "more lines not shown" in diff and diff.count("\n") < 5_000
    small = unified_diff("/etc/x", "a\nb\nc\nd\ne\nf\ng\nh\n", "a\nb\nc\nd\nE\nf\ng\nh\n")
    assert small == "--- /etc/x\n+++ /etc/x\n@@ -2,7 +2,7 @@\n b\n c\n d\n-e\n+E\n f\n g\n h\n", small
