"""A real, throw-away Kubernetes control plane on 127.0.0.1 for the k8s test tier.

etcd (Debian `etcd-server`), kube-apiserver and kube-controller-manager 1.20.2 (built from Debian's
`kubernetes` source package by scripts/k8s/build.sh, cached in ~/.cache/mixplane/k8s-1.20.2/bin). There is
no kubelet: pods stay Pending, which is why tests run pod templates as local processes themselves.

    python -m tests.k8s.cluster up DIR     # starts, prints the kubeconfig path, leaves pids in DIR/pids.json
    python -m tests.k8s.cluster down DIR   # stops them by pid

The API server runs with token auth, RBAC, the admission webhooks and a service-account key pair; it binds
127.0.0.1 only and advertises 10.0.0.1 (it refuses a loopback advertise address). One test CA signs the
serving certificate and, through :meth:`Cluster.issue_cert`, the webhook servers' certificates.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import random
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

K8S_VERSION = "1.20.2"
REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "k8s" / "build.sh"
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


def _find(name: str) -> str | None:
    built = cache_dir() / "bin" / name
    if name.startswith("kube-"):
        return str(built) if built.is_file() else None
    return shutil.which(name)


def binaries(names: tuple[str, ...] = ALL_TOOLS) -> dict[str, str]:
    """Paths of the named binaries, building/installing them with the project's script if any is missing."""
    have = {n: _find(n) for n in names}
    if not all(have.values()):
        missing = [k for k, v in have.items() if not v]
        print(f"k8s tier: {', '.join(missing)} missing; running {BUILD_SCRIPT} (about 7 minutes cold)", file=sys.stderr)
        r = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=sys.stderr, stderr=sys.stderr)
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

    # ---- lifecycle ----
    @classmethod
    def start(cls, workdir: str | os.PathLike, timeout: float = 120.0) -> "Cluster":
        bins = binaries()
        wd = Path(workdir).resolve()
        pki, logs = wd / "pki", wd / "logs"
        for d in (pki, logs, wd / "etcd"):
            d.mkdir(parents=True, exist_ok=True)
        make_ca(pki)
        sign_cert(pki, "apiserver", "kube-apiserver",
                  ["IP:127.0.0.1", "DNS:localhost", f"IP:{ADVERTISE_ADDRESS}", "IP:10.96.0.1", "DNS:kubernetes",
                   "DNS:kubernetes.default", "DNS:kubernetes.default.svc"])
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)
        token = secrets.token_hex(16)
        (pki / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
        os.chmod(pki / "tokens.csv", 0o600)

        etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
        server = f"https://127.0.0.1:{api_port}"
        kubeconfig = wd / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "mixplane-test",
            "clusters": [{"name": "mixplane-test", "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")}}],
            "users": [{"name": "admin", "user": {"token": token}}],
            "contexts": [{"name": "mixplane-test", "context": {"cluster": "mixplane-test", "user": "admin", "namespace": "default"}}],
        }, indent=1))
        (wd / "audit-policy.json").write_text(json.dumps(AUDIT_POLICY))
        c = cls(workdir=wd, server=server, token=token, kubeconfig=kubeconfig, ca_file=pki / "ca.crt", bins=bins)
        try:
            c._spawn("etcd", [bins["etcd"], "--name", "mixplane-test", "--data-dir", str(wd / "etcd"),
                              "--listen-client-urls", f"http://127.0.0.1:{etcd_port}",
                              "--advertise-client-urls", f"http://127.0.0.1:{etcd_port}",
                              "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                              "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer}",
                              "--initial-cluster", f"mixplane-test=http://127.0.0.1:{etcd_peer}",
                              "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
                              "--quota-backend-bytes", str(1 << 30), "--log-level", "warn"])
            c._wait(lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), "etcd", 30.0)
            c._spawn("kube-apiserver", [
                bins["kube-apiserver"], f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1", f"--secure-port={api_port}", "--insecure-port=0",
                f"--advertise-address={ADVERTISE_ADDRESS}",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=RBAC", f"--enable-admission-plugins={','.join(ADMISSION_PLUGINS)}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/12", f"--cert-dir={wd / 'certs'}", "--profiling=false",
                "--enable-priority-and-fairness=false", "--logtostderr=true", "--v=1",
                f"--audit-policy-file={wd / 'audit-policy.json'}", f"--audit-log-path={wd / 'audit.log'}",
                "--audit-log-format=json", "--audit-log-mode=blocking"])
            c._wait(c._ready, "kube-apiserver", timeout)
            c._spawn("kube-controller-manager", [
                bins["kube-controller-manager"], f"--kubeconfig={kubeconfig}", f"--controllers={','.join(CONTROLLERS)}",
                f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
                "--leader-elect=false", "--port=0", "--secure-port=0", "--use-service-account-credentials=false",
                "--concurrent-gc-syncs=5", "--logtostderr=true", "--v=1"])
            c._wait(c._default_sa_has_token, "kube-controller-manager", timeout)
        except BaseException:
            c.stop()
            raise
        c._save()
        return c

    def stop(self) -> None:
        """SIGTERM in reverse start order, then SIGKILL whatever is left after a grace period."""
        for name in reversed(list(self.pids)):
            proc = self._procs.get(name)
            if proc is None:
                _terminate(self.pids[name])
                continue
            proc.terminate()
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        self.pids.clear()
        self._procs.clear()
        (self.workdir / "pids.json").unlink(missing_ok=True)

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

    # ---- internals ----
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.workdir / "logs" / f"{name}.log", "ab")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.pids[name] = p.pid
        self._procs[name] = p
        self._save()

    def _save(self) -> None:
        (self.workdir / "pids.json").write_text(json.dumps({"pids": self.pids, "server": self.server, "token": self.token}))

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
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.k8s.cluster up|down DIR", file=sys.stderr)
        return 2
    cmd, wd = argv[0], Path(argv[1])
    if cmd == "up":
        c = Cluster.start(wd)
        print(c.kubeconfig)
        return 0
    state = json.loads((wd / "pids.json").read_text())
    for name in reversed(list(state["pids"])):
        _terminate(int(state["pids"][name]))
    (wd / "pids.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
