"""Credential files and the ledger behind symbolic links: followed under --root, as in a chroot.

The kubelet writes kubelet-client-current.pem as an absolute link (to kubelet-client-2026-...pem):
under --root that target is a path under the root, never the real host's file of that name. Each
kind of file the agent reads (kubeconfig, token file, CA and client certificate, ledger.json) gets
the two cases: an absolute link that stays inside the root works; one whose target exists only on
the real host (outside the root) is not read, and the error names the link and where it leads.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from kube_emulator import KubeEmulator

from gpu_agent.errors import AgentError
from gpu_agent.host.ledger import PATH as LEDGER, Ledger, LedgerError, Owned
from gpu_agent.host.paths import Root, followed
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.client import ApiError, KubeClient
from gpu_agent.kube.kubeconfig import load, read_token

KUBECONFIG = "/etc/kubernetes/kubelet.conf"
NODE = "gpu-node-1"


def link(root: Path, host_path: str, target: str) -> None:
    """The link `host_path` under the root, pointing at `target` as written (absolute: as the kubelet does)."""
    place = root / host_path.lstrip("/")
    place.parent.mkdir(parents=True, exist_ok=True)
    place.symlink_to(target)


def put(root: Path, host_path: str, data: bytes | str) -> None:
    place = root / host_path.lstrip("/")
    place.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    place.write_bytes(data)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory of the real host, outside the root: what a link must never lead to."""
    path = tmp_path / "host"
    path.mkdir()
    return path


@pytest.fixture
def api(tmp_path: Path) -> Iterator[KubeEmulator]:
    with KubeEmulator(tmp_path / "pki", nodes=(NODE,)) as emulator:
        yield emulator


def kubeconfig(server: str, user: str, cluster: str = "") -> str:
    return (f"apiVersion: v1\nclusters:\n- name: c\n  cluster:\n    server: {server}\n{cluster}"
            "contexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n"
            f"users:\n- name: u\n  user:\n{user}")


TOKEN_USER = "    token: abc\n"


def test_paths_are_followed_as_in_a_chroot(root: Path) -> None:
    link(root, "/var/run", "/run")
    link(root, "/etc/up", "../../../../../../../../../../data")  # '..' above '/' stays at '/'
    assert followed(Root(root), "/var/run/x/y") == "/run/x/y"  # missing parts are joined as written
    assert followed(Root(root), "/etc/up/f") == "/data/f"
    link(root, "/loop", "/loop")
    with pytest.raises(OSError, match="Too many levels"):
        followed(Root(root), "/loop/f")


# --- the kubeconfig ------------------------------------------------------------------------------

def test_a_kubeconfig_behind_an_absolute_link_inside_the_root_is_read(root: Path) -> None:
    put(root, "/etc/kubernetes/kubelet-2026.conf", kubeconfig("https://10.0.0.1:6443", TOKEN_USER))
    link(root, KUBECONFIG, "/etc/kubernetes/kubelet-2026.conf")
    assert load(Root(root), KUBECONFIG).server == "https://10.0.0.1:6443"


def test_a_kubeconfig_link_to_the_real_hosts_file_is_not_followed_there(root: Path, outside: Path) -> None:
    put(outside, "/kubelet.conf", kubeconfig("https://10.0.0.1:6443", TOKEN_USER))
    link(root, KUBECONFIG, str(outside / "kubelet.conf"))
    with pytest.raises(AgentError) as raised:
        load(Root(root), KUBECONFIG)
    assert str(raised.value) == f"kubeconfig {KUBECONFIG} (a link to {outside}/kubelet.conf) not found"


# --- the token file ------------------------------------------------------------------------------

def test_a_token_file_behind_an_absolute_link_inside_the_root_is_read(root: Path) -> None:
    put(root, KUBECONFIG, kubeconfig("https://10.0.0.1:6443", "    tokenFile: /var/lib/kubelet/token\n"))
    put(root, "/run/secrets/token-1", "node-token\n")
    link(root, "/var/lib/kubelet/token", "/run/secrets/token-1")
    assert read_token(Root(root), load(Root(root), KUBECONFIG)) == "node-token"


def test_a_token_file_link_that_climbs_out_of_the_root_is_resolved_inside(root: Path, outside: Path) -> None:
    put(root, KUBECONFIG, kubeconfig("https://10.0.0.1:6443", "    tokenFile: /var/lib/kubelet/token\n"))
    put(outside, "/token", "the-real-hosts-token\n")
    climb = "../" * 20 + str(outside.relative_to("/")) + "/token"  # from /var/lib/kubelet, far above '/'
    link(root, "/var/lib/kubelet/token", climb)
    credentials = load(Root(root), KUBECONFIG)
    with pytest.raises(AgentError, match=f"token file /var/lib/kubelet/token \\(a link to {outside}/token\\) "
                                         "not found"):
        read_token(Root(root), credentials)
    put(root, f"{outside}/token", "the-roots-token\n")  # the same path under the root: that one is read
    assert read_token(Root(root), credentials) == "the-roots-token"


# --- the CA file and the client certificate --------------------------------------------------------

def cert_files(api: KubeEmulator, root: Path, ca: str = "/etc/kubernetes/pki/ca.crt",
               pem: str = "/var/lib/kubelet/pki/kubelet-client-current.pem") -> KubeClient:
    put(root, KUBECONFIG, kubeconfig(api.url, f"    client-certificate: {pem}\n    client-key: {pem}\n",
                                     f"    certificate-authority: {ca}\n"))
    return KubeClient(Root(root), KUBECONFIG, 5, RequestBudget())


def test_the_kubelets_rotating_certificate_link_and_a_linked_ca_are_followed_inside_the_root(
        api: KubeEmulator, root: Path) -> None:
    ours = api.node_credentials(NODE)
    put(root, "/var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem", ours.cert_pem + ours.key_pem)
    link(root, "/var/lib/kubelet/pki/kubelet-client-current.pem",
         "/var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem")  # as the kubelet writes it
    put(root, "/etc/ssl/cluster-ca.pem", api.ca_pem)
    link(root, "/etc/kubernetes/pki/ca.crt", "/etc/ssl/cluster-ca.pem")
    assert cert_files(api, root).get_node(NODE)["metadata"]["name"] == NODE
    assert [r.user for r in api.requests] == [f"system:node:{NODE}"]


def test_a_client_certificate_link_to_the_real_hosts_file_is_not_used(api: KubeEmulator, root: Path,
                                                                      outside: Path) -> None:
    ours = api.node_credentials(NODE)
    put(outside, "/kubelet-client.pem", ours.cert_pem + ours.key_pem)  # valid, but not the root's
    link(root, "/var/lib/kubelet/pki/kubelet-client-current.pem", str(outside / "kubelet-client.pem"))
    put(root, "/etc/kubernetes/pki/ca.crt", api.ca_pem)
    with pytest.raises(ApiError) as raised:
        cert_files(api, root).get_node(NODE)
    assert (f"/var/lib/kubelet/pki/kubelet-client-current.pem (a link to {outside}/kubelet-client.pem) "
            "not found") in str(raised.value)
    assert api.requests == []


def test_a_ca_link_to_the_real_hosts_file_is_not_used(api: KubeEmulator, root: Path, outside: Path) -> None:
    ours = api.node_credentials(NODE)
    put(root, "/var/lib/kubelet/pki/kubelet-client-current.pem", ours.cert_pem + ours.key_pem)
    put(outside, "/ca.crt", api.ca_pem)
    link(root, "/etc/kubernetes/pki/ca.crt", str(outside / "ca.crt"))
    with pytest.raises(ApiError, match=f"/etc/kubernetes/pki/ca.crt \\(a link to {outside}/ca.crt\\) not found"):
        cert_files(api, root).get_node(NODE)
    assert api.requests == []


# --- the ledger ----------------------------------------------------------------------------------

ENTRY = Owned("/etc/x.conf", "toolkit", None, "sha256:0")


def test_a_ledger_behind_absolute_links_inside_the_root_is_read_and_written_through(root: Path) -> None:
    link(root, "/var/lib", "/data/var-lib")  # /var/lib on another file system, linked absolutely
    (root / "data/var-lib/gpu-agent").mkdir(parents=True)
    Ledger(Root(root)).own(ENTRY)
    stored = root / "data/var-lib/gpu-agent/ledger.json"
    assert "/etc/x.conf" in json.loads(stored.read_text())["owned"]
    assert Ledger(Root(root)).owned()["/etc/x.conf"] == ENTRY
    assert (root / "var/lib").is_symlink()


def test_a_ledger_link_to_the_real_hosts_file_is_neither_read_nor_written_there(root: Path, outside: Path) -> None:
    host_ledger = outside / "ledger.json"
    host_text = json.dumps({"version": 1, "owned": {"/etc/host.conf": {
        "owner": "toolkit", "original": None, "written": "sha256:1", "restart": None}}})
    host_ledger.write_text(host_text)
    link(root, LEDGER, str(host_ledger))
    ledger = Ledger(Root(root))
    # The host's file is not the root's ledger; under the root the link leads nowhere, which is refused
    # (taken for "no ledger", uninstall would say there is nothing to undo) rather than read or written.
    with pytest.raises(LedgerError, match="a link that leads to nothing under the root"):
        ledger.owned()
    with pytest.raises(LedgerError, match="a link that leads to nothing under the root"):
        ledger.own(ENTRY)
    assert host_ledger.read_text() == host_text
    assert not (root / str(host_ledger).lstrip("/")).exists()
