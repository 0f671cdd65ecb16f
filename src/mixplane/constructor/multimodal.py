"""Multimodal collation (pure numpy): image patches for the encoder, placeholder tokens for the backbone.

A VLM sample is text tokens with image placeholders interleaved: each image becomes
``patches / merge`` consecutive ``image_token_id`` tokens in the backbone sequence (merge = 4 for 2x2
patch merging), and ``patches`` rows of ``patch_size² · channels`` pixels for the vision encoder.

Per module, a rank receives:

* **encoder** (its own parallelism; with ``axis='WORLD'`` every world rank encodes a share of the
  step's images, independent of its backbone CP / PP / TP coordinates):
  ``pixel_patches`` [N, p·p·C] uint8, ``patch_cu_seqlens`` [n+1] (varlen attention per image),
  ``image_grid`` [n, 2] (patch rows, cols), ``patch_position_ids`` [N, 2] (row, col of each patch, for
  2-D RoPE), ``image_ids`` [n] (the image's index in the step), ``image_quarantined`` [n] int8 (1: the image's
  header read but its pixels did not -- a truncated file --, so it is delivered as zeros of its planned grid and
  was quarantined where it was decoded; the same wherever that is). Images go to the lowest rank of an
  image-module DP x CP bucket; its TP / PP peers receive only the shapes (:func:`encoder_shapes`).
* **backbone** (the fused layout): ``image_token_index`` [rows, S] int32 — for each placeholder
  position, the index of its merged token in the step's encoder output gathered in image order
  (all-gather of every encoder rank's output, in rank order), -1 for text — plus
  ``encoder_tokens_per_rank`` so the trainer can size a variable all-gather, and ``image_token_mask``.

Placeholders whose image is not encoded in this step (a split document whose image went with an
earlier piece) get index -1 and ``image_token_mask`` False; :func:`mask_orphan_placeholders` turns
them into padding-like tokens with ignored labels so nothing reads an embedding that is not there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from mixplane.layout import segment_offsets
from mixplane.imagedecode import blank_patches, decode_or_blank, rowmajor_to_windows
from mixplane.protocol import ENCODER_FIELDS  # noqa: F401 - the STEP_DATA schema owns the field list

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------ images
# Loaders decode, resize and cut images (`imagedecode.image_to_patches`, row-major patches) unless the
# source's image.decode_at says constructor or client: then its images arrive as raw encoded bytes
# (EncodedImage), decoded here by the same function, or passed on raw for the client to decode.


@dataclass(frozen=True)
class EncodedImage:
    """An image as its loader shipped it when it was not decoded there: raw encoded bytes, the settings
    to decode them with, where it was read (for a bad image's error), and whether the client decodes it."""

    data: np.ndarray  # uint8, the encoded file as read
    patch: int
    max_side: int
    where: str  # "source 'x', column 'image': sample key K (file F, row R)"
    at_client: bool


@dataclass(frozen=True)
class QuarantinedImage:
    """An image whose header read (the step is planned with its grid) but whose pixels did not: delivered as
    zeros of the grid (`imagedecode.blank_patches`) with ``image_quarantined`` set; `error` names it."""

    patch: int
    error: str

def patch_positions(grid: tuple[int, int], merge: int = 1) -> np.ndarray:
    """(row, col) of every patch in merge-window order (`rowmajor_to_windows`): [gh*gw, 2] int32."""
    gh, gw = grid
    m = int(round(merge ** 0.5))
    r, c = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    pos = np.stack([r, c], axis=-1).reshape(gh // m, m, gw // m, m, 2).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(pos.reshape(gh * gw, 2)).astype(np.int32)


# ------------------------------------------------------------------------------------------ encoder side
def collate_encoder(patches: list[np.ndarray], grids: list[tuple[int, int]], image_ids: list[int] | np.ndarray,
                    merge: int = 1, quarantined: list[int] | np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The encoder batch of one rank: its images' patches concatenated, with varlen boundaries (`quarantined`:
    1 for an image delivered blank, see QuarantinedImage)."""
    if not (len(patches) == len(grids) == len(image_ids)) or (quarantined is not None and len(quarantined) != len(grids)):
        raise ValueError("patches, grids, image_ids and quarantined differ in length")
    n = [len(p) for p in patches]
    for i, (p, g) in enumerate(zip(patches, grids)):
        if len(p) != g[0] * g[1]:
            raise ValueError(f"image {i}: {len(p)} patches but grid {g}")
    dim = patches[0].shape[1] if patches else 0
    cu = np.zeros(len(n) + 1, np.int32)
    np.cumsum(n, out=cu[1:])
    return {
        "pixel_patches": np.concatenate(patches).astype(np.uint8, copy=False) if patches else np.zeros((0, dim), np.uint8),
        "patch_cu_seqlens": cu,
        "image_grid": np.asarray(grids, np.int32).reshape(-1, 2),
        "patch_position_ids": (np.concatenate([patch_positions(g, merge) for g in grids]) if grids
                               else np.zeros((0, 2), np.int32)),
        "image_ids": np.asarray(image_ids, np.int64),
        "image_quarantined": (np.asarray(quarantined, np.int8) if quarantined is not None
                              else np.zeros(len(grids), np.int8)),
    }


# ------------------------------------------------------------------------------------------ backbone side
def encoder_offsets(img_rank: np.ndarray, img_tokens: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each image's merged tokens sit in the gathered encoder output (ranks in order, images in
    step order within a rank), and the merged-token count of every encoder rank."""
    img_rank = np.asarray(img_rank, np.int64)
    img_tokens = np.asarray(img_tokens, np.int64)
    per_rank = np.bincount(img_rank, weights=img_tokens, minlength=world).astype(np.int64)
    rank_base = np.concatenate([[0], np.cumsum(per_rank)[:-1]])
    order = np.lexsort((np.arange(len(img_rank)), img_rank))
    within = np.zeros(len(img_rank), np.int64)
    run = np.zeros(world, np.int64)
    for i in order:
        within[i] = run[img_rank[i]]
        run[img_rank[i]] += img_tokens[i]
    return rank_base[img_rank] + within if len(img_rank) else within, per_rank


def fused_layout(input_ids: np.ndarray, image_token_id: int, *, seg_row: np.ndarray, seg_offset: np.ndarray,
                 seg_len: np.ndarray, seg_image: np.ndarray, seg_ph_before: np.ndarray,
                 img_rank: np.ndarray, img_tokens: np.ndarray, world: int, img_base: np.ndarray | None = None,
                 encoder_tokens: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The backbone's view of the images in one rank's rows.

    Segments (pieces of samples) are given by row, offset in row and length; ``seg_image`` is the
    step-level index of the image the segment's placeholders belong to (-1: none or not encoded this
    step) and ``seg_ph_before`` how many of that image's placeholders precede the segment (non-zero
    for later pieces of a split sample).
    """
    rows, S = input_ids.shape
    index = np.full((rows, S), -1, np.int32)
    if img_base is not None and encoder_tokens is not None:  # the planner's, for a partial image list
        base, per_rank = np.asarray(img_base, np.int64), np.asarray(encoder_tokens, np.int64)
    else:
        base, per_rank = encoder_offsets(img_rank, img_tokens, world)
    flat_ids = input_ids.reshape(-1)
    flat_idx = index.reshape(-1)
    for i in range(len(seg_row)):
        lo = int(seg_row[i]) * S + int(seg_offset[i])
        hi = lo + int(seg_len[i])
        ph = np.flatnonzero(flat_ids[lo:hi] == image_token_id)
        if not len(ph):
            continue
        im = int(seg_image[i])
        if im < 0:
            continue  # orphan placeholders: their image is not encoded in this step
        k = int(seg_ph_before[i]) + np.arange(len(ph))
        if k[-1] >= img_tokens[im]:
            raise ValueError(f"segment {i}: {len(ph)} placeholders after {int(seg_ph_before[i])} exceed image {im}'s "
                             f"{int(img_tokens[im])} tokens")
        flat_idx[lo + ph] = (base[im] + k).astype(np.int32)
    return {"image_token_index": index, "image_token_mask": index >= 0,
            "encoder_tokens_per_rank": per_rank.astype(np.int64)}


def mask_orphan_placeholders(batch: dict[str, np.ndarray], image_token_id: int, pad_id: int) -> int:
    """Placeholders without an embedding become pad tokens with ignored labels; returns how many."""
    ids = batch["input_ids"]
    orphan = (ids == image_token_id) & (batch["image_token_index"] < 0)
    n = int(orphan.sum())
    if n:
        ids[orphan] = pad_id
        if "labels" in batch:
            batch["labels"][orphan] = IGNORE_INDEX
            # the token before an orphan must not learn to predict a placeholder either
            prev = np.zeros_like(orphan)
            prev[:, :-1] = orphan[:, 1:]
            batch["labels"][prev & (batch["labels"] == image_token_id)] = IGNORE_INDEX
    return n


def gather_embeddings(encoder_outputs: list[np.ndarray], image_token_index: np.ndarray, text_embeddings: np.ndarray) -> np.ndarray:
    """Reference of what the trainer does (in torch, after an all-gather): splice image embeddings in."""
    gathered = np.concatenate(encoder_outputs) if encoder_outputs else np.zeros((0, text_embeddings.shape[-1]))
    out = text_embeddings.copy()
    m = image_token_index >= 0
    out[m] = gathered[image_token_index[m]]
    return out


# ------------------------------------------------------------------------------------------ constructor glue
def fuse_batch(batch: dict[str, np.ndarray], *, img_source: np.ndarray, img_key: np.ndarray, img_rank: np.ndarray,
               img_patches: np.ndarray, world: int, image_token_id: int, merge: int, pad_id: int,
               img_base: np.ndarray | None = None, encoder_tokens: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Add the backbone's fused layout to one data-parallel rank's batch (in place).

    ``img_*`` list every image of the step with the global rank that encodes it; the encoder outputs
    are all-gathered in rank order, so ``image_token_index`` indexes that gathered tensor (in merged
    tokens) and ``encoder_tokens`` [world] sizes the gather. ``img_base`` / ``encoder_tokens`` given (the
    planner's, protocol.IMG_BASE): ``img_*`` list only this constructor's images, placed by ``img_base``. Placeholders sit at the start of an
    image sample (image first, then caption); those of a later piece of a split sample have no image
    in this step and become padding with ignored labels (counted in ``orphan_placeholders``).
    """
    rows = batch["segment_row"].astype(np.int64)
    lens = batch["segment_len"].astype(np.int64)
    starts = batch["segment_start"].astype(np.int64)
    where = {(int(s), int(k)): j for j, (s, k) in enumerate(zip(img_source, img_key))}
    seg_image = np.array([where.get((int(s), int(k)), -1) if st == 0 else -1
                          for s, k, st in zip(batch["segment_source"], batch["segment_key"], starts)], np.int64)
    fused = fused_layout(batch["input_ids"], image_token_id, seg_row=rows, seg_offset=segment_offsets(rows, lens),
                         seg_len=lens, seg_image=seg_image, seg_ph_before=np.zeros(len(rows), np.int64),
                         img_rank=np.asarray(img_rank, np.int64),
                         img_tokens=np.asarray(img_patches, np.int64) // merge, world=world,
                         img_base=img_base, encoder_tokens=encoder_tokens)
    batch["image_token_index"] = fused["image_token_index"]
    batch["image_token_mask"] = fused["image_token_mask"]
    batch["encoder_tokens"] = fused["encoder_tokens_per_rank"]
    batch["orphan_placeholders"] = np.array([mask_orphan_placeholders(batch, image_token_id, pad_id)], np.int64)
    return batch


def encoder_batch(rank: int, *, img_source: np.ndarray, img_key: np.ndarray, img_rank: np.ndarray,
                  img_patches: np.ndarray, images: dict[tuple[int, int], tuple[Any, tuple[int, int]]],
                  merge: int, patch_dim: int, on_quarantine: Any = None) -> dict[str, Any]:
    """The vision-encoder batch of one global rank: the step's images whose ``img_rank`` is `rank`.

    ``images`` maps (source, key) to (row-major patches [n, D], grid) as loaders cut them, or to
    (EncodedImage, grid) when the loader shipped raw bytes; patches are reordered so the ``merge``
    patches of one merged token are consecutive. An EncodedImage is decoded here (ImageDecodeError
    names it), unless every image of the rank is for the client to decode: then ``pixel_patches`` is
    replaced by ``image_bytes`` / ``image_bytes_offsets`` / ``image_max_side`` and ``image_decode``
    (patch size, merge, each image's name), from which the client makes the same ``pixel_patches``
    (imagedecode.decode_encoder_images). A decoded image replaces its EncodedImage in ``images``; one whose pixels
    do not decode is replaced by a QuarantinedImage (`on_quarantine(error)` is called once for it) and delivered
    as zeros of its grid with ``image_quarantined`` 1. Raises KeyError when an image's patches are not here.
    """
    mine = np.flatnonzero(np.asarray(img_rank) == rank)
    found = []
    for i in mine:
        k = (int(img_source[i]), int(img_key[i]))
        if k not in images:
            raise KeyError(f"patches of source {k[0]} sample {k[1]} (encoded by rank {rank}) are not at this constructor")
        found.append(images[k])
    if found and all(isinstance(pix, EncodedImage) and pix.at_client for pix, _ in found):
        return _client_encoder_batch(found, mine, img_patches, merge)
    patches, grids, bad = [], [], []
    for i, (pix, grid) in zip(mine, found):
        if isinstance(pix, EncodedImage):  # decode_at constructor (or client, in a rank that mixes places)
            decoded, err = decode_or_blank(pix.data, grid, patch=pix.patch, max_side=pix.max_side, merge=merge,
                                           where=pix.where)
            # decoded once, even if the reply is retried; a bad one is reported once
            pix = QuarantinedImage(pix.patch, err) if err is not None else decoded
            images[(int(img_source[i]), int(img_key[i]))] = (pix, grid)
            if err is not None and on_quarantine is not None:
                on_quarantine(err)
        bad.append(1 if isinstance(pix, QuarantinedImage) else 0)
        if isinstance(pix, QuarantinedImage):
            pix = blank_patches(grid, pix.patch)
        if len(pix) != int(img_patches[i]) or grid[0] * grid[1] != len(pix):
            raise ValueError(f"source {int(img_source[i])} sample {int(img_key[i])}: {len(pix)} patches, grid {grid}, "
                             f"planned {int(img_patches[i])}")
        patches.append(pix[rowmajor_to_windows(grid, merge)] if merge > 1 else pix)
        grids.append(grid)
    if patches:
        return collate_encoder(patches, grids, mine, merge, bad)
    return {"pixel_patches": np.zeros((0, patch_dim), np.uint8), "patch_cu_seqlens": np.zeros(1, np.int32),
            "image_grid": np.zeros((0, 2), np.int32), "patch_position_ids": np.zeros((0, 2), np.int32),
            "image_ids": np.zeros(0, np.int64), "image_quarantined": np.zeros(0, np.int8)}


def _client_encoder_batch(found: list[tuple[EncodedImage, tuple[int, int]]], mine: np.ndarray, img_patches: np.ndarray,
                          merge: int) -> dict[str, Any]:
    grids = [g for _, g in found]
    for (enc, g), i in zip(found, mine):
        if g[0] * g[1] != int(img_patches[i]):
            raise ValueError(f"{enc.where}: grid {g}, planned {int(img_patches[i])} patches")
    out: dict[str, Any] = collate_encoder([np.zeros((g[0] * g[1], 0), np.uint8) for g in grids], grids, mine, merge)
    del out["pixel_patches"]
    off = np.zeros(len(found) + 1, np.int64)
    np.cumsum([len(e.data) for e, _ in found], out=off[1:])
    out["image_bytes"] = np.concatenate([e.data for e, _ in found])
    out["image_bytes_offsets"] = off
    out["image_max_side"] = np.array([e.max_side for e, _ in found], np.int32)
    out["image_decode"] = {"patch_size": found[0][0].patch, "merge": merge, "where": [e.where for e, _ in found]}
    return out


def encoder_shapes(rank: int, *, img_rank: np.ndarray, img_patches: np.ndarray, patch_dim: int) -> dict[str, list]:
    """[dtype, shape] of every field of :func:`encoder_batch` for `rank`, from the layout alone (no
    pixels needed): what a peer of the encoding rank allocates to receive its copy by broadcast."""
    mine = np.asarray(img_rank) == rank
    n, N = int(mine.sum()), int(np.asarray(img_patches, np.int64)[mine].sum())
    return {"pixel_patches": ["|u1", [N, patch_dim]], "patch_cu_seqlens": ["<i4", [n + 1]], "image_grid": ["<i4", [n, 2]],
            "patch_position_ids": ["<i4", [N, 2]], "image_ids": ["<i8", [n]], "image_quarantined": ["|i1", [n]]}
