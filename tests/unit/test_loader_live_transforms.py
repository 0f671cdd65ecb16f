"""Live sources join new files and block when dry; transforms turn rows into tokens and patches."""

import io
import logging
import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.unit.loader_testdata import text_table
from mixplane.loader.stream import RawSamples, open_stream
from mixplane.loader.transforms import TransformedSamples, append_value, concat_ragged, make_transform, target_size
from mixplane.samples import Ragged, key_row
from mixplane.spec import ImageSpec, SourceSpec


@pytest.fixture(autouse=True)
def _index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


def _write(d, k, n, start):
    t = text_table(n, k, start)
    tmp = os.path.join(d, f".tmp-{k}")
    pq.write_table(t, tmp, data_page_size=1024, write_batch_size=50)
    os.replace(tmp, os.path.join(d, f"part-{k:02d}.parquet"))  # appear atomically, as a writer should
    return t


def test_live_source_joins_new_files_and_blocks_when_dry(tmp_path, caplog):
    d = str(tmp_path)
    _write(d, 5, 300, 0)
    src = SourceSpec(name="live", uri=os.path.join(d, "*.parquet"), columns=["text", "row"], kind="text", live=True)
    s = open_stream(src, seed=0, buffer_rows=100, poll_s=0.05, status_every_s=0.0)
    r = s.take(300)
    assert sorted(r.columns["row"].to_pylist()) == list(range(300))
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        r = s.take(10, timeout=0.3)
    assert len(r) == 0 and time.monotonic() - t0 >= 0.25
    assert s.dry and s.status()["dry"] and "is dry" in s.status_line()
    assert any("is dry" in m for m in caplog.messages)
    # a new file (sorting *before* the first) joins without a restart; each row still comes once
    _write(d, 1, 200, 300)
    r = s.take(200, timeout=5)
    assert sorted(r.columns["row"].to_pylist()) == list(range(300, 500))
    assert not s.dry
    assert sorted(key_row(r.keys).tolist()) == list(range(300, 500))
    # resume from state: same segments, same continuation
    st = s.state_dict()
    _write(d, 2, 100, 500)
    a = s.take(100, timeout=5)
    s2 = open_stream(src, seed=0, buffer_rows=100, poll_s=0.05)
    s2.load_state_dict(st)
    b = s2.take(100, timeout=5)
    assert (a.keys == b.keys).all() and sorted(a.columns["row"].to_pylist()) == list(range(500, 600))


def test_live_source_may_start_empty(tmp_path):
    d = str(tmp_path)
    src = SourceSpec(name="live", uri=os.path.join(d, "*.parquet"), columns=["text"], kind="text", live=True)
    s = open_stream(src, seed=0, poll_s=0.05)
    assert len(s.take(5, timeout=0.1)) == 0 and s.dry
    _write(d, 0, 50, 0)
    assert len(s.take(50, timeout=5)) == 50


class FakeClock:
    """Stands in for the stream module's `time`: sleeping advances the clock at once."""

    def __init__(self):
        self.now = 1000.0
        self.slept = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, dt):
        self.now += dt
        self.slept += dt


@pytest.fixture
def clock_and_listings(monkeypatch):
    import mixplane.loader.stream as stream_mod

    clock = FakeClock()
    listings = []
    real = stream_mod.list_source

    def listing(source):
        listings.append(clock.now)
        return real(source)

    monkeypatch.setattr(stream_mod, "time", clock)
    monkeypatch.setattr(stream_mod, "list_source", listing)
    return clock, listings


def test_dry_live_source_lists_storage_at_most_once_per_poll_interval(tmp_path, clock_and_listings):
    clock, listings = clock_and_listings
    d = str(tmp_path)
    _write(d, 0, 40, 0)
    src = SourceSpec(name="live", uri=os.path.join(d, "*.parquet"), columns=["text", "row"], kind="text", live=True)
    s = open_stream(src, seed=0, poll_s=2.0, status_every_s=1e9)
    assert len(s.take(40)) == 40 and len(listings) == 1  # the listing at open
    # a loader's poll loop on the dry source: take(timeout=0.2) every 50 ms for 10 s
    takes = 200
    for _ in range(takes):
        assert len(s.take(10, timeout=0.2)) == 0
        clock.now += 0.05
    assert s.dry
    gaps = np.diff(listings)
    assert len(listings) <= 1 + 10 / 2.0 + 1 and (gaps >= 2.0).all()  # once per poll_s, not twice per take
    # a take sleeps only when a listing falls due within its timeout; otherwise it returns at once
    assert clock.slept <= 0.2 * len(listings)
    assert s.seconds_to_rescan() <= 2.0
    # new files are found by the next listing that falls due
    _write(d, 1, 30, 40)
    clock.now += s.seconds_to_rescan()
    r = s.take(30, timeout=0.2)
    assert sorted(r.columns["row"].to_pylist()) == list(range(40, 70)) and not s.dry


def test_loader_window_waits_on_a_dry_live_source_instead_of_asking_again(tmp_path, clock_and_listings):
    from mixplane.loader.window import LoaderWindow

    clock, listings = clock_and_listings
    d = str(tmp_path)
    _write(d, 0, 20, 0)
    src = SourceSpec(name="live", uri=os.path.join(d, "*.parquet"), columns=["text", "row"], kind="text", live=True)
    stream = open_stream(src, seed=0, poll_s=2.0, status_every_s=1e9)

    def transform(raw):
        n = np.full(len(raw), 5, np.int32)
        return TransformedSamples(Ragged(np.zeros(5 * len(raw), np.int32), np.arange(len(raw) + 1) * 5), None, n,
                                  np.zeros(len(raw), np.int32))

    w = LoaderWindow(stream, transform, (64, 0, 64), read_timeout=0.2)
    w.seek({"low": 0})
    assert len(w.fill()) == 20 and w.stalled and not w.complete
    # dry, next listing not due: the window has nothing to do (the poll loop sleeps on its sockets)
    assert w.waiting and w.full and not w.wants_read_ahead
    n = len(listings)
    clock.now += 1.0
    assert w.full and len(listings) == n
    clock.now += 1.0  # the listing is due: the loader asks again, once
    assert not w.full
    _write(d, 1, 10, 20)
    assert len(w.fill()) == 10 and len(listings) == n + 1
    assert w.waiting  # dry again right after, without a second listing
    w.seek({"low": 0})  # a new session: not waiting any more
    assert not w.stalled and not w.full


# ---------------------------------------------------------------- transforms

@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["alpha beta gamma delta epsilon doc 1 2 3 : hello world"] * 5,
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>", "<|image|>"]))
    p = str(tmp_path_factory.mktemp("tok") / "tok.json")
    tok.save(p)
    return p


def raw(columns, n):
    return RawSamples(np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64), columns)


def test_text_is_tokenized_in_one_batch_with_eos(tokenizer_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    texts = ["alpha beta", "", None, "gamma gamma unknownword delta"]
    f = make_transform(SourceSpec(name="t", uri="x", kind="text", tokenizer=tokenizer_path))
    out = f(raw({"text": pa.array(texts)}, 4))
    eos = tok.token_to_id("<|endoftext|>")
    for i, t in enumerate(texts):
        assert out.tokens[i].tolist() == tok.encode(t or "", add_special_tokens=False).ids + [eos]
    assert out.ntokens.tolist() == [len(out.tokens[i]) for i in range(4)] and out.npatches.tolist() == [0] * 4
    f2 = make_transform(SourceSpec(name="t", uri="x", kind="text", tokenizer=tokenizer_path, append_eos=False))
    assert f2(raw({"text": pa.array(["alpha"])}, 1)).tokens[0].tolist() == [tok.token_to_id("alpha")]


def test_token_columns_pass_through():
    f = make_transform(SourceSpec(name="t", uri="x", kind="tokens", columns=["ids"]))
    for typ in (pa.list_(pa.int32()), pa.list_(pa.int64()), pa.large_list(pa.int32())):
        out = f(raw({"ids": pa.array([[1, 2, 3], None, [], [7]], typ)}, 4))
        assert [out.tokens[i].tolist() for i in range(4)] == [[1, 2, 3], [], [], [7]]
        assert out.tokens.values.dtype == np.int32 and out.ntokens.tolist() == [3, 0, 0, 1]
    b = pa.array([np.array([5, 6], "<i4").tobytes(), b"", np.array([9], "<i4").tobytes()])
    out = f(raw({"ids": b}, 3))
    assert [out.tokens[i].tolist() for i in range(3)] == [[5, 6], [], [9]]
    # bad rows are emptied and counted, not raised (tests/unit/test_loader_badrows.py)
    assert f(raw({"ids": pa.array([b"abc"])}, 1)).ntokens.tolist() == [0]
    assert f(raw({"ids": pa.array([[2**40]], pa.list_(pa.int64()))}, 1)).ntokens.tolist() == [0]
    assert any("whole little-endian int32" in m for m in f.quarantine.messages())
    with pytest.raises(ValueError, match="column 'ids'"):
        f(raw({"ids": pa.array(["abc"])}, 1))


def test_ragged_helpers():
    a = Ragged.from_arrays([np.array([1, 2]), np.array([], np.int32), np.array([3])])
    assert [x.tolist() for x in (append_value(a, 9)[i] for i in range(3))] == [[1, 2, 9], [9], [3, 9]]
    b = Ragged.from_arrays([np.array([7]), np.array([8, 8]), np.array([], np.int32)])
    c = concat_ragged(a, b)
    assert [c[i].tolist() for i in range(3)] == [[1, 2, 7], [8, 8], [3]]


def _png(w, h, seed=0):
    from PIL import Image

    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue(), a


def test_image_text_patches_and_fused_tokens(tokenizer_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    exact, pixels = _png(28, 42)  # already a multiple of 14: kept as is
    big, _ = _png(1000, 300, 1)
    src = SourceSpec(name="vl", uri="x", kind="image_text", tokenizer=tokenizer_path, columns=["img", "cap"],
                     image=ImageSpec(patch_size=14, max_side=224, merge=1))
    f = make_transform(src)
    imgs = pa.array([exact, big, None, b"not an image"], pa.binary())
    caps = pa.array(["alpha beta", "gamma", "delta", "epsilon"])
    out = f(raw({"img": imgs, "cap": caps}, 4))
    img_id = tok.token_to_id("<|image|>")
    eos = tok.token_to_id("<|endoftext|>")
    # sample 0: exact size, 3x2 patches; patch pixels recoverable from the flat buffer
    assert out.image_grid[0].tolist() == [3, 2] and out.npatches[0] == 6
    p = out.patches[0].reshape(3, 2, 14, 14, 3)
    assert (p[1, 0] == pixels[14:28, 0:14]).all()
    assert out.tokens[0].tolist() == [img_id] * 6 + tok.encode("alpha beta", add_special_tokens=False).ids + [eos]
    # sample 1: longer side capped, both sides multiples of the patch size
    hp, wp = out.image_grid[1].tolist()
    assert wp * 14 <= 224 and (wp * 14, hp * 14) == target_size(1000, 300, 14, 224)
    assert len(out.patches[1]) == hp * wp * 14 * 14 * 3
    # sample 2: no image, text only
    assert out.npatches[2] == 0 and out.tokens[2].tolist()[-1] == eos
    # sample 3: undecodable image -> emptied (dropped by the loader) and counted
    assert out.ntokens[3] == 0 and out.npatches[3] == 0
    assert f.quarantine.counts()["by_kind"] == {"bad_image": 1}
    assert out.ntokens.tolist()[:3] == [len(out.tokens[i]) for i in range(3)]


def test_bad_images_are_counted_and_remembered_within_bounds(tokenizer_path, monkeypatch):
    import mixplane.loader.transforms as tr
    from mixplane.samples import make_key

    monkeypatch.setattr(tr, "SAMPLE_QUARANTINE_ENTRIES", 5)
    monkeypatch.setattr(tr, "SAMPLE_QUARANTINE_SEEN", 8)
    src = SourceSpec(name="vl", uri="x", kind="image_text", tokenizer=tokenizer_path, columns=["img", "cap"],
                     image=ImageSpec(patch_size=14, max_side=224, merge=1))
    f = make_transform(src)
    cols = {"img": pa.array([b"not an image"] * 10, pa.binary()), "cap": pa.array(["alpha"] * 10)}
    for epoch in range(4):  # the same 10 bad rows every epoch, under new keys
        keys = make_key(epoch, np.arange(10))
        out = f(RawSamples(keys, np.arange(10) + 10 * epoch, cols))
        assert (out.ntokens == 0).all()
    q = f.quarantine
    assert q.units_total == 40 and q.counts()["by_kind"] == {"bad_image": 40}  # every bad sample counted
    assert len(q.entries) == 5 and f"sample key {int(keys[-1])}" in q.entries[-1].message  # the last ones kept
    assert len(q._seen) == 8  # memory stays bounded however many epochs go by
    f(RawSamples(keys[-3:], np.arange(3), {c: a[:3] for c, a in cols.items()}))  # re-read after a seek
    assert q.units_total == 40


def test_image_merge_rounds_to_merged_grid(tokenizer_path):
    big, _ = _png(500, 333)
    src = SourceSpec(name="vl", uri="x", kind="image_text", tokenizer=tokenizer_path, columns=["img", "cap"],
                     image=ImageSpec(patch_size=14, max_side=448, merge=4))
    out = make_transform(src)(raw({"img": pa.array([{"bytes": big, "path": None}]), "cap": pa.array(["x"])}, 1))
    hp, wp = out.image_grid[0].tolist()
    assert hp % 2 == 0 and wp % 2 == 0
    from tokenizers import Tokenizer

    img_id = Tokenizer.from_file(tokenizer_path).token_to_id("<|image|>")
    assert int((out.tokens[0] == img_id).sum()) == hp * wp // 4  # one placeholder per merged 2x2 patch block
    assert out.npatches[0] == hp * wp and out.ntokens[0] == len(out.tokens[0])


def test_window_reads_about_the_tokens_it_misses_not_a_fixed_count():
    """A source of very long documents: topping up a window tokenizes a few documents, not CHUNK of them,
    and the announced prefix is the same whatever the read sizes."""
    from mixplane.loader.window import CHUNK, MIN_CHUNK, LoaderWindow

    class Stream:
        def __init__(self):
            self.at, self.reads = 0, []

        def seek(self, p):
            self.at = p

        def take(self, n, timeout=None):
            self.reads.append(n)
            pos = np.arange(self.at, self.at + n)
            self.at += n
            return RawSamples(pos.astype(np.int64), pos.astype(np.int64), {})

    def transform(raw, length=lambda p: 20_000 + 1000 * (p % 7)):
        n = np.array([length(int(p)) for p in raw.positions], np.int32)
        off = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
        return TransformedSamples(Ragged(np.zeros(int(off[-1]), np.int32), off), None, n, np.zeros(len(raw), np.int32))

    def run(min_tokens):
        s = Stream()
        w = LoaderWindow(s, transform, (4, min_tokens, 10_000))
        w.seek({"low": 0})
        a = w.fill()
        while w.wants_read_ahead:
            w.read_ahead()
        return s, w, a

    s, w, a = run(200_000)
    lengths = np.cumsum([20_000 + 1000 * (p % 7) for p in range(100)])
    assert len(a) == int(np.argmax(lengths >= 200_000)) + 1  # the shortest prefix with >= 4 samples, >= 200k tokens
    read_tokens = int(w._read_tokens)
    # window + read-ahead ask for 400k tokens; every read after the first is sized to what is missing
    assert read_tokens < 400_000 + MIN_CHUNK * 26_000 and max(s.reads[1:]) <= max(MIN_CHUNK, 20)
    assert max(s.reads) < CHUNK
    s2, _, a2 = run(200_000)
    np.testing.assert_array_equal(a.pos, a2.pos)
