"""Packing within buckets of a metadata column (sources[].pack_by, loader.buckets): adjacent rows of one value are
one document, in file order, the same after any seek; the planner packs them with its guarantees and resumes
exactly; bad specs name the field. docs/mixtures.md."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.loader.buckets import BucketJoiner
from mixplane.loader.split import row_of, window_pos
from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.planner.core import StepPlanner
from mixplane.planner.windows import ReplicaWindow
from mixplane.replay import ReplayLoaders
from mixplane.samples import key_epoch, key_row, make_key
from mixplane.spec import SourceSpec, SpecError, pack_bucket, parse_spec
from tests.resume_harness import Resumable, check_save_load_state


def test_joiner_ends_a_bucket_at_a_new_value_a_null_a_new_pass_and_its_token_bound():
    j = BucketJoiner(max_tokens=10)
    rows = [("a", 0, 3), ("a", 0, 3), ("b", 0, 2), (None, 0, 1), (None, 0, 1), ("b", 0, 1), ("b", 1, 1),
            ("c", 1, 6), ("c", 1, 4), ("c", 1, 1), ("d", 1, 1)]
    out = []
    for r, (v, e, n) in enumerate(rows):
        g = j.push(r, int(make_key(e, r)), v, np.full(n, r, np.int32))
        if g is not None:
            out.append((g.row, g.rows, g.joined().tolist()))
    assert out == [(0, 2, [0, 0, 0, 1, 1, 1]), (2, 1, [2, 2]), (3, 1, [3]), (4, 1, [4]), (5, 1, [5]), (6, 1, [6]),
                   (7, 2, [7] * 6 + [8] * 4), (9, 1, [9])]
    assert j.open is not None and j.open.row == 10  # complete only when the next row comes
    j.reset()
    assert j.open is None


def repos(tmp_path, n_repos=12, seed=5):
    """A depsorted-like token source: rows by repository (files in order), some repositories across pages."""
    rng = np.random.default_rng(seed)
    ids, repo, want = [], [], {}
    for r in range(n_repos):
        files = [rng.integers(3, 1000, int(rng.integers(5, 90)), dtype=np.int32) for _ in range(int(rng.integers(1, 7)))]
        want[f"r{r}"] = np.concatenate(files).tolist()
        ids += files
        repo += [f"r{r}"] * len(files)
    pq.write_table(pa.table({"ids": pa.array(ids, pa.list_(pa.int32())), "repo": pa.array(repo, pa.string())}),
                   tmp_path / "repos.parquet", row_group_size=7, data_page_size=256, write_page_index=True)
    return str(tmp_path), repo, want


def source(d: str) -> SourceSpec:
    return SourceSpec(name="code", uri=d, kind="tokens", columns=["ids", "repo"], shuffle="sequential",
                      append_eos=False, pack_by="repo")


def test_a_bucket_is_its_rows_concatenated_in_file_order_in_every_pass(tmp_path):
    d, repo, want = repos(tmp_path)
    src = source(d)
    w = LoaderWindow(open_stream(src, seed=0, cache_dir=None), make_transform(src), (4, 100, 8), bucket=pack_bucket(src))
    got = []
    while len(got) < 2 * len(want) + 1:
        a = w.fill()
        for p, k in zip(a.pos.tolist(), a.key.tolist()):
            got.append((p, k, w.span(p, 0, len(w.buffer[p].tokens) - 1)[1].tolist()))
            w.retire(p)
    first_rows = [i for i in range(len(repo)) if i == 0 or repo[i] != repo[i - 1]]
    for e in range(2):
        chunk = got[e * len(want):(e + 1) * len(want)]
        assert [row_of(p) for p, _, _ in chunk] == [e * len(repo) + r for r in first_rows]
        assert [p for p, _, _ in chunk] == [window_pos(row_of(p), 0) for p, _, _ in chunk]
        assert [int(key_epoch(k)) for _, k, _ in chunk] == [e] * len(want)
        assert [int(key_row(k)) for _, k, _ in chunk] == first_rows
        assert [t for _, _, t in chunk] == [want[f"r{r}"] for r in range(len(want))]


class Pair:
    """A bucketed source's loader window and the planner's view of it, consuming halves of some buckets, so that
    cursors fall inside buckets (as test_loader_split_docs.SplitPair)."""

    def __init__(self, d: str):
        src = source(d)
        self.stream = open_stream(src, seed=3, cache_dir=None)
        bounds = (3, 120, 6)
        self.lw = LoaderWindow(self.stream, make_transform(src), bounds, bucket=pack_bucket(src))
        self.rw = ReplicaWindow(0, 0, *bounds)

    def step(self):
        a = self.lw.fill()
        new = a.pos >= self.rw.next_pos
        self.rw.add(a.pos[new], a.key[new], a.tokens[new], a.patches[new])
        spans = []
        for i in range(min(3, len(self.rw))):
            p, left = int(self.rw.pos[i]), int(self.rw.tokens[i] - self.rw.done[i])
            n = (left + 1) // 2 if (i > 0 and row_of(p) % 3 == 1) else left
            key, toks = self.lw.span(p, int(self.rw.done[i]), n)
            spans.append((p, key, int(self.rw.done[i]), n, toks.tolist()))
            self.rw.done[i] += n
        for p in self.rw.compact().tolist():
            self.lw.retire(int(p))
        return spans

    def load(self, cur):
        self.rw.restore(cur)
        self.lw.seek(cur)


def test_resume_from_any_window_cursor_is_exact(tmp_path):
    d, _, _ = repos(tmp_path)
    ref = check_save_load_state(
        Resumable(make=lambda: Pair(d), next_item=Pair.step, save=lambda x: x.rw.cursor(), load=Pair.load,
                  close=lambda x: x.stream.close()),
        total=24, midpoints=[1, 3, 8, 13, 19])
    assert any(s[2] > 0 for item in ref for s in item), "no bucket was consumed in halves"


def spec_doc(d: str, **source) -> dict:
    return {"name": "pack", "sources": [{"name": "code", "uri": d, "kind": "tokens", "columns": ["ids", "repo"],
                                         "shuffle": "sequential", "append_eos": False, "pack_by": "repo", **source},
                                        {"name": "web", "uri": d, "kind": "tokens", "columns": ["ids"], "shuffle": "row"}],
            "mixture": {"weights": {"code": 0.6, "web": 0.4}, "seed": 4},
            "batch": {"sequences": 4, "seq_len": 64, "microbatches": 1},
            "topology": {"modules": {"backbone": {"dp": 2}}}, "runtime": {"window": 6, "metrics": False}}


def test_the_planner_packs_buckets_in_order_and_resumes_exactly(tmp_path):
    d, repo, want = repos(tmp_path)
    spec = parse_spec(spec_doc(d))
    concat = {r: np.array(t) for r, t in want.items()}
    first_row = {}

    class Run:
        def __init__(self):
            self.planner, self.loaders = StepPlanner(spec), ReplayLoaders()

        def step(self):
            self.loaders(self.planner)
            pc = self.planner.plan().pieces
            return tuple(getattr(pc, f).tolist() for f in ("bin", "source", "key", "start", "length", "replica", "pos"))

    ref = check_save_load_state(
        Resumable(make=Run, next_item=Run.step, save=lambda r: r.planner.cursor(), load=lambda r, c: r.planner.restore(c),
                  close=lambda r: r.loaders.close()),
        total=16, midpoints=[1, 5, 9, 13])
    # every piece of `code` is a contiguous span of one bucket; each bucket's pieces cover it in order, no gap
    seen: dict[int, list[tuple[int, int]]] = {}
    for item in ref:
        for s, k, start, n in zip(item[1], item[2], item[3], item[4]):
            if s == 0:
                seen.setdefault(k, []).append((start, n))
    for i, r in enumerate(repo):
        if i == 0 or repo[i] != repo[i - 1]:
            first_row[int(make_key(0, i))] = r
    assert len(seen) >= 4
    for k, spans in seen.items():
        assert int(key_row(k)) in first_row, f"key {k} is not the first row of a bucket"
        spans.sort()
        assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    whole = [k for k, spans in seen.items() if spans[-1][0] + spans[-1][1] == len(concat[first_row[int(key_row(k))]])]
    assert len(whole) >= 3


@pytest.mark.parametrize("source, batch, path", [
    ({"pack_by": "lang"}, {}, "sources[0].pack_by"),
    ({"pack_by": "ids"}, {}, "sources[0].pack_by"),
    ({"shuffle": "page"}, {}, "sources[0].shuffle"),
    ({"live": True, "replicas": 1}, {}, "sources[0].live"),
    ({"overlong_doc": "split"}, {}, "sources[0].overlong_doc"),
    ({}, {"overlong": "truncate"}, "batch.overlong"),
])
def test_bad_pack_by_specs_name_the_field(source, batch, path):
    doc = spec_doc("/x/d", **source)
    doc["batch"].update(batch)
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    assert path in [p.path for p in e.value.problems], e.value
