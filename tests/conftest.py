"""Shared fixtures: small real Parquet sources written with pyarrow (no network, seconds to build), and helpers the
integration tests share."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def write_token_source(directory: Path, *, rows: int, files: int, mean_len: float, seed: int,
                       rows_per_group: int = 200, vocab: int = 1000, page_checksum: bool = False) -> list[np.ndarray]:
    """A `tokens` source: list<int32> documents with lognormal lengths; returns the documents in source order."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    lens = np.maximum(1, rng.lognormal(np.log(mean_len), 0.9, rows).astype(np.int64))
    docs = [rng.integers(3, vocab, n, dtype=np.int32) for n in lens]
    per = -(-rows // files)
    for f in range(files):
        part = docs[f * per : (f + 1) * per]
        table = pa.table({"tokens": pa.array(part, type=pa.list_(pa.int32())),
                          "id": pa.array(np.arange(f * per, f * per + len(part)), pa.int64())})
        pq.write_table(table, directory / f"part-{f:03d}.parquet", row_group_size=rows_per_group, write_page_index=True,
                       write_page_checksum=page_checksum)
    return docs


@pytest.fixture(scope="session")
def token_sources(tmp_path_factory) -> dict[str, object]:
    """Three token sources with different length distributions (a, b, c)."""
    root = tmp_path_factory.mktemp("sources")
    docs = {
        "a": write_token_source(root / "a", rows=3000, files=3, mean_len=60, seed=1),
        "b": write_token_source(root / "b", rows=2000, files=2, mean_len=150, seed=2),
        "c": write_token_source(root / "c", rows=1500, files=2, mean_len=400, seed=3),
    }
    return {"root": root, "docs": docs}


def token_mixture(root: Path, **overrides) -> dict:
    """A valid mixture document over the `token_sources` fixture; overrides are merged per section."""
    doc = {
        "name": "test",
        "sources": [{"name": n, "uri": str(root / n), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"}
                    for n in ("a", "b", "c")],
        "mixture": {"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 7},
        "batch": {"sequences": 8, "seq_len": 256, "microbatches": 2},
        "topology": {"modules": {"backbone": {"dp": 2}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": 64, "metrics": False},
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(doc.get(k), dict):
            doc[k] = {**doc[k], **v}
        else:
            doc[k] = v
    return doc


def fetch_batches(rt, ranks, steps: int) -> dict[int, list[dict[str, np.ndarray]]]:
    """Rank -> the `steps` batches a trainer of each rank in `ranks` gets from the runtime `rt` (its tensor fields as
    numpy copies), one MixtureLoader after another."""
    from mixplane.client import MixtureLoader  # (torch: imported only by the tests that fetch)

    out = {}
    for r in ranks:
        loader = MixtureLoader(rt.planner_endpoint, rank=r, max_steps=steps, timeout_s=90)
        out[r] = [{k: v.numpy().copy() for k, v in b.items() if hasattr(v, "numpy")} for b in loader]
        loader.close()
    return out


@pytest.fixture(scope="session", autouse=True)
def _index_cache(tmp_path_factory):
    """The loaders' page indexes and kept listings (MIXPLANE_INDEX_CACHE) in this run's own directory unless it is
    set: a kept listing is found by its source's uri and endpoint, and a test server's endpoint (a free port) may be
    an earlier run's, whose objects were others (loader/listing.py)."""
    if "MIXPLANE_INDEX_CACHE" in os.environ:
        yield
        return
    os.environ["MIXPLANE_INDEX_CACHE"] = str(tmp_path_factory.mktemp("index-cache"))
    try:
        yield
    finally:
        os.environ.pop("MIXPLANE_INDEX_CACHE", None)


def pytest_runtest_logstart(nodeid, location):
    """The test that runs now, kept where scripts/run-tests.sh reads it if pytest itself dies (MIXPLANE_TEST_LAST)."""
    if path := os.environ.get("MIXPLANE_TEST_LAST"):
        Path(path).write_text(nodeid + "\n")
