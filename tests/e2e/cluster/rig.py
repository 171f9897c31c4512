"""The real cluster of issue 34 in one booted Debian 13 machine (systemd-nspawn): etcd, kube-apiserver and a
kubelet built from upstream (components.py), Debian 13's containerd 1.7 or the built containerd 2.x, and the
agent from its .deb.

The apiserver authorizes with Node,RBAC and admits with NodeRestriction; the kubelet holds a client
certificate as kubeadm leaves it (CN system:node:<node>, O system:nodes, behind the symbolic link
/var/lib/kubelet/pki/kubelet-client-current.pem) and the agent uses the kubelet's kubeconfig. The
certificates are made here with the tests' PKI (kube_emulator.KubePKI: the cluster CA, the apiserver's
serving certificate, client certificates).

The machine has a private network namespace: the loopback and one link (a veth pair, both ends inside)
with an address of the documentation range, which the apiserver advertises and the kubelet reports as its
node IP; no packet leaves it. The tests reach the apiserver through that namespace (nsenter -n, the
host's curl), and containerd through crictl inside.

What this machine lacks and what stands in:
- no cgroup controllers in the booted system's cgroup v2 tree (this machine binds them to cgroup v1):
  the kubelet runs without QoS cgroups (cgroupsPerQOS false, no node allocatable enforcement) and
  containerd's CRI makes no cgroups (disable_cgroup), as in tests/e2e/test_runtimes.py;
- no /dev/kmsg (the kubelet's OOM watcher will not start without it): a link to the console;
- a read-only /proc/sys whose kernel settings are the host's: the three the kubelet checks at start
  (KUBELET_SYSCTLS) show its values through files bound over them, and the host's are left alone;
- the apiserver allows anonymous requests, as its default and kubeadm's are (they get 403, not 401);
- containerd 2.x (the second runtime, RUNTIMES): no distribution packages it for Debian 13, so the built
  binaries replace the package's and its record names their version; with no cgroup controllers and no
  disable_cgroup in 2.x, a runc wrapper first on PATH drops the resource limits (not the device rules)
  from each container's spec;
- no scheduler and no controller-manager: pods are bound by spec.nodeName, run on the host network
  (no CNI plugin), with no service account token mounted.
"""
from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from components import CONTAINERD, CRICTL, ETCD, KUBERNETES, missing
from conftest import Container, run, runtimes_root
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from kube_emulator import KubePKI
from test_runtimes import STAND_INS, _busybox_image

ADDRESS = "192.0.2.10"  # TEST-NET-1, on the machine's own veth link
API = "https://127.0.0.1:6443"
PKI = "/etc/kubernetes/pki"
KUBELET_CONF = "/etc/kubernetes/kubelet.conf"  # kubeadm's path, and the agent's default kubeconfig
KUBELET_PEM = "/var/lib/kubelet/pki/kubelet-client-current.pem"
AUDIT_LOG = "/var/log/kubernetes/audit.log"
BIN = "/usr/local/bin"

# Every request that writes a Node or its status, with who sent it (user and user agent) and what it sent:
# the tests count them (a pass with nothing to change must send none) and read a driver reload's patches.
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Request
  verbs: [create, update, patch, delete]
  resources: [{group: "", resources: [nodes, nodes/status]}]
- level: None
"""


def _unit(description: str, exec_start: str, after: str = "", kind: str = "simple") -> str:
    return (f"[Unit]\nDescription={description}\n{f'After={after}' if after else ''}\n\n"
            f"[Service]\nType={kind}\nExecStart={exec_start}\nRestart=on-failure\nRestartSec=2s\n"
            "LimitNOFILE=65536\n")


def _etcd_unit() -> str:
    peer, client = "http://127.0.0.1:2380", "http://127.0.0.1:2379"
    return _unit("etcd, the cluster's store", " ".join([
        f"{BIN}/etcd", "--name=node", "--data-dir=/var/lib/etcd", f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}", f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=node={peer}", "--log-level=warn"]), kind="notify")


def _apiserver_unit() -> str:
    return _unit("kube-apiserver", " ".join([
        f"{BIN}/kube-apiserver", "--etcd-servers=http://127.0.0.1:2379", f"--advertise-address={ADDRESS}",
        "--secure-port=6443", f"--tls-cert-file={PKI}/apiserver.crt", f"--tls-private-key-file={PKI}/apiserver.key",
        f"--client-ca-file={PKI}/ca.crt", "--authorization-mode=Node,RBAC",
        "--kubelet-preferred-address-types=InternalIP",  # the node IP: its name would be looked up in DNS
        "--enable-admission-plugins=NodeRestriction", "--allow-privileged=true",
        f"--kubelet-client-certificate={PKI}/apiserver-kubelet-client.crt",
        f"--kubelet-client-key={PKI}/apiserver-kubelet-client.key",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={PKI}/sa.pub", f"--service-account-signing-key-file={PKI}/sa.key",
        "--audit-policy-file=/etc/kubernetes/audit-policy.yaml", f"--audit-log-path={AUDIT_LOG}"]),
        after="etcd.service")


def _kubelet_unit() -> str:
    return _unit("kubelet", f"{BIN}/kubelet --config=/var/lib/kubelet/config.yaml --kubeconfig={KUBELET_CONF} "
                            f"--node-ip={ADDRESS} --v=2", after="containerd.service kube-apiserver.service")


KUBELET_CONFIG = """apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: /etc/kubernetes/pki/ca.crt}
authorization: {mode: AlwaysAllow}
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
rotateCertificates: false
evictionHard: {memory.available: "0%", nodefs.available: "0%", imagefs.available: "0%"}
"""


def _kubeconfig(ca_pem: bytes, user: str, certificate: str, key: str) -> str:
    ca = base64.b64encode(ca_pem).decode()
    return (f"apiVersion: v1\nkind: Config\nclusters:\n- name: kubernetes\n  cluster:\n"
            f"    certificate-authority-data: {ca}\n    server: https://{ADDRESS}:6443\n"
            f"contexts:\n- name: {user}@kubernetes\n  context: {{cluster: kubernetes, user: '{user}'}}\n"
            f"current-context: {user}@kubernetes\n"
            f"users:\n- name: '{user}'\n  user:\n    client-certificate: {certificate}\n    client-key: {key}\n")


@dataclass
class Answer:
    status: int
    body: Any


class Cluster:
    """The booted machine, its node's name, and the admin's way to the apiserver."""

    def __init__(self, container: Container, directory: Path, node: str, pki: KubePKI) -> None:
        self.container = container
        self.directory = directory
        self.node = node
        self.pki = pki
        self.admin = pki.client_cert("kubernetes-admin", ("system:masters",))
        self.runtime = "containerd-1.7"  # a key of RUNTIMES

    def api(self, method: str, path: str, body: Optional[Any] = None, content_type: str = "application/json",
            cert: Optional[Path] = None, anonymous: bool = False) -> Answer:
        """One request to the apiserver as the admin (or as `cert`'s user, or with no certificate), from
        inside the machine's network."""
        argv = ["nsenter", "-t", str(self.container.init_pid), "-n", "curl", "-sS", "--cacert",
                str(self.pki.ca_path), "-X", method, "-w", "\n%{http_code}", "-H", "Accept: application/json"]
        if not anonymous:
            argv += ["--cert", str(cert or self.admin.combined_path)]
        if body is not None:
            argv += ["-H", f"Content-Type: {content_type}", "--data-binary", json.dumps(body)]
        done = run([*argv, API + path], timeout=60, check=False)
        if done.returncode != 0:  # not listening yet, or gone: what curl says, as the body
            return Answer(0, done.stderr.strip())
        text, _, code = done.stdout.rpartition("\n")
        try:
            parsed = json.loads(text) if text.strip() else None
        except ValueError:
            parsed = text
        return Answer(int(code), parsed)

    def get(self, path: str) -> Any:
        answer = self.api("GET", path)
        assert answer.status == 200, (path, answer)
        return answer.body

    def node_object(self) -> dict[str, Any]:
        found: dict[str, Any] = self.get(f"/api/v1/nodes/{self.node}")
        return found

    def wait(self, what: str, predicate: Any, timeout: float = 180) -> Any:
        """predicate() until it answers something true; its answer. On timeout, what was last seen."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(1)
        raise AssertionError(f"{what}: not within {timeout:.0f} s; last: {last!r}\n{self.journal()}")

    def journal(self, *units: str, lines: int = 40) -> str:
        chosen = units or ("kube-apiserver", "kubelet", "gpu-agent", "containerd")
        return "\n".join(self.container.exec("journalctl", "--no-pager", "-o", "cat", "-n", str(lines), "-u", unit,
                                             check=False).stdout for unit in chosen)

    def audit(self) -> list[dict[str, Any]]:
        text = self.container.exec("cat", AUDIT_LOG, check=False).stdout
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def _write(root: Path, path: str, content: str | bytes, mode: int = 0o644) -> None:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    target.write_bytes(content)
    target.chmod(mode)


# What the machine runs; its runtime is Debian 13's containerd 1.7, or the built containerd 2.x (RUNTIMES).
NEEDED = (KUBERNETES, ETCD, CRICTL, CONTAINERD)
RUNTIMES = {"containerd-1.7": "1.7.24", "containerd-2": CONTAINERD.version.lstrip("v")}

# Without cgroup controllers, containerd 2.x (which has no disable_cgroup) makes runc write limits to
# files that are not there. runc as the shim finds it first on PATH drops the limits from the bundle's
# spec and runs Debian's runc: the device rules stay, so the container's devices are what the CRI asked.
RUNC_WITHOUT_LIMITS = """#!/usr/bin/python3
import json, os, sys
args = sys.argv[1:]
if "create" in args or "run" in args:
    bundle = next((args[i + 1] for i, a in enumerate(args) if a in ("--bundle", "-b")), ".")
    path = os.path.join(bundle, "config.json")
    with open(path) as file:
        spec = json.load(file)
    resources = spec.get("linux", {}).get("resources")
    if resources:
        spec["linux"]["resources"] = {"devices": resources.get("devices", [])}
        with open(path, "w") as file:
            json.dump(spec, file)
os.execv("/usr/bin/runc", ["runc", *args])
"""


def _install_components(root: Path, runtime: str) -> None:
    lacking = missing(NEEDED)
    if lacking:
        raise RuntimeError("the cluster rig's components are not built:\n  " + "\n  ".join(lacking))
    for component in (KUBERNETES, ETCD, CRICTL):
        for name in component.binaries:
            shutil.copy(component.binary(name), root / BIN.lstrip("/") / name)
    if runtime == "containerd-2":
        _containerd_2(root)


def _containerd_2(root: Path) -> None:
    """containerd 2.x as a distribution's package of it would be (Debian 13 has 1.7 only): the built
    binaries in place of the package's, its record naming their version; the package's version 2 root
    config stays, as an upgrade leaves it."""
    for name in CONTAINERD.binaries:
        shutil.copy(CONTAINERD.binary(name), root / "usr/bin" / name)
    status = root / "var/lib/dpkg/status"
    text = status.read_text()
    record = re.search(r"^Package: containerd\n(?:.+\n)*?Version: (\S+)\n", text, re.M)
    assert record, "no containerd package record"
    start, end = record.span(1)
    status.write_text(text[:start] + f"{RUNTIMES['containerd-2']}-0+rig1" + text[end:])
    _write(root, "/usr/local/sbin/runc", RUNC_WITHOUT_LIMITS, 0o755)


def _install_pki(root: Path, pki: KubePKI, node: str) -> None:
    _write(root, f"{PKI}/ca.crt", pki.ca_pem)
    server = pki.serving_cert("kube-apiserver-rig", ("127.0.0.1", ADDRESS, "10.0.0.1"),
                              ("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"))
    _write(root, f"{PKI}/apiserver.crt", server.cert_pem)
    _write(root, f"{PKI}/apiserver.key", server.key_pem, 0o600)
    kubelet_client = pki.client_cert("kube-apiserver-kubelet-client", ("system:masters",), key_type="rsa")
    _write(root, f"{PKI}/apiserver-kubelet-client.crt", kubelet_client.cert_pem)
    _write(root, f"{PKI}/apiserver-kubelet-client.key", kubelet_client.key_pem, 0o600)
    account = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write(root, f"{PKI}/sa.key", account.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.TraditionalOpenSSL,
                                                         serialization.NoEncryption()), 0o600)
    _write(root, f"{PKI}/sa.pub", account.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    # kubeadm's layout once the kubelet has its certificate: one dated PEM with certificate and key, the
    # kubeconfig naming the -current link for both.
    credentials = pki.node_cert(node)
    dated = "/var/lib/kubelet/pki/kubelet-client-2026-01-01-00-00-00.pem"
    _write(root, dated, credentials.cert_pem + credentials.key_pem, 0o600)
    (root / KUBELET_PEM.lstrip("/")).symlink_to(dated)
    _write(root, KUBELET_CONF, _kubeconfig(pki.ca_pem, f"system:node:{node}", KUBELET_PEM, KUBELET_PEM), 0o600)


def prepare(directory: Path, node: str, pki: KubePKI, runtime: str = "containerd-1.7") -> None:
    """The machine's tree before it boots: binaries, certificates, configs and units."""
    _install_components(directory, runtime)
    _install_pki(directory, pki, node)
    _write(directory, "/etc/hostname", node + "\n")
    _write(directory, "/etc/kubernetes/audit-policy.yaml", AUDIT_POLICY)
    _write(directory, "/var/lib/kubelet/config.yaml", KUBELET_CONFIG)
    (directory / "var/lib/kubelet/device-plugins").mkdir(parents=True, exist_ok=True)
    (directory / "var/log/kubernetes").mkdir(parents=True, exist_ok=True)
    for name, text in (("etcd", _etcd_unit()), ("kube-apiserver", _apiserver_unit()), ("kubelet", _kubelet_unit())):
        _write(directory, f"/etc/systemd/system/{name}.service", text)
    # The toolkit's binaries as tests/e2e/test_runtimes.py stands them in (the runtime passes to runc), and
    # the busybox image's tarball.
    for path, text in STAND_INS.items():
        _write(directory, path, text, 0o755)
    _write(directory, IMAGE_TAR, _busybox_image(directory))
    config = directory / "etc/containerd/config.toml"
    table = '  [plugins."io.containerd.grpc.v1.cri"]\n'
    assert table in config.read_text(), config.read_text()
    config.write_text(config.read_text().replace(
        table, table + "    restrict_oom_score_adj = true\n    disable_cgroup = true\n"))


def _network(container: Container) -> None:
    pid = str(container.init_pid)
    # A veth pair with both ends inside (this machine's kernel has no dummy links): up, so routes work.
    for argv in (["ip", "link", "add", "rig0", "type", "veth", "peer", "name", "rig1"],
                 ["ip", "addr", "add", f"{ADDRESS}/24", "dev", "rig0"], ["ip", "link", "set", "rig1", "up"],
                 ["ip", "link", "set", "rig0", "up"], ["ip", "route", "add", "default", "dev", "rig0"]):
        run(["nsenter", "-t", pid, "-n", *argv])


# The kernel settings the kubelet insists on (it writes them where they differ), and what they are here:
# /proc/sys is read-only in the machine and they are not namespaced, so the host's stay as they are and
# the machine's /proc/sys shows the kubelet's values, each file bound over by one holding it.
KUBELET_SYSCTLS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}


def _kernel_stand_ins(container: Container) -> None:
    script = ["mkdir -p /run/rig-sysctl", "ln -sf /dev/console /dev/kmsg"]  # the kubelet's OOM watcher opens it
    for key, value in KUBELET_SYSCTLS.items():
        held = f"/run/rig-sysctl/{key.replace('/', '.')}"
        script += [f"echo {value} > {held}", f"mount --bind {held} /proc/sys/{key}"]
    container.sh(" && ".join(script))


def start(container: Container, directory: Path, node: str, pki: KubePKI) -> Cluster:
    """etcd, the apiserver and the kubelet started in turn on the booted machine; the Node registered."""
    _network(container)
    _kernel_stand_ins(container)
    cluster = Cluster(container, directory, node, pki)
    container.exec("systemctl", "start", "etcd", timeout=120)
    container.exec("systemctl", "start", "kube-apiserver")
    cluster.wait("the apiserver's /readyz", lambda: cluster.api("GET", "/readyz").status == 200, timeout=240)
    # No controller-manager makes the namespace's service account: the pods' admission needs it.
    cluster.wait("the default namespace", lambda: cluster.api("GET", "/api/v1/namespaces/default").status == 200)
    created = cluster.api("POST", "/api/v1/namespaces/default/serviceaccounts",
                          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    assert created.status in (201, 409), created
    container.exec("systemctl", "restart", "containerd", timeout=120)
    container.exec("systemctl", "start", "kubelet")
    cluster.wait("the kubelet's Node", lambda: cluster.api("GET", f"/api/v1/nodes/{node}").status == 200)
    return cluster


DROP_IN = "/etc/systemd/system/gpu-agent.service.d/rig.conf"
# The agent as packaged, simulating a DGX H100 through the node's / bound again at /node (the way
# tests/e2e/test_runtimes.py runs it): with simulated GPUs on / itself it leaves the real runtimes alone,
# through /node it configures the real containerd and writes the real CDI spec. The unit's sandbox lets it
# write there as it lets it write the same paths under /.
AGENT_DROP_IN = """[Service]
Environment=GPU_AGENT_SIMULATE=dgx-h100
Environment=GPU_AGENT_ROOT=/node
ReadWritePaths=/node
"""


def install_agent(container: Container) -> None:
    """The .deb installed, the drop-in written, the agent started (Type=notify: after its first pass)."""
    container.exec("dpkg", "-i", "/root/gpu-agent.deb")
    container.sh("mkdir -p /node && mount --rbind / /node && mount --make-rslave /node")
    container.sh(f"mkdir -p {Path(DROP_IN).parent} && cat > {DROP_IN} <<'EOF'\n{AGENT_DROP_IN}EOF")
    container.exec("systemctl", "daemon-reload")
    container.exec("systemctl", "start", "gpu-agent", timeout=180)


IMAGE = "docker.io/local/busybox:1"
DRIVER = "550.90.07"  # dgx-h100's
LIBCUDA = f"/usr/lib/x86_64-linux-gnu/libcuda.so.{DRIVER}"
IMAGE_TAR = "/root/image.tar"


def import_images(container: Container) -> str:
    """containerd restarted on the agent's configuration (the simulated agent's own restarts are the
    simulator's), then the pods' image and the CRI's sandbox image imported from busybox: nothing pulled.
    Docker (in the cached tree) makes the images from the tarball, as tests/e2e/test_runtimes.py does.
    The sandbox image's name is returned (a container that sleeps, as pause does)."""
    container.exec("systemctl", "restart", "containerd", timeout=180)
    dump = container.exec("containerd", "config", "dump").stdout
    # 1.7: sandbox_image in the CRI plugin, CDI on by enable_cdi; 2.x: the images plugin's pinned sandbox,
    # CDI always on.
    pause = re.search(r"""(?:sandbox_image|sandbox) = ['"]([^'"]+)['"]""", dump)
    assert pause and ("enable_cdi = true" in dump or "io.containerd.cri.v1.runtime" in dump), dump
    local = IMAGE.split("/", 1)[1]
    container.sh(f"docker import {IMAGE_TAR} {local} && docker import --change 'ENTRYPOINT [\"/bin/sleep\", "
                 f"\"1000000\"]' {IMAGE_TAR} {pause[1]} && docker save {local} {pause[1]} | "
                 "ctr -n k8s.io images import -", timeout=300)
    return pause[1]


def boot(work: Path, deb: Path, node: str = "gpu-node", runtime: str = "containerd-1.7"
         ) -> tuple[Container, Path, KubePKI]:
    directory = work / "rootfs"
    run(["cp", "-a", "--reflink=auto", str(runtimes_root("trixie")), str(directory)], timeout=900)
    shutil.copy(deb, directory / "root/gpu-agent.deb")
    pki = KubePKI(work / "pki")
    prepare(directory, node, pki, runtime)
    container = Container(directory, work / "console.log", nested=True)
    return container, directory, pki


def stop(container: Container, directory: Path) -> None:
    container.stop()
    subprocess.run(["rm", "-rf", str(directory)], timeout=600, check=False)
