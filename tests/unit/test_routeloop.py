"""The compiled routing and layout loops (planner/routing.py over planner/routeloop.py) give exactly what the
routing rules written plainly give (planner/routespec.py): same instructions, same order, same dtypes -- on
random layouts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.layout import StepLayout
from mixplane import wire
from mixplane.planner.routing import (Fanout, ImageParts, constructor_columns, constructor_images, loader_instructions,
                                     loader_routes)

from mixplane.planner import routespec


def random_step(seed: int, *, dup_fanout: bool = False):
    """A layout and its pieces (shuffled), as a strategy would leave them: split samples, image samples whose
    first span carries the image, several loader replicas, fan-outs with empty and shared entries."""
    rng = np.random.default_rng(seed)
    dp, rpr = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    rows = dp * rpr
    n_samples = int(rng.integers(0, 40))
    segs = []  # (row, source, key, start, len, patches)
    for k in range(n_samples):
        src = int(rng.integers(0, 4))
        parts = int(rng.integers(1, 4)) if rng.random() < 0.3 else 1
        patches = int(rng.integers(1, 50)) if rng.random() < 0.4 else 0
        for j in range(parts):
            segs.append((int(rng.integers(0, rows)), src, 1000 + k, 7 * j, int(rng.integers(1, 8)), patches if j == 0 else 0))
    segs.sort(key=lambda x: x[0])  # stable: listed by row
    arr = np.array(segs, np.int64).reshape(-1, 6)
    world = dp * int(rng.integers(1, 4))
    img = arr[arr[:, 5] > 0]
    img_rank = rng.integers(0, world, len(img))
    lay = StepLayout(step=int(rng.integers(0, 100)), seq_len=64, dp=dp, microbatches=rpr, rows_per_microbatch=1,
                     seg_row=arr[:, 0], seg_source=arr[:, 1], seg_key=arr[:, 2], seg_start=arr[:, 3], seg_len=arr[:, 4],
                     img_source=img[:, 1], img_key=img[:, 2], img_rank=img_rank, img_patches=img[:, 5])
    n = len(arr)
    perm = rng.permutation(n)  # piece i is segment perm[i]
    pieces = {"source": arr[perm, 1], "key": arr[perm, 2], "start": arr[perm, 3],
              "replica": rng.integers(0, 3, n), "pos": rng.permutation(10 * n + 1)[:n].astype(np.int64),
              "retired": rng.integers(0, 2, n).astype(np.uint8)}
    piece_of_seg = np.empty(n, np.int64)
    piece_of_seg[perm] = np.arange(n)
    seg_of_img = np.flatnonzero(arr[:, 5] > 0)
    n_cons = int(rng.integers(1, 6))

    def lists(m: int) -> list[list[int]]:
        out = []
        for _ in range(m):
            x = sorted(rng.choice(n_cons, int(rng.integers(0, min(3, n_cons) + 1)), replace=False).tolist())
            if dup_fanout and x and rng.random() < 0.3:
                x = sorted(x + [x[0]])
            out.append(x)
        return out
    return lay, pieces, piece_of_seg, seg_of_img, Fanout.from_lists(lists(dp)), Fanout.from_lists(lists(world))


def same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        for name, x in a[k].arrays().items():
            y = b[k].arrays()[name]
            assert x.dtype == y.dtype and np.array_equal(x, y), (k, name)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.booleans(), st.booleans())
def test_loader_instructions_follow_the_rules(seed, aligned, img_given, dup):
    lay, p, pos_, soi, dp_fan, rank_fan = random_step(seed, dup_fanout=dup)
    args = (lay, p["source"], p["key"], p["start"], p["replica"], p["pos"], p["retired"], dp_fan, rank_fan)
    kw = {"piece_of_seg": pos_ if aligned else None, "seg_of_img": soi if img_given else None}
    same(loader_instructions(*args, **kw), routespec.loader_instructions(*args, **kw))


def test_the_comparison_sees_a_wrong_flag():
    """The equivalence check is not vacuous: one changed retire flag or destination is caught."""
    for seed in range(50):
        lay, p, pos_, soi, dp_fan, rank_fan = random_step(seed)
        got = loader_instructions(lay, p["source"], p["key"], p["start"], p["replica"], p["pos"], p["retired"],
                                  dp_fan, rank_fan, pos_, soi)
        if got:
            break
    want = routespec.loader_instructions(lay, p["source"], p["key"], p["start"], p["replica"], p["pos"], p["retired"],
                                   dp_fan, rank_fan, pos_, soi)
    k = next(iter(got))
    got[k].dest[0] += 1
    try:
        same(got, want)
    except AssertionError:
        return
    raise AssertionError("a changed destination went unnoticed")


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_constructor_images_follow_the_rules(seed, dup):
    """routeloop.image_lists against the rule: a constructor's images are those in its rows or encoded by a rank it serves."""
    lay, _, _, soi, dp_fan, rank_fan = random_step(seed, dup_fanout=dup)
    n_cons = int(max(dp_fan.targets.max(initial=-1), rank_fan.targets.max(initial=-1))) + 1 + seed % 2
    got = constructor_images(lay, soi, dp_fan, rank_fan, n_cons)
    want = routespec.constructor_images(lay, soi, dp_fan, rank_fan, n_cons)
    assert len(got) == len(want) == n_cons
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_loader_routes_are_the_instructions_and_encode_to_their_messages(seed):
    """LoaderRoutes (the columns the server encodes at once) is, as a Mapping, loader_instructions' dict, and
    its columns give every loader's PLAN_LOADER bytes."""
    lay, p, pos_, soi, dp_fan, rank_fan = random_step(seed)
    args = (lay, p["source"], p["key"], p["start"], p["replica"], p["pos"], p["retired"], dp_fan, rank_fan, pos_, soi)
    routes, want = loader_routes(*args), loader_instructions(*args)
    assert list(routes) == list(want) == routes.loaders and len(routes) == len(want)
    same({k: routes[k] for k in routes}, want)
    meta = {"session": 1, "step": lay.step, "released_through": -1}
    for key, frames in zip(routes.loaders, wire.encode_columns(wire.Kind.PLAN_LOADER, meta, routes.columns())):
        assert [bytes(memoryview(f).cast("B")) for f in frames] == \
            [bytes(memoryview(f).cast("B")) for f in wire.encode(wire.Kind.PLAN_LOADER, meta, want[key].arrays())]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.booleans())
def test_constructor_columns_are_each_constructors_ranks(seed, in_order, images):
    """constructor_columns cuts what select_ranks gives every constructor (same arrays, dtypes, dp) --
    for constructors holding the DP ranks in order (no gather) and for any lists of ranks (out of order,
    repeated, shared by constructors, none); with every image or each constructor's own (ImageParts.cut)."""
    lay = random_step(seed)[0]
    rng = np.random.default_rng(seed)
    if in_order:
        cuts = np.sort(rng.integers(0, lay.dp + 1, int(rng.integers(0, 4))))
        dps = [list(range(a, b)) for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), lay.dp])]
    else:
        dps = [rng.integers(0, lay.dp, int(rng.integers(0, 4))).tolist() for _ in range(int(rng.integers(1, 5)))]
    n = len(dps)
    idx = None
    cut = None
    if images:
        m = len(lay.img_key)  # each constructor's images: any ascending subset
        per = [np.flatnonzero(rng.random(m) < 0.5).astype(np.int64) for _ in range(n)]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([len(x) for x in per], out=offsets[1:])
        parts = ImageParts(per, np.arange(len(lay.img_key), dtype=np.int64), np.zeros(3, np.uint16), offsets,
                           np.concatenate(per) if per else np.zeros(0, np.int64))
        order = list(range(n)) if rng.random() < 0.5 else rng.permutation(n).tolist()
        idx = [per[c] for c in order]
        cut = parts.cut(order)
        want_b = np.concatenate([parts.base[per[c]] for c in order]) if order else np.zeros(0, np.int64)
        assert np.array_equal(parts.columns(cut)[0].data, want_b)
    cols = constructor_columns(lay, dps, cut)
    want = [routespec.constructor_layout(lay, d, None if idx is None else idx[c]) for c, d in enumerate(dps)]
    assert len(cols.dp) == len(want)
    for c, sub in enumerate(want):
        assert cols.dp[c] == sub.dp and list(cols.arrays(c)) == list(sub.arrays())
        for name, a in sub.arrays().items():
            got = cols.arrays(c)[name]
            assert got.dtype == a.dtype and np.array_equal(got, a), (c, name)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 70_000)), max_size=60), st.integers(1, 4), st.integers(10, 12))
def test_compiled_image_offsets_equal_the_numpy_version(imgs, merge, world):
    """routeloop.image_offsets (a counting sort's offsets, merging patches itself) against routing.image_offsets."""
    from mixplane.planner import routeloop
    from mixplane.planner.routing import image_offsets
    rank = np.array([r for r, _ in imgs], np.int32)
    patches = np.array([p for _, p in imgs], np.int32)
    got = routeloop.image_offsets(rank, patches, merge, world)
    want = image_offsets(rank, patches.astype(np.int64) // merge, world)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and np.array_equal(a, b)
