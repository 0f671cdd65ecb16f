"""``overlong_doc: split`` — one over-long document delivered as several bounded pieces, in order.

A source under ``split`` gives every stream row :data:`SPLIT_SLOTS` window positions: piece ``k`` of
the row at stream position ``p`` is announced at window position ``p * SPLIT_SLOTS + k``. The planner
treats positions as opaque increasing integers, so its cursors, skips and partial progress name
pieces exactly like whole samples; a seek to ``p * SPLIT_SLOTS + k`` re-reads row ``p`` and skips its
first ``k`` pieces *without tokenizing them* (their boundaries are computed from the bytes alone).

A document is split when it is longer than max_doc_bytes (kind tokens: max_doc_tokens). Its piece
size is :func:`piece_limit` of its length (64 KiB, more for a document that would need more than
SPLIT_SLOTS pieces, never more than max_doc_bytes; beyond SPLIT_SLOTS x max_doc_bytes the rest is
cut and counted). Piece boundaries are a pure function of the document's UTF-8 bytes and that size
(the prefix rule): starting at byte 0, each piece is the longest prefix of at most ``piece_bytes`` bytes of the
rest that ends before a space (:func:`bounds.cut_point`), else at a character boundary; the next
piece starts with that space. The tokens of a document are the concatenation of the tokens of its
pieces (for a tokenizer that splits at whitespace this equals tokenizing the whole text); only the
last piece carries the EOS. Each piece is tokenized only when the window needs it, so a giant row
costs its raw bytes plus one piece's tokens, never the whole document's tokens.

Pieces keep the row's key for piece 0 (so ``truncate`` and ``split`` agree on the first piece) and a
distinct negative key for the others (:func:`piece_key`): the constructors address spans by
(source, key, start), so every piece must be its own sample there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mixplane.loader.bounds import cut_point
from mixplane.samples import PIECE_SHIFT  # piece keys: -((piece << PIECE_SHIFT) | key) (samples.sample_pass reads them)

SPLIT_SLOTS = 1 << 12  # window positions per stream row: the most pieces one document is delivered as
# preferred piece size: a few of the planner's sequences each, so a window that needs many samples
# (runtime window) is filled by tokenizing a few MB, not min_samples x max_doc_bytes
SPLIT_PIECE_BYTES = 64 << 10
SPLIT_PIECE_TOKENS = 16 << 10  # the same for token rows (kind tokens)


def piece_limit(size: int, preferred: int, most: int) -> int:
    """Piece size for a document of ``size`` bytes (or tokens): ``preferred``, larger for a document
    that would need more than SPLIT_SLOTS pieces, never above ``most`` (max_doc_bytes / max_doc_tokens).
    A pure function of the document, so every re-read cuts the same pieces."""
    return max(1, min(most, max(min(preferred, most), -(-int(size) // SPLIT_SLOTS))))


def window_pos(row_pos: int, piece: int) -> int:
    """Window position of piece ``piece`` of the row at stream position ``row_pos``."""
    return int(row_pos) * SPLIT_SLOTS + int(piece)


def row_of(pos: int) -> int:
    """Stream position of the row a window position belongs to."""
    return int(pos) // SPLIT_SLOTS


def piece_of(pos: int) -> int:
    return int(pos) % SPLIT_SLOTS


def piece_key(key: int, piece: int) -> int:
    """The sample key of a piece: the row's key for piece 0, a distinct negative key for the others."""
    if piece == 0:
        return int(key)
    return -((int(piece) << PIECE_SHIFT) | int(key))


def piece_end(data: memoryview | bytes, start: int, limit: int) -> int:
    """End (exclusive) of the piece of ``data`` that starts at byte ``start``: at most ``limit`` bytes,
    before a space where there is one, else at a character boundary; never empty."""
    rest = memoryview(data)[start:]
    cut = cut_point(rest, limit)
    if cut <= 0:  # a limit shorter than one character: take that character whole
        cut = 1
        while cut < len(rest) and (rest[cut] & 0xC0) == 0x80:
            cut += 1
    return start + cut


def piece_bounds(data: memoryview | bytes, limit: int, max_pieces: int = SPLIT_SLOTS) -> list[tuple[int, int]]:
    """All (start, end) byte ranges of the prefix rule (tests and offline checks; the window walks them lazily)."""
    out: list[tuple[int, int]] = []
    start = 0
    while start < len(data) and len(out) < max_pieces:
        end = piece_end(data, start, limit)
        out.append((start, end))
        start = end
    return out


@dataclass
class PendingDoc:
    """The not yet delivered rest of a split document: its raw text bytes (kind text) or its token ids
    (kind tokens), where the next piece starts, and that piece's number."""

    row_pos: int
    key: int
    piece: int  # number of the next piece
    offset: int  # byte (text) or token (tokens) offset where the next piece starts
    text: memoryview | None = None
    tokens: np.ndarray | None = None

    @property
    def size(self) -> int:
        return len(self.text) if self.text is not None else len(self.tokens) if self.tokens is not None else 0

    @property
    def exhausted(self) -> bool:
        return self.offset >= self.size

    @property
    def pos(self) -> int:
        return window_pos(self.row_pos, self.piece)
