"""Packing efficiency on the demo sources (seed 004: next fit wastes ~15%, best fit nears 100%).

    python bench/packing.py [--quick] [--data DIR] [--seq-len 4096]

Documents of the demo sources (`mixplane demo-data`; built into DIR if missing) are tokenized with the
demo tokenizer (plus end-of-text, as the loaders do), over-long ones split into seq_len chunks, and
packed three ways, each over the same stream of documents (the three sources interleaved):

* ``bfd``: best-fit-decreasing over consecutive chunks of 4096 documents (seed 004's sub-plans),
* ``next_fit``: the same chunks in stream order, a new row whenever a document does not fit,
* ``online_best_fit``: what the planner does per step — best fit, in arrival order, into a step of
  64 rows from a read-ahead window of 512 documents (documents that do not fit wait for the next step).

Efficiency = document tokens / (rows x seq_len). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from mixplane.planner.packing import OnlinePacker, packing_report_chunks, split_overlong  # noqa: E402


def doc_lengths(data: Path, max_docs: int | None) -> dict[str, np.ndarray]:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    out = {}
    for src in sorted(p for p in data.iterdir() if p.is_dir()):
        texts: list[str] = []
        for f in sorted(src.glob("*.parquet")):
            texts += pq.read_table(f, columns=["text"]).column("text").to_pylist()
            if max_docs and len(texts) >= max_docs:
                break
        texts = texts[:max_docs] if max_docs else texts
        enc = tok.encode_batch_fast(texts, add_special_tokens=False)
        out[src.name] = np.array([len(e.ids) + 1 for e in enc], dtype=np.int64)  # + end-of-text
    return out


def interleave(by_source: dict[str, np.ndarray], seed: int = 0) -> np.ndarray:
    """One stream mixing the sources in proportion to their document counts, in a fixed random order."""
    rng = np.random.default_rng(seed)
    tags = np.concatenate([np.full(len(v), i) for i, v in enumerate(by_source.values())])
    rng.shuffle(tags)
    its = [iter(v.tolist()) for v in by_source.values()]
    return np.array([next(its[t]) for t in tags], dtype=np.int64)


def online_best_fit(lengths: np.ndarray, seq_len: int, rows: int = 64, window: int = 512) -> tuple[float, int]:
    """The planner's per-step packing: best fit in arrival order from a bounded window."""
    _, _, pieces = split_overlong(lengths, seq_len, "split")
    pieces = pieces.tolist()
    buf: list[int] = []
    nxt = 0
    used = tokens = steps = 0
    while True:
        while len(buf) < window and nxt < len(pieces):
            buf.append(pieces[nxt])
            nxt += 1
        if not buf:
            break
        packer = OnlinePacker(rows, seq_len, "best_fit")
        keep = []
        for p in buf:
            if packer.largest_gap > 0 and packer.place(p) >= 0:
                tokens += p
            else:
                keep.append(p)
        if nxt >= len(pieces) and len(keep) == len(buf):
            break
        last = nxt >= len(pieces) and not keep
        if not last:  # the final, partly filled step is not a steady-state step
            used += rows
            steps += 1
        else:
            tokens -= sum(buf)
        buf = keep
    return tokens / float(used * seq_len) if used else 0.0, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", default=os.environ.get("MIXPLANE_DEMO_DATA", ".mixplane/demo-data"))
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=4096, help="documents per BFD / next-fit sub-plan")
    args = ap.parse_args()
    data = Path(args.data)
    if not (data / "tokenizer.json").exists():
        build = ["demo-data", str(data)]
        if args.quick:  # a smaller demo set of its own, so --quick stays within a minute
            data = Path(".mixplane/bench-packing-quick")
            build = ["demo-data", str(data), "--max-mb", "4"]
        if not (data / "tokenizer.json").exists():
            subprocess.run([sys.executable, "-m", "mixplane.cli", *build], check=True, stdout=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")})
    t0 = time.perf_counter()
    by_source = doc_lengths(data, 1500 if args.quick else None)
    lengths = interleave(by_source)
    S = args.seq_len
    res = {}
    for name, pol in (("bfd", "best_fit"), ("next_fit", "next_fit"), ("none", "none")):
        r = packing_report_chunks(lengths, S, pol, "split", chunk=args.chunk)
        res[name] = r
        print(json.dumps({"policy": name, **r.as_dict()}), flush=True)
    online, steps = online_best_fit(lengths, S)
    stats = {src: {"documents": int(len(v)), "mean": round(float(v.mean()), 1), "p50": int(np.median(v)),
                   "p99": int(np.percentile(v, 99)), "over_seq_len": int((v > S).sum())} for src, v in by_source.items()}
    print(json.dumps({"sources": stats, "online_steps": steps, "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    print(json.dumps({"seq_len": S, "documents": int(len(lengths)), "tokens": int(lengths.sum()),
                      "bfd_efficiency": round(res["bfd"].efficiency, 4),
                      "next_fit_efficiency": round(res["next_fit"].efficiency, 4),
                      "online_best_fit_efficiency": round(online, 4),
                      "unpacked_efficiency": round(res["none"].efficiency, 4)}), flush=True)


if __name__ == "__main__":
    main()
