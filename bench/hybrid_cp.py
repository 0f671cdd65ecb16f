"""Benchmark: hybrid DP x CP consumers beside the fixed CP scheme, on bench/balance.py's meshes and text mixture.

For every mesh with context parallelism (576 = TP4 x PP4 x CP4 x DP9, 1152 = the same with DP18, and seed 001's
case-study mesh PP9 x DP8 x CP2 x TP4) x batch x sequence length x distribution, the real planner (StepPlanner:
exact mixing of the demo-data token lengths, 40 / 30 / 30, Llama-12B FLOPs) plans a few steps, with bench/balance.py's
two batch settings: ``text-packed`` (mixplane's default: ``bs`` best-fit packed rows of ``seq`` tokens per DP
replica) and ``text`` (the paper's: ``bs`` samples per replica, each its own row, longer ones truncated). On each
step's selection we compare the cost every DP x CP rank carries:

* ``fixed_vanilla``  — mix's packing in order, every row cut over its replica's CP group (zig-zag shards);
* ``fixed_greedy``   — ``llm_balance`` on axis CP, level ``both`` (rows dealt by their busiest shard, documents
  ordered inside rows for even shards) — the best the fixed scheme does;
* ``hybrid``         — DGraph.hybrid_cp(): every piece on a power-of-two group of DP x CP ranks sized by its
  length (at most seq_len / cp tokens of it per rank), short ones whole on one rank, placed by cost (LPT) with
  no rank holding more tokens than in the fixed scheme.

``fixed_greedy_even`` is ``fixed_greedy`` under bench/balance.py's model instead (a row's cost split evenly over its
CP group): the zig-zag shards count padding as free, so in a row mostly of padding (``text``: one sample per row)
the sample sits in CP rank 0's first chunk and that rank carries it alone -- true for varlen attention on padded
rows, not for a BSHD kernel that computes the padding too; the even split is the other bound.

``hybrid_delivered`` -- DGraph.hybrid_cp(deliver=True), what the plan carries and constructors deliver: the same
placement when every replica's pieces fit its rows (``delivered_dp_x_cp``: share of steps), else each replica's
pieces placed over its own cp ranks (rows as balanced). On the first step the constructor's own functions build
DP replica 0's batch (``materialize_rank`` over synthetic token spans) and cut every CP rank's message:
``bytes_fixed`` (``rank_view``, the fixed scheme's rows) and ``bytes_hybrid`` (``hybrid_view``) are the tensor
bytes per step to the replica's cp ranks (one rank per CP coordinate: PP stages and TP peers left out).

Per variant: imbalance = max / mean rank cost (1.0 is even); ``speedup_vs_fixed_greedy`` = the busiest fixed-greedy
rank's cost / the busiest hybrid rank's (the step time at a fixed throughput, pipeline and CP exchange left out);
``cp_token_fraction`` = share of the tokens that go through a CP exchange (1.0 in the fixed scheme); ``overflow`` =
pieces no group had token room for. ``place_s``: the time of hybrid_cp() (median over steps).

Last stdout line: {"rows": [{gpus, mesh, dist, bs, seq, imbalance_fixed_vanilla, imbalance_fixed_greedy,
imbalance_fixed_greedy_even, imbalance_hybrid, imbalance_hybrid_delivered, delivered_dp_x_cp,
speedup_vs_fixed_greedy, speedup_vs_fixed_greedy_even, speedup_delivered_vs_fixed_greedy, cp_token_fraction,
overflow, place_s, bytes_fixed, bytes_hybrid}, ...]}
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from balance import CASE_MESH, MESHES, SyntheticStreams, demo_lengths, log, make_spec  # noqa: E402
from broadcast_bytes import replica_batch  # noqa: E402

from mixplane.constructor.collate import hybrid_view  # noqa: E402
from mixplane.layout import StepLayout  # noqa: E402
from mixplane.parallelism import rank_view  # noqa: E402
from mixplane.planner import hybridcp  # noqa: E402
from mixplane.planner.balance import imbalance  # noqa: E402
from mixplane.planner.context import PlanContext  # noqa: E402
from mixplane.planner.core import StepPlanner  # noqa: E402
from mixplane.planner.cost import backbone_cost  # noqa: E402
from mixplane.planner.dgraph import DGraph  # noqa: E402


def replica_bytes(fixed: StepLayout, hybrid: StepLayout, cp: int) -> tuple[int, int]:
    """Tensor bytes the constructor sends DP replica 0's cp ranks per step: fixed CP rows, hybrid groups."""
    fb, hb = replica_batch(fixed), replica_batch(hybrid)
    nb = lambda v: sum(a.nbytes for a in v.values() if isinstance(a, np.ndarray))  # noqa: E731
    return (sum(nb(rank_view(fb, cp=cp, cp_rank=c)) for c in range(cp)),
            sum(nb(hybrid_view(hybrid, 0, hb, c)) for c in range(cp)))


def run_row(gpus: int, mesh: dict, bs: int, seq: int, dist: str, steps: int, lengths: dict) -> dict:
    spec = make_spec(gpus, bs, seq, dist, mesh)
    streams = SyntheticStreams("text", spec.source_names(), lengths, seq)
    cost = backbone_cost(spec)
    rec: dict[str, list[float]] = {k: [] for k in ("iv", "ig", "ie", "ih", "sp", "spe", "frac", "over", "t", "id",
                                                   "dd", "spd", "bf", "bh")}

    def strategy(ctx: PlanContext):
        van = DGraph(ctx).mix().distribute("CP").cost(cost)
        fv = hybridcp.fixed_loads(van.shard_costs(), ctx.dp)
        g = DGraph(ctx).distribute("CP").cost(cost).balance("greedy", level="both")
        fg = hybridcp.fixed_loads(g.shard_costs(), ctx.dp)
        rc = np.bincount(g.rows(), weights=g.piece_costs(), minlength=ctx.rows)  # bench/balance.py's model:
        fe = np.repeat(rc.reshape(ctx.dp, -1).sum(axis=1) / mesh["cp"], mesh["cp"])  # a row split evenly over CP
        t0 = time.perf_counter()
        p = g.hybrid_cp()
        rec["t"].append(time.perf_counter() - t0)
        rec["iv"].append(imbalance(fv))
        rec["ig"].append(imbalance(fg))
        rec["ie"].append(imbalance(fe))
        rec["spe"].append(float(fe.max() / p.loads.max()))
        rec["ih"].append(imbalance(p.loads))
        rec["sp"].append(float(fg.max() / p.loads.max()))
        rec["frac"].append(p.cp_token_fraction(ctx.pieces.length))
        rec["over"].append(p.overflow)
        fixed_layout = g.plan()
        d = g.hybrid_cp(deliver=True)  # what the plan carries (rows moved to the groups' replicas)
        rec["id"].append(imbalance(d.loads))
        rec["spd"].append(float(fg.max() / d.loads.max()))
        rec["dd"].append(float(ctx.stats["hybrid_cp"]["delivered"] == "dp_x_cp"))
        layout = g.plan()
        if not rec["bf"]:
            bf, bh = replica_bytes(fixed_layout, layout, mesh["cp"])
            rec["bf"].append(bf)
            rec["bh"].append(bh)
        return layout

    planner = StepPlanner(spec, strategy)
    for _ in range(steps):
        streams.fill(planner)
        planner.plan()
    row = {"gpus": gpus, "mesh": "x".join(f"{a.upper()}{mesh[a]}" for a in ("pp", "dp", "cp", "tp")),
           "dist": dist, "bs": bs, "seq": seq,
           "imbalance_fixed_vanilla": round(float(np.mean(rec["iv"])), 4),
           "imbalance_fixed_greedy": round(float(np.mean(rec["ig"])), 4),
           "imbalance_fixed_greedy_even": round(float(np.mean(rec["ie"])), 4),
           "imbalance_hybrid": round(float(np.mean(rec["ih"])), 4),
           "imbalance_hybrid_delivered": round(float(np.mean(rec["id"])), 4),
           "delivered_dp_x_cp": round(float(np.mean(rec["dd"])), 3),
           "speedup_delivered_vs_fixed_greedy": round(float(np.mean(rec["spd"])), 3),
           "bytes_fixed": int(rec["bf"][0]), "bytes_hybrid": int(rec["bh"][0]),
           "speedup_vs_fixed_greedy": round(float(np.mean(rec["sp"])), 3),
           "speedup_vs_fixed_greedy_even": round(float(np.mean(rec["spe"])), 3),
           "cp_token_fraction": round(float(np.mean(rec["frac"])), 3),
           "overflow": int(np.sum(rec["over"])), "place_s": round(float(np.median(rec["t"])), 4)}
    log(f"{gpus:5d} GPUs {row['mesh']:16s} {dist:11s} bs {bs:3d} x {seq:5d}: imbalance fixed vanilla {row['imbalance_fixed_vanilla']:.4f} "
        f"fixed greedy {row['imbalance_fixed_greedy']:.4f} (even split {row['imbalance_fixed_greedy_even']:.4f}) hybrid "
        f"{row['imbalance_hybrid']:.4f} delivered {row['imbalance_hybrid_delivered']:.4f} ({row['delivered_dp_x_cp']:.0%} dp x cp) "
        f"| replica bytes/step fixed {row['bytes_fixed'] / 1e6:.2f} MB hybrid {row['bytes_hybrid'] / 1e6:.2f} MB | busiest rank {row['speedup_vs_fixed_greedy']:.3f}x lighter (even split "
        f"{row['speedup_vs_fixed_greedy_even']:.3f}x) | {row['cp_token_fraction']:.1%} of tokens through CP | "
        f"overflow {row['overflow']} | hybrid_cp {row['place_s']:.3f}s")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one mesh, two sequence lengths, one step")
    ap.add_argument("--steps", type=int, default=None, help="steps planned per row (default 2, quick 1)")
    args = ap.parse_args()
    lengths = demo_lengths()
    meshes = [(576, MESHES[576]), (1152, MESHES[1152]), (576, CASE_MESH)]
    if args.quick:
        grid = [(576, MESHES[576], 16, s, "text-packed") for s in (4096, 16384)]
        steps = args.steps or 1
    else:
        grid = [(g, m, b, s, d) for d in ("text-packed", "text") for g, m in meshes for b in (16, 72)
                for s in (4096, 8192, 16384)]
        steps = args.steps or 2
    t0 = time.perf_counter()
    rows = [run_row(g, m, b, s, d, steps, lengths) for g, m, b, s, d in grid]
    log(f"done in {time.perf_counter() - t0:.0f}s")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
