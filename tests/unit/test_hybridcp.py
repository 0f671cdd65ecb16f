"""Hybrid DP x CP consumers: every sequence on a power-of-two group of ranks sized by its length (long ones spread
over CP, short ones whole on one rank), placed by cost; beside the fixed scheme on real planner steps."""

import numpy as np
import pytest

from mixplane.planner import hybridcp
from mixplane.planner.balance import imbalance
from mixplane.planner.cost import backbone_cost
from mixplane.planner.dgraph import DGraph, DGraphError
from tests.unit.planner_helpers import make_spec
from tests.unit.test_planner_dgraph import MODEL, plan_with


def test_group_sizes_are_the_powers_of_two_that_fit():
    assert hybridcp.group_sizes(np.array([1, 256, 257, 600, 1024]), 256, 8).tolist() == [1, 1, 2, 4, 4]
    with pytest.raises(ValueError, match="needs 8 ranks"):
        hybridcp.group_sizes(np.array([2000]), 256, 6)


def test_every_sequence_lands_on_an_aligned_group_and_costs_are_conserved():
    rng = np.random.default_rng(3)
    L = np.concatenate([rng.integers(1, 200, 300), rng.integers(700, 1024, 6)])
    c = L.astype(float) ** 1.5
    cap = 1.05 * L.sum() / 8
    p = hybridcp.place(L, c, consumers=8, max_tokens=256, capacity=cap)
    assert np.all(p.first % p.group_size == 0) and np.all(p.first + p.group_size <= 8)
    assert p.loads.sum() == pytest.approx(c.sum()) and p.tokens.sum() == pytest.approx(L.sum())
    assert p.tokens.max() <= cap and p.overflow == 0
    tight = hybridcp.place(L, c, consumers=8, max_tokens=256, capacity=L.sum() / 16)  # room for half: the rest overflows
    assert tight.overflow > 0 and tight.tokens.sum() == pytest.approx(L.sum())
    assert np.all(p.group_size[L <= 256] == 1) and np.all(p.group_size[L > 512] == 4)
    assert imbalance(p.loads) < 1.02
    assert p.consumers(int(np.argmax(L))).tolist() == list(range(p.first[np.argmax(L)], p.first[np.argmax(L)] + 4))


def test_short_sequences_stay_whole_and_even_out_what_fixed_cp_cannot():
    # dp 2 x cp 2, rows of 512: replica 0 holds one 512-token document, replica 1 eight of 64 (same tokens)
    S, cp, dp = 512, 2, 2
    L = np.array([512] + [64] * 8)
    c = L + L.astype(float) ** 2 / 100  # attention makes the long one dearer
    fixed = hybridcp.fixed_loads(np.array([[c[0] / 2, c[0] / 2], [c[1:].sum() / 2, c[1:].sum() / 2]]), dp)
    p = hybridcp.place(L, c, consumers=dp * cp, max_tokens=S // cp, capacity=S // cp)
    assert p.group_size[0] == 2 and np.all(p.group_size[1:] == 1)
    assert imbalance(p.loads) <= imbalance(fixed)
    assert p.cp_token_fraction(L) == pytest.approx(0.5)  # only the long document goes through CP


def test_dgraph_hybrid_cp_on_planner_steps():
    spec = make_spec(dp=2, cp=2, rows=16, microbatches=2, seq_len=512, window=128, model=MODEL)
    seen = {}

    def strategy(ctx):
        g = DGraph(ctx).mix().distribute("CP").cost(backbone_cost(ctx.spec)).balance("greedy", level="both")
        p = g.hybrid_cp()
        seen["p"], seen["stats"], seen["L"] = p, dict(ctx.stats["hybrid_cp"]), ctx.pieces.length.copy()
        with pytest.raises(DGraphError, match="text"):
            g.images().hybrid_cp()
        return g.plan()

    plan_with(spec, strategy, steps=2)
    p, st = seen["p"], seen["stats"]
    assert st["consumers"] == 4 and p.loads.shape == (4,) and st["overflow"] == 0
    assert p.tokens.max() <= 8 * 256  # a rank holds no more tokens than a CP rank of the fixed scheme
    assert 0.0 < st["cp_token_fraction"] < 1.0  # some pieces kept whole, some spread
    assert st["imbalance_hybrid"] <= st["imbalance_fixed"] + 1e-9
