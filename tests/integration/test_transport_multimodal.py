"""Image-text samples end to end: patches travel from the loader with the sample's first piece, the
constructor builds the encoder batch and the fused layout, and every placeholder points at its patch."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.client import MixtureLoader
from mixplane.constructor.multimodal import rowmajor_to_windows
from mixplane.layout import segment_offsets
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec

pytestmark = pytest.mark.timeout(180)
P = 14


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a small red square", "a blue picture of a cat", "the dog sat"] * 20,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|endoftext|>", "<|image|>"]))
    tok.save(str(path))
    return tok


def expected_patches(a: np.ndarray, merge: int = 1) -> np.ndarray:
    """An image's patches as the trainer's encoder sees them: cut row-major, reordered into merge
    windows, ``merge`` patches per merged token (one row per token)."""
    gh, gw = a.shape[0] // P, a.shape[1] // P
    patches = a.reshape(gh, P, gw, P, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1)
    return patches[rowmajor_to_windows((gh, gw), merge)].reshape(gh * gw // merge, -1)


def _images(n, rng, unit=P):
    from PIL import Image

    out, arrays = [], []
    for i in range(n):
        h, w = unit * int(rng.integers(1, 4)), unit * int(rng.integers(1, 3))
        a = rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, format="PNG")  # lossless: patches can be compared exactly
        out.append(buf.getvalue())
        arrays.append(a)
    return out, arrays


@pytest.mark.parametrize("merge", [1, 4])
def test_image_patches_and_fused_layout_end_to_end(tmp_path, merge):
    rng = np.random.default_rng(0)
    tok = _tokenizer(tmp_path / "tok.json")
    img_id = tok.token_to_id("<|image|>")
    n = 30
    images, arrays = _images(n, rng, unit=P * int(merge ** 0.5))  # no resize: pixels compare exactly
    captions = [" ".join(rng.choice(["a", "small", "red", "square", "cat", "dog"], size=int(rng.integers(1, 6))))
                for _ in range(n)]
    pq.write_table(pa.table({"image": images, "caption": captions}), tmp_path / "vlm.parquet", row_group_size=10)
    spec = parse_spec({
        "name": "vlm-test",
        "sources": [{"name": "vlm", "uri": str(tmp_path / "vlm.parquet"), "kind": "image_text",
                     "columns": ["image", "caption"], "tokenizer": str(tmp_path / "tok.json"),
                     "image": {"patch_size": P, "max_side": 448, "merge": merge}}],
        "batch": {"sequences": 2, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": 16, "metrics": False, "run_dir": str(tmp_path / "run")},
    })
    with EmbeddedRuntime(spec, tmp_path / "run", log_level="WARNING") as rt:
        loaders = [MixtureLoader(rt.planner_endpoint, rank=r, timeout_s=60, max_steps=4) for r in range(2)]
        seen_images = checked = 0
        for _ in range(4):
            batches = [{k: v.numpy() for k, v in next(l).items()} for l in loaders]
            # what the trainer all-gathers: every rank's encoder output in rank order (here: the patches)
            gathered = np.concatenate([x["pixel_patches"] for x in batches])
            merged = gathered.reshape(len(gathered) // merge, -1)  # merged token t = patches [t*merge, (t+1)*merge)
            for b in batches:
                ids, idx, pix = b["input_ids"], b["image_token_index"], b["pixel_patches"]
                assert b["encoder_tokens"].tolist() == [len(x["pixel_patches"]) // merge for x in batches]
                assert b["patch_cu_seqlens"][-1] == len(pix)
                # every remaining placeholder has an embedding; nothing else does
                assert np.array_equal(ids == img_id, idx >= 0)
                seen_images += len(b["image_ids"])
                # each placeholder points at the right patch of the right image (image first, then caption)
                rows, lens = b["segment_row"].astype(np.int64), b["segment_len"].astype(np.int64)
                offs = segment_offsets(rows, lens)
                for r, key, start, ln, o in zip(rows, b["segment_key"], b["segment_start"], lens, offs):
                    expect = expected_patches(arrays[int(key) & ((1 << 40) - 1)], merge)  # one row per merged token
                    seg_ids, seg_idx = ids[r, o:o + ln], idx[r, o:o + ln]
                    if start == 0:
                        k = min(len(expect), int(ln))
                        assert np.all(seg_ids[:k] == img_id) and not np.any(seg_ids[k:] == img_id)
                        np.testing.assert_array_equal(merged[seg_idx[:k]], expect[:k])
                        checked += k
                    else:  # a later piece: its image went with the first piece, placeholders are masked
                        assert not np.any(seg_ids == img_id)
        assert seen_images > 0 and checked > 0
        for l in loaders:
            l.close()
