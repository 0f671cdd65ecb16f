"""A zoo of Parquet files as data pipelines write them: pyarrow (every encoding it offers, data pages
v1 and v2, every codec, large types, int64 token ids), DuckDB, Polars and fastparquet (and Spark, in
the integration tests), all holding the same rows, so one directory of them is one source.

Columns: ``text`` (string, nulls), ``id`` (int64: the row's index in the source), ``toks``
(list<int32> token ids), ``meta`` (struct<url: string, score: double>, read as ``meta.url`` /
``meta.score``), ``turns`` (list<list<string>>: conversation turns). fastparquet cannot write nested
columns: its files hold ``text`` and ``id`` only.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ["alpha", "beta", "gamma", "δέλτα", "日本", "", "the quick brown fox"]
ALL_COLUMNS = ["text", "id", "toks", "meta.url", "meta.score", "turns"]
FLAT_COLUMNS = ["text", "id"]


def zoo_table(n: int, start: int = 0, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    text = [None if i % 13 == 5 else f"{start + i} " + " ".join(rng.choice(WORDS, int(rng.integers(0, 25))))
            for i in range(n)]
    toks = [list(map(int, rng.integers(0, 50_000, int(rng.integers(0, 40))))) for _ in range(n)]
    meta = [None if i % 17 == 3 else {"url": None if i % 5 == 0 else f"https://example.org/{start + i}",
                                      "score": float(rng.random())} for i in range(n)]
    turns = [None if i % 19 == 7 else
             [None if (i + k) % 11 == 0 else [" ".join(rng.choice(WORDS, int(rng.integers(1, 6))))
                                             for _ in range(int(rng.integers(0, 4)))]
              for k in range(int(rng.integers(0, 5)))]
             for i in range(n)]
    return pa.table({
        "text": pa.array(text, pa.string()),
        "id": pa.array(np.arange(start, start + n, dtype=np.int64)),
        "toks": pa.array(toks, pa.list_(pa.int32())),
        "meta": pa.array(meta, pa.struct([("url", pa.string()), ("score", pa.float64())])),
        "turns": pa.array(turns, pa.list_(pa.list_(pa.string()))),
    })


def reference_columns(path: str, columns: list[str]) -> dict[str, pa.Array]:
    """pyarrow's reading of ``columns`` of a file (``a.b``: field b of struct a, null where a is null)."""
    t = pq.read_table(path)
    out = {}
    for c in columns:
        if c in t.column_names:
            out[c] = t.column(c).combine_chunks()
        else:
            top, field = c.split(".", 1)
            s = t.column(top).combine_chunks()
            out[c] = s.flatten()[s.type.get_field_index(field)]
    return out


_DELTA = {"text": "DELTA_LENGTH_BYTE_ARRAY", "id": "DELTA_BINARY_PACKED", "toks": "DELTA_BINARY_PACKED",
          "meta.url": "DELTA_BYTE_ARRAY", "meta.score": "BYTE_STREAM_SPLIT",
          "turns.list.element.list.element": "DELTA_BYTE_ARRAY"}
_DELTA2 = {"text": "DELTA_BYTE_ARRAY", "id": "BYTE_STREAM_SPLIT", "toks": "BYTE_STREAM_SPLIT",
           "meta.url": "DELTA_LENGTH_BYTE_ARRAY", "meta.score": "BYTE_STREAM_SPLIT",
           "turns.list.element.list.element": "DELTA_LENGTH_BYTE_ARRAY"}
_SMALL = {"data_page_size": 4096, "row_group_size": 700}


def _pa(**kw) -> Callable[[pa.Table, str], None]:
    def write(t: pa.Table, p: str) -> None:
        pq.write_table(t, p, **{**_SMALL, **kw})
    return write


def _pa_large(t: pa.Table, p: str) -> None:
    """large_string / large_binary text and meta, int64 token ids: the same rows, other physical types."""
    t = t.set_column(0, "text", t.column("text").cast(pa.large_string()))
    t = t.set_column(2, "toks", t.column("toks").cast(pa.list_(pa.int64())))
    t = t.set_column(3, "meta", t.column("meta").cast(pa.struct([("url", pa.large_string()), ("score", pa.float64())])))
    pq.write_table(t, p, compression="lz4", data_page_version="2.0", **_SMALL)


def _duckdb(**options) -> Callable[[pa.Table, str], None]:
    def write(t: pa.Table, p: str) -> None:
        import duckdb

        con = duckdb.connect()
        try:
            con.register("zoo", t)
            opts = ", ".join(["FORMAT parquet", "ROW_GROUP_SIZE 700"] + [f"{k} {v}" for k, v in options.items()])
            con.execute(f"COPY (SELECT * FROM zoo ORDER BY id) TO '{p}' ({opts})")
        finally:
            con.close()
    return write


def _polars(**kw) -> Callable[[pa.Table, str], None]:
    def write(t: pa.Table, p: str) -> None:
        import polars as pl

        pl.from_arrow(t).write_parquet(p, row_group_size=700, data_page_size=4096, **kw)
    return write


def _fastparquet(page_version: int = 1, **kw) -> Callable[[pa.Table, str], None]:
    def write(t: pa.Table, p: str) -> None:
        import fastparquet.writer

        df = t.select(FLAT_COLUMNS).to_pandas()
        df["text"] = df["text"].astype(object)
        before = fastparquet.writer.DATAPAGE_VERSION  # its switch for v2 pages (else read from the environment)
        fastparquet.writer.DATAPAGE_VERSION = page_version
        try:
            fastparquet.write(p, df, row_group_offsets=700, object_encoding={"text": "utf8"}, write_index=False, **kw)
        finally:
            fastparquet.writer.DATAPAGE_VERSION = before
    return write


# (name, writer, columns it holds)
WRITERS: list[tuple[str, Callable[[pa.Table, str], None], list[str]]] = [
    ("pyarrow-v1-dict-snappy", _pa(), ALL_COLUMNS),
    ("pyarrow-v2-dict-zstd", _pa(data_page_version="2.0", compression="zstd"), ALL_COLUMNS),
    ("pyarrow-v1-delta-gzip", _pa(use_dictionary=False, column_encoding=_DELTA, compression="gzip"), ALL_COLUMNS),
    ("pyarrow-v2-delta-zstd", _pa(use_dictionary=False, column_encoding=_DELTA, data_page_version="2.0",
                                  compression="zstd"), ALL_COLUMNS),
    ("pyarrow-v2-split-brotli", _pa(use_dictionary=False, column_encoding=_DELTA2, data_page_version="2.0",
                                    compression="brotli", write_page_index=True), ALL_COLUMNS),
    ("pyarrow-v1-plain-none", _pa(use_dictionary=False, compression="none", write_page_index=True), ALL_COLUMNS),
    ("pyarrow-v2-large-lz4", _pa_large, ALL_COLUMNS),
    ("duckdb-v1-snappy", _duckdb(), ALL_COLUMNS),
    ("duckdb-v2-zstd", _duckdb(PARQUET_VERSION="V2", COMPRESSION="zstd"), ALL_COLUMNS),
    ("polars-zstd", _polars(), ALL_COLUMNS),
    ("polars-lz4-nostats", _polars(compression="lz4", statistics=False), ALL_COLUMNS),
    ("fastparquet-snappy", _fastparquet(compression="SNAPPY"), FLAT_COLUMNS),
    ("fastparquet-v2-none", _fastparquet(2, stats=False), FLAT_COLUMNS),
]


def write_zoo(directory: str, rows: int = 1500, writers=None) -> list[tuple[str, str, list[str], pa.Table]]:
    """One file per writer, rows numbered on across files; returns (writer, path, columns, table)."""
    os.makedirs(directory, exist_ok=True)
    out, start = [], 0
    for k, (name, write, cols) in enumerate(writers or WRITERS):
        t = zoo_table(rows + 31 * k, start, seed=k)
        p = os.path.join(directory, f"part-{k:02d}-{name}.parquet")
        write(t, p)
        out.append((name, p, cols, t))
        start += len(t)
    return out
