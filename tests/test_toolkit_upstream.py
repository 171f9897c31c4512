"""nvidia-ctk's own runtime-config test cases, replayed on the agent's writers: NVIDIA/nvidia-container-toolkit
at commit d34b3046758cb1a5db606b2a39519c731bbf9f56. pkg/config/engine/containerd/config_test.go (TestAddRuntime),
containerd/config_v1_test.go (TestAddRuntimeV1) and crio/crio_test.go (TestAddRuntime) are copied to
tests/data/upstream and read here; pkg/config/engine/docker/docker_test.go (TestUpdateConfigDefaultRuntime,
TestUpdateConfigRuntimes) is encoded below. nvidia-ctk edits containerd's and Docker's file in place and writes
CRI-O a drop-in; the agent writes containerd a drop-in. So the replay compares what the runtime would see after
merging (the nvidia runtime's entry, the other runtimes upstream's result names, the default runtime, the CDI
switch), not bytes. Upstream's runtime name (`test`, `runtime1`, `NAME`) is the agent's `nvidia`. Where the
agent deliberately differs, the case names the sentence of docs/toolkit.md that says why."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Optional

import pytest
import tomlkit

from gpu_agent.host.paths import Root
from gpu_agent.toolkit import containerd, crio, docker

UPSTREAM = Path(__file__).parent / "data/upstream/nvidia-container-toolkit/pkg/config/engine"
DOCS = Path(__file__).parent.parent / "docs/toolkit.md"
NAME = "test"  # upstream's runtime name and binary in the TOML tables
BINARY = "/usr/bin/test"
KEPT_DEFAULT = ("an `nvidia` default runtime the admin's own file names stays when `set_as_default` is off: "
                "the agent's own default lives in its drop-in and goes with it")
# Expected results that differ on purpose: (file, description) -> (what the agent's result has instead, reason).
DELIBERATE: dict[tuple[str, str], tuple[dict[str, Any], str]] = {
    ("containerd/config_test.go", "runtime already exists in config, not default runtime"):
        ({"default_runtime_name": NAME}, KEPT_DEFAULT),
    ("containerd/config_v1_test.go", "empty config not default runtime"):
        ({"runtime_type": containerd.RUNC_V2},
         "the fixture passes `WithRuntimeType(\"\")`; nvidia-ctk's default, and the agent's, is "
         "`io.containerd.runc.v2`"),
}


def go_cases(path: str) -> list[tuple[str, dict[str, Any]]]:
    """The rows of the file's TestAddRuntime* table: description, config, setAsDefault, expectedConfig."""
    text = (UPSTREAM / path).read_text()
    table = text[text.index("func TestAddRuntime"):text.index("for _, tc := range testCases")]
    rows = []
    for block in re.split(r"\n\t\t\{\n", table)[1:]:
        fields = dict(re.findall(r'(\w+):\s*(`[^`]*`|"[^"]*"|true|false|nil)', block))
        row = {"config": "", "setAsDefault": "false", **fields}
        rows.append((row["description"].strip('"'), {
            "config": row["config"].strip("`"), "default": row["setAsDefault"] == "true",
            "expected": row["expectedConfig"].strip("`")}))
    return rows


def containerd_cases() -> list[Any]:
    return [pytest.param(path, description, row, id=f"{path}: {description}")
            for path in ("containerd/config_test.go", "containerd/config_v1_test.go")
            for description, row in go_cases(path)]


def test_the_copied_tables_are_read_whole() -> None:
    assert [len(go_cases(path)) for path in ("containerd/config_test.go", "containerd/config_v1_test.go",
                                            "crio/crio_test.go")] == [10, 4, 7]


def renamed(runtimes: dict[str, Any]) -> dict[str, Any]:
    return {(containerd.RUNTIME_NAME if name == NAME else name): entry for name, entry in runtimes.items()}


def effective_default(containerd_table: dict[str, Any]) -> str:
    name = containerd_table.get("default_runtime_name", "runc")
    return containerd.RUNTIME_NAME if name == NAME else name


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


def agent_containerd(root: Path, config: str, set_as_default: bool, legacy: bool) -> dict[str, Any]:
    """The CRI plugin table containerd would see after the agent's writes. With no file the agent writes
    version 2, as nvidia-ctk does; an empty file is version 1 to both (upstream's WithUseLegacyConfig)."""
    config = config.replace(f"runtimes.{NAME}", "runtimes.nvidia").replace(f'"{NAME}"', '"nvidia"')
    path = root / "etc/containerd/config.toml"
    path.parent.mkdir(parents=True)
    if config.strip() or legacy:
        path.write_text(config)
    files = containerd.plan(Root(root), BINARY, enable_cdi=False, set_as_default=set_as_default)
    assert files.root_desired is not None
    plugin = containerd.CRI_PLUGIN[files.version]
    top = tomlkit.parse(files.root_desired).unwrap().get("plugins", {}).get(plugin, {})
    drop_in = tomlkit.parse(files.drop_in_desired).unwrap()["plugins"][plugin]
    return merged(top, drop_in) if files.version >= 3 else drop_in


@pytest.mark.parametrize("path, description, row", containerd_cases())
def test_containerd_agrees_with_nvidia_ctk(tmp_path: Path, path: str, description: str, row: dict[str, Any]) -> None:
    expected_document = tomlkit.parse(row["expected"]).unwrap()
    plugin = containerd.CRI_PLUGIN[expected_document.get("version", 1)]
    expected = expected_document["plugins"][plugin]["containerd"]
    got = agent_containerd(tmp_path, row["config"], row["default"], legacy=path.endswith("_v1_test.go"))
    assert got.get("enable_cdi", False) is False
    runtimes = renamed(expected["runtimes"])
    wanted = {"default": effective_default(expected), "nvidia": set_entries(runtimes.pop("nvidia"))}
    instead, reason = DELIBERATE.get((path, description), ({}, ""))
    if "default_runtime_name" in instead:
        wanted["default"] = effective_default(instead)
    wanted["nvidia"].update({key: value for key, value in instead.items() if key != "default_runtime_name"})
    assert not reason or reason in " ".join(DOCS.read_text().split())
    assert {"default": effective_default(got["containerd"]),
            "nvidia": set_entries(got["containerd"]["runtimes"]["nvidia"])} == wanted
    for name, entry in runtimes.items():  # the admin's runtimes, as they were
        assert set_entries(got["containerd"]["runtimes"][name]) == set_entries(entry)


@pytest.mark.parametrize("description, row", go_cases("crio/crio_test.go"), ids=lambda value: str(value)[:60])
def test_crio_agrees_with_nvidia_ctk(root: Path, description: str, row: dict[str, Any]) -> None:
    """nvidia-ctk writes CRI-O a drop-in from the config it reads, as the agent does: both merged on the input."""
    config = row["config"].replace(f"runtimes.{NAME}]", "runtimes.nvidia]").replace(f'"{NAME}"', '"nvidia"')
    conf = root / "etc/crio/crio.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text(config)
    upstream_drop_in = row["expected"].replace(f"runtimes.{NAME}]", "runtimes.nvidia]").replace(f'"{NAME}"',
                                                                                            '"nvidia"')
    base = tomlkit.parse(config).unwrap()
    wanted = merged(base, tomlkit.parse(upstream_drop_in).unwrap())["crio"]["runtime"]
    got = merged(base, tomlkit.parse(crio.desired(Root(root), BINARY, row["default"])).unwrap())["crio"]["runtime"]
    assert got["runtimes"] == wanted["runtimes"]
    assert got.get("default_runtime") == wanted.get("default_runtime")


DOCKER_BINARY = "/test/runtime/dir/runtime1"
DOCKER_OPTIONS = {"exec-opts": ["native.cgroupdriver=systemd"], "log-driver": "json-file",
                  "log-opts": {"max-size": "100m"}, "storage-driver": "overlay2"}


# docker_test.go TestUpdateConfigDefaultRuntime: config, setAsDefault, the resulting default-runtime.
@pytest.mark.parametrize("case, config, set_as_default, default_runtime", [
    (0, {}, False, None),
    (1, {}, True, "nvidia"),
    (2, {"default-runtime": "ALREADY_SET"}, False, "ALREADY_SET"),
    (3, {"default-runtime": "ALREADY_SET"}, True, "nvidia"),
])
def test_docker_default_runtime_agrees_with_nvidia_ctk(case: int, config: dict[str, Any], set_as_default: bool,
                                                       default_runtime: Optional[str]) -> None:
    written = json.loads(docker.desired(json.dumps(config), DOCKER_BINARY, False, set_as_default))
    assert written.get("default-runtime") == default_runtime


# docker_test.go TestUpdateConfigRuntimes: the config and its expected result, runtime1 as `nvidia`. Upstream's
# second runtime (runtime2) is left out: the agent configures only its own. Case 4 adds no runtime: nothing to replay.
@pytest.mark.parametrize("case, config, expected", [
    (0, {}, {"runtimes": {"nvidia": {"path": DOCKER_BINARY, "args": []}}}),
    (1, {"runtimes": {"nvidia": {"path": "runtime1", "args": []}}},
     {"runtimes": {"nvidia": {"path": DOCKER_BINARY, "args": []}}}),
    (2, {"runtimes": {"not-nvidia": {"path": "some-other-path", "args": []}}},
     {"runtimes": {"not-nvidia": {"path": "some-other-path", "args": []},
                   "nvidia": {"path": DOCKER_BINARY, "args": []}}}),
    (3, DOCKER_OPTIONS, {**DOCKER_OPTIONS, "runtimes": {"nvidia": {"path": DOCKER_BINARY, "args": []}}}),
])
def test_docker_runtimes_agree_with_nvidia_ctk(case: int, config: dict[str, Any], expected: dict[str, Any]) -> None:
    assert json.loads(docker.desired(json.dumps(config), DOCKER_BINARY, False, False)) == expected
