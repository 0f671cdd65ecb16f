"""Images with tensor parallelism (vlm_balance broadcasts the backbone over TP): the encoder batch is
per rank and stays out of the TP rule. A TP rank > 0 whose backbone view is metadata-only still gets
its own images as tensors (encoder {dp: world}); when the backbone encodes (no encoder module), the
bucket's lowest rank gets the pixels and its TP peers the same shapes as empty buffers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.client import MixtureLoader
from mixplane.constructor.multimodal import ENCODER_FIELDS
from mixplane.layout import segment_offsets
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.integration.test_transport_multimodal import P, _images, _tokenizer, expected_patches

pytestmark = pytest.mark.timeout(240)
STEPS = 4
SCALARS = ("step", "lr_scale", "phase", "seq_len", "meta_only", "encoder_meta_only", "encoder_leader")


def _after_broadcasts(batches: list[dict], tp: int) -> list[dict]:
    """What broadcast_tp (backbone from tp 0) and broadcast_encoder (pixels from the leader) leave."""
    out = []
    for r, b in enumerate(batches):
        b = dict(b)
        if b["meta_only"]:
            src = batches[r - r % tp]
            b.update({k: v for k, v in src.items() if k not in ENCODER_FIELDS and k not in SCALARS})
        if b.get("encoder_meta_only"):
            b.update({k: batches[int(b["encoder_leader"])][k] for k in ENCODER_FIELDS})
        out.append(b)
    return out


@pytest.mark.parametrize("encoder", [True, False], ids=["encoder-dp-world", "backbone-encodes"])
def test_images_with_tp2_reach_their_encoder_and_skip_the_tp_broadcast(tmp_path, encoder):
    rng = np.random.default_rng(11)
    tok = _tokenizer(tmp_path / "tok.json")
    img_id = tok.token_to_id("<|image|>")
    n = 60
    images, arrays = _images(n, rng)
    captions = [" ".join(rng.choice(["a", "small", "red", "cat", "dog"], size=int(rng.integers(1, 8)))) for _ in range(n)]
    pq.write_table(pa.table({"image": images, "caption": captions}), tmp_path / "vlm.parquet", row_group_size=10)
    modules = {"backbone": {"dp": 2, "tp": 2}, **({"encoder": {"dp": 4}} if encoder else {})}
    spec = parse_spec({
        "name": "vlm-tp",
        "sources": [{"name": "vlm", "uri": str(tmp_path / "vlm.parquet"), "kind": "image_text",
                     "columns": ["image", "caption"], "tokenizer": str(tmp_path / "tok.json"),
                     "image": {"patch_size": P, "max_side": 448}}],
        "batch": {"sequences": 4, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": modules},
        "strategy": {"name": "vlm_balance"},  # broadcast: [TP] by default
        "runtime": {"window": 16, "metrics": False},
    })
    tp1_images = 0
    with EmbeddedRuntime(spec, tmp_path / "run", log_level="WARNING") as rt:
        loaders = [MixtureLoader(rt.planner_endpoint, rank=r, timeout_s=60, max_steps=STEPS) for r in range(4)]
        for _ in range(STEPS):
            got = [{k: v.numpy() for k, v in next(l).items()} for l in loaders]
            for r, b in enumerate(got):
                assert bool(b["meta_only"]) == (r % 2 == 1)  # backbone: tp 1 is metadata-only
                leader = r if encoder else r - r % 2
                assert int(b["encoder_leader"]) == leader
                assert bool(b["encoder_meta_only"]) == (leader != r)
                if leader != r:  # the leader's shapes, as empty buffers
                    assert {k: got[leader][k].shape for k in ENCODER_FIELDS} == {k: b[k].shape for k in ENCODER_FIELDS}
                elif r % 2:
                    tp1_images += len(b["image_ids"])
            full = _after_broadcasts(got, tp=2)
            enc_tokens = full[0]["encoder_tokens"]
            leaders = [r for r in range(4) if int(full[r]["encoder_leader"]) == r]
            for r in range(4):
                assert np.array_equal(full[r]["encoder_tokens"], enc_tokens)
                assert enc_tokens[r] == (len(full[r]["pixel_patches"]) if r in leaders else 0)
            gathered = np.concatenate([full[r]["pixel_patches"] for r in leaders])  # the all-gather, ranks in order
            for b in full:
                ids, idx = b["input_ids"], b["image_token_index"]
                assert np.array_equal(ids == img_id, idx >= 0)
                rows, lens = b["segment_row"].astype(np.int64), b["segment_len"].astype(np.int64)
                offs = segment_offsets(rows, lens)
                for row, key, start, ln, o in zip(rows, b["segment_key"], b["segment_start"], lens, offs):
                    if start != 0:
                        continue
                    expect = expected_patches(arrays[int(key) & ((1 << 40) - 1)])
                    k = min(len(expect), int(ln))
                    np.testing.assert_array_equal(gathered[idx[row, o:o + k]], expect[:k])
        for l in loaders:
            l.close()
    if encoder:
        assert tp1_images > 0, "tp 1 ranks must encode images of their own"
