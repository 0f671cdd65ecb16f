"""Per-constructor image lists (issue 14 item 3): a constructor's PLAN_CONSTRUCTOR lists only the images
its rows start or its ranks' encoder leaders encode, plus the planner's gather offsets; what it builds
from them is what it built from the whole step's list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.constructor.multimodal import encoder_offsets, encoder_shapes, fuse_batch
from mixplane.constructor.server import encoder_leaders as constructor_leaders
from mixplane.planner.core import StepPlanner
from mixplane.planner.routing import (Fanout, image_offsets, image_parts, image_routing, image_segments,
                                     loader_instructions)
from mixplane.topology import constructor_groups, dp_ranks_of_group, encoder_leaders

from .planner_helpers import fill, make_spec
from mixplane.planner.routespec import constructor_layout


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 50)), max_size=40))
def test_image_offsets_are_the_constructors_encoder_offsets(imgs):
    rank = np.array([r for r, _ in imgs], np.int64)
    tok = np.array([t for _, t in imgs], np.int64)
    a, b = image_offsets(rank, tok, 8), encoder_offsets(rank, tok, 8)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def _batch(sub, rows_per_rank, dp_local, image_token_id, rng):
    """A batch of one DP rank of `sub` whose image samples start with their placeholders."""
    S = sub.seq_len
    lo, hi = dp_local * rows_per_rank, (dp_local + 1) * rows_per_rank
    m = (sub.seg_row >= lo) & (sub.seg_row < hi)
    rows = sub.seg_row[m].astype(np.int64) - lo
    ids = rng.integers(1, 100, (rows_per_rank, S)).astype(np.int32)
    return {"input_ids": ids, "segment_row": rows, "segment_len": sub.seg_len[m], "segment_start": sub.seg_start[m],
            "segment_source": sub.seg_source[m], "segment_key": sub.seg_key[m]}


@pytest.mark.parametrize("dp,tp,pp", [(4, 1, 1), (2, 2, 2)])
def test_partial_image_lists_build_what_the_full_list_builds(dp, tp, pp):
    spec = make_spec(sources=3, rows=8 * dp, seq_len=256, dp=dp, tp=tp, pp=pp, microbatches=2, encoder=True,
                     weights={"s0": 3, "s1": 1, "s2": 1}, strategy="vlm_balance")
    planner = StepPlanner(spec)
    groups = constructor_groups(spec)
    assert np.array_equal(encoder_leaders(spec), [constructor_leaders(spec)[r] for r in range(spec.world_size)])
    dps = [dp_ranks_of_group(spec, g) for g in groups]
    dp_to: list[list[int]] = [[] for _ in range(dp)]
    for ci, d in enumerate(dps):
        for x in d:
            dp_to[x].append(ci)
    leader_fanout, merge = image_routing(spec, groups)
    assert leader_fanout is not None and merge
    leaders = encoder_leaders(spec)
    rng = np.random.default_rng(0)
    seen_partial = False
    for _ in range(4):
        fill(planner, images=True)
        plan = planner.plan()
        lay, p = plan.layout, plan.pieces
        if not len(lay.img_key):
            continue
        img = image_parts(lay, image_segments(lay, plan.piece_of_seg, p.patches), Fanout.from_lists(dp_to),
                          leader_fanout, len(groups), merge, spec.world_size)
        assert img is not None
        rank_to: list[list[int]] = [[] for _ in range(spec.world_size)]
        for ci, g in enumerate(groups):
            for r in g:
                rank_to[int(r)].append(ci)
        args = (lay, p.source, p.key, p.start, p.replica, p.pos, planner.retired(p), Fanout.from_lists(dp_to),
                Fanout.from_lists(rank_to))
        slow, fast = loader_instructions(*args), loader_instructions(*args, plan.piece_of_seg,
                                                                      image_segments(lay, plan.piece_of_seg, p.patches))
        assert slow.keys() == fast.keys()
        for key in slow:
            for name, a in slow[key].arrays().items():
                assert np.array_equal(a, fast[key].arrays()[name]) and a.dtype == fast[key].arrays()[name].dtype
        full = [constructor_layout(lay, d) for d in dps]
        part = [constructor_layout(lay, d, ix) for d, ix in zip(dps, img.idx)]
        listed = 0
        for ci, (f, q) in enumerate(zip(full, part)):
            listed += len(q.img_key)
            seen_partial |= len(q.img_key) < len(lay.img_key)
            extra = img.arrays(ci)
            for dl in range(len(dps[ci])):
                b = _batch(f, lay.rows_per_rank, dl, 7, rng)
                b2 = {k: v.copy() for k, v in b.items()}
                kw = dict(world=spec.world_size, image_token_id=7, merge=merge, pad_id=0)
                want = fuse_batch(b, img_source=f.img_source, img_key=f.img_key, img_rank=f.img_rank,
                                  img_patches=f.img_patches, **kw)
                got = fuse_batch(b2, img_source=q.img_source, img_key=q.img_key, img_rank=q.img_rank,
                                 img_patches=q.img_patches, img_base=extra["img_base"],
                                 encoder_tokens=extra["encoder_tokens"], **kw)
                for k in ("image_token_index", "encoder_tokens", "input_ids", "orphan_placeholders"):
                    assert np.array_equal(want[k], got[k]), (ci, dl, k)
            for r in groups[ci]:  # every rank's encoder view: its leader's images
                a = encoder_shapes(int(leaders[r]), img_rank=f.img_rank, img_patches=f.img_patches, patch_dim=12)
                c = encoder_shapes(int(leaders[r]), img_rank=q.img_rank, img_patches=q.img_patches, patch_dim=12)
                assert a == c, (ci, r)
        assert listed <= 2 * len(lay.img_key)  # each image: its text's constructor and its encoder's
    assert seen_partial


def _plan_msg(meta, arrays):
    from mixplane import wire
    from mixplane.wire import Kind

    frames = wire.encode(Kind.PLAN_CONSTRUCTOR, meta, arrays)
    return wire.decode([bytes(memoryview(f)) for f in frames])


def test_cursor_travels_deflated_when_large_and_comes_back_whole():
    from mixplane.protocol import CURSOR_ARRAY, ZIP_CURSOR_BYTES, cursor_array, plan_cursor
    from mixplane.wire import WireError

    small = {"step": 3, "windows": [{"source": 0, "low": 5}]}
    large = {"step": 9, "windows": [{"source": i, "replica": 0, "low": i * 7, "next": i * 9, "skip": list(range(i % 13)),
                                     "partial": {}} for i in range(1024)]}
    a, b = cursor_array(small), cursor_array(large)
    assert bytes(a[:1]) == b"{" and bytes(b[:1]) != b"{"
    assert len(b) < ZIP_CURSOR_BYTES * 4 < len(__import__("json").dumps(large))
    for cur, arr in ((small, a), (large, b)):
        assert plan_cursor(_plan_msg({"step": 1}, {CURSOR_ARRAY: arr})) == cur
    with pytest.raises(WireError, match="cursor_after"):
        plan_cursor(_plan_msg({"step": 1}, {CURSOR_ARRAY: np.frombuffer(b"x\x9cnot zlib", np.uint8)}))


def test_plan_images_fields_are_checked():
    from mixplane.protocol import ENCODER_TOKENS, IMG_BASE, STEP_IMAGES, plan_images
    from mixplane.wire import WireError

    ok = {IMG_BASE: np.array([0, 4], np.int64), ENCODER_TOKENS: np.array([4, 2, 0], np.int32)}
    base, enc, n = plan_images(_plan_msg({STEP_IMAGES: 5}, ok), 2, 3)
    assert base.tolist() == [0, 4] and enc.dtype == np.int64 and enc.tolist() == [4, 2, 0] and n == 5
    narrow = {**ok, ENCODER_TOKENS: np.array([4, 65535, 0], np.uint16)}  # what the planner sends when it fits
    assert plan_images(_plan_msg({STEP_IMAGES: 5}, narrow), 2, 3)[1].tolist() == [4, 65535, 0]
    assert plan_images(_plan_msg({}, {}), 4, 3) == (None, None, 4)  # an older planner: every image listed
    bad = [({STEP_IMAGES: 5}, {IMG_BASE: ok[IMG_BASE]}, "come together"),
           ({STEP_IMAGES: 5}, {**ok, IMG_BASE: np.array([0], np.int64)}, IMG_BASE),
           ({STEP_IMAGES: 5}, {**ok, ENCODER_TOKENS: np.array([1, 2], np.int64)}, ENCODER_TOKENS),
           ({STEP_IMAGES: 5}, {**ok, ENCODER_TOKENS: np.array([1, 2, 3], np.int16)}, ENCODER_TOKENS),
           ({STEP_IMAGES: 1}, ok, STEP_IMAGES), ({}, ok, STEP_IMAGES)]
    for meta, arrays, field in bad:
        with pytest.raises(WireError, match=field):
            plan_images(_plan_msg(meta, arrays), 2, 3)
