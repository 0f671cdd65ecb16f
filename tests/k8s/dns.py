"""The test node's cluster DNS: `<svc>.<ns>.svc[.cluster.local]` from the API server's Services and Endpoints.

Debian has no CoreDNS; this is the part of it the tier needs. A ClusterIP Service answers its IP; a headless one
the addresses of its ready endpoints, and `<hostname>.<svc>.<ns>.svc` the endpoint with that hostname (a
StatefulSet's pods). Every other name gets NXDOMAIN: nothing is forwarded (the cluster reaches only its own
ranges). Names are re-read from the API server at most every `refresh` seconds, and at once (rate-limited) on a
miss, so a Service created a moment ago resolves.

    python -m tests.k8s.dns --kubeconfig FILE --listen 172.17.0.1:53 [--domain cluster.local]
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import sys
import threading
import time
import urllib.request
from pathlib import Path

from dnslib import QTYPE, RCODE, RR, A, DNSRecord  # type: ignore[import-untyped]

TTL = 5


class Names:
    """name (lower case, no trailing dot) -> IPv4 addresses, rebuilt from lists of Services and Endpoints."""

    def __init__(self, server: str, token: str, ca: str, domain: str, refresh: float = 2.0):
        self.server, self.token, self.domain, self.refresh = server, token, domain, refresh
        self.ctx = ssl.create_default_context(cafile=ca)
        self.table: dict[str, list[str]] = {}
        self.loaded = 0.0
        self.lock = threading.Lock()

    def _get(self, path: str) -> dict:
        req = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, context=self.ctx, timeout=5) as r:
            return json.loads(r.read())

    def reload(self) -> None:
        services = self._get("/api/v1/services")["items"]
        endpoints = {(e["metadata"]["namespace"], e["metadata"]["name"]): e for e in self._get("/api/v1/endpoints")["items"]}
        table: dict[str, list[str]] = {}
        for s in services:
            ns, name = s["metadata"]["namespace"], s["metadata"]["name"]
            base = f"{name}.{ns}.svc"
            ip = s["spec"].get("clusterIP")
            ep = endpoints.get((ns, name)) or {}
            addrs = [a for sub in ep.get("subsets") or [] for a in sub.get("addresses") or []]
            if ip and ip != "None":
                table[base] = [ip]
            else:
                table[base] = sorted({a["ip"] for a in addrs})
            for a in addrs:
                if a.get("hostname"):
                    table.setdefault(f"{a['hostname']}.{base}", []).append(a["ip"])
        self.table = {**table, **{f"{k}.{self.domain}": v for k, v in table.items()}}
        self.loaded = time.monotonic()

    def lookup(self, name: str) -> list[str] | None:
        name = name.rstrip(".").lower()
        with self.lock:
            if time.monotonic() - self.loaded > self.refresh or (name not in self.table and time.monotonic() - self.loaded > 0.2):
                try:
                    self.reload()
                except OSError as e:  # the API server restarting: answer from what we had
                    print(f"dns: reload failed: {e}", file=sys.stderr, flush=True)
            return self.table.get(name)


def answer(names: Names, data: bytes) -> bytes:
    q = DNSRecord.parse(data)
    reply = q.reply()
    reply.header.ra = 0
    qn, qt = str(q.q.qname), q.q.qtype
    ips = names.lookup(qn)
    if ips is None:
        reply.header.rcode = RCODE.NXDOMAIN
    elif qt in (QTYPE.A, QTYPE.ANY):
        for ip in ips:
            reply.add_answer(RR(qn, QTYPE.A, rdata=A(ip), ttl=TTL))
    # AAAA and other types of a known name: NOERROR without answers (the cluster is IPv4 only)
    return reply.pack()


def serve(names: Names, host: str, port: int) -> None:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((host, port))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((host, port))
    tcp.listen(64)

    def tcp_loop() -> None:
        while True:
            conn, _ = tcp.accept()
            with conn:
                try:
                    conn.settimeout(5)
                    n = int.from_bytes(conn.recv(2), "big")
                    data = b""
                    while len(data) < n:
                        chunk = conn.recv(n - len(data))
                        if not chunk:
                            break
                        data += chunk
                    out = answer(names, data)
                    conn.sendall(len(out).to_bytes(2, "big") + out)
                except Exception as e:  # noqa: BLE001 - one bad client must not stop the server
                    print(f"dns: tcp: {e!r}", file=sys.stderr, flush=True)

    threading.Thread(target=tcp_loop, daemon=True).start()
    print(f"dns: serving {host}:{port}", flush=True)
    while True:
        data, peer = udp.recvfrom(4096)
        try:
            udp.sendto(answer(names, data), peer)
        except Exception as e:  # noqa: BLE001 - a malformed query
            print(f"dns: {peer}: {e!r}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.k8s.dns")
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--listen", required=True, help="HOST:PORT")
    ap.add_argument("--domain", default="cluster.local")
    a = ap.parse_args(argv)
    cfg = json.loads(Path(a.kubeconfig).read_text())
    cluster, user = cfg["clusters"][0]["cluster"], cfg["users"][0]["user"]
    host, port = a.listen.rsplit(":", 1)
    serve(Names(cluster["server"], user["token"], cluster["certificate-authority"], a.domain), host, int(port))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
