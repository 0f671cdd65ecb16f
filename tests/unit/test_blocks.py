"""Block order of large sources (loader/blocks.py): blocks cover the listing, partitions split them disjointly, and
positions and key rows encode (epoch, block, offset) reversibly -- pure functions, no I/O."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.loader.blocks import (
    MAX_BLOCK_SLOTS, BlockError, BlockLayout, decode_position, encode_position,
)


@pytest.mark.parametrize("files,k", [(1, 4), (10, 4), (100_000, 256), (1000, 1000), (7, 1)])
def test_blocks_cover_the_listing_once_in_blocks_of_k(files, k):
    lay = BlockLayout(files, k, seed=5, source="s")
    got = [lay.members(b) for b in range(lay.num_blocks)]
    assert all(len(m) == k for m in got[:-1]) and 1 <= len(got[-1]) <= k
    allf = np.concatenate(got)
    assert sorted(allf.tolist()) == list(range(files))
    assert all((np.diff(m) > 0).all() for m in got)  # listing order within a block
    again = BlockLayout(files, k, seed=5, source="s")
    assert all((again.members(b) == got[b]).all() for b in range(lay.num_blocks))  # a function of the seed


def test_blocks_mix_the_listing_and_depend_on_seed_and_source():
    a = BlockLayout(10_000, 256, seed=1, source="s").members(0)
    assert int(a.max() - a.min()) > 5000  # drawn over the whole listing, not a run of neighbours
    assert not np.array_equal(a, BlockLayout(10_000, 256, seed=2, source="s").members(0))
    assert not np.array_equal(a, BlockLayout(10_000, 256, seed=1, source="t").members(0))
    with pytest.raises(BlockError, match="block 40 not in"):
        BlockLayout(10_000, 256, seed=1, source="s").members(40)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_partitions_read_disjoint_blocks_that_cover_each_epoch(n):
    lay = BlockLayout(2000, 64, seed=9, source="s")
    for epoch in range(3):
        orders = [lay.order(epoch, p, n) for p in range(n)]
        assert [len(o) for o in orders] == [lay.blocks_per_epoch(p, n) for p in range(n)]
        allb = np.concatenate(orders)
        assert sorted(allb.tolist()) == list(range(lay.num_blocks))
    assert not np.array_equal(lay.order(0, 0, 1), lay.order(1, 0, 1))  # a new block order each epoch
    assert lay.block_seed(0, 3) != lay.block_seed(1, 3) != lay.block_seed(1, 4)


def test_position_round_trip_and_order_at_every_block_boundary():
    rng = np.random.default_rng(0)
    for base_pos, base_epoch, per in [(0, 0, 1), (0, 0, 391), (123_456, 2, 7)]:
        prev = -1
        for e in range(base_epoch, base_epoch + 3):
            for j in range(per if per < 20 else 20):
                for off in [0, 1, int(rng.integers(0, MAX_BLOCK_SLOTS)), MAX_BLOCK_SLOTS - 1]:
                    p = encode_position(base_pos, base_epoch, per, e, j, off)
                    assert decode_position(p, base_pos, base_epoch, per) == (e, j, off)
                    assert p > prev or off != 0 or p == base_pos
                    prev = max(prev, p)
        with pytest.raises(BlockError, match="before this stream's start"):
            decode_position(base_pos - 1, base_pos, base_epoch, per)
    with pytest.raises(BlockError):
        encode_position(0, 0, 3, 0, 3, 0)
    with pytest.raises(BlockError):
        encode_position(0, 0, 3, 0, 0, MAX_BLOCK_SLOTS)
    # positions increase with (epoch, block, offset), in the read order
    seq = [encode_position(0, 0, 4, e, j, o) for e in range(2) for j in range(4) for o in (0, 5, 99)]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)


def test_key_rows_name_block_and_row_and_refuse_an_overfull_block():
    lay = BlockLayout(100_000, 256, seed=0, source="s")
    assert lay.row_bits == 40 - 9  # 391 blocks
    rows = np.array([0, 1, 12345, (1 << lay.row_bits) - 1], np.int64)
    for b in (0, 1, 390):
        kr = lay.key_row(b, rows)
        assert [lay.split_key_row(int(x)) for x in kr] == [(b, int(r)) for r in rows]
        assert int(kr.max()) < (1 << 40)
    with pytest.raises(BlockError, match="lower sources"):
        lay.key_row(0, np.array([1 << lay.row_bits]))
