"""Batch materialisation: the vectorised `materialize_rank` equals a plain per-token reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.constructor.collate import IGNORE_INDEX, MissingPayload, SpanStore, materialize_rank
from mixplane.layout import StepLayout, segment_offsets


def reference_rank(layout: StepLayout, dp_local: int, spans: dict, pad_id: int) -> dict[str, np.ndarray]:
    """What one rank's batch must hold, written out position by position."""
    S, R = layout.seq_len, layout.rows_per_rank
    out = {"input_ids": np.full((R, S), pad_id, np.int64), "labels": np.full((R, S), IGNORE_INDEX, np.int64),
           "position_ids": np.zeros((R, S), np.int64), "source_ids": np.full((R, S), -1, np.int32)}
    fill = [0] * R
    bounds = {0}
    seg = {k: [] for k in ("segment_source", "segment_key", "segment_start", "segment_len", "segment_row",
                           "segment_offset")}
    for i in range(len(layout.seg_row)):
        row = int(layout.seg_row[i]) - dp_local * R
        if not 0 <= row < R:
            continue
        s, k, st0, n = (int(layout.seg_source[i]), int(layout.seg_key[i]), int(layout.seg_start[i]),
                        int(layout.seg_len[i]))
        tok = spans[(s, k, st0)]
        off = fill[row]
        for t in range(n):
            out["input_ids"][row, off + t] = tok[t]
            out["position_ids"][row, off + t] = t
            out["source_ids"][row, off + t] = s
            if t + 1 < len(tok):  # the next token: inside the piece, or the extra one the loader sent
                out["labels"][row, off + t] = tok[t + 1]
        fill[row] += n
        bounds.add(row * S + fill[row])
        for name, v in zip(seg, (s, k, st0, n, row, off)):
            seg[name].append(v)
    for row in range(R):
        for t in range(S - fill[row]):
            out["position_ids"][row, fill[row] + t] = t
        bounds.add((row + 1) * S)
    cu = np.array(sorted(bounds), np.int64)
    out["cu_seqlens"] = cu.astype(np.int32)
    mb = layout.rows_per_microbatch * S
    out["cu_seqlens_mb"] = np.array([list(cu).index(m * mb) for m in range(layout.microbatches + 1)], np.int64)
    for name, dtype in (("segment_source", np.int32), ("segment_key", np.int64), ("segment_start", np.int64),
                        ("segment_len", np.int64), ("segment_row", np.int64), ("segment_offset", np.int64)):
        out[name] = np.array(seg[name], dtype)
    return out


def random_step(seed: int, dp: int, microbatches: int, rows_per_mb: int, seq_len: int, blocks: int):
    """A valid random layout, the spans a loader would send for it (split over `blocks` messages, with
    stale duplicates sent earlier), and the dict a plain store would hold."""
    rng = np.random.default_rng(seed)
    rows = dp * microbatches * rows_per_mb
    seg = {k: [] for k in ("row", "source", "key", "start", "len")}
    used = set()
    for r in range(rows):
        room = int(rng.integers(0, seq_len + 1)) if rng.random() < 0.8 else seq_len
        while room > 0 and rng.random() < 0.9:
            n = int(rng.integers(1, room + 1))
            while True:  # addresses are unique within a step; a sample may have several pieces (split)
                a = (int(rng.integers(0, 3)), int(rng.integers(-5, 40)) * 1_000_003, int(rng.integers(0, 3)) * 64)
                if a not in used:
                    used.add(a)
                    break
            for k, v in zip(("row", "source", "key", "start", "len"), (r, *a, n)):
                seg[k].append(v)
            room -= n
    layout = StepLayout(step=int(rng.integers(0, 1000)), seq_len=seq_len, dp=dp, microbatches=microbatches,
                        rows_per_microbatch=rows_per_mb, seg_row=np.array(seg["row"]), seg_source=np.array(seg["source"]),
                        seg_key=np.array(seg["key"]), seg_start=np.array(seg["start"]), seg_len=np.array(seg["len"]))
    layout.validate()
    # (source, key, start, tokens): every span with 0-2 tokens past its end, in a random order
    spans = [(s, k, st0, rng.integers(0, 50_000, size=n + int(rng.integers(0, 3))).astype(np.int32))
             for s, k, st0, n in zip(seg["source"], seg["key"], seg["start"], seg["len"])]
    order = rng.permutation(len(spans))
    stale = [(s, k, st0, np.full(int(rng.integers(0, 5)), -7, np.int32)) for s, k, st0, _ in spans[: len(spans) // 4]]
    sent = stale + [spans[i] for i in order]
    store, plain = SpanStore.empty(), {}
    cuts = np.sort(rng.integers(0, len(sent) + 1, size=blocks - 1)) if blocks > 1 else []
    for part in np.split(np.arange(len(sent)), cuts):
        by_source: dict[int, list] = {}
        for i in part:
            by_source.setdefault(sent[i][0], []).append(sent[i])
        for s, items in by_source.items():  # one SAMPLES message per source, as loaders send them
            lens = [len(t) for *_, t in items]
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            values = np.concatenate([t for *_, t in items]) if items else np.zeros(0, np.int32)
            store.add(s, np.array([k for _, k, _, _ in items], np.int64), np.array([x for _, _, x, _ in items], np.int64),
                      offsets, values)
            for _, k, x, t in items:
                plain[(s, k, x)] = t
    return layout, store, plain


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dp=st.integers(1, 3), microbatches=st.integers(1, 3),
       rows_per_mb=st.integers(1, 3), seq_len=st.integers(1, 48), blocks=st.integers(1, 4), pad_id=st.integers(0, 9))
def test_materialize_rank_equals_reference(seed, dp, microbatches, rows_per_mb, seq_len, blocks, pad_id):
    layout, store, plain = random_step(seed, dp, microbatches, rows_per_mb, seq_len, blocks)
    for dp_local in range(dp):
        got = materialize_rank(layout, dp_local, store, pad_id)
        want = reference_rank(layout, dp_local, plain, pad_id)
        assert sorted(got) == sorted(want)
        for name, a in want.items():
            assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
            np.testing.assert_array_equal(got[name], a, err_msg=name)


def test_missing_and_short_spans_name_step_source_and_sample():
    layout = StepLayout(step=17, seq_len=8, dp=1, microbatches=1, rows_per_microbatch=1, seg_row=np.array([0, 0]),
                        seg_source=np.array([1, 2]), seg_key=np.array([5, 6]), seg_start=np.array([0, 3]),
                        seg_len=np.array([3, 4]))
    store = SpanStore.empty()
    store.add(1, np.array([5]), np.array([0]), np.array([0, 4]), np.arange(4, dtype=np.int32))
    with pytest.raises(MissingPayload, match=r"step 17: tokens of source 2 sample 6 at offset 3 \(missing\)"):
        materialize_rank(layout, 0, store)
    store.add(2, np.array([6]), np.array([3]), np.array([0, 2]), np.arange(2, dtype=np.int32))
    with pytest.raises(MissingPayload, match=r"source 2 sample 6 at offset 3 \(2 < 4 tokens\)"):
        materialize_rank(layout, 0, store)
    store.add(2, np.array([6]), np.array([3]), np.array([0, 4]), np.arange(10, 14, dtype=np.int32))  # resent: replaces
    b = materialize_rank(layout, 0, store)
    assert b["input_ids"][0].tolist() == [0, 1, 2, 10, 11, 12, 13, 0]
    assert b["labels"][0].tolist() == [1, 2, 3, 11, 12, 13, -100, -100]
    assert b["cu_seqlens"].tolist() == [0, 3, 7, 8] and b["segment_offset"].tolist() == [0, 3]


def test_span_store_addresses_blocks_without_copying_per_span():
    store = SpanStore.empty()
    vals = np.arange(10, dtype=np.int32)
    assert store.add(0, np.array([7, 8]), np.array([0, 5]), np.array([0, 4, 10]), vals) == 2
    store.spans[(1, 7, 0)] = np.array([42, 43], np.int32)  # one span at a time (replay)
    assert len(store) == 3 and (0, 8, 5) in store and (0, 8, 0) not in store and (0, 8, 5) in store.spans
    assert store.spans[(0, 8, 5)].tolist() == [4, 5, 6, 7, 8, 9] and store.get((1, 7, 0)).tolist() == [42, 43]
    assert sorted(store.spans) == [(0, 7, 0), (0, 8, 5), (1, 7, 0)]
    assert store.contains(np.array([0, 1, 1]), np.array([7, 7, 8]), np.array([0, 0, 0])).tolist() == [True, True, False]
    with pytest.raises(KeyError):
        store.spans[(2, 0, 0)]


def test_segment_offsets():
    assert segment_offsets(np.array([0, 0, 0, 2, 2, 5]), np.array([3, 4, 1, 2, 6, 9])).tolist() == [0, 3, 7, 0, 2, 0]
    assert segment_offsets(np.zeros(0, np.int32), np.zeros(0, np.int32)).tolist() == []
    with pytest.raises(ValueError, match="ordered by row"):
        segment_offsets(np.array([1, 0]), np.array([1, 1]))
