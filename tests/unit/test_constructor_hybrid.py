"""Hybrid DP x CP delivery, constructor side (pure): every rank's parts of the CP groups the plan gives it, cut from
its replica's batch. Every token of every planned piece reaches exactly the ranks of its group, once; a group's parts
merged (cp_merge) give its sequence; a group of one keeps its documents whole."""

import numpy as np
import pytest

from mixplane.constructor.collate import IGNORE_INDEX, SpanStore, hybrid_view, materialize_rank
from mixplane.parallelism import cp_merge, group_token_index, hybrid_groups, hybrid_rank_batch
from tests.unit.test_hybridcp import _hybrid_plans


def _tokens(s, k, start, n):
    """Deterministic tokens of a piece (and the token after it, for its last label)."""
    return (np.arange(start, start + n + 1, dtype=np.int64) * 7 + k * 13 + s * 100003) % 50000 + 3


def _views(lay):
    store = SpanStore.empty()
    for s, k, st, ln in zip(lay.seg_source.tolist(), lay.seg_key.tolist(), lay.seg_start.tolist(), lay.seg_len.tolist()):
        store.put(s, k, st, _tokens(s, k, st, ln).astype(np.int32))
    cp = lay.hybrid_cp
    return {(d, c): hybrid_view(lay, d, materialize_rank(lay, d, store), c) for d in range(lay.dp) for c in range(cp)}


def test_every_planned_token_reaches_its_group_once_and_merges_back():
    _, plans = _hybrid_plans(steps=2)
    for plan in plans:
        lay = plan.layout
        views = _views(lay)
        want = {}  # piece -> its group's ranks
        for s, k, st, ln, row, f, g in zip(lay.seg_source.tolist(), lay.seg_key.tolist(), lay.seg_start.tolist(),
                                           lay.seg_len.tolist(), lay.seg_row.tolist(), lay.seg_cp_first.tolist(),
                                           lay.seg_cp_size.tolist()):
            want[(s, k, st)] = (ln, row // lay.rows_per_rank, f, g)
        seen: dict = {}
        real = 0
        for (d, c), v in views.items():
            T = v["input_ids"].shape[1]
            assert v["input_ids"].shape == (1, T) and int(v["cu_seqlens"][-1]) == T and "cp_token_index" not in v
            real += int((v["source_ids"] >= 0).sum())
            for s, k, st in zip(v["segment_source"].tolist(), v["segment_key"].tolist(), v["segment_start"].tolist()):
                seen.setdefault((s, k, st), []).append((d, c))
            assert [(int(a), int(b)) for a, b in zip(v["cp_group_first"], v["cp_group_size"])] == \
                hybrid_groups(lay.seg_cp_first[lay.seg_row // lay.rows_per_rank == d],
                              lay.seg_cp_size[lay.seg_row // lay.rows_per_rank == d], c)
        assert real == int(lay.seg_len.sum())  # every token once (padding aside)
        for piece, (_ln, d, f, g) in want.items():
            assert sorted(seen[piece]) == [(d, f + j) for j in range(g)], piece  # exactly the ranks the plan names
        # a group's parts, merged, are its documents one after the other (each padded to a multiple of 2k)
        for d in range(lay.dp):
            groups = {(int(f), int(g)) for f, g, r in zip(lay.seg_cp_first, lay.seg_cp_size, lay.seg_row // lay.rows_per_rank) if r == d}
            for f, g in groups:
                parts = []
                docs0: list = []
                for j in range(g):
                    v = views[(d, f + j)]
                    gi = [(int(a), int(b)) for a, b in zip(v["cp_group_first"], v["cp_group_size"])].index((f, g))
                    lo_doc, hi_doc = int(v["cp_group_docs"][gi]), int(v["cp_group_docs"][gi + 1])
                    lo, hi = int(v["cu_seqlens"][lo_doc]), int(v["cu_seqlens"][hi_doc])
                    part = {n: v[n][0, lo:hi] for n in ("input_ids", "labels", "position_ids", "source_ids")}
                    part["cu_seqlens"] = v["cu_seqlens"][lo_doc:hi_doc + 1] - lo
                    part["cp_token_index"] = group_token_index(part["cu_seqlens"], g, j)
                    docs = list(zip(v["segment_source"][lo_doc:hi_doc].tolist(), v["segment_key"][lo_doc:hi_doc].tolist(),
                                    v["segment_start"][lo_doc:hi_doc].tolist(), v["segment_len"][lo_doc:hi_doc].tolist()))
                    if j:
                        assert docs == docs0  # every member lists the group's documents alike
                    docs0 = docs
                    parts.append(part)
                whole = cp_merge(parts, mode="document") if g > 1 else parts[0]
                cu = np.asarray(whole["cu_seqlens"], np.int64)
                for i, (s, k, st, ln) in enumerate(docs0):
                    a, b = int(cu[i]), int(cu[i + 1])
                    tok = _tokens(s, k, st, ln)
                    assert np.array_equal(whole["input_ids"][a:a + ln], tok[:ln])
                    assert np.array_equal(whole["labels"][a:a + ln], tok[1:ln + 1])
                    assert np.array_equal(whole["position_ids"][a:b], np.arange(b - a))
                    assert np.all(whole["source_ids"][a:a + ln] == s) and np.all(whole["source_ids"][a + ln:b] == -1)
                    assert np.all(whole["labels"][a + ln:b] == IGNORE_INDEX)
                    assert (b - a) % (2 * g if g > 1 else 1) == 0 and b - a - ln < (2 * g if g > 1 else 1)


def test_a_rank_in_no_group_gets_an_empty_row():
    b = {"input_ids": np.zeros((1, 8), np.int64), "labels": np.zeros((1, 8), np.int64),
         "segment_row": np.array([0]), "segment_offset": np.array([0]), "segment_len": np.array([8]),
         "segment_source": np.array([0]), "segment_key": np.array([1]), "segment_start": np.array([0])}
    v = hybrid_rank_batch({**b, "row_weight": np.array([0.5]), "cu_seqlens_mb": np.array([0, 1])}, np.array([0]),
                          np.array([1]), cp_rank=1)
    assert v["input_ids"].shape == (1, 0) and v["cu_seqlens"].tolist() == [0] and len(v["cp_group_size"]) == 0
    assert v["row_weight"].tolist() == [0.5] and "cu_seqlens_mb" not in v and "segment_row" not in v  # a hook's field: whole
    with pytest.raises(ValueError, match="2 groups for 1 segments"):
        hybrid_rank_batch(b, np.array([0, 0]), np.array([1, 1]), cp_rank=0)


def test_client_checks_and_splits_a_hybrid_message():
    import torch

    from mixplane.client import DeliveryError, check_step_data, cp_groups
    from tests.unit.test_client import _msg

    b = {"input_ids": np.arange(16, dtype=np.int64).reshape(2, 8), "labels": np.zeros((2, 8), np.int64),
         "segment_row": np.array([0, 1, 1]), "segment_offset": np.array([0, 0, 3]), "segment_len": np.array([8, 3, 5]),
         "segment_source": np.array([0, 1, 1]), "segment_key": np.array([1, 2, 3]), "segment_start": np.zeros(3, np.int64)}
    v = hybrid_rank_batch(b, np.array([0, 1, 0]), np.array([2, 1, 2]), cp_rank=1)
    arrays = {k: x for k, x in v.items() if isinstance(x, np.ndarray)}
    check_step_data(_msg(**arrays), 1, 0, "c")
    with pytest.raises(DeliveryError, match="hybrid CP step: cu_seqlens ends at"):
        check_step_data(_msg(**{**arrays, "cu_seqlens": v["cu_seqlens"][:-1]}), 1, 0, "c")
    t = {k: torch.from_numpy(x) for k, x in arrays.items()}
    t["cp_group_ranks"] = torch.tensor([7, 8, 9], dtype=torch.int32)  # the (1, 1) group, then the (0, 2) group
    got = list(cp_groups(t))
    from mixplane.client import microbatches
    with pytest.raises(ValueError, match="iterate cp_groups"):
        list(microbatches(t))
    assert [(g["cp_size"], g["cp_rank"], g["ranks"]) for g in got] == [(1, 0, [7]), (2, 1, [8, 9])]
    assert got[0]["input_ids"].tolist() == [[8, 9, 10]] and got[0]["cu_seqlens"].tolist() == [0, 3]
    # the (0, 2) group: documents of 8 and 5 tokens (padded to 8 and 8), rank 1 holds chunks 1 and 2 of each
    assert got[1]["input_ids"].tolist() == [[2, 3, 4, 5, 13, 14, 15, 0]] and got[1]["cu_seqlens"].tolist() == [0, 4, 8]
    assert got[1]["cp_token_index"].tolist() == [2, 3, 4, 5, 10, 11, 12, 13] and got[1]["max_seqlen"] == 4
