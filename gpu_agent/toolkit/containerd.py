"""containerd: an `nvidia` runtime in a drop-in, imported by the root config, every other byte kept.

containerd 1.x (config versions 1 and 2) merges an imported file by replacing each plugin's whole
table, and a runtimes map replaces the built-in one (runc included), so a drop-in that only added
runtimes.nvidia would silently drop the CRI plugin's mirrors, sandbox image and runc. The drop-in
therefore carries the CRI plugin table as the files before it define it, plus the default runtime
and the nvidia runtime; it is regenerated whenever those change. containerd 2.x (version 3) merges
imported files key by key; the same drop-in is right there too.
"""
from __future__ import annotations

import copy
import glob
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import tomlkit

from gpu_agent.errors import StageError
from gpu_agent.host import proc
from gpu_agent.host.files import read_text
from gpu_agent.host.paths import Root
from gpu_agent.toolkit.tomldoc import deep_merge, parse

ROOT_CONFIG = "/etc/containerd/config.toml"
DROP_IN_DIR = "/etc/containerd/conf.d"
DROP_IN = f"{DROP_IN_DIR}/99-nvidia.toml"
IMPORT_GLOB = f"{DROP_IN_DIR}/*.toml"
RUNTIME_NAME = "nvidia"
CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
HEADER = "# Written by gpu-agent: the nvidia runtime, with the CRI settings it inherits. Do not edit.\n"


@dataclass(frozen=True)
class ContainerdFiles:
    root_current: Optional[str]
    root_desired: Optional[str]  # None: the root file does not exist and is not ours to create
    drop_in_current: Optional[str]
    drop_in_desired: str
    version: int


def config_version(document: dict[str, Any], name: str) -> int:
    version = document.get("version", 1)
    if version not in CRI_PLUGIN:
        raise StageError(f"{name}: version = {version!r} is not a containerd config version this agent knows (1, 2, 3)")
    return int(version)


def plan(root: Root, binary: str, enable_cdi: bool, set_as_default: bool) -> ContainerdFiles:
    root_text = read_text(root(ROOT_CONFIG))
    document = parse(root_text, ROOT_CONFIG) if root_text is not None else {"version": 2}
    version = config_version(document, ROOT_CONFIG)
    _refuse_dormant_files(root, document)
    root_desired = with_import(root_text) if root_text is not None else _minimal_root(version)
    # The imports as they will be once the root file is written: conf.d files count from the start.
    cri = _effective_cri(root, {**document, "imports": parse(root_desired, ROOT_CONFIG).get("imports", [])}, version)
    drop_in = _drop_in(cri, version, binary, enable_cdi, set_as_default)
    return ContainerdFiles(
        root_current=root_text,
        root_desired=root_desired,
        drop_in_current=read_text(root(DROP_IN)),
        drop_in_desired=drop_in,
        version=version,
    )


def _refuse_dormant_files(root: Root, document: dict[str, Any]) -> None:
    """Files in conf.d that containerd does not import yet would take effect with our import line."""
    if IMPORT_GLOB in document.get("imports", []):
        return
    imported = set(_imported(root, document))
    directory = root(DROP_IN_DIR)
    dormant = [f"{DROP_IN_DIR}/{p.name}" for p in sorted(directory.glob("*.toml")) if directory.is_dir()
               and p.name != Path(DROP_IN).name and f"{DROP_IN_DIR}/{p.name}" not in imported]
    if dormant:
        raise StageError(f"{ROOT_CONFIG} does not import {IMPORT_GLOB} yet, and adding it would also switch on "
                         f"{', '.join(dormant)}: import the glob yourself or move those files; nothing was changed")


def _effective_cri(root: Root, document: dict[str, Any], version: int) -> dict[str, Any]:
    """The CRI plugin table as containerd would see it without our drop-in, the files in import
    order (the root file first): with containerd 1.x the last file that defines the plugin wins
    whole; with 2.x (version 3) each file's keys are merged in."""
    plugin = CRI_PLUGIN[version]
    cri = copy.deepcopy(document.get("plugins", {}).get(plugin, {}))
    for path in _imported(root, document):
        if path == DROP_IN:
            continue
        imported = parse(read_text(root(path)) or "", path).get("plugins", {})
        if plugin in imported:
            if version >= 3:
                deep_merge(cri, imported[plugin])
            else:
                cri = copy.deepcopy(imported[plugin])
    return cri


def hidden_by(root: Root, version: int) -> list[str]:
    """conf.d files that sort after ours and define the CRI plugin: with containerd 1.x they replace
    the table our drop-in writes, nvidia runtime included."""
    directory = root(DROP_IN_DIR)
    ours = Path(DROP_IN).name
    return [f"{DROP_IN_DIR}/{p.name}" for p in sorted(directory.glob("*.toml")) if directory.is_dir()
            and p.name > ours and CRI_PLUGIN[version] in parse(p.read_text(), f"{DROP_IN_DIR}/{p.name}").get("plugins", {})]


def _imported(root: Root, document: dict[str, Any]) -> list[str]:
    """Host paths of the imported files, globs expanded as containerd does (sorted)."""
    paths: list[str] = []
    for pattern in document.get("imports", []):
        host_pattern = pattern if pattern.startswith("/") else f"/etc/containerd/{pattern}"
        matches = sorted(glob.glob(str(root(host_pattern))))
        prefix = str(root("/")).rstrip("/")
        paths += [match[len(prefix):] if prefix else match for match in matches]
    return paths


def _drop_in(cri: dict[str, Any], version: int, binary: str, enable_cdi: bool, set_as_default: bool) -> str:
    containerd = cri.setdefault("containerd", {})
    runtimes = containerd.setdefault("runtimes", {})
    default_name = containerd.get("default_runtime_name", "runc")
    # Our runtimes map replaces containerd's built-in one: keep the default runtime in it.
    runtimes.setdefault(default_name, {"runtime_type": "io.containerd.runc.v2"})
    base = copy.deepcopy(runtimes.get(default_name) or runtimes.get("runc") or {})
    base["runtime_type"] = "io.containerd.runc.v2"
    base.setdefault("options", {})["BinaryName"] = binary
    runtimes[RUNTIME_NAME] = base
    if enable_cdi:
        cri["enable_cdi"] = True
    if set_as_default:
        containerd["default_runtime_name"] = RUNTIME_NAME
    document: dict[str, Any] = {} if version == 1 else {"version": version}
    document["plugins"] = {CRI_PLUGIN[version]: cri}
    return HEADER + tomlkit.dumps(document)


def with_import(text: str) -> str:
    """The root config with the conf.d glob in `imports`; every other byte as it was."""
    document = tomlkit.parse(text)
    imports = document.get("imports")
    if imports is not None:
        if IMPORT_GLOB in imports:
            return text
        imports.append(IMPORT_GLOB)
        return tomlkit.dumps(document)
    line = f'imports = ["{IMPORT_GLOB}"]  # added by gpu-agent\n'
    match = re.search(r"^version\s*=.*\n", text, flags=re.MULTILINE)
    if match and _top_level(text, match.start()):
        return text[: match.end()] + line + text[match.end():]
    return line + text  # a top-level key is valid before everything


def _top_level(text: str, offset: int) -> bool:
    return not re.search(r"^\s*\[", text[:offset], flags=re.MULTILINE)


def _minimal_root(version: int) -> str:
    prefix = "" if version == 1 else f"version = {version}\n"
    return prefix + f'imports = ["{IMPORT_GLOB}"]  # added by gpu-agent\n'


def validate(root: Root, files: ContainerdFiles, binary: str, timeout: float = 30.0) -> Optional[str]:
    """Ask the installed containerd what it makes of the desired files (`config dump`): None when the
    nvidia runtime is there with its BinaryName and the default runtime's options, else the problem.
    Raises Skipped when no containerd able to read this config version is installed."""
    containerd = shutil.which("containerd")
    if containerd is None:
        raise Skipped("containerd is not installed here")
    readable = _max_config_version(containerd, timeout)
    if files.version > readable:
        raise Skipped(f"the installed containerd reads config versions up to {readable}, this file is {files.version}")
    with tempfile.TemporaryDirectory(prefix="gpu-agent-containerd.") as scratch:
        conf_d = Path(scratch) / "conf.d"
        conf_d.mkdir()
        existing = root(DROP_IN_DIR)
        for other in sorted(existing.glob("*.toml")) if existing.is_dir() else ():
            if other.name != Path(DROP_IN).name:
                shutil.copy(other, conf_d / other.name)
        (conf_d / Path(DROP_IN).name).write_text(files.drop_in_desired)
        document = tomlkit.parse(files.root_desired or "")
        document["imports"] = [str(conf_d / "*.toml") if p == IMPORT_GLOB else str(root(p)) if p.startswith("/") else p
                               for p in document.get("imports", [])]
        config = Path(scratch) / "config.toml"
        config.write_text(tomlkit.dumps(document))
        done = proc.run([containerd, "--config", str(config), "config", "dump"], timeout=timeout)
        output = done.output.replace(str(conf_d), DROP_IN_DIR).replace(str(config), ROOT_CONFIG)
    if done.returncode != 0:
        return f"containerd rejects the result: {output}"
    effective = tomlkit.parse(done.stdout).unwrap()
    cri = effective.get("plugins", {}).get(CRI_PLUGIN[max(files.version, 2)], {})
    runtimes = cri.get("containerd", {}).get("runtimes", {})
    nvidia = runtimes.get(RUNTIME_NAME, {})
    if nvidia.get("options", {}).get("BinaryName") != binary:
        return f"containerd's effective config has no {RUNTIME_NAME} runtime running {binary}"
    default = runtimes.get(cri.get("containerd", {}).get("default_runtime_name", "runc"), {})
    wanted = default.get("options", {}).get("SystemdCgroup")
    if wanted is not None and nvidia["options"].get("SystemdCgroup") != wanted:
        return f"the {RUNTIME_NAME} runtime's SystemdCgroup differs from the default runtime's ({wanted})"
    return None


class Skipped(Exception):
    """Validation could not run here; the reason says why."""


def _max_config_version(containerd: str, timeout: float) -> int:
    done = proc.run([containerd, "--version"], timeout=timeout)
    match = re.search(r"\s v?(\d+)\.(\d+)", " " + done.stdout)
    major = int(match.group(1)) if match else 1
    return 3 if major >= 2 else 2
