"""Builds the real cluster's upstream components from their Go modules, at pinned versions, into a cache
outside the clone (issue 34).

Each component has a consumer module of ours under modules/<component>/: a go.mod that requires the
upstream module at its pinned version (Kubernetes' also pins each staging module it replaces with a
local path) and the go.sum that records every module's checksum. `go build -mod=readonly` from there
builds the upstream packages as they are: nothing of theirs is kept in this repository, and a module
whose checksum differs from go.sum stops the build.

A component lands in CACHE/cluster/<component>-<version>-<recipe>/bin/, <recipe> being a digest of its
go.mod, go.sum, packages and link flags, so a changed recipe builds anew; a cached one is skipped. A
build goes to a .partial folder first, renamed when every binary is there: an interrupted build leaves
nothing that looks built.

usage: components.py [--cache DIR] [--list] [COMPONENT ...]   (default: every component)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

HERE = Path(__file__).resolve().parent
MODULES = HERE / "modules"
CACHE = Path(os.environ.get("GPU_AGENT_E2E_CACHE", "/var/cache/gpu-agent-e2e")) / "cluster"
BUILD_TIMEOUT = 3600  # one `go build` on a loaded 2-core machine: the kubelet alone takes about 15 minutes cold
MAKE = "make e2e-cluster-build"


def _kubernetes_version_flags(version: str) -> list[str]:
    """What Kubernetes' own build stamps in: without it the kubelet reports v0.0.0-master as the Node's
    kubeletVersion, which the agent reads."""
    major, minor = version.lstrip("v").split(".")[:2]
    flags = []
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {package}.gitVersion={version}", f"-X {package}.gitMajor={major}",
                  f"-X {package}.gitMinor={minor}"]
    return [*flags, "-X k8s.io/component-base/version.gitTreeState=clean"]


@dataclass(frozen=True)
class Component:
    name: str
    module: str  # the upstream module its go.mod requires
    version: str
    binaries: Mapping[str, str]  # binary name: the package it is built from
    ldflags: Sequence[str] = field(default_factory=tuple)

    @property
    def directory(self) -> Path:
        return MODULES / self.name

    def recipe(self) -> str:
        """A digest of everything the build depends on but the Go toolchain."""
        digest = hashlib.sha256()
        for name in ("go.mod", "go.sum"):
            digest.update((self.directory / name).read_bytes())
        digest.update(json.dumps([dict(self.binaries), list(self.ldflags)]).encode())
        return digest.hexdigest()[:12]

    @property
    def cached(self) -> Path:
        return CACHE / f"{self.name}-{self.version}-{self.recipe()}"

    def binary(self, name: str) -> Path:
        return self.cached / "bin" / name


KUBERNETES = Component("kubernetes", "k8s.io/kubernetes", "v1.34.4", {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
}, _kubernetes_version_flags("v1.34.4"))
# etcd's server module is its main package; the version it reports is a constant of its api module.
ETCD = Component("etcd", "go.etcd.io/etcd/server/v3", "v3.6.16", {"etcd": "go.etcd.io/etcd/server/v3"})
# The newest containerd 2.x the module proxy serves that builds with the machine's Go (v2.4.2 asks 1.26.6).
CONTAINERD = Component("containerd", "github.com/containerd/containerd/v2", "v2.4.2", {
    "containerd": "github.com/containerd/containerd/v2/cmd/containerd",
    "containerd-shim-runc-v2": "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
    "ctr": "github.com/containerd/containerd/v2/cmd/ctr",
}, ("-X github.com/containerd/containerd/v2/version.Version=v2.4.2",))
CRICTL = Component("crictl", "sigs.k8s.io/cri-tools", "v1.34.0", {"crictl": "sigs.k8s.io/cri-tools/cmd/crictl"},
                   ("-X sigs.k8s.io/cri-tools/pkg/version.Version=v1.34.0",))
COMPONENTS = {component.name: component for component in (KUBERNETES, ETCD, CONTAINERD, CRICTL)}


class BuildError(Exception):
    pass


def required_go(component: Component) -> tuple[int, ...]:
    found = re.search(r"^go (\d+(?:\.\d+)*)", (component.directory / "go.mod").read_text(), re.M)
    return tuple(int(part) for part in found[1].split(".")) if found else (1,)


def go_version() -> tuple[int, ...]:
    go = shutil.which("go")
    if go is None:
        raise BuildError("no `go` on PATH: the cluster rig builds upstream's components with Go 1.26 or newer")
    done = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60)
    found = re.match(r"go(\d+(?:\.\d+)*)", done.stdout.strip())
    if done.returncode != 0 or not found:
        raise BuildError(f"`go env GOVERSION` answered {done.stdout.strip() or done.stderr.strip()!r}")
    return tuple(int(part) for part in found[1].split("."))


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # Static binaries (they run inside the booted Debian), nothing but go.mod's versions and go.sum's sums.
    env.update(CGO_ENABLED="0", GOFLAGS="-mod=readonly -buildvcs=false", GOWORK="off")
    return env


def build(component: Component, log: Path | None = None) -> Path:
    """component's binaries, built unless cached; the folder they are in."""
    if all(component.binary(name).exists() for name in component.binaries):
        return component.cached
    found, needed = go_version(), required_go(component)
    if found < needed:
        raise BuildError(f"{component.name} {component.version}: modules/{component.name}/go.mod asks Go "
                         f"{'.'.join(map(str, needed))}, this machine's go is {'.'.join(map(str, found))}")
    partial = component.cached.with_name(component.cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "bin").mkdir(parents=True)
    work = partial / "module"  # go.mod and go.sum copied: a build never writes into the clone
    work.mkdir()
    for name in ("go.mod", "go.sum"):
        shutil.copy(component.directory / name, work / name)
    env = _environment()
    versions = {}
    for number, (binary, package) in enumerate(component.binaries.items(), 1):
        step = f"step {number}/{len(component.binaries)} of {component.name} {component.version}: {binary}"
        argv = ["nice", "go", "build", "-trimpath", "-ldflags", " ".join(["-s", "-w", *component.ldflags]),
                "-o", str(partial / "bin" / binary), package]
        print(f"cluster rig: {step} (go build {package})", flush=True)
        started = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise BuildError(f"{step}: `go build {package}` ran past {BUILD_TIMEOUT} s") from exc
        if log is not None:
            with log.open("a") as out:
                out.write(f"== {step}\n{done.stdout}{done.stderr}")
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
            raise BuildError(f"{step}: `go build {package}` in {work} exited {done.returncode}:\n{tail}")
        versions[binary] = {"package": package, "seconds": round(time.monotonic() - started)}
    shutil.rmtree(work)
    (partial / "built.json").write_text(json.dumps({
        "component": component.name, "module": component.module, "version": component.version,
        "go": ".".join(map(str, go_version())), "binaries": versions}, indent=1) + "\n")
    shutil.rmtree(component.cached, ignore_errors=True)
    partial.rename(component.cached)
    return component.cached


def missing(components: Sequence[Component] = tuple(COMPONENTS.values())) -> list[str]:
    """What is not built yet, each naming the build step that makes it (for the tests' message)."""
    return [f"{name} of {component.name} {component.version} ({component.binary(name)}): run `{MAKE}` "
            f"(or `python3 tests/e2e/cluster/components.py {component.name}`)"
            for component in components for name in component.binaries if not component.binary(name).exists()]


def main(argv: Sequence[str] | None = None) -> int:
    global CACHE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, help=f"where the binaries go (default {CACHE})")
    parser.add_argument("--list", action="store_true", help="say where each component is and whether it is built")
    parser.add_argument("components", nargs="*", metavar="COMPONENT",
                        help=f"any of {', '.join(COMPONENTS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.components if name not in COMPONENTS]
    if unknown:
        parser.error(f"no component {', '.join(unknown)}: the rig builds {', '.join(COMPONENTS)}")
    if args.cache:
        CACHE = args.cache
    chosen = [COMPONENTS[name] for name in args.components] or list(COMPONENTS.values())
    if args.list:
        for component in chosen:
            state = "built" if not missing([component]) else "not built"
            print(f"{component.name} {component.version}: {state}: {component.cached}")
        return 0
    CACHE.mkdir(parents=True, exist_ok=True)
    for component in chosen:
        started = time.monotonic()
        was_built = not missing([component])
        try:
            where = build(component, CACHE / f"{component.name}-{component.version}.log")
        except BuildError as exc:
            print(f"cluster rig: building {exc}", file=sys.stderr)
            return 1
        took = "cached" if was_built else f"built in {time.monotonic() - started:.0f} s"
        print(f"cluster rig: {component.name} {component.version}: {took}: {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
