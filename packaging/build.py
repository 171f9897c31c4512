"""Build dist/gpu-agent_<version>_amd64.deb and dist/gpu-agent-<version>-1.x86_64.rpm with nfpm.

The packages carry the agent and its Python dependencies, so installing needs no network. The
compiled dependencies (pydantic-core, PyYAML, psutil, ...) are per Python ABI, so wheels are
fetched for each supported ABI (3.9 RHEL 9, 3.10 Ubuntu 22.04, 3.11 Debian 12, 3.12 Ubuntu 24.04)
and installed into /usr/lib/gpu-agent/site-cpXY; whatever is byte-identical across all of them
moves to site-common. /usr/bin/gpu-agent picks the directory of the python3 it runs on.
"""
from __future__ import annotations

import argparse
import filecmp
import gzip
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
TOP = HERE.parent
sys.path.insert(0, str(TOP))

from gpu_agent import __version__  # noqa: E402
from gpu_agent.config.defaults import render_defaults  # noqa: E402

ABIS = ("3.9", "3.10", "3.11", "3.12")
# glibc 2.34 is the oldest of the targets (RHEL 9); every manylinux tag up to it is usable.
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64")
LIB = "usr/lib/gpu-agent"
PIP_TIMEOUT = 900
MAINTAINER = "gpu-agent developers <gpu-agent@example.com>"


def requirements() -> list[str]:
    return [r for r in metadata.requires("gpu-agent") or [] if "extra ==" not in r]


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   check=True, timeout=PIP_TIMEOUT)


def vendor(stage: Path, wheels: Path) -> None:
    """Install the dependencies per ABI, then hoist what all ABIs share into site-common."""
    local = wheels / "local"
    # sdnotify is published as an sdist only: build its (pure Python) wheel here.
    pip("wheel", "--no-deps", "--wheel-dir", str(local), "sdnotify")
    platform_args = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    for abi in ABIS:
        target = stage / LIB / f"site-cp{abi.replace('.', '')}"
        common = ["--only-binary=:all:", "--python-version", abi, "--implementation", "cp", *platform_args]
        pip("download", "--dest", str(wheels / abi), "--find-links", str(local), *common, *requirements())
        pip("install", "--no-index", "--find-links", str(wheels / abi), "--find-links", str(local),
            "--target", str(target), "--no-compile", *common, *requirements())
        trim(target)
    hoist_common(stage / LIB)


def trim(site: Path) -> None:
    """Drop what the agent never runs and strip what it does."""
    # Console scripts, nvidia-ml-py's example, and PyYAML's libyaml binding: the pure-Python
    # parser reads our small config just as well, and a private libyaml copy is one more to patch.
    for extra in [site / "bin", site / "example.py", *site.glob("yaml/_yaml*.so")]:
        shutil.rmtree(extra) if extra.is_dir() else extra.unlink(missing_ok=True)
    for library in site.rglob("*.so"):
        subprocess.run(["strip", "--strip-unneeded", str(library)], check=True, timeout=60)


def hoist_common(lib: Path) -> None:
    sites = sorted(lib.glob("site-cp*"))
    common = lib / "site-common"
    common.mkdir()
    for entry in sorted(p.name for p in sites[0].iterdir()):
        if all(_same(sites[0] / entry, site / entry) for site in sites[1:]):
            shutil.move(str(sites[0] / entry), common / entry)
            for site in sites[1:]:
                path = site / entry
                shutil.rmtree(path) if path.is_dir() else path.unlink()


def _same(a: Path, b: Path) -> bool:
    if not b.exists() or a.is_dir() != b.is_dir():
        return False
    if a.is_file():
        return filecmp.cmp(a, b, shallow=False)
    compared = filecmp.dircmp(a, b)
    if compared.left_only or compared.right_only or compared.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, compared.common_files, shallow=False)
    return not mismatch and not errors and all(_same(a / d, b / d) for d in compared.common_dirs)


def debian_changelog(path: Path) -> None:
    """changelog.Debian.gz, reproducible: dated by the last commit, gzip without a timestamp."""
    date = subprocess.run(["git", "-C", str(TOP), "log", "-1", "--format=%aD"], capture_output=True,
                          text=True, timeout=30).stdout.strip() or "Thu, 01 Jan 2026 00:00:00 +0000"
    text = (f"gpu-agent ({__version__}-1) unstable; urgency=medium\n\n"
            f"  * Release {__version__}; see /usr/share/doc/gpu-agent/README.md.\n\n"
            f" -- {MAINTAINER}  {date}\n")
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as out:
        out.write(text.encode())


def stage_files(stage: Path) -> None:
    shutil.copytree(TOP / "gpu_agent", stage / LIB / "gpu_agent",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    etc = stage / "etc/gpu-agent"
    etc.mkdir(parents=True)
    (etc / "config.yaml").write_text(render_defaults())
    debian_changelog(stage / "changelog.Debian.gz")


def nfpm_config(stage: Path) -> dict:
    systemd = TOP / "systemd"
    contents = [
        {"src": str(HERE / "launcher.py"), "dst": "/usr/bin/gpu-agent", "file_info": {"mode": 0o755}},
        {"src": str(stage / LIB), "dst": f"/{LIB}", "type": "tree"},
        {"src": str(systemd / "gpu-agent.service"), "dst": "/usr/lib/systemd/system/gpu-agent.service",
         "file_info": {"mode": 0o644}},
        {"src": str(HERE / "gpu-agent.preset"), "dst": "/usr/lib/systemd/system-preset/90-gpu-agent.preset",
         "file_info": {"mode": 0o644}},
        {"src": str(systemd / "gpu-agent.tmpfiles"), "dst": "/usr/lib/tmpfiles.d/gpu-agent.conf",
         "file_info": {"mode": 0o644}},
        {"src": str(stage / "etc/gpu-agent/config.yaml"), "dst": "/etc/gpu-agent/config.yaml",
         "type": "config|noreplace", "file_info": {"mode": 0o644}},
        {"src": str(HERE / "mig.yaml"), "dst": "/etc/gpu-agent/mig.yaml",
         "type": "config|noreplace", "file_info": {"mode": 0o644}},
        {"src": str(TOP / "README.md"), "dst": "/usr/share/doc/gpu-agent/README.md", "file_info": {"mode": 0o644}},
        {"src": str(HERE / "copyright"), "dst": "/usr/share/doc/gpu-agent/copyright", "file_info": {"mode": 0o644}},
    ]
    deb_only = [{"src": str(stage / "changelog.Debian.gz"), "dst": "/usr/share/doc/gpu-agent/changelog.Debian.gz",
                 "file_info": {"mode": 0o644}, "packager": "deb"}]
    return {
        "name": "gpu-agent",
        "arch": "amd64",
        "platform": "linux",
        "version": __version__,
        "release": "1",
        "section": "admin",
        "priority": "optional",
        "maintainer": MAINTAINER,
        "description": "makes a node's NVIDIA GPUs ready for Kubernetes and containers\n"
                       "A node-local daemon run by systemd: GPU discovery and health, a read-only\n"
                       "HTTP endpoint (/healthz, /readyz, /status, /metrics) and a simulator.",
        "vendor": "gpu-agent",
        "homepage": "https://localhost/gpu-agent",
        "license": "Apache-2.0",
        "contents": contents + deb_only,
        "overrides": {
            "deb": {"depends": ["python3 (>= 3.9)", "python3 (<< 3.13)", "libc6 (>= 2.34)", "kmod"],
                    "scripts": {"postinstall": str(HERE / "deb/postinst"), "preremove": str(HERE / "deb/prerm"),
                                "postremove": str(HERE / "deb/postrm")}},
            "rpm": {"depends": ["python3 >= 3.9", "python3 < 3.13", "glibc >= 2.34", "kmod"],
                    "scripts": {"postinstall": str(HERE / "rpm/post"), "preremove": str(HERE / "rpm/preun"),
                                "postremove": str(HERE / "rpm/postun")}},
        },
        "rpm": {"summary": "makes a node's NVIDIA GPUs ready for Kubernetes and containers",
                "group": "System Environment/Daemons"},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(TOP / "dist"), help="where the packages go (default dist/)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nfpm = shutil.which("nfpm") or str(Path(sys.executable).parent / "nfpm")
    with tempfile.TemporaryDirectory(prefix="gpu-agent-package.") as tmp:
        work = Path(tmp)
        stage = work / "stage"
        vendor(stage, work / "wheels")
        stage_files(stage)
        config = work / "nfpm.yaml"
        config.write_text(yaml.safe_dump(nfpm_config(stage), sort_keys=False))
        for packager, name in (("deb", f"gpu-agent_{__version__}_amd64.deb"),
                               ("rpm", f"gpu-agent-{__version__}-1.x86_64.rpm")):
            subprocess.run([nfpm, "package", "--config", str(config), "--packager", packager,
                            "--target", str(out / name)], check=True, timeout=300)
            print(out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
