"""k3s, RKE2 and microk8s: the containerd each embeds, configured the way its own documentation says.

k3s and RKE2 render /var/lib/rancher/{k3s,rke2}/agent/etc/containerd/config.toml at every start, so that
file is read and never written. It is rendered from config-v3.toml.tmpl (config version 3, containerd
2.x), else config.toml.tmpl (version 2), else the built-in template; a template may extend the built-in
one with `{{ template "base" . }}` (k3s and RKE2 releases since September 2023). Releases with k3s PR
#13680 make the built-in templates import <dir>/config-v3.toml.d/*.toml (version 3) or
<dir>/config.toml.d/*.toml (version 2). The agent writes its drop-in, 99-nvidia.toml, into that
directory; where the rendered config does not import it yet, it adds the import to the template in use
(creating `imports = [...]` + `{{ template "base" . }}` when there is none). Both restart with the
k3s / k3s-agent, rke2-server / rke2-agent unit; their containerd answers on /run/k3s/containerd/.

Both add an `nvidia` runtime themselves when they find nvidia-container-runtime in /usr/bin or
/usr/local/nvidia/toolkit at start. When the rendered config already has the runtime the agent wants,
CDI as asked and the default runtime as asked, nothing is written at all.

microk8s renders $SNAP_DATA/args/containerd.toml from $SNAP_DATA/args/containerd-template.toml (its
`${SNAP_DATA}`-style variables substituted) each time snap.microk8s.daemon-containerd starts, and its
documentation says to edit the template and restart: the agent edits that template in place (the
nvidia runtime appended, enable_cdi and default_runtime_name set), every other byte kept, as the GPU
Operator does on microk8s (CONTAINERD_CONFIG pointed at the template).

Sources: https://docs.k3s.io/advanced#configuring-containerd (templates, base template),
https://docs.k3s.io/advanced#nvidia-container-runtime-support (runtime detection),
https://github.com/k3s-io/k3s/blob/main/pkg/agent/containerd/runtimes.go (where it looks),
https://github.com/k3s-io/k3s/pull/13680 (config-v3.toml.d imports),
https://docs.rke2.io/advanced#configuring-containerd, https://docs.rke2.io/add-ons/gpu_operators
(the /run/k3s/containerd socket on RKE2), https://microk8s.io/docs/configuring-services and
canonical/microk8s microk8s-resources/wrappers/run-containerd-with-args, default-args/containerd and
default-args/kubelet (template rendering, socket, kubelet kubeconfig and --root-dir).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Optional

from gpu_agent.config.kubernetes import KubernetesConfig
from gpu_agent.config.plugin import DEVICE_PLUGIN_DIR, MICROK8S_DEVICE_PLUGIN_DIR
from gpu_agent.errors import AgentError, StageError
from gpu_agent.numbers import version_numbers
from gpu_agent.host.paths import Root
from gpu_agent.printable import printable
from gpu_agent.toolkit import configfile, containerd
from gpu_agent.toolkit.services import ServiceControl
from gpu_agent.toolkit.tomldoc import load, without_bom
from gpu_agent.toolkit.transaction import FileChange

DROP_IN_NAME = "99-nvidia.toml"
ADDED = "# added by gpu-agent"
TEMPLATE_HEADER = ("# Written by gpu-agent: the built-in template, importing the drop-ins where the nvidia runtime "
                   "is. `gpu-agent uninstall` removes it.\n")
BASE = '{{ template "base" . }}'
_UNCHANGED = "nothing was changed"
# Go's text/template: a comment action keeps the line above whole when the template starts by trimming
_KEEP = "{{/* gpu-agent: keeps the line above */}}\n"
# The k3s (and RKE2: the same agent code) releases that have a template feature: the first patch release of
# each minor that has it; every minor from `all_from` on has it, none before the table's first.
# `{{ template "base" . }}`: k3s docs, advanced.md "Base template", Version Gate (k3s-io/docs 40e7e02, PR #213).
BASE_TEMPLATE_SINCE = {(1, 24): 17, (1, 25): 13, (1, 26): 8, (1, 27): 5, (1, 28): 1}
BASE_TEMPLATE_ALL_FROM = (1, 29)
# config-v3.toml.tmpl, read before config.toml.tmpl, with containerd 2.0 (k3s PR #11626); k3s docs,
# advanced.md Version Gate: "containerd 2.0 as of the February 2025 releases: v1.31.6+k3s1 and v1.32.2+k3s1".
V3_TEMPLATE_SINCE = {(1, 31): 6, (1, 32): 2}
V3_TEMPLATE_ALL_FROM = (1, 33)


def has_feature(version: Optional[str], since: dict[tuple[int, int], int], all_from: tuple[int, int]) -> Optional[bool]:
    """Whether the k3s or RKE2 release `version` (`1.32.2+k3s1`) has a feature of the tables above; None
    when the version is unknown."""
    numbers = version_numbers(version)
    if numbers is None:
        return None
    minor = (numbers[0], numbers[1])
    if minor >= all_from:
        return True
    first = since.get(minor)
    return first is not None and (numbers[2] if len(numbers) > 2 else 0) >= first


@dataclass(frozen=True)
class Distribution:
    name: str
    config_dir: str  # where containerd's config and its templates are
    units: tuple[tuple[str, tuple[str, ...]], ...]  # (unit, where its unit file may be), in order of preference
    socket: str
    kubeconfig: str  # the kubelet's own credentials
    device_plugin_dir: str
    rendered: str  # the file whose presence says the distribution's containerd has been set up

    @property
    def templated(self) -> bool:
        """k3s and RKE2: a Go template rendered at each start (microk8s: a TOML file with variables)."""
        return self.name != "microk8s"

    @property
    def reads(self) -> tuple[str, ...]:
        """The files (and patterns) its containerd's config is made from at start."""
        if not self.templated:
            return (self.rendered,)
        return tuple(f"{self.config_dir}/{name}" for name in (
            "config-v3.toml.tmpl", "config.toml.tmpl", "config-v3.toml.d/*.toml", "config.toml.d/*.toml"))


def _rancher(name: str, units: tuple[str, str]) -> Distribution:
    directory = f"/var/lib/rancher/{name}/agent/etc/containerd"
    unit_dirs = ("/etc/systemd/system", "/usr/local/lib/systemd/system", "/usr/lib/systemd/system",
                 "/lib/systemd/system")
    return Distribution(name, directory, tuple((unit, tuple(f"{d}/{unit}" for d in unit_dirs)) for unit in units),
                        "/run/k3s/containerd/containerd.sock", f"/var/lib/rancher/{name}/agent/kubelet.kubeconfig",
                        DEVICE_PLUGIN_DIR, f"{directory}/config.toml")


MICROK8S_ARGS = "/var/snap/microk8s/current/args"
MICROK8S_UNIT = "snap.microk8s.daemon-containerd.service"
DISTRIBUTIONS = {
    "k3s": _rancher("k3s", ("k3s.service", "k3s-agent.service")),
    "rke2": _rancher("rke2", ("rke2-server.service", "rke2-agent.service")),
    "microk8s": Distribution(
        "microk8s", MICROK8S_ARGS,
        ((MICROK8S_UNIT, (f"/etc/systemd/system/{MICROK8S_UNIT}",)),),
        "/var/snap/microk8s/common/run/containerd.sock", "/var/snap/microk8s/current/credentials/kubelet.config",
        MICROK8S_DEVICE_PLUGIN_DIR, f"{MICROK8S_ARGS}/containerd-template.toml"),
}
# Every file the agent may write for them (host.owned.OWNABLE holds the same).
WRITTEN = tuple(path.replace("*.toml", DROP_IN_NAME) for d in DISTRIBUTIONS.values() for path in d.reads)


def kubeconfig(root: Root, configured: str) -> str:
    """The kubelet's credentials: `configured` where it exists or is not the default; else the kubeconfig
    of the first distribution whose kubelet has one here; else `configured`."""
    if configured != KubernetesConfig().kubeconfig or root(configured).exists():
        return configured
    return next((d.kubeconfig for d in DISTRIBUTIONS.values() if root(d.kubeconfig).is_file()), configured)


def unit(root: Root, distribution: Distribution, services: ServiceControl) -> str:
    """The unit that runs the distribution here: the first systemd knows, else the first whose unit file
    is under the root (a sandbox root has no service manager), else the first."""
    for name, _ in distribution.units:
        state = services.state(name)
        if state is not None and state.exists:
            return name
    for name, files in distribution.units:
        if any(root(path).is_file() for path in files):
            return name
    return distribution.units[0][0]


def plan(root: Root, distribution: Distribution, binary: str, enable_cdi: bool,
         set_as_default: bool, release: Optional[str] = None) -> list[FileChange]:
    """The files to write for the distribution's containerd; each change's current == desired where the
    file is the agent's already (kept, so it stays claimed). `release`: the k3s or RKE2 version
    (`1.32.2+k3s1`), which says which templates it reads; None when unknown."""
    if distribution.templated:
        return _rancher_files(root, distribution, binary, enable_cdi, set_as_default, release)
    return [_microk8s_file(root, distribution, binary, enable_cdi, set_as_default)]


# --- k3s and RKE2 ---------------------------------------------------------------------------------

def _rancher_files(root: Root, distribution: Distribution, binary: str, enable_cdi: bool,
                   set_as_default: bool, release: Optional[str]) -> list[FileChange]:
    rendered = configfile.read(root, distribution.rendered)
    if rendered.text is None:
        raise StageError(f"{distribution.rendered}: {distribution.name} has not rendered its containerd config yet "
                         f"(it does at every start): start {distribution.name} once; {_UNCHANGED}")
    document = load(rendered.text, rendered.shown)
    document.check(containerd.FILE_SCHEMA)
    version = containerd.config_version(document)
    if version < 2:
        raise document.error(("version",), f"{distribution.name} renders config version 2 or 3; is this file its own?")
    plugin = ("plugins", containerd.CRI_PLUGIN[version])
    document.check(((plugin, containerd.TABLE),))
    document.check(containerd.CRI_SCHEMA, prefix=plugin)
    cri = document.table(*plugin)
    drop_in = _drop_in(cri, version, binary, enable_cdi, set_as_default)
    if drop_in is None:
        return []  # the distribution's own detection serves: nothing to write, nothing to restart

    template = _template_read(root, distribution, version, release)
    directory = template.path.replace(".tmpl", ".d")
    pattern = f"{directory}/*.toml"
    ours = f"{directory}/{DROP_IN_NAME}"
    changes = []
    template_text = template.text
    if template_text is not None and pattern in template_text:
        changes.append(FileChange(template.target, template_text, template_text, foreign=True))  # kept, claimed
    elif pattern not in document.strings("imports"):
        others = [path for path in configfile.glob(root, pattern) if path != ours]
        if others:
            raise StageError(f"{distribution.name} does not import {pattern} yet, and adding it would also switch on "
                             f"{', '.join(map(printable, others))}: import the pattern yourself or move those files; "
                             f"{_UNCHANGED}")
        if template_text is None and has_feature(release, BASE_TEMPLATE_SINCE, BASE_TEMPLATE_ALL_FROM) is False:
            raise StageError(f"{distribution.name} {release} has no base template to extend (from v1.24.17, v1.25.13, "
                             f"v1.26.8, v1.27.5, v1.28.1): add imports = [\"{printable(pattern)}\"] to a template of "
                             f"your own at {template.shown}, or upgrade {distribution.name}; {_UNCHANGED}")
        desired = _with_import(template_text, template.shown, pattern)
        changes.append(FileChange(template.target, template_text, desired, foreign=template_text is not None))
    current = configfile.read(root, ours)
    changes.append(FileChange(current.target, current.text, drop_in, foreign=False, mode=rendered.mode))
    return changes


def _template_read(root: Root, distribution: Distribution, version: int,
                   release: Optional[str]) -> configfile.ConfigFile:
    """The template the distribution renders its containerd config from: config-v3.toml.tmpl where the
    release reads it and it exists, else config.toml.tmpl where that exists; with neither, the one of the
    rendered config's version (that of the built-in template in use). A release that reads no
    config-v3.toml.tmpl (before containerd 2.0) never gets one; with the release unknown, the rendered
    config's version says whether it does (version 3: containerd 2.0, which reads it)."""
    reads_v3 = has_feature(release, V3_TEMPLATE_SINCE, V3_TEMPLATE_ALL_FROM)
    if reads_v3 is None:
        reads_v3 = version >= 3
    v2 = configfile.read(root, f"{distribution.config_dir}/config.toml.tmpl")
    if not reads_v3:
        return v2
    v3 = configfile.read(root, f"{distribution.config_dir}/config-v3.toml.tmpl")
    return v3 if v3.text is not None else v2 if v2.text is not None else v3 if version >= 3 else v2


def _drop_in(cri: dict[str, Any], version: int, binary: str, enable_cdi: bool, set_as_default: bool) -> Optional[str]:
    """What the drop-in holds, None when the rendered config already is what is asked. Version 3 files are
    merged key by key (containerd 2.x): only what differs. Version 2 files may be read by containerd 1.7,
    whose imports replace the whole CRI table: then it is all there, as containerd.py writes it."""
    import tomlkit

    table = cri.get("containerd", {})
    runtimes = table.get("runtimes", {})
    default = table.get("default_runtime_name", "runc")
    has_runtime = runtimes.get(containerd.RUNTIME_NAME, {}).get("options", {}).get("BinaryName") == binary
    cdi_on = cri.get("enable_cdi", version >= 3)  # on by default from containerd 2.0
    needs_default = set_as_default and default != containerd.RUNTIME_NAME
    if has_runtime and (cdi_on or not enable_cdi) and not needs_default:
        return None
    if version < 3:
        return containerd.drop_in(copy.deepcopy(cri), version, binary, enable_cdi, set_as_default)
    wanted: dict[str, Any] = {}
    if enable_cdi and not cdi_on:
        wanted["enable_cdi"] = True
    if needs_default:
        wanted.setdefault("containerd", {})["default_runtime_name"] = containerd.RUNTIME_NAME
    if not has_runtime:
        runtime = copy.deepcopy(containerd.inherited(runtimes, default))
        runtime["runtime_type"] = runtime.get("runtime_type") or containerd.RUNC_V2
        runtime.setdefault("options", {})["BinaryName"] = binary
        wanted.setdefault("containerd", {}).setdefault("runtimes", {})[containerd.RUNTIME_NAME] = runtime
    plugins = {"plugins": {containerd.CRI_PLUGIN[version]: wanted}}
    return containerd.HEADER + tomlkit.dumps({"version": version, **plugins})


def _with_import(text: Optional[str], name: str, pattern: str) -> str:
    """The template with containerd's imports of `pattern` at its top (a top-level key must come before
    every table); a new one extends the built-in template."""
    line = f'imports = ["{pattern}"]  {ADDED}\n'
    if text is None:
        return TEMPLATE_HEADER + line + BASE + "\n"
    text = without_bom(text)
    check_template(text, name)
    imports = re.search(r"^[ \t]*imports[ \t]*=", text, flags=re.MULTILINE)
    if imports:
        number = text.count("\n", 0, imports.start()) + 1
        raise StageError(f"{name}:{number}: sets imports already: add \"{printable(pattern)}\" to it yourself "
                         f"(the agent's drop-in goes there); {_UNCHANGED}")
    newline = "\r\n" if "\r\n" in text else "\n"
    line = line.replace("\n", newline)
    keep = _KEEP.replace("\n", newline) if re.match(r"\s*\{\{-", text) else ""
    return line + keep + text


def check_template(text: str, name: str) -> None:
    """A Go template whose actions are all closed, and whose TOML after the base template (when nothing
    but TOML follows it) is valid; else an error naming the file and line."""
    import tomlkit

    position = 0
    actions = []
    while True:
        start = text.find("{{", position)
        if start < 0:
            break
        end = text.find("}}", start + 2)
        if end < 0:
            raise StageError(f"{name}:{text.count(chr(10), 0, start) + 1}: a template action opened with {{{{ is "
                             f"never closed with }}}}; {_UNCHANGED}")
        actions.append((start, end + 2))
        position = end + 2
    if not actions:
        return
    start, end = actions[-1]
    if re.fullmatch(r"\{\{-?\s*template\s+\"base\"\s+\.\s*-?\}\}", text[start:end]):
        rest = text[end:]
        first = text.count("\n", 0, end)  # lines before the rest's first
        try:
            tomlkit.parse(rest)
        except tomlkit.exceptions.ParseError as exc:
            raise StageError(f"{name}:{first + exc.line}: not valid TOML after {BASE}; {_UNCHANGED}") from None
        except Exception:
            raise StageError(f"{name}: not valid TOML after {BASE}; {_UNCHANGED}") from None


# --- microk8s -------------------------------------------------------------------------------------

def _microk8s_file(root: Root, distribution: Distribution, binary: str, enable_cdi: bool,
                   set_as_default: bool) -> FileChange:
    template = configfile.read(root, distribution.rendered)
    if template.text is None:
        raise StageError(f"{distribution.rendered}: not there; is microk8s installed? {_UNCHANGED}")
    document = load(template.text, template.shown)
    document.check(containerd.FILE_SCHEMA)
    version = containerd.config_version(document)
    plugin = containerd.CRI_PLUGIN[version]
    document.check(((("plugins", plugin), containerd.TABLE),))
    document.check(containerd.CRI_SCHEMA, prefix=("plugins", plugin))
    cri = document.table("plugins", plugin)
    table = cri.get("containerd", {})
    runtimes = table.get("runtimes", {})
    text = without_bom(template.text)
    newline = "\r\n" if "\r\n" in text else "\n"
    header = f'[plugins."{plugin}".containerd.runtimes.{containerd.RUNTIME_NAME}'
    if containerd.RUNTIME_NAME not in runtimes:
        default = containerd.inherited(runtimes, table.get("default_runtime_name", "runc"))
        runtime = {"runtime_type": default.get("runtime_type") or containerd.RUNC_V2}
        options = {**default.get("options", {}), "BinaryName": binary}
        block = (f"{ADDED}: the nvidia runtime{newline}{header}]{newline}"
                 + _keys(runtime, newline) + f"{header}.options]{newline}" + _keys(options, newline))
        text = text + ("" if text.endswith("\n") or not text else newline) + newline + block
    elif runtimes[containerd.RUNTIME_NAME].get("options", {}).get("BinaryName") != binary:
        text = _set(text, template.shown, ("plugins", plugin, "containerd", "runtimes", containerd.RUNTIME_NAME,
                                          "options"), "BinaryName", binary)
    if enable_cdi and cri.get("enable_cdi") is not True:
        text = _set(text, template.shown, ("plugins", plugin), "enable_cdi", True)
    default_name = table.get("default_runtime_name")
    if set_as_default and default_name != containerd.RUNTIME_NAME:
        text = _set(text, template.shown, ("plugins", plugin, "containerd"), "default_runtime_name",
                    containerd.RUNTIME_NAME)
    elif not set_as_default and default_name == containerd.RUNTIME_NAME:
        text = _set(text, template.shown, ("plugins", plugin, "containerd"), "default_runtime_name", "${RUNTIME}")
    if text != without_bom(template.text):
        load(text, f"{template.shown} as the agent would write it")  # never write what does not parse
    else:
        text = template.text
    return FileChange(template.target, template.text, text, foreign=True)


def _keys(values: dict[str, Any], newline: str) -> str:
    import tomlkit

    return "".join(f"  {key} = {tomlkit.item(value).as_string()}{newline}" for key, value in values.items()
                   if not isinstance(value, dict))


def _set(text: str, name: str, table: tuple[str, ...], key: str, value: Any) -> str:
    """The text with table.key = value: the value replaced where the key is, else a line added under the
    table's header (or where tomlkit puts it when the table has none); every other byte kept."""
    import tomlkit

    document = tomlkit.parse(text)
    node: Any = document
    for part in table:
        node = node.setdefault(part, tomlkit.table())
    if key not in node:
        quoted = r"\.".join(rf"""(?:{re.escape(part)}|"{re.escape(part)}"|'{re.escape(part)}')""" for part in table)
        header = re.search(rf"^[ \t]*\[[ \t]*{quoted}[ \t]*\][ \t]*(?:#[^\n]*)?\r?\n", text, flags=re.MULTILINE)
        if header:
            newline = "\r\n" if header.group(0).endswith("\r\n") else "\n"
            indent = re.match(r"[ \t]*", header.group(0)).group(0) + "  "  # type: ignore[union-attr]
            line = f"{indent}{key} = {tomlkit.item(value).as_string()}  {ADDED}{newline}"
            return text[:header.end()] + line + text[header.end():]
    try:
        node[key] = value
    except (AgentError, ValueError, TypeError):
        raise StageError(f"{name}: cannot set {'.'.join(table)}.{key}; {_UNCHANGED}") from None
    return tomlkit.dumps(document)
