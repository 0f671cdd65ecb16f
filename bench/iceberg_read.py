"""Iceberg read throughput against the same files read as plain Parquet (seed 004's pipeline: a blend's inputs are
table snapshots).

Data: `--files` Parquet files of token documents (lognormal lengths around 400 tokens, several row groups, pyarrow's
defaults), written once under `--data`. The same files are registered in place as an Iceberg table's snapshot
(a SQLite catalog, pyiceberg's add_files: no copy), so both sources read identical bytes. Per source, in the same
process and interleaved (plain, iceberg, plain, ...): `list_s` (the source's listing: a directory walk, or the
catalog's snapshot planned into its data files), `open_s` (the stream opened: listing plus page index, the index
cache off so both read every footer), and `rows_per_s` / `tokens_per_s` over one epoch in page shuffle at the
loader's defaults; the median of `--repeats` runs. The two read the same rows: the benchmark asserts one epoch of
each has the same ids.

Usage: python bench/iceberg_read.py [--quick] [--files 16] [--rows 20000] [--repeats 3] [--data DIR]
The last stdout line is one JSON object: {"files": .., "rows": .., "plain": {...}, "iceberg": {...},
"iceberg_over_plain": {"rows_per_s": .., "open_s": ..}, "load_avg": [..]}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mixplane.loader.files import list_source_files  # noqa: E402
from mixplane.loader.stream import open_stream  # noqa: E402
from mixplane.samples import key_epoch  # noqa: E402
from mixplane.spec import SourceSpec  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_files(d: Path, files: int, rows: int) -> list[str]:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = []
    for f in range(files):
        lens = np.maximum(8, rng.lognormal(np.log(400), 0.7, rows).astype(np.int64))
        flat = rng.integers(3, 32_000, int(lens.sum()), dtype=np.int64)
        offsets = np.zeros(rows + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        table = pa.table({"tokens": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat)),
                          "id": pa.array(np.arange(f * rows, (f + 1) * rows), pa.int64())})
        p = d / f"part-{f:03d}.parquet"
        pq.write_table(table, p, row_group_size=max(1, rows // 4), write_page_index=True)
        out.append(str(p))
    return out


def register(root: Path, paths: list[str]) -> str:
    from pyiceberg.catalog import load_catalog

    os.environ["PYICEBERG_CATALOG__BENCH__URI"] = f"sqlite:///{root}/catalog.db"
    os.environ["PYICEBERG_CATALOG__BENCH__WAREHOUSE"] = f"file://{root}/warehouse"
    cat = load_catalog("bench", uri=f"sqlite:///{root}/catalog.db", warehouse=f"file://{root}/warehouse")
    cat.create_namespace("ns")
    table = cat.create_table("ns.docs", schema=pq.read_schema(paths[0]))
    table.add_files(paths)
    return f"iceberg://bench/ns.docs@{table.current_snapshot().snapshot_id}"


def one_run(uri: str, rows: int) -> tuple[dict[str, float], list[int]]:
    t0 = time.perf_counter()
    listed = list_source_files(uri)
    t_list = time.perf_counter() - t0
    src = SourceSpec(name="s", uri=uri, kind="tokens", columns=["tokens", "id"], shuffle="page")
    t0 = time.perf_counter()
    stream = open_stream(src, seed=1)
    t_open = time.perf_counter() - t0
    got, tokens, ids = 0, 0, []
    t0 = time.perf_counter()
    while got < rows:
        r = stream.take(min(4096, rows - got))
        first = key_epoch(r.keys) == 0
        got += int(first.sum())
        ids.extend(r.columns["id"].to_numpy()[first].tolist())
        tokens += int(sum(len(x) for x in r.columns["tokens"].to_numpy(zero_copy_only=False)[first]))
    t_read = time.perf_counter() - t0
    assert len(listed.paths) > 0
    return {"list_s": t_list, "open_s": t_open, "rows_per_s": got / t_read, "tokens_per_s": tokens / t_read}, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--files", type=int, default=None)
    ap.add_argument("--rows", type=int, default=None, help="rows per file")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--data", default=None)
    args = ap.parse_args()
    files = args.files or (4 if args.quick else 16)
    rows = args.rows or (5_000 if args.quick else 20_000)
    repeats = args.repeats or (2 if args.quick else 3)
    os.environ["MIXPLANE_INDEX_CACHE"] = ""  # both read every footer and index
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="iceberg-bench-") as tmp:
        root = Path(args.data or tmp)
        paths = write_files(root / "data", files, rows)
        uris = {"plain": str(root / "data"), "iceberg": register(root, paths)}
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in uris}
        seen: dict[str, list[int]] = {}
        for i in range(repeats):
            for name, uri in uris.items():
                res, ids = one_run(uri, files * rows)
                runs[name].append(res)
                seen[name] = sorted(ids)
                log(f"run {i} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in res.items()))
        assert seen["plain"] == seen["iceberg"] == list(range(files * rows)), "the two sources read different rows"
    med = {name: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]} for name, rs in runs.items()}
    out = {"files": files, "rows": files * rows, "repeats": repeats, **med,
           "iceberg_over_plain": {"rows_per_s": round(med["iceberg"]["rows_per_s"] / med["plain"]["rows_per_s"], 3),
                                  "open_s": round(med["iceberg"]["open_s"] / med["plain"]["open_s"], 3)},
           "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
