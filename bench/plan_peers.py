"""Benchmark: the planner server with 1,024 simulated loaders and 512 simulated constructors (issue 14 item 3).

The real PlannerServer (real ZeroMQ ROUTER on 127.0.0.1, its own journal) in this process; the peers in
a few processes, one DEALER socket each, speaking the real protocol:

* a simulated Source Loader registers (HELLO), keeps the loaders' own `LoaderWindow` over a synthetic
  stream (text, lognormal lengths), announces exactly what a loader announces (LOADER_META), and on
  every PLAN_LOADER marks the planned spans consumed, retires samples, and announces the refill;
* a simulated Data Constructor registers (HELLO), asks for all the steps (NEED_STEPS) and records every
  PLAN_CONSTRUCTOR (the StepLayout of its DP rank and the cursor after the step).

Nothing moves payload; the point is the planner's fan-out. Checked at the end (``ok``): every plan
message the planner sent arrived (per peer, per step: sent == received), the planner counted 0
undeliverable and 0 bad messages, every constructor got every step, every peer got the SHUTDOWN the
planner's close() sends behind the last plans (it lingers until they left), and per step the spans the
loaders were told to send equal (as a multiset of (source, key, start, len, constructor)) the
segments the constructors were told to expect. ``planner_cpu_ms_per_step`` is the planner thread's
CPU time over the run divided by the steps (registration and metadata handling included).

Last stdout line: {"loaders", "constructors", "steps", "ok", "undeliverable", "bad_messages",
"plan_messages", "plan_bytes_per_step", "planner_cpu_ms_per_step", "wall_s", ...}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from mixplane import wire  # noqa: E402
from mixplane.loader.transforms import TransformedSamples  # noqa: E402
from mixplane.loader.window import LoaderWindow  # noqa: E402
from mixplane.planner.server import PlannerServer, tune_gc  # noqa: E402
from mixplane.protocol import plan_cursor  # noqa: E402
from mixplane.samples import Ragged, make_key  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402
from mixplane.wire import Kind  # noqa: E402

SEQ = 2048
M64 = (1 << 64) - 1


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_doc(loaders: int, constructors: int) -> dict[str, Any]:
    """One source per simulated loader (one replica), one DP rank per simulated constructor."""
    rng = np.random.default_rng(3)
    w = rng.uniform(0.5, 1.5, loaders)
    rows = 2 * constructors
    share = rows * SEQ * float(w.max() / w.sum())
    return {"name": "peers", "sources": [{"name": f"s{i}", "uri": f"/sim/s{i}", "kind": "tokens"} for i in range(loaders)],
            "mixture": {"weights": {f"s{i}": float(w[i]) for i in range(loaders)}, "unit": "tokens"},
            "batch": {"sequences": rows, "seq_len": SEQ, "microbatches": 2, "packing": "best_fit", "overlong": "split"},
            "topology": {"modules": {"backbone": {"dp": constructors}}}, "strategy": {"name": "llm_balance"},
            "runtime": {"window": 4, "window_tokens": int(2 * share) + SEQ, "metrics": False, "max_lead_steps": 8}}


def span_hash(src: np.ndarray, key: np.ndarray, start: np.ndarray, length: np.ndarray, dest: np.ndarray) -> int:
    """Order-free fingerprint of a multiset of spans: the sum of a 64-bit mix of each."""
    with np.errstate(over="ignore"):
        x = np.asarray(src, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        for v in (key, start, length, dest):
            x = (x ^ np.asarray(v, np.int64).astype(np.uint64)) * np.uint64(0xBF58476D1CE4E5B9)
            x ^= x >> np.uint64(31)
    return int(x.sum(dtype=np.uint64)) & M64


# ---- simulated peers ----------------------------------------------------------------------------------

class Rows:
    def __init__(self, keys: np.ndarray, positions: np.ndarray, ntokens: np.ndarray):
        self.keys, self.positions, self.ntokens = keys, positions, ntokens
        self.npatches = np.zeros(len(keys), np.int64)

    def __len__(self) -> int:
        return len(self.keys)


class Stream:
    """Sample p of source s: lognormal length (median 400 tokens), deterministic in (s, p)."""

    def __init__(self, source: int):
        self.source, self.position = source, 0

    def seek(self, position: int) -> None:
        self.position = int(position)

    def take(self, n: int, *, timeout: float | None = None) -> Rows:
        pos = np.arange(self.position, self.position + n, dtype=np.int64)
        self.position += n
        rng = np.random.default_rng([self.source, int(pos[0])])
        tok = np.minimum(4 * SEQ, 1 + rng.lognormal(math.log(400), 1.0, n)).astype(np.int64)
        return Rows(np.asarray(make_key(0, pos), np.int64), pos, tok)


def transform(raw: Rows) -> TransformedSamples:
    n = raw.ntokens.astype(np.int32)
    off = np.zeros(len(n) + 1, np.int64)
    np.cumsum(n, out=off[1:])
    return TransformedSamples(Ragged(np.zeros(int(off[-1]), np.int32), off), None, n, np.zeros(len(n), np.int32))


def peer_main(role: str, endpoint: str, lo: int, hi: int, doc: dict, steps: int, deadline_s: float) -> dict:
    spec = parse_spec(doc)
    ctx = zmq.Context()
    socks: dict[zmq.Socket, int] = {}
    windows: dict[int, LoaderWindow] = {}
    session: dict[int, int] = {}
    received: dict[str, list[int]] = {}  # peer -> steps it got a plan for
    spans: dict[int, list[int]] = {}  # step -> [count, hash]
    errors: list[str] = []
    done: set[int] = set()
    poller = zmq.Poller()
    for i in range(lo, hi):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.connect(endpoint)
        socks[s] = i
        poller.register(s, zmq.POLLIN)
        if role == "loader":
            windows[i] = LoaderWindow(Stream(i), transform, spec.window_bounds(i))
            wire.send(s, Kind.HELLO, {"role": "loader", "source": i, "replica": 0})
        else:
            wire.send(s, Kind.HELLO, {"role": "constructor", "index": i, "data_endpoint": "tcp://127.0.0.1:9",
                                      "client_endpoint": "tcp://127.0.0.1:9"})

    def announce(s: zmq.Socket, i: int) -> None:
        a = windows[i].fill()
        if len(a):
            wire.send(s, Kind.LOADER_META, {"session": session[i], "source": i, "replica": 0},
                      {"pos": a.pos, "key": a.key, "tokens": a.tokens, "patches": a.patches})

    def add(step: int, n: int, h: int) -> None:
        c = spans.setdefault(step, [0, 0])
        c[0] += n
        c[1] = (c[1] + h) & M64

    end = time.monotonic() + deadline_s

    def complete() -> bool:
        """Every peer of this process got the planner's SHUTDOWN (it comes after the peer's last plan)."""
        return len(done) == len(socks)

    while not complete() and time.monotonic() < end:
        for s, _ in poller.poll(200):
            i = socks[s]
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg = wire.decode(frames)
                k = msg.kind
                if k == Kind.WELCOME:
                    session[i] = msg.get("session", int)
                    if role == "loader":
                        windows[i].seek(msg.get("cursor", dict))
                        announce(s, i)
                    else:
                        wire.send(s, Kind.NEED_STEPS, {"session": session[i], "through": steps - 1})
                elif k == Kind.PLAN_LOADER:
                    step = msg.get("step", int)
                    received.setdefault(str(i), []).append(step)
                    w = windows[i]
                    pos, start, ln, dest, ret = (msg.array(x) for x in ("pos", "start", "len", "dest", "retire"))
                    keys = np.zeros(len(pos), np.int64)
                    for j in range(len(pos)):
                        if ln[j] > 0:
                            keys[j] = w.span(int(pos[j]), int(start[j]), int(ln[j]))[0]
                    for j in np.flatnonzero(ret):
                        w.retire(int(pos[j]))
                    m = ln > 0
                    add(step, int(m.sum()), span_hash(np.full(int(m.sum()), i), keys[m], start[m], ln[m], dest[m]))
                    announce(s, i)
                elif k == Kind.PLAN_CONSTRUCTOR:
                    step = msg.get("step", int)
                    received.setdefault(str(i), []).append(step)
                    a = msg.arrays
                    n = len(a["seg_key"])
                    add(step, n, span_hash(a["seg_source"], a["seg_key"], a["seg_start"], a["seg_len"], np.full(n, i)))
                    if plan_cursor(msg) is None:
                        errors.append(f"constructor {i} step {step}: no cursor after the step")
                elif k == Kind.SHUTDOWN:
                    done.add(i)
                elif k in (Kind.HEARTBEAT, Kind.ACK):
                    pass
                else:
                    errors.append(f"{role} {i}: unexpected {k.name}")
    for s in socks:
        s.close(0)
    ctx.term()
    return {"role": role, "received": received, "spans": {str(k): v for k, v in spans.items()},
            "complete": complete(), "peers": len(socks), "errors": errors[:20]}


# ---- the planner side ---------------------------------------------------------------------------------

class CountingPlanner(PlannerServer):
    """The real planner server, counting what it hands to ZeroMQ per peer and step."""

    def __init__(self, *a: Any, **kw: Any):
        super().__init__(*a, **kw)
        self.sent: dict[tuple[bytes, int], int] = {}
        self.plan_bytes = 0
        self.plan_messages = 0

    def _send(self, identity: bytes, kind: Kind, meta: dict[str, Any] | None = None,
              arrays: dict[str, np.ndarray] | None = None, *, frames: list | None = None) -> bool:
        ok = super()._send(identity, kind, meta, arrays, frames=frames)
        if ok and kind in (Kind.PLAN_LOADER, Kind.PLAN_CONSTRUCTOR):
            step = int((meta or {})["step"])
            self.sent[(identity, step)] = self.sent.get((identity, step), 0) + 1
            self.plan_messages += 1
            # the meta's JSON and the arrays' bytes (the frames after the header, when sent encoded)
            data = (sum(memoryview(f).nbytes for f in frames[1:]) if frames is not None
                    else sum(np.asarray(a).nbytes for a in (arrays or {}).values()))
            self.plan_bytes += len(json.dumps(meta)) + data
        return ok


def run(loaders: int, constructors: int, steps: int, loader_procs: int, constructor_procs: int,
        timeout_s: float) -> dict[str, Any]:
    doc = make_doc(loaders, constructors)
    spec = parse_spec(doc)
    tmp = tempfile.mkdtemp(prefix="plan-peers-")
    t_start = time.perf_counter()
    server = CountingPlanner(spec, "tcp://127.0.0.1:0", run_dir=tmp, metrics_port=None)
    tune_gc()  # as `mixplane planner` does once its server is up
    cpu: dict[str, float] = {}

    def serve() -> None:
        t0 = time.thread_time()
        try:
            server.run(max_seconds=timeout_s)
        finally:
            cpu["planner"] = time.thread_time() - t0

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    doc_file = os.path.join(tmp, "spec.json")
    with open(doc_file, "w") as f:
        json.dump({**doc, "_steps": steps}, f)
    procs = []
    for role, n, k in (("loader", loaders, loader_procs), ("constructor", constructors, constructor_procs)):
        cuts = np.linspace(0, n, k + 1).astype(int)
        for a, b in zip(cuts[:-1], cuts[1:]):
            procs.append(subprocess.Popen([sys.executable, __file__, "--peer", role, "--endpoint", server.endpoint,
                                           "--range", f"{a}:{b}", "--doc", doc_file, "--timeout", str(timeout_s)],
                                          stdout=subprocess.PIPE, text=True))
    end = time.monotonic() + timeout_s
    last = time.monotonic()
    while server.planned_through < steps - 1 and time.monotonic() < end and th.is_alive():
        time.sleep(0.05)
        if time.monotonic() - last > 15:
            last = time.monotonic()
            log(f"  {time.perf_counter() - t_start:.0f} s: {len(server.loaders)} loaders and {len(server.constructors)} "
                f"constructors registered, planned through step {server.planned_through}")
    planned = server.planned_through + 1
    t_planned = time.perf_counter() - t_start
    # the planner stops: its close() sends every peer SHUTDOWN behind its last plan, and what is still
    # queued leaves after the socket closed (linger); a peer stops at its SHUTDOWN
    ident = {**{f"loader:{k[0]}": v for k, v in server.loaders.items()},
             **{f"constructor:{c.index}": c.identity for c in server.constructors.values()}}
    server.stopped = True
    th.join(timeout=60)
    undeliverable = server.m.bad_messages.labels("planner", "undeliverable")._value.get()
    bad = server.m.bad_messages.labels("planner", "content")._value.get()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=timeout_s)
        results.append(json.loads(out.strip().splitlines()[-1]))
    sent = dict(server.sent)  # final: what the planner handed to ZeroMQ for every peer and step
    wall = time.perf_counter() - t_start
    got: dict[tuple[bytes, int], int] = {}
    spans: dict[str, dict[int, list[int]]] = {"loader": {}, "constructor": {}}
    errors: list[str] = []
    complete = 0
    for r in results:
        errors += r["errors"]
        complete += r["peers"] if r["complete"] else 0
        for peer, stp in r["received"].items():
            for s in stp:
                key = (ident[f"{r['role']}:{peer}"], s)
                got[key] = got.get(key, 0) + 1
        for s, (n, h) in r["spans"].items():
            c = spans[r["role"]].setdefault(int(s), [0, 0])
            c[0] += n
            c[1] = (c[1] + h) & M64
    cons_ids = {c.identity for c in server.constructors.values()}
    cons_steps = {s for (i, s) in got if i in cons_ids}
    per_cons: dict[bytes, int] = {}
    for (i, _s) in got:
        if i in cons_ids:
            per_cons[i] = per_cons.get(i, 0) + 1
    every_constructor = all(per_cons.get(i, 0) == planned for i in cons_ids)
    matched = spans["loader"] == spans["constructor"] and len(spans["loader"]) == planned
    ok = (planned == steps and got == sent and undeliverable == 0 and bad == 0 and every_constructor
          and matched and not errors and complete == loaders + constructors and cons_steps == set(range(steps)))
    return {"loaders": loaders, "constructors": constructors, "peers": loaders + constructors, "steps": planned,
            "ok": bool(ok), "undeliverable": int(undeliverable), "bad_messages": int(bad),
            "plan_messages": sum(sent.values()), "delivered_equals_sent": got == sent,
            "spans_match": bool(matched), "every_constructor_every_step": bool(every_constructor),
            "peers_complete": complete, "plan_bytes_per_step": int(server.plan_bytes / max(planned, 1)),
            "planner_cpu_ms_per_step": round(cpu.get("planner", float("nan")) * 1e3 / max(planned, 1), 2),
            "planned_in_s": round(t_planned, 2), "wall_s": round(wall, 2), "errors": errors[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="128 loaders, 64 constructors, 20 steps (within 60 s)")
    ap.add_argument("--loaders", type=int, default=1024)
    ap.add_argument("--constructors", type=int, default=512)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--procs", default="4,2", help="loader processes, constructor processes")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--peer", choices=("loader", "constructor"), help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--range", help=argparse.SUPPRESS)
    ap.add_argument("--doc", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        lo, hi = (int(x) for x in args.range.split(":"))
        with open(args.doc) as f:
            doc = json.load(f)
        steps = doc.pop("_steps")
        print(json.dumps(peer_main(args.peer, args.endpoint, lo, hi, doc, steps, args.timeout)))
        return
    if args.quick:
        args.loaders, args.constructors, args.steps = 128, 64, 20
    lp, cp = (int(x) for x in args.procs.split(","))
    row = run(args.loaders, args.constructors, args.steps, lp, cp, args.timeout)
    log(f"{row['loaders']} loaders + {row['constructors']} constructors, {row['steps']} steps: ok={row['ok']} "
        f"undeliverable={row['undeliverable']} planner CPU {row['planner_cpu_ms_per_step']} ms/step, {row['wall_s']} s")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
