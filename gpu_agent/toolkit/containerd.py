"""containerd: an `nvidia` runtime in a drop-in, imported by the root config, every other byte kept.

containerd 1.x (config versions 1 and 2) merges an imported file by replacing each plugin's whole
table, and a runtimes map replaces the built-in one (runc included), so a drop-in that only added
runtimes.nvidia would silently drop the CRI plugin's mirrors, sandbox image and runc. The drop-in
therefore carries the CRI plugin table as the files before it define it, plus the default runtime
and the nvidia runtime; it is regenerated whenever those change. containerd 2.x (versions 3 and 4)
merges imported files key by key; the same drop-in is right there too. Version 4 (containerd 2.3 and
later) moved server-level settings into plugin tables and left the CRI's where version 3 has them.

The files are found as containerd finds them: `imports` of every loaded file, breadth first, each
file once; a relative path is read against the directory of the file that names it; a path with
`*` is a Go glob (dot files match). containerd 1.x reads a *relative* glob against its working
directory instead (fixed in 2.0), so such an import is refused when containerd 1.x is installed.
"""
from __future__ import annotations

import copy
import posixpath
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpu_agent.errors import StageError
from gpu_agent.host import proc
from gpu_agent.host.paths import Root
from gpu_agent.numbers import version_numbers
from gpu_agent.toolkit import configfile
from gpu_agent.printable import printable
from gpu_agent.toolkit.document import (
    BOOLEAN,
    INTEGER,
    STRING,
    STRINGS,
    TABLE,
    Document,
)
from gpu_agent.toolkit.tomldoc import deep_merge, load, parse, without_bom
from gpu_agent.toolkit.versions import VERSION_OUTPUT_BYTES, from_output

ROOT_CONFIG = "/etc/containerd/config.toml"
DROP_IN_DIR = "/etc/containerd/conf.d"
DROP_IN = f"{DROP_IN_DIR}/99-nvidia.toml"
IMPORT_GLOB = f"{DROP_IN_DIR}/*.toml"
RUNTIME_NAME = "nvidia"
RUNC_V2 = "io.containerd.runc.v2"  # the runtime_type nvidia-ctk fills in where the copied one is empty
CRI_PLUGIN = {1: "cri", 2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime",
              4: "io.containerd.cri.v1.runtime"}
# The newest config version each containerd release line reads: 1.x version 2, 2.0 to 2.2 version 3,
# 2.3 and later version 4 (containerd v2.4.2's own default is version 4, tests/e2e/cluster).
READABLE_FROM = ((2, 3, 4), (2, 0, 3), (0, 0, 2))
HEADER = "# Written by gpu-agent: the nvidia runtime, with the CRI settings it inherits. Do not edit.\n"
MAX_FILES = 256  # files one containerd config may import, all levels together
_UNCHANGED = "nothing was changed"

# What every containerd config file must hold where the agent reads or writes.
FILE_SCHEMA = ((("version",), INTEGER), (("imports",), STRINGS), (("plugins",), TABLE))
CRI_SCHEMA = (
    (("containerd",), TABLE),
    (("containerd", "default_runtime_name"), STRING),
    (("containerd", "runtimes"), TABLE),
    (("containerd", "runtimes", "*"), TABLE),
    (("containerd", "runtimes", "*", "runtime_type"), STRING),
    (("containerd", "runtimes", "*", "options"), TABLE),
    (("enable_cdi",), BOOLEAN),
)


@dataclass(frozen=True)
class ContainerdFiles:
    root_current: Optional[str]
    root_desired: Optional[str]  # None: the root file does not exist and is not ours to create
    drop_in_current: Optional[str]
    drop_in_desired: str
    version: int
    root_target: str = ROOT_CONFIG  # where the root config really is (a link is written through)
    drop_in_target: str = DROP_IN
    root_mode: Optional[int] = None
    imported: tuple[tuple[str, str], ...] = ()  # (path, text) of every other file containerd will load
    hiding: tuple[str, ...] = ()  # files loaded after the drop-in that replace its CRI table (1.x)


def config_version(document: Document) -> int:
    version = document.get(("version",), INTEGER)
    if version is None:
        return 1
    if version not in CRI_PLUGIN:
        raise document.error(("version",), "not a containerd config version this agent knows (1, 2, 3, 4)")
    return int(version)


def plan(root: Root, binary: str, enable_cdi: bool, set_as_default: bool) -> ContainerdFiles:
    root_file = configfile.read(root, ROOT_CONFIG)
    if root_file.text is not None:
        document = load(root_file.text, root_file.shown)
        document.check(FILE_SCHEMA)
    else:
        document = Document({"version": 2}, ROOT_CONFIG)
    version = config_version(document)
    _check_cri(document, version)
    files = _Imports(root, version)
    before = files.load(document)
    # Any import that leads to the drop-in will do (`conf.d/*`, a relative path, a file imported by an
    # imported file): the root file is then left as it is, every import in it kept.
    imported = DROP_IN in before
    if root_file.text is None:
        root_desired = _minimal_root(version)
    else:
        root_desired = root_file.text if imported else with_import(root_file.text, "imports" in document.data)
    imports = document.strings("imports") + ([] if imported else [IMPORT_GLOB])
    after = files.load(Document({**document.data, "imports": imports}, root_file.shown))
    dormant = [path for path in after if path not in before and path != DROP_IN]
    if dormant:
        raise StageError(f"{ROOT_CONFIG} does not import {IMPORT_GLOB} yet, and adding it would also switch on "
                         f"{', '.join(map(printable, dormant))}: import the glob yourself or move those files; "
                         f"{_UNCHANGED}")
    drop_in = configfile.read(root, DROP_IN)
    order = list(after)
    plugin = CRI_PLUGIN[version]
    later = order[order.index(DROP_IN) + 1:] if DROP_IN in after else []
    desired = _drop_in(_effective_cri(document, after, version), version, binary, enable_cdi, set_as_default)
    if drop_in.text is not None and drop_in.text != desired and _sufficient(document, after, version, drop_in.text,
                                                                              drop_in.shown, desired):
        desired = drop_in.text  # another writer's (nvidia-ctk's) drop-in already gives what ours would: left as it is
    return ContainerdFiles(
        root_current=root_file.text,
        root_desired=root_desired,
        drop_in_current=drop_in.text,
        drop_in_desired=desired,
        version=version,
        root_target=root_file.target,
        drop_in_target=drop_in.target,
        root_mode=root_file.mode,
        imported=tuple((path, after[path].text) for path in order if path != DROP_IN),
        hiding=tuple(path for path in later if plugin in after[path].document.table("plugins")),
    )


def _check_cri(document: Document, version: int) -> None:
    """Every key of the CRI plugin the agent reads has the type containerd gives it."""
    plugin = ("plugins", CRI_PLUGIN[version])
    document.check(((plugin, TABLE),))
    document.check(CRI_SCHEMA, prefix=plugin)


def _patterns(document: Document, parent: str) -> list[str]:
    """The file's imports as containerd resolves them: absolute, cleaned paths or patterns."""
    return [_clean(item if item.startswith("/") else posixpath.join(posixpath.dirname(parent), item))
            for item in document.strings("imports")]


def _clean(path: str) -> str:
    """Go's filepath.Clean of an absolute path."""
    return "/" + posixpath.normpath(path).lstrip("/")


@dataclass(frozen=True)
class _File:
    text: str
    document: Document


class _Imports:
    """The files containerd loads besides the root config, found as containerd finds them; each
    file is read once however often it is asked for."""

    def __init__(self, root: Root, version: int) -> None:
        self.root = root
        self.version = version
        self.relative_globs: Optional[bool] = None  # whether they mean what they say: asked when first met
        self.cache: dict[str, _File] = {DROP_IN: _File("", Document({}, DROP_IN))}  # ours: rewritten anyway

    def load(self, document: Document) -> dict[str, _File]:
        """The imported files in containerd's order (breadth first, each once), checked."""
        loaded: dict[str, _File] = {}
        pending = [(ROOT_CONFIG, path) for path in self._resolve(ROOT_CONFIG, document)]
        while pending:
            parent, path = pending.pop(0)
            if path in loaded or path == ROOT_CONFIG:
                continue
            if len(loaded) >= MAX_FILES:
                raise StageError(f"{ROOT_CONFIG}: imports more than {MAX_FILES} files; {_UNCHANGED}")
            loaded[path] = self._read(parent, path)
            pending += [(path, child) for child in self._resolve(path, loaded[path].document)]
        return loaded

    def _read(self, parent: str, path: str) -> _File:
        if path not in self.cache:
            imported = configfile.read(self.root, path, f"imported by {printable(parent)}")
            if imported.text is None and DROP_IN.startswith(path + "/"):
                raise StageError(f"{printable(parent)}: imports {printable(path)}, the directory the agent's "
                                 f"{DROP_IN} goes in: containerd would read a directory as a file; {_UNCHANGED}")
            if imported.text is None:
                raise StageError(f"{printable(parent)}: imports {printable(path)}, which does not exist "
                                 "(containerd would not start); "
                                 f"{_UNCHANGED}")
            document = load(imported.text, imported.shown)
            document.check(FILE_SCHEMA)
            declared = document.get(("version",), INTEGER)
            if declared is not None and declared > self.version:
                raise document.error(("version",), f"version {declared} is newer than the root config's "
                                     f"{ROOT_CONFIG} (version {self.version}): containerd 1.x reads no version past "
                                     "2 and 2.0 to 2.2 none past 3, and they refuse to start; write this file in "
                                     f"version {self.version}, or migrate the root config (`containerd config "
                                     "migrate`)")
            _check_cri(document, self.version)
            self.cache[path] = _File(imported.text, document)
        return self.cache[path]

    def _resolve(self, parent: str, document: Document) -> list[str]:
        paths: list[str] = []
        for written, path in zip(document.strings("imports"), _patterns(document, parent)):
            if not written:
                raise document.error(("imports",), "an empty path (containerd would read the directory as a file)")
            if "\0" in written:
                raise document.error(("imports",), "a path cannot hold a NUL character")
            if "*" not in written:
                paths.append(path)
                continue
            if not written.startswith("/") and not self._relative_globs_allowed():
                raise document.error(("imports",), f'the relative pattern "{printable(written)}" is read against '
                                     "containerd's working directory by the installed containerd 1.x (against the "
                                     "file's directory from 2.0): write it as an absolute path, e.g. "
                                     f"{printable(path)}")
            try:
                paths += configfile.glob(self.root, path, assume=(DROP_IN,))
            except configfile.BadPattern:
                raise document.error(("imports",), f'"{printable(written)}" is not a valid glob pattern') from None
        return paths

    def _relative_globs_allowed(self) -> bool:
        """Whether a relative glob is read against its file's directory: not by containerd 1.x."""
        if self.relative_globs is None:
            containerd = shutil.which("containerd")
            self.relative_globs = containerd is None or _release(containerd, 30.0) >= (2, 0)
        return self.relative_globs


def _effective_cri(document: Document, imported: dict[str, _File], version: int,
                   include_drop_in: bool = False) -> dict[str, Any]:
    """The CRI plugin table as containerd would see it without our drop-in, the files in import
    order (the root file first): with containerd 1.x the last file that defines the plugin wins
    whole; with 2.x (version 3) each file's keys are merged in."""
    plugin = CRI_PLUGIN[version]
    cri = copy.deepcopy(document.table("plugins", plugin))
    for path, file in imported.items():
        if (path == DROP_IN and not include_drop_in) or plugin not in file.document.table("plugins"):
            continue
        if version >= 3:
            deep_merge(cri, file.document.table("plugins", plugin))
        else:
            cri = copy.deepcopy(file.document.table("plugins", plugin))
    return cri


def _sufficient(document: Document, loaded: dict[str, _File], version: int, text: str, shown: str,
                desired: str) -> bool:
    """Whether a drop-in someone else wrote at the agent's path (nvidia-ctk runtime configure writes
    /etc/containerd/conf.d/99-nvidia.toml too) makes containerd see everything the agent's would: the CRI
    plugin as merged with it holds every key and value it holds merged with the agent's, and it declares
    no version but the root file's. Then it is recognised and left, so the two writers never take turns."""
    if text.startswith(HEADER):
        return False  # the agent's own, out of date
    try:
        theirs = load(text, shown)
        theirs.check(FILE_SCHEMA)
        _check_cri(theirs, version)
    except StageError:
        return False  # not a file containerd would read as the agent reads it: replaced
    if theirs.get(("version",), INTEGER) not in (None, version) or theirs.strings("imports"):
        return False
    ours = load(desired, DROP_IN)
    with_theirs = _effective_cri(document, {**loaded, DROP_IN: _File(text, theirs)}, version, include_drop_in=True)
    with_ours = _effective_cri(document, {**loaded, DROP_IN: _File(desired, ours)}, version, include_drop_in=True)
    return covers(with_theirs, with_ours)


def covers(have: Any, want: Any) -> bool:
    """Every key of `want` in `have` with the same value, tables compared key by key."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(key in have and covers(have[key], value) for key, value in want.items())
    return bool(have == want)


def _drop_in(cri: dict[str, Any], version: int, binary: str, enable_cdi: bool, set_as_default: bool) -> str:
    import tomlkit

    containerd = cri.setdefault("containerd", {})
    runtimes = containerd.setdefault("runtimes", {})
    default_name = containerd.get("default_runtime_name", "runc")
    base = copy.deepcopy(inherited(runtimes, default_name))
    # Our runtimes map replaces containerd's built-in one: keep the default runtime in it.
    runtimes.setdefault(default_name, {"runtime_type": RUNC_V2})
    if not base.get("runtime_type"):
        base["runtime_type"] = RUNC_V2
    options = base.setdefault("options", {})
    options["BinaryName"] = binary
    if version == 1:
        options["Runtime"] = binary  # the legacy io.containerd.runtime.v1.linux shim's name for it
    runtimes[RUNTIME_NAME] = base
    if enable_cdi:
        cri["enable_cdi"] = True
    if set_as_default:
        containerd["default_runtime_name"] = RUNTIME_NAME
    document: dict[str, Any] = {} if version == 1 else {"version": version}
    document["plugins"] = {CRI_PLUGIN[version]: cri}
    return HEADER + tomlkit.dumps(document)


def inherited(runtimes: dict[str, Any], default_name: str) -> dict[str, Any]:
    """The runtime whose settings the nvidia runtime copies, as nvidia-ctk picks it
    (pkg/config/engine.GetLowLevelRuntimes): the default runtime unless it is an nvidia one, else
    runc, else crun; nothing when none is defined."""
    names = ([] if default_name.startswith("nvidia") else [default_name]) + ["runc", "crun"]
    return next((runtimes[name] for name in names if isinstance(runtimes.get(name), dict)), {})


drop_in = _drop_in  # the drop-in's text, for the distributions that embed containerd (distributions.py)


def with_import(text: str, has_imports: bool) -> str:
    """The root config with the conf.d glob added to `imports`; every other byte as it was."""
    import tomlkit

    text = without_bom(text)
    if has_imports:
        document = tomlkit.parse(text)
        document["imports"].append(IMPORT_GLOB)
        return tomlkit.dumps(document)
    newline = "\r\n" if "\r\n" in text else "\n"  # the file's own line ends
    line = f'imports = ["{IMPORT_GLOB}"]  # added by gpu-agent{newline}'
    match = re.search(r"^version\s*=.*\n", text, flags=re.MULTILINE)
    if match and _top_level(text, match.start()):
        return text[: match.end()] + line + text[match.end():]
    return line + text  # a top-level key is valid before everything


def _top_level(text: str, offset: int) -> bool:
    return not re.search(r"^[ \t]*\[", text[:offset], flags=re.MULTILINE)  # [ \t]: \s would rescan blank lines


def _minimal_root(version: int) -> str:
    prefix = "" if version == 1 else f"version = {version}\n"
    return prefix + f'imports = ["{IMPORT_GLOB}"]  # added by gpu-agent\n'


def validate(root: Root, files: ContainerdFiles, binary: str, timeout: float = 30.0) -> Optional[str]:
    """Ask the installed containerd what it makes of the desired files (`config dump`): None when the
    nvidia runtime is there with its BinaryName and the default runtime's options, else the problem.
    The files are copied to a scratch tree at their host paths, absolute imports pointed into it, so
    containerd finds exactly the files it will find on the host. Raises Skipped when no containerd
    able to read this config version is installed."""
    containerd = shutil.which("containerd")
    if containerd is None:
        raise Skipped("containerd is not installed here")
    release = _release(containerd, timeout)
    readable = next(version for major, minor, version in READABLE_FROM if release >= (major, minor))
    if files.version > readable:
        raise Skipped(f"the installed containerd reads config versions up to {readable}, this file is {files.version}")
    contents = dict(files.imported)
    contents[ROOT_CONFIG] = files.root_desired or ""
    contents[DROP_IN] = files.drop_in_desired
    with tempfile.TemporaryDirectory(prefix="gpu-agent-containerd.") as scratch:
        tree = Path(scratch) / "root"
        for path, text in contents.items():
            copy_path = tree / path.lstrip("/")
            copy_path.parent.mkdir(parents=True, exist_ok=True)
            copy_path.write_text(_imports_under(text, str(tree)))
        config = str(tree / ROOT_CONFIG.lstrip("/"))
        done = proc.run([containerd, "--config", config, "config", "dump"], timeout=timeout)
        said = done.output.replace(str(tree), "")
    if done.returncode != 0:
        return f"containerd rejects the result: {_what_containerd_says(said, list(contents))}"
    dumped = parse(done.stdout, "containerd's effective config")
    effective = Document(dumped, "containerd's effective config")
    # containerd 2.x dumps its own layout (version 3 and later: the CRI's runtime plugin) whatever the
    # version of the files it read, a version 2 file migrated; 1.x dumps version 2 (tests/e2e/cluster).
    dumped_version = dumped.get("version")
    version = dumped_version if isinstance(dumped_version, int) else files.version
    plugin = ("plugins", CRI_PLUGIN[min(max(version, 2), max(CRI_PLUGIN))])
    effective.check(((plugin, TABLE),))
    effective.check(CRI_SCHEMA, prefix=plugin)
    runtimes = effective.table(*plugin, "containerd", "runtimes")
    nvidia = runtimes.get(RUNTIME_NAME, {})
    if nvidia.get("options", {}).get("BinaryName") != binary:
        culprit = (f" ({', '.join(files.hiding)} loads after {DROP_IN} and replaces its CRI table)"
                   if files.hiding else "")
        return f"containerd's effective config has no {RUNTIME_NAME} runtime running {binary}{culprit}"
    default = runtimes.get(effective.string(*plugin, "containerd", "default_runtime_name") or "runc", {})
    # containerd 2.x dumps runc's default options (SystemdCgroup = false) where the file names none, and
    # the nvidia runtime's options as written: an option missing is its default, false.
    wanted = default.get("options", {}).get("SystemdCgroup")
    if wanted is not None and bool(nvidia["options"].get("SystemdCgroup", False)) != bool(wanted):
        return f"the {RUNTIME_NAME} runtime's SystemdCgroup differs from the default runtime's ({wanted})"
    return None


def _imports_under(text: str, tree: str) -> str:
    """The file with its absolute imports moved under `tree`; every other byte as it was."""
    import tomlkit

    if "imports" not in text:
        return text
    document = tomlkit.parse(without_bom(text))
    imports = document.get("imports")
    if not imports:
        return text
    document["imports"] = [tree + item if item.startswith("/") else item for item in imports]
    return tomlkit.dumps(document)


# containerd's messages quote the values they cannot convert: only these words of ours are shown, and
# the file named only where containerd names the right one (its final check names the last file read).
_CONTAINERD_REASONS = (
    ("Can't convert", "a value of the wrong type", False),
    ("cannot decode", "a value of the wrong type", False),
    ("plugin key URI", "a plugin name that is not a URI like io.containerd.grpc.v1.cri", False),
    ("plugin URI", "a plugin name that is not a URI like io.containerd.grpc.v1.cri", False),
    ("no such file", "a file it imports does not exist", True),
    ("permission denied", "a file it cannot read", True),
    ("unsupported config version", "a config version it does not know", False),
)


def _what_containerd_says(output: str, paths: list[str]) -> str:
    reason, names_file = next(((words, named) for marker, words, named in _CONTAINERD_REASONS if marker in output),
                              ("it cannot load the files", False))
    position = re.search(r"\((\d+), (\d+)\)", output)
    where = (f" at line {position.group(1)}, column {position.group(2)} of one of the files as they would be written"
             if position else "")
    named = [path for path in paths if path in output] if names_file else []
    return (f"{reason}{where}" + (f" ({', '.join(named)})" if named else "")
            + f"; `containerd --config {ROOT_CONFIG} config dump` shows what it makes of the files as they are")


class Skipped(Exception):
    """Validation could not run here; the reason says why."""


def _release(containerd: str, timeout: float) -> tuple[int, int]:
    """(major, minor) of `containerd --version`; (1, 0) when it names none."""
    done = proc.run([containerd, "--version"], timeout=timeout, limit=VERSION_OUTPUT_BYTES)
    numbers = version_numbers(from_output(done.stdout), parts=2)
    return (numbers[0], numbers[1]) if numbers and len(numbers) >= 2 else (1, 0)
