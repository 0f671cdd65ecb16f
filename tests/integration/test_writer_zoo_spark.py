"""Spark's Parquet files (pyspark on the machine's JDK, local[1], bound to 127.0.0.1): its v1 writer
(dictionary, snappy) and its v2 writer (DELTA_* encodings, data pages v2, zstd), each decoded by the
page reader equal to pyarrow's reading, and read as one source together with pyarrow's files."""

import glob
import os
import shutil

import pyarrow.parquet as pq
import pytest

from tests.unit.test_loader_writer_zoo import _encodings, _read_all
from tests.unit.writer_zoo import ALL_COLUMNS, reference_columns, write_zoo, zoo_table
from mixplane.loader.stream import open_stream
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec


@pytest.fixture(autouse=True)
def _index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


@pytest.fixture(scope="module")
def spark_files(tmp_path_factory):
    assert shutil.which("java"), "Spark needs a JDK: apt-get install default-jre-headless"
    from pyspark.sql import SparkSession

    out = tmp_path_factory.mktemp("spark")
    spark = (SparkSession.builder.master("local[1]").appName("mixplane-zoo")
             .config("spark.ui.enabled", "false").config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").config("spark.sql.shuffle.partitions", "1")
             .getOrCreate())
    try:
        paths, tables = {}, {}
        for k, (name, opts) in enumerate([("spark-v1-snappy", {"compression": "snappy"}),
                           ("spark-v2-zstd", {"compression": "zstd", "parquet.writer.version": "v2",
                                              "parquet.block.size": str(64 << 10), "parquet.page.size": "4096"})]):
            tables[name] = t = zoo_table(1500, start=100_000 * (k + 1), seed=7 + k)
            w = spark.createDataFrame(t.to_pandas()).coalesce(1).write.mode("overwrite")
            for k, v in opts.items():
                w = w.option(k, v)
            w.parquet(str(out / name))
            (p,) = glob.glob(str(out / name / "*.parquet"))
            paths[name] = p
    finally:
        spark.stop()
    return paths, tables


def test_spark_files_decode_equal_to_pyarrow(spark_files):
    paths, tables = spark_files
    assert {"DELTA_BINARY_PACKED", "DELTA_BYTE_ARRAY"} & _encodings(paths["spark-v2-zstd"])
    for name, p in paths.items():
        got, _ = _read_all(p, ALL_COLUMNS)
        exp = reference_columns(p, ALL_COLUMNS)
        for c in ALL_COLUMNS:
            assert got[c].equals(exp[c].cast(got[c].type)), (name, c)
        assert sorted(got["id"].to_pylist()) == tables[name].column("id").to_pylist()


def test_spark_and_pyarrow_files_are_one_source(spark_files, tmp_path):
    paths, _ = spark_files
    d = str(tmp_path / "src")
    os.makedirs(d)
    for name, p in paths.items():
        shutil.copy(p, os.path.join(d, f"{name}.parquet"))
    for _, p, cols, _ in write_zoo(str(tmp_path / "zoo"), rows=500)[:4]:
        shutil.copy(p, os.path.join(d, os.path.basename(p)))
    s = open_stream(SourceSpec(name="spark", uri=d, columns=ALL_COLUMNS, kind="text"), seed=0, buffer_rows=200)
    r = s.take(s.index.num_rows)
    assert (key_epoch(r.keys) == 0).all()
    assert s.quarantine.counts()["units"] == 0, s.quarantine.messages()
    exp = {}
    for p in sorted(glob.glob(os.path.join(d, "*.parquet"))):
        ref = reference_columns(p, ALL_COLUMNS)
        for i, v in enumerate(ref["id"].to_pylist()):
            exp[v] = {c: ref[c][i].as_py() for c in ALL_COLUMNS}
    ids = r.columns["id"].to_pylist()
    assert sorted(ids) == sorted(exp)
    for c in ALL_COLUMNS:
        vals = r.columns[c].to_pylist()
        assert all(vals[i] == exp[v][c] for i, v in enumerate(ids)), c
    assert pq.ParquetFile(paths["spark-v1-snappy"]).metadata.created_by.lower().startswith("parquet-mr")
