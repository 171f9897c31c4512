"""The device path: which way a pod's GPU reaches its container for each runtime and kubelet version
(a pure decision, table-driven), how versions are read, and what the toolkit, the CDI stage and
Allocate do with the choice on a simulated node."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest
import tomlkit
from harness import SimNode, run_cli

from gpu_agent.plugin.allocate import AllocationError, allocate
from gpu_agent.plugin.devices import PluginDevice, Resource
from gpu_agent.toolkit.devicepath import Found, Inputs, choose
from gpu_agent.host import proc
from gpu_agent.host.paths import Root
from gpu_agent.host.proc import Completed
from gpu_agent.toolkit.versions import Versions, from_dpkg, from_output

CONTAINERD, DOCKER, CRIO = "containerd", "docker", "crio"
K3S, RKE2, MICROK8S, PODMAN, NERDCTL = "k3s", "rke2", "microk8s", "podman", "nerdctl"


def row(runtimes: tuple[tuple[str, Optional[str]], ...], kubelet: Optional[str] = "1.31.0",
        consumers: tuple[tuple[str, Optional[str]], ...] = (), **settings: Any) -> Any:
    return choose(Inputs(runtimes=tuple(Found(name, version) for name, version in runtimes), kubelet=kubelet,
                         consumers=tuple(Found(name, version) for name, version in consumers), **settings))


# (case, runtimes, kubelet, settings) -> (strategy, CDI switch written in, nvidia default in, spec needed)
TABLE = [
    ("debian12-containerd-1.6", ((CONTAINERD, "1.6.20~ds1"),), "1.28.2", {}, ("envvar", (), (CONTAINERD,), False)),
    ("debian12-containerd-and-docker-20.10", ((CONTAINERD, "1.6.20~ds1"), (DOCKER, "20.10.24+dfsg1")), "1.29.0", {},
     ("envvar", (), (CONTAINERD,), False)),
    ("debian13-containerd-1.7", ((CONTAINERD, "1.7.24~ds1"),), "1.31.0", {}, ("cdi-cri", (CONTAINERD,), (), True)),
    ("debian13-containerd-1.7-docker-26", ((CONTAINERD, "1.7.24"), (DOCKER, "26.1.5")), "1.31.0", {},
     ("cdi-cri", (CONTAINERD, DOCKER), (), True)),
    ("containerd-2", ((CONTAINERD, "2.0.2"),), "1.32.1", {}, ("cdi-cri", (CONTAINERD,), (), True)),
    ("containerd-1.7-kubelet-1.28", ((CONTAINERD, "1.7.24"),), "v1.28.9", {},
     ("cdi-annotations", (CONTAINERD,), (), True)),
    ("crio-1.28", ((CRIO, "1.28.1"),), "1.28.0", {}, ("cdi-annotations", (CRIO,), (), True)),
    ("crio-1.30", ((CRIO, "1.30.4"),), "1.30.0", {}, ("cdi-cri", (CRIO,), (), True)),
    ("crio-1.22", ((CRIO, "1.22.5"),), "1.22.0", {}, ("envvar", (), (CRIO,), False)),
    ("docker-20.10-alone", ((DOCKER, "20.10.24"),), None, {"plugin": False}, ("envvar", (), (), False)),
    ("docker-25-alone", ((DOCKER, "25.0.3"),), None, {"plugin": False}, ("envvar", (DOCKER,), (), True)),
    ("docker-26-behind-cri-dockerd", ((DOCKER, "26.1.5"),), "1.30.0", {}, ("envvar", (DOCKER,), (DOCKER,), True)),
    ("no-runtime-plugin-on", (), "1.31.0", {}, ("envvar", (), (), False)),
    ("no-runtime-cdi-cri-set", (), "1.31.0", {"setting": "cdi-cri"}, ("cdi-cri", (), (), True)),
    ("unknown-versions-assumed", ((CONTAINERD, None),), None, {}, ("cdi-cri", (CONTAINERD,), (), True)),
    ("cdi-off", ((CONTAINERD, "1.7.24"),), "1.31.0", {"spec": False}, ("envvar", (), (CONTAINERD,), False)),
    ("set-as-default-false", ((CONTAINERD, "1.6.20"),), "1.28.0", {"set_as_default": False},
     ("envvar", (), (), False)),
    ("set-as-default-true", ((CONTAINERD, "1.7.24"), (DOCKER, "26.1.5")), "1.31.0", {"set_as_default": True},
     ("cdi-cri", (CONTAINERD, DOCKER), (CONTAINERD, DOCKER), True)),
    ("explicit-cdi-cri-on-1.6", ((CONTAINERD, "1.6.20"),), "1.31.0", {"setting": "cdi-cri"},
     ("cdi-cri", (), (), True)),
    ("node-says-1.6-over-unknown", ((CONTAINERD, None),), "1.31.0", {"node_runtime": "containerd://1.6.20"},
     ("envvar", (), (CONTAINERD,), False)),
    ("node-says-crio", ((CONTAINERD, "1.7.24"), (CRIO, "1.30.0")), "1.31.0", {"node_runtime": "cri-o://1.30.0"},
     ("cdi-cri", (CONTAINERD, CRIO), (), True)),
    # CDI consumers outside the CRI: the spec is written for them whatever the kubelet's path
    ("debian12-with-podman-4.3", ((CONTAINERD, "1.6.20~ds1"), (DOCKER, "20.10.24+dfsg1")), "1.28.2",
     {"consumers": ((PODMAN, "4.3.1+ds1"),)}, ("envvar", (), (CONTAINERD,), True)),
    ("debian13-with-podman-5.4", ((CONTAINERD, "1.7.24~ds1"),), "1.31.0", {"consumers": ((PODMAN, "5.4.2+ds1"),)},
     ("cdi-cri", (CONTAINERD,), (), True)),
    ("podman-alone", (), None, {"consumers": ((PODMAN, "4.1.0"),)}, ("envvar", (), (), True)),
    ("podman-4.0-reads-no-spec", (), None, {"consumers": ((PODMAN, "4.0.2"),)}, ("envvar", (), (), False)),
    ("podman-version-unknown", (), None, {"consumers": ((PODMAN, None),)}, ("envvar", (), (), True)),
    ("nerdctl-2.1", ((CONTAINERD, "1.6.20"),), None, {"consumers": ((NERDCTL, "2.1.2"),)},
     ("envvar", (), (CONTAINERD,), True)),
    ("nerdctl-2.0", ((CONTAINERD, "1.6.20"),), None, {"consumers": ((NERDCTL, "2.0.3"),)},
     ("envvar", (), (CONTAINERD,), False)),
    ("podman-cdi-off", (), None, {"consumers": ((PODMAN, "5.4.2"),), "spec": False}, ("envvar", (), (), False)),
    # k3s, RKE2 and microk8s: their own kubelet on the containerd they embed, by its version
    ("k3s-containerd-1.7", ((K3S, "1.7.23-k3s2"),), "1.31.4+k3s1", {}, ("cdi-cri", (K3S,), (), True)),
    ("k3s-containerd-2.0", ((K3S, "2.0.2-k3s2"),), "1.32.1+k3s1", {}, ("cdi-cri", (K3S,), (), True)),
    ("k3s-containerd-1.6", ((K3S, "1.6.19-k3s1"),), "1.26.4+k3s1", {}, ("envvar", (), (K3S,), False)),
    ("rke2-containerd-1.7-kubelet-1.28", ((RKE2, "1.7.11-k3s2"),), "1.28.5+rke2r1", {},
     ("cdi-annotations", (RKE2,), (), True)),
    ("microk8s-containerd-1.6", ((MICROK8S, "1.6.28"),), "1.28.15", {}, ("envvar", (), (MICROK8S,), False)),
    ("k3s-beside-containerd-1.6", ((CONTAINERD, "1.6.20"), (K3S, None)), "1.31.4+k3s1",
     {"node_runtime": "containerd://1.7.23-k3s2"}, ("cdi-cri", (K3S,), (), True)),
    ("k3s-version-from-the-node", ((K3S, None),), None, {"node_runtime": "containerd://1.6.19-k3s1"},
     ("envvar", (), (K3S,), False)),
    ("k3s-set-as-default-false", ((K3S, "1.6.19-k3s1"),), None, {"set_as_default": False}, ("envvar", (), (), False)),
]


@pytest.mark.parametrize("runtimes, kubelet, settings, expected", [case[1:] for case in TABLE],
                         ids=[case[0] for case in TABLE])
def test_the_device_path_for_each_runtime_and_kubelet(runtimes: Any, kubelet: Optional[str],
                                                      settings: dict[str, Any], expected: tuple[Any, ...]) -> None:
    path = row(runtimes, kubelet, **settings)
    assert (path.strategy, path.cdi, path.nvidia_default, path.spec_needed) == expected, path.reason
    assert path.chosen == (settings.get("setting", "auto") == "auto")


def test_the_kubelets_runtime_and_the_cdi_consumers_are_named() -> None:
    k3s = row(((CONTAINERD, "1.6.20"), (K3S, None)), node_runtime="containerd://1.7.23-k3s2")
    assert k3s.kubelet_runtime == K3S and k3s.no_cdi[CONTAINERD].startswith("containerd 1.6.20 does not apply CDI")
    assert row(((CONTAINERD, "1.7.24"), (MICROK8S, "1.6.28")), node_runtime="containerd://1.7.24").kubelet_runtime \
        == CONTAINERD  # no -k3s: not k3s's or RKE2's, and the Node's version is plain containerd's
    assert row(((CONTAINERD, "1.7.24"), (RKE2, "1.7.23-k3s2"))).kubelet_runtime == RKE2  # RKE2 runs its kubelet
    old = row(((K3S, "1.6.19-k3s1"),))
    assert old.reason.startswith("k3s (containerd 1.6.19-k3s1) does not apply CDI (from 1.7)")
    assert old.no_cdi == {K3S: "k3s (containerd 1.6.19-k3s1) does not apply CDI (from 1.7): no enable_cdi written, "
                               "it would be ignored"}
    podman = row(((CONTAINERD, "1.6.20"),), consumers=((PODMAN, "4.3.1"), (NERDCTL, "1.7.6")))
    assert podman.consumers == (PODMAN,) and podman.to_json()["cdi_consumers"] == [PODMAN]
    assert "the CDI spec is written for Podman 4.3.1, which read it themselves" in podman.reason
    assert podman.no_cdi[NERDCTL] == "nerdctl 1.7.6 reads no CDI spec (from 2.1)"


def test_the_reasons_name_the_versions_and_what_was_not_written() -> None:
    path = row(((CONTAINERD, "1.6.20~ds1"), (DOCKER, "20.10.24+dfsg1")), "1.28.2")
    assert path.reason.startswith("containerd 1.6.20~ds1 does not apply CDI (from 1.7)")
    assert "nvidia made containerd's default runtime" in path.reason
    assert path.no_cdi == {CONTAINERD: "containerd 1.6.20~ds1 does not apply CDI (from 1.7): no enable_cdi written, "
                                       "it would be ignored",
                           DOCKER: "Docker 20.10.24+dfsg1 does not apply CDI (from 25.0): no features.cdi written, "
                                   "it would be ignored"}
    explicit = row(((CONTAINERD, "1.6.20"),), "1.31.0", setting="cdi-cri")
    assert explicit.warning and "containerd 1.6.20 does not apply CDI" in explicit.warning
    assert "runtimeClassName: nvidia" in row(((CONTAINERD, "1.6.20"),), set_as_default=False).reason
    assert "assumed where unknown: containerd (version unknown), kubelet version unknown" in \
        row(((CONTAINERD, None),), None).reason


@pytest.mark.parametrize("output, version", [
    ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3\n", "1.6.20~ds1"),
    ("containerd containerd.io 1.7.24 88bf19b2105c8b17560993bee28a01ddc2f97182\n", "1.7.24"),
    ("containerd github.com/containerd/containerd/v2 v2.0.2 c507a0257ea6462fbd6f5ba4f5c74facb04021f4\n", "2.0.2"),
    ("Docker version 20.10.24+dfsg1, build 297e128\n", "20.10.24+dfsg1"),
    ("crio version 1.28.1\n", "1.28.1"),
    ("Kubernetes v1.29.3+k3s1\n", "1.29.3+k3s1"),
    ("no version here\n", None),
])
def test_versions_from_the_binaries_output(output: str, version: Optional[str]) -> None:
    assert from_output(output) == version


def test_versions_of_the_distributions_and_podman_where_they_put_them(root: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    versions = Versions(Root(root))
    assert not versions.installed("podman") and versions.read("k3s") == (None, f"no package record under {root}")
    (root / "snap/microk8s/x1/meta").mkdir(parents=True)
    (root / "snap/microk8s/current").symlink_to("x1")
    (root / "snap/microk8s/x1/meta/snap.yaml").write_text("name: microk8s\nversion: v1.32.3\nsummary: k8s\n")
    assert versions.read("microk8s-kubelet") == ("1.32.3", "/snap/microk8s/current/meta/snap.yaml")
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/podman").symlink_to("/usr/lib/podman/podman")  # absolute: followed inside the root
    assert not versions.installed("podman")
    (root / "usr/lib/podman").mkdir(parents=True)
    (root / "usr/lib/podman/podman").write_text("")
    assert versions.installed("podman")
    # On the running system, k3s's own containerd answers --version (k3s-io/k3s cmd/containerd/main.go)
    ran = []

    def run(argv: list[str], timeout: float, limit: int) -> Completed:
        ran.append(argv)
        return Completed(tuple(argv), 0, "containerd github.com/k3s-io/containerd v1.7.23-k3s2 d9a0b1\n", "")

    monkeypatch.setattr(Root, "is_running_system", property(lambda self: True))
    monkeypatch.setattr(proc, "run", run)
    binary = root / "var/lib/rancher/k3s/data/abc/bin/containerd"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    (root / "var/lib/rancher/k3s/data/current").symlink_to(root / "var/lib/rancher/k3s/data/abc")
    for _ in range(2):  # run once: the answer is kept until the binary changes
        assert versions.read("k3s") == ("1.7.23-k3s2", "/var/lib/rancher/k3s/data/current/bin/containerd --version")
    assert ran == [[f"{root}/var/lib/rancher/k3s/data/current/bin/containerd", "--version"]]


def test_versions_from_the_package_database() -> None:
    status = ("Package: containerd\nStatus: install ok installed\nVersion: 1.6.20~ds1-1+deb12u3\n\n"
              "Package: docker-ce\nStatus: deinstall ok config-files\nVersion: 5:26.1.5-1~debian.12~bookworm\n\n"
              "Package: docker.io\nStatus: install ok installed\nVersion: 5:26.1.5+dfsg1-9\n")
    assert from_dpkg(status, ("containerd", "containerd.io")) == ("1.6.20~ds1", "containerd")
    assert from_dpkg(status, ("docker-ce", "docker.io")) == ("26.1.5+dfsg1", "docker.io")
    assert from_dpkg(status, ("cri-o",)) is None


def test_allocate_names_no_cdi_device_the_spec_does_not_hold() -> None:
    resource = Resource("nvidia.com/gpu", tuple(PluginDevice(uuid, uuid, uuid, index, None, True)
                                                for index, uuid in enumerate(("GPU-a", "GPU-b"))))
    assert allocate(resource, ["GPU-a"], "cdi-cri", False, frozenset({"nvidia.com/gpu=GPU-a"})).cdi_devices == \
        ("nvidia.com/gpu=GPU-a",)
    with pytest.raises(AllocationError, match="the CDI spec holds no nvidia.com/gpu=GPU-b"):
        allocate(resource, ["GPU-b"], "cdi-annotations", False, frozenset({"nvidia.com/gpu=GPU-a"}))
    assert allocate(resource, ["GPU-b"], "envvar", False, frozenset()).envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-b"}
    with pytest.raises(AllocationError, match="no device path is chosen yet"):
        allocate(resource, ["GPU-a"], "", False)


# --- on a simulated node -------------------------------------------------------------------------------------

def node(root: Path, *installed: tuple[str, str]) -> SimNode:
    """A simulated DGX H100 with the toolkit, a kubelet's device-plugin directory and `installed` runtimes."""
    sim = SimNode(root, "dgx-h100")
    for binary in ("/usr/bin/nvidia-container-runtime", "/usr/bin/nvidia-container-runtime-hook",
                   "/usr/bin/nvidia-cdi-hook"):
        (root / binary.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        (root / binary.lstrip("/")).write_text("#!/bin/sh\n")
    (root / "var/lib/kubelet/device-plugins").mkdir(parents=True)
    for name, version in installed:
        sim.sim("install-runtime", name, version)
    return sim


def check_json(root: Path) -> dict[str, Any]:
    config = root.parent / "config.yaml"
    config.write_text("version: v1\n")
    done = run_cli("--simulate", "dgx-h100", "check", "--json", root=root, config=config)
    return json.loads(done.stdout)


@pytest.mark.subprocess  # the containerd installed here (Debian 12's) loads the drop-in the stage writes
def test_debian12_containerd_1_6_takes_the_nvidia_runtime_path(root: Path) -> None:
    sim = node(root, ("containerd", "1.6.20~ds1"), ("docker", "20.10.24+dfsg1"), ("kubelet", "1.28.2"),
               ("podman", "4.3.1+ds1"))
    found = check_json(root)["device_path"]
    assert (found["strategy"], found["chosen_by"], found["nvidia_default"]) == ("envvar", "auto", ["containerd"])
    assert (found["cdi_runtimes"], found["cdi_consumers"], found["cdi_spec_needed"]) == ([], ["podman"], True)
    done = sim.apply({})
    assert done.ok, [(run.stage, run.message) for run in done.runs if run.state != "ok"]
    cri = tomlkit.parse((root / "etc/containerd/conf.d/99-nvidia.toml").read_text())["plugins"][
        "io.containerd.grpc.v1.cri"]
    assert "enable_cdi" not in cri and cri["containerd"]["default_runtime_name"] == "nvidia"
    daemon = json.loads((root / "etc/docker/daemon.json").read_text())
    assert "features" not in daemon and "default-runtime" not in daemon
    toolkit = done.stage("toolkit").message
    assert "containerd: containerd 1.6.20~ds1 does not apply CDI (from 1.7): no enable_cdi written" in toolkit
    # Podman 4.3 reads the spec itself (podman run --device nvidia.com/gpu=0): it is written for it
    gpu = done.state.inventory.gpus[0].uuid
    assert f"name: {gpu}" in (root / "var/run/cdi/nvidia.yaml").read_text()
    assert done.state.device_path.strategy == "envvar" and f"nvidia.com/gpu={gpu}" in done.state.cdi_devices
    status = done.state.to_json()["device_path"]
    assert status["strategy"] == "envvar" and "does not apply CDI" in status["reason"]
    assert "the CDI spec is written for Podman 4.3.1+ds1" in status["reason"]


@pytest.mark.subprocess  # as above
def test_debian13_containerd_1_7_chooses_cdi(root: Path) -> None:
    sim = node(root, ("containerd", "1.7.24~ds1"), ("docker", "26.1.5+dfsg1"), ("kubelet", "1.31.4"))
    assert check_json(root)["device_path"]["strategy"] == "cdi-cri"
    done = sim.apply({})
    assert done.ok, [(run.stage, run.message) for run in done.runs if run.state != "ok"]
    cri = tomlkit.parse((root / "etc/containerd/conf.d/99-nvidia.toml").read_text())["plugins"][
        "io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True and cri["containerd"].get("default_runtime_name", "runc") == "runc"
    assert json.loads((root / "etc/docker/daemon.json").read_text())["features"] == {"cdi": True}
    gpu = done.state.inventory.gpus[0].uuid
    assert f"nvidia.com/gpu={gpu}" in done.state.cdi_devices
    assert f"name: {gpu}" in (root / "var/run/cdi/nvidia.yaml").read_text()


def test_plugin_without_a_runtime_names_no_cdi_device_without_a_spec(root: Path) -> None:
    sim = node(root)
    done = sim.apply({})
    assert done.state.device_path.strategy == "envvar" and done.stage("cdi").message.startswith("no CDI spec needed")
    forced = sim.apply({"plugin": {"device_list_strategy": "cdi-cri"}})
    assert forced.stage("cdi").state == "ok" and (root / "var/run/cdi/nvidia.yaml").exists()
    assert forced.state.cdi_devices
