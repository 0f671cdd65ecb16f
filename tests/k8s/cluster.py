"""A real, throw-away Kubernetes cluster for the k8s test tier: a control plane, and on request a node.

etcd (Debian `etcd-server`), kube-apiserver and kube-controller-manager 1.20.2 (built from Debian's
`kubernetes` source package by scripts/k8s/build.sh, cached in ~/.cache/mixplane/k8s-1.20.2/bin).

Control plane only (`Cluster.start(dir)`, the `k8s_cluster` fixture): there is no kubelet, pods stay Pending,
and tests run pod templates as local processes themselves. The API server binds 127.0.0.1 only and advertises
10.0.0.1 (it refuses a loopback advertise address).

With a node (`Cluster.start(dir, node=True)`, the `k8s_node` fixture; tests/k8s/node.py): dockerd, kubelet
(dockershim), kube-scheduler, kube-proxy and a cluster DNS run pods of images built here (scripts/k8s/images.sh);
the API server binds and advertises docker0's address, which pods reach; the network discipline holds while it
runs, and `stop()` leaves the host's iptables, routes, mounts, sysctls and cgroups as they were.

    python -m tests.k8s.cluster up DIR [--no-node]   # starts, prints the kubeconfig path, state in DIR/pids.json
    python -m tests.k8s.cluster down DIR             # stops everything by pid and undoes the node's host changes

The API server runs with token auth, RBAC (and the Node authorizer with a node), the admission webhooks and a
service-account key pair. One test CA signs the serving certificate and, through :meth:`Cluster.issue_cert`,
the webhook servers' certificates.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import random
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

K8S_VERSION = "1.20.2"
REPO = Path(__file__).resolve().parents[2]
PROJECT_VERSION = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)  # type: ignore[union-attr]
BUILD_SCRIPT = REPO / "scripts" / "k8s" / "build.sh"
FAILURES_DIR = Path("/tmp/mixplane-k8s-failures")  # Cluster.keep_logs: a failed test's pod logs, past pytest's tmp rotation
ADVERTISE_ADDRESS = "10.0.0.1"
CONTROLLERS = ("garbagecollector", "deployment", "replicaset", "statefulset", "namespace", "serviceaccount",
               "serviceaccount-token", "disruption", "job", "endpoint", "pvc-protection")
ADMISSION_PLUGINS = ("NamespaceLifecycle", "LimitRanger", "ServiceAccount", "DefaultStorageClass", "ResourceQuota",
                     "MutatingAdmissionWebhook", "ValidatingAdmissionWebhook",
                     # setting blockOwnerDeletion needs `update` on the owner's finalizers (the chart's RBAC must grant it)
                     "OwnerReferencesPermissionEnforcement")
AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
                "rules": [{"level": "Metadata"}]}


class ClusterError(RuntimeError):
    """The control plane could not be built or started; the message names the component and its log."""


def cache_dir() -> Path:
    return Path(os.environ.get("MIXPLANE_K8S_CACHE", Path.home() / ".cache" / "mixplane" / f"k8s-{K8S_VERSION}"))


ALL_TOOLS = ("kube-apiserver", "kube-controller-manager", "etcd", "kubectl", "prometheus")
NODE_TOOLS = ("kubelet", "kube-scheduler", "kube-proxy", "dockerd", "conntrack")
# a node adds the controllers of what kubelet, kube-proxy and volumes need
NODE_CONTROLLERS = ("endpointslice", "endpointslicemirroring", "persistentvolume-binder", "pv-protection", "podgc",
                    "ttl", "daemonset", "replicationcontroller", "nodelifecycle")


def _find(name: str) -> str | None:
    built = cache_dir() / "bin" / name
    if name.startswith("kube-") or name == "kubelet":
        return str(built) if built.is_file() else None
    if name == "dockerd":
        return "/usr/sbin/dockerd" if Path("/usr/sbin/dockerd").is_file() else None
    return shutil.which(name)


def binaries(names: tuple[str, ...] = ALL_TOOLS) -> dict[str, str]:
    """Paths of the named binaries, building/installing them with the project's script if any is missing."""
    have = {n: _find(n) for n in names}
    if not all(have.values()):
        missing = [k for k, v in have.items() if not v]
        mode = ["node"] if set(missing) & set(NODE_TOOLS) else []
        print(f"k8s tier: {', '.join(missing)} missing; running {BUILD_SCRIPT} {' '.join(mode)} (about 7 minutes cold)",
              file=sys.stderr)
        r = subprocess.run(["bash", str(BUILD_SCRIPT), *mode], stdout=sys.stderr, stderr=sys.stderr)
        if r.returncode:
            raise ClusterError(f"{BUILD_SCRIPT} failed (exit {r.returncode})")
        have = {n: _find(n) for n in names}
        if not all(have.values()):
            raise ClusterError(f"still missing after {BUILD_SCRIPT}: {[k for k, v in have.items() if not v]}")
    return {k: str(v) for k, v in have.items()}


_ISSUED_PORTS: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range and never handed out before in this process.

    A port the kernel picks for bind(0) lies in the ephemeral range, where any outgoing connection made
    before the server binds (kubectl, the API server's own clients) may take it; and two calls may return
    the same port. Either makes a server that binds later fail with 'address in use'.
    """
    lo, _ = _ephemeral_range()
    lo = max(lo, 12000)  # at least 10,000 candidates in [2000, lo)
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(2000, lo)
        if port in _ISSUED_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ISSUED_PORTS.add(port)
        return port
    raise ClusterError("no free port below the ephemeral range")


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if r.returncode:
        raise ClusterError(f"openssl {' '.join(args[:2])}: {r.stderr.strip()}")


def make_ca(d: Path) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "3650",
             "-subj", "/CN=mixplane-test-ca", cwd=d)


def sign_cert(d: Path, name: str, cn: str, sans: list[str]) -> tuple[Path, Path]:
    """A serving certificate signed by d/ca.crt; sans like ["IP:127.0.0.1", "DNS:localhost"]."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
             cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "3650", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.crt", d / f"{name}.key"


@dataclass
class Cluster:
    """A running control plane; `stop()` ends its processes by pid."""

    workdir: Path
    server: str
    token: str
    kubeconfig: Path
    ca_file: Path
    bins: dict[str, str]
    pids: dict[str, int] = field(default_factory=dict)
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict, repr=False)
    node: Any = None  # tests.k8s.node.Node when the cluster has a node
    image: str = f"mixplane:{PROJECT_VERSION}"
    restore_problems: list[str] = field(default_factory=list)

    # ---- lifecycle ----
    @classmethod
    def start(cls, workdir: str | os.PathLike, timeout: float = 120.0, *, node: bool = False) -> "Cluster":
        """The control plane; with `node`, also dockerd, kubelet, scheduler, kube-proxy and the cluster DNS (the
        images built first by scripts/k8s/images.sh), the node Ready and kube-proxy serving when this returns."""
        from tests.k8s import node as nodemod

        bins = binaries(ALL_TOOLS + NODE_TOOLS if node else ALL_TOOLS)
        if node:
            nodemod.build_images()
        wd = Path(workdir).resolve()
        pki, logs = wd / "pki", wd / "logs"
        for d in (pki, logs, wd / "etcd"):
            d.mkdir(parents=True, exist_ok=True)
        bind = nodemod.BRIDGE_IP if node else "127.0.0.1"
        advertise = nodemod.BRIDGE_IP if node else ADVERTISE_ADDRESS
        make_ca(pki)
        sign_cert(pki, "apiserver", "kube-apiserver",
                  ["IP:127.0.0.1", "DNS:localhost", f"IP:{advertise}", "IP:10.96.0.1", "DNS:kubernetes",
                   "DNS:kubernetes.default", "DNS:kubernetes.default.svc", "DNS:kubernetes.default.svc.cluster.local"])
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
        token = secrets.token_hex(16)
        tokens = {"admin": token}
        lines = [f'{token},admin,admin,"system:masters"']
        if node:  # the node's own identities: the Node authorizer's, and the default bindings' of proxy and scheduler
            for user, uid, group in ((f"system:node:{nodemod.NODE_NAME}", "node", "system:nodes"),
                                     ("system:kube-proxy", "kube-proxy", ""), ("system:kube-scheduler", "kube-scheduler", "")):
                tokens[user] = secrets.token_hex(16)
                lines.append(f'{tokens[user]},{user},{uid}' + (f',"{group}"' if group else ""))
            sign_cert(pki, "apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["DNS:kube-apiserver"])
        (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
        os.chmod(pki / "tokens.csv", 0o600)

        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        server = f"https://{bind}:{api_port}"
        kubeconfig = wd / "kubeconfig"
        kubeconfig.write_text(json.dumps(_kubeconfig(server, pki / "ca.crt", token, "default"), indent=1))
        (wd / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
        c = cls(workdir=wd, server=server, token=token, kubeconfig=kubeconfig, ca_file=pki / "ca.crt", bins=bins)
        try:
            if node:
                c.node = nodemod.Node(wd)
                c._start_docker(bins)
            c._spawn("etcd", [bins["etcd"], "--name", "mixplane-test", "--data-dir", str(wd / "etcd"),
                              "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                              "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                              "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                              "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                              "--initial-cluster", f"mixplane-test=http://127.0.0.1:{etcd_peer}",
                              "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
                              "--quota-backend-bytes", str(1 << 30), "--log-level", "warn"])
            c._wait(lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), "etcd", 30.0)
            node_args = [f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                         f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                         "--kubelet-preferred-address-types=InternalIP"] if node else []
            c._spawn("kube-apiserver", [
                bins["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--bind-address={bind}", f"--secure-port={api_port}", "--insecure-port=0",
                f"--advertise-address={advertise}",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
                f"--authorization-mode={'Node,RBAC' if node else 'RBAC'}",
                f"--enable-admission-plugins={','.join(ADMISSION_PLUGINS + (('NodeRestriction',) if node else ()))}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/12", f"--cert-dir={wd / 'certs'}", "--profiling=false",
                "--enable-priority-and-fairness=false", "--logtostderr=true", "--v=1",
                f"--audit-policy-file={wd / 'audit-policy.json'}", f"--audit-log-path={wd / 'audit.log'}",
                "--audit-log-format=json", "--audit-log-mode=blocking", *node_args])
            c._wait(c._ready, "kube-apiserver", timeout)
            controllers = CONTROLLERS + (NODE_CONTROLLERS if node else ())
            c._spawn("kube-controller-manager", [
                bins["kube-controller-manager"], f"--kubeconfig={kubeconfig}", f"--controllers={','.join(controllers)}",
                f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                "--leader-elect=false", "--port=0", "--secure-port=0", "--use-service-account-credentials=false",
                "--concurrent-gc-syncs=5", "--logtostderr=true", "--v=1"])
            c._wait(c._default_sa_has_token, "kube-controller-manager", timeout)
            if node:
                c._start_node(bins, tokens, timeout)
        except BaseException:
            c.stop()
            raise
        c._save()
        return c

    def _start_docker(self, bins: dict[str, str]) -> None:
        """Host preparation (lock, snapshot, discipline), the conntrack log, dockerd with the image cache."""
        n = self.node
        assert n is not None
        n.prepare_host(bins.get("kube-proxy"))
        self._spawn("conntrack", [bins["conntrack"], "-E", "-e", "NEW", "-o", "timestamp"], cgroup=False)
        # dockerd inherits the image cache's lock: held while it runs, even after `up` returned
        self._spawn("dockerd", ["/usr/sbin/dockerd", "--config-file", str(n.write_daemon_json())],
                    pass_fds=(n.lock_fd,) if n.lock_fd is not None else ())
        n.state["bridge_created"] = True
        n.save()
        self._wait(lambda: n.docker("version", check=False, timeout=5).returncode == 0, "dockerd", 60)
        n.remove_containers()  # a former node's pods (a run killed before `down`)
        from tests.k8s.node import PAUSE_IMAGE
        for image in (PAUSE_IMAGE, self.image):
            if n.docker("image", "inspect", image, check=False).returncode:
                raise ClusterError(f"image {image} missing from {nodemod_docker_root()} (scripts/k8s/images.sh)")

    def _start_node(self, bins: dict[str, str], tokens: dict[str, str], timeout: float) -> None:
        from tests.k8s import node as nodemod

        n, wd, pki = self.node, self.workdir, self.workdir / "pki"
        assert n is not None
        kc = {}
        for short, user in (("kubelet", f"system:node:{nodemod.NODE_NAME}"), ("kube-proxy", "system:kube-proxy"),
                            ("kube-scheduler", "system:kube-scheduler")):
            kc[short] = wd / f"{short}.kubeconfig"
            kc[short].write_text(json.dumps(_kubeconfig(self.server, pki / "ca.crt", tokens[user], "default")))
        self._spawn("kube-scheduler", [bins["kube-scheduler"], f"--kubeconfig={kc['kube-scheduler']}",
                                       f"--authentication-kubeconfig={kc['kube-scheduler']}",
                                       f"--authorization-kubeconfig={kc['kube-scheduler']}",
                                       "--leader-elect=false", "--port=0", "--bind-address=127.0.0.1",
                                       f"--secure-port={free_port()}", "--logtostderr=true", "--v=1"])
        self._spawn("dns", [sys.executable, "-m", "tests.k8s.dns", f"--kubeconfig={self.kubeconfig}",
                            f"--listen={nodemod.DNS_IP}:53"], env={**os.environ, "PYTHONPATH": str(REPO)})
        self._wait(lambda: _dns_up(nodemod.DNS_IP), "dns", 30)
        root = wd / "kubelet"
        (wd / "resolv.conf").write_text("")  # pods get the cluster DNS and no upstream: no name leaves the cluster
        kubelet_port, healthz = free_port(), free_port()
        self._spawn("kubelet", [
            bins["kubelet"], f"--kubeconfig={kc['kubelet']}", f"--hostname-override={nodemod.NODE_NAME}",
            f"--node-ip={nodemod.BRIDGE_IP}", f"--address={nodemod.BRIDGE_IP}", f"--port={kubelet_port}",
            "--read-only-port=0", f"--healthz-port={healthz}", "--healthz-bind-address=127.0.0.1",
            f"--root-dir={root}", f"--cert-dir={wd / 'kubelet-pki'}", f"--volume-plugin-dir={wd / 'kubelet-plugins'}",
            "--container-runtime=docker", f"--docker-endpoint={n.docker_sock}",
            f"--container-runtime-endpoint=unix://{wd / 'dockershim.sock'}",
            f"--experimental-dockershim-root-directory={wd / 'dockershim'}",
            f"--pod-infra-container-image={nodemod.PAUSE_IMAGE}", "--cgroup-driver=cgroupfs", "--cgroups-per-qos=false",
            "--enforce-node-allocatable=", "--fail-swap-on=false", f"--cluster-dns={nodemod.DNS_IP}",
            "--cluster-domain=cluster.local", f"--resolv-conf={wd / 'resolv.conf'}", "--anonymous-auth=false",
            f"--client-ca-file={pki / 'ca.crt'}", "--authorization-mode=AlwaysAllow", "--make-iptables-util-chains=false",
            "--oom-score-adj=0", "--eviction-hard=memory.available<100Mi,nodefs.available<1%,imagefs.available<1%",
            "--image-gc-high-threshold=100", "--image-gc-low-threshold=99", "--max-pods=60", "--serialize-image-pulls=false",
            "--node-status-update-frequency=4s", "--sync-frequency=10s", "--logtostderr=true", "--v=1"],
            env={**os.environ, "AWS_EC2_METADATA_DISABLED": "true"})
        self._wait(self.node_ready, "kubelet", timeout)
        self._spawn("kube-proxy", [
            bins["kube-proxy"], f"--kubeconfig={kc['kube-proxy']}", f"--hostname-override={nodemod.NODE_NAME}",
            "--proxy-mode=iptables", f"--cluster-cidr={nodemod.POD_CIDR}", f"--bind-address={nodemod.BRIDGE_IP}",
            f"--nodeport-addresses={nodemod.BRIDGE_IP}/32", f"--healthz-bind-address=127.0.0.1:{free_port()}",
            f"--metrics-bind-address=127.0.0.1:{free_port()}", "--oom-score-adj=0", "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0", "--logtostderr=true", "--v=1"])
        n.state["kube_proxy_ran"] = True
        n.save()
        self._wait(lambda: "KUBE-SVC-" in subprocess.run(["iptables-save", "-t", "nat"], capture_output=True,
                                                        text=True).stdout, "kube-proxy", timeout)
        nodemod.reinstall_jumps(n.state["cgroup2"])

    def node_ready(self) -> bool:
        from tests.k8s.node import NODE_NAME

        obj = self.api(f"/api/v1/nodes/{NODE_NAME}")
        return any(c["type"] == "Ready" and c["status"] == "True" for c in obj["status"].get("conditions") or [])

    def stop(self) -> None:
        """SIGTERM in reverse start order, then SIGKILL whatever is left after a grace period; with a node, its
        pods' containers are removed first and the host's state restored last."""
        problems = self._stop(self.pids, self._procs.get, self.node, self.bins.get("kube-proxy"))
        self._procs.clear()
        (self.workdir / "pids.json").unlink(missing_ok=True)
        self.node = None
        if problems:
            print("k8s node: host state not fully restored:\n" + "\n".join(problems), file=sys.stderr)
        self.restore_problems = problems

    @staticmethod
    def _stop(pids: dict[str, int], proc_of, node, kube_proxy: str | None) -> list[str]:
        def end(name: str) -> None:
            proc = proc_of(name)
            if proc is None:
                _terminate(pids[name])
                return
            proc.terminate()
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)

        order = list(reversed(list(pids)))
        if node is not None:  # kubelet first (it would restart what we remove), then its pods, dockerd after the rest
            for name in ("kube-proxy", "kubelet"):
                if name in pids:
                    end(name)
            if "dockerd" in pids:
                node.remove_containers()
            order = [n for n in order if n not in ("kube-proxy", "kubelet", "dockerd", "conntrack")] + \
                    [n for n in ("dockerd", "conntrack") if n in pids]
            for name in order:
                end(name)
        else:
            for name in order:
                end(name)
        pids.clear()
        return node.restore_host(kube_proxy) if node is not None else []

    # ---- use ----
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        r = subprocess.run([self.bins["kubectl"], f"--kubeconfig={self.kubeconfig}", *args], input=input,
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise ClusterError(f"kubectl {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def api(self, path: str, method: str = "GET", body: dict | None = None, timeout: float = 10.0) -> dict:
        """A raw API request (JSON in, JSON out) with the admin token."""
        req = urllib.request.Request(self.server + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, context=self.ssl_context(), timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def issue_cert(self, name: str, sans: list[str] | None = None) -> tuple[Path, Path]:
        """A serving certificate from the test CA (for webhook servers on 127.0.0.1); returns (cert, key)."""
        return sign_cert(self.workdir / "pki", name, name, sans or ["IP:127.0.0.1", "DNS:localhost"])

    def audit(self, user: str | None = None) -> list[dict]:
        """The API server's audit events (every request, level Metadata), those of `user` when given."""
        path = self.workdir / "audit.log"
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        return [e for e in events if user is None or (e.get("user") or {}).get("username") == user]

    def log(self, name: str) -> str:
        p = self.workdir / "logs" / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def apply_until_accepted(self, doc: dict, timeout: float = 30.0) -> None:
        """`kubectl apply` of `doc` again until it is accepted (the operator's webhook Service serves a moment after
        the operator is Ready); on timeout the error names kubectl's last answer, and the webhook's message (kubectl
        1.20's apply says only "The request is invalid" for a denial: `create -v=8` shows the API server's body)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                body = self.kubectl("create", "-v=8", "-f", "-", input=json.dumps(doc), check=False).stderr
                msgs = re.findall(r'"message":"((?:[^"\\]|\\.)*)"', body)
                raise AssertionError(f"{doc['kind']} {doc['metadata']['name']} not accepted in {timeout:g} s: "
                                     f"{r.stderr.strip()[-2000:]}" + (f"; the API server: {msgs[-1]}" if msgs else ""))
            time.sleep(1.0)

    def keep_logs(self, ns: str, why: str = "") -> Path:
        """A failed test's evidence, kept past pytest's tmp rotation: every pod's full logs (all containers, and the
        previous run of restarted ones), the namespace's pods / events / endpoints, the node's REJECT counts and
        kube-proxy log, and the conntrack lines of the namespace's Service addresses. Returns the directory."""
        d = FAILURES_DIR / f"{time.strftime('%Y%m%dT%H%M%S')}-{ns}"[:120]
        d.mkdir(parents=True, exist_ok=True)
        (d / "why.txt").write_text(why)
        try:
            pods = json.loads(self.kubectl("get", "pods", "-n", ns, "-o", "json", check=False).stdout or "{}").get("items", [])
        except json.JSONDecodeError:
            pods = []
        for p in pods:
            name = p["metadata"]["name"]
            for ctr in p["spec"]["containers"]:
                for prev in ("", "--previous"):
                    out = self.kubectl("-n", ns, "logs", name, "-c", ctr["name"], "--timestamps", *([prev] if prev else []),
                                       check=False)
                    if out.stdout or not prev:
                        (d / f"{name}.{ctr['name']}{'.previous' if prev else ''}.log").write_text(out.stdout + out.stderr)
        (d / "state.txt").write_text("\n".join(
            self.kubectl(*a, check=False).stdout for a in (
                ("get", "pods,services,endpoints,deployments,statefulsets,jobs", "-n", ns, "-o", "wide"),
                ("get", "events", "-n", ns, "--sort-by=.lastTimestamp"),
                ("get", "services,endpoints", "-n", ns, "-o", "yaml"))))
        if self.node is not None:
            from tests.k8s import node as nodemod

            (d / "rejects.json").write_text(json.dumps(nodemod.reject_counts()))
            ips = {s["spec"].get("clusterIP") for s in json.loads(self.kubectl(
                "get", "services", "-n", ns, "-o", "json", check=False).stdout or '{"items": []}')["items"]} - {None, "None"}
            ct = self.workdir / "logs" / "conntrack.log"
            lines = [ln for ln in (ct.read_text(errors="replace").splitlines() if ct.exists() else [])
                     if any(f"dst={ip} " in ln for ip in ips)]
            (d / "conntrack-services.log").write_text("\n".join(lines) + "\n")
            if (self.workdir / "logs" / "kube-proxy.log").exists():
                shutil.copy(self.workdir / "logs" / "kube-proxy.log", d / "kube-proxy.log")
        return d

    # ---- internals ----
    def _spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None, cgroup: bool = True,
               pass_fds: tuple[int, ...] = ()) -> None:
        log = open(self.workdir / "logs" / f"{name}.log", "ab")
        procs = None
        if self.node is not None and cgroup:  # the node's processes live in its cgroup (the discipline's OUTPUT rule)
            procs = f"/sys/fs/cgroup/unified/{self.node.state['cgroup2']}/cgroup.procs"

        def enter() -> None:
            if procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                             env=env, preexec_fn=enter if procs else None, pass_fds=pass_fds)
        log.close()
        self.pids[name] = p.pid
        self._procs[name] = p
        self._save()

    def _save(self) -> None:
        (self.workdir / "pids.json").write_text(json.dumps({"pids": self.pids, "server": self.server, "token": self.token,
                                                            "kube-proxy": self.bins.get("kube-proxy")}))

    def _wait(self, ready, name: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise ClusterError(f"{name} exited during start-up; log {self.workdir / 'logs' / (name + '.log')}:\n"
                                   + self.log(name)[-3000:])
            try:
                if ready():
                    return
            except Exception:  # noqa: BLE001 - not up yet: connection refused, 403 before RBAC bootstrap, ...
                pass
            time.sleep(0.25)
        raise ClusterError(f"{name} not ready within {timeout:.0f}s; log {self.workdir / 'logs' / (name + '.log')}:\n"
                           + self.log(name)[-3000:])

    def _ready(self) -> bool:
        req = urllib.request.Request(self.server + "/readyz", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, context=self.ssl_context(), timeout=5) as resp:
            return resp.status == 200

    def _default_sa_has_token(self) -> bool:
        sa = self.api("/api/v1/namespaces/default/serviceaccounts/default")
        return bool(sa.get("secrets"))


def _kubeconfig(server: str, ca: Path, token: str, namespace: str) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "mixplane-test",
            "clusters": [{"name": "mixplane-test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
            "users": [{"name": "user", "user": {"token": token}}],
            "contexts": [{"name": "mixplane-test", "context": {"cluster": "mixplane-test", "user": "user", "namespace": namespace}}]}


def _dns_up(host: str) -> bool:
    """The cluster DNS answers (kubernetes.default.svc resolves over UDP)."""
    from dnslib import DNSRecord  # type: ignore[import-untyped]

    reply = DNSRecord.parse(DNSRecord.question("kubernetes.default.svc").send(host, 53, timeout=1))
    return bool(reply.rr)


def nodemod_docker_root() -> Path:
    from tests.k8s.node import docker_root

    return docker_root()


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status == 200


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (the `down` CLI): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return done == 0


def _terminate(pid: int, grace: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    while _alive(pid) and time.monotonic() < deadline + 5:
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    node = "--no-node" not in argv
    argv = [a for a in argv if a != "--no-node"]
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.k8s.cluster up [--no-node] DIR | down DIR", file=sys.stderr)
        return 2
    cmd, wd = argv[0], Path(argv[1]).resolve()
    if cmd == "up":
        wd.mkdir(parents=True, exist_ok=True)
        c = Cluster.start(wd, node=node)
        if c.node is not None:  # the image cache's lock goes on with dockerd (which inherited it), not with us
            os.close(c.node.lock_fd)
        print(c.kubeconfig)
        return 0
    from tests.k8s.node import Node

    state = json.loads((wd / "pids.json").read_text())
    problems = Cluster._stop({k: int(v) for k, v in state["pids"].items()}, lambda _n: None, Node.load(wd),
                             state.get("kube-proxy"))
    (wd / "pids.json").unlink(missing_ok=True)
    if problems:
        print("host state not fully restored:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
