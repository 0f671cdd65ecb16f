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


def test_place_in_rows_gives_every_piece_a_row_of_its_group_replica():
    rng = np.random.default_rng(5)
    L = np.concatenate([rng.integers(1, 128, 200), rng.integers(300, 512, 12)])
    c = L.astype(float) ** 1.5
    dp, cp, rpr, S = 2, 4, 20, 512
    p, rows = hybridcp.place_in_rows(L, c, dp, cp, S // cp, rpr * S / cp, rpr, S)
    assert np.array_equal(rows // rpr, p.first // cp)  # the row's replica is the group's
    assert np.bincount(rows, weights=L, minlength=dp * rpr).max() <= S
    assert np.all(p.first % p.group_size == 0) and np.all(p.first % cp + p.group_size <= cp)
    assert p.loads.sum() == pytest.approx(c.sum()) and imbalance(p.loads) < 1.05
    # three pieces of 400 tokens, one row per replica: the third finds no row
    assert hybridcp.place_in_rows(np.array([400, 400, 400]), np.ones(3), 2, 2, 256, 1024, 1, 512) is None


def test_spread_replicas_is_the_even_split_of_each_replica():
    p = hybridcp.spread_replicas(np.array([10, 20, 30]), np.array([1.0, 2.0, 3.0]), np.array([0, 1, 1]), dp=2, cp=2)
    assert p.group_size.tolist() == [2, 2, 2] and p.first.tolist() == [0, 2, 2]
    assert p.loads.tolist() == [0.5, 0.5, 2.5, 2.5] and p.tokens.tolist() == [5, 5, 25, 25]


def test_within_replicas_places_each_replica_over_its_own_cp_ranks():
    L = np.array([500, 100, 100, 512, 60, 60, 60, 60])
    rep = np.array([0, 0, 0, 1, 1, 1, 1, 1])
    p = hybridcp.within_replicas(L, L.astype(float), rep, dp=2, cp=2, max_tokens=256, capacity=512)
    assert np.array_equal(p.first // 2, rep) and np.all(p.first % p.group_size == 0)
    assert p.group_size.tolist() == [2, 1, 1, 2, 1, 1, 1, 1]
    assert p.tokens.sum() == L.sum() and p.overflow == 0


def _hybrid_plans(steps=3, **kw):
    spec = make_spec(dp=2, cp=4, rows=16, microbatches=2, seq_len=512, window=128, model=MODEL,
                     strategy="llm_balance", options={"hybrid_cp": True, **kw})
    from mixplane.planner.core import StepPlanner
    from mixplane.planner.strategies import resolve_strategy
    from tests.unit.planner_helpers import run
    return spec, run(StepPlanner(spec, resolve_strategy(spec)), steps)


def test_delivered_hybrid_layout_names_every_piece_group():
    from mixplane.layout import StepLayout, layout_digest
    spec, plans = _hybrid_plans()
    for plan in plans:
        lay = plan.layout
        assert lay.hybrid_cp == 4 and len(lay.seg_cp_size) == len(lay.seg_row)
        k, f = lay.seg_cp_size.astype(int), lay.seg_cp_first.astype(int)
        # the group size the length needs (at most seq_len / cp tokens of a piece per rank), aligned inside cp
        st = plan.stats["hybrid_cp"]
        need = hybridcp.group_sizes(lay.seg_len, 512 // 4, 8)
        if st["delivered"] == "spread_replicas":
            assert np.all(k == 4)
        else:
            assert np.array_equal(k, need)
        assert np.all(f % k == 0) and np.all(f + k <= 4)
        assert st["delivered"] == "spread_replicas" or ((k == 1).any() and (k > 1).any())
        assert st["delivered"] in ("dp_x_cp", "within_replicas", "spread_replicas") and st["imbalance_hybrid"] <= st["imbalance_fixed"] + 1e-9
        # every rank holds at most what a CP rank of the fixed scheme holds
        tok = np.zeros((2, 4))
        for d, ff, kk, ln in zip(lay.seg_row // lay.rows_per_rank, f, k, lay.seg_len):
            tok[d, ff:ff + kk] += ln / kk
        assert tok.max() <= 8 * 512 / 4 * (1 + 1e-9) or st["overflow"] > 0
        # the wire form carries the groups; a constructor's part keeps them; the digest covers them
        back = StepLayout.from_parts(lay.meta(), lay.arrays())
        assert np.array_equal(back.seg_cp_first, lay.seg_cp_first) and back.hybrid_cp == 4
        part = lay.select_ranks([1])
        assert np.array_equal(part.seg_cp_size, lay.seg_cp_size[lay.seg_row // lay.rows_per_rank == 1])
        whole = np.zeros_like(lay.seg_cp_first)
        moved = StepLayout.from_parts(lay.meta(), {**lay.arrays(), "seg_cp_first": whole, "seg_cp_size": whole + 1})
        assert layout_digest(moved) != layout_digest(lay)
    assert any(p.stats["hybrid_cp"]["delivered"] == "dp_x_cp" for p in plans)
    # planning again gives the same layouts, bit for bit (what replay and resume rely on)
    _, again = _hybrid_plans()
    assert [layout_digest(p.layout) for p in again] == [layout_digest(p.layout) for p in plans]


def test_hybrid_layout_errors_name_the_step_and_segment():
    from mixplane.layout import StepLayout
    one = np.ones(2, np.int64)
    base = dict(seg_row=one - 1, seg_source=one - 1, seg_key=one - 1, seg_start=one - 1, seg_len=one)
    with pytest.raises(ValueError, match="step 7: segment 1: CP group of 2 ranks from cp rank 1"):
        StepLayout(7, 8, 1, 1, 1, **base, hybrid_cp=2, seg_cp_first=np.array([0, 1]), seg_cp_size=np.array([1, 2])).validate()
    with pytest.raises(ValueError, match="not hybrid_cp"):
        StepLayout(7, 8, 1, 1, 1, **base, seg_cp_first=np.array([0, 0]), seg_cp_size=np.array([1, 1])).validate()
    with pytest.raises(ValueError, match="missing array 'seg_cp_size'"):
        lay = StepLayout(7, 8, 1, 1, 1, **base, hybrid_cp=2, seg_cp_first=np.array([0, 0]), seg_cp_size=np.array([1, 1]))
        StepLayout.from_parts(lay.meta(), {k: v for k, v in lay.arrays().items() if k != "seg_cp_size"})


def test_hybrid_delivery_refuses_what_it_cannot_deliver():
    spec = make_spec(dp=2, cp=2, rows=8, microbatches=2, seq_len=512, window=128, model=MODEL)

    def cp_broadcast(ctx):
        g = DGraph(ctx).mix().distribute("CP").cost(backbone_cost(ctx.spec)).balance("greedy")
        g.hybrid_cp(deliver=True)
        return g.broadcast_at("CP").plan()

    with pytest.raises(DGraphError, match=r"broadcast_at\(CP\)"):
        plan_with(spec, cp_broadcast)
    spec3 = make_spec(dp=2, cp=3, rows=8, microbatches=2, seq_len=516, window=128, model=MODEL)

    def deliver(ctx):
        g = DGraph(ctx).mix().distribute("CP").cost(backbone_cost(ctx.spec))
        g.hybrid_cp(deliver=True)
        return g.plan()

    with pytest.raises(DGraphError, match="cp 3 is not a power of two"):
        plan_with(spec3, deliver)


def test_constructor_columns_carry_each_constructor_its_groups():
    from mixplane.planner.routing import constructor_columns
    _, plans = _hybrid_plans(steps=1)
    lay = plans[0].layout
    for ranks in ([[0], [1]], [[1], [0]], [[0, 1]]):
        cols = constructor_columns(lay, ranks)
        for c, r in enumerate(ranks):
            want = lay.select_ranks(r).arrays()
            got = cols.arrays(c)
            assert set(got) == set(want)
            for k in want:
                assert np.array_equal(got[k], want[k]), (ranks, c, k)


def test_validation_names_what_hybrid_delivery_cannot_take():
    from mixplane.spec import SpecError, parse_spec

    def doc(cp, broadcast, encoder=False):
        d = make_spec(dp=2, cp=cp, rows=8, microbatches=2, seq_len=12 * cp, strategy="llm_balance", encoder=encoder,
                      options={"hybrid_cp": True, "broadcast": broadcast}).model_dump(mode="json", exclude_none=True)
        return d

    parse_spec(doc(2, ["TP"]))
    with pytest.raises(SpecError) as e:
        parse_spec(doc(3, ["TP", "CP"], encoder=True))
    msg = str(e.value)
    assert "strategy.options.hybrid_cp" in msg and "power of two, got 3" in msg
    assert "broadcast CP" in msg and "text only; image_text source(s): s0" in msg
