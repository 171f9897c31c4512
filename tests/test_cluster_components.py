"""The cluster rig's recipe (tests/e2e/cluster/components.py, issue 34): each consumer module pins the version
the script builds and go.sum holds its checksums; what is not built is named with the step that builds it;
a failing `go build` is reported with its step, not a traceback."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e" / "cluster"))
import components
from components import COMPONENTS, KUBERNETES, BuildError, Component


@pytest.mark.parametrize("component", COMPONENTS.values(), ids=list(COMPONENTS))
def test_each_module_pins_the_version_built_and_records_its_checksums(component: Component) -> None:
    mod = (component.directory / "go.mod").read_text()
    assert re.search(rf"^require {re.escape(component.module)} {re.escape(component.version)}$", mod, re.M), mod
    sums = (component.directory / "go.sum").read_text().splitlines()
    for suffix in ("", "/go.mod"):
        assert any(line.startswith(f"{component.module} {component.version}{suffix} h1:") for line in sums), suffix
    for package in component.binaries.values():
        assert package.startswith(component.module)
    assert [path.name for path in component.directory.iterdir()] in (["go.mod", "go.sum"], ["go.sum", "go.mod"])


def test_kubernetes_staging_modules_are_the_published_ones_of_the_same_release() -> None:
    mod = (KUBERNETES.directory / "go.mod").read_text()
    replaced = dict(re.findall(r"^\t(k8s\.io/\S+) => (?:k8s\.io/\S+) (v\S+)$", mod, re.M))
    minor, patch = KUBERNETES.version.lstrip("v").split(".")[1:]
    assert len(replaced) >= 30 and set(replaced.values()) == {f"v0.{minor}.{patch}"}, replaced
    assert {"k8s.io/api", "k8s.io/apimachinery", "k8s.io/client-go", "k8s.io/kubelet"} <= set(replaced)
    # the version the kubelet reports as the Node's kubeletVersion (the agent reads it) is stamped in
    assert f"-X k8s.io/component-base/version.gitVersion={KUBERNETES.version}" in KUBERNETES.ldflags


def test_what_is_not_built_is_named_with_its_build_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(components, "CACHE", tmp_path)
    lacking = components.missing([COMPONENTS["etcd"]])
    assert len(lacking) == 1
    assert lacking[0].startswith(f"etcd of etcd {COMPONENTS['etcd'].version} ({tmp_path}/etcd-")
    assert "make e2e-cluster-build" in lacking[0] and "components.py etcd" in lacking[0]
    built = COMPONENTS["etcd"].binary("etcd")
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    assert components.missing([COMPONENTS["etcd"]]) == []


@pytest.mark.subprocess  # go itself, offline: the package is in no module go.mod requires
@pytest.mark.skipif(shutil.which("go") is None, reason="no go on PATH (.ci/run installs it)")
def test_a_failing_build_names_its_step_and_leaves_nothing_that_looks_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "modules" / "broken"
    module.mkdir(parents=True)
    (module / "go.mod").write_text("module gpu-agent.test/cluster/broken\n\ngo 1.21\n")
    (module / "go.sum").write_text("")
    monkeypatch.setattr(components, "MODULES", tmp_path / "modules")
    monkeypatch.setattr(components, "CACHE", tmp_path / "cache")
    monkeypatch.setenv("GOPROXY", "off")
    broken = Component("broken", "example.invalid/broken", "v1.0.0", {"broken": "example.invalid/broken/cmd/broken"})
    with pytest.raises(BuildError) as raised:
        components.build(broken)
    message = str(raised.value)
    assert message.startswith("step 1/1 of broken v1.0.0: broken: `go build example.invalid/broken/cmd/broken` in ")
    assert "example.invalid/broken" in message.split("exited", 1)[1]  # go's own words follow
    assert not broken.cached.exists() and components.missing([broken])
