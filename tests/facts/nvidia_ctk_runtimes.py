"""What nvidia-ctk's runtime-config unit tests expect, as our own data: each case's input config, whether
the runtime is made the default, and the result, with the upstream file, Go test and commit it comes from
(github.com/NVIDIA/nvidia-container-toolkit). The configs are the parsed documents (what tomlkit or json
reads from upstream's fixtures), built here from a few runtime shapes; tests/test_toolkit_upstream.py
renders them and replays each case on the agent's writers.

Names are upstream's: each case says which runtimes its Go test adds (`test`, `NAME`, `runtime1`...), and
the replay reads the first as the agent's `nvidia`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

COMMIT = "d34b3046758cb1a5db606b2a39519c731bbf9f56"
CONTAINERD = "pkg/config/engine/containerd/config_test.go"
CONTAINERD_V1 = "pkg/config/engine/containerd/config_v1_test.go"
CRIO = "pkg/config/engine/crio/crio_test.go"
DOCKER = "pkg/config/engine/docker/docker_test.go"

TOML_RUNTIME = {"test": "/usr/bin/test"}  # what the containerd and CRI-O tests add, by name and binary


@dataclass(frozen=True)
class Case:
    source: str  # the file in nvidia-container-toolkit
    test: str  # the Go test function whose table holds the case
    description: str  # the case's name there (`test case N` where the table has none: Go's t.Run name)
    config: dict[str, Any]  # the config before: containerd's or CRI-O's TOML, or daemon.json
    set_as_default: bool
    expected: dict[str, Any]  # the config after (for CRI-O: the drop-in nvidia-ctk writes)
    added: dict[str, str] = field(default_factory=lambda: dict(TOML_RUNTIME))  # runtimes added: name -> binary
    commit: str = COMMIT


# --- containerd ----------------------------------------------------------------------------------------

CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
RUNC_V2 = "io.containerd.runc.v2"


def containerd_runtime(binary: str, runtime_type: str = RUNC_V2, engine: str = "", root: str = "",
                       privileged: bool = False, **options: Any) -> dict[str, Any]:
    """One entry under `runtimes`, with every key nvidia-ctk's fixtures spell out."""
    return {"privileged_without_host_devices": privileged, "runtime_engine": engine, "runtime_root": root,
            "runtime_type": runtime_type, "options": {"BinaryName": binary, **options}}


def containerd_config(version: int, runtimes: dict[str, Any], default: Optional[str] = None, *,
                      version_key: bool = True) -> dict[str, Any]:
    """A whole config.toml of that version: the CRI plugin's runtimes and default runtime, and the
    `version` key unless `version_key` is off."""
    table: dict[str, Any] = {"runtimes": runtimes}
    if default is not None:
        table["default_runtime_name"] = default
    document: dict[str, Any] = {"version": version} if version_key else {}
    document["plugins"] = {CRI_PLUGIN[version]: {"containerd": table}}
    return document


# Two sets of settings an admin's runtime may carry, each value distinct, so that the result shows which
# runtime the new one copied them from.
SETTINGS: dict[str, Any] = {"runtime_type": "type", "engine": "engine", "root": "root", "privileged": True,
                            "SystemdCgroup": True}
DEFAULT_SETTINGS: dict[str, Any] = {"runtime_type": "defaulttype", "engine": "defaultengine",
                                    "root": "defaultroot", "privileged": False, "SystemdCgroup": False}
RUNC = containerd_runtime("/usr/bin/runc", **SETTINGS)
DEFAULT = containerd_runtime("/usr/bin/default", **DEFAULT_SETTINGS)
DEFAULT_AS_RUNC = containerd_runtime("/usr/bin/default", **SETTINGS)  # a default runtime with runc's settings
TEST = containerd_runtime("/usr/bin/test")


def _table(source: str, test: str, rows: list[tuple[str, dict[str, Any], bool, dict[str, Any]]]) -> list[Case]:
    """Cases from rows of (description, config, set_as_default, expected), each adding TOML_RUNTIME."""
    return [Case(source, test, description, config, set_as_default, expected)
            for description, config, set_as_default, expected in rows]


def _containerd_v2_v3() -> list[Case]:
    v2, v3 = 2, 3
    runc_and_test = {"runc": RUNC, "test": containerd_runtime("/usr/bin/test", **SETTINGS)}
    default_and_test = {"default": DEFAULT_AS_RUNC, "test": containerd_runtime("/usr/bin/test", **SETTINGS)}
    empty_type_runc = containerd_runtime("/usr/bin/runc", "", SystemdCgroup=True)
    return _table(CONTAINERD, "TestAddRuntime", [
        ("empty config not default runtime", {}, False, containerd_config(v2, {"test": TEST})),
        ("empty config, set as default runtime", {}, True, containerd_config(v2, {"test": TEST}, "test")),
        ("empty runtime_type copied from runc options is replaced with default",
         containerd_config(v2, {"runc": empty_type_runc}), False,
         containerd_config(v2, {"runc": empty_type_runc,
                                "test": containerd_runtime("/usr/bin/test", SystemdCgroup=True)})),
        ("options from runc are imported", containerd_config(v2, {"runc": RUNC}), False,
         containerd_config(v2, runc_and_test)),
        ("options from default runtime are imported",
         containerd_config(v2, {"default": DEFAULT_AS_RUNC}, "default"), False,
         containerd_config(v2, default_and_test, "default")),
        ("options from the default runtime take precedence over runc",
         containerd_config(v2, {"default": DEFAULT, "runc": RUNC}, "default"), False,
         containerd_config(v2, {"default": DEFAULT, "runc": RUNC,
                                "test": containerd_runtime("/usr/bin/test", **DEFAULT_SETTINGS)}, "default")),
        ("empty v3 spec is supported", {"version": v3}, False, containerd_config(v3, {"test": TEST})),
        ("v3 spec is supported", containerd_config(v3, {"runc": RUNC}), False, containerd_config(v3, runc_and_test)),
        ("runtime already exists in config, default runtime", containerd_config(v2, {"test": TEST}, "test"), True,
         containerd_config(v2, {"test": TEST}, "test")),
        ("runtime already exists in config, not default runtime", containerd_config(v2, {"test": TEST}, "test"),
         False, containerd_config(v2, {"test": TEST})),
    ])


def _containerd_v1() -> list[Case]:
    """Version 1 (the fixture asks for the legacy format): the input files carry no `version` key, and the
    new runtime's options name the binary twice, as `BinaryName` and `Runtime`."""
    def test_runtime(**settings: Any) -> dict[str, Any]:
        return containerd_runtime("/usr/bin/test", Runtime="/usr/bin/test", **settings)

    return _table(CONTAINERD_V1, "TestAddRuntimeV1", [
        ("empty config not default runtime", {}, False,
         containerd_config(1, {"test": test_runtime(runtime_type="")})),
        ("options from runc are imported", containerd_config(1, {"runc": RUNC}, version_key=False), False,
         containerd_config(1, {"runc": RUNC, "test": test_runtime(**SETTINGS)})),
        ("options from default runtime are imported",
         containerd_config(1, {"default": DEFAULT_AS_RUNC}, "default", version_key=False), False,
         containerd_config(1, {"default": DEFAULT_AS_RUNC, "test": test_runtime(**SETTINGS)}, "default")),
        ("options from the default runtime take precedence over runc",
         containerd_config(1, {"default": DEFAULT, "runc": RUNC}, "default", version_key=False), False,
         containerd_config(1, {"default": DEFAULT, "runc": RUNC, "test": test_runtime(**DEFAULT_SETTINGS)},
                           "default")),
    ])


# --- CRI-O ---------------------------------------------------------------------------------------------

def crio_config(runtimes: dict[str, Any], default: Optional[str] = None) -> dict[str, Any]:
    section: dict[str, Any] = {"runtimes": runtimes}
    if default is not None:
        section["default_runtime"] = default
    return {"crio": {"runtime": section}}


def crio_runtime(path: str, runtime_type: str, **options: Any) -> dict[str, Any]:
    return {"runtime_path": path, "runtime_type": runtime_type, **options}


def _crio() -> list[Case]:
    test = crio_runtime("/usr/bin/test", "oci")
    runc = crio_runtime("/usr/bin/runc", "runcoci", runc_option="option")
    default = crio_runtime("/usr/bin/default", "defaultoci", default_option="option")
    test_from_default = crio_runtime("/usr/bin/test", "oci", default_option="option")
    return _table(CRIO, "TestAddRuntime", [
        ("empty config not default runtime", {}, False, crio_config({"test": test})),
        ("empty config, set as default runtime", {}, True, crio_config({"test": test}, "test")),
        ("options from runc are imported", crio_config({"runc": runc}), False,
         crio_config({"test": crio_runtime("/usr/bin/test", "oci", runc_option="option")})),
        ("options from default runtime are imported", crio_config({"default": default}, "default"), False,
         crio_config({"test": test_from_default})),
        ("options from the default runtime take precedence over runc",
         crio_config({"default": default, "runc": runc}, "default"), False, crio_config({"test": test_from_default})),
        ("runtime already exists in config, default runtime", crio_config({"test": test}, "test"), True,
         crio_config({"test": test}, "test")),
        ("runtime already exists in config, not default runtime", crio_config({"test": test}, "test"), False,
         crio_config({"test": test})),
    ])


# --- Docker (daemon.json) ------------------------------------------------------------------------------

def _docker_default_runtime() -> list[Case]:
    """Only `default-runtime` is compared upstream; absent from `expected` where it must be unset. The
    runtime is added with an empty path (and, in the first case, an empty name)."""
    already_set = {"default-runtime": "ALREADY_SET"}
    rows: list[tuple[dict[str, Any], str, bool, dict[str, Any]]] = [
        ({}, "", False, {}), ({}, "NAME", True, {"default-runtime": "NAME"}),
        (already_set, "NAME", False, already_set), (already_set, "NAME", True, {"default-runtime": "NAME"})]
    return [Case(DOCKER, "TestUpdateConfigDefaultRuntime", f"test case {index}", config, set_as_default,
                 expected, added={name: ""})
            for index, (config, name, set_as_default, expected) in enumerate(rows)]


def _docker_runtimes() -> list[Case]:
    """Runtimes added without making them the default; the whole daemon.json compared. Upstream's fifth case
    adds no runtime at all and is left out: the agent always adds its own, so there is nothing to replay."""
    def runtime(path: str) -> dict[str, Any]:
        return {"path": path, "args": []}

    both = {"runtime1": "/test/runtime/dir/runtime1", "runtime2": "/test/runtime/dir/runtime2"}
    one = {"runtime1": both["runtime1"]}
    options: dict[str, Any] = {"exec-opts": ["native.cgroupdriver=systemd"], "log-driver": "json-file",
                               "log-opts": {"max-size": "100m"}, "storage-driver": "overlay2"}
    added_runtimes = {name: runtime(path) for name, path in both.items()}
    rows: list[tuple[dict[str, Any], dict[str, str], dict[str, Any]]] = [
        ({}, both, {"runtimes": added_runtimes}),
        ({"runtimes": {"runtime1": runtime("runtime1")}}, both, {"runtimes": added_runtimes}),
        ({"runtimes": {"not-nvidia": runtime("some-other-path")}}, one,
         {"runtimes": {"not-nvidia": runtime("some-other-path"), "runtime1": runtime(one["runtime1"])}}),
        (options, one, {**options, "runtimes": {"runtime1": runtime(one["runtime1"])}}),
    ]
    return [Case(DOCKER, "TestUpdateConfigRuntimes", f"test case {index}", config, False, expected, added=added)
            for index, (config, added, expected) in enumerate(rows)]


CASES: list[Case] = [*_containerd_v2_v3(), *_containerd_v1(), *_crio(), *_docker_default_runtime(),
                     *_docker_runtimes()]


def cases(source: str, test: str) -> list[Case]:
    return [case for case in CASES if (case.source, case.test) == (source, test)]
