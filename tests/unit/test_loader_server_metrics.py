"""A loader's Prometheus counters follow what its stream and transform quarantined."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader.server import LoaderServer
from mixplane.loader.stream import open_stream
from mixplane.loader.window import CHUNK
from mixplane.samples import key_row
from mixplane.spec import parse_spec
from tests.integration.test_transport_multimodal import P, _images, _tokenizer


def _counter(m, name: str, source: str) -> float:
    return m.registry.get_sample_value(name, {"source": source}) or 0.0


def test_undecodable_images_are_counted_in_the_loader_metrics(tmp_path):
    rng = np.random.default_rng(5)
    _tokenizer(tmp_path / "tok.json")
    n = 100
    images, _ = _images(n, rng)
    bad = set(range(0, n, 7))
    images = [b"\x89PNG broken" if i in bad else im for i, im in enumerate(images)]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "caption": ["a cat"] * n}),
                   tmp_path / "vl.parquet", row_group_size=10)
    spec = parse_spec({
        "name": "bad-images",
        "sources": [{"name": "vl", "uri": str(tmp_path / "vl.parquet"), "kind": "image_text",
                     "columns": ["image", "caption"], "tokenizer": str(tmp_path / "tok.json"),
                     "image": {"patch_size": P, "max_side": 448}}],
        "batch": {"sequences": 2, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}},
        "runtime": {"window": 8, "metrics": False},
    })
    server = LoaderServer(spec, 0, 0, "tcp://127.0.0.1:9")  # never connected: the test drives _fill by hand
    try:
        server.welcomed = True
        server.window.seek({"low": 0})
        assert server._fill()
        # what the loader read: the first CHUNK rows of the same deterministic stream
        check = open_stream(spec.sources[0], seed=spec.mixture.seed)
        read_rows = {int(r) for r in key_row(check.take(CHUNK).keys)}
        check.close()
        rows = {int(key_row(b.key)) for b in server.window.buffer.values()}
        assert rows and rows <= read_rows - bad  # no bad sample announced
        expected = len(read_rows & bad)
        assert expected > 0
        assert _counter(server.m, "mixplane_loader_quarantined_samples_total", "vl") == expected
        server.window.seek({"low": 0})  # re-reading the same rows does not count them twice
        server._fill()
        assert _counter(server.m, "mixplane_loader_quarantined_samples_total", "vl") == expected
    finally:
        server.close()
