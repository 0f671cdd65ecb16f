"""Benchmark: cost and balance at 288 / 576 / 1152 GPUs (seed 001 Table 2 and Fig. 13).

For every mesh x per-DP-replica batch x sequence length x sample distribution, the real planner
(StepPlanner: exact mixing + best-fit packing) plans a few steps; on each step's selection we time

* ``cost_s``            — DGraph.cost: analytical FLOPs of every piece (backbone) and image (encoder);
* ``balance_greedy_s``  — DGraph.balance(method="greedy") (backbone rows, and images for VLM);
* ``balance_kk_s``      — the same with Karmarkar-Karp;

(each the fastest of 5 repeats on fresh graphs — the machine is shared — then the median over the
planned steps) and simulate the step on the trainer to get the per-step max / mean rank cost of vanilla (no
balancing: mix's packing in order, images on their own replica's ranks round-robin), greedy and KK.

Meshes (TP x PP x CP x DP): 288 = 4 x 8 x 1 x 9 and 576 = 4 x 4 x 4 x 9 (the paper's Fig. 12), and
1152 = 4 x 4 x 4 x 18 (the 576 mesh with data parallelism doubled).

Two batch settings. The paper's (dist ``text`` / ``coyo``): ``bs`` *samples* per data-parallel
rank of the module that consumes them (seed 001 §7.2: "a batch size of 72 for each GPU") — for
text the backbone's DP replica, for VLM the encoder's world-wide DP rank, so a backbone replica of
tp x pp x cp GPUs then trains bs x tp x pp x cp pairs — each sample its own sequence of at most
``seq`` tokens (longer ones truncated), 8 microbatches per replica; vanilla gives every replica
the next samples in sampling order and every GPU its own bs images, as a loader without
scheduling does. mixplane's default (dist ``text-packed`` / ``coyo-packed``): ``bs`` best-fit
*packed* rows of ``seq`` tokens per replica, one row per microbatch; vanilla is then mix's packing
in order, already even in tokens, so only the quadratic attention term and the encoder are left
to balance.

Distributions:
* ``text`` — the demo-data sources (`mixplane demo-data`: Python stdlib code, man pages, Debian
  docs), token counts from the demo tokenizer (bench/data/demo_token_lengths.npz; `--recompute`
  rebuilds it), mixed 40 / 30 / 30 by tokens; code and docs are heavy-tailed (docs up to 243k tokens,
  split into seq-sized pieces). Model: Llama-12B (h 4608, 45 layers, ffn 16384, vocab 128256).
* ``coyo`` — coyo-like image-text pairs: captions lognormal (median 16 tokens, 98% <= 64) with a 1%
  Pareto tail up to 2048; images with lognormal long sides (median 500 px, 64-4000) and aspect
  ratios 1:2..2:1, resized to <= 896 px, 14 px patches (up to 4096 per image), 2 x 2 merged into
  backbone tokens. Model: Llama-12B backbone + ViT-2B encoder (h 1664, 48 layers, ffn 8192) with
  world-wide data parallelism.

* ``navit`` (case-study row only) — navit-like pairs: images at their native resolution (no resize;
  long side lognormal, median 640 px, 64..8192 px, aspect 1:3..3:1, at most 128 x 128 = 16,384 patches),
  so patch counts are heavy-tailed (p50 ~1.2k, p99 ~16k patches against coyo's ~4k maximum); longer
  captions. Run on seed 001 §7.4's mesh (PP 9 x DP 8 x CP 2 x TP 4 = 576 GPUs, batch 128 read as 128
  packed 8k sequences), the row adds ``mesh``, ``sequences``, ``paper`` (37.24 s -> 15.91 s, 2.34x)
  and ``omissions``: what the simulation leaves out, so its speedup is set beside the paper's, not equated.

Simulated step time (FLOPs per GPU, i.e. time at a fixed throughput): every backbone DP replica
runs a 1F1B pipeline, ``(sum_m c_m + (pp - 1) max_m c_m) / (tp cp pp)`` over its microbatch costs
c_m (context parallelism splits a row evenly); with an encoder, every rank first encodes its images
and the all-to-all waits for the slowest. Step = max encoder rank + max backbone replica; the
imbalance of a variant is step / (mean encoder rank + mean backbone replica), and
``simulated_speedup`` = vanilla step / greedy step (next to the paper's measured 1.71x / 2.63x /
3.09x at 4k / 8k / 16k, which include effects this model leaves out: activation memory, OOM
avoidance, all-to-all imbalance).

Last stdout line: {"rows": [{gpus, bs, seq, dist, cost_s, balance_greedy_s, balance_kk_s,
imbalance_vanilla, imbalance_greedy, imbalance_kk, simulated_speedup}, ..., {the navit case-study row with
mesh, sequences, paper, omissions}]}
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from mixplane.layout import StepLayout  # noqa: E402
from mixplane.planner.context import PlanContext  # noqa: E402
from mixplane.planner.core import StepPlanner  # noqa: E402
from mixplane.planner.dgraph import vanilla_strategy  # noqa: E402
from mixplane.planner.cost import backbone_cost, encoder_cost  # noqa: E402
from mixplane.planner.dgraph import DGraph  # noqa: E402
from mixplane.protocol import window_fill_length  # noqa: E402
from mixplane.samples import make_key  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402

MESHES = {288: {"tp": 4, "pp": 8, "cp": 1, "dp": 9}, 576: {"tp": 4, "pp": 4, "cp": 4, "dp": 9},
          1152: {"tp": 4, "pp": 4, "cp": 4, "dp": 18}}
PAPER_SPEEDUP = {4096: 1.71, 8192: 2.63, 16384: 3.09}
LLAMA_12B = {"hidden": 4608, "layers": 45, "heads": 36, "ffn_hidden": 16384, "vocab": 128256, "gated_mlp": True}
VIT_2B = {"hidden": 1664, "layers": 48, "heads": 16, "ffn_hidden": 8192, "vocab": 1, "gated_mlp": False}
TEXT_WEIGHTS = {"code": 0.4, "man": 0.3, "docs": 0.3}
LENGTHS_FILE = HERE / "data" / "demo_token_lengths.npz"
CALIBRATION: dict | None = None  # --calibration: seconds per FLOP (mixplane calibrate) for both models
BLOCK = 1 << 16
DISTS = ("text", "coyo", "text-packed", "coyo-packed")
IMAGE_DISTS = ("coyo", "navit")
# seed 001 §7.4 case study: Llama-12B + ViT-2B on navit_data, PP 9 x DP 8 x CP 2 x TP 4 (576 GPUs), batch 128,
# iteration 37.24 s -> 15.91 s (2.34x); we read batch 128 as 128 packed 8k sequences per step (16 per DP replica)
CASE_MESH = {"tp": 4, "pp": 9, "cp": 2, "dp": 8}
CASE_PAPER = {"iteration_s_baseline": 37.24, "iteration_s_balanced": 15.91, "speedup": 2.34}
OMISSIONS = ("all-to-all time and its imbalance (encoder features to the backbone)", "activation memory and the OOMs "
             "/ recomputation the paper's baseline suffers", "kernel efficiency varying with sequence and image size",
             "CP / TP / PP communication and the pipeline's warm-up beyond 1F1B's (pp - 1) x max microbatch",
             "the paper's baseline loader (ours: mix's packing in order, images on their own replica's ranks)")
REPS = 5  # cost and balance are timed this many times per step on fresh graphs; the machine is shared, so
# the fastest of the repeats is the step's time (noise only ever adds), and rows report the median over steps


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


# ---- sample distributions ----------------------------------------------------------------------

def demo_lengths(recompute: bool = False) -> dict[str, np.ndarray]:
    if recompute or not LENGTHS_FILE.exists():
        from mixplane.demo.data import build_demo_data
        import pyarrow.parquet as pq
        from tokenizers import Tokenizer

        out = Path(os.environ.get("MIXPLANE_BENCH_DEMO", "/tmp/mixplane-bench-demo"))
        if not (out / "SUMMARY.json").exists():
            log(f"building demo data in {out} ...")
            build_demo_data(out)
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        res = {}
        for s in TEXT_WEIGHTS:
            texts = []
            for f in sorted((out / s).glob("*.parquet")):
                texts += pq.read_table(f, columns=["text"]).column("text").to_pylist()
            res[s] = np.array([len(tok.encode(t).ids) for t in texts], dtype=np.int32)
        LENGTHS_FILE.parent.mkdir(exist_ok=True)
        np.savez_compressed(LENGTHS_FILE, **res)
    d = np.load(LENGTHS_FILE)
    return {s: d[s].astype(np.int64) for s in TEXT_WEIGHTS}


def coyo_block(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(backbone tokens, encoder patches) of n coyo-like image-text pairs."""
    text = np.exp(rng.normal(math.log(16.0), 0.65, n))
    tail = rng.random(n) < 0.01
    text[tail] = np.minimum(2048, 64 * (1 + rng.pareto(1.5, int(tail.sum()))))
    text = np.maximum(1, text.astype(np.int64))
    long_side = np.clip(np.exp(rng.normal(math.log(500.0), 0.6, n)), 64, 4000)
    aspect = np.exp(rng.uniform(math.log(0.5), math.log(2.0), n))
    w, h = long_side, long_side / np.maximum(aspect, 1 / aspect)
    scale = np.minimum(1.0, 896.0 / np.maximum(w, h))
    w, h = np.maximum(14, w * scale), np.maximum(14, h * scale)
    patches = (np.ceil(w / 14) * np.ceil(h / 14)).astype(np.int64)
    tokens = text + np.ceil(patches / 4).astype(np.int64) + 1
    return tokens, patches


def navit_block(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(backbone tokens, encoder patches) of n navit-like pairs: images at their native resolution (no
    resize: long side lognormal, median 640 px, sigma 0.8, 64..8192 px, aspect 1:3..3:1), 14 px patches
    capped at 128 x 128 = 16,384 per image (NaViT packs native-resolution patch sequences), so patch
    counts have a heavy tail (p50 ~1.3k, p99 ~16k); captions longer than coyo's (lognormal, median 40
    tokens, 2% tail up to 2,048); 2 x 2 merged patches become backbone tokens."""
    text = np.exp(rng.normal(math.log(40.0), 0.8, n))
    tail = rng.random(n) < 0.02
    text[tail] = np.minimum(2048, 128 * (1 + rng.pareto(1.5, int(tail.sum()))))
    text = np.maximum(1, text.astype(np.int64))
    long_side = np.clip(np.exp(rng.normal(math.log(640.0), 0.8, n)), 64, 8192)
    aspect = np.exp(rng.uniform(math.log(1 / 3), math.log(3.0), n))
    w, h = long_side, long_side / np.maximum(aspect, 1 / aspect)
    pw, ph = np.ceil(np.maximum(14, w) / 14), np.ceil(np.maximum(14, h) / 14)
    scale = np.minimum(1.0, np.sqrt(16384.0 / (pw * ph)))  # the patch cap keeps the aspect ratio
    patches = (np.maximum(1, np.floor(pw * scale)) * np.maximum(1, np.floor(ph * scale))).astype(np.int64)
    tokens = text + np.ceil(patches / 4).astype(np.int64) + 1
    return tokens, patches


class SyntheticStreams:
    """Per (source, replica) deterministic streams of sample metadata, generated in vectorised blocks."""

    def __init__(self, dist: str, names: list[str], lengths: dict[str, np.ndarray] | None, seq_len: int):
        self.dist = dist
        self.names = names
        self.lengths = lengths
        self.seq_len = seq_len
        self.cache: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def block(self, si: int, rep: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        k = (si, rep, b)
        if k not in self.cache:
            rng = np.random.default_rng([si, rep, b, 12345])
            if self.dist == "coyo":
                self.cache[k] = coyo_block(rng, BLOCK)
            elif self.dist == "navit":
                self.cache[k] = navit_block(rng, BLOCK)
            else:
                L = self.lengths[self.names[si]]  # type: ignore[index]
                tok = L[rng.integers(0, len(L), BLOCK)] + 1  # + EOS
                self.cache[k] = (tok, np.zeros(BLOCK, np.int64))
            if len(self.cache) > 64:
                self.cache.pop(next(iter(self.cache)))
        return self.cache[k]

    def meta(self, si: int, rep: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, start + n, dtype=np.int64)
        tok = np.empty(n, np.int64)
        pat = np.empty(n, np.int64)
        for b in np.unique(pos // BLOCK):
            sel = (pos // BLOCK) == b
            t, p = self.block(si, rep, int(b))
            tok[sel] = t[pos[sel] % BLOCK]
            pat[sel] = p[pos[sel] % BLOCK]
        return tok, pat

    def fill(self, planner: StepPlanner) -> None:
        """Top windows up exactly as loaders do (shortest prefix that fills them), vectorised."""
        for w in planner.windows:
            if w.ready:
                continue
            start = w.next_pos  # the bench never restores, so nothing is skipped ahead of next_pos
            have_n, have_t = len(w), w.unconsumed_tokens
            chunk = 4096
            while True:
                tok, pat = self.meta(w.source, w.replica, start, chunk)
                k = window_fill_length(have_n, have_t, tok, w.min_samples, w.min_tokens, w.capacity)
                if k is not None:
                    pos = np.arange(start, start + k, dtype=np.int64)
                    w.add(pos, np.asarray(make_key(0, pos), np.int64), tok[:k], pat[:k])
                    break
                chunk *= 4


# ---- specs ---------------------------------------------------------------------------------------

def make_spec(gpus: int, bs: int, seq: int, dist: str, mesh: dict | None = None):
    packed = dist.endswith("-packed")
    dist = dist.removesuffix("-packed")
    mesh = mesh or MESHES[gpus]
    world = gpus
    modules = {"backbone": dict(mesh)}
    model = {"backbone": {**LLAMA_12B, **({"calibration": CALIBRATION} if CALIBRATION else {})}}
    if dist in IMAGE_DISTS:
        sources = [{"name": dist, "uri": f"/bench/{dist}", "kind": "image_text", "tokenizer": "/bench/tok.json",
                    "columns": ["image", "caption"]}]
        weights = {dist: 1.0}
        modules["encoder"] = {"dp": world}
        model["encoder"] = {**VIT_2B, **({"calibration": CALIBRATION} if CALIBRATION else {})}
    else:
        sources = [{"name": n, "uri": f"/bench/{n}", "kind": "tokens"} for n in TEXT_WEIGHTS]
        weights = TEXT_WEIGHTS
    doc = {"name": "bench", "sources": sources, "mixture": {"weights": weights, "unit": "tokens"},
           # paper setting: bs samples per GPU (every rank's share of the global batch), each its own sequence
           # of at most seq tokens, 8 microbatches per replica; packed: bs best-fit rows of seq tokens per
           # replica, one row per microbatch
           "batch": ({"sequences": bs * mesh["dp"], "seq_len": seq, "microbatches": bs, "packing": "best_fit",
                      "overlong": "split"} if packed else
                     {"sequences": bs * (world if dist in IMAGE_DISTS else mesh["dp"]), "seq_len": seq, "microbatches": 8,
                      "packing": "none",
                      "overlong": "truncate"}),
           "topology": {"modules": modules}, "model": model, "strategy": {"name": "vanilla"},
           "runtime": ({"window": 64, "window_max": 1 << 22, "metrics": False} if packed else
                       # one sample per row: a window of one step's samples per source is enough
                       {"window": bs * world + 1, "window_tokens": 1, "window_max": 1 << 22, "metrics": False})}
    if not packed and dist not in IMAGE_DISTS:
        doc["runtime"]["window"] = bs * mesh["dp"] + 1
    return parse_spec(doc)


# ---- simulation ----------------------------------------------------------------------------------

def simulate(layout_rows: np.ndarray, piece_cost: np.ndarray, n_rows: int, dp: int, mesh: dict,
             img_rank: np.ndarray | None, img_cost: np.ndarray | None, world: int) -> tuple[float, float]:
    """(step time, imbalance) in FLOPs per GPU; see the module docstring."""
    rc = np.bincount(layout_rows, weights=piece_cost, minlength=n_rows).reshape(dp, -1)
    gpus_per_replica = mesh["tp"] * mesh["cp"] * mesh["pp"]
    pipe = (rc.sum(axis=1) + (mesh["pp"] - 1) * rc.max(axis=1)) / gpus_per_replica
    step = pipe.max()
    mean = pipe.mean()
    if img_rank is not None and img_cost is not None:
        enc = np.bincount(img_rank, weights=img_cost, minlength=world)
        step += enc.max()
        mean += enc.mean()
    return float(step), float(step / mean)


def run_row(gpus: int, bs: int, seq: int, dist: str, steps: int, lengths: dict | None, mesh: dict | None = None) -> dict:
    spec = make_spec(gpus, bs, seq, dist, mesh)
    mesh = mesh or MESHES[gpus]
    names = spec.source_names()
    kind = dist.removesuffix("-packed")
    streams = SyntheticStreams(kind, names, lengths, seq)
    bb_cost = backbone_cost(spec)
    enc_cost = encoder_cost(spec) if kind in IMAGE_DISTS else None
    rec: dict[str, list[float]] = {k: [] for k in ("cost", "greedy", "kk", "iv", "ig", "ik", "sv", "sg", "sk")}
    info: dict[str, float] = {}

    def strategy(ctx: PlanContext) -> StepLayout:
        pieces = ctx.pieces
        info["pieces"] = len(pieces)
        info["images"] = int((pieces.patches > 0).sum())
        results = {}
        for method in ("none", "greedy", "karmarkar_karp"):
            tcs, tbs = [], []
            for _ in range(REPS if method != "none" else 1):  # fresh graph each time; fastest of the repeats
                g = DGraph(ctx)
                g.distribute("DP")
                img = g.images().distribute("WORLD") if enc_cost is not None else None
                t0 = time.perf_counter()
                g.cost(bb_cost)
                if img is not None:
                    img.cost(enc_cost)
                t1 = time.perf_counter()
                if method != "none":
                    g.balance(method, level="inter")
                    if img is not None:
                        img.balance(method)
                t2 = time.perf_counter()
                tcs.append(t1 - t0)
                tbs.append(t2 - t1)
            lay = g.plan()
            results[method] = (lay, float(np.min(tcs)), float(np.min(tbs)), g.piece_costs())
        w = gpus
        for method, key in (("none", "v"), ("greedy", "g"), ("karmarkar_karp", "k")):
            lay, tc, tb, pc = results[method]
            # costs of the layout's segments / images in layout order
            seg_cost = bb_cost({"length": lay.seg_len.astype(np.int64)})
            ic = enc_cost({"patches": lay.img_patches.astype(np.int64)}) if enc_cost is not None else None
            st, imb = simulate(lay.seg_row.astype(np.int64), seg_cost, ctx.rows, ctx.dp, mesh,
                               lay.img_rank.astype(np.int64) if ic is not None else None, ic, w)
            rec["s" + key].append(st)
            rec["i" + key].append(imb)
            if method == "greedy":
                rec["cost"].append(tc)
                rec["greedy"].append(tb)
            elif method == "karmarkar_karp":
                rec["kk"].append(tb)
        return results["none"][0]

    planner = StepPlanner(spec, strategy)
    t_plan = []
    for _ in range(steps):
        streams.fill(planner)
        t0 = time.perf_counter()
        planner.plan()
        t_plan.append(time.perf_counter() - t0)
    row = {
        "gpus": gpus, "bs": bs, "seq": seq, "dist": dist,
        "cost_s": round(float(np.median(rec["cost"])), 5),
        "balance_greedy_s": round(float(np.median(rec["greedy"])), 5),
        "balance_kk_s": round(float(np.median(rec["kk"])), 5),
        "imbalance_vanilla": round(float(np.mean(rec["iv"])), 4),
        "imbalance_greedy": round(float(np.mean(rec["ig"])), 4),
        "imbalance_kk": round(float(np.mean(rec["ik"])), 4),
        "simulated_speedup": round(float(np.mean(np.array(rec["sv"]) / np.array(rec["sg"]))), 3),
    }
    if mesh is not MESHES.get(gpus):
        row.update(mesh="x".join(f"{a.upper()}{mesh[a]}" for a in ("pp", "dp", "cp", "tp")), sequences=spec.rows_per_step,
                   paper=CASE_PAPER, omissions=list(OMISSIONS))
    log(f"{gpus:5d} GPUs bs {bs:3d} seq {seq:5d} {dist:11s}: {info['pieces']:7d} pieces {info['images']:7d} images | "
        f"cost {row['cost_s']:.4f}s greedy {row['balance_greedy_s']:.4f}s kk {row['balance_kk_s']:.4f}s | "
        f"imbalance vanilla {row['imbalance_vanilla']:.3f} greedy {row['imbalance_greedy']:.4f} kk {row['imbalance_kk']:.4f} | "
        f"speedup {row['simulated_speedup']:.2f}x (paper {CASE_PAPER['speedup'] if 'paper' in row else PAPER_SPEEDUP[seq]}x) | "
        f"whole plan() {np.median(t_plan):.2f}s")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset that ends within 60 s")
    ap.add_argument("--steps", type=int, default=None, help="steps planned per row (default 3, quick 1)")
    ap.add_argument("--recompute", action="store_true", help="rebuild the demo token counts")
    ap.add_argument("--calibration", metavar="JSON", help="a calibration (mixplane calibrate's `calibration` object) "
                    "applied to both models: costs, balancing and the simulated step are then in measured seconds")
    args = ap.parse_args()
    global CALIBRATION
    if args.calibration:
        CALIBRATION = json.loads(Path(args.calibration).read_text())
    lengths = demo_lengths(args.recompute)
    if args.quick:
        grid = [(g, 144, s, d) for g in (288, 1152) for s in (4096, 16384) for d in DISTS]
        steps = args.steps or 1
    else:
        grid = [(g, b, s, d) for g in (288, 576, 1152) for b in (72, 144) for s in (4096, 8192, 16384) for d in DISTS]
        steps = args.steps or 3
    t0 = time.perf_counter()
    rows = [run_row(g, b, s, d, steps, lengths) for g, b, s, d in grid]
    # seed 001 §7.4: the navit case study (native resolutions) on its mesh
    case = run_row(576, 16, 8192, "navit-packed", steps, lengths, CASE_MESH)
    rows.append(case)
    log(f"case study (navit, PP9 x DP8 x CP2 x TP4, 128 x 8k): simulated speedup {case['simulated_speedup']}x "
        f"beside the paper's {CASE_PAPER['speedup']}x; vanilla imbalance {case['imbalance_vanilla']}; not modelled: "
        + "; ".join(OMISSIONS))
    worst = max(max(r["imbalance_greedy"], r["imbalance_kk"]) for r in rows)
    target = [r for r in rows if r["gpus"] == 1152 and r["bs"] == 144 and r["seq"] == 16384]
    log(f"done in {time.perf_counter() - t0:.0f}s; worst balanced imbalance {worst:.4f} (target <= 1.05)")
    for r in target:
        log(f"1152/144/16k {r['dist']}: balance_greedy_s {r['balance_greedy_s']} (target <= 0.05, paper 0.357), "
            f"cost_s {r['cost_s']} (target <= 0.01, paper 0.107), balance_kk_s {r['balance_kk_s']}")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
