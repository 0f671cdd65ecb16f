"""Per-loader instructions of a step: spans to every constructor of their dp rank, pixels only to the
constructor of the rank that encodes the image, retire once."""

import numpy as np

from mixplane.layout import StepLayout
from mixplane.planner.routing import Fanout, loader_instructions


def make_layout():
    # 2 dp ranks x 1 microbatch x 1 row of 16 tokens; source 0 text, source 1 image-text
    return StepLayout(step=3, seq_len=16, dp=2, microbatches=1, rows_per_microbatch=1,
                      seg_row=[0, 0, 1], seg_source=[0, 1, 1], seg_key=[10, 20, 21], seg_start=[0, 0, 4],
                      seg_len=[8, 8, 6], img_source=[1], img_key=[20], img_rank=[3], img_patches=[8])


def test_spans_fan_out_and_retire_once_pixels_go_to_the_encoder():
    lay = make_layout()
    # pieces in a different order than the layout; (replica, pos) per piece
    src, key, start = np.array([1, 0, 1]), np.array([21, 10, 20]), np.array([4, 0, 0])
    rep, pos = np.array([0, 0, 0]), np.array([7, 3, 5])
    retired = np.array([0, 1, 1], np.uint8)
    dp_fan = Fanout.from_lists([[0, 1], [1]])  # dp 0 is served by constructors 0 and 1 (split across nodes)
    rank_fan = Fanout.from_lists([[0], [0], [1], [2]])  # rank 3 (the image's encoder) is constructor 2's
    out = loader_instructions(lay, src, key, start, rep, pos, retired, dp_fan, rank_fan)
    text = out[(0, 0)]
    assert text.pos.tolist() == [3, 3] and sorted(text.dest.tolist()) == [0, 1]
    assert text.retire.sum() == 1 and text.img.sum() == 0  # retired with its last copy only
    img = out[(1, 0)]
    rows = sorted(zip(img.pos.tolist(), img.start.tolist(), img.len.tolist(), img.dest.tolist(), img.img.tolist()))
    assert rows == [(5, 0, 0, 2, 1),  # image only: constructor 2 gets no token of sample 20
                    (5, 0, 8, 0, 0), (5, 0, 8, 1, 0),  # its first span, no pixels (they are not encoded there)
                    (7, 4, 6, 1, 0)]


def test_pixels_ride_with_a_span_when_the_encoder_constructor_gets_one():
    lay = make_layout()
    out = loader_instructions(lay, lay.seg_source, lay.seg_key, lay.seg_start, np.zeros(3, np.int64),
                              np.array([3, 5, 7]), np.zeros(3, np.uint8), Fanout.from_lists([[0], [1]]),
                              Fanout.from_lists([[0], [0], [1], [0]]))  # rank 3 is constructor 0's: it has span (20, 0)
    img = out[(1, 0)]
    assert (img.len > 0).all()  # no image-only instruction needed
    assert img.img[(img.pos == 5) & (img.dest == 0)].tolist() == [1]
