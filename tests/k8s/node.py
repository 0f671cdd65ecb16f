"""The k8s tier's real node: what `Cluster.start(node=True)` adds to the control plane, and takes away again.

    dockerd (Debian's docker.io 20.10): its own exec-root, pidfile and socket under the cluster's directory, the
        image cache's data-root (~/.cache/mixplane/docker, images built by scripts/k8s/images.sh), the docker0
        bridge at BRIDGE_CIDR, no iptables/NAT of its own, default runtime scripts/k8s/runc-clamp (this machine's
        root lacks CAP_SYS_RESOURCE: a sandbox's negative oom_score_adj is raised to 0)
    kubelet (dockershim): node IP = docker0's address, credentials naming the node (Node authorizer), its root,
        plugin and dockershim directories in the cluster's directory, AWS_EC2_METADATA_DISABLED=true (its in-tree
        AWS credential provider asks 169.254.169.254 otherwise), image GC off (the images are built, not pulled)
    kube-scheduler, kube-proxy (iptables mode), the cluster DNS (tests/k8s/dns.py) on docker0:53

Network discipline (while the cluster runs): the cluster's host processes sit in a cgroup-v2 group of their own;
filter rules reject whatever they, or any container (a source in the bridge range), send to a destination outside
loopback, the bridge, and the service range; the link-local range (169.254/16, the metadata service) is rejected
by a rule of its own that counts, and so is traffic to the service range that kube-proxy neither translated nor
refused (a Service whose rules it is changing: such a SYN would leave by the default route, see egress_rules). mangle rules mark the cluster's connections (MARK), and `conntrack -E` logs every
new connection, so a test can show that none went anywhere else (`egress_report`).

Host state left as it was: the iptables rules are removed (kube-proxy's by `kube-proxy --cleanup`), docker0
deleted, the sysctls that dockerd, kubelet and kube-proxy set restored, mounts under the cluster's directory
unmounted, the cgroups the node made removed (only those: other processes make cgroups meanwhile), /var/log/pods and /var/log/containers removed when the node created them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
IMAGES_SCRIPT = REPO / "scripts" / "k8s" / "images.sh"
RUNC_CLAMP = REPO / "scripts" / "k8s" / "runc-clamp"
DOCKER = "/usr/bin/docker"  # Debian's client; /usr/local/bin/docker may be a newer one first on PATH
NODE_NAME = "mixplane-node"
BRIDGE_CIDR = "172.17.0.1/16"
BRIDGE_IP = BRIDGE_CIDR.split("/")[0]
POD_CIDR = str(ipaddress.ip_interface(BRIDGE_CIDR).network)  # pods get their IPs from docker0's range
SERVICE_CIDR = "10.96.0.0/12"
DNS_IP = BRIDGE_IP
ALLOWED = ("127.0.0.0/8", POD_CIDR, SERVICE_CIDR)
LINK_LOCAL = "169.254.0.0/16"
CHAIN = "MIXPLANE-EGRESS"
MARK = "0x6d78"
PAUSE_IMAGE = "k8s.gcr.io/pause:3.2"
SYSCTLS = ("net/ipv4/ip_forward", "net/ipv4/conf/all/route_localnet", "net/bridge/bridge-nf-call-iptables",
           "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/netfilter/nf_conntrack_max",
           "net/netfilter/nf_conntrack_tcp_timeout_established", "net/netfilter/nf_conntrack_tcp_timeout_close_wait")
CGROUP_ROOT = Path("/sys/fs/cgroup")
LOG_DIRS = (Path("/var/log/pods"), Path("/var/log/containers"))


class NodeError(RuntimeError):
    pass


def docker_root() -> Path:
    return Path(os.environ.get("MIXPLANE_DOCKER_ROOT", Path.home() / ".cache" / "mixplane" / "docker"))


def docker_lock_path() -> Path:
    return Path.home() / ".cache" / "mixplane" / "docker.lock"


def build_images() -> None:
    """scripts/k8s/images.sh: every image the node runs (cached; builds what is missing or changed)."""
    r = subprocess.run(["bash", str(IMAGES_SCRIPT)], stdout=sys.stderr, stderr=sys.stderr)
    if r.returncode:
        raise NodeError(f"{IMAGES_SCRIPT} failed (exit {r.returncode})")


def _sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, input=input)
    if check and r.returncode:
        raise NodeError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def _read_sysctls() -> dict[str, str]:
    out = {}
    for k in SYSCTLS:
        p = Path("/proc/sys") / k
        if p.exists():
            out[k] = p.read_text().strip()
    return out


def _write_sysctl(k: str, v: str) -> None:
    try:
        (Path("/proc/sys") / k).write_text(v + "\n")
    except OSError as e:
        print(f"node: could not restore {k}={v}: {e}", file=sys.stderr)


def _cgroup_dirs() -> list[str]:
    """Every cgroup directory of every v1 hierarchy (and the v2 one), relative to /sys/fs/cgroup."""
    out = []
    for ctrl in sorted(CGROUP_ROOT.iterdir()) if CGROUP_ROOT.is_dir() else []:
        if not ctrl.is_dir() or ctrl.is_symlink():
            continue
        for dirpath, dirnames, _ in os.walk(ctrl):
            out.extend(os.path.relpath(os.path.join(dirpath, d), CGROUP_ROOT) for d in dirnames)
    return out


# The pods' containers all sit in dockerd's cgroup parent /docker (cgroupfs driver, kubelet --cgroups-per-qos=false),
# which weighs cpu.shares 1024 against every busy process of the host at 1024 each: with the other work on this shared
# machine at load 12-24, the whole cluster got ~1/13-1/25 of the 2 cores (components Ready 50-60 s after the apply;
# 24-28 s with the weight). The node gives /docker the weight of as many busy processes as the cluster runs (planner,
# 2 constructors, loaders, 2 trainers, operator), restored at stop. (It did not end the remote e2e flake: deploy.md.)
CONTAINERS_CPU = CGROUP_ROOT / "cpu" / "docker"
CONTAINERS_CPU_SHARES = 8192
NODE_CGROUPS = ("kubepods", "docker")  # what dockerd and the kubelet (cgroupfs driver) create under each hierarchy


def _node_cgroup(rel: str) -> bool:
    """A cgroup the node's processes made (`memory/kubepods/...`, `cpu/docker/<id>`, the node's own v2 group); not
    one that another process of the machine made while the node ran (e.g. `memory/process_api/<id>`)."""
    parts = rel.split("/")
    return len(parts) > 1 and (parts[1] in NODE_CGROUPS or parts[1].startswith("mixplane-node-"))


def _mounts_under(*roots: Path) -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == str(r) or mp.startswith(str(r) + "/") for r in roots):
            found.append(mp)
    return found


def _umount_under(*roots: Path) -> None:
    for _ in range(5):
        mps = _mounts_under(*roots)
        if not mps:
            return
        for mp in sorted(mps, key=lambda m: m.count("/"), reverse=True):
            subprocess.run(["umount", mp], capture_output=True)
        for mp in _mounts_under(*roots):
            subprocess.run(["umount", "-l", mp], capture_output=True)


UNTRANSLATED = "mixplane-service-untranslated"  # the comment of the rules that refuse untranslated ClusterIP traffic


def egress_rules(cgroup: str) -> list[tuple[str, str, list[str]]]:
    """(table, chain, rule) of the discipline: filter rules that reject, mangle rules that mark (for conntrack).
    The jumps into CHAIN are inserted first; the UNTRANSLATED rules are appended last (see below)."""
    rules: list[tuple[str, str, list[str]]] = []
    # the chain every path into / through the host jumps to; sources: the containers, and the cluster's processes.
    # Only what they open is judged: a reply (to the host's own connection into a pod, e.g. the API server calling a
    # webhook through its Service, masqueraded to the bridge address) is let through.
    rules.append(("filter", CHAIN, ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"]))
    for d in ALLOWED:
        rules.append(("filter", CHAIN, ["-d", d, "-j", "RETURN"]))
    rules.append(("filter", CHAIN, ["-d", LINK_LOCAL, "-j", "REJECT"]))
    rules.append(("filter", CHAIN, ["-j", "REJECT"]))
    rules.append(("filter", "INPUT", ["-s", POD_CIDR, "-j", CHAIN]))
    rules.append(("filter", "FORWARD", ["-s", POD_CIDR, "-j", CHAIN]))
    rules.append(("filter", "OUTPUT", ["-m", "cgroup", "--path", cgroup, "-j", CHAIN]))
    # A ClusterIP is a destination only before kube-proxy's DNAT (nat PREROUTING / OUTPUT, which run before these
    # filter chains); kube-proxy itself refuses a Service without ready endpoints (its KUBE-SERVICES jumps, first in
    # FORWARD / OUTPUT after CHAIN's). What comes past both was neither translated nor refused: a Service whose rules
    # kube-proxy is changing or has not written yet. Let through, such a SYN took the host's default route out of
    # the machine, and its retransmissions kept the untranslated conntrack entry, so the connect hung for the
    # kernel's SYN retries (~127 s) while every new connection was served (test_e2e[remote]'s flake: a constructor
    # that never registered). Refused (and counted) here, last in the chains, the component's next try is a new
    # connection that kube-proxy's rules of that moment translate.
    comment = ["-m", "comment", "--comment", UNTRANSLATED]
    rules.append(("filter", "FORWARD", ["-s", POD_CIDR, "-d", SERVICE_CIDR, *comment, "-j", "REJECT"]))
    rules.append(("filter", "OUTPUT", ["-m", "cgroup", "--path", cgroup, "-d", SERVICE_CIDR, *comment, "-j", "REJECT"]))
    rules.append(("mangle", "PREROUTING", ["-s", POD_CIDR, "-j", "CONNMARK", "--set-mark", MARK]))
    rules.append(("mangle", "OUTPUT", ["-m", "cgroup", "--path", cgroup, "-j", "CONNMARK", "--set-mark", MARK]))
    return rules


def _appended(rule: list[str]) -> bool:
    return UNTRANSLATED in rule


def install_egress(cgroup: str) -> None:
    _sh("iptables", "-t", "filter", "-N", CHAIN)
    for table, chain, rule in egress_rules(cgroup):
        if chain == CHAIN or _appended(rule):
            _sh("iptables", "-t", table, "-A", chain, *rule)
        else:
            _sh("iptables", "-t", table, "-I", chain, "1", *rule)


_NODE_PATH = re.compile(r"--path (mixplane-node-\S+)")


def clear_dead_nodes(kube_proxy: str | None = None) -> list[str]:
    """Remove the discipline a node left when its process was killed before it could restore the host (a session
    that ended mid-run): its rules name a cgroup of no live process; and, with `kube_proxy`, that node's kube-proxy
    rules (`kube-proxy --cleanup`: else they are in the next node's "before" and its own cleanup makes the host
    differ from it). Call with the node lock held: the lock's holder is the only live node, so any discipline found
    then is a dead node's. Returns what was removed."""
    removed = []
    if kube_proxy and re.search(r"^:KUBE-", _sh("iptables-save", check=False).stdout, re.M):
        subprocess.run([kube_proxy, "--cleanup", "--proxy-mode=iptables"], capture_output=True, timeout=60)
        _drop_chains(iptables_save().splitlines())  # what --cleanup leaves (see restore_host)
        removed.append("kube-proxy's and kubelet's chains (kube-proxy --cleanup, then the KUBE-* chains left)")
    dead = sorted(set(_NODE_PATH.findall(_sh("iptables-save", check=False).stdout)))
    for cg in dead:
        procs = CGROUP_ROOT / "unified" / cg / "cgroup.procs"
        if procs.exists() and procs.read_text().split():
            raise NodeError(f"iptables name cgroup {cg}, whose processes still run: another node runs on this machine")
        made = not procs.parent.is_dir()
        if made:
            procs.parent.mkdir()  # iptables resolves a rule's cgroup path to delete it
        remove_egress(cg)
        removed.append(f"the discipline of {cg}")
        os.rmdir(procs.parent)
        if not made:
            removed.append(f"cgroup unified/{cg}")
    if _sh("iptables", "-t", "filter", "-L", CHAIN, "-n", check=False).returncode == 0:
        remove_egress("mixplane-node-none")  # a chain left without jumps of a cgroup (killed while installing)
        removed.append(f"chain {CHAIN}")
    return removed


def reinstall_jumps(cgroup: str) -> None:
    """Put the jumps back in first place (kube-proxy inserts its own chains' jumps at the top), the UNTRANSLATED
    rules back last."""
    for table, chain, rule in egress_rules(cgroup):
        if chain != CHAIN and table == "filter":
            _sh("iptables", "-t", table, "-D", chain, *rule, check=False)
            _sh("iptables", "-t", table, "-A" if _appended(rule) else "-I", chain, *([] if _appended(rule) else ["1"]), *rule)


def remove_egress(cgroup: str) -> None:
    for table, chain, rule in egress_rules(cgroup):
        if chain != CHAIN:
            while _sh("iptables", "-t", table, "-D", chain, *rule, check=False).returncode == 0:
                pass
    _sh("iptables", "-t", "filter", "-F", CHAIN, check=False)
    _sh("iptables", "-t", "filter", "-X", CHAIN, check=False)


def reject_counts() -> dict[str, int]:
    """Packets the discipline's REJECT rules refused so far: {"link-local": n, "service-untranslated": n,
    "other": n} (service-untranslated: to a ClusterIP that kube-proxy neither translated nor refused, see
    egress_rules)."""
    out = {"link-local": 0, "service-untranslated": 0, "other": 0}
    for chain in (CHAIN, "FORWARD", "OUTPUT"):
        r = _sh("iptables", "-t", "filter", "-L", chain, "-v", "-x", "-n", check=False)
        for line in r.stdout.splitlines():
            f = line.split()
            if len(f) < 9 or f[2] != "REJECT":
                continue
            if UNTRANSLATED in line:
                out["service-untranslated"] += int(f[0])
            elif chain == CHAIN:
                out["link-local" if f[8] == LINK_LOCAL else "other"] += int(f[0])
    return out


_CT = re.compile(r"src=(\S+) dst=(\S+)")


def conntrack_events(log: Path) -> list[dict[str, Any]]:
    """The new connections `conntrack -E -e NEW` logged that carry the cluster's mark: proto, src, dst, dport."""
    out = []
    mark = str(int(MARK, 16))
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if f"mark={mark}" not in line:
            continue
        m = _CT.search(line)
        if not m:
            continue
        pm = re.search(r"\[NEW\]\s+(\w+)", line)
        proto = pm.group(1) if pm else "?"
        dport = re.search(r"dport=(\d+)", line)
        out.append({"proto": proto, "src": m.group(1), "dst": m.group(2), "dport": int(dport.group(1)) if dport else None,
                    "line": line})
    return out


def untranslated(event: dict[str, Any]) -> bool:
    """A connection to the service range that no DNAT translated (its reply would come from the ClusterIP itself):
    one that left the host (the REJECT rule refuses them before a connection is confirmed, so none is logged)."""
    m = _CT.findall(event["line"])
    return (len(m) >= 2 and ipaddress.ip_address(m[0][1]) in ipaddress.ip_network(SERVICE_CIDR)
            and m[1][0] == m[0][1])


def outside(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return not any(ip in ipaddress.ip_network(n) for n in ALLOWED)


class Node:
    """The node's processes and host changes; state saved in DIR/node.json so that `down` can undo all of it."""

    def __init__(self, wd: Path, state: dict[str, Any] | None = None):
        self.wd = wd
        self.state: dict[str, Any] = state or {}
        self.lock_fd: int | None = None

    # ---- paths ----
    @property
    def docker_sock(self) -> str:
        return f"unix://{self.wd / 'docker' / 'docker.sock'}"

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([DOCKER, "-H", self.docker_sock, *args], capture_output=True, text=True, timeout=timeout)
        if check and r.returncode:
            raise NodeError(f"docker {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def save(self) -> None:
        (self.wd / "node.json").write_text(json.dumps(self.state, indent=1))

    @classmethod
    def load(cls, wd: Path) -> "Node | None":
        p = wd / "node.json"
        return cls(wd, json.loads(p.read_text())) if p.exists() else None

    # ---- host state ----
    def prepare_host(self, kube_proxy: str | None = None) -> str:
        """Lock the image cache's data-root, clear what a killed node left (clear_dead_nodes), snapshot what the
        node changes, put this process in the node's cgroup (its children inherit it), install the discipline.
        Returns the cgroup's path (v2, relative)."""
        lock = docker_lock_path()
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + 900
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NodeError(f"{lock} held for 15 minutes (another node or an image build)") from None
                time.sleep(1)
        self.lock_fd = fd
        if Path("/sys/class/net/docker0").exists():
            raise NodeError("docker0 exists already: another node (or Docker) runs on this machine")
        for what in clear_dead_nodes(kube_proxy):
            print(f"node: removed what a killed node left: {what}", file=sys.stderr)
        cg = f"mixplane-node-{os.getpid()}-{time.monotonic_ns() % 100000}"
        self.state.update({
            "sysctls": _read_sysctls(), "cgroups": _cgroup_dirs(), "cgroup2": cg,
            "log_dirs_existed": [str(d) for d in LOG_DIRS if d.exists()],
            "iptables_before": iptables_save(), "nft_tables_before": nft_tables(),
        })
        self.save()
        if CONTAINERS_CPU.parent.is_dir():
            shares = CONTAINERS_CPU / "cpu.shares"
            self.state["containers_cpu_shares"] = shares.read_text().strip() if shares.exists() else None
            self.save()
            CONTAINERS_CPU.mkdir(exist_ok=True)  # (a new one is removed at stop with the node's other cgroups)
            shares.write_text(str(CONTAINERS_CPU_SHARES))
        (CGROUP_ROOT / "unified" / cg).mkdir()
        self.state["egress"] = True
        self.save()
        install_egress(cg)
        for k, v in (("net/ipv4/ip_forward", "1"), ("net/bridge/bridge-nf-call-iptables", "1")):
            _write_sysctl(k, v)
        return cg

    def enter_cgroup(self, pid: int) -> None:
        (CGROUP_ROOT / "unified" / self.state["cgroup2"] / "cgroup.procs").write_text(str(pid))

    def write_daemon_json(self) -> Path:
        d = self.wd / "docker"
        d.mkdir(parents=True, exist_ok=True)
        root = docker_root()
        root.mkdir(parents=True, exist_ok=True)
        cfg = {"data-root": str(root), "exec-root": str(d / "exec"), "pidfile": str(d / "docker.pid"),
               "hosts": [self.docker_sock], "storage-driver": "overlay2", "exec-opts": ["native.cgroupdriver=cgroupfs"],
               "bip": BRIDGE_CIDR, "iptables": False, "ip-forward": False, "ip-masq": False, "ip6tables": False,
               "userland-proxy": False, "default-runtime": "mixplane-runc",
               "runtimes": {"mixplane-runc": {"path": str(RUNC_CLAMP)}},
               "log-driver": "json-file", "log-opts": {"max-size": "20m", "max-file": "2"}, "dns": [DNS_IP]}
        p = d / "daemon.json"
        p.write_text(json.dumps(cfg, indent=1))
        return p

    def remove_containers(self) -> None:
        ids = self.docker("ps", "-aq", check=False).stdout.split()
        if ids:
            self.docker("rm", "-f", "-v", *ids, check=False, timeout=180)

    def restore_host(self, kube_proxy: str | None) -> list[str]:
        """Undo what prepare_host and the node's processes changed (they are stopped). Returns what differs still."""
        st = self.state
        problems = []
        if kube_proxy and st.get("kube_proxy_ran"):
            subprocess.run([kube_proxy, "--cleanup", "--proxy-mode=iptables"], capture_output=True, timeout=60)
        if st.get("egress"):
            remove_egress(st["cgroup2"])
        # what --cleanup leaves: kube-proxy's canaries and the KUBE-MARK-* chains (kubelet's, shared, in 1.20)
        before_rules = set((st.get("iptables_before") or "").splitlines())
        _drop_chains([ln for ln in iptables_save().splitlines() if ln not in before_rules])
        _umount_under(self.wd, docker_root())
        if Path("/sys/class/net/docker0").exists() and st.get("bridge_created"):
            subprocess.run(["ip", "link", "del", "docker0"], capture_output=True)
        for k, v in (st.get("sysctls") or {}).items():
            _write_sysctl(k, v)
        for d in LOG_DIRS:
            if str(d) not in st.get("log_dirs_existed", [str(x) for x in LOG_DIRS]) and d.exists():
                shutil.rmtree(d, ignore_errors=True)
        if st.get("containers_cpu_shares") and (CONTAINERS_CPU / "cpu.shares").exists():
            try:
                (CONTAINERS_CPU / "cpu.shares").write_text(st["containers_cpu_shares"])
            except OSError as e:
                problems.append(f"cgroup {CONTAINERS_CPU}/cpu.shares: {e}")
        before = set(st.get("cgroups") or [])
        new = [rel for rel in set(_cgroup_dirs()) - before if _node_cgroup(rel)]
        for rel in sorted(new, key=lambda p: p.count("/"), reverse=True) if before else []:
            try:
                os.rmdir(CGROUP_ROOT / rel)
            except OSError as e:
                problems.append(f"cgroup {rel}: {e}")
        cg = st.get("cgroup2")
        if cg and (CGROUP_ROOT / "unified" / cg).exists():
            try:
                os.rmdir(CGROUP_ROOT / "unified" / cg)
            except OSError as e:
                problems.append(f"cgroup unified/{cg}: {e}")
        for t in sorted(set(nft_tables()) - set(st.get("nft_tables_before") or nft_tables())):
            # a table iptables-nft created for our rules (mangle, nat): delete it once it holds no rule of anyone's
            fam, name = t.split()[1:3]
            if not [ln for ln in iptables_save().splitlines() if ln.startswith(name + " ")]:
                _sh("nft", "delete", "table", fam, name, check=False)
        if "iptables_before" in st and iptables_save() != st["iptables_before"]:
            problems.append("iptables differ:\n" + iptables_diff(st["iptables_before"], iptables_save()))
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
        return problems


def _drop_chains(lines: list[str]) -> None:
    """Flush, then delete, the KUBE-* chains among `lines` (iptables_save's "table :CHAIN" lines)."""
    chains = sorted({(t, c[1:]) for t, c, *_ in (ln.split() for ln in lines) if c.startswith(":KUBE-")})
    for t, c in chains:
        _sh("iptables", "-t", t, "-F", c, check=False)
    for t, c in chains:
        _sh("iptables", "-t", t, "-X", c, check=False)


def iptables_save() -> str:
    """Rules and user-defined chains per table (no counters): what must be the same after the node as before."""
    out, table = [], ""
    for ln in _sh("iptables-save", check=False).stdout.splitlines():
        if ln.startswith("*"):
            table = ln[1:]
        elif ln.startswith("-A"):
            out.append(f"{table} {ln}")
        elif ln.startswith(":") and ln.split()[1] == "-":  # a chain of someone's own (built-in ones have a policy)
            out.append(f"{table} {ln.split()[0]}")
    return "\n".join(sorted(out))


def nft_tables() -> list[str]:
    r = _sh("nft", "list", "tables", check=False)
    return sorted(ln.strip() for ln in r.stdout.splitlines() if ln.startswith("table "))


def iptables_diff(a: str, b: str) -> str:
    sa, sb = set(a.splitlines()), set(b.splitlines())
    return "\n".join([f"- {x}" for x in sorted(sa - sb)] + [f"+ {x}" for x in sorted(sb - sa)])


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200
