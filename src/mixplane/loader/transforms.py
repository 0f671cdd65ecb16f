"""Sample transforms run inside a Source Loader: raw column values -> token ids (and image patches)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from mixplane.loader.stream import RawSamples
from mixplane.samples import Ragged
from mixplane.spec import SourceSpec

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]")


@dataclass
class TransformedSamples:
    tokens: Ragged
    patches: Ragged | None
    ntokens: np.ndarray
    npatches: np.ndarray


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


def _ragged_from_list_array(arr: pa.Array) -> Ragged:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if not pa.types.is_list(arr.type) and not pa.types.is_large_list(arr.type):
        raise TypeError(f"expected a list column of token ids, got {arr.type}")
    if arr.null_count:
        arr = arr.fill_null(pa.scalar([], type=arr.type))
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=np.int32)
    values = values[offsets[0] : offsets[-1]]
    return Ragged(values, offsets - offsets[0])


def make_transform(source: SourceSpec) -> Callable[[RawSamples], TransformedSamples]:
    col = source.columns[0]
    if source.kind == "tokens":
        def tokens_passthrough(raw: RawSamples) -> TransformedSamples:
            rg = _ragged_from_list_array(raw.columns[col])
            n = rg.lengths.astype(np.int32)
            return TransformedSamples(rg, None, n, np.zeros(len(n), np.int32))
        return tokens_passthrough
    if source.kind == "text":
        tok = load_tokenizer(source.tokenizer or "")
        eos = eos_id(tok) if source.append_eos else None

        def tokenize(raw: RawSamples) -> TransformedSamples:
            arr = raw.columns[col]
            if not (pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)):
                if pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type):
                    arr = pc.cast(arr, pa.large_string())
                else:
                    raise TypeError(f"source {source.name!r}: column {col!r} is {arr.type}, expected text")
            texts = arr.fill_null("").to_pylist()
            enc = tok.encode_batch_fast(texts, add_special_tokens=False)
            ids = [np.asarray(e.ids, dtype=np.int32) for e in enc]
            if eos is not None:
                ids = [np.append(a, np.int32(eos)) for a in ids]
            rg = Ragged.from_arrays(ids, np.int32)
            n = rg.lengths.astype(np.int32)
            return TransformedSamples(rg, None, n, np.zeros(len(n), np.int32))
        return tokenize
    raise NotImplementedError(f"source {source.name!r}: kind {source.kind} is not supported by this loader yet")
