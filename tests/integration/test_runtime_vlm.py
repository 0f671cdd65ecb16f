"""VLM hybrid balance across several constructors: an image may be encoded by a rank whose
constructor gets no text span of that sample; its pixels must still arrive there."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.client import MixtureLoader
from mixplane.layout import segment_offsets
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.integration.test_transport_multimodal import P, _images, _tokenizer, expected_patches

pytestmark = pytest.mark.timeout(240)


def test_images_reach_the_rank_that_encodes_them(tmp_path):
    rng = np.random.default_rng(3)
    tok = _tokenizer(tmp_path / "tok.json")
    img_id = tok.token_to_id("<|image|>")
    n = 60
    images, arrays = _images(n, rng)
    captions = [" ".join(rng.choice(["a", "small", "red", "cat", "dog"], size=int(rng.integers(1, 8)))) for _ in range(n)]
    pq.write_table(pa.table({"image": images, "caption": captions}), tmp_path / "vlm.parquet", row_group_size=10)
    spec = parse_spec({
        "name": "vlm-cross",
        "sources": [{"name": "vlm", "uri": str(tmp_path / "vlm.parquet"), "kind": "image_text",
                     "columns": ["image", "caption"], "tokenizer": str(tmp_path / "tok.json"),
                     "image": {"patch_size": P, "max_side": 448}}],
        "batch": {"sequences": 4, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 4}, "encoder": {"dp": 4}}},
        "strategy": {"name": "vlm_balance"},
        "runtime": {"window": 16, "metrics": False},
    })
    cross = 0
    with EmbeddedRuntime(spec, tmp_path / "run", log_level="WARNING") as rt:
        assert len([c for c in rt.children if c.name.startswith("constructor")]) == 4
        loaders = [MixtureLoader(rt.planner_endpoint, rank=r, timeout_s=60, max_steps=6) for r in range(4)]
        for _ in range(6):
            batches = [{k: v.numpy() for k, v in next(l).items()} for l in loaders]
            gathered = np.concatenate([x["pixel_patches"] for x in batches])
            for rank, b in enumerate(batches):
                ids, idx = b["input_ids"], b["image_token_index"]
                assert np.array_equal(ids == img_id, idx >= 0)
                rows, lens = b["segment_row"].astype(np.int64), b["segment_len"].astype(np.int64)
                offs = segment_offsets(rows, lens)
                for r, key, start, ln, o in zip(rows, b["segment_key"], b["segment_start"], lens, offs):
                    if start != 0:
                        continue
                    expect = expected_patches(arrays[int(key) & ((1 << 40) - 1)])
                    k = min(len(expect), int(ln))
                    seg_idx = idx[r, o : o + k]
                    np.testing.assert_array_equal(gathered[seg_idx], expect[:k])
                    owner = int(np.searchsorted(np.cumsum([len(x["pixel_patches"]) for x in batches]), seg_idx[0], side="right"))
                    cross += owner != rank
        for l in loaders:
            l.close()
    assert cross > 0, "the test must exercise images encoded away from their text's rank"
