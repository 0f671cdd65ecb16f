"""Multimodal collation: patches, placeholders, encoder batches and the backbone's fused layout."""

import numpy as np
import pytest

from mixplane.constructor.multimodal import (collate_encoder, encoder_offsets, fused_layout, gather_embeddings,
                                             mask_orphan_placeholders, patch_positions, rowmajor_to_windows)
from mixplane.loader.transforms import image_to_patches

IMG = 9999


def _png(a: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def test_loader_patches_in_merge_windows_match_patch_positions():
    """Loaders cut row-major patches; the constructor's window order and 2-D positions agree with them."""
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, size=(28, 56, 3), dtype=np.uint8)  # 2 x 4 patches of 14: no resize
    flat, hp, wp = image_to_patches(_png(img), 14, 896)
    pix = flat.reshape(hp * wp, -1)
    assert (hp, wp) == (2, 4)
    np.testing.assert_array_equal(pix[5].reshape(14, 14, 3), img[14:28, 14:28])  # row 1, col 1
    assert patch_positions((hp, wp))[5].tolist() == [1, 1]
    order = rowmajor_to_windows((hp, wp), 4)
    pos = patch_positions((hp, wp), merge=4)
    # merged token 0 covers patches (0,0) (0,1) (1,0) (1,1), token 1 the next 2x2 window
    assert pos[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    for k, (r, c) in enumerate(pos.tolist()):
        np.testing.assert_array_equal(pix[order][k].reshape(14, 14, 3), img[14 * r:14 * r + 14, 14 * c:14 * c + 14])
    with pytest.raises(ValueError, match="merged"):
        rowmajor_to_windows((3, 4), 4)


def test_encoder_batch_collates_with_varlen_boundaries():
    enc = collate_encoder([np.zeros((4, 12), np.uint8), np.ones((6, 12), np.uint8)], [(2, 2), (2, 3)], [0, 3])
    assert enc["pixel_patches"].shape == (10, 12) and enc["patch_cu_seqlens"].tolist() == [0, 4, 10]
    assert enc["image_grid"].tolist() == [[2, 2], [2, 3]] and enc["patch_position_ids"].shape == (10, 2)
    with pytest.raises(ValueError, match="grid"):
        collate_encoder([np.zeros((5, 12), np.uint8)], [(2, 2)], [0])


def test_fused_layout_maps_every_placeholder_to_its_embedding():
    # two images: image 0 (3 tokens) encoded on rank 1, image 1 (2 tokens) on rank 0
    img_rank, img_tokens = np.array([1, 0]), np.array([3, 2])
    base, per_rank = encoder_offsets(img_rank, img_tokens, world=2)
    assert per_rank.tolist() == [2, 3] and base.tolist() == [2, 0]
    S = 8
    ids = np.array([[IMG, IMG, IMG, 7, 8, IMG, IMG, 0],
                    [IMG, 5, 6, 0, 0, 0, 0, 0]])  # row 1: an orphan placeholder of an image encoded earlier
    out = fused_layout(ids, IMG, seg_row=np.array([0, 0, 1]), seg_offset=np.array([0, 5, 0]),
                       seg_len=np.array([5, 2, 3]), seg_image=np.array([0, 1, -1]), seg_ph_before=np.array([0, 0, 2]),
                       img_rank=img_rank, img_tokens=img_tokens, world=2)
    idx = out["image_token_index"]
    assert idx[0].tolist() == [2, 3, 4, -1, -1, 0, 1, -1]
    assert idx[1, 0] == -1 and out["encoder_tokens_per_rank"].tolist() == [2, 3]
    # the trainer's all-gather in rank order, then splice
    enc0 = np.array([[10.0], [11.0]])  # rank 0 encodes image 1
    enc1 = np.array([[20.0], [21.0], [22.0]])  # rank 1 encodes image 0
    emb = gather_embeddings([enc0, enc1], idx, np.zeros((2, S, 1)))
    assert emb[0, :3, 0].tolist() == [20.0, 21.0, 22.0] and emb[0, 5:7, 0].tolist() == [10.0, 11.0]
    batch = {"input_ids": ids.copy(), "labels": np.roll(ids, -1, axis=1), "image_token_index": idx}
    assert mask_orphan_placeholders(batch, IMG, pad_id=0) == 1
    assert batch["input_ids"][1, 0] == 0 and batch["labels"][1, 0] == -100


def test_fused_layout_rejects_too_many_placeholders():
    ids = np.array([[IMG, IMG, IMG, 0]])
    with pytest.raises(ValueError, match="exceed image 0"):
        fused_layout(ids, IMG, seg_row=np.array([0]), seg_offset=np.array([0]), seg_len=np.array([3]),
                     seg_image=np.array([0]), seg_ph_before=np.array([0]), img_rank=np.array([0]),
                     img_tokens=np.array([2]), world=1)
