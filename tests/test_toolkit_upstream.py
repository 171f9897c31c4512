"""nvidia-ctk's own runtime-config test cases, replayed on the agent's writers. The cases live in
tests/facts/nvidia_ctk_runtimes.py, re-expressed as our own data, each naming its file in
NVIDIA/nvidia-container-toolkit, its Go test and the commit: containerd's TestAddRuntime and TestAddRuntimeV1,
CRI-O's TestAddRuntime, Docker's TestUpdateConfigDefaultRuntime and TestUpdateConfigRuntimes. nvidia-ctk edits
containerd's and Docker's file in place and writes CRI-O a drop-in; the agent writes containerd a drop-in. So the
replay compares what the runtime would see after merging (the nvidia runtime's entry, the other runtimes
upstream's result names, the default runtime, the CDI switch), not bytes. The runtime upstream adds (`test`,
`NAME`, `runtime1`) is the agent's `nvidia`. Where the agent deliberately differs, the case names the sentence of
docs/toolkit.md that says why."""
from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import tomlkit
from facts import nvidia_ctk_runtimes as upstream
from facts.nvidia_ctk_runtimes import Case

from gpu_agent.host.paths import Root
from gpu_agent.toolkit import containerd, crio, docker

DOCS = Path(__file__).parent.parent / "docs/toolkit.md"
NVIDIA = containerd.RUNTIME_NAME
DEFAULT_KEYS = ("default_runtime_name", "default_runtime", "default-runtime")  # containerd's, CRI-O's, Docker's
KEPT_DEFAULT = ("an `nvidia` default runtime the admin's own file names stays when `set_as_default` is off: "
                "the agent's own default lives in its drop-in and goes with it")
# Expected results that differ on purpose: (file, description) -> (what the agent's result has instead, reason).
DELIBERATE: dict[tuple[str, str], tuple[dict[str, Any], str]] = {
    (upstream.CONTAINERD, "runtime already exists in config, not default runtime"):
        ({"default_runtime_name": NVIDIA}, KEPT_DEFAULT),
    (upstream.CONTAINERD_V1, "empty config not default runtime"):
        ({"runtime_type": containerd.RUNC_V2},
         "the fixture passes `WithRuntimeType(\"\")`; nvidia-ctk's default, and the agent's, is "
         "`io.containerd.runc.v2`"),
}


def replayed(*tables: tuple[str, str]) -> list[Any]:
    return [pytest.param(case, id=f"{case.source.rsplit('/', 2)[-2]}/{case.test}: {case.description}")
            for table in tables for case in upstream.cases(*table)]


def test_the_fact_table_holds_every_case() -> None:
    """As many cases per upstream table as it held at the commit (Docker's TestUpdateConfigRuntimes: one of its
    five adds no runtime and is not replayed), each named once, all from that commit."""
    assert Counter((case.source, case.test) for case in upstream.CASES) == {
        (upstream.CONTAINERD, "TestAddRuntime"): 10, (upstream.CONTAINERD_V1, "TestAddRuntimeV1"): 4,
        (upstream.CRIO, "TestAddRuntime"): 7, (upstream.DOCKER, "TestUpdateConfigDefaultRuntime"): 4,
        (upstream.DOCKER, "TestUpdateConfigRuntimes"): 4}
    assert len({(case.source, case.test, case.description) for case in upstream.CASES}) == len(upstream.CASES)
    assert {case.commit for case in upstream.CASES} == {"d34b3046758cb1a5db606b2a39519c731bbf9f56"}
    assert all(case.added for case in upstream.CASES)


def added_runtime(case: Case) -> tuple[str, str]:
    """The runtime the case adds (its first, where it adds several): its name and binary."""
    return next(iter(case.added.items()))


def as_nvidia(value: Any, name: str) -> Any:
    """`value` with upstream's runtime `name` as the agent's `nvidia`: its entry under any `runtimes` table,
    and a default runtime naming it."""
    if not isinstance(value, dict):
        return copy.deepcopy(value)
    result = {}
    for key, item in value.items():
        if key == "runtimes" and isinstance(item, dict):
            result[key] = {(NVIDIA if runtime == name else runtime): as_nvidia(entry, name)
                           for runtime, entry in item.items()}
        elif key in DEFAULT_KEYS and item == name:
            result[key] = NVIDIA
        else:
            result[key] = as_nvidia(item, name)
    return result


def set_entries(entry: dict[str, Any]) -> dict[str, Any]:
    """A containerd runtime entry without the keys upstream writes at containerd's own defaults."""
    return {key: value for key, value in entry.items() if value not in ("", False)}


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` merged into `base` key by key, as containerd 2.x and CRI-O merge drop-ins."""
    result = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def agent_containerd(root: Path, config: dict[str, Any], binary: str, set_as_default: bool,
                     legacy: bool) -> dict[str, Any]:
    """The CRI plugin table containerd would see after the agent's writes. With no file the agent writes
    version 2, as nvidia-ctk does; an empty file is version 1 to both (upstream's WithUseLegacyConfig)."""
    path = root / "etc/containerd/config.toml"
    path.parent.mkdir(parents=True)
    if config or legacy:
        path.write_text(tomlkit.dumps(config))
    files = containerd.plan(Root(root), binary, enable_cdi=False, set_as_default=set_as_default)
    assert files.root_desired is not None
    plugin = containerd.CRI_PLUGIN[files.version]
    top = tomlkit.parse(files.root_desired).unwrap().get("plugins", {}).get(plugin, {})
    drop_in = tomlkit.parse(files.drop_in_desired).unwrap()["plugins"][plugin]
    return merged(top, drop_in) if files.version >= 3 else drop_in


def default_runtime(containerd_table: dict[str, Any]) -> str:
    return containerd_table.get("default_runtime_name", "runc")


@pytest.mark.parametrize("case", replayed((upstream.CONTAINERD, "TestAddRuntime"),
                                          (upstream.CONTAINERD_V1, "TestAddRuntimeV1")))
def test_containerd_agrees_with_nvidia_ctk(tmp_path: Path, case: Case) -> None:
    name, binary = added_runtime(case)
    expected_document = as_nvidia(case.expected, name)
    plugin = containerd.CRI_PLUGIN[expected_document.get("version", 1)]
    expected = expected_document["plugins"][plugin]["containerd"]
    got = agent_containerd(tmp_path, as_nvidia(case.config, name), binary, case.set_as_default,
                           legacy=case.source == upstream.CONTAINERD_V1)
    assert got.get("enable_cdi", False) is False
    runtimes = dict(expected["runtimes"])
    wanted: dict[str, Any] = {"default": default_runtime(expected), "nvidia": set_entries(runtimes.pop(NVIDIA))}
    instead, reason = DELIBERATE.get((case.source, case.description), ({}, ""))
    if "default_runtime_name" in instead:
        wanted["default"] = default_runtime(instead)
    wanted["nvidia"].update({key: value for key, value in instead.items() if key != "default_runtime_name"})
    assert not reason or reason in " ".join(DOCS.read_text().split())
    assert {"default": default_runtime(got["containerd"]),
            "nvidia": set_entries(got["containerd"]["runtimes"][NVIDIA])} == wanted
    for runtime, entry in runtimes.items():  # the admin's runtimes, as they were
        assert set_entries(got["containerd"]["runtimes"][runtime]) == set_entries(entry)


@pytest.mark.parametrize("case", replayed((upstream.CRIO, "TestAddRuntime")))
def test_crio_agrees_with_nvidia_ctk(root: Path, case: Case) -> None:
    """nvidia-ctk writes CRI-O a drop-in from the config it reads, as the agent does: both merged on the input."""
    name, binary = added_runtime(case)
    config = as_nvidia(case.config, name)
    conf = root / "etc/crio/crio.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text(tomlkit.dumps(config))
    wanted = merged(config, as_nvidia(case.expected, name))["crio"]["runtime"]
    written = crio.desired(Root(root), binary, case.set_as_default)  # None: the config gives it already
    drop_in = tomlkit.parse(written).unwrap() if written is not None else {}
    got = merged(config, drop_in)["crio"]["runtime"]
    assert got["runtimes"] == wanted["runtimes"]
    assert got.get("default_runtime") == wanted.get("default_runtime")


@pytest.mark.parametrize("case", replayed((upstream.DOCKER, "TestUpdateConfigDefaultRuntime")))
def test_docker_default_runtime_agrees_with_nvidia_ctk(case: Case) -> None:
    """Upstream compares only `default-runtime` here."""
    name, binary = added_runtime(case)
    written = json.loads(docker.desired(json.dumps(case.config), binary, False, case.set_as_default))
    assert written.get("default-runtime") == as_nvidia(case.expected, name).get("default-runtime")


@pytest.mark.parametrize("case", replayed((upstream.DOCKER, "TestUpdateConfigRuntimes")))
def test_docker_runtimes_agree_with_nvidia_ctk(case: Case) -> None:
    """The whole daemon.json. Where upstream adds a second runtime, its entry is not expected: the agent
    configures only its own."""
    name, binary = added_runtime(case)
    expected = as_nvidia(case.expected, name)
    for other in list(case.added)[1:]:
        del expected["runtimes"][other]
    config = as_nvidia(case.config, name)
    assert json.loads(docker.desired(json.dumps(config), binary, False, case.set_as_default)) == expected
