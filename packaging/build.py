"""Build one package per target distribution with nfpm: the agent and its Python dependencies, vendored.

The packages carry the dependencies, so installing needs no network. Some are compiled (pydantic-core,
PyYAML, psutil, multidict) and load only into the Python they were built for, so each package is built
for one distribution's python3 (TARGETS): the wheels of its ABI, at the versions its constraints file
pins, go to /usr/lib/gpu-agent/site-cpXY. /usr/bin/gpu-agent refuses to run on another Python.
"""
from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
TOP = HERE.parent
sys.path.insert(0, str(TOP))

from gpu_agent import __version__  # noqa: E402
from gpu_agent.cli import build_parser  # noqa: E402
from gpu_agent.config.defaults import render_defaults  # noqa: E402

# glibc 2.34 is the oldest of the targets (RHEL 9); every manylinux tag up to it is usable.
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")
LIB = "usr/lib/gpu-agent"
PIP_TIMEOUT = 900
MAINTAINER = "gpu-agent developers <gpu-agent@example.com>"


@dataclass(frozen=True)
class Target:
    name: str
    packager: str  # deb or rpm
    python: str  # the distribution's python3, major.minor
    release: str  # the package's release, with the distribution's tag
    suite: str  # deb: the changelog's distribution
    constraints: Path  # name==version for every distribution the package vendors

    @property
    def site(self) -> str:
        return f"site-cp{self.python.replace('.', '')}"

    @property
    def filename(self) -> str:
        if self.packager == "deb":
            return f"gpu-agent_{__version__}-{self.release}_amd64.deb"
        return f"gpu-agent-{__version__}-{self.release}.x86_64.rpm"


TARGETS = (
    Target("debian12", "deb", "3.11", "1+deb12", "bookworm", TOP / "constraints.txt"),
    Target("debian13", "deb", "3.13", "1+deb13", "trixie", TOP / "constraints.txt"),
    Target("el9", "rpm", "3.9", "1.el9", "", HERE / "constraints-cp39.txt"),
)


def requirements() -> list[str]:
    return [r for r in metadata.requires("gpu-agent") or [] if "extra ==" not in r]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, timeout=PIP_TIMEOUT)


def vendor(target: Target, stage: Path, wheels: Path) -> None:
    """Install the target's pinned dependencies for its ABI into its site directory."""
    local = wheels / "local"
    constraints = ["--constraint", str(target.constraints)]
    # sdnotify is published as an sdist only: build its (pure Python) wheel here.
    pip("wheel", "--no-deps", "--wheel-dir", str(local), *constraints, "sdnotify")
    platform_args = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    site = stage / LIB / target.site
    common = ["--only-binary=:all:", "--python-version", target.python, "--implementation", "cp", *platform_args,
              *constraints]
    downloaded = wheels / target.python
    pip("download", "--dest", str(downloaded), "--find-links", str(local), *common, *requirements())
    pip("install", "--no-index", "--find-links", str(downloaded), "--find-links", str(local), "--target", str(site),
        "--no-compile", *common, *requirements())
    check_pinned(target, site)
    trim(site)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(constraints: Path) -> dict[str, str]:
    found = {}
    for number, line in enumerate(constraints.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise SystemExit(f"{constraints}:{number}: not name==version: {line!r}")
        found[_normalized(name.strip())] = version.strip()
    return found


def check_pinned(target: Target, site: Path) -> None:
    """Every distribution vendored at the version its constraints file pins: the same set every build."""
    pinned = pins(target.constraints)
    unpinned = []
    for info in sorted(site.glob("*.dist-info")):
        dist = metadata.PathDistribution(info)
        name, version = dist.metadata["Name"], dist.version
        if pinned.get(_normalized(name)) != version:
            unpinned.append(f"{name} {version}")
    if unpinned:
        raise SystemExit(f"{target.name}: {target.constraints} does not pin {', '.join(unpinned)}; "
                         "pin each as name==version")


def trim(site: Path) -> None:
    """Drop what the agent never runs and strip what it does."""
    # Console scripts, nvidia-ml-py's example, and PyYAML's libyaml binding: the pure-Python
    # parser reads our small config just as well, and a private libyaml copy is one more to patch.
    for extra in [site / "bin", site / "example.py", *site.glob("yaml/_yaml*.so")]:
        shutil.rmtree(extra) if extra.is_dir() else extra.unlink(missing_ok=True)
    # pip's install records: RECORD's hashes are stale once the libraries are stripped, and dpkg or rpm
    # owns these files, not pip.
    for record in ("INSTALLER", "RECORD", "REQUESTED", "direct_url.json"):
        for path in site.glob(f"*.dist-info/{record}"):
            path.unlink()
    for library in site.rglob("*.so"):
        subprocess.run(["strip", "--strip-unneeded", "--remove-section=.comment", str(library)], check=True, timeout=60)
    link_duplicates(site)


def link_duplicates(site: Path) -> None:
    """A file byte-identical to one before it (two projects' LICENSE, WHEEL) becomes a relative link to it."""
    first: dict[bytes, Path] = {}
    for path in sorted(p for p in site.rglob("*") if p.is_file() and not p.is_symlink()):
        original = first.setdefault(path.read_bytes(), path)
        if original != path:
            path.unlink()
            path.symlink_to(os.path.relpath(original, path.parent))


def last_commit(fmt: str, fallback: str) -> str:
    return subprocess.run(["git", "-C", str(TOP), "log", "-1", f"--format={fmt}"], capture_output=True, text=True,
                          timeout=30).stdout.strip() or fallback


def debian_changelog(target: Target, path: Path) -> None:
    """changelog.Debian.gz, reproducible: dated by the last commit, gzip without a timestamp."""
    date = last_commit("%aD", "Thu, 01 Jan 2026 00:00:00 +0000")
    text = (f"gpu-agent ({__version__}-{target.release}) {target.suite}; urgency=medium\n\n"
            f"  * Release {__version__} for Python {target.python}; see /usr/share/doc/gpu-agent/README.md.\n\n"
            f" -- {MAINTAINER}  {date}\n")
    gzipped(path, text.encode())


def rpm_changelog(target: Target, path: Path) -> None:
    """nfpm's changelog (chglog's YAML), rpm's %changelog."""
    date = last_commit("%aI", "2026-01-01T00:00:00+00:00")
    entry = {"semver": f"{__version__}-{target.release}", "date": date, "packager": MAINTAINER,
             "changes": [{"note": f"Release {__version__} for Python {target.python}"}]}
    path.write_text(yaml.safe_dump([entry], sort_keys=False))


def _roff(text: str) -> str:
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text[:1] in (".", "'") else text


def man_page() -> str:
    """gpu-agent(1) from the CLI's own parser: its commands and global options, as `gpu-agent --help` has them."""
    parser = build_parser()
    commands, options = [], []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands = [(choice.dest, choice.help or "") for choice in action._choices_actions]
        elif action.option_strings:
            flags = ", ".join(action.option_strings) + (f" {action.metavar}" if action.metavar else "")
            options.append((flags, action.help or ""))
    lines = [f'.TH GPU-AGENT 1 "" "gpu-agent {__version__}" "User Commands"', ".SH NAME",
             "gpu\\-agent \\- " + _roff(parser.description or "").rstrip("."),
             ".SH SYNOPSIS", ".B gpu\\-agent", "[\\fIOPTIONS\\fR] \\fICOMMAND\\fR [\\fIARGS\\fR]",
             ".SH DESCRIPTION",
             _roff("A node-local daemon run by systemd (gpu-agent.service) and its command line. "
                   "`gpu-agent COMMAND --help` lists each command's options; /usr/share/doc/gpu-agent/README.md "
                   "describes the agent."),
             ".SH COMMANDS"]
    for name, text in commands:
        lines += [".TP", f".B {_roff(name)}", _roff(text)]
    lines.append(".SH OPTIONS")
    for flags, text in options:
        lines += [".TP", f".B {_roff(flags)}", _roff(text.replace("%(prog)s", "gpu-agent"))]
    lines += [".SH EXIT STATUS", _roff(parser.epilog or ""), ".SH FILES", ".TP", ".I /etc/gpu\\-agent/config.yaml",
              "the configuration, every default written as a comment", ".SH SEE ALSO",
              ".BR systemctl (1),", ".BR journalctl (1)"]
    return "\n".join(lines) + "\n"


def gzipped(path: Path, data: bytes) -> None:
    """Reproducible: no timestamp, no name in the header, maximum compression (as lintian asks)."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="", compresslevel=9) as out:
        out.write(data)


def stage_files(target: Target, stage: Path) -> None:
    shutil.copytree(TOP / "gpu_agent", stage / LIB / "gpu_agent",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    etc = stage / "etc/gpu-agent"
    etc.mkdir(parents=True)
    (etc / "config.yaml").write_text(render_defaults())
    gzipped(stage / "gpu-agent.1.gz", man_page().encode())
    if target.packager == "deb":
        debian_changelog(target, stage / "changelog.Debian.gz")
    else:
        rpm_changelog(target, stage / "changelog.yaml")


def nfpm_config(target: Target, stage: Path) -> dict:
    systemd = TOP / "systemd"
    doc = "/usr/share/doc/gpu-agent"
    contents = [
        {"src": str(HERE / "launcher.py"), "dst": "/usr/bin/gpu-agent", "file_info": {"mode": 0o755}},
        {"src": str(stage / LIB), "dst": f"/{LIB}", "type": "tree"},
        {"src": str(systemd / "gpu-agent.service"), "dst": "/usr/lib/systemd/system/gpu-agent.service",
         "file_info": {"mode": 0o644}},
        # The MPS control daemons' units (docs/device-plugin.md): started by gpu-agent by name, never enabled.
        {"src": str(systemd / "gpu-agent-mps@.service"), "dst": "/usr/lib/systemd/system/gpu-agent-mps@.service",
         "file_info": {"mode": 0o644}},
        {"src": str(systemd / "run-nvidia-mps-shm.mount"), "dst": "/usr/lib/systemd/system/run-nvidia-mps-shm.mount",
         "file_info": {"mode": 0o644}},
        {"src": str(HERE / "gpu-agent.preset"), "dst": "/usr/lib/systemd/system-preset/90-gpu-agent.preset",
         "file_info": {"mode": 0o644}},
        {"src": str(systemd / "gpu-agent.tmpfiles"), "dst": "/usr/lib/tmpfiles.d/gpu-agent.conf",
         "file_info": {"mode": 0o644}},
        {"src": str(stage / "etc/gpu-agent/config.yaml"), "dst": "/etc/gpu-agent/config.yaml",
         "type": "config|noreplace", "file_info": {"mode": 0o644}},
        {"src": str(HERE / "mig.yaml"), "dst": "/etc/gpu-agent/mig.yaml",
         "type": "config|noreplace", "file_info": {"mode": 0o644}},
    ]
    man = {"src": str(stage / "gpu-agent.1.gz"), "dst": "/usr/share/man/man1/gpu-agent.1.gz",
           "file_info": {"mode": 0o644}}
    # The README's links: the topic pages beside it, as in the repository.
    pages = [{"src": str(page), "dst": f"{doc}/docs/{page.name}", "file_info": {"mode": 0o644}}
             for page in sorted((TOP / "docs").glob("*.md"))]
    python = target.python
    newer = f"{python.split('.')[0]}.{int(python.split('.')[1]) + 1}"
    if target.packager == "deb":
        contents += [
            {"src": str(TOP / "README.md"), "dst": f"{doc}/README.md", "file_info": {"mode": 0o644}},
            *pages,
            {"src": str(HERE / "copyright"), "dst": f"{doc}/copyright", "file_info": {"mode": 0o644}},
            {"src": str(stage / "changelog.Debian.gz"), "dst": f"{doc}/changelog.Debian.gz",
             "file_info": {"mode": 0o644}},
            man,
        ]
        depends = [f"python3 (>= {python}~)", f"python3 (<< {newer})", "libc6 (>= 2.34)", "kmod"]
        scripts = {"postinstall": HERE / "deb/postinst", "preremove": HERE / "deb/prerm",
                   "postremove": HERE / "deb/postrm"}
    else:
        contents += [
            {"src": str(TOP / "README.md"), "dst": f"{doc}/README.md", "type": "doc", "file_info": {"mode": 0o644}},
            *({**page, "type": "doc"} for page in pages),
            {"src": str(HERE / "copyright"), "dst": "/usr/share/licenses/gpu-agent/copyright", "type": "license",
             "file_info": {"mode": 0o644}},
            {**man, "type": "doc"},  # %doc; typed so, nfpm would leave it out of the deb
        ]
        # python(abi) is what RHEL's python3 provides for its ABI: exactly the one the package is built for.
        depends = [f"python(abi) = {python}", "glibc >= 2.34", "kmod"]
        scripts = {"postinstall": HERE / "rpm/post", "preremove": HERE / "rpm/preun", "postremove": HERE / "rpm/postun"}
    config = {
        "name": "gpu-agent",
        "arch": "amd64",
        "platform": "linux",
        "version": __version__,
        "release": target.release,
        "section": "admin",
        "priority": "optional",
        "maintainer": MAINTAINER,
        "description": "makes a node's NVIDIA GPUs ready for Kubernetes and containers\n"
                       "A node-local daemon run by systemd: GPU discovery and health, a read-only\n"
                       "HTTP endpoint (/healthz, /readyz, /status, /metrics) and a simulator.",
        "vendor": "gpu-agent",
        "homepage": "https://localhost/gpu-agent",
        "license": "Apache-2.0",
        "depends": depends,
        "contents": contents,
        "scripts": {key: str(path) for key, path in scripts.items()},
    }
    if target.packager == "rpm":
        config["changelog"] = str(stage / "changelog.yaml")
        config["rpm"] = {"summary": "Makes a node's NVIDIA GPUs ready for Kubernetes and containers",
                         "group": "System Environment/Daemons"}
    return config


def build(target: Target, out: Path, nfpm: str, work: Path) -> Path:
    stage = work / target.name
    vendor(target, stage, work / "wheels")
    stage_files(target, stage)
    config = work / f"nfpm-{target.name}.yaml"
    config.write_text(yaml.safe_dump(nfpm_config(target, stage), sort_keys=False))
    package = out / target.filename
    subprocess.run([nfpm, "package", "--config", str(config), "--packager", target.packager,
                    "--target", str(package)], check=True, timeout=300)
    return package


def main() -> int:
    names = [target.name for target in TARGETS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(TOP / "dist"), help="where the packages go (default dist/)")
    parser.add_argument("--target", action="append", choices=names,
                        help=f"build only this target (repeatable; default all: {', '.join(names)})")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nfpm = shutil.which("nfpm") or str(Path(sys.executable).parent / "nfpm")
    with tempfile.TemporaryDirectory(prefix="gpu-agent-package.") as tmp:
        for target in TARGETS:
            if args.target is None or target.name in args.target:
                print(build(target, out, nfpm, Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
