"""Benchmark: what one Data Constructor sends per step with and without selective broadcast (TP, PP, CP).

For seed 001's meshes (576 GPUs = TP4 x PP4 x CP4 x DP9, its case study PP9 x DP8 x CP2 x TP4) and sequence
lengths 4k / 8k / 16k, the real planner (StepPlanner, bench/balance.py's packed demo-data mixture) plans a step;
the constructor's own code builds one DP replica's batch from it (``materialize_rank`` over token spans of the
planned sizes) and cuts every rank's message of that replica with the constructor's functions
(``parallelism.rank_view`` under each broadcast set, ``bytes_per_step``), as ``constructor/server.py`` does.

Per broadcast set: ``bytes`` (tensor bytes the constructor sends for the replica per step), ``messages`` (ranks
that receive tensors; the others get metadata only) and ``fanout_bytes`` (what the trainer's ranks then send one
another: each receiver's holding, once). The batch: ``bs`` packed rows of ``seq`` tokens per replica.

Last stdout line: {"rows": [{mesh, ranks_per_replica, bs, seq, batch_bytes, broadcast: {name: {bytes, messages,
fanout_bytes}}}, ...]}
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from balance import CASE_MESH, MESHES, SyntheticStreams, demo_lengths, log, make_spec  # noqa: E402

from mixplane.constructor.collate import SpanStore, materialize_rank  # noqa: E402
from mixplane.layout import StepLayout  # noqa: E402
from mixplane.parallelism import META_ONLY, bytes_per_step, rank_view, receive_axis  # noqa: E402
from mixplane.planner.core import StepPlanner  # noqa: E402
from mixplane.planner.dgraph import vanilla_strategy  # noqa: E402

SETS = {"none": (), "PP": ("PP",), "CP": ("CP",), "CP+PP": ("CP", "PP"), "TP": ("TP",), "TP+PP": ("TP", "PP"),
        "TP+CP": ("TP", "CP"), "TP+CP+PP": ("TP", "CP", "PP")}


def dp_batch(gpus: int, mesh: dict, bs: int, seq: int, lengths: dict) -> dict:
    """DP replica 0's batch of one planned step, built by the constructor's materialize_rank."""
    spec = make_spec(gpus, bs, seq, "text-packed", mesh)
    planner = StepPlanner(spec, vanilla_strategy)
    SyntheticStreams("text", spec.source_names(), lengths, seq).fill(planner)
    return replica_batch(planner.plan().layout)


def replica_batch(lay: StepLayout) -> dict:
    """DP replica 0's batch of a layout, over synthetic token spans of the planned sizes."""
    spans = SpanStore.empty()
    rng = np.random.default_rng(0)
    for s in np.unique(lay.seg_source):
        sel = lay.seg_source == s
        n = lay.seg_len[sel].astype(np.int64) + 1  # the next token labels a piece's last position
        off = np.concatenate([[0], np.cumsum(n)])
        spans.add(int(s), lay.seg_key[sel], lay.seg_start[sel], off, rng.integers(0, 128000, int(off[-1])).astype(np.int32))
    return materialize_rank(lay, 0, spans)


def run_row(gpus: int, mesh: dict, bs: int, seq: int, lengths: dict) -> dict:
    batch = dp_batch(gpus, mesh, bs, seq, lengths)
    cp, pp, tp = mesh["cp"], mesh["pp"], mesh["tp"]
    coords = [(c, p, t) for p, c, t in itertools.product(range(pp), range(cp), range(tp))]
    out = {}
    for name, axes in SETS.items():
        sent, msgs = bytes_per_step(batch, coords, cp=cp, pp=pp, broadcast_at=axes)
        fan = 0
        for c, p, t in coords:  # a receiver gets its holding once, from its group's coordinate 0
            if receive_axis({"cp": c, "pp": p, "tp": t}, [a.lower() for a in axes]) is None:
                continue
            v = rank_view(batch, cp=cp, cp_rank=c, pp=pp, pp_stage=p, tp_rank=t, broadcast_at=axes)
            assert v[META_ONLY]
            fan += sum(int(np.prod(shape)) * np.dtype(dt).itemsize for dt, shape in v["shapes"].values())
        out[name] = {"bytes": int(sent), "messages": int(msgs), "fanout_bytes": int(fan)}
    row = {"mesh": "x".join(f"{a.upper()}{mesh[a]}" for a in ("pp", "dp", "cp", "tp")), "ranks_per_replica": len(coords),
           "bs": bs, "seq": seq, "batch_bytes": int(sum(v.nbytes for v in batch.values() if isinstance(v, np.ndarray))),
           "broadcast": out}
    log(f"{row['mesh']:16s} {bs:3d} x {seq:5d} (batch {row['batch_bytes'] / 1e6:7.2f} MB, {len(coords)} ranks): " + " | ".join(
        f"{n} {o['bytes'] / 1e6:8.2f} MB in {o['messages']:2d} msgs (+{o['fanout_bytes'] / 1e6:.2f} MB fan-out)"
        for n, o in out.items()))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one mesh, one sequence length")
    args = ap.parse_args()
    lengths = demo_lengths()
    grid = [(576, MESHES[576], 16, s) for s in ((8192,) if args.quick else (4096, 8192, 16384))]
    if not args.quick:
        grid += [(576, CASE_MESH, 16, s) for s in (4096, 8192, 16384)]
    rows = [run_row(g, m, b, s, lengths) for g, m, b, s in grid]
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
