"""Byte bounds on text values, applied straight on Arrow arrays (no Python string of a giant value).

Used by the text transforms (``sources[].max_doc_bytes``: cut a document before it is tokenized)
and by the stream, which keeps no more than a few bytes past that bound of any text value it caches
or hands out, so a giant row costs its page read and nothing after it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pyarrow as pa

CUT_LOOKBACK = 4096  # bytes searched back from a limit for a space to cut at


def cut_point(data: memoryview | bytes, limit: int) -> int:
    """Where to cut UTF-8 ``data`` to at most ``limit`` bytes: before the last space in the final
    CUT_LOOKBACK bytes (whitespace-splitting tokenizers then produce the same tokens as for the
    whole text), else at the last character boundary."""
    if len(data) <= limit:
        return len(data)
    lo = max(0, limit - CUT_LOOKBACK)
    tail = bytes(data[lo : limit + 1])
    sp = tail.rfind(b" ")
    if sp > 0:
        return lo + sp
    return char_boundary(data, limit)


def char_boundary(data: memoryview | bytes, limit: int) -> int:
    """The longest prefix of UTF-8 ``data`` of at most ``limit`` bytes that ends between characters."""
    if len(data) <= limit:
        return len(data)
    cut = limit
    while cut > 0 and (data[cut] & 0xC0) == 0x80:  # inside a multi-byte character
        cut -= 1
    return cut


def value_lengths(arr: pa.Array) -> np.ndarray:
    """Bytes of every value of a string / binary array, from its offsets (no compute kernel: the
    stream calls this on every unit it loads, and pyarrow.compute alone costs ~30 MB to import)."""
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_binary(t):
        otype: type = np.int32
    elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        otype = np.int64
    else:  # other layouts (views, dictionaries, fixed size): the kernel
        import pyarrow.compute as pc

        return pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    buf = arr.buffers()[1]
    if buf is None or not len(arr):
        return np.zeros(len(arr), np.int64)
    item = np.dtype(otype).itemsize
    return np.diff(np.frombuffer(buf, otype, count=len(arr) + 1, offset=arr.offset * item)).astype(np.int64)


def bound_texts(arr: pa.Array, max_bytes: int, policy: str,
                cut_at: Callable[[memoryview], int] | None = None) -> tuple[pa.Array, np.ndarray]:
    """``arr`` with every value over ``max_bytes`` replaced by its first piece (``truncate``: ending
    before a space where there is one; ``prefix``: its first max_bytes, to a character boundary;
    ``cut_at``: where that function says) or by an empty value (``drop``), and the mask of those rows.
    Lengths come from the offsets; only the kept bytes of an over-long value are copied."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    over = np.zeros(len(arr), bool)
    t = arr.type
    if pa.types.is_null(t) or not len(arr):
        return arr, over
    over = value_lengths(arr) > max_bytes
    if not over.any():
        return arr, over
    if arr.null_count:  # a null slot's offsets need not be equal
        over &= np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), bool)
        if not over.any():
            return arr, over
    parts: list[pa.Array] = []
    last = 0
    for i in np.flatnonzero(over).tolist():
        parts.append(arr.slice(last, i - last))
        piece = b""
        if policy != "drop":
            buf = memoryview(arr[i].as_buffer())
            cut = cut_at(buf) if cut_at is not None else (char_boundary if policy == "prefix" else cut_point)(buf, max_bytes)
            piece = bytes(buf[:cut])
        try:
            parts.append(pa.array([piece], pa.binary()).cast(t))
        except pa.ArrowInvalid:  # not UTF-8 where it was cut: nothing of it is kept
            parts.append(pa.array([b""], pa.binary()).cast(t))
        last = i + 1
    parts.append(arr.slice(last))
    return pa.concat_arrays([p for p in parts if len(p)] or [arr.slice(0, 0)]), over
