"""A forged ledger cannot make `uninstall` (or any pass) act outside what the agent owns.

The class: the ledger is trusted only for the files the stages write (host.owned.OWNABLE, checked
here against each stage's own constants) and the /dev/char links, and for originals only at the
agent's own name in /var/lib/gpu-agent/originals. An entry for anything else (a system file with its
right digest, a path reached through a link out of the root, an original elsewhere), a ledger of the
wrong types or with huge numbers: each is refused by ledger entry, nothing is removed or restored,
nothing outside the root changes (a canary directory beside it compared byte for byte), no traceback.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpu_agent.host import owned
from gpu_agent.host.ledger import PATH as LEDGER, Ledger
from gpu_agent.host.paths import Root
from gpu_agent.plan import digest
from harness import SimNode, run_cli
from test_faults_captures import snapshot

PASSWD = "root:x:0:0::/root:/bin/sh\n"


@pytest.fixture
def node(tmp_path: Path) -> SimNode:
    (tmp_path / "root").mkdir()
    sim = SimNode(tmp_path / "root", "dgx-h100")
    sim.sim("show")
    for name, text in {"etc/passwd": PASSWD, "etc/shadow": "root:*:19000::::::\n", "etc/motd": "hello\n"}.items():
        (sim.root / name).parent.mkdir(parents=True, exist_ok=True)
        (sim.root / name).write_text(text)
    return sim


@pytest.fixture
def canary(tmp_path: Path) -> Path:
    directory = tmp_path / "canary"
    directory.mkdir()
    (directory / "daemon.json").write_text('{"theirs": true}\n')
    (directory / "passwd").write_text(PASSWD)
    return directory


def forge(sim: SimNode, owned_entries: dict[str, Any], links: Any = None) -> None:
    ledger = sim.root / LEDGER.lstrip("/")
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.write_text(json.dumps({"version": 1, "pending_restarts": {}, "owned": owned_entries,
                                  "links": links or {}}))


def entry(written: str, original: Any = None, owner: str = "toolkit") -> dict[str, Any]:
    return {"owner": owner, "original": original, "written": digest(written.encode()), "restart": None}


def uninstall(sim: SimNode, tmp_path: Path) -> str:
    result = run_cli("--simulate", "dgx-h100", "uninstall", root=sim.root)
    assert "Traceback" not in result.stdout + result.stderr and "internal error" not in result.stdout + result.stderr
    return result.stdout + result.stderr


def test_every_stage_writes_only_what_the_ledger_may_undo(tmp_path: Path) -> None:
    from gpu_agent.config.toolkit import CdiConfig
    from gpu_agent.stages import driver, labels, toolkit
    from gpu_agent.toolkit import containerd, crio, distributions, docker, runtime_config

    root = Root(tmp_path)
    paths = [driver.BLACKLIST_NOUVEAU, "/etc/modprobe.d/gpu-agent-nvidia.conf", containerd.ROOT_CONFIG,
             containerd.DROP_IN, docker.DAEMON_JSON, crio.DROP_IN, runtime_config.PATH, runtime_config.RECORD,
             toolkit.OCI_HOOK, CdiConfig().path, "/etc/cdi/nvidia.yaml", labels.NFD_FILE, *distributions.WRITTEN]
    assert {path: owned.refusal(root, path) for path in paths} == {path: None for path in paths}
    for foreign in ("/etc/passwd", "/etc/modprobe.d/evil.conf", "/etc/cdi/sub/x.yaml", "/var/lib/gpu-agent/ledger.json",
                    "/etc/containerd/conf.d/00-other.toml", "/root/.ssh/authorized_keys"):
        assert owned.refusal(root, foreign) is not None, foreign


def test_an_owned_system_file_with_its_digest_is_refused_and_kept(node: SimNode, tmp_path: Path) -> None:
    forge(node, {"/etc/passwd": entry(PASSWD, owner="driver"), "/etc/shadow": entry("root:*:19000::::::\n")})
    out = uninstall(node, tmp_path)
    assert f"{LEDGER}: owned /etc/passwd: not a file gpu-agent writes" in out and "left alone" in out
    assert f"{LEDGER}: owned /etc/shadow: not a file gpu-agent writes" in out
    assert (node.root / "etc/passwd").read_text() == PASSWD and (node.root / "etc/shadow").exists()


def test_an_original_outside_the_agents_own_is_refused(node: SimNode, tmp_path: Path) -> None:
    """"original": "/etc/shadow" must not copy the shadow file over what the agent wrote."""
    (node.root / "etc/docker").mkdir(parents=True)
    (node.root / "etc/docker/daemon.json").write_text("{}\n")
    forge(node, {"/etc/docker/daemon.json": entry("{}\n", original="/etc/shadow")})
    out = uninstall(node, tmp_path)
    assert (f"{LEDGER}: owned /etc/docker/daemon.json: its original /etc/shadow is not where gpu-agent keeps "
            "originals (/var/lib/gpu-agent/originals/etc_docker_daemon.json)") in out
    assert (node.root / "etc/docker/daemon.json").read_text() == "{}\n"


def test_an_original_that_is_a_link_is_not_followed(node: SimNode, tmp_path: Path, canary: Path) -> None:
    (node.root / "etc/docker").mkdir(parents=True)
    (node.root / "etc/docker/daemon.json").write_text("{}\n")
    saved = node.root / owned.original_of("/etc/docker/daemon.json").lstrip("/")
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.symlink_to(canary / "passwd")
    before = snapshot(canary)
    forge(node, {"/etc/docker/daemon.json": entry("{}\n", original=owned.original_of("/etc/docker/daemon.json"))})
    out = uninstall(node, tmp_path)
    assert "cannot undo /etc/docker/daemon.json: the saved original" in out
    assert (node.root / "etc/docker/daemon.json").read_text() == "{}\n"
    assert snapshot(canary) == before


@pytest.mark.parametrize("how", ["absolute", "relative"])
def test_a_link_in_the_root_never_leads_a_removal_out_of_it(node: SimNode, tmp_path: Path, canary: Path,
                                                            how: str) -> None:
    """/etc/docker leads (as the OS reads it) to the canary, whose daemon.json has the digest the ledger names."""
    text = str(canary) if how == "absolute" else os.path.relpath(canary, node.root / "etc")
    (node.root / "etc/docker").symlink_to(text)
    before = snapshot(canary)
    forge(node, {"/etc/docker/daemon.json": entry('{"theirs": true}\n'),
                 str(canary / "daemon.json"): entry('{"theirs": true}\n')})
    out = uninstall(node, tmp_path)
    if how == "relative":  # the link leads to /canary under the root: the canary's own path is no file of ours
        assert f"{LEDGER}: owned {canary}/daemon.json: not a file gpu-agent writes" in out
    else:  # it leads to <root>/<canary>, where the agent would write through it: nothing there to undo
        assert not (node.root / str(canary).lstrip("/")).exists()
    assert snapshot(canary) == before


def test_a_file_that_became_a_link_or_a_fifo_is_left_alone(node: SimNode, tmp_path: Path, canary: Path) -> None:
    (node.root / "etc/docker").mkdir(parents=True)
    (node.root / "etc/docker/daemon.json").symlink_to(canary / "daemon.json")
    (node.root / "etc/cdi").mkdir(parents=True)
    os.mkfifo(node.root / "etc/cdi/nvidia.yaml")
    before = snapshot(canary)
    forge(node, {"/etc/docker/daemon.json": entry('{"theirs": true}\n'), "/etc/cdi/nvidia.yaml": entry("")})
    out = uninstall(node, tmp_path)
    assert "left as they are, changed since gpu-agent wrote them" in out
    assert (node.root / "etc/docker/daemon.json").is_symlink() and (node.root / "etc/cdi/nvidia.yaml").exists()
    assert snapshot(canary) == before


def test_a_forged_link_entry_is_refused(node: SimNode, tmp_path: Path) -> None:
    (node.root / "etc/localtime").symlink_to("/usr/share/zoneinfo/UTC")
    forge(node, {}, {"/etc/localtime": {"owner": "driver", "target": "/usr/share/zoneinfo/UTC"},
                     "/dev/char/../../etc/localtime": {"owner": "driver", "target": "/usr/share/zoneinfo/UTC"}})
    out = uninstall(node, tmp_path)
    assert f"{LEDGER}: link /etc/localtime: not a link gpu-agent makes" in out
    assert (node.root / "etc/localtime").is_symlink()


@pytest.mark.parametrize("document, message", [
    ({"version": 1, "owned": {"/etc/docker/daemon.json": {"owner": 1}}}, "owned: expected an object of host paths"),
    ({"version": 1, "owned": [], "links": {}}, "owned: expected an object"),
    ({"version": 1, "links": {"/dev/char/1:1": "x"}}, "links: expected an object"),
    ('{"version": 1, "mig_checkpoints": {"GPU-1": {"gpu": ' + "9" * 5000 + "}}}", "an integer of 5000 digits"),
    ('{"version": ' + "1" * 4301 + "}", "an integer of 4301 digits"),
    ("[" * 100000, "nested too deeply"),
    ({"version": 1, "owned": {"/etc/docker/daemon.json": {"owner": "toolkit", "original": None, "written": "sha256:0",
                                                          "restart": "../../../etc/evil; rm -rf /"}}},
     "owned: expected an object of host paths"),
    ({"version": 1, "pending_restarts": {"--force.service": {}}}, "pending_restarts: expected an object of units"),
])
def test_a_ledger_of_the_wrong_shape_is_refused_cleanly(node: SimNode, tmp_path: Path, document: Any,
                                                        message: str) -> None:
    ledger = node.root / LEDGER.lstrip("/")
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.write_text(document if isinstance(document, str) else json.dumps(document))
    before = hashlib.sha256(ledger.read_bytes()).hexdigest()
    out = uninstall(node, tmp_path)
    assert LEDGER in out and message in out, out
    assert hashlib.sha256(ledger.read_bytes()).hexdigest() == before
    assert (node.root / "etc/passwd").read_text() == PASSWD


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_a_ledger_that_is_a_link_to_nothing_is_refused_not_taken_for_none(node: SimNode, tmp_path: Path,
                                                                          canary: Path, target: str) -> None:
    """A link where the ledger goes that leads nowhere under the root (here: to the canary's path, which
    the root does not hold) is not "nothing to undo": uninstall says so and changes nothing."""
    ledger = node.root / LEDGER.lstrip("/")
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.symlink_to(canary / "file" if target == "absolute" else "../../../nowhere/ledger.json")
    before = snapshot(canary)
    result = run_cli("--simulate", "dgx-h100", "uninstall", root=node.root)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and f"{LEDGER}: a link that leads to nothing" in out, out
    assert "nothing of gpu-agent's is left to undo" not in out and "Traceback" not in out
    assert ledger.is_symlink() and snapshot(canary) == before


def test_a_path_outside_the_owned_set_is_never_written(node: SimNode) -> None:
    """toolkit.cdi.path: /etc/passwd (or any stage's path) is refused at the write, not only at the undo."""
    root = Root(node.root)
    with pytest.raises(owned.NotOwnable, match="/etc/passwd: not a file gpu-agent writes"):
        owned.write(root, Ledger(root), "cdi", "/etc/passwd", "x")
    assert (node.root / "etc/passwd").read_text() == PASSWD
    assert "/etc/passwd" not in Ledger(root).owned()
