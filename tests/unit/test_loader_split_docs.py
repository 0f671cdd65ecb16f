"""overlong_doc: split (issue 10 item 3): an over-long document is delivered whole, as consecutive
bounded pieces in order, each tokenized only when the window needs it; resume / seek / replay
land exactly inside a document."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.resume_harness import Resumable, check_save_load_state
from mixplane.loader import transforms as tr
from mixplane.loader.split import (
    SPLIT_SLOTS, PendingDoc, piece_bounds, piece_end, piece_key, piece_limit, piece_of, row_of, window_pos,
)
from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.planner.core import StepPlanner
from mixplane.planner.windows import ReplicaWindow
from mixplane.replay import ReplayLoaders
from mixplane.spec import SourceSpec, parse_spec

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "hello", "world", "été", "naïve"]
EOS = 1
MAX_BYTES = 1000
GIANT = (3, 11)  # rows holding a giant document


@pytest.fixture(autouse=True)
def _no_index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    p = str(tmp_path_factory.mktemp("tok") / "tok.json")
    tok.save(p)
    return p


def words(n: int, seed: int) -> str:
    return " ".join(np.random.default_rng(seed).choice(WORDS, n).tolist())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    texts = [words(5 + i % 7, i) for i in range(40)]
    for r in GIANT:
        texts[r] = words(2500 + 300 * r, 100 + r)  # ~15-20 KB: 15-20 pieces of <= 1000 bytes
    d = tmp_path_factory.mktemp("split")
    pq.write_table(pa.table({"text": texts}), d / "s.parquet", row_group_size=40)
    return str(d), texts


def encode(tok_path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tok_path).encode(text, add_special_tokens=False).ids


def source(d: str, tok_path: str, policy: str = "split", **kw) -> SourceSpec:
    return SourceSpec(name="t", uri=d, tokenizer=tok_path, shuffle="sequential", max_doc_bytes=MAX_BYTES,
                      overlong_doc=policy, **kw)


def drain(w: LoaderWindow, rows: int) -> list[tuple[int, int, list[int]]]:
    """Every sample of the first ``rows`` stream rows, in announcement order, consumed whole."""
    row_of = globals()["row_of"] if w.splitter is not None else (lambda p: p)
    out = []
    while True:
        a = w.fill()
        for p, k in zip(a.pos.tolist(), a.key.tolist()):
            n = len(w.buffer[p].tokens)
            out.append((p, k, w.span(p, 0, n - 1)[1].tolist()))
            w.retire(p)
        if len(a) == 0 or row_of(int(a.pos[-1])) >= rows:
            return [x for x in out if row_of(x[0]) < rows]


def test_piece_bounds_are_the_prefix_rule():
    data = ("alpha beta été " * 200).encode()
    for limit in (1, 2, 7, 64, 1000):
        b = piece_bounds(data, limit)
        assert b[0][0] == 0 and b[-1][1] == len(data)
        assert all(e0 == s1 for (_, e0), (s1, _) in zip(b, b[1:]))  # consecutive, nothing lost
        assert all(0 < e - s <= max(limit, 2) for s, e in b)  # bounded, never empty (é is 2 bytes)
        for s, e in b:
            data[s:e].decode()  # every piece is whole characters
        if limit >= 64:
            assert all(data[e:e + 1] == b" " for _, e in b[:-1])  # cut before a space
    assert piece_end(b"abc", 0, 10) == 3
    # piece size: 64 KiB, larger for a document that would need more than SPLIT_SLOTS pieces, <= max_doc_bytes
    assert piece_limit(200 << 10, 64 << 10, 1 << 20) == 64 << 10
    assert piece_limit(1 << 30, 64 << 10, 1 << 20) == (1 << 30) // SPLIT_SLOTS
    assert piece_limit(8 << 30, 64 << 10, 1 << 20) == 1 << 20  # beyond SPLIT_SLOTS x max_doc_bytes: the rest is cut
    assert piece_limit(5000, 64 << 10, 1000) == 1000
    assert row_of(window_pos(12, 7)) == 12 and piece_of(window_pos(12, 7)) == 7
    keys = {piece_key(k, p) for k in (0, 5, (3 << 40) | 9) for p in range(4)}
    assert len(keys) == 12  # every piece of every row is its own sample


def test_split_delivers_every_piece_in_order_and_the_pieces_concatenate_to_the_document(corpus, tok_path):
    d, texts = corpus
    src = source(d, tok_path)
    w = LoaderWindow(open_stream(src, seed=0, cache_dir=None), make_transform(src), (4, 200, 8))
    got = drain(w, len(texts))
    by_row: dict[int, list] = {}
    for p, k, toks in got:
        by_row.setdefault(row_of(p), []).append((piece_of(p), k, toks))
    assert sorted(by_row) == list(range(len(texts)))  # every row delivered, none twice
    assert [row_of(p) for p, _, _ in got] == sorted(row_of(p) for p, _, _ in got)  # a document's pieces are consecutive
    for r, text in enumerate(texts):
        pieces = by_row[r]
        if r not in GIANT:
            assert [(pc, k) for pc, k, _ in pieces] == [(0, r)]
            assert pieces[0][2] == encode(tok_path, text) + [EOS]
            continue
        data = text.encode()
        bounds = piece_bounds(data, MAX_BYTES)
        assert len(bounds) > 10
        assert [pc for pc, _, _ in pieces] == list(range(len(bounds)))
        assert [k for _, k, _ in pieces] == [piece_key(r, i) for i in range(len(bounds))]
        # the prefix rule: each piece tokenized on its own, EOS after the last one only ...
        want = [encode(tok_path, data[s:e].decode()) for s, e in bounds]
        want[-1] = want[-1] + [EOS]
        assert [toks for _, _, toks in pieces] == want
        # ... and, for a tokenizer that splits at whitespace, exactly the whole document's tokens
        assert sum((toks for _, _, toks in pieces), []) == encode(tok_path, text) + [EOS]
        assert all(len(t) <= src.max_doc_tokens for _, _, t in pieces)
    assert w.split_overlong >= len(GIANT) and w.cut_overlong == 0 and w.dropped_overlong == 0  # (reads run into epoch 1)


def test_split_tokenizes_one_piece_at_a_time(corpus, tok_path, monkeypatch):
    """No tokenizer call ever sees more than one piece, and a window that needs two pieces of a giant
    document has made only about that many: the rest waits as raw bytes."""
    d, texts = corpus
    seen: list[int] = []
    real = tr.load_tokenizer

    class Spy:
        def __init__(self, tok):
            self.tok = tok

        def encode_batch_fast(self, batch, **kw):
            seen.extend(len(t.encode()) for t in batch)
            return self.tok.encode_batch_fast(batch, **kw)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    monkeypatch.setattr(tr, "load_tokenizer", lambda p: Spy(real(p)))
    src = source(d, tok_path)
    stream = open_stream(src, seed=0, cache_dir=None)
    stream.seek(GIANT[0])
    w = LoaderWindow(stream, make_transform(src), (2, 1, 2))
    a = w.fill()
    assert [piece_of(p) for p in a.pos.tolist()] == [0, 1] and all(row_of(p) == GIANT[0] for p in a.pos.tolist())
    assert max(seen) <= MAX_BYTES
    pending = [b for b in w.staged if isinstance(b, PendingDoc)]
    # row 3: pieces 2.. not tokenized yet; row 11 (read in the same take): only its first piece
    assert [(x.row_pos, x.piece) for x in pending] == [(GIANT[0], 2), (GIANT[1], 1)]
    assert pending[0].offset < len(texts[GIANT[0]].encode()) // 4


def test_truncate_and_drop_are_unchanged_and_split_agrees_on_the_first_piece(corpus, tok_path):
    d, texts = corpus
    runs = {}
    for policy in ("truncate", "split"):
        src = source(d, tok_path, policy)
        w = LoaderWindow(open_stream(src, seed=0, cache_dir=None), make_transform(src), (4, 200, 8))
        runs[policy] = [(row_of(p) if policy == "split" else p, k, t) for p, k, t in drain(w, len(texts))
                        if policy != "split" or piece_of(p) == 0]
    split_first = runs["split"]
    trunc = runs["truncate"]
    assert [(p, k) for p, k, _ in trunc] == [(p, k) for p, k, _ in split_first]
    for (p, _, a), (_, _, b) in zip(trunc, split_first):
        assert a == b if p not in GIANT else a[:-1] == b  # truncate ends the cut document with its EOS


def test_split_token_rows(tmp_path):
    rows = [list(range(5)), list(range(100, 1100)), list(range(7))]
    pq.write_table(pa.table({"ids": pa.array(rows, pa.list_(pa.int32()))}), tmp_path / "t.parquet")
    src = SourceSpec(name="k", uri=str(tmp_path), kind="tokens", columns=["ids"], shuffle="sequential",
                     max_doc_tokens=128, overlong_doc="split")
    w = LoaderWindow(open_stream(src, seed=0, cache_dir=None), make_transform(src), (4, 100, 8))
    got = drain(w, 3)
    assert [(row_of(p), piece_of(p)) for p, _, _ in got] == [(0, 0)] + [(1, i) for i in range(8)] + [(2, 0)]
    assert sum((t for p, _, t in got if row_of(p) == 1), []) == rows[1]
    assert all(len(t) <= 128 for _, _, t in got)


class SplitPair:
    """A split source's loader window and the planner's view of it (as test_resume_harness.WindowPair):
    whole samples and halves of some, so cursors fall inside documents and inside pieces."""

    def __init__(self, d: str, tok_path: str):
        src = source(d, tok_path)
        self.stream = open_stream(src, seed=3, cache_dir=None)
        bounds = (3, 120, 6)
        self.lw = LoaderWindow(self.stream, make_transform(src), bounds)
        self.rw = ReplicaWindow(0, 0, *bounds)

    def step(self):
        a = self.lw.fill()
        new = a.pos >= self.rw.next_pos
        self.rw.add(a.pos[new], a.key[new], a.tokens[new], a.patches[new])
        spans = []
        for i in range(min(3, len(self.rw))):
            p, left = int(self.rw.pos[i]), int(self.rw.tokens[i] - self.rw.done[i])
            n = (left + 1) // 2 if (i > 0 and p % 3 == 1) else left
            key, toks = self.lw.span(p, int(self.rw.done[i]), n)
            spans.append((p, key, int(self.rw.done[i]), n, toks.tolist()))
            self.rw.done[i] += n
        for p in self.rw.compact().tolist():
            self.lw.retire(int(p))
        return spans

    def save(self):
        return self.rw.cursor()

    def load(self, cur):
        self.rw.restore(cur)
        self.lw.seek(cur)


def test_resume_inside_a_split_document_is_exact(corpus, tok_path):
    d, texts = corpus
    mids = [2, 9, 17, 30, 45, 70]
    inside = []  # cursors that fall inside a giant document (past its first piece)
    orig_save = SplitPair.save

    def save(pair):
        cur = orig_save(pair)
        inside.append(row_of(cur["low"]) in GIANT and piece_of(cur["low"]) > 0)
        return cur

    ref = check_save_load_state(
        Resumable(make=lambda: SplitPair(d, tok_path), next_item=SplitPair.step, save=save, load=SplitPair.load,
                  close=lambda w: w.stream.close()),
        total=90, midpoints=mids)
    assert any(inside), "no midpoint fell inside a split document"
    assert any(piece_of(s[0]) > 5 for item in ref for s in item)  # far into a giant document


def test_planner_over_a_split_source_resumes_exactly(corpus, tok_path):
    """The planner's own cursor over real loader windows (offline replay): split pieces through packing,
    a phase change and a restore mid-document."""
    d, _ = corpus
    spec = parse_spec({
        "name": "split",
        "sources": [{"name": "t", "uri": d, "tokenizer": tok_path, "shuffle": "sequential", "max_doc_bytes": MAX_BYTES,
                     "overlong_doc": "split"},
                    {"name": "u", "uri": d, "tokenizer": tok_path, "shuffle": "row"}],
        "mixture": {"weights": {"t": 0.7, "u": 0.3}, "seed": 4, "phases": [{"start_step": 10, "weights": {"t": 0.5}}]},
        "batch": {"sequences": 4, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}},
        "runtime": {"window": 6, "metrics": False},
    })

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
        total=30, midpoints=[1, 7, 12, 21])
    t_pos = [p for item in ref for s, p in zip(item[1], item[6]) if s == 0]
    assert any(piece_of(p) > 0 for p in t_pos), "the planner never packed a later piece"
    assert max(t_pos) < 40 * SPLIT_SLOTS


def test_document_bounds_cannot_be_lifted_past_what_a_loader_survives(corpus, tok_path):
    from mixplane.spec import MAX_DOC_BYTES, SpecError

    d, _ = corpus
    doc = {"name": "b", "sources": [{"name": "t", "uri": d, "tokenizer": tok_path, "max_doc_bytes": MAX_DOC_BYTES + 1,
                                     "max_doc_tokens": 1 << 40}],
           "mixture": {"weights": {"t": 1.0}}, "batch": {"sequences": 2, "seq_len": 64}}
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    msg = str(e.value)
    assert "sources[0].max_doc_bytes" in msg and "67108864" in msg and "sources[0].max_doc_tokens" in msg
