"""What each decoding path of the page reader costs (issue 13 item 0): samples/s of a page-mode
stream over the same rows written several ways.

- ``numpy_dict``: pyarrow's defaults (dictionary + PLAIN fallback, data pages v1): the numpy fast path;
- ``numpy_plain``: ``use_dictionary=False``, PLAIN (fast path);
- ``arrow_delta``: ``use_dictionary=False`` with DELTA_LENGTH_BYTE_ARRAY text and DELTA_BINARY_PACKED
  token ids in data pages v2, as Spark's and DuckDB's v2 writers store them: Arrow's decoders, page by
  page (:func:`mixplane.loader.parquet.arrow_decode_page`);
- ``arrow_forced_dict`` / ``arrow_forced_plain``: the files of the numpy modes, every page forced through
  the Arrow path — the two paths side by side on identical bytes.

Columns: ``text`` (documents of ~0.3-3 KB) and ``toks`` (list<int32>, ~100-600 ids). Each mode reads
one epoch (every row once) after one warm-up pass over the index; the page index cache is off.

Usage: python bench/parquet_paths.py [--quick]
Last stdout line: {"rows": N, "modes": {NAME: {"samples_per_s": .., "mb_per_s": .., "path": "numpy"|"arrow"}},
"arrow_over_numpy": {"dict": .., "plain": ..}}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader import parquet as pr
from mixplane.loader.stream import open_stream
from mixplane.spec import SourceSpec

WORDS = np.array("the of and to in a is that for it as was with be by on not he this are or his from at which "
                 "but have an they you were her she there one all we their can been has more if will would "
                 "who so no data model training token page parquet arrow stream shuffle".split())


def table(n: int, seed: int, start: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    lens = rng.integers(50, 500, n)
    words = WORDS[rng.integers(0, len(WORDS), int(lens.sum()))]
    cuts = np.concatenate([[0], np.cumsum(lens)])
    text = [" ".join(words[cuts[i]:cuts[i + 1]]) for i in range(n)]
    tl = rng.integers(100, 600, n)
    ids = rng.integers(0, 50_000, int(tl.sum())).astype(np.int32)
    offs = np.concatenate([[0], np.cumsum(tl)]).astype(np.int32)
    return pa.table({"text": pa.array(text), "toks": pa.ListArray.from_arrays(pa.array(offs), pa.array(ids)),
                     "id": pa.array(np.arange(start, start + n, dtype=np.int64))})


def write(d: str, rows: int, files: int, **kw) -> None:
    os.makedirs(d, exist_ok=True)
    per = rows // files
    for k in range(files):
        pq.write_table(table(per, k, k * per), os.path.join(d, f"part-{k}.parquet"), **kw)


def run(d: str, force_arrow: bool, path: str) -> dict:
    native = pr.ColumnInfo.native
    if force_arrow:  # every column as if numpy could not decode it: every page through arrow_decode_page
        pr.ColumnInfo.native = property(lambda self: False)
    try:
        spec = SourceSpec(name="b", uri=d, columns=["text", "toks"], kind="text")
        s = open_stream(spec, seed=0, buffer_rows=2000)
        n = s.index.num_rows
        t0 = time.perf_counter()
        got, nbytes = 0, 0
        while got < n:
            r = s.take(min(1000, n - got))
            got += len(r.keys)
            nbytes += r.columns["text"].nbytes + r.columns["toks"].nbytes
        dt = time.perf_counter() - t0
        s.close()
    finally:
        pr.ColumnInfo.native = native
    return {"samples_per_s": round(got / dt, 1), "mb_per_s": round(nbytes / dt / 1e6, 1),
            "path": path}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    os.environ["MIXPLANE_INDEX_CACHE"] = ""
    rows = 12_000 if args.quick else 60_000
    with tempfile.TemporaryDirectory(prefix="mixplane-paths-") as tmp:
        dirs = {"dict": os.path.join(tmp, "dict"), "plain": os.path.join(tmp, "plain"), "delta": os.path.join(tmp, "delta")}
        write(dirs["dict"], rows, 4)
        write(dirs["plain"], rows, 4, use_dictionary=False)
        write(dirs["delta"], rows, 4, use_dictionary=False, data_page_version="2.0",
              column_encoding={"text": "DELTA_LENGTH_BYTE_ARRAY", "toks": "DELTA_BINARY_PACKED", "id": "DELTA_BINARY_PACKED"})
        modes = {}
        for name, d, force in [("numpy_dict", dirs["dict"], False), ("arrow_forced_dict", dirs["dict"], True),
                               ("numpy_plain", dirs["plain"], False), ("arrow_forced_plain", dirs["plain"], True),
                               ("arrow_delta", dirs["delta"], False)]:
            path = "arrow" if force or name == "arrow_delta" else "numpy"
            run(d, force, path)  # warm-up (page cache, imports)
            modes[name] = run(d, force, path)
            print(name, modes[name], flush=True)
    ratio = {k: round(modes[f"arrow_forced_{k}"]["samples_per_s"] / modes[f"numpy_{k}"]["samples_per_s"], 3)
             for k in ("dict", "plain")}
    print(json.dumps({"rows": rows, "modes": modes, "arrow_over_numpy": ratio}))


if __name__ == "__main__":
    main()
