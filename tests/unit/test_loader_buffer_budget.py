"""The shuffle buffer is bounded in bytes as well as rows, so long documents cannot blow a loader's memory."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader.stream import MIN_BUFFER_ROWS, open_stream
from mixplane.spec import SourceSpec


def write_text(path, n, size, seed=0):
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list("abcdefgh "), size)) for _ in range(n)]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=100, compression="zstd")
    return texts


def test_long_rows_get_fewer_buffer_rows(tmp_path):
    write_text(tmp_path / "long.parquet", 400, 20_000)
    src = SourceSpec(name="long", uri=str(tmp_path / "long.parquet"), tokenizer="x", shuffle_buffer_mb=4.0)
    s = open_stream(src, seed=0)
    assert 150 <= s.buffer_rows <= (4 << 20) // 20_000  # ~20 KB decoded per row
    tiny = open_stream(src.model_copy(update={"shuffle_buffer_mb": 0.1}), seed=0)
    assert tiny.buffer_rows == MIN_BUFFER_ROWS
    unbounded = open_stream(src.model_copy(update={"shuffle_buffer_mb": None}), seed=0)
    assert unbounded.buffer_rows == 10_000


def test_budgeted_stream_is_still_deterministic_and_complete(tmp_path):
    texts = write_text(tmp_path / "t.parquet", 300, 5_000)
    src = SourceSpec(name="t", uri=str(tmp_path / "t.parquet"), tokenizer="x", shuffle_buffer_mb=0.5)
    a = open_stream(src, seed=3).take(300)
    b = open_stream(src, seed=3).take(300)
    assert np.array_equal(a.keys, b.keys)
    assert sorted(a.columns["text"].to_pylist()) == sorted(texts)  # one epoch: every row once
