"""Routing and layout as they were in numpy before routeloop compiled them (kept verbatim as the
reference tests/unit/test_routeloop.py compares the compiled versions with, bit for bit)."""

from __future__ import annotations

import numpy as np

from mixplane.layout import StepLayout
from mixplane.planner.routing import Fanout, Instructions


def old_loader_instructions(layout: StepLayout, piece_source: np.ndarray, piece_key: np.ndarray, piece_start: np.ndarray,
                        piece_replica: np.ndarray, piece_pos: np.ndarray, retired: np.ndarray,
                        dp_fanout: Fanout, rank_fanout: Fanout,
                        piece_of_seg: np.ndarray | None = None,
                        seg_of_img: np.ndarray | None = None) -> dict[tuple[int, int], Instructions]:
    """Per (source, replica): what to send to which constructor.

    `retired[i]` says piece i's sample leaves its window with this step. Pieces and layout segments
    are the same spans (the planner checks coverage), matched here by (source, key, start) unless
    `piece_of_seg` (the coverage check's match: the piece of every segment) is given; an image's first
    span likewise unless `seg_of_img` (image_segments) is given.
    """
    n = len(layout.seg_row)
    if len(piece_source) != n:
        raise ValueError(f"step {layout.step}: {len(piece_source)} pieces for {n} segments")
    # align pieces with segments
    if piece_of_seg is not None and len(piece_of_seg) == n:
        replica = np.asarray(piece_replica, np.int64)[piece_of_seg]
        pos = np.asarray(piece_pos, np.int64)[piece_of_seg]
        ret = np.asarray(retired, np.uint8)[piece_of_seg]
    else:
        lo = np.lexsort((layout.seg_start, layout.seg_key, layout.seg_source))
        po = np.lexsort((piece_start, piece_key, piece_source))
        replica = np.empty(n, np.int64)
        pos = np.empty(n, np.int64)
        ret = np.empty(n, np.uint8)
        replica[lo] = piece_replica[po]
        pos[lo] = piece_pos[po]
        ret[lo] = np.asarray(retired, np.uint8)[po]
    src = layout.seg_source.astype(np.int64)
    # token spans: one instruction per (segment, constructor of its dp rank)
    seg, dest = dp_fanout.expand(layout.seg_row.astype(np.int64) // layout.rows_per_rank)
    last = np.ones(len(seg), bool)
    last[:-1] = seg[1:] != seg[:-1]  # the last copy of a segment carries its retire flag
    cols = {"src": src[seg], "rep": replica[seg], "pos": pos[seg], "start": layout.seg_start[seg].astype(np.int64),
            "len": layout.seg_len[seg].astype(np.int64), "dest": dest, "retire": np.where(last, ret[seg], 0).astype(np.uint8),
            "img": np.zeros(len(seg), np.uint8)}
    # images: mark the first span's instruction for the encoder's constructor, or add an image-only one
    if len(layout.img_key) and seg_of_img is not None and len(seg_of_img) == len(layout.img_key):
        fseg = np.asarray(seg_of_img, np.int64)
    elif len(layout.img_key):
        first = layout.seg_start == 0
        fk = np.stack([src[first], layout.seg_key[first].astype(np.int64)])
        f_order = np.lexsort(fk[::-1])
        fk_sorted = fk[:, f_order]
        ik = np.stack([layout.img_source.astype(np.int64), layout.img_key.astype(np.int64)])
        # position of each image's first span among the start-0 segments
        key_f = fk_sorted[0] * (1 << 48) + fk_sorted[1]
        key_i = ik[0] * (1 << 48) + ik[1]
        at = np.searchsorted(key_f, key_i)
        if np.any(at >= len(key_f)) or np.any(key_f[np.minimum(at, len(key_f) - 1)] != key_i):
            raise ValueError(f"step {layout.step}: an image has no first span in the layout")
        fseg = np.flatnonzero(first)[f_order][at]
    if len(layout.img_key):
        img_of, img_dest = rank_fanout.expand(layout.img_rank.astype(np.int64))
        img_seg = fseg[img_of]
        # existing (segment, dest) instructions that can carry the pixels
        code_exist = seg * (1 << 20) + dest
        code_img = img_seg * (1 << 20) + img_dest
        if len(code_exist) and bool(np.all(code_exist[1:] > code_exist[:-1])):
            # segments in order, each one's constructors ascending: a bisect per image, not a set
            at = np.minimum(np.searchsorted(code_exist, code_img), len(code_exist) - 1)
            found = code_exist[at] == code_img
            cols["img"][at[found]] = 1
            extra = ~found
        else:
            hit = np.isin(code_exist, code_img)
            cols["img"][hit] = 1
            extra = ~np.isin(code_img, code_exist)
        if extra.any():
            e = img_seg[extra]
            add = {"src": src[e], "rep": replica[e], "pos": pos[e], "start": np.zeros(len(e), np.int64),
                   "len": np.zeros(len(e), np.int64), "dest": img_dest[extra], "retire": np.zeros(len(e), np.uint8),
                   "img": np.ones(len(e), np.uint8)}
            cols = {k: np.concatenate([cols[k], add[k]]) for k in cols}
    # split by loader replica
    key = cols["src"] * (1 << 20) + cols["rep"]
    order = _stable_order(key)
    cols = {k: v[order] for k, v in cols.items()}
    key = key[order]
    out: dict[tuple[int, int], Instructions] = {}
    if len(order) == 0:
        return out
    bounds = np.flatnonzero(np.diff(key)) + 1
    for lo_i, hi_i in zip(np.concatenate([[0], bounds]), np.concatenate([bounds, [len(key)]])):
        sl = slice(int(lo_i), int(hi_i))
        out[(int(cols["src"][lo_i]), int(cols["rep"][lo_i]))] = Instructions(
            cols["pos"][sl], cols["start"][sl], cols["len"][sl], cols["dest"][sl].astype(np.int32),
            cols["retire"][sl], cols["img"][sl])
    return out


def _stable_order(key: np.ndarray) -> np.ndarray:
    """np.argsort(key, kind="stable"), as a radix sort when the keys fit 16 bits (ranks, constructors)."""
    key = np.asarray(key)
    if len(key) and 0 <= int(key.min()) and int(key.max()) < 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    return np.argsort(key, kind="stable")


def _old_stable_order(key: np.ndarray) -> np.ndarray:
    """np.argsort(key, kind="stable"), as a radix sort when the keys fit 16 bits (ranks, constructors)."""
    key = np.asarray(key)
    if len(key) and 0 <= int(key.min()) and int(key.max()) < 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    return np.argsort(key, kind="stable")


def old_constructor_images(layout: StepLayout, seg_of_img: np.ndarray, dp_fanout: Fanout, leader_fanout: Fanout,
                       n_constructors: int) -> list[np.ndarray]:
    """The images each constructor needs (ascending indices into the step's image list): those whose text
    starts in its rows (its DP ranks: `dp_fanout`, from the image's first segment `seg_of_img`) and those
    encoded by an encoder leader of one of its ranks (`leader_fanout`: leader rank -> constructors), in
    one vectorised pass -- what a constructor is told about images grows with its share of them, not with
    the step's."""
    n = len(layout.img_key)
    if n == 0:
        return [np.zeros(0, np.int64) for _ in range(n_constructors)]
    img_dp = layout.seg_row[seg_of_img].astype(np.int64) // layout.rows_per_rank
    cuts = np.arange(n_constructors + 1, dtype=np.int64)
    parts = []
    for img_idx, cons in (dp_fanout.expand(img_dp), leader_fanout.expand(layout.img_rank.astype(np.int64))):
        o = _old_stable_order(cons)  # per constructor, images stay ascending (expand lists them in order)
        parts.append((img_idx[o], np.searchsorted(cons[o], cuts)))
    (a, ab), (b, bb) = parts
    return [np.union1d(a[ab[c]:ab[c + 1]], b[bb[c]:bb[c + 1]]) for c in range(n_constructors)]


def constructor_layouts(layout: StepLayout, dp_ranks: list[list[int]],
                        image_idx: list[np.ndarray] | None = None) -> list[StepLayout]:
    """`layout.select_ranks(ranks)` for every constructor's DP ranks, in one pass: segments are listed by
    row, hence by DP rank, so a rank's segments are one slice (a constructor of consecutive ranks gets
    views, not copies). Per constructor this costs its own segments, not the whole step's.
    `image_idx` (constructor_images): each constructor's images; default: every image of the step."""
    rpr = layout.rows_per_rank
    bounds = np.searchsorted(layout.seg_row, np.arange(layout.dp + 1, dtype=np.int64) * rpr).tolist()
    names = ("seg_source", "seg_key", "seg_start", "seg_len")
    out = []
    for c, ranks in enumerate(dp_ranks):
        d = sorted({int(x) for x in ranks})
        if d and d == list(range(d[0], d[-1] + 1)):
            sl = slice(bounds[d[0]], bounds[d[-1] + 1])
            row = layout.seg_row[sl] - np.int32(d[0] * rpr)
            cols = [getattr(layout, n)[sl] for n in names]
        else:
            idx = np.concatenate([np.arange(bounds[x], bounds[x + 1]) for x in d]) if d else np.zeros(0, np.int64)
            remap = np.full(layout.dp, -1, np.int64)
            remap[d] = np.arange(len(d))
            r = layout.seg_row[idx].astype(np.int64)
            row = remap[r // rpr] * rpr + r % rpr
            cols = [getattr(layout, n)[idx] for n in names]
        if image_idx is None:
            img = (layout.img_source, layout.img_key, layout.img_rank, layout.img_patches)
        else:
            ii = image_idx[c]
            img = (layout.img_source[ii], layout.img_key[ii], layout.img_rank[ii], layout.img_patches[ii])
        out.append(StepLayout(layout.step, layout.seq_len, len(d), layout.microbatches, layout.rows_per_microbatch,
                              layout.phase, layout.lr_scale, layout.generation, seg_row=row,
                              seg_source=cols[0], seg_key=cols[1], seg_start=cols[2], seg_len=cols[3],
                              img_source=img[0], img_key=img[1], img_rank=img[2], img_patches=img[3]))
    return out
