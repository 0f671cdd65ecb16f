"""Parallelism transforms: CP zig-zag shards put back together reproduce the batch, work is balanced,
PP stages get what they need and no more, TP copies share buffers."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mixplane.planner.packing import pack_documents
from mixplane.parallelism import (META_ONLY, causal_work, cp_merge, cp_split, document_zigzag_index,
                                  group_views, position_ids_from_cu_seqlens, pp_filter, rank_view,
                                  tp_receives, zigzag_chunks, zigzag_index)


def _row_batch(rows=3, S=32, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, size=(rows, S)).astype(np.int32)
    return {"input_ids": ids, "labels": np.roll(ids, -1, axis=1), "position_ids": np.tile(np.arange(S, dtype=np.int32), (rows, 1)),
            "source_ids": np.zeros((rows, S), np.int16), "cu_seqlens": np.arange(0, rows * S + 1, S, dtype=np.int32),
            "max_seqlen": S, "step": 7, "lr_scale": 1.0}


def test_zigzag_chunks_pair_early_with_late():
    assert [zigzag_chunks(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        zigzag_index(10, 4, 0)
    with pytest.raises(ValueError, match="outside"):
        zigzag_chunks(2, 2)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_row_shards_merge_back_in_zigzag_order(cp):
    b = _row_batch(S=32)
    shards = [cp_split(b, cp, r) for r in range(cp)]
    for s in shards:
        assert s["input_ids"].shape == (3, 32 // cp)
        assert s["cu_seqlens"] is b["cu_seqlens"]  # ring attention needs the full boundaries
    merged = cp_merge(shards)
    for f in ("input_ids", "labels", "position_ids", "source_ids"):
        np.testing.assert_array_equal(merged[f], b[f])
    # the concatenation of chunks in zig-zag order is the sequence itself
    if cp > 1:
        chunks = {}
        c = 32 // (2 * cp)
        for r, s in enumerate(shards):
            a, z = zigzag_chunks(cp, r)
            chunks[a], chunks[z] = s["input_ids"][:, :c], s["input_ids"][:, c:]
        np.testing.assert_array_equal(np.concatenate([chunks[k] for k in range(2 * cp)], axis=1), b["input_ids"])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_row_zigzag_balances_causal_work_exactly(cp):
    S = 4096
    works = {causal_work(zigzag_index(S, cp, r)) for r in range(cp)}
    assert len(works) == 1
    contiguous = [causal_work(np.arange(r * S // cp, (r + 1) * S // cp)) for r in range(cp)]
    assert max(contiguous) > 2 * min(contiguous)  # what the zig-zag avoids


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=40), st.sampled_from([2, 4]))
def test_document_layout_round_trips_and_balances(lengths, cp):
    S = 256
    plan = pack_documents(lengths, S, "best_fit", align=2 * cp)
    # build a flat THD sequence with one segment per (aligned) piece
    foot = -(-plan.length // (2 * cp)) * (2 * cp)
    cu = np.concatenate([[0], np.cumsum(foot)]).astype(np.int32)
    T = int(cu[-1])
    ids = np.arange(T, dtype=np.int32) * 3 + 1
    pos = position_ids_from_cu_seqlens(cu)
    b = {"input_ids": ids, "position_ids": pos, "labels": ids + 1, "cu_seqlens": cu, "max_seqlen": int(foot.max())}
    shards = [cp_split(b, cp, r, mode="document") for r in range(cp)]
    for s in shards:
        assert len(s["input_ids"]) == T // cp
        np.testing.assert_array_equal(s["cu_seqlens"], cu // cp)
    merged = cp_merge(shards, mode="document")
    np.testing.assert_array_equal(merged["input_ids"], ids)
    np.testing.assert_array_equal(merged["cu_seqlens"], cu)
    # every document is split evenly and causal work is identical on every rank
    works = {causal_work(document_zigzag_index(cu, cp, r), cu) for r in range(cp)}
    assert len(works) == 1


def test_document_layout_rejects_unaligned_documents():
    b = {"input_ids": np.arange(10), "cu_seqlens": np.array([0, 3, 10])}
    with pytest.raises(ValueError, match="document 0 has length 3.*align=4"):
        cp_split(b, 2, 0, mode="document")
    with pytest.raises(ValueError, match="unknown context-parallel layout"):
        cp_split(b, 2, 0, mode="ring")


def test_pipeline_stages_get_inputs_labels_or_metadata():
    b = _row_batch()
    first, mid, last = (pp_filter(b, s, 4) for s in (0, 1, 3))
    assert {"input_ids", "position_ids", "cu_seqlens", "step"} <= set(first) and "labels" not in first
    assert {"labels", "source_ids", "cu_seqlens", "step"} <= set(last) and "input_ids" not in last
    assert not any(isinstance(v, np.ndarray) and k != "cu_seqlens" for k, v in mid.items())
    assert mid["shapes"]["input_ids"] == ["int32", [3, 32]] and mid["max_seqlen"] == 32
    assert first["input_ids"] is b["input_ids"]  # no copy
    only = pp_filter(b, 0, 1)
    assert set(only) == set(b)


def test_tensor_parallel_copies_or_broadcast():
    b = _row_batch()
    assert tp_receives(1) and tp_receives(0, ["TP"]) and not tp_receives(1, ["tp"])
    copy = rank_view(b, tp_rank=3)
    assert copy["input_ids"] is b["input_ids"]
    meta = rank_view(b, tp_rank=1, broadcast_at=["TP"])
    assert meta[META_ONLY] and not any(isinstance(v, np.ndarray) for v in meta.values())
    assert meta["shapes"]["labels"] == ["int32", [3, 32]] and meta["step"] == 7


def test_group_views_build_each_distinct_view_once():
    b = _row_batch(S=32)
    coords = [(cp, pp, tp) for pp in range(4) for cp in range(2) for tp in range(2)]
    views, keys = group_views(b, coords, cp=2, pp=4, broadcast_at=["TP"])
    # 2 cp x 3 pp roles x (receives or not) = 12 distinct, out of 16 ranks
    assert len(keys) == 16 and len(views) == 12
    # the two middle stages share their view object
    i1, i2 = coords.index((0, 1, 0)), coords.index((0, 2, 0))
    assert views[keys[i1]] is views[keys[i2]]
    v = views[keys[coords.index((1, 0, 0))]]
    np.testing.assert_array_equal(v["input_ids"], b["input_ids"][:, zigzag_index(32, 2, 1)])
    v = views[keys[coords.index((1, 3, 1))]]
    assert v[META_ONLY] and v["shapes"]["labels"] == ["int32", [3, 16]]


def test_position_ids_from_cu_seqlens():
    assert position_ids_from_cu_seqlens(np.array([0, 3, 5])).tolist() == [0, 1, 2, 0, 1]
