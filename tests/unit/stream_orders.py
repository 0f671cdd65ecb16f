"""Recorded stream orders: what every shuffle mode delivers for fixed sources and seeds.

``tests/unit/data/stream_orders.json`` was written by ``python -m tests.unit.stream_orders`` with
the SourceStream as it was before the shuffle policies were split out of it (commit 3cf13a6);
test_loader_stream_orders.py checks that today's stream still delivers exactly those sequences.
Each case records the first keys in clear (readable diffs) and a SHA-256 of the whole run:
keys, positions and the delivered column bytes, over two epochs and a seek.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import numpy as np
import pyarrow.parquet as pq

from tests.unit.loader_testdata import text_table, write_source
from mixplane.spec import SourceSpec

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = os.path.join(HERE, "data", "stream_orders.json")
MODES = ("page", "row", "rowgroup", "sequential")

# name -> (mode, source layout, stream options, partition, num_partitions)
CASES: dict[str, tuple[str, str, dict, int, int]] = {}
for _m in MODES:
    CASES[f"{_m}-1"] = (_m, "plain", {"buffer_rows": 300}, 0, 1)
    CASES[f"{_m}-p1of3"] = (_m, "plain", {"buffer_rows": 200}, 1, 3)
    CASES[f"{_m}-dict"] = (_m, "dict", {"buffer_rows": 250}, 0, 1)
    CASES[f"{_m}-bad-page"] = (_m, "bad", {"buffer_rows": 100}, 0, 1)
CASES["page-reads3"] = ("page", "plain", {"buffer_rows": 300, "page_reads": 3}, 0, 1)
CASES["page-reads1-p0of2"] = ("page", "plain", {"buffer_rows": 300, "page_reads": 1}, 0, 2)
CASES["page-small-pages"] = ("page", "small", {"buffer_rows": 600}, 0, 1)
CASES["page-budget"] = ("page", "plain", {"buffer_rows": 5000, "buffer_bytes": 40_000}, 0, 1)
CASES["row-block7"] = ("row", "plain", {"buffer_rows": 300, "row_block": 7}, 0, 1)


def make_sources(root: str) -> dict[str, str]:
    """The sources the cases read (deterministic files for the pinned pyarrow)."""
    out = {}
    d = os.path.join(root, "plain")
    write_source(d, nfiles=3, rows=900, page_index=[True, False])
    out["plain"] = d
    d = os.path.join(root, "dict")
    write_source(d, nfiles=2, rows=700, dictionary=True, seed=5)
    out["dict"] = d
    d = os.path.join(root, "bad")
    paths, _ = write_source(d, nfiles=3, rows=400)
    from mixplane.loader import indexscan as scan
    idx = scan.build_source_index(paths, ["text", "row"], cache_dir=None)
    u = int(idx.primary["file_first_unit"][0]) + 2
    off, ln = int(idx.primary["unit_off"][u]), int(idx.primary["unit_len"][u])
    with open(paths[0], "r+b") as f:  # a page whose body is corrupt: its slots stay empty
        f.seek(off + ln - 8)
        f.write(b"\x00" * 8)
    out["bad"] = d
    d = os.path.join(root, "small")
    os.makedirs(d, exist_ok=True)
    n = 0
    for k in range(2):
        t = text_table(3000, k, n)
        n += len(t)
        pq.write_table(t, os.path.join(d, f"p{k}.parquet"), data_page_size=1024, write_batch_size=4,
                       row_group_size=1000, use_dictionary=False)
    out["small"] = d
    return out


def run_case(dirs: dict[str, str], name: str) -> dict:
    """Two epochs and a bit in uneven takes, then a seek back into epoch 0: keys, positions, data."""
    from mixplane.loader.stream import open_stream

    mode, layout, opts, p, N = CASES[name]
    spec = SourceSpec(name="src", uri=dirs[layout], columns=["text", "ids", "row"], kind="text", shuffle=mode)
    s = open_stream(spec, seed=11, partition=p, num_partitions=N, cache_dir=None, **opts)
    h = hashlib.sha256()
    keys = []
    sizes = [1, 2, 97, 1000, 5, 1500, 333, 64, 2000, 700]
    for k in sizes:
        r = s.take(k)
        keys.append(r.keys)
        h.update(r.keys.tobytes())
        h.update(r.positions.tobytes())
        for c in ("text", "ids", "row"):
            h.update(str(r.columns[c].to_pylist()).encode())
    mid = int(sum(sizes) // 3)
    s.seek(mid)
    r = s.take(400)
    h.update(b"seek")
    h.update(r.keys.tobytes())
    h.update(r.positions.tobytes())
    h.update(str(r.columns["text"].to_pylist()).encode())
    s.close()
    allk = np.concatenate(keys)
    return {"first_keys": allk[:40].tolist(), "n": int(len(allk)), "sha256": h.hexdigest()}


def record(root: str) -> dict:
    dirs = make_sources(root)
    return {name: run_case(dirs, name) for name in CASES}


if __name__ == "__main__":
    import tempfile

    os.environ["MIXPLANE_INDEX_CACHE"] = ""
    with tempfile.TemporaryDirectory() as t:
        rec = record(t)
    with open(sys.argv[1] if len(sys.argv) > 1 else RECORD, "w") as f:
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in rec.items()) + "\n}\n")
