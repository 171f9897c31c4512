"""gpu_agent.toolkit.cdi on simulated nodes: names, nodes, mounts and hooks, the CDI schema, determinism."""
from __future__ import annotations

import json
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from upstream_data import schema_file
import yaml

from gpu_agent.errors import AgentError
from gpu_agent.host import devnodes, ldcache
from gpu_agent.host.modules import KernelModules
from gpu_agent.host.paths import Root
from gpu_agent.nvml.client import Nvml
from gpu_agent.nvml.model import Inventory
from gpu_agent.sim.fake import FakeNvml
from gpu_agent.sim.kernel import SimModprobe, mig_cap_minor
from gpu_agent.sim.machine import MachineState
from gpu_agent.sim.userspace import install_driver_userspace, lib_dir
from gpu_agent.toolkit import cdi

VERSION = "550.90.07"
LIB = lib_dir()
MIG_MACHINE = {"name": "mig-node", "gpus": [
    {"model": "H100-80GB-HBM3", "count": 1, "mig": {"enabled": True, "devices": ["3g.40gb", "3g.40gb"]}},
    {"model": "H100-80GB-HBM3", "count": 1},
]}


class Node:
    """A simulated node: machine state, the agent's root over it, and NVML."""

    def __init__(self, path: Path, spec: str) -> None:
        self.path = path
        self.state = MachineState(Root(path))
        self.state.ensure(spec)
        self.root = Root(path).with_kernel(self.state.kernel_dir)
        self.nvml = Nvml(FakeNvml(self.state))

    def load(self, *modules: str) -> Node:
        for module in modules:
            SimModprobe(self.state, self.root).load(module)
        return self

    def inventory(self) -> Inventory:
        return self.nvml.inventory.read()

    def spec(self, **kwargs: Any) -> dict[str, Any]:
        return cdi.build_spec(self.inventory(), self.root, cdi.discover(self.root, VERSION), **kwargs)

    def make_device_nodes(self) -> None:
        """What the driver stage creates: the MIG instances' capability nodes among them, as nvidia-modprobe -f
        makes them for a process that opens an instance."""
        kernel = KernelModules(self.root)
        for node in devnodes.expected(self.root, kernel.char_majors(), list(devnodes.gpu_minors(self.root).values()),
                                      set(kernel.loaded())):
            devnodes.create_node(self.root, node)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(spec: Any = "dgx-h100", userspace: bool = True) -> Node:
        if isinstance(spec, dict):
            machine_file = tmp_path / "machine.yaml"
            machine_file.write_text(yaml.safe_dump(spec))
            spec = str(machine_file)
        result = Node(tmp_path / "root", spec).load("nvidia")
        if userspace:
            install_driver_userspace(result.path, VERSION)
        made.append(result)
        return result

    yield make
    for result in made:
        result.nvml.close()


def schema_validator() -> Any:
    """The CDI JSON schema (draft-07; schema.json refers to defs.json by relative name), read from
    ../shared/schemas/cdi/ (its README names the commit)."""
    import jsonschema
    import referencing
    from referencing.jsonschema import DRAFT7

    schema_dir = schema_file("cdi/schema.json").parent
    base = schema_dir.as_uri() + "/"
    schema = {**json.loads((schema_dir / "schema.json").read_text()), "$id": base + "schema.json"}
    defs = referencing.Resource.from_contents(json.loads(schema_file("cdi/defs.json").read_text()),
                                              default_specification=DRAFT7)
    registry = referencing.Registry().with_resource(base + "defs.json", defs)
    return jsonschema.Draft7Validator(schema, registry=registry)


def names(spec: dict[str, Any]) -> list[str]:
    return [device["name"] for device in spec["devices"]]


def device(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(d for d in spec["devices"] if d["name"] == name)


def paths(edits: dict[str, Any]) -> list[str]:
    return [n["path"] for n in edits.get("deviceNodes", [])]


# --- whole GPUs ---------------------------------------------------------------------------------


def test_dgx_h100_spec_is_valid_cdi(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    spec = dgx.spec()
    validator = schema_validator()
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(spec)]
    assert errors == []
    # the YAML the runtime reads is the same document
    assert not list(validator.iter_errors(yaml.safe_load(cdi.render(spec))))
    assert spec["kind"] == "nvidia.com/gpu" and spec["cdiVersion"] == "0.5.0"  # names start with a digit


def test_schema_check_catches_a_broken_spec(node: Callable[..., Node]) -> None:
    spec = node("dgx-h100").spec()
    del spec["devices"][0]["containerEdits"]
    spec["containerEdits"]["mounts"][0]["options"] = "ro"
    assert len(list(schema_validator().iter_errors(spec))) == 2


def test_dgx_h100_devices_by_index_uuid_and_all(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    inventory = dgx.inventory()
    spec = dgx.spec()
    uuids = [gpu.uuid for gpu in inventory.gpus]
    assert names(spec) == [str(n) for n in range(8)] + sorted(uuids) + ["all"]
    for gpu in inventory.gpus:
        assert paths(device(spec, str(gpu.index))["containerEdits"]) == [f"/dev/nvidia{gpu.minor_number}"]
        assert device(spec, gpu.uuid)["containerEdits"] == device(spec, str(gpu.index))["containerEdits"]
    assert paths(device(spec, "all")["containerEdits"]) == [f"/dev/nvidia{n}" for n in range(8)]
    assert not any(name.startswith("MIG-") or ":" in name for name in names(spec))


def test_common_edits_mount_the_driver_files_at_their_host_paths(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    edits = dgx.spec()["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    mounts = {m["hostPath"]: m for m in edits["mounts"]}
    assert all(m["containerPath"] == m["hostPath"] and m["options"] == ["ro", "nosuid", "nodev", "bind"]
               for m in mounts.values())
    libraries = {p for p in mounts if p.startswith(LIB + "/")}
    assert libraries == {f"{LIB}/{name}.so.{VERSION}" for name in (
        "libcuda", "libcudadebugger", "libnvidia-ml", "libnvidia-ptxjitcompiler", "libnvidia-nvvm", "libnvidia-cfg",
        "libnvidia-opencl", "libnvidia-allocator", "libnvidia-gpucomp", "libnvidia-pkcs11",
        "libnvidia-pkcs11-openssl3")}
    assert {f"/usr/bin/{b}" for b in cdi.BINARIES} | {f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin",
                                                       f"/lib/firmware/nvidia/{VERSION}/gsp_tu10x.bin"} \
        == set(mounts) - libraries
    assert str(dgx.path) not in cdi.render(dgx.spec())  # host paths, never the agent's --root
    # nvidia-ctk's order: shallower container paths first, then by name
    keys = [(m["containerPath"].count("/"), m["containerPath"]) for m in edits["mounts"]]
    assert keys == sorted(keys)


def test_hooks_link_libcuda_and_update_the_ldcache(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    assert dgx.spec()["containerEdits"]["hooks"] == [
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
         "args": ["nvidia-cdi-hook", "create-symlinks", "--link", f"libcuda.so.1::{LIB}/libcuda.so"]},
        {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
         "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB]},
    ]
    # nvidia-ctk itself runs the hooks as a subcommand
    hooks = dgx.spec(hook="/usr/local/bin/nvidia-ctk")["containerEdits"]["hooks"]
    assert [h["args"][:3] for h in hooks] == [["nvidia-ctk", "hook", "create-symlinks"],
                                              ["nvidia-ctk", "hook", "update-ldcache"]]
    assert {h["path"] for h in hooks} == {"/usr/local/bin/nvidia-ctk"}


def test_device_nodes_carry_host_numbers_once_they_exist(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100").load("nvidia_uvm")
    before = dgx.spec()
    assert "deviceNodes" not in before["containerEdits"]  # control nodes are listed only when present
    assert device(before, "0")["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    dgx.make_device_nodes()
    after = dgx.spec()
    assert after["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia-uvm", "type": "c", "major": 510, "minor": 0},
        {"path": "/dev/nvidia-uvm-tools", "type": "c", "major": 510, "minor": 1},
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255},
    ]  # no nvidia_modeset loaded, so no /dev/nvidia-modeset
    assert device(after, "7")["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia7", "type": "c", "major": 195, "minor": 7}]
    dgx.load("nvidia_modeset").make_device_nodes()
    assert "/dev/nvidia-modeset" in paths(dgx.spec()["containerEdits"])


def test_ipc_sockets_are_mounted_when_present(node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch) -> None:
    dgx = node("dgx-h100")
    assert not [m for m in dgx.spec()["containerEdits"]["mounts"] if m["hostPath"].startswith("/run/")]
    path = dgx.root("/run/nvidia-persistenced/socket")
    path.parent.mkdir(parents=True)
    monkeypatch.chdir(path.parent)  # a socket path is limited to 108 bytes; bind by relative name
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path.name)
        mounts = [m for m in dgx.spec()["containerEdits"]["mounts"] if m["hostPath"].startswith("/run/")]
    socket_path = "/run/nvidia-persistenced/socket"
    assert mounts == [{"hostPath": socket_path, "containerPath": socket_path,
                       "options": ["ro", "nosuid", "nodev", "bind", "noexec"]}]


# --- MIG ---------------------------------------------------------------------------------------


def test_a_mig_spec_is_valid_cdi(node: Callable[..., Node]) -> None:
    assert not list(schema_validator().iter_errors(node(MIG_MACHINE).spec()))


def test_mig_devices_by_position_and_uuid_with_their_capability_nodes(node: Callable[..., Node]) -> None:
    mig = node(MIG_MACHINE)
    inventory = mig.inventory()
    gpu = inventory.gpus[0]
    assert [d.profile for d in gpu.mig.devices] == ["3g.40gb", "3g.40gb"]
    spec = mig.spec()
    mig_uuids = [d.uuid for d in gpu.mig.devices]
    assert names(spec) == ["0", "0:0", "0:1", "1"] + sorted([g.uuid for g in inventory.gpus] + mig_uuids) + ["all"]
    # GPU instances 1 and 2 (compute instance 0 each): minors 12/13 and 21/22 on GPU minor 0
    for position, (gi_minor, ci_minor) in enumerate(((12, 13), (21, 22))):
        edits = device(spec, f"0:{position}")["containerEdits"]
        assert paths(edits) == ["/dev/nvidia0", f"/dev/nvidia-caps/nvidia-cap{gi_minor}",
                                f"/dev/nvidia-caps/nvidia-cap{ci_minor}"]
        assert edits["hooks"] == [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                                   "args": ["nvidia-cdi-hook", "chmod", "--mode", "755", "--path", "/dev/nvidia-caps"]}]
        assert device(spec, mig_uuids[position])["containerEdits"] == edits
    assert "hooks" not in device(spec, "0")["containerEdits"] and "hooks" not in device(spec, "1")["containerEdits"]
    assert paths(device(spec, "all")["containerEdits"]) == [
        "/dev/nvidia0", "/dev/nvidia1", *(f"/dev/nvidia-caps/nvidia-cap{m}" for m in (12, 13, 21, 22))]


def test_mig_capability_nodes_get_host_numbers(node: Callable[..., Node]) -> None:
    mig = node(MIG_MACHINE)
    mig.make_device_nodes()
    nodes = device(mig.spec(), "0:1")["containerEdits"]["deviceNodes"]
    assert nodes == [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0},
                     {"path": "/dev/nvidia-caps/nvidia-cap21", "type": "c", "major": 237, "minor": 21},
                     {"path": "/dev/nvidia-caps/nvidia-cap22", "type": "c", "major": 237, "minor": 22}]


def test_simulated_capability_minors_follow_the_driver_table(node: Callable[..., Node]) -> None:
    # nv-caps.c: config 1, monitor 2, then 15 GIs x (1 + 8 CIs) per GPU minor
    assert [mig_cap_minor(0, 0), mig_cap_minor(0, 0, 0), mig_cap_minor(0, 1), mig_cap_minor(0, 1, 0),
            mig_cap_minor(0, 2, 0), mig_cap_minor(0, 14, 7), mig_cap_minor(1, 0)] == [3, 4, 12, 13, 22, 137, 138]
    mig = node(MIG_MACHINE)
    access = mig.root("/proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access")
    assert access.read_text() == "DeviceFileMinor: 22\nDeviceFileMode: 292\nDeviceFileModify: 1\n"
    assert not mig.root("/proc/driver/nvidia/capabilities/gpu1/mig").exists()  # GPU 1 has no MIG instances


def test_missing_capability_file_is_an_error_naming_it(node: Callable[..., Node]) -> None:
    mig = node(MIG_MACHINE)
    mig.root("/proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access").unlink()
    with pytest.raises(AgentError, match=r"/proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access is missing"):
        mig.spec()


def _unreadable(inventory: Inventory, index: int) -> Inventory:
    """`inventory` with GPU `index` as discovery has it once NVML cannot read it: as last read, marked."""
    lost = replace(inventory.gpus[index], unreadable="nvmlDeviceGetHandleByIndex: GPU is lost",
                   known_from="last reading")
    return replace(inventory, gpus=tuple(lost if gpu.index == index else gpu for gpu in inventory.gpus))


def test_a_gpu_nvml_cannot_read_keeps_its_devices_while_its_node_exists(node: Callable[..., Node]) -> None:
    """Issue 33: the spec does not change with a loss (a container restarted with the GPU resolves its name);
    once the GPU's device node is gone, its devices go (and `all` does not name a node that is not there)."""
    dgx = node("dgx-h100")
    dgx.make_device_nodes()
    inventory = dgx.inventory()
    files = cdi.discover(dgx.root, VERSION)
    lost = _unreadable(inventory, 3)
    assert cdi.build_spec(lost, dgx.root, files) == cdi.build_spec(inventory, dgx.root, files)
    dgx.root("/dev/nvidia3").unlink()
    spec = cdi.build_spec(lost, dgx.root, files)
    assert "3" not in names(spec) and inventory.gpus[3].uuid not in names(spec) and len(names(spec)) == 15
    assert "/dev/nvidia3" not in paths(device(spec, "all")["containerEdits"])
    assert "3" in names(cdi.build_spec(inventory, dgx.root, files))  # read now: listed, the runtime finds it
    assert not list(schema_validator().iter_errors(spec))


def test_a_gpu_nvml_cannot_read_keeps_the_mig_devices_the_driver_still_has(node: Callable[..., Node]) -> None:
    mig = node(MIG_MACHINE)
    mig.make_device_nodes()
    inventory = mig.inventory()
    files = cdi.discover(mig.root, VERSION)
    mig.root("/proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access").unlink()  # the driver dropped GI 2's
    spec = cdi.build_spec(_unreadable(inventory, 0), mig.root, files)
    assert names(spec)[:3] == ["0", "0:0", "1"] and inventory.gpus[0].mig.devices[1].uuid not in names(spec)
    with pytest.raises(AgentError, match="gi2/ci0/access is missing"):  # a GPU read now: the driver must have it
        cdi.build_spec(inventory, mig.root, files)


# --- determinism and change ----------------------------------------------------------------------


def test_unchanged_machine_renders_byte_identical(node: Callable[..., Node]) -> None:
    mig = node(MIG_MACHINE)
    mig.make_device_nodes()
    first = cdi.render(mig.spec())
    mig.nvml.close()
    mig.nvml = Nvml(FakeNvml(mig.state))  # a fresh NVML session, as after an agent restart
    assert cdi.render(mig.spec()) == first
    assert "&id" not in first and "*id" not in first  # repeated edits are written out, not aliased
    assert yaml.safe_load(first) == mig.spec()


def test_mig_change_changes_the_spec(node: Callable[..., Node]) -> None:
    mig = node(MIG_MACHINE)
    before = mig.spec()
    removed = mig.inventory().gpus[0].mig.devices[1].uuid
    with mig.state.edit() as state:  # what destroying the second GPU instance leaves
        state["gpus"][0]["mig"]["gpu_instances"].pop()
    after = mig.spec()
    assert cdi.render(after) != cdi.render(before)
    assert "0:1" not in names(after) and removed not in names(after) and "0:0" in names(after)
    assert paths(device(after, "all")["containerEdits"]) == [
        "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"]


# --- driver files ---------------------------------------------------------------------------------


def test_discover_keeps_to_the_driver_version_and_the_native_abi(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    cache = dgx.root(ldcache.PATH)
    entries = ldcache.read_cache(cache)
    assert any(e.path.startswith("/usr/lib/i386-linux-gnu/") for e in entries)  # 32-bit copies are there
    old = dgx.root(f"{LIB}/libnvidia-ml.so.535.104.05")
    old.write_text("left over from the previous driver\n")
    (dgx.root(f"{LIB}/libnvidia-ml.so.0")).symlink_to(old.name)
    other = dgx.root(f"{LIB}/libnvidia-egl-wayland.so.1.1.13")
    other.write_text("not ours\n")
    (dgx.root(f"{LIB}/libcuda.so")).symlink_to("libcuda.so.1")  # the development link: the same library again
    ldcache.write_cache(cache, [*entries, ldcache.CacheEntry("libnvidia-ml.so.0", f"{LIB}/libnvidia-ml.so.0"),
                                ldcache.CacheEntry("libcuda.so", f"{LIB}/libcuda.so"),
                                ldcache.CacheEntry("libnvidia-egl-wayland.so.1", f"{LIB}/{other.name}"),
                                ldcache.CacheEntry("libgone.so.1", f"{LIB}/libgone.so.1")])
    files = cdi.discover(dgx.root, VERSION)
    assert len(files.libraries) == 11 and files.missing == ()
    assert all(p.startswith(LIB + "/") and p.endswith(f".so.{VERSION}") for p in files.libraries)
    assert files.library_dirs == (LIB,)


def test_discover_follows_links_under_the_root(node: Callable[..., Node]) -> None:
    """A merged-/usr node lists /lib/...; an absolute link must resolve inside the root, not on this machine."""
    dgx = node("dgx-h100")
    (dgx.root("/lib/x86_64-gnu-test")).symlink_to(LIB)  # absolute: only valid under the root
    cache = dgx.root(ldcache.PATH)
    moved = [ldcache.CacheEntry(e.key, e.path.replace(LIB, "/lib/x86_64-gnu-test"), e.flags)
             for e in ldcache.read_cache(cache)]
    ldcache.write_cache(cache, moved)
    files = cdi.discover(dgx.root, VERSION)
    assert f"{LIB}/libcuda.so.{VERSION}" in files.libraries and len(files.libraries) == 11


def test_binaries_are_found_in_path_order_and_must_be_executable(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    local = dgx.root("/usr/local/bin/nvidia-smi")
    local.parent.mkdir(parents=True)
    local.write_text("#!/bin/sh\n")
    local.chmod(0o644)
    dgx.root("/usr/bin/nvidia-debugdump").unlink()
    assert cdi.discover(dgx.root, VERSION).binaries == (
        "/usr/bin/nvidia-smi", "/usr/bin/nvidia-persistenced", "/usr/bin/nvidia-cuda-mps-control",
        "/usr/bin/nvidia-cuda-mps-server")
    local.chmod(0o755)
    assert cdi.discover(dgx.root, VERSION).binaries[0] == "/usr/local/bin/nvidia-smi"


def test_no_gpus_is_an_error_not_an_empty_spec(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    with pytest.raises(AgentError, match="no GPUs"):
        cdi.build_spec(Inventory(VERSION, "12.4"), dgx.root, cdi.discover(dgx.root, VERSION))


def test_missing_userspace_is_reported_not_hidden(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    files = cdi.discover(dgx.root, "555.42.02")  # the kernel module's version, but userspace is 550
    assert files.libraries == () and files.firmware == ()
    assert files.missing == ("libcuda.so.555.42.02", "libnvidia-ml.so.555.42.02")
    spec = cdi.build_spec(dgx.inventory(), dgx.root, files)
    assert "hooks" not in spec["containerEdits"]  # nothing to link or cache
    dgx.root(ldcache.PATH).unlink()
    with pytest.raises(AgentError, match="etc/ld.so.cache: no ld.so cache; run ldconfig"):
        cdi.discover(dgx.root, VERSION)


def test_userspace_upgrade_replaces_the_old_version(node: Callable[..., Node]) -> None:
    dgx = node("dgx-h100")
    install_driver_userspace(dgx.path, "555.42.02")
    assert cdi.discover(dgx.root, VERSION).libraries == ()
    files = cdi.discover(dgx.root, "555.42.02")
    assert len(files.libraries) == 11 and files.firmware == (
        "/lib/firmware/nvidia/555.42.02/gsp_ga10x.bin", "/lib/firmware/nvidia/555.42.02/gsp_tu10x.bin")
    assert not list(dgx.root(LIB).glob(f"*.so.{VERSION}"))


@pytest.mark.parametrize("path", ["/", "/tmp/..", "/usr/../"])
def test_userspace_install_refuses_the_real_root(path: str) -> None:
    with pytest.raises(ValueError, match="never under /"):
        install_driver_userspace(Path(path), VERSION)


# --- cdiVersion ----------------------------------------------------------------------------------


def spec_with(*, device: Any = None, edits: Any = None, **top: Any) -> dict[str, Any]:
    return {"cdiVersion": "", "kind": top.pop("kind", "nvidia.com/gpu"),
            "devices": [{"name": "gpu", "containerEdits": {}, **(device or {})}], "containerEdits": edits or {}, **top}


@pytest.mark.parametrize("spec, version", [
    (spec_with(), "0.3.0"),
    (spec_with(edits={"mounts": [{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]}), "0.4.0"),
    (spec_with(device={"name": "0"}), "0.5.0"),
    (spec_with(edits={"deviceNodes": [{"path": "/dev/x", "hostPath": "/dev/y"}]}), "0.5.0"),
    (spec_with(annotations={"a": "b"}), "0.6.0"),
    (spec_with(device={"annotations": {"a": "b"}}), "0.6.0"),
    (spec_with(kind="nvidia.com/gpu.shared"), "0.6.0"),
    (spec_with(edits={"additionalGids": [44]}), "0.7.0"),
    (spec_with(device={"containerEdits": {"intelRdt": {"closID": "x"}}}), "0.7.0"),
    (spec_with(edits={"intelRdt": {"enableMonitoring": True}}), "1.1.0"),
    (spec_with(device={"containerEdits": {"netDevices": [{"hostInterfaceName": "eth1", "name": "n"}]}}), "1.1.0"),
    (spec_with(device={"name": "0", "annotations": {"a": "b"}}, edits={"additionalGids": [1]}), "0.7.0"),
])
def test_minimum_version_follows_the_cdi_rules(spec: dict[str, Any], version: str) -> None:
    assert cdi.minimum_version(spec) == version


# --- additionalGids (CDI 0.7.0) ---------------------------------------------------------------------

# nvidia-container-toolkit v1.20.0 (5505e2f9), internal/edits/device_test.go TestGetAdditionalGIDs, as
# (case, the node's group, its permission bits, additional_gids on) -> the groups the container gets.
# Upstream's cases without a GID or file mode have no counterpart: a node the agent can stat has both.
GROUP_CASES = [
    ("feature disabled", 1, 0o660, False, []),
    ("device node has zero GID", 0, 0o660, True, []),
    ("character device is world read-writeable", 1, 0o666, True, []),
    ("character device is only world readable", 1, 0o664, True, [1]),
    ("character device is only world writeable", 1, 0o662, True, [1]),
    ("character device is not world read-writeable", 1, 0o660, True, [1]),
]


@pytest.mark.parametrize("case, gid, mode, enabled, expected", GROUP_CASES, ids=[case[0] for case in GROUP_CASES])
def test_the_groups_a_device_node_needs_as_nvidia_ctk_1_20_gives_them(
        tmp_path: Path, case: str, gid: int, mode: int, enabled: bool, expected: list[int]) -> None:
    import os

    node_path = tmp_path / "dev/nvidia0"
    node_path.parent.mkdir()
    os.mknod(node_path, 0o600 | 0o020000, os.makedev(195, 0))  # a character device, as the driver's
    os.chown(node_path, 0, gid)
    os.chmod(node_path, mode)
    assert (cdi.group_ids(Root(tmp_path), ["/dev/nvidia0"]) if enabled else []) == expected
    (tmp_path / "dev/regular").write_text("")
    os.chown(tmp_path / "dev/regular", 0, 1)
    assert cdi.group_ids(Root(tmp_path), ["/dev/regular", "/dev/missing"]) == []  # no character device: none


def test_a_spec_with_additional_gids_is_0_7_0_and_valid_cdi(node: Callable[..., Node]) -> None:
    import os

    dgx = node("dgx-h100").load("nvidia_uvm")
    dgx.make_device_nodes()
    os.chown(dgx.root("/dev/nvidia0"), 0, 44)
    os.chmod(dgx.root("/dev/nvidia0"), 0o660)
    without = dgx.spec()
    assert without["cdiVersion"] == "0.5.0" and "additionalGids" not in device(without, "0")["containerEdits"]
    assert device(without, "0")["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "gid": 44}]  # the group: written when not 0
    spec = dgx.spec(additional_gids=True)
    assert spec["cdiVersion"] == "0.7.0" and device(spec, "0")["containerEdits"]["additionalGids"] == [44]
    assert device(spec, "all")["containerEdits"]["additionalGids"] == [44]
    assert "additionalGids" not in device(spec, "1")["containerEdits"]  # 0666 root:root: anyone opens it
    assert "additionalGids" not in spec["containerEdits"]
    assert not list(schema_validator().iter_errors(yaml.safe_load(cdi.render(spec))))


@pytest.mark.parametrize("name, version, reads", [
    ("containerd", "1.7.15", False), ("containerd", "1.7.16", True), ("containerd", "1.7.24~ds1", True),
    ("containerd", "1.6.20~ds1", False), ("containerd", "2.0.0", True), ("k3s", "1.7.23-k3s2", True),
    ("crio", "1.29.13", False), ("crio", "1.30.0", True),
    ("podman", "4.3.1+ds1", False), ("podman", "5.0.3", False), ("podman", "5.1.0", True), ("podman", "5.4.2", True),
    ("docker", "20.10.24+dfsg1", False), ("docker", "25.0.16", False), ("docker", "25.0.17", True),
    ("docker", "26.0.2", False), ("docker", "26.1.0", True), ("docker", "26.1.5+dfsg1", True),
    ("nerdctl", "2.1.0", False), ("containerd", None, None),
])
def test_which_cdi_readers_take_a_0_7_0_spec(name: str, version: Any, reads: Any) -> None:
    from gpu_agent.toolkit.cdi_readers import reads_070
    from gpu_agent.toolkit.devicepath import Found

    assert reads_070(Found(name, version)) is reads


def test_additional_gids_only_where_every_reader_takes_them(tmp_path: Path) -> None:
    from gpu_agent.config.toolkit import CdiConfig
    from gpu_agent.stages.cdi import Cdi
    from gpu_agent.toolkit.devicepath import Found, Inputs, choose

    def decide(setting: Any, *readers: tuple[str, str], consumers: tuple[tuple[str, str], ...] = ()) -> Any:
        path = choose(Inputs(runtimes=tuple(Found(n, v) for n, v in readers), kubelet="1.31.4",
                             consumers=tuple(Found(n, v) for n, v in consumers)))
        stage = Cdi(Root(tmp_path), CdiConfig(additional_gids=setting), None, None)  # type: ignore[arg-type]
        return stage._additional_gids(path)

    assert decide("auto", ("containerd", "1.7.24~ds1"), ("docker", "26.1.5+dfsg1"),
                  consumers=(("podman", "5.4.2"),)) == (True, "")  # Debian 13
    on, why = decide("auto", ("containerd", "1.7.24~ds1"), consumers=(("podman", "4.3.1+ds1"),))
    assert not on and "refused by Podman 4.3.1+ds1 (from 5.1.0)" in why and "stays at the version" in why
    on, why = decide("auto", ("containerd", None))
    assert not on and "containerd (version unknown): version unknown" in why
    assert decide("auto", ("containerd", "1.6.20")) == (False, "no CDI reader whose version says it reads "
                                                             "cdiVersion 0.7.0 (toolkit.cdi.additional_gids: auto)")
    assert decide(False, ("containerd", "2.0.2")) == (False, "toolkit.cdi.additional_gids is false")
    assert decide(True, ("containerd", "1.7.15"))[0] is True
