"""A source indexed block by block (loader/blockstream.py): every row once per epoch, deterministic for a seed, resume
exact at every position without indexing earlier blocks, packs reused, bad files quarantined by name, states of the
page order refused clearly; smaller listings keep the page order (tests/unit/stream_orders.json)."""

from __future__ import annotations

import io
import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.loader.blocks import MAX_BLOCK_SLOTS
from mixplane.loader.blockstream import BlockStream
from mixplane.loader.files import list_source_files
from mixplane.loader.stream import SourceStream, open_stream
from mixplane.repartition import repartition
from mixplane.samples import key_epoch, key_row
from mixplane.spec import SourceSpec


def _corpus(d, files: int, rows: int) -> str:
    d.mkdir(exist_ok=True)
    for i in range(files):  # row r of file i holds the value i * rows + r
        ids = pa.array([np.arange(i * rows + r, i * rows + r + 3, dtype=np.int32) for r in range(rows)],
                       pa.list_(pa.int32()))
        pq.write_table(pa.table({"ids": ids}), d / f"f{i:05d}.parquet", row_group_size=max(1, rows // 2),
                       data_page_size=64, write_page_index=True)
    return str(d)


def _spec(uri: str, **kw) -> SourceSpec:
    return SourceSpec(name="big", uri=uri, kind="tokens", columns=["ids"], **{"lazy_index_files": 40, "block_files": 8,
                                                                             **kw})


def _values(r) -> list[int]:
    return [v[0] for v in r.columns["ids"].to_pylist()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("blocks"), 60, 8)


def test_every_row_once_per_epoch_deterministic_for_a_seed(corpus):
    src = _spec(corpus)
    with open_stream(src, seed=4, cache_dir=None) as s, open_stream(src, seed=4, cache_dir=None) as t:
        assert isinstance(s, BlockStream) and s.blocks.num_blocks == 8
        a, b = s.take(480), s.take(480)
        assert sorted(_values(a)) == list(range(480)) == sorted(_values(b))  # epoch 0, then epoch 1
        assert _values(a) != _values(b) and _values(a) != list(range(480))  # shuffled, anew each epoch
        assert np.array_equal(a.keys, t.take(480).keys)  # the same order for the same seed
        assert (np.diff(np.concatenate([a.positions, b.positions])) > 0).all()
        for k, v in zip(b.keys[-30:].tolist(), _values(b)[-30:]):  # keys name the file and row (recent blocks)
            path, row = s.where_key(k)
            assert os.path.basename(path) == f"f{v // 8:05d}.parquet" and row == v % 8
        assert len(set(a.keys.tolist()) | set(b.keys.tolist())) == 960
    with open_stream(src, seed=5, cache_dir=None) as u:
        assert _values(u.take(480)) != _values(a)


def test_partitions_are_disjoint_and_cover_each_epoch(corpus):
    src = _spec(corpus)
    for n in (2, 3):
        got = {0: [], 1: []}
        for p in range(n):
            with open_stream(src, seed=1, partition=p, num_partitions=n, cache_dir=None) as s:
                r = s.take(480)  # more than an epoch of this partition
                ep = key_epoch(r.keys)
                for e in (0, 1):
                    got[e] += [v for v, k in zip(_values(r), ep.tolist()) if k == e]
        assert sorted(got[0]) == list(range(480))  # epoch 0 of every partition: each row once


def test_resume_at_every_position_is_exact_and_indexes_one_block(corpus):
    src = _spec(corpus)
    with open_stream(src, seed=7, cache_dir=None) as s:
        whole = s.take(480 + 120)  # epoch 0 and the start of epoch 1
    pos, keys = whole.positions.tolist(), whole.keys.tolist()
    for i, p in enumerate(pos[:580]):
        with open_stream(src, seed=7, cache_dir=None) as r:
            r.seek(p)
            got = r.take(min(5, len(pos) - i))
            assert got.keys.tolist() == keys[i : i + len(got)] and got.positions.tolist() == pos[i : i + len(got)]
    # via state_dict between takes, at every take boundary of a stream taking 37 rows at a time
    with open_stream(src, seed=7, cache_dir=None) as s:
        for i in range(0, 560, 37):
            st = s.state_dict()
            assert s.take(37).keys.tolist() == keys[i : i + 37]
            with open_stream(src, seed=7, cache_dir=None) as r:
                r.load_state_dict(st)
                assert r.take(37).keys.tolist() == keys[i : i + 37]
                assert r.status()["block_files"] <= 8  # only its own block was indexed


def test_old_and_foreign_states_are_refused_by_name(corpus, tmp_path):
    with open_stream(_spec(corpus), seed=0, cache_dir=None) as s:
        st = s.state_dict()
        with pytest.raises(ValueError, match="lazy_index_files: 0"):
            s.load_state_dict({**st, "version": 2, "order": "pages"})
        with pytest.raises(ValueError, match="block_files"):
            s.load_state_dict({**st, "block_files": 16})
    with open_stream(_spec(corpus, lazy_index_files=0), seed=0, cache_dir=None) as old:
        assert isinstance(old, SourceStream)  # below the threshold (or 0): the whole source's page order
        with pytest.raises(ValueError, match="block by block"):
            old.load_state_dict(st)
        v2 = {**old.state_dict(), "version": 2}
        del v2["order"]
        old.load_state_dict(v2)  # a page-order state of before keeps its meaning


def test_block_packs_make_a_warm_start_read_no_footer(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    src = _spec(corpus)
    with open_stream(src, seed=2, cache_dir=cache) as s:
        a = s.take(480)
        assert s.stats.reads > 0
    packs = [f for f in os.listdir(cache) if f.startswith("source-")]
    assert len(packs) == 8 and not [f for f in os.listdir(cache) if f.startswith("recent-")]
    with open_stream(src, seed=2, cache_dir=cache) as w:
        assert w.index.num_rows  # the first block, from its pack
        assert w.stats.reads == 0 and w.stats.bytes_read == 0
        assert np.array_equal(w.take(480).keys, a.keys)


def test_bad_files_among_many_are_quarantined_by_name_and_the_source_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    files, rows = 1200, 16
    buf = io.BytesIO()
    pq.write_table(pa.table({"ids": pa.array([[1, 2, 3]] * rows, pa.list_(pa.int32()))}), buf, row_group_size=8,
                   write_page_index=True)
    paths = []
    for i in range(files):
        p = tmp_path / f"part-{i:05d}.parquet"
        p.write_bytes(buf.getvalue())
        paths.append(str(p))
    corrupt, missing, changed = paths[77], paths[600], paths[1199]
    with open(corrupt, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff\xff\xff\x7fPAR1")
    listing = list_source_files(str(tmp_path))
    os.remove(missing)
    with open(changed, "r+b") as f:
        f.truncate(os.path.getsize(changed) // 2)
    src = SourceSpec(name="big", uri=str(tmp_path), kind="tokens", columns=["ids"], lazy_index_files=1000,
                     block_files=128)
    with open_stream(src, seed=0, cache_dir=None, files=listing) as s:
        assert isinstance(s, BlockStream)
        got = s.take((files - 3) * rows)  # epoch 0: every row of the 1,197 good files
        assert len(got) == (files - 3) * rows and s.epoch == 0
        where = {s.where_key(int(k)) for k in got.keys[-rows * 100 :]}
        assert len(where) == rows * 100
        assert {e.file for e in s.quarantine.entries} == {corrupt, missing, changed}
        assert len(s.take(rows)) == rows and s.epoch == 1  # and the source goes on


def _read_until(s, end, chunk=16):
    """Keys and positions of the rows at positions [s.position, end)."""
    ks, ps = [], []
    while s.position < end:
        r = s.take(chunk)
        mine = r.positions < end
        ks.append(r.keys[mine])
        ps.append(r.positions[mine])
        if not mine.all():
            s.seek(end)
    return (np.concatenate(ks), np.concatenate(ps)) if ks else (np.zeros(0, np.int64), np.zeros(0, np.int64))


@pytest.mark.parametrize("case", range(8))
def test_a_source_read_block_by_block_is_repartitioned_exactly(corpus, case):
    """N -> M partitions at random cursors (consumed slots above them too): the new partitions' prefixes read every
    row of the unfinished epochs the old ones did not, once; then their own epochs cover the source; a seek or a
    state_dict anywhere in a prefix resumes exactly."""
    rng = np.random.default_rng(case)
    N, M = (int(x) for x in rng.integers(1, 4, size=2))
    src = _spec(corpus)
    with open_stream(src, seed=3, cache_dir=None) as whole:
        all_rows = set(key_row(whole.take(480).keys).tolist())
    old = [open_stream(src, seed=3, partition=i, num_partitions=N, cache_dir=None) for i in range(N)]
    consumed, cursors = [], []
    for s in old:
        low = s.position + int(rng.integers(0, int(s.epoch_rows(0, s.partition, N) * 1.7)))
        consumed.append(_read_until(s, low)[0])
        k2, p2 = _read_until(s, low + 2 * MAX_BLOCK_SLOTS // 3, chunk=7)
        took = rng.random(len(p2)) < 0.4
        consumed.append(k2[took])
        cursors.append((low, [int(p) for p in p2[took]]))
    new = repartition([s.layout() for s in old], cursors, M, old[0].epoch_rows, source="big")
    E = new[0].epoch
    got = list(consumed)
    streams = [open_stream(src, seed=3, partition=k, num_partitions=M, cache_dir=None) for k in range(M)]
    for s, lay in zip(streams, new):
        s.set_layout(lay)
        got.append(_read_until(s, lay.prefix_rows)[0])
    keys = np.concatenate(got)
    c = Counter(zip(key_epoch(keys).tolist(), key_row(keys).tolist()))
    assert not [k for k, v in c.items() if v > 1], "read twice"
    assert set(c) == {(e, r) for e in range(E) for r in all_rows}
    own = [_read_until(s, lay.prefix_rows + s.epoch_rows(E, s.partition, M))[0] for s, lay in zip(streams, new)]
    own_keys = np.concatenate(own)
    assert (key_epoch(own_keys) == E).all() and sorted(key_row(own_keys).tolist()) == sorted(all_rows)
    # seek / state_dict anywhere in the longest prefix
    lay = max(new, key=lambda x: x.prefix_rows)
    with open_stream(src, seed=3, partition=lay.partition, num_partitions=M, cache_dir=None) as ref:
        ref.set_layout(lay)
        full_k, full_p = _read_until(ref, lay.prefix_rows + MAX_BLOCK_SLOTS)
    for at in sorted({0, len(full_p) // 2, max(0, len(full_p) - 3), *rng.integers(0, max(1, len(full_p)), 3).tolist()}):
        if at >= len(full_p):
            continue
        with open_stream(src, seed=3, partition=lay.partition, num_partitions=M, cache_dir=None) as s:
            s.set_layout(lay)
            s.seek(int(full_p[at]))
            st = s.state_dict()
            k, p = _read_until(s, lay.prefix_rows + MAX_BLOCK_SLOTS)
            assert k.tolist() == full_k[at:].tolist() and p.tolist() == full_p[at:].tolist()
        with open_stream(src, seed=3, partition=lay.partition, num_partitions=M, cache_dir=None) as s2:
            s2.load_state_dict(st)
            assert s2.layout() == lay
            assert _read_until(s2, lay.prefix_rows + MAX_BLOCK_SLOTS)[0].tolist() == full_k[at:].tolist()
    for s in old + streams:
        s.close()
