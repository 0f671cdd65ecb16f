"""Bounded documents (issue 10 item 3): sources[].max_doc_bytes / max_doc_tokens / overlong_doc are
applied before a text is tokenized; over-long documents are cut to a bounded first piece or dropped,
and counted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.loader import transforms as tr
from mixplane.loader.stream import RawSamples, open_stream
from mixplane.loader.bounds import cut_point
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.spec import SourceSpec, SpecError, parse_spec

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "hello", "world"]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 5, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    p = str(tmp_path_factory.mktemp("tok") / "tok.json")
    tok.save(p)
    return p


def words(n: int, seed: int = 0) -> str:
    return " ".join(np.random.default_rng(seed).choice(WORDS, n).tolist())


def raw(texts, typ=pa.string()):
    n = len(texts)
    return RawSamples(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64), {"text": pa.array(texts, typ)})


def encode(tok_path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tok_path).encode(text, add_special_tokens=False).ids


def test_cut_point_ends_before_a_space_or_on_a_character_boundary():
    assert cut_point(b"alpha beta gamma", 12) == 10  # "alpha beta" | " gamma"
    assert cut_point(b"short", 12) == 5
    data = ("é" * 10).encode()  # two bytes each, no space
    c = cut_point(data, 7)
    assert c == 6 and data[:c].decode() == "é" * 3


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.binary()])
def test_long_text_keeps_its_first_piece_and_the_rest_is_untouched(tok_path, typ):
    long = words(400, 1)
    texts = ["alpha beta", long, None, "gamma"]
    f = make_transform(SourceSpec(name="t", uri="x", tokenizer=tok_path, max_doc_bytes=100))
    out = f(raw(texts, typ))
    eos = 1  # "<|endoftext|>" is the second special token
    assert out.overlong.tolist() == [False, True, False, False]
    kept = long.encode()[: cut_point(long.encode(), 100)].decode()
    assert len(kept.encode()) <= 100 and long.startswith(kept) and long[len(kept)] == " "
    assert out.tokens[1].tolist() == encode(tok_path, kept) + [eos]  # the same tokens the whole text starts with
    assert encode(tok_path, long)[: len(out.tokens[1]) - 1] == out.tokens[1].tolist()[:-1]
    assert out.tokens[0].tolist() == encode(tok_path, "alpha beta") + [eos]
    assert out.tokens[3].tolist() == encode(tok_path, "gamma") + [eos]


def test_long_text_dropped_under_drop_and_counted_by_the_window(tok_path, tmp_path):
    texts = [words(5, i) for i in range(200)]  # reads stay inside epoch 0
    texts[17] = words(3000, 99)  # ~18 KB
    pq.write_table(pa.table({"text": texts}), tmp_path / "s.parquet")
    for policy, dropped, cut in (("drop", 1, 0), ("truncate", 0, 1)):
        src = SourceSpec(name="t", uri=str(tmp_path), tokenizer=tok_path, shuffle="sequential", max_doc_bytes=1000,
                         overlong_doc=policy)
        w = LoaderWindow(open_stream(src, seed=0, cache_dir=None), make_transform(src), (30, 10_000, 30))
        a = w.fill()
        assert w.dropped_overlong == dropped and w.cut_overlong == cut
        assert len(a) == 30 and a.pos.tolist() == [p for p in range(31) if policy != "drop" or p != 17][:30]
        if policy == "truncate":
            assert 100 < int(a.tokens[17]) <= 1000 // 5 + 1  # ~1000 bytes of 5-6 byte words, plus EOS
        assert int(a.tokens.max()) <= 1000  # no document past its bound reached the window


def test_token_cap_for_tokens_and_text_sources(tok_path):
    ids = [list(range(5)), list(range(50)), []]
    r = RawSamples(np.arange(3, dtype=np.int64), np.arange(3, dtype=np.int64),
                   {"ids": pa.array(ids, pa.list_(pa.int32()))})
    for policy, want in (("truncate", [5, 16, 0]), ("drop", [5, 0, 0])):
        f = make_transform(SourceSpec(name="t", uri="x", kind="tokens", columns=["ids"], max_doc_tokens=16,
                                      overlong_doc=policy))
        out = f(r)
        assert out.ntokens.tolist() == want and out.overlong.tolist() == [False, True, False]
        if policy == "truncate":
            assert out.tokens[1].tolist() == list(range(16))  # the first max_doc_tokens, in order
        assert out.tokens[0].tolist() == list(range(5))
    f = make_transform(SourceSpec(name="t", uri="x", tokenizer=tok_path, max_doc_tokens=8))
    out = f(raw(["alpha", words(30, 3)]))
    assert out.ntokens.tolist() == [2, 8] and out.overlong.tolist() == [False, True]
    assert out.tokens[1].tolist() == encode(tok_path, words(30, 3))[:8]


def test_text_over_one_tokenizer_call_is_encoded_in_pieces_to_the_same_ids(tok_path, monkeypatch):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    monkeypatch.setattr(tr, "ENCODE_BATCH_CHARS", 300)
    texts = ["beta", words(500, 4), "", words(80, 5)]
    calls = []
    real = tok.encode_batch_fast

    class Spy:
        def encode_batch_fast(self, batch, add_special_tokens=False):
            calls.append(max(len(t) for t in batch))
            return real(batch, add_special_tokens=add_special_tokens)

    rg = tr._encode(Spy(), texts)
    assert [rg[i].tolist() for i in range(4)] == [tok.encode(t, add_special_tokens=False).ids for t in texts]
    assert max(calls) <= 300  # no call saw more than one piece's worth of text


def test_spec_bounds_have_safe_defaults_and_are_validated():
    s = SourceSpec(name="t", uri="x")
    assert s.max_doc_bytes < 64 << 20 and s.max_doc_tokens < 64 << 20 and s.overlong_doc == "truncate"
    doc = {"name": "t", "sources": [{"name": "a", "uri": "/x", "kind": "tokens", "max_doc_tokens": 0,
                                     "overlong_doc": "split-ish"}],
           "batch": {"sequences": 1, "seq_len": 8}}
    with pytest.raises(SpecError) as e:
        parse_spec(doc)
    msg = str(e.value)
    assert "sources[0].max_doc_tokens" in msg and "sources[0].overlong_doc" in msg


def test_stream_keeps_only_the_bound_of_a_giant_text_and_the_transform_result_is_unchanged(tok_path, tmp_path):
    texts = [words(5, i) for i in range(50)]
    texts[7] = "δ" + words(4000, 7)  # ~24 KB, a two-byte character first
    pq.write_table(pa.table({"text": texts}), tmp_path / "s.parquet")
    for policy in ("truncate", "drop"):
        src = SourceSpec(name="t", uri=str(tmp_path), tokenizer=tok_path, shuffle="sequential", max_doc_bytes=999,
                         overlong_doc=policy)
        r = open_stream(src, seed=0, cache_dir=None).take(50)
        got = r.columns["text"].to_pylist()
        assert 999 < len(got[7].encode()) <= 999 + 4 and texts[7].startswith(got[7])  # cut on load, past the bound
        assert got[:7] + got[8:] == texts[:7] + texts[8:]
        f = make_transform(src)
        whole = f(raw(texts))  # the transform on the uncut column
        out = f(r)
        assert out.overlong.tolist() == whole.overlong.tolist() == [i == 7 for i in range(50)]
        assert [out.tokens[i].tolist() for i in range(50)] == [whole.tokens[i].tolist() for i in range(50)]


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string(), pa.binary(), pa.large_binary()])
def test_value_lengths_and_bounds_on_sliced_arrays_with_nulls(typ):
    import pyarrow.compute as pc

    from mixplane.loader.bounds import bound_texts, value_lengths

    vals = ["a", None, "bb b" * 50, "", "ccc", None, "d" * 300]
    arr = pa.array([None if v is None else v.encode() for v in vals], pa.binary()).cast(typ).slice(1, 6)
    assert value_lengths(arr).tolist() == pc.binary_length(arr).fill_null(0).to_pylist()
    out, over = bound_texts(arr, 100, "truncate")
    assert over.tolist() == [False, True, False, False, False, True] and out.null_count == 2
    assert len(out[1].as_py()) <= 100 and out[5].as_py() == out[5].as_py()[:100]
    assert out[2].as_py() == arr[2].as_py() and out[3].as_py() == arr[3].as_py()
