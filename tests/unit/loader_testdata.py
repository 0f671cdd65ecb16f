"""Small Parquet sources for the loader tests (written with pyarrow; reference reads use pyarrow)."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

WORDS = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "日本", "z", ""]


def mixed_table(n: int, seed: int = 0) -> pa.Table:
    """Strings, list<int32> with null lists and null items, nullable scalars of several types."""
    rng = np.random.default_rng(seed)
    text = [None if rng.random() < 0.1 else " ".join(rng.choice(WORDS, int(rng.integers(0, 40)))) for _ in range(n)]
    toks = [None if rng.random() < 0.05 else
            [None if rng.random() < 0.02 else int(x) for x in rng.integers(0, 50_000, int(rng.integers(0, 60)))]
            for _ in range(n)]
    return pa.table({
        "text": pa.array(text, pa.string()),
        "toks": pa.array(toks, pa.list_(pa.int32())),
        "ids": pa.array([list(map(int, rng.integers(0, 300, int(rng.integers(0, 50))))) for _ in range(n)],
                        pa.list_(pa.field("item", pa.int32(), nullable=False))),
        "i64": pa.array([None if i % 7 == 0 else i * 3 - 1000 for i in range(n)], pa.int64()),
        "f64": pa.array(rng.random(n)),
        "f32": pa.array(rng.random(n).astype(np.float32)),
        "flag": pa.array([None if i % 11 == 0 else bool(rng.random() < 0.5) for i in range(n)]),
        "blob": pa.array([bytes(rng.integers(0, 256, int(rng.integers(0, 9)), dtype=np.uint8)) for _ in range(n)]),
        "cat": pa.array(rng.choice(["x", "y", "z"], n)),
        "u16": pa.array(rng.integers(0, 60000, n).astype(np.uint16)),
        "large": pa.array(text, pa.large_string()),
    })


def text_table(n: int, seed: int = 0, start: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    return pa.table({
        "text": pa.array([f"doc {start + i}: " + " ".join(rng.choice(WORDS[:5], int(rng.integers(1, 60)))) for i in range(n)]),
        "ids": pa.array([[start + i] * int(rng.integers(1, 20)) for i in range(n)], pa.list_(pa.int32())),
        "row": pa.array(np.arange(start, start + n, dtype=np.int64)),
    })


def write_source(directory: str, nfiles: int = 3, rows: int = 1200, *, page_size: int = 2048, row_group_size: int = 500,
                 page_index: bool | list[bool] = True, version: str = "1.0", compression: str = "snappy",
                 checksum: bool = True, seed: int = 0, dictionary: bool = False) -> tuple[list[str], pa.Table]:
    """Files d/part-00.parquet ... with a global `row` column equal to the row's index in the source."""
    os.makedirs(directory, exist_ok=True)
    paths, tables = [], []
    start = 0
    for k in range(nfiles):
        t = text_table(rows + 37 * k, seed + k, start)
        start += len(t)
        p = os.path.join(directory, f"part-{k:02d}.parquet")
        pi = page_index[k % len(page_index)] if isinstance(page_index, list) else page_index
        pq.write_table(t, p, data_page_size=page_size, row_group_size=row_group_size, write_page_index=pi,
                       data_page_version=version, compression=compression, write_page_checksum=checksum,
                       use_dictionary=dictionary, write_batch_size=50)
        paths.append(p)
        tables.append(t)
    return paths, pa.concat_tables(tables)
