"""Issue 5: a bad row found by a transform empties its sample and is counted; the rest of its batch is delivered."""

import numpy as np
import pyarrow as pa
import pytest

from mixplane.loader.stream import RawSamples
from mixplane.loader.transforms import TransformError, make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.spec import ImageSpec, SourceSpec
from tests.unit.test_loader_live_transforms import tokenizer_path  # noqa: F401  (module fixture)

KEYS = np.array([100, 101, 102, 103], np.int64)


def _raw(col: str, arr: pa.Array) -> RawSamples:
    return RawSamples(KEYS[: len(arr)], np.arange(len(arr), dtype=np.int64), {col: arr})


def _i32(*xs) -> bytes:
    return np.array(xs, "<i4").tobytes()


BAD_TOKEN_BATCHES = {
    "binary_not_whole_int32": pa.array([_i32(1, 2), _i32(3) + b"\x01", _i32(4, 5, 6), b""], pa.binary()),
    "large_binary_not_whole_int32": pa.array([_i32(1, 2), b"abc", _i32(4, 5, 6), b""], pa.large_binary()),
    "null_item": pa.array([[1, 2], [3, None], [4, 5, 6], []], pa.list_(pa.int32())),
    "id_beyond_int32": pa.array([[1, 2], [2**40], [4, 5, 6], []], pa.list_(pa.int64())),
    "negative_id": pa.array([[1, 2], [-1, 7], [4, 5, 6], []], pa.large_list(pa.int64())),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKEN_BATCHES))
def test_bad_token_row_is_emptied_counted_and_the_rest_delivered(case):
    f = make_transform(SourceSpec(name="s", uri="x", kind="tokens", columns=["ids"]))
    out = f(_raw("ids", BAD_TOKEN_BATCHES[case]))
    assert [out.tokens[i].tolist() for i in range(4)] == [[1, 2], [], [4, 5, 6], []]
    assert out.ntokens.tolist() == [2, 0, 3, 0] and out.tokens.values.dtype == np.int32
    q = f.quarantine
    assert q.units_total == 1 and q.counts()["by_kind"] == {"bad_tokens": 1}
    e = q.entries[-1]
    assert e.column == "ids" and e.page == 101 and "source 's'" in e.message and "sample key 101" in e.message


def test_bad_token_rows_with_eos_keep_good_rows_and_stay_empty(tokenizer_path):  # noqa: F811
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(tokenizer_path).token_to_id("<|endoftext|>")
    f = make_transform(SourceSpec(name="s", uri="x", kind="tokens", columns=["ids"], tokenizer=tokenizer_path))
    out = f(_raw("ids", BAD_TOKEN_BATCHES["null_item"]))
    assert [out.tokens[i].tolist() for i in range(4)] == [[1, 2, eos], [], [4, 5, 6, eos], [eos]]
    assert out.ntokens.tolist() == [3, 0, 4, 1]


def test_non_utf8_text_row_is_emptied_counted_and_the_rest_tokenized(tokenizer_path):  # noqa: F811
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    eos = tok.token_to_id("<|endoftext|>")
    f = make_transform(SourceSpec(name="s", uri="x", kind="text", tokenizer=tokenizer_path))
    texts = [b"alpha beta", b"gamma \xff\xfe", None, "delta".encode()]
    out = f(_raw("text", pa.array(texts, pa.binary())))
    want = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in ("alpha beta", None, "", "delta") if t is not None]
    assert [out.tokens[i].tolist() for i in (0, 2, 3)] == want
    assert out.ntokens[1] == 0 and len(out.tokens[1]) == 0
    q = f.quarantine
    assert q.counts()["by_kind"] == {"bad_text": 1} and q.entries[-1].column == "text" and q.entries[-1].page == 101


def test_non_utf8_caption_empties_its_image_text_sample(tokenizer_path):  # noqa: F811
    src = SourceSpec(name="vl", uri="x", kind="image_text", tokenizer=tokenizer_path, columns=["img", "cap"],
                     image=ImageSpec(patch_size=14, max_side=224, merge=1))
    f = make_transform(src)
    caps = pa.array([b"alpha", b"\xff", b"gamma"], pa.binary())
    out = f(RawSamples(KEYS[:3], np.arange(3), {"img": pa.nulls(3, pa.binary()), "cap": caps}))
    assert out.ntokens[1] == 0 and out.ntokens[0] > 0 and out.ntokens[2] > 0
    assert f.quarantine.counts()["by_kind"] == {"bad_text": 1}


def test_a_column_of_the_wrong_type_is_still_a_configuration_error():
    f = make_transform(SourceSpec(name="s", uri="x", kind="tokens", columns=["ids"]))
    with pytest.raises(TransformError, match="column 'ids'"):
        f(_raw("ids", pa.array([1.5, 2.0])))


class _OneBatch:
    def __init__(self, raw):
        self.raw, self.done = raw, False

    def take(self, n):
        if self.done:
            return RawSamples(np.zeros(0, np.int64), np.zeros(0, np.int64), {c: a[:0] for c, a in self.raw.columns.items()})
        self.done = True
        return self.raw


def test_window_keeps_going_past_a_bad_row_and_drops_it():
    f = make_transform(SourceSpec(name="s", uri="x", kind="tokens", columns=["ids"]))
    w = LoaderWindow(_OneBatch(_raw("ids", BAD_TOKEN_BATCHES["binary_not_whole_int32"])), f, (1, 1, 100))
    w._read(4)
    assert [b.key for b in w.staged] == [100, 102] and [b.tokens.tolist() for b in w.staged] == [[1, 2], [4, 5, 6]]
