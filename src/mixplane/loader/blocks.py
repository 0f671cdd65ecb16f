"""Block order of a large source read lazily: which files form each block, the blocks' read order per epoch and
partition, and stream positions and sample keys as (epoch, block, offset) -- pure functions of the listing's size,
the seed and the source name, no I/O.

A source of many files (``sources[].lazy_index_files``) is not indexed whole before it serves: its files, in
listing (path) order, are permuted once by the seed and cut into blocks of ``block_files`` files; each epoch
draws an order of the blocks from the listing alone, partitions take every N-th block of it, and a block's files
are indexed only when the read order reaches them (their pages then shuffled within the block by the page-mode
machinery). A stream position is ``base + ((epoch - base_epoch) * blocks_per_epoch + j) << OFFSET_BITS + offset``
(j: the block's place in the partition's order of that epoch), so a resume computes its block from the position
alone, without indexing any earlier block; positions are increasing but not dense (a block owns 2^30 slots). A
sample's row in its key is ``block << row_bits | row in the block``. docs/loader.md, Start-up on many files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.loader.shuffle import epoch_rng
from mixplane.samples import EPOCH_SHIFT
from mixplane.spec import SourceSpec

OFFSET_BITS = 30  # slots a block owns in stream positions (its rows must fit)
MAX_BLOCK_SLOTS = 1 << OFFSET_BITS
LOOKAHEAD_BLOCKS = 1  # blocks indexed in the background beyond the one being read
RECENT_BLOCKS = 4  # blocks whose row starts a stream keeps to name the file of a key (and a profile counts)


class BlockError(MixplaneError, ValueError):
    """A position, block or row outside what a block layout can express; the message says which."""


@dataclass
class BlockLayout:
    """Blocks of a listing of ``num_files`` files (ids: their index in the sorted listing)."""

    num_files: int
    block_files: int
    seed: int
    source: str
    _perm: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_files < 1:
            raise BlockError(f"source {self.source!r}: a block layout needs at least one file")
        if self.block_files < 1:
            raise BlockError(f"source {self.source!r}: block_files must be >= 1, not {self.block_files}")

    @property
    def num_blocks(self) -> int:
        return -(-self.num_files // self.block_files)

    @property
    def row_bits(self) -> int:
        """Bits of a sample key's row left for the row within its block (the block id takes the rest)."""
        return EPOCH_SHIFT - max(1, (self.num_blocks - 1).bit_length())

    def _permutation(self) -> np.ndarray:
        if self._perm is None:  # the same for every epoch: a block's files are indexed (and packed) once
            self._perm = epoch_rng(self.seed, self.source, 0, 21).permutation(self.num_files).astype(np.int64)
        return self._perm

    def members(self, block: int) -> np.ndarray:
        """File ids of ``block``, ascending (read in listing order within the block)."""
        if not 0 <= block < self.num_blocks:
            raise BlockError(f"source {self.source!r}: block {block} not in [0, {self.num_blocks})")
        k = self.block_files
        return np.sort(self._permutation()[block * k : (block + 1) * k])

    def blocks_per_epoch(self, partition: int, num_partitions: int) -> int:
        """Blocks partition ``partition`` of ``num_partitions`` reads in every epoch."""
        return len(range(partition, self.num_blocks, num_partitions))

    def order(self, epoch: int, partition: int, num_partitions: int) -> np.ndarray:
        """The blocks partition ``partition`` reads in ``epoch``, in read order: every N-th block of one epoch-wide
        permutation, so partitions are disjoint and together cover the source whatever N is."""
        perm = epoch_rng(self.seed, self.source, epoch, 22).permutation(self.num_blocks).astype(np.int64)
        return perm[partition::num_partitions]

    def block_seed(self, epoch: int, block: int) -> int:
        """The seed of a block's page order in an epoch (a new shuffle of its pages each epoch)."""
        return int(epoch_rng(self.seed, self.source, epoch, 23, block).integers(0, 2**63 - 1))

    def key_row(self, block: int, row: np.ndarray) -> np.ndarray:
        """Sample-key rows of rows of ``block`` (their index within the block's files)."""
        row = np.asarray(row, np.int64)
        if len(row) and int(row.max()) >> self.row_bits:
            raise BlockError(f"source {self.source!r}: block {block} holds more than 2^{self.row_bits} rows "
                             "(lower sources[].block_files)")
        return (np.int64(block) << np.int64(self.row_bits)) | row

    def split_key_row(self, key_row: int) -> tuple[int, int]:
        """(block, row within the block) of a sample key's row."""
        return int(key_row) >> self.row_bits, int(key_row) & ((1 << self.row_bits) - 1)


def lazy_indexing(source: SourceSpec, num_files: int) -> bool:
    """Whether a source of ``num_files`` listed files is read block by block (static, page mode, large enough)."""
    start = source.block_read_from
    return start is not None and num_files >= start


def block_order(source: SourceSpec, files_listed: int) -> BlockLayout | None:
    """The block layout of a source of ``files_listed`` listed files its loaders read block by block
    (:func:`lazy_indexing`), None when they read the whole source's page order. Its seed is 0: the blocks' count
    and sizes do not depend on it."""
    if files_listed < 1 or not lazy_indexing(source, files_listed):
        return None
    return BlockLayout(files_listed, int(source.block_files), 0, source.name)


def encode_position(base_pos: int, base_epoch: int, per_epoch: int, epoch: int, j: int, offset: int) -> int:
    """Stream position of slot ``offset`` of the ``j``-th block of ``epoch`` (positions count from ``base_pos``, the
    start of ``base_epoch``; ``per_epoch`` blocks each epoch)."""
    if not (epoch >= base_epoch and 0 <= j < per_epoch and 0 <= offset < MAX_BLOCK_SLOTS):
        raise BlockError(f"no position for epoch {epoch} block {j} offset {offset} "
                         f"(from epoch {base_epoch}, {per_epoch} blocks an epoch)")
    return base_pos + ((((epoch - base_epoch) * per_epoch) + j) << OFFSET_BITS) + offset


def decode_position(position: int, base_pos: int, base_epoch: int, per_epoch: int) -> tuple[int, int, int]:
    """(epoch, j, offset) of a stream position: the inverse of :func:`encode_position` (offset < 2^30)."""
    if position < base_pos:
        raise BlockError(f"position {position} is before this stream's start ({base_pos})")
    if per_epoch < 1:
        raise BlockError("a partition without blocks has no positions")
    slot, offset = divmod(position - base_pos, MAX_BLOCK_SLOTS)
    e, j = divmod(slot, per_epoch)
    return base_epoch + e, j, offset
