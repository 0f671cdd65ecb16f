"""Sample transforms run inside a Source Loader: raw column values -> token ids (and image patches).

* ``text``: one batched ``encode_batch_fast`` call per take, EOS appended vectorised.
* ``tokens``: a ``list<int32|int64>`` column passes through (a ``binary`` column is read as
  little-endian int32); the tokenizer's EOS is appended when a tokenizer is given.
* ``image_text``: columns [image, caption]. The image (encoded bytes, or an HF-style struct with a
  ``bytes`` field) is decoded with Pillow, resized so its longer side is at most ``max_side`` and
  both sides are multiples of ``patch_size`` (times sqrt(merge) when patches are merged), and cut
  into patches. Its tokens are the fused sequence ``[image placeholder] * (patches / merge) +
  caption tokens (+ EOS)``. ``patches`` holds each sample's patch pixels flattened (uint8, patch
  by patch, row-major, each patch p*p*3 RGB), ``image_grid`` its (h_patches, w_patches). With
  ``image.decode_at`` constructor or client, only the image's header is read here (its grid) and
  ``patches`` holds the raw encoded bytes, decoded later by the same code (:mod:`mixplane.imagedecode`).

Per-sample metadata the planner sees before any payload moves: ``ntokens`` and ``npatches`` (the
key and source travel with the RawSamples). A bad sample — an image that cannot be decoded, a
binary token row that is not whole int32 values, a null token item, an id outside int32, text that
is not UTF-8 — is emptied (ntokens 0, so the loader drops it) and counted in
``transform.quarantine.units_total`` (one per bad sample read, for the loader's metrics); the good
rows of its batch are delivered unchanged. A batch is converted whole; only when that fails are its
rows checked one by one to find the bad ones (the error path, never the common one). A column of a
type the kind cannot read at all is a configuration error and still raises TransformError.

Bounded documents (``sources[].max_doc_bytes`` / ``max_doc_tokens`` / ``overlong_doc``): a text (or
caption) longer than max_doc_bytes is cut *before* it is tokenized — its first max_doc_bytes,
ending at a space where there is one, or nothing under ``drop`` — read straight from the Arrow
buffer, so a giant row never becomes a giant Python string or a giant tokenizer call. Texts over
:data:`ENCODE_BATCH_CHARS` are tokenized in pieces cut at spaces (the tokenizer's memory grows with
its input). A document with more than max_doc_tokens tokens keeps its first max_doc_tokens (or is
dropped). ``TransformedSamples.overlong`` marks the documents cut or dropped; the window counts them.
"""

from __future__ import annotations

import itertools

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mixplane.errors import MixplaneError
from mixplane.imagedecode import (PLACES, ImageCosts, choose_decode_place, image_grid, image_to_patches, merge_multiple,  # noqa: F401 - one decode for every place
                                  place_costs, target_size)
from mixplane.loader.bounds import CUT_LOOKBACK, bound_texts, value_lengths
from mixplane.loader.split import SPLIT_PIECE_BYTES, SPLIT_PIECE_TOKENS, SPLIT_SLOTS, PendingDoc, piece_end, piece_limit
from mixplane.loader.quarantine import QuarantineLog
from mixplane.loader.stream import RawSamples
from mixplane.samples import Ragged
from mixplane.spec import SourceSpec
from mixplane.tokens import resolve_image_token_id

log = logging.getLogger(__name__)
R = TypeVar("R")
SAMPLE_QUARANTINE_ENTRIES = 100  # bad-sample records a transform keeps (the last ones)
SAMPLE_QUARANTINE_SEEN = 4096  # recent bad-sample keys remembered, so a re-read after a seek counts once
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


@dataclass
class TransformedSamples:
    tokens: Ragged  # int32 token ids per sample (image_text: fused sequence with placeholders)
    patches: Ragged | None  # uint8 flattened patch pixels per sample (image_text only)
    ntokens: np.ndarray  # int32
    npatches: np.ndarray  # int32
    image_grid: np.ndarray | None = None  # int32 (n, 2): (h_patches, w_patches); (0, 0) without image
    patch_size: int = 0
    overlong: np.ndarray | None = None  # bool: the document was over max_doc_bytes / max_doc_tokens (cut or dropped)
    rest: dict[int, PendingDoc] | None = None  # overlong_doc: split: row -> the rest after its first piece


# a source's transform: raw rows of the stream -> token/image samples (make_transform builds one per source)
Transform = Callable[[RawSamples], TransformedSamples]


class TransformError(MixplaneError, ValueError):
    """A column that cannot be turned into tokens (wrong type, bad token bytes); names the source and column."""


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises a plain Exception on bad files
        raise ValueError(f"{path}: cannot load tokenizer ({e})") from None


def eos_id(tok) -> int | None:
    for t in EOS_CANDIDATES:
        i = tok.token_to_id(t)
        if i is not None:
            return int(i)
    return None


# ---- ragged helpers (vectorised) ----

def append_value(rg: Ragged, value: int) -> Ragged:
    """Append one value to every item of a Ragged without a Python loop."""
    n = len(rg)
    lens = rg.lengths
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens + 1, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=rg.values.dtype)
    is_tail = np.zeros(len(out), bool)
    is_tail[offsets[1:] - 1] = True
    out[is_tail] = value
    out[~is_tail] = rg.values
    return Ragged(out, offsets)


def concat_ragged(a: Ragged, b: Ragged) -> Ragged:
    """Item-wise concatenation a[i] + b[i] (vectorised)."""
    la, lb = a.lengths, b.lengths
    offsets = np.zeros(len(la) + 1, np.int64)
    np.cumsum(la + lb, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.result_type(a.values.dtype, b.values.dtype))
    from_a = np.zeros(len(out), bool)
    # mark the first la[i] slots of item i
    if len(out):
        starts = offsets[:-1]
        idx = np.repeat(starts, la) + (np.arange(int(la.sum())) - np.repeat(np.concatenate([[0], np.cumsum(la)])[:-1], la))
        from_a[idx] = True
    out[from_a] = a.values
    out[~from_a] = b.values
    return Ragged(out, offsets)


def _ragged_from_list_array(arr: pa.Array, what: str = "tokens") -> Ragged:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return _ragged_from_binary(arr, what)
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise TransformError(f"{what}: expected a list<int> or binary column of token ids, got {t}")
    if not pa.types.is_integer(t.value_type):
        raise TransformError(f"{what}: token list items are {t.value_type}, expected integers")
    if arr.null_count:
        arr = arr.fill_null(pa.scalar([], type=t))
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    vals_arr = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))  # .values ignores a slice
    if vals_arr.null_count:
        raise TransformError(f"{what}: token lists contain nulls")
    values = vals_arr.to_numpy(zero_copy_only=False)
    if values.dtype != np.int32:
        if len(values) and (values.min() < 0 or values.max() > np.iinfo(np.int32).max):
            raise TransformError(f"{what}: token ids outside int32")
        values = values.astype(np.int32)
    return Ragged(values, offsets - offsets[0])


def _ragged_from_binary(arr: pa.Array, what: str) -> Ragged:
    if pa.types.is_fixed_size_binary(arr.type):
        arr = arr.cast(pa.binary())
    if arr.null_count:
        arr = arr.fill_null(b"")
    bufs = arr.buffers()
    otype = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(bufs[1], dtype=otype, count=len(arr) + 1, offset=arr.offset * np.dtype(otype).itemsize).astype(np.int64)
    if np.any(np.diff(offsets) % 4):
        raise TransformError(f"{what}: binary token rows must hold whole little-endian int32 values")
    data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
    data = data[offsets[0] : offsets[-1]]
    return Ragged(data.view("<i4").astype(np.int32), (offsets - offsets[0]) // 4)


def _texts(arr: pa.Array, what: str) -> list[str]:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            arr = pc.cast(arr, pa.large_string())  # raises on invalid UTF-8
        elif pa.types.is_null(t):
            return [""] * len(arr)
        else:
            raise TransformError(f"{what}: column is {t}, expected text")
    return arr.fill_null("").to_pylist()


@dataclass(frozen=True)
class DocBounds:
    """Per-source document limits (spec fields max_doc_bytes, max_doc_tokens, overlong_doc)."""

    max_bytes: int
    max_tokens: int
    policy: str = "truncate"  # or "drop" or "split"

    @classmethod
    def of(cls, source: SourceSpec) -> "DocBounds":
        return cls(int(source.max_doc_bytes), int(source.max_doc_tokens), str(source.overlong_doc))

    def piece_bytes(self, eos: bool) -> int:
        """Bytes of one piece under ``split``: max_doc_bytes, and no more than max_doc_tokens (minus the
        EOS) so that a piece's tokens fit its bound too (a token covers at least one byte in the
        tokenizers in use; a piece with more tokens than that is cut, and counted)."""
        return max(1, min(self.max_bytes, self.max_tokens - int(eos)))


class Splitter:
    """The next piece of a split document (:mod:`loader.split`): where it ends (no tokenizing, so
    pieces a resumed window skips cost nothing) and its tokens (EOS after the last piece only)."""

    def __init__(self, bounds: DocBounds, tok=None, eos: int | None = None):
        self.bounds, self.tok, self.eos = bounds, tok, eos
        self.piece_bytes = bounds.piece_bytes(eos is not None)

    def text_limit(self, size: int) -> int:
        """Bytes per piece of a document of ``size`` bytes."""
        return piece_limit(size, SPLIT_PIECE_BYTES, self.piece_bytes)

    def token_limit(self, size: int) -> int:
        return piece_limit(size, SPLIT_PIECE_TOKENS, self.bounds.max_tokens)

    def first_cut(self, buf: memoryview) -> int:
        """End of a long document's first piece (the transform cuts it before tokenizing)."""
        return piece_end(buf, 0, self.text_limit(len(buf)))

    def advance(self, doc: PendingDoc) -> tuple[int, bool, bool]:
        """(end of the next piece, is it the last one, is the rest of the document cut off)."""
        if doc.text is not None:
            end = piece_end(doc.text, doc.offset, self.text_limit(doc.size))
        else:
            end = min(doc.offset + self.token_limit(doc.size), doc.size)
        if end >= doc.size:
            return end, True, False
        if doc.piece + 1 >= SPLIT_SLOTS:  # the most pieces one row can be announced as
            return end, True, True
        return end, False, False

    def tokens(self, doc: PendingDoc, end: int, last: bool) -> np.ndarray:
        if doc.tokens is not None:
            return np.array(doc.tokens[doc.offset : end], np.int32)
        assert doc.text is not None and self.tok is not None
        text = bytes(doc.text[doc.offset : end]).decode("utf-8", "replace")
        ids = np.asarray(_encode(self.tok, [text])[0], np.int32)
        if last and self.eos is not None:
            ids = np.append(ids, np.int32(self.eos))
        return ids[: self.bounds.max_tokens]


def _prefixes(rg: Ragged, lengths: np.ndarray) -> Ragged:
    """The first ``lengths[i]`` (<= the item's length) values of every item (vectorised)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    idx = np.repeat(rg.offsets[:-1] - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
    return Ragged(rg.values[idx], offsets)


def _cap_tokens(rg: Ragged, max_tokens: int, policy: str) -> tuple[Ragged, np.ndarray]:
    """Items longer than ``max_tokens`` cut to their first max_tokens (or emptied under ``drop``)."""
    lens = rg.lengths
    over = lens > max_tokens
    if not over.any():
        return rg, over
    return _prefixes(rg, np.where(over, 0 if policy == "drop" else max_tokens, lens)), over


class _OverlongLog:
    """Rate-limited log of documents over their source's bounds (the first few, then every 1000th)."""

    def __init__(self, what: str):
        self.what, self.count = what, 0
        self._lock = threading.Lock()  # transforms may run on a partition's worker threads

    def note(self, raw: RawSamples, rows: np.ndarray, why: str, policy: str) -> None:
        for i in np.flatnonzero(rows).tolist():
            with self._lock:
                self.count += 1
                count = self.count
            if count <= 10 or count % 1000 == 0:
                log.warning("%s: sample key %d: document over %s (%s; %d so far)", self.what, int(raw.keys[i]), why,
                            {"drop": "dropped", "split": "split into pieces"}.get(policy, "cut to its first piece"),
                            count)


def _check_token_type(arr, what: str) -> None:
    """Column-level check (a wrong type is a configuration error, not a bad row)."""
    t = arr.type
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        raise TransformError(f"{what}: expected a list<int> or binary column of token ids, got {t}")
    if not pa.types.is_integer(t.value_type):
        raise TransformError(f"{what}: token list items are {t.value_type}, expected integers")


def _check_text_type(arr, what: str) -> None:
    t = arr.type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or pa.types.is_null(t)):
        raise TransformError(f"{what}: column is {t}, expected text")


ROW_ERRORS = (ValueError, pa.ArrowException, OverflowError)  # TransformError is a ValueError


def _bad_rows(convert: Callable, arr: pa.Array) -> dict[int, str]:
    """Rows of ``arr`` that ``convert`` rejects, with why: one row at a time (only after the whole
    batch failed, so the common path stays vectorised)."""
    bad: dict[int, str] = {}
    for i in range(len(arr)):
        try:
            convert(arr.slice(i, 1))
        except ROW_ERRORS as e:
            bad[i] = str(e)
    return bad


def _convert_isolating(convert: Callable[[pa.Array], R], arr: pa.Array) -> tuple[R, np.ndarray, dict[int, str]]:
    """(convert(good rows), mask of good rows, {bad row: why}). The whole batch first; if that
    fails, find the bad rows and convert the others in one call."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    try:
        return convert(arr), np.ones(len(arr), bool), {}
    except ROW_ERRORS:
        bad = _bad_rows(convert, arr)
        if not bad:
            raise  # not a row's fault (e.g. the batch as a whole): let the caller see it
    keep = np.ones(len(arr), bool)
    keep[list(bad)] = False
    return convert(arr.filter(pa.array(keep))), keep, bad


def _scatter(rg: Ragged, keep: np.ndarray) -> Ragged:
    """Items of ``rg`` at the True slots of ``keep``, empty items elsewhere (vectorised)."""
    if keep.all():
        return rg
    lens = np.zeros(len(keep), np.int64)
    lens[keep] = rg.lengths
    offsets = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return Ragged(rg.values, offsets)


def _quarantine_rows(quarantine: QuarantineLog, raw: RawSamples, bad: dict[int, str], what: str, kind: str,
                     column: str) -> None:
    for i, why in bad.items():
        key = int(raw.keys[i])
        quarantine.add(_SampleError(f"{what}: sample key {key}: {why}", key, kind, column), pages=0)


ENCODE_BATCH_CHARS = 1 << 20  # text per tokenizer call: bounds the tokenizer's transient memory


def _split_text(text: str, n: int) -> list[str]:
    """``text`` in pieces of at most ``n`` characters, cut before a space where there is one."""
    out, i = [], 0
    while len(text) - i > n:
        j = text.rfind(" ", i + max(1, n - CUT_LOOKBACK), i + n)
        j = j if j > i else i + n
        out.append(text[i:j])
        i = j
    out.append(text[i:])
    return out


def _encode(tok, texts: list[str]) -> Ragged:
    """Batched tokenizer calls of at most ~1 MB of text each (a tokenizer's intermediate state is tens
    of bytes per token, so a batch of long documents would otherwise spike the loader's memory); a
    longer text is tokenized in pieces cut at spaces and its ids concatenated."""
    if any(len(t) > ENCODE_BATCH_CHARS for t in texts):
        pieces: list[str] = []
        owner: list[int] = []
        for k, t in enumerate(texts):
            ps = _split_text(t, ENCODE_BATCH_CHARS) if len(t) > ENCODE_BATCH_CHARS else [t]
            pieces.extend(ps)
            owner.extend([k] * len(ps))
        rg = _encode(tok, pieces)
        lens = np.bincount(np.asarray(owner, np.int64), weights=rg.lengths, minlength=len(texts)).astype(np.int64)
        offsets = np.zeros(len(texts) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return Ragged(rg.values, offsets)  # pieces are in document order: values concatenate per document
    ids: list[list[int]] = []
    i = 0
    while i < len(texts):
        j, size = i, 0
        while j < len(texts) and (j == i or size + len(texts[j]) <= ENCODE_BATCH_CHARS):
            size += len(texts[j])
            j += 1
        ids.extend(e.ids for e in tok.encode_batch_fast(texts[i:j], add_special_tokens=False))
        i = j
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1]))
    return Ragged(values, offsets)


# ---- images ----

def _image_bytes(arr: pa.Array, what: str) -> list[bytes | None]:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    t = arr.type
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if "bytes" not in names:
            raise TransformError(f"{what}: image struct has no 'bytes' field (fields: {names})")
        arr = arr.field("bytes")
        t = arr.type
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)):
        raise TransformError(f"{what}: image column is {t}, expected encoded image bytes")
    return arr.to_pylist()


def make_transform(source: SourceSpec) -> Transform:
    tok = load_tokenizer(source.tokenizer) if source.tokenizer else None
    eos = eos_id(tok) if (tok is not None and source.append_eos) else None
    # bad samples: keys are new every epoch, so the log remembers only the most recent ones
    quarantine = QuarantineLog(source.name, max_entries=SAMPLE_QUARANTINE_ENTRIES, max_seen=SAMPLE_QUARANTINE_SEEN)
    bounds = DocBounds.of(source)
    overlong_log = _OverlongLog(f"source {source.name!r}")

    if source.kind == "tokens":
        col = source.columns[0]
        what = f"source {source.name!r}, column {col!r}"

        def tokens_passthrough(raw: RawSamples) -> TransformedSamples:
            arr = raw.columns[col]
            _check_token_type(arr, what)
            rg, keep, bad = _convert_isolating(lambda a: _ragged_from_list_array(a, what), arr)
            if eos is not None:
                rg = append_value(rg, eos)
            rg = _scatter(rg, keep)
            whole = rg
            rg, over = _cap_tokens(rg, bounds.max_tokens, "truncate" if bounds.policy == "split" else bounds.policy)
            overlong_log.note(raw, over, f"max_doc_tokens={bounds.max_tokens}", bounds.policy)
            _quarantine_rows(quarantine, raw, bad, what, "bad_tokens", col)
            rest = None
            if bounds.policy == "split" and over.any():  # the rest of each long row, in pieces
                rest = {}
                first = rg.lengths.copy()
                for i in np.flatnonzero(over).tolist():
                    first[i] = tokens_splitter.token_limit(int(whole.lengths[i]))
                    rest[i] = PendingDoc(int(raw.positions[i]), int(raw.keys[i]), 1, int(first[i]),
                                         tokens=np.array(whole[i], np.int32))
                rg = _prefixes(whole, first)
            n = rg.lengths.astype(np.int32)
            return TransformedSamples(rg, None, n, np.zeros(len(n), np.int32), overlong=over, rest=rest)

        tokens_passthrough.quarantine = quarantine  # type: ignore[attr-defined]
        tokens_splitter = Splitter(bounds)
        tokens_passthrough.splitter = tokens_splitter if bounds.policy == "split" else None  # type: ignore[attr-defined]
        return tokens_passthrough

    if source.kind == "text":
        if tok is None:
            raise ValueError(f"source {source.name!r}: kind text needs a tokenizer")
        col = source.columns[0]
        what = f"source {source.name!r}, column {col!r}"

        def tokenize(raw: RawSamples) -> TransformedSamples:
            arr = raw.columns[col]
            _check_text_type(arr, what)
            if isinstance(arr, pa.ChunkedArray):
                arr = arr.combine_chunks()
            whole = arr
            split = bounds.policy == "split"
            limit = splitter.piece_bytes if split else bounds.max_bytes
            # before any text is tokenized (split: the first piece now, the others when the window needs them)
            arr, big = bound_texts(arr, limit, "truncate" if split else bounds.policy,
                                   splitter.first_cut if split else None)
            overlong_log.note(raw, big, f"max_doc_bytes={limit}", bounds.policy)
            texts, keep, bad = _convert_isolating(lambda a: _texts(a, what), arr)
            rg = _encode(tok, texts)
            if eos is not None:
                rg = append_value(rg, eos)
            rg = _scatter(rg, keep)
            rest = None
            if split and big.any():
                rows = np.flatnonzero(big & keep).tolist()
                if eos is not None:  # the EOS goes after the document's last piece
                    rg = _prefixes(rg, rg.lengths - np.isin(np.arange(len(rg)), rows))
                first = value_lengths(arr)
                rest = {i: PendingDoc(int(raw.positions[i]), int(raw.keys[i]), 1, int(first[i]),
                                      text=memoryview(whole[i].as_buffer())) for i in rows}
            if bounds.policy == "drop" and big.any():  # an emptied text still got its EOS
                rg = _prefixes(rg, np.where(big, 0, rg.lengths))
            rg, many = _cap_tokens(rg, bounds.max_tokens, "truncate" if split else bounds.policy)
            overlong_log.note(raw, many & ~big, f"max_doc_tokens={bounds.max_tokens}", bounds.policy)
            _quarantine_rows(quarantine, raw, bad, what, "bad_text", col)
            n = rg.lengths.astype(np.int32)
            return TransformedSamples(rg, None, n, np.zeros(len(n), np.int32), overlong=big | many, rest=rest)

        splitter = Splitter(bounds, tok, eos)
        tokenize.quarantine = quarantine  # type: ignore[attr-defined]
        tokenize.splitter = splitter if bounds.policy == "split" else None  # type: ignore[attr-defined]
        return tokenize

    if source.kind == "image_text":
        if len(source.columns) < 2:
            raise ValueError(f"source {source.name!r}: image_text needs columns [image, caption]")
        img_col, cap_col = source.columns[0], source.columns[1]
        im = source.image
        p, max_side, merge = im.patch_size, im.max_side, im.merge
        multiple = merge_multiple(merge)
        encoded = im.decode_at in ("constructor", "client")  # ship raw bytes, decode elsewhere (mixplane.imagedecode)
        img_tok = resolve_image_token_id(im.image_token_id, source.tokenizer)  # the id constructors resolve too
        what = f"source {source.name!r}"

        def image_text(raw: RawSamples) -> TransformedSamples:
            n = len(raw)
            cap_what = f"{what}, column {cap_col!r}"
            _check_text_type(raw.columns[cap_col], cap_what)
            caps_arr, big = bound_texts(raw.columns[cap_col], bounds.max_bytes, "truncate")  # a caption is cut, never drops its image
            overlong_log.note(raw, big, f"max_doc_bytes={bounds.max_bytes} (caption)", "truncate")
            texts, cap_ok, bad_caps = _convert_isolating(lambda a: _texts(a, cap_what), caps_arr)
            caps = _encode(tok, texts) if tok is not None else \
                Ragged(np.zeros(0, np.int32), np.zeros(int(cap_ok.sum()) + 1, np.int64))
            if eos is not None:
                caps = append_value(caps, eos)
            caps = _scatter(caps, cap_ok)
            _quarantine_rows(quarantine, raw, bad_caps, cap_what, "bad_text", cap_col)
            imgs = _image_bytes(raw.columns[img_col], f"{what}, column {img_col!r}")
            grid = np.zeros((n, 2), np.int32)
            pix: list[np.ndarray] = []
            bad = ~cap_ok  # a caption that is not text empties its sample too
            for i, b in enumerate(imgs):  # image decoding is per image by nature (Pillow)
                if b is None or bad[i]:
                    pix.append(np.zeros(0, np.uint8))
                    continue
                try:
                    if encoded:  # the header gives the grid; the raw bytes travel (decoded where decode_at says)
                        hp, wp = image_grid(b, p, max_side, multiple)
                        flat = np.frombuffer(b, np.uint8)
                    else:
                        flat, hp, wp = image_to_patches(b, p, max_side, multiple)
                except Exception as e:  # PIL raises many types for corrupt data
                    try:  # a header that reads (a truncated file): as wherever else it is decoded, delivered blank
                        hp, wp = (0, 0) if encoded else image_grid(b, p, max_side, multiple)
                    except Exception:  # noqa: BLE001 - PIL again
                        hp = wp = 0
                    key = int(raw.keys[i])
                    if hp and wp:  # no pixels (patches empty, grid set): the loader ships it flagged img_bad
                        quarantine.add(_SampleError(f"{what}, column {img_col!r}: sample key {key}: undecodable image "
                                                    f"pixels ({e}); delivered as zeros of its {hp}x{wp} patch grid",
                                                    key, "bad_image_pixels", img_col), pages=0)
                        grid[i] = (hp, wp)
                        pix.append(np.zeros(0, np.uint8))
                        continue
                    bad[i] = True
                    quarantine.add(_SampleError(f"{what}, column {img_col!r}: sample key {key}: "
                                                f"undecodable image ({e})", key, "bad_image", img_col),
                                   pages=0)
                    pix.append(np.zeros(0, np.uint8))
                    continue
                grid[i] = (hp, wp)
                pix.append(flat)
            npatches = (grid[:, 0] * grid[:, 1]).astype(np.int32)
            nplace = (npatches // merge).astype(np.int64)
            place = Ragged(np.full(int(nplace.sum()), img_tok, np.int32),
                           np.concatenate([[0], np.cumsum(nplace)]).astype(np.int64))
            tokens = concat_ragged(place, caps)
            ntokens = tokens.lengths.astype(np.int32)
            if bad.any():  # an undecodable image empties its sample: the loader drops it
                keep = ~bad
                lens = np.where(keep, tokens.lengths, 0)
                offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
                tokens = Ragged(tokens.values[np.repeat(keep, tokens.lengths)], offs)
                ntokens = lens.astype(np.int32)
                npatches[bad] = 0
            patches = Ragged.from_arrays(pix, np.uint8)
            return TransformedSamples(tokens, patches, ntokens, npatches, grid, p)

        image_text.quarantine = quarantine  # type: ignore[attr-defined]
        return image_text
    raise NotImplementedError(f"source {source.name!r}: kind {source.kind} is not supported")


class _SampleError(MixplaneError, ValueError):
    """A bad sample for the QuarantineLog: kind (bad_image, bad_tokens, bad_text), column, sample key."""

    unit = "sample"
    file = row_group = None

    def __init__(self, message: str, key: int, kind: str = "bad_image", column: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.column = column
        self.page = key  # the sample key identifies the quarantined unit


# ---- where images are decoded (image.decode_at: auto) ----

MEASURE_FILES = 2  # files of a source `auto` reads its sample from (a source of 10^5 files is not indexed for it)


def measure_image_costs(source: SourceSpec, seed: int, rows: int = 32) -> ImageCosts:
    """Mean decode CPU seconds (this thread's clock), raw bytes and decoded patch bytes per image over the
    first `rows` rows, in the source's read order, of its first MEASURE_FILES files (what `auto` decides from)."""
    from mixplane.loader.files import SourceFiles, SourceFilesError
    from mixplane.loader.listing import source_listing
    from mixplane.loader.stream import open_stream

    try:
        listed = source_listing(source)
    except SourceFilesError:  # no files yet (a live source) or none readable: nothing measured; the loader says why
        return ImageCosts(0.0, 0.0, 0.0, 0)
    k = min(MEASURE_FILES, len(listed.paths))
    if k == 0:
        return ImageCosts(0.0, 0.0, 0.0, 0)
    first = SourceFiles(uri=listed.uri, filesystem=listed.filesystem, paths=listed.paths[:k], sizes=listed.sizes[:k],
                        mtimes_ns=listed.mtimes_ns[:k])
    stream = open_stream(source, seed=seed, partition=0, num_partitions=1, cache_dir=None, files=first,
                         buffer_rows=rows)
    try:
        raw = stream.take(rows, timeout=0.5 if source.live else None)
    finally:
        stream.close()
    return image_costs_of(source, raw.columns[source.columns[0]] if len(raw) else None)


def image_costs_of(source: SourceSpec, column: pa.Array | None, limit: int = 32) -> ImageCosts:
    """Mean decode CPU seconds (this thread's clock), raw bytes and decoded patch bytes per image over the first
    `limit` images of a column of raw image bytes (rows read by a stream); images that do not decode are left out
    (they are the loader's to quarantine, not a cost)."""
    im = source.image
    multiple = merge_multiple(im.merge)
    cpu = raw_b = dec_b = 0.0
    n = 0
    for b in _image_bytes(column, f"source {source.name!r}") if column is not None and len(column) else []:
        if n >= limit:
            break
        if b is None:
            continue
        t0 = time.thread_time()
        try:
            flat, _, _ = image_to_patches(b, im.patch_size, im.max_side, multiple)
        except Exception:  # a bad image is the loader's to quarantine, not a cost
            continue
        cpu += time.thread_time() - t0
        raw_b += len(b)
        dec_b += flat.nbytes
        n += 1
    return ImageCosts(cpu / n, raw_b / n, dec_b / n, n) if n else ImageCosts(0.0, 0.0, 0.0, 0)


def resolve_decode_places(spec, measure: Callable[[SourceSpec, int], ImageCosts] | None = None,
                          previous: dict[str, str] | None = None):
    """`spec` with every image source's ``image.decode_at: auto`` replaced by the place
    :func:`mixplane.imagedecode.choose_decode_place` picks from its measured costs (one image reaches one
    rank: consumers 1), so every component, the run directory's spec and the planner's journal hold the
    same concrete choice (replay reads it there). `previous`: source -> place an earlier run in the same
    run directory journaled; such a source keeps it (a restarted run is not measured again)."""
    sources, changed = [], False
    for s in spec.sources:
        if s.kind == "image_text" and s.image.decode_at == "auto" and (previous or {}).get(s.name) in PLACES:
            log.info("source %s: images decoded at the %s, as the run's journal recorded", s.name, (previous or {})[s.name])
            s = s.model_copy(update={"image": s.image.model_copy(update={"decode_at": (previous or {})[s.name]})})
            changed = True
        elif s.kind == "image_text" and s.image.decode_at == "auto":
            costs = (measure or measure_image_costs)(s, spec.mixture.seed)
            place = choose_decode_place(costs, consumers=1)
            log.info("source %s: images decoded at the %s (%d measured: %.2f ms CPU, %.0f raw bytes, %.0f decoded "
                     "bytes per image; costs %s)", s.name, place, costs.images, costs.decode_s * 1e3, costs.raw_bytes,
                     costs.decoded_bytes, {k: round(v * 1e3, 3) for k, v in place_costs(costs).items()})
            s = s.model_copy(update={"image": s.image.model_copy(update={"decode_at": place})})
            changed = True
        sources.append(s)
    return spec.model_copy(update={"sources": sources}) if changed else spec
