"""Transport benchmark: client receive throughput into torch tensors, small-message latency, CURVE cost.

    python bench/transport.py [--quick]

* ``gbps_plain``: the real trainer client (`MixtureLoader`, prefetch 2) pulling steps of 4, 16 and
  64 MB microbatches (input_ids, labels, position_ids, source_ids, cu_seqlens) from a server process
  speaking the constructor's protocol (ROUTE, GET_STEP -> STEP_DATA, zero-copy frames), over loopback
  TCP; bytes of tensors handed to the caller / wall time, all sizes together.
* ``gbps_curve``: the same with CURVE encryption and the ZAP allowlist on (what a secured run, the
  embedded runtime's default, pays on its payload sockets).
* ``gbps_ipc``: the same without CURVE over an ipc:// socket in a 0700 directory (the cheaper path a
  local run could use for payloads: only the same uid can connect).
* ``gbps_raw_zmq``: the limit of this machine: raw pyzmq PUSH/PULL of messages of the same sizes with
  zero-copy frames, received as numpy -> torch.
* ``checksum_gbps``: payload integrity alone, in one process: bytes per second through a checksummed
  STEP_DATA's encode (xxh3-64 per buffer, CRC-32 of the header, end marker) and its verifying decode, and
  ``checksum_ms_per_64mb`` what both sides together spend on one 64 MB message (payloads are checksummed by
  default since ``runtime.checksum_payloads`` became true; the server above sends them so).
* ``p50_us`` / ``p99_us``: round trip of a small request and reply (GET_STEP -> 1 KB STEP_DATA with the
  mixplane framing) over loopback TCP, without CURVE (with CURVE in the line before the last).

GB = 1e9 bytes. Server and client are separate processes (one core each on this machine).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from mixplane import wire  # noqa: E402
from mixplane.wire import Kind  # noqa: E402

MB = 1 << 20
SEQ = 4096


def make_batch(nbytes: int) -> dict[str, np.ndarray]:
    """A collated microbatch of about nbytes (28 bytes per token: 3 x int64 + int32)."""
    rows = max(1, round(nbytes / (28 * SEQ)))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50_000, size=(rows, SEQ), dtype=np.int64)
    return {"input_ids": ids, "labels": np.roll(ids, -1, axis=1),
            "position_ids": np.tile(np.arange(SEQ, dtype=np.int64), (rows, 1)),
            "source_ids": np.zeros((rows, SEQ), np.int32),
            "cu_seqlens": np.arange(0, rows * SEQ + 1, 512, dtype=np.int32)}


def serve(endpoint_q, nbytes: int, curve_dir: str | None, seconds: float, ipc_dir: str | None = None) -> None:
    """Planner + constructor stand-in: answers ROUTE and GET_STEP with a prebuilt batch (zero-copy)."""
    import zmq

    ctx = zmq.Context()
    auth = None
    sock = ctx.socket(zmq.ROUTER)
    wire.configure_socket(sock, sndhwm=64, rcvhwm=1000)
    if curve_dir:
        setup = wire.CurveSetup.from_dir(curve_dir, "server")
        auth = wire.Authenticator(ctx, setup.allow)
        wire.curve_server(sock, setup.keys)
    if ipc_dir:
        ep = f"ipc://{ipc_dir}/bench-{os.getpid()}.sock"
        sock.bind(ep)
    else:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        ep = f"tcp://127.0.0.1:{port}"
    endpoint_q.put(ep)
    batch = make_batch(nbytes) if nbytes else {"x": np.zeros(256, np.int32)}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not sock.poll(200):
            continue
        route, msg = wire.recv(sock, routed=True)
        if msg.kind == Kind.ROUTE:
            wire.send(sock, Kind.ROUTE_REPLY, {"constructor": 0, "endpoint": ep, "session": 0, "coords": {"rank": 0},
                                               "sources": ["bench"]}, route=route)
        elif msg.kind == Kind.GET_STEP:
            step = msg.get("step", int)
            wire.send(sock, Kind.STEP_DATA, {"step": step, "rank": 0, "phase": 0, "lr_scale": 1.0, "generation": 0,
                                             "session": 0, "microbatches": 1, "cursor_after": None},
                      batch, route=route)
        elif msg.kind == Kind.SHUTDOWN:
            break
    sock.close(0)
    if auth:
        auth.close()
    ctx.term()


def start_server(nbytes: int, curve_dir: str | None, seconds: float, ipc_dir: str | None = None):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=serve, args=(q, nbytes, curve_dir, seconds, ipc_dir), daemon=True)
    p.start()
    return p, q.get(timeout=30)


def stop(p) -> None:
    p.join(timeout=10)
    if p.is_alive():
        p.terminate()
        p.join()


def client_throughput(nbytes: int, steps: int, curve_dir: str | None, ipc_dir: str | None = None) -> tuple[int, float]:
    import torch  # noqa: F401

    from mixplane.client import MixtureLoader

    p, ep = start_server(nbytes, curve_dir, seconds=300, ipc_dir=ipc_dir)
    curve = wire.CurveSetup.from_dir(curve_dir, "client") if curve_dir else None
    warm = 2
    try:
        loader = MixtureLoader(ep, rank=0, prefetch=2, timeout_s=60, max_steps=steps + warm, curve=curve)
        total = 0
        t0 = None
        for i, b in enumerate(loader):
            if i == warm - 1:
                t0 = time.perf_counter()
            elif i >= warm:
                total += sum(v.numel() * v.element_size() for v in b.values() if v.dim() > 0)
        dt = time.perf_counter() - t0
        loader.close()
    finally:
        import zmq
        c = zmq.Context.instance()
        s = c.socket(zmq.DEALER)
        s.linger = 0
        if curve:
            wire.curve_client(s, curve.keys, curve.server_key("server"))
        s.connect(ep)
        wire.send(s, Kind.SHUTDOWN)
        time.sleep(0.05)
        s.close(0)
        stop(p)
    return total, dt


def raw_push(ep_q, nbytes: int, count: int) -> None:
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 4)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    ep_q.put(f"tcp://127.0.0.1:{port}")
    payload = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    for _ in range(count):
        s.send(payload, copy=False)
    s.close(linger=-1)
    ctx.term()


def raw_throughput(nbytes: int, count: int) -> tuple[int, float]:
    import torch
    import zmq

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    warm = 2
    p = ctx.Process(target=raw_push, args=(q, nbytes, count + warm), daemon=True)
    p.start()
    ep = q.get(timeout=30)
    zc = zmq.Context.instance()
    s = zc.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 4)
    s.connect(ep)
    total = 0
    t0 = None
    for i in range(count + warm):
        f = s.recv(copy=False)
        t = torch.from_numpy(np.frombuffer(f.buffer, dtype=np.uint8))
        if i == warm - 1:
            t0 = time.perf_counter()
        elif i >= warm:
            total += t.numel()
    dt = time.perf_counter() - t0
    s.close(0)
    stop(p)
    return total, dt


def latency(iters: int, curve_dir: str | None) -> tuple[float, float]:
    import zmq

    p, ep = start_server(0, curve_dir, seconds=120)
    c = zmq.Context.instance()
    s = c.socket(zmq.DEALER)
    s.linger = 0
    if curve_dir:
        setup = wire.CurveSetup.from_dir(curve_dir, "client")
        wire.curve_client(s, setup.keys, setup.server_key("server"))
    s.connect(ep)
    lat = np.empty(iters)
    for i in range(iters + 200):
        t0 = time.perf_counter()
        wire.send(s, Kind.GET_STEP, {"step": i, "rank": 0})
        wire.recv_timeout(s, 10, what="latency probe")
        if i >= 200:
            lat[i - 200] = time.perf_counter() - t0
    wire.send(s, Kind.SHUTDOWN)
    time.sleep(0.05)
    s.close(0)
    stop(p)
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


def checksum_cost(size: int, reps: int) -> tuple[float, float]:
    """(GB/s, ms per message) of encode + decode with checksums minus the same without, for one `size` message."""
    batch = make_batch(size)
    meta = {"step": 0, "rank": 0, "phase": 0, "lr_scale": 1.0}

    def run(checksum: bool) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            frames = wire.encode(Kind.STEP_DATA, meta, batch, checksum=checksum)
            wire.decode([f if isinstance(f, (bytes, np.ndarray)) else bytes(f) for f in frames])
            best = min(best, time.perf_counter() - t0)
        return best

    extra = max(1e-9, run(True) - run(False))
    nbytes = sum(a.nbytes for a in batch.values())
    return nbytes / extra / 1e9, extra * 1e3 * (64 * MB / nbytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="finish within 60 s")
    args = ap.parse_args()
    sizes = [4 * MB, 16 * MB, 64 * MB]
    per_size = (256 if args.quick else 2048) * MB  # bytes moved per size and mode
    curve_per_size = (48 if args.quick else 384) * MB
    iters = 2000 if args.quick else 20000
    keydir = tempfile.mkdtemp(prefix="mixplane-curve-")
    wire.generate_keys(keydir, "server")
    wire.generate_keys(keydir, "client")

    ipc_dir = tempfile.mkdtemp(prefix="mixplane-ipc-")  # mkdtemp: mode 0700
    res: dict[str, dict[int, float]] = {"plain": {}, "raw": {}, "curve": {}, "ipc": {}}
    tot = {k: [0, 0.0] for k in res}
    rounds = 2 if args.quick else 3
    for size in sizes:
        n = max(3, per_size // size // rounds)
        acc = {"raw": [0, 0.0], "plain": [0, 0.0]}
        for _ in range(rounds):  # alternate, so a noisy neighbour hits both modes alike
            for mode in ("raw", "plain"):
                b, dt = raw_throughput(size, n) if mode == "raw" else client_throughput(size, n, None)
                acc[mode][0] += b
                acc[mode][1] += dt
        for mode, (b, dt) in acc.items():
            res[mode][size] = b / dt / 1e9
            tot[mode][0] += b
            tot[mode][1] += dt
        nc = max(2, curve_per_size // size)
        b, dt = client_throughput(size, nc, keydir)
        res["curve"][size] = b / dt / 1e9
        tot["curve"][0] += b
        tot["curve"][1] += dt
        b, dt = client_throughput(size, nc, None, ipc_dir)
        res["ipc"][size] = b / dt / 1e9
        tot["ipc"][0] += b
        tot["ipc"][1] += dt
        print(json.dumps({"size_mb": size // MB, "gbps_plain": round(res["plain"][size], 3),
                          "gbps_raw_zmq": round(res["raw"][size], 3), "gbps_curve": round(res["curve"][size], 3),
                          "gbps_ipc": round(res["ipc"][size], 3)}), flush=True)
    p50, p99 = latency(iters, None)
    c50, c99 = latency(iters // 2, keydir)
    g = {k: tot[k][0] / tot[k][1] / 1e9 for k in tot}
    cs_gbps, cs_ms = checksum_cost(64 * MB, 3 if args.quick else 10)
    print(json.dumps({"latency_curve_p50_us": round(c50, 1), "latency_curve_p99_us": round(c99, 1),
                      "plain_over_raw": round(g["plain"] / g["raw"], 3), "latency": "round trip, 1 KB reply"}), flush=True)
    print(json.dumps({"gbps_plain": round(g["plain"], 3), "gbps_curve": round(g["curve"], 3), "gbps_ipc": round(g["ipc"], 3),
                      "gbps_raw_zmq": round(g["raw"], 3), "p50_us": round(p50, 1), "p99_us": round(p99, 1),
                      "checksum_gbps": round(cs_gbps, 2), "checksum_ms_per_64mb": round(cs_ms, 1)}), flush=True)


if __name__ == "__main__":
    main()
