"""Multimodal collation: patches, placeholders, encoder batches and the backbone's fused layout."""

import numpy as np
import pytest

from mixplane.constructor.multimodal import (assign_world, collate_encoder, encoder_offsets, fused_layout,
                                             gather_embeddings, image_to_patches, interleave,
                                             mask_orphan_placeholders, patch_positions, target_grid)

IMG = 9999


def test_target_grid_respects_max_side_and_merge():
    assert target_grid(896, 896, 14, 896) == (64, 64)
    gh, gw = target_grid(1000, 500, 14, 448, merge=4)
    assert gh % 2 == 0 and gw % 2 == 0 and gh * 14 <= 448 and gw * 14 <= 448
    assert target_grid(10, 10, 14, 896, merge=4) == (2, 2)  # tiny images still give one merged token
    with pytest.raises(ValueError, match="square"):
        target_grid(10, 10, 14, 896, merge=2)


def test_patches_round_trip_without_resize():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, size=(28, 42, 3), dtype=np.uint8)
    p, grid = image_to_patches(img, patch_size=14, max_side=896)
    assert grid == (2, 3) and p.shape == (6, 14 * 14 * 3)
    np.testing.assert_array_equal(p[4].reshape(14, 14, 3), img[14:28, 14:28])  # row 1, col 1
    pos = patch_positions(grid)
    assert pos[4].tolist() == [1, 1]


def test_merge_windows_are_consecutive():
    img = np.arange(28 * 28, dtype=np.uint8).reshape(28, 28, 1)
    p, grid = image_to_patches(img, patch_size=7, max_side=28, merge=4)
    assert grid == (4, 4)
    pos = patch_positions(grid, merge=4)
    # the first merged token covers patches (0,0) (0,1) (1,0) (1,1)
    assert pos[:4].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    np.testing.assert_array_equal(p[2].reshape(7, 7), img[7:14, 0:7, 0])


def test_resize_large_image():
    img = np.zeros((1000, 2000, 3), np.uint8)
    p, (gh, gw) = image_to_patches(img, patch_size=14, max_side=448)
    assert gw * 14 <= 448 and len(p) == gh * gw


def test_interleave_and_encoder_batch():
    s = interleave([4, np.array([1, 2, 3]), 2, np.array([5])], IMG)
    assert s.tokens.tolist() == [IMG] * 4 + [1, 2, 3] + [IMG] * 2 + [5]
    assert s.image_start.tolist() == [0, 7] and s.image_tokens.tolist() == [4, 2]
    with pytest.raises(ValueError, match="placeholder id"):
        interleave([np.array([IMG])], IMG)
    enc = collate_encoder([np.zeros((4, 12), np.uint8), np.ones((6, 12), np.uint8)], [(2, 2), (2, 3)], [0, 3])
    assert enc["pixel_patches"].shape == (10, 12) and enc["patch_cu_seqlens"].tolist() == [0, 4, 10]
    assert enc["image_grid"].tolist() == [[2, 2], [2, 3]] and enc["patch_position_ids"].shape == (10, 2)


def test_assign_world_balances_images():
    r = assign_world(np.array([100, 90, 10, 10, 5]), 2)
    load = np.bincount(r, weights=[100, 90, 10, 10, 5], minlength=2)
    assert abs(load[0] - load[1]) <= 15


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
