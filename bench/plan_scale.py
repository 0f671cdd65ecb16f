"""Benchmark: one whole planner step at frontier scale (issue 14), split into its phases.

For meshes of {1,152, 4,608, 16,384} GPUs (TP 8 x PP 8 x CP 1 x DP {18, 72, 256}) x {16, 256, 1,024}
sources x global batches of {2k, 8k, 16k} sequences of 8k tokens (rounded down to a multiple of DP:
one packed row per microbatch), the real planner plans steps exactly as the planner server does:

* ``ingest``   — the loaders' metadata for the step goes into the windows (ReplicaWindow.add: what the
                 server does on every LOADER_META; the synthetic streams that produce it are not timed);
* ``mix``      — StepPlanner.select (DGraph.mix): the mixing sampler picks every piece and the
                 best-fit packer places it, one compiled loop (planner/selectloop.py), so mixing and
                 packing are one phase; the loop's one-off compile (or load from numba's cache) happens
                 before the first step and is reported as ``jit_s``;
* ``cost`` / ``balance`` — the built-in strategy's DGraph calls (vlm_balance: backbone rows over DP,
                 images over every encoder rank; greedy, inter), timed between the calls;
* ``layout``   — DGraph.plan (the StepLayout) plus the rest of StepPlanner.plan (the window store
                 gathering what the loaders announced, cursor before the step, snapshot, validation,
                 coverage check, window compaction);
* ``route``    — what PlannerServer._dispatch computes before sending: the cursor after the step,
                 routing.loader_routes, each constructor's images and layout (routing.image_parts,
                 routing.constructor_columns);
* ``encode``   — the cursor's JSON (protocol.cursor_array) and wire.encode_columns of every PLAN_LOADER
                 and PLAN_CONSTRUCTOR message (the frames the server hands to ZeroMQ) — bytes counted (after
                 the timer) per kind (``plan_bytes``) and per peer (mean / max, ``plan_bytes_per_peer``); a
                 constructor's message lists only its images (routing.image_parts);
* ``journal``  — Journal.step into a real journal file (bytes: the file's growth, the every-100-steps
                 checkpoint included);
* ``metrics``  — the per-step Prometheus updates _dispatch makes (per source and per window).

The process freezes its start-up objects out of garbage collection once the planner exists, as
``mixplane planner`` does (server.tune_gc).

Sources: 1 in 8 is image-text (coyo-like pairs: captions + images resized to <= 896 px, 14 px
patches merged 2 x 2; bench/balance.py), the others text with lognormal lengths whose medians range
from 200 to 4,000 tokens (sigma 1.2, capped at 128k, longer documents split into 8k pieces); weights
uniform in [0.5, 1.5]. Windows: runtime.window_tokens = 2 x the largest source's tokens per step
(the default, 2 x tokens per step, would hold 2 x 134 M tokens per source at 1,024 sources).

Each configuration runs in its own process (planner RSS = that process's peak RSS, the synthetic
streams included), plans ``warmup`` steps untimed and then ``steps`` timed steps.

Last stdout line: {"rows": [{"gpus", "sources", "sequences", "step_ms_p50", "step_ms_p99", "phases_ms":
{phase: p50}, "rss_mb", "plan_bytes": {"loaders", "constructors"}, "journal_bytes", "peers", ...}, ...]}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from balance import LLAMA_12B, VIT_2B, coyo_block  # noqa: E402

from mixplane.layout import StepLayout  # noqa: E402
from mixplane.metrics import make_metrics  # noqa: E402
from mixplane.planner import layoutloop, routeloop, selectloop  # noqa: E402
from mixplane.planner.context import PlanContext  # noqa: E402
from mixplane.planner.core import StepPlanner  # noqa: E402
from mixplane.planner.cost import backbone_cost, encoder_cost  # noqa: E402
from mixplane.planner.dgraph import DGraph  # noqa: E402
from mixplane.planner.journal import Journal, cursor_field  # noqa: E402
from mixplane.planner.server import StepMetrics, tune_gc  # noqa: E402
from mixplane.planner import dispatch  # noqa: E402
from mixplane.planner.dispatch import DispatchTopology  # noqa: E402
from mixplane.protocol import cursor_text_array, window_fill_length  # noqa: E402
from mixplane.samples import make_key  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402
from mixplane.topology import dp_ranks_of_group  # noqa: E402

SEQ = 8192
DP = {1152: 18, 4608: 72, 16384: 256}
GPUS = (1152, 4608, 16384)
SOURCES = (16, 256, 1024)
SEQUENCES = (2048, 8192, 16384)
PHASES = ("ingest", "mix", "cost", "balance", "layout", "route", "encode", "journal", "metrics")
BLOCK = 2048
IMAGE_EVERY = 8  # 1 source in 8 is image-text


def clock() -> np.ndarray:
    """(wall, CPU of this thread) in seconds: the machine is shared, so CPU time is reported beside wall time."""
    return np.array([time.perf_counter(), time.thread_time()])


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---- synthetic loaders ---------------------------------------------------------------------------

class Streams:
    """Deterministic per-source metadata streams, generated in blocks (only the current block is kept)."""

    def __init__(self, n_sources: int, seq_len: int):
        rng = np.random.default_rng(7)
        self.median = np.exp(rng.uniform(math.log(200), math.log(4000), n_sources))
        self.image = np.array([i % IMAGE_EVERY == IMAGE_EVERY - 1 for i in range(n_sources)])
        self.seq_len = seq_len
        self.cache: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}

    def block(self, si: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        have = self.cache.get(si)
        if have is None or have[0] != b:
            rng = np.random.default_rng([si, b, 4242])
            if self.image[si]:
                tok, pat = coyo_block(rng, BLOCK)
            else:
                tok = np.minimum(131072, 1 + rng.lognormal(math.log(self.median[si]), 1.2, BLOCK)).astype(np.int64)
                pat = np.zeros(BLOCK, np.int64)
            have = self.cache[si] = (b, tok, pat)
        return have[1], have[2]

    def meta(self, si: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        tok = np.empty(n, np.int64)
        pat = np.empty(n, np.int64)
        i = 0
        while i < n:
            p = start + i
            b, o = divmod(p, BLOCK)
            t, q = self.block(si, b)
            k = min(n - i, BLOCK - o)
            tok[i:i + k] = t[o:o + k]
            pat[i:i + k] = q[o:o + k]
            i += k
        return tok, pat

    def announce(self, planner: StepPlanner) -> list[tuple]:
        """What every loader would announce now: the shortest unconsumed prefix that fills its window."""
        out = []
        for w in planner.windows:
            if w.ready:
                continue
            start, have_n, have_t, chunk = w.next_pos, len(w), w.unconsumed_tokens, 256
            while True:
                tok, pat = self.meta(w.source, start, chunk)
                k = window_fill_length(have_n, have_t, tok, w.min_samples, w.min_tokens, w.capacity)
                if k is not None:
                    pos = np.arange(start, start + k, dtype=np.int64)
                    out.append((w, pos, np.asarray(make_key(w.source, pos), np.int64), tok[:k], pat[:k]))
                    break
                chunk *= 4
        return out


# ---- spec ----------------------------------------------------------------------------------------

def make_spec(gpus: int, n_sources: int, sequences: int, streams: Streams):
    dp = DP[gpus]
    rows = (sequences // dp) * dp
    rng = np.random.default_rng(11)
    weights = rng.uniform(0.5, 1.5, n_sources)
    p = weights / weights.sum()
    srcs = []
    for i in range(n_sources):
        s = {"name": f"s{i}", "uri": f"/bench/s{i}", "kind": "tokens"}
        if streams.image[i]:
            s.update(kind="image_text", tokenizer="/bench/tok.json", columns=["image", "caption"])
        srcs.append(s)
    tokens_per_step = rows * SEQ
    doc = {"name": "plan-scale", "sources": srcs,
           "mixture": {"weights": {f"s{i}": float(weights[i]) for i in range(n_sources)}, "unit": "tokens"},
           "batch": {"sequences": rows, "seq_len": SEQ, "microbatches": rows // dp, "packing": "best_fit",
                     "overlong": "split"},
           "topology": {"modules": {"backbone": {"tp": 8, "pp": 8, "cp": 1, "dp": dp}, "encoder": {"dp": gpus}}},
           "model": {"backbone": LLAMA_12B, "encoder": VIT_2B},
           "strategy": {"name": "vlm_balance"},
           "runtime": {"window": 32, "window_tokens": int(2 * tokens_per_step * p.max()) + SEQ,
                       "window_max": 1 << 20, "metrics": False}}
    return parse_spec(doc)


# ---- one configuration ---------------------------------------------------------------------------

def run_config(gpus: int, n_sources: int, sequences: int, warmup: int, steps: int) -> dict:
    jit_s = selectloop.warm() + routeloop.warm() + layoutloop.warm()
    streams = Streams(n_sources, SEQ)
    spec = make_spec(gpus, n_sources, sequences, streams)
    T: dict[str, np.ndarray] = {}
    info: dict[str, int] = {}
    bb, enc = backbone_cost(spec), encoder_cost(spec)

    def strategy(ctx: PlanContext) -> StepLayout:
        """vlm_balance's DGraph calls, timed between them."""
        t0 = clock()
        g = DGraph(ctx).mix()
        t1 = clock()
        g.distribute("DP")
        img = g.images().distribute("WORLD")
        g.cost(bb)
        img.cost(enc)
        t2 = clock()
        g.balance("greedy", "inter", True)
        img.balance("greedy")
        g.broadcast_at("TP")
        t3 = clock()
        lay = g.plan()
        T["select"], T["cost"], T["balance"] = t1 - t0, t2 - t1, t3 - t2
        info["pieces"] = len(ctx.pieces)
        info["images"] = int((ctx.pieces.patches > 0).sum())
        return lay

    planner = StepPlanner(spec, strategy)
    topo = DispatchTopology.of(spec)  # what PlannerServer keeps of its topology
    cons = [(ci, dp_ranks_of_group(spec, g)) for ci, g in enumerate(topo.groups)]
    m = make_metrics("planner")
    step_metrics = StepMetrics(m, spec.source_names(), planner.windows)  # labelled series looked up once, as the server does
    tmp = tempfile.mkdtemp(prefix="plan-scale-")
    jpath = os.path.join(tmp, "journal.jsonl")
    journal = Journal(jpath)
    journal.open(spec, 0, planner.cursor())
    tune_gc()  # as `mixplane planner` does once its server is up
    rec: dict[str, list[np.ndarray]] = {k: [] for k in (*PHASES, "step")}
    sizes: dict[str, list[float]] = {k: [] for k in ("loaders", "constructors", "journal", "loader_mean", "loader_max",
                                                      "constructor_mean", "constructor_max")}
    for s in range(warmup + steps):
        ann = streams.announce(planner)
        t0 = clock()
        for w, pos, key, tok, pat in ann:
            w.add(pos, key, tok, pat)
        t_ingest = clock() - t0
        t0 = clock()
        plan = planner.plan()
        t_plan = clock() - t0
        # PlannerServer._dispatch, the same code (planner.dispatch): cursor after, retire flags, routes, layouts
        t0 = clock()
        lay = plan.layout
        cursor_after = planner.cursor_later()
        retired = plan.retired if plan.retired is not None else planner.retired(plan.pieces)
        routed = dispatch.route(plan, topo, retired, cons)
        t_route = clock() - t0
        t0 = clock()  # the frames, counted once the timer stopped (the server sends them instead)
        _, msg_l = dispatch.loader_messages(routed, 0, lay.step, -1)
        cursor = cursor_text_array(cursor_after.json())
        msg_c = [frames for _, frames in dispatch.constructor_messages(routed, plan, 0, cursor)]
        t_encode = clock() - t0
        per_l = [sum(memoryview(f).nbytes for f in frames) for frames in msg_l]
        per_c = [sum(memoryview(f).nbytes for f in frames) for frames in msg_c]
        b_load, b_cons = sum(per_l), sum(per_c)
        del msg_l, msg_c
        size0 = os.path.getsize(jpath)
        t0 = clock()
        journal.step(plan)
        t_journal = clock() - t0
        j_bytes = os.path.getsize(jpath) - size0
        # the per-step metric updates _dispatch makes
        t0 = clock()
        step_metrics.record(plan, planner.schedule.at(lay.step).probs, planner.sampler.realized)
        m.planner_phase.set(lay.phase)
        t_metrics = clock() - t0
        layout = t_plan - T["select"] - T["cost"] - T["balance"]
        ph = {"ingest": t_ingest, "mix": T["select"], "cost": T["cost"], "balance": T["balance"],
              "layout": layout, "route": t_route, "encode": t_encode, "journal": t_journal, "metrics": t_metrics}
        total_s = sum(ph.values())
        if s >= warmup:
            for k, v in ph.items():
                rec[k].append(v)
            rec["step"].append(total_s)
            sizes["loaders"].append(b_load)
            sizes["constructors"].append(b_cons)
            sizes["loader_mean"].append(b_load / max(len(per_l), 1))
            sizes["loader_max"].append(max(per_l, default=0))
            sizes["constructor_mean"].append(b_cons / max(len(per_c), 1))
            sizes["constructor_max"].append(max(per_c, default=0))
            sizes["journal"].append(j_bytes)
        log(f"  step {s}: {total_s[0] * 1e3:8.1f} ms wall {total_s[1] * 1e3:8.1f} ms CPU ({info['pieces']} pieces, "
            f"{info['images']} images); CPU ms: " + " ".join(f"{k} {v[1] * 1e3:.1f}" for k, v in ph.items()))
    journal.close()
    # journal bytes per step: the step records plus the checkpoint every `every` steps, amortised
    ckpt = len(json.dumps({"event": "checkpoint", "step": 0, "session": 0, **cursor_field(planner.cursor())},
                          separators=(",", ":"))) + 1  # as Journal writes it (deflated when large)
    j_step = float(np.median(sizes["journal"]))
    ms = lambda v: round(float(v) * 1e3, 2)  # noqa: E731
    wall = {k: np.array([x[0] for x in v]) for k, v in rec.items()}
    cpu = {k: np.array([x[1] for x in v]) for k, v in rec.items()}
    peers = len(planner.windows) + len(topo.groups)
    return {
        "gpus": gpus, "sources": n_sources, "sequences": spec.rows_per_step, "seq_len": SEQ,
        "step_ms_p50": ms(np.median(wall["step"])), "step_ms_p99": ms(np.percentile(wall["step"], 99)),
        "phases_ms": {k: ms(np.median(wall[k])) for k in PHASES},
        "step_cpu_ms_p50": ms(np.median(cpu["step"])), "step_cpu_ms_p99": ms(np.percentile(cpu["step"], 99)),
        "phases_cpu_ms": {k: ms(np.median(cpu[k])) for k in PHASES},
        "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "plan_bytes": {"loaders": int(np.median(sizes["loaders"])), "constructors": int(np.median(sizes["constructors"]))},
        "plan_bytes_per_peer": {k: int(np.median(sizes[k])) for k in ("loader_mean", "loader_max", "constructor_mean",
                                                                      "constructor_max")},
        "journal_bytes": int(round(j_step + ckpt / journal.every)),
        "peers": peers, "loaders": len(planner.windows), "constructors": len(topo.groups),
        "pieces": info["pieces"], "images": info["images"], "steps": steps, "jit_s": round(jit_s, 3),
    }


def grid(quick: bool) -> list[tuple[int, int, int]]:
    if quick:
        return [(1152, 16, 2048), (1152, 256, 2048), (4608, 16, 2048)]
    return [(g, s, q) for g in GPUS for s in SOURCES for q in SEQUENCES]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the smallest rows; ends within 60 s")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 8, quick 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--only", default=None, help="run one configuration GPUS,SOURCES,SEQUENCES in this process")
    ap.add_argument("--rows", default=None, help="configurations to run, e.g. '16384,1024,16384;1152,16,2048'")
    args = ap.parse_args()
    steps = args.steps or (3 if args.quick else 8)
    if args.only:
        g, s, q = (int(x) for x in args.only.split(","))
        print(json.dumps(run_config(g, s, q, args.warmup, steps)))
        return
    todo = grid(args.quick) if not args.rows else [tuple(int(x) for x in r.split(",")) for r in args.rows.split(";")]
    rows = []
    t0 = time.perf_counter()
    for g, s, q in todo:
        log(f"{g} GPUs x {s} sources x {q} sequences of {SEQ}:")
        out = subprocess.run([sys.executable, __file__, "--only", f"{g},{s},{q}", "--steps", str(steps),
                              "--warmup", str(args.warmup)], stdout=subprocess.PIPE, check=True, text=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        log(f"  -> p50 {row['step_ms_p50']} ms p99 {row['step_ms_p99']} ms rss {row['rss_mb']} MB "
            f"plan bytes {row['plan_bytes']} journal {row['journal_bytes']} B peers {row['peers']}")
        rows.append(row)
    log(f"done in {time.perf_counter() - t0:.0f} s")
    for k, v in fit_exponents(rows).items():
        log(f"step time ~ {k}^b: " + ", ".join(f"{name} b = {b:.2f}" for name, b in v.items()))
    print(json.dumps({"rows": rows}))


def fit_exponents(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Least-squares slope of log(step time) against log(GPUs) (sources and sequences fixed) and against
    log(sources) (GPUs and sequences fixed), for wall and CPU p50; the largest slope over the groups."""
    out: dict[str, dict[str, float]] = {}
    for axis, keep in (("gpus", ("sources", "sequences")), ("sources", ("gpus", "sequences"))):
        res: dict[str, float] = {}
        for metric in ("step_ms_p50", "step_cpu_ms_p50"):
            groups: dict[tuple, list[tuple[float, float]]] = {}
            for r in rows:
                seq_class = min(SEQUENCES, key=lambda q: abs(q - r["sequences"]))
                key = tuple(seq_class if k == "sequences" else r[k] for k in keep)
                groups.setdefault(key, []).append((math.log(r[axis]), math.log(r[metric])))
            slopes = [float(np.polyfit(*zip(*g), 1)[0]) for g in groups.values() if len({x for x, _ in g}) > 1]
            if slopes:
                res[f"{metric} max"] = max(slopes)
                res[f"{metric} median"] = float(np.median(slopes))
        out[axis] = res
    return out


if __name__ == "__main__":
    main()
