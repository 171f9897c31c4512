"""The kubeconfig reader: what it accepts, and errors that name the place without showing the file."""
from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from gpu_agent.errors import AgentError
from gpu_agent.host.paths import Root
from gpu_agent.kube.budget import RequestBudget
from gpu_agent.kube.client import ApiError, KubeClient
from gpu_agent.kube.kubeconfig import load

PATH = "/etc/kubernetes/kubelet.conf"
BASE = """apiVersion: v1
clusters:
- name: kubernetes
  cluster:
    server: {server}
{cluster}contexts:
- name: node
  context: {{cluster: kubernetes, user: node}}
current-context: node
users:
- name: node
  user:
    token: abc.def-ghi_123
"""


def write(root: Path, server: str = "https://10.0.0.1:6443", cluster: str = "", text: str = "") -> Root:
    path = root / PATH.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text or BASE.format(server=server, cluster=cluster))
    return Root(root)


def error(root: Root) -> str:
    with pytest.raises(AgentError) as raised:
        load(root, PATH)
    return str(raised.value)


def test_a_kubelet_kubeconfig_is_read(root: Path) -> None:
    credentials = load(write(root, server="https://10.0.0.1:6443/"), PATH)
    assert (credentials.server, credentials.token, credentials.user) == ("https://10.0.0.1:6443", "abc.def-ghi_123",
                                                                         "node")
    assert "abc.def" not in repr(credentials)  # a dataclass repr would show the token


def test_a_yaml_error_gives_file_line_and_column_only(root: Path) -> None:
    text = BASE.format(server="https://10.0.0.1:6443", cluster="").replace("token: abc.def-ghi_123",
                                                                           "token: abc.def: ghi")
    message = error(write(root, text=text))
    assert message.startswith(f"kubeconfig {PATH}:13:19: not valid YAML: ")
    assert "abc" not in message and "ghi" not in message


def test_a_wrong_type_names_the_key_not_the_value(root: Path) -> None:
    message = error(write(root, cluster="    insecure-skip-tls-verify: 'false'\n"))
    assert message == (f"kubeconfig {PATH}: clusters[0].cluster.insecure-skip-tls-verify: expected true or false, "
                       "found a string")


@pytest.mark.parametrize("server,reason", [
    ("https://admin:hunter2@10.0.0.1:6443", "https://...@10.0.0.1:6443 carries a user name or password"),
    ("https://10.0.0.1:6443?x=hunter2", "a query ('?') or fragment ('#') has no place in a server URL"),
    ("10.0.0.1:6443", "expected https://HOST[:PORT]"),
    ("https://10.0.0.1:hunter2", "not a URL the agent can use"),
])
def test_a_server_url_that_cannot_be_used_is_refused(root: Path, server: str, reason: str) -> None:
    message = error(write(root, server=server))
    assert message.startswith(f"kubeconfig {PATH}: clusters[0].cluster.server: ") and reason in message
    assert "hunter2" not in message and "admin" not in message


def test_a_path_with_a_nul_is_refused_naming_the_key(root: Path) -> None:
    text = BASE.format(server="https://10.0.0.1:6443", cluster="") + '    tokenFile: "/var/lib/\\0token"\n'
    assert error(write(root, text=text)) == (f"kubeconfig {PATH}: users[0].user.tokenFile: a path cannot hold a "
                                             "NUL character")


def test_a_fifo_is_refused_without_waiting_for_a_writer(root: Path) -> None:
    path = root / PATH.lstrip("/")
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    assert error(Root(root)) == f"kubeconfig {PATH} is not a regular file"


def test_requests_go_under_the_servers_path(root: Path) -> None:
    """A server behind a proxy (https://proxy/k8s/clusters/c1) is reached under its path."""
    from kube_emulator import KubeEmulator

    with KubeEmulator(root.parent / "pki") as api:
        api.add_token("abc.def-ghi_123", "system:node:gpu-node-1", ["system:nodes"])
        ca = base64.b64encode(api.ca_pem).decode()
        write(root, server=api.url + "/k8s/clusters/c1/", cluster=f"    certificate-authority-data: {ca}\n")
        with pytest.raises(ApiError, match="404"):
            KubeClient(Root(root), PATH, 5, RequestBudget()).get_node("gpu-node-1")
        assert [r.path for r in api.requests] == ["/k8s/clusters/c1/api/v1/nodes/gpu-node-1"]


def test_a_request_that_cannot_be_formed_spends_none_of_the_budget(root: Path) -> None:
    text = BASE.format(server="https://10.0.0.1:6443", cluster="") + "    tokenFile: /var/lib/kubelet/token\n"
    budget = RequestBudget(per_minute=1)
    client = KubeClient(write(root, text=text), PATH, 5, budget)
    for _ in range(3):
        with pytest.raises(AgentError, match="token file /var/lib/kubelet/token not found"):
            client.get_node("gpu-node-1")
    assert budget.take() and not budget.take()


def test_a_kubeconfigs_ca_is_the_only_one_trusted(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With certificate-authority(-data) set, a server certificate from another CA fails, even one the
    system's bundle trusts (SSL_CERT_FILE stands for that bundle here), as client-go's RootCAs do."""
    from kube_emulator import KubeEmulator, write_kubeconfig

    with KubeEmulator(root.parent / "cluster-pki") as cluster, KubeEmulator(root.parent / "public-pki") as impostor:
        monkeypatch.setenv("SSL_CERT_FILE", str(impostor.pki.ca_path))
        node = cluster.node_credentials("gpu-node-1")
        write_kubeconfig(root / PATH.lstrip("/"), impostor.url, user=node, ca_pem=cluster.pki.ca_pem)
        with pytest.raises(ApiError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            KubeClient(Root(root), PATH, 5, RequestBudget()).get_node("gpu-node-1")
        assert impostor.requests == []
        write_kubeconfig(root / PATH.lstrip("/"), cluster, user=node)
        node_object = KubeClient(Root(root), PATH, 5, RequestBudget()).get_node("gpu-node-1")
        assert node_object["metadata"]["name"] == "gpu-node-1"


@pytest.mark.parametrize("name", ["../../api/v1/namespaces/kube-system/secrets/x", "a?watch=1#x", "nœud", "GPU-1",
                                  "..", ""])
def test_a_node_name_that_is_not_one_never_reaches_a_request_path(root: Path, name: str) -> None:
    """Config and hostname are validated where they are read; the client refuses such a name again,
    before a byte is sent or the budget is spent."""
    budget = RequestBudget(per_minute=1)
    client = KubeClient(write(root), PATH, 5, budget)
    with pytest.raises(ApiError, match="is not a Kubernetes Node name|is empty") as raised:
        client.patch_node(name, {"metadata": {}})
    assert "set kubernetes.node_name" in str(raised.value)
    assert budget.take()
