"""Bounded documents (issue 10 item 3): one giant text row among normal rows.

A `text` source of normal documents (~2 KB each) with one row of ``--row-mb`` MiB in the middle,
read by a Source Loader's own pipeline (SourceStream -> text transform with the source's
tokenizer -> LoaderWindow), the window drained after every fill as the planner would. Measured in
a fresh process: the loader's peak RSS, the longest time one fill took (a step waits that long for
its data: the delivery stall), and what happened to the giant row (tokens delivered, documents
cut or dropped). The tokenizer is a byte-level BPE trained here on the normal documents.

Usage: python bench/big_row.py [--quick] [--row-mb 256] [--shuffle sequential|page|...] [--overlong-doc truncate|drop|split]
       [--max-doc-bytes N] [--max-doc-tokens N]
The last stdout line is one JSON object:
{"row_mb": ..., "peak_rss_mb": ..., "max_stall_s": ..., "samples": ..., "tokens": ..., "giant_tokens": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
         "you were her she there been one all we their has would when if so no will more out can its other into time "
         "loader planner constructor parquet page shuffle mixture token window budget stream epoch").split()


def _text(rng: np.random.Generator, nbytes: int) -> str:
    words = rng.choice(WORDS, size=max(1, nbytes // 5))
    s = " ".join(words.tolist())
    return s[:nbytes]


def build(data: str, row_mb: float, rows: int) -> dict:
    """The source (one Parquet file) and the tokenizer, reused when already built with these sizes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(data, exist_ok=True)
    tag = f"rows{rows}-giant{row_mb:g}mb"
    path = os.path.join(data, f"{tag}.parquet")
    tok = os.path.join(data, "tokenizer.json")
    rng = np.random.default_rng(0)
    normal = [_text(rng, int(rng.integers(500, 4000))) for _ in range(rows)]
    if not os.path.exists(tok):
        from mixplane.demo.data import train_tokenizer
        from pathlib import Path

        train_tokenizer(iter(normal), 1000, Path(tok))
    if not os.path.exists(path):
        block = _text(rng, 1 << 20)  # the giant row: a random 1 MiB block repeated
        giant = (block * int(np.ceil(row_mb)))[: int(row_mb * (1 << 20))]
        texts = normal[: rows // 2] + [giant] + normal[rows // 2 :]
        pq.write_table(pa.table({"text": pa.array(texts, pa.large_string())}), path + ".tmp", row_group_size=rows + 1,
                       compression="zstd")
        os.replace(path + ".tmp", path)
    return {"path": path, "tokenizer": tok, "rows": rows + 1, "giant_index": rows // 2}


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss it does not start at the parent's peak, which
    a child keeps across fork + exec on Linux, and the parent may have just built the giant row)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args) -> None:
    from mixplane.loader.stream import open_stream
    from mixplane.loader.transforms import make_transform
    from mixplane.loader.split import PIECE_SHIFT, PendingDoc
    from mixplane.loader.window import LoaderWindow
    from mixplane.spec import SourceSpec

    extra = {}
    if args.max_doc_bytes:
        extra["max_doc_bytes"] = args.max_doc_bytes
    if args.max_doc_tokens:
        extra["max_doc_tokens"] = args.max_doc_tokens
    if args.overlong_doc:
        extra["overlong_doc"] = args.overlong_doc
    src = SourceSpec(name="big", uri=args.path, kind="text", tokenizer=args.tokenizer, shuffle=args.shuffle, **extra)
    stream = open_stream(src, seed=0, cache_dir=None)
    window = LoaderWindow(stream, make_transform(src), (32, 16384, 256))
    base_mb = _peak_rss_mb()
    t_start = time.perf_counter()
    max_stall = 0.0
    samples = tokens = giant_tokens = 0
    giant_key = args.giant_index
    pieces = 0

    def pending() -> bool:  # split: pieces of the giant row still to come
        return any(isinstance(b, PendingDoc) for b in window.staged)

    while (stream.position < args.rows or pending()) and time.perf_counter() - t_start < args.budget:
        t0 = time.perf_counter()
        a = window.fill()
        max_stall = max(max_stall, time.perf_counter() - t0)
        for p in list(window.buffer):
            b = window.buffer[p]
            window.span(p, 0, len(b.tokens))
            if b.key == giant_key or (b.key < 0 and (-b.key) & ((1 << PIECE_SHIFT) - 1) == giant_key):
                giant_tokens += len(b.tokens)
                pieces += 1
            window.retire(p)
        samples += len(a)
        tokens += int(a.tokens.sum())
    out = {"row_mb": args.row_mb, "shuffle": args.shuffle, "peak_rss_mb": round(_peak_rss_mb(), 1),
           "base_rss_mb": round(base_mb, 1), "max_stall_s": round(max_stall, 2),
           "total_s": round(time.perf_counter() - t_start, 2), "rows_read": int(stream.position), "samples": samples,
           "tokens": tokens, "giant_tokens": giant_tokens, "giant_pieces": pieces,
           "dropped_overlong": int(window.dropped_overlong), "cut_overlong": int(window.cut_overlong),
           "split_overlong": int(window.split_overlong),
           "limits": {k: getattr(src, k, None) for k in ("max_doc_bytes", "max_doc_tokens", "overlong_doc")}}
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer normal rows (ends within 60 s)")
    ap.add_argument("--row-mb", type=float, default=256.0, help="size of the giant row (MiB)")
    ap.add_argument("--rows", type=int, default=None, help="normal rows (default 4000, quick 1000)")
    ap.add_argument("--max-doc-bytes", type=int, default=None, help="sources[].max_doc_bytes (default: the spec's)")
    ap.add_argument("--max-doc-tokens", type=int, default=None, help="sources[].max_doc_tokens (default: the spec's)")
    ap.add_argument("--overlong-doc", default=None, help="sources[].overlong_doc (default: the spec's)")
    ap.add_argument("--shuffle", default="sequential", help="the source's shuffle mode (sequential: the giant row is read mid-run)")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds the worker may run")
    ap.add_argument("--data", default=os.path.join(HERE, "data", "big_row"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--giant-index", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    rows = args.rows or (1000 if args.quick else 4000)
    t0 = time.perf_counter()
    man = build(args.data, args.row_mb, rows)
    print(json.dumps({"data": man, "build_s": round(time.perf_counter() - t0, 1)}), flush=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--path", man["path"], "--tokenizer", man["tokenizer"],
           "--rows", str(man["rows"]), "--giant-index", str(man["giant_index"]), "--row-mb", str(args.row_mb),
           "--budget", str(args.budget), "--shuffle", args.shuffle]
    for flag, v in (("--max-doc-bytes", args.max_doc_bytes), ("--max-doc-tokens", args.max_doc_tokens),
                    ("--overlong-doc", args.overlong_doc)):
        if v is not None:
            cmd += [flag, str(v)]
    env = dict(os.environ, MIXPLANE_INDEX_CACHE="")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit(f"worker failed ({p.returncode})")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
