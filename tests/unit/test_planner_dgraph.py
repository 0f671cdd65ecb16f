"""DGraph primitives over real planner steps: mix, distribute, cost, balance, broadcast_at, plan, hooks."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.planner.core import CoverageError, StepPlanner, check_coverage
from mixplane.planner.cost import backbone_cost, encoder_cost, token_cost
from mixplane.planner.dgraph import DGraph, DGraphError, _cp_shard_costs
from mixplane.planner.balance import imbalance

from mixplane.samples import make_key

from .planner_helpers import fill, make_spec, run

MODEL = {"backbone": {"hidden": 512, "layers": 4, "heads": 8, "vocab": 1000}}


def plan_with(spec, fn, steps=1, **kw):
    """Run `fn(ctx)` as the strategy for a few steps; returns the plans."""
    return run(StepPlanner(spec, fn), steps, **kw)


def pieces_multiset(layout):
    return sorted(zip(layout.seg_source.tolist(), layout.seg_key.tolist(), layout.seg_start.tolist(), layout.seg_len.tolist()))


def test_balanced_plan_is_a_rearrangement_of_the_mixed_step():
    spec = make_spec(dp=4, rows=32, microbatches=4, seq_len=512, model=MODEL)
    seen = []

    def strategy(ctx):
        g = DGraph(ctx).mix()
        van = g.plan()
        g2 = DGraph(ctx).distribute("DP").cost(backbone_cost(ctx.spec)).balance("greedy")
        lay = g2.plan()
        seen.append((van, lay, g2))
        return lay

    for plan, (van, bal, g) in zip(plan_with(spec, strategy, steps=4), seen):
        assert pieces_multiset(van) == pieces_multiset(bal)
        check_coverage(bal, plan.pieces)
        # whole rows move: every row of the balanced layout is a row of the vanilla one
        def rows_of(lay):
            return sorted(tuple(sorted(zip(lay.seg_key[lay.seg_row == r].tolist(), lay.seg_start[lay.seg_row == r].tolist())))
                          for r in range(lay.rows))
        assert rows_of(van) == rows_of(bal)
        costs = backbone_cost(spec)({"length": bal.seg_len.astype(np.int64)})
        per_rank = np.bincount(bal.seg_row // bal.rows_per_rank, weights=costs, minlength=bal.dp)
        per_rank_v = np.bincount(van.seg_row // van.rows_per_rank, weights=backbone_cost(spec)({"length": van.seg_len.astype(np.int64)}), minlength=van.dp)
        assert imbalance(per_rank) <= imbalance(per_rank_v) + 1e-12
        assert g.balanced["imbalance_after"] <= g.balanced["imbalance_before"] + 1e-12
        assert plan.stats["text"]["method"] == "greedy"


def test_balance_evens_ranks_with_heavy_tailed_rows():
    spec = make_spec(dp=4, rows=64, microbatches=4, seq_len=1024, model=MODEL, window=256)
    out = {}

    def strategy(ctx):
        van = DGraph(ctx).mix().distribute("DP").cost(backbone_cost(ctx.spec))
        before = imbalance(van.bucket_costs())
        for m in ("greedy", "karmarkar_karp"):
            g = DGraph(ctx).distribute("DP").cost(backbone_cost(ctx.spec)).balance(m)
            out[m] = imbalance(g.bucket_costs())
        out["before"] = before
        return g.plan()

    plan_with(spec, strategy, steps=2)
    assert out["greedy"] < 1.01 and out["karmarkar_karp"] < 1.01
    assert out["greedy"] <= out["before"]


def test_microbatches_get_whole_rows_and_even_costs():
    spec = make_spec(dp=2, rows=32, microbatches=4, seq_len=256, model=MODEL)
    got = {}

    def strategy(ctx):
        g = DGraph(ctx).mix().distribute("DP").cost(backbone_cost(ctx.spec)).balance("greedy")
        lay = g.plan()
        rc = np.bincount(lay.seg_row, weights=backbone_cost(ctx.spec)({"length": lay.seg_len.astype(np.int64)}), minlength=lay.rows)
        got["mb"] = rc.reshape(lay.dp * lay.microbatches, lay.rows_per_microbatch).sum(axis=1)
        return lay

    plan_with(spec, strategy)
    mb = got["mb"]
    assert len(mb) == 8 and imbalance(mb) < 1.2


def test_keep_global_batch_false_repacks_samples_and_stays_complete():
    spec = make_spec(dp=2, rows=16, microbatches=2, seq_len=512, model=MODEL)
    res = {}

    def strategy(ctx):
        g = DGraph(ctx).mix().distribute("DP").cost(backbone_cost(ctx.spec)).balance("greedy", keep_global_batch=False)
        res["stats"] = dict(g.balanced)
        return g.plan()

    for plan in plan_with(spec, strategy, steps=3):
        check_coverage(plan.layout, plan.pieces)
        assert np.all(plan.layout.row_fill() <= 512)
    assert res["stats"]["repack"] in ("balanced", "kept mix packing (balanced re-packing could not place every piece)")


def test_intra_level_reorders_documents_to_even_cp_shards():
    spec = make_spec(dp=2, cp=2, rows=8, microbatches=2, seq_len=1024, model=MODEL)
    res = {}

    def strategy(ctx):
        base = DGraph(ctx).mix().distribute("CP").cost(backbone_cost(ctx.spec))
        res["before"] = base.shard_costs().max(axis=1).sum()
        g = DGraph(ctx).distribute("CP").cost(backbone_cost(ctx.spec)).balance("greedy", level="intra")
        res["after"] = g.shard_costs().max(axis=1).sum()
        lay = g.plan()
        # intra-level never moves a piece to another row
        assert pieces_multiset(lay) == pieces_multiset(base.plan())
        assert np.array_equal(np.sort(g.rows()), np.sort(base.rows()))
        return lay

    plan_with(spec, strategy, steps=3)
    assert res["after"] <= res["before"]


# One source whose stream packs (best fit, seq_len 1024) into four full rows, in mix's order:
# [768, 128, 128] (long document first), [768, 256], [512, 4 x 128], [8 x 128].
PATTERN = np.array([768, 128, 128, 768, 256, 512, 128, 128, 128, 128] + [128] * 8)


def pattern_meta(source, replica, pos, seq_len):
    pos = np.asarray(pos, np.int64)
    return make_key(0, pos * 8 + replica), PATTERN[pos % len(PATTERN)], np.zeros(len(pos), np.int64)


def cp_spec(microbatches=2):
    return make_spec(sources=1, dp=2, cp=2, rows=4, microbatches=microbatches, seq_len=1024, model=MODEL)


def zigzag_busiest(flops, pairs_on_busiest_rank):
    """Hand formula for a full row under cp=2: each rank holds 512 tokens; row cost = 2 x busiest rank."""
    return 2 * (flops.linear_per_token * 512 + flops.per_pair * pairs_on_busiest_rank)


def test_intra_level_strictly_lowers_the_busiest_microbatch():
    """Row 0 = [768, 128, 128]: under zig-zag (chunks of 256; rank 0 = chunks 0, 3, rank 1 = chunks 1, 2)
    the long document first puts its positions 256..767 on rank 1: 262400 attention pairs. Putting it
    last leaves the busiest rank 180480 pairs. Row 1 = [256, 768] is already at its best (196864)."""
    res = {}

    def strategy(ctx):
        g = DGraph(ctx).mix().distribute("CP").cost(backbone_cost(ctx.spec))
        key = np.arange(len(g.pieces))
        key[[3, 4]] = key[[4, 3]]  # row 1 as [256, 768]
        g.set_rows(g.rows(), key)
        mb = lambda: g.row_costs().reshape(ctx.dp * ctx.microbatches, -1).sum(axis=1)
        res["before"], rows_before = mb(), g.rows().copy()
        g.balance("greedy", level="intra")
        res["after"] = mb()
        assert np.array_equal(g.rows(), rows_before)  # documents stay in their rows
        res["flops"] = g.cost_fn.flops
        return g.plan()

    plan_with(cp_spec(), strategy, meta=pattern_meta)
    f, before, after = res["flops"], res["before"], res["after"]
    assert np.isclose(before[0], zigzag_busiest(f, 262400)) and np.isclose(after[0], zigzag_busiest(f, 180480))
    assert np.isclose(after[1], zigzag_busiest(f, 196864))
    assert after.max() < before.max() * (1 - 1e-3)  # the busiest microbatch strictly cheaper
    assert np.all(after <= before * (1 + 1e-12))


def test_distribute_cp_deals_rows_by_their_busiest_shard():
    """distribute('CP'): rows still go to DP replicas, but a row costs its busiest zig-zag shard x cp, not
    the sum of its documents. Two rows whose sums differ only slightly but whose shards are uneven
    (long document first) end up apart under 'CP'; under 'DP' they share a replica."""
    res = {}

    def strategy(ctx):
        dims = ctx.spec
        rows_key = {}

        def graph(axis):
            g = DGraph(ctx).mix().distribute(axis).cost(backbone_cost(dims))
            if not rows_key:
                key = np.arange(len(g.pieces))
                key[[3, 4]] = key[[4, 3]]  # row 1 as [256, 768]
                rows_key["v"] = (g.rows().copy(), key)
            g.set_rows(*rows_key["v"])
            return g

        cp, dp = graph("CP"), graph("DP")
        res["cp_rows"] = cp.row_costs()
        res["sum_rows"] = dp.row_costs()
        res["shard_max"] = cp.shard_costs().max(axis=1)
        cp.balance("greedy", level="inter")
        dp.balance("greedy", level="inter")
        per_rank = ctx.rows // ctx.dp
        orig = rows_key["v"][0]

        def bucket_of_row(g):  # the DP replica every original row went to
            out = np.zeros(ctx.rows, np.int64)
            out[orig] = g.rows() // per_rank
            return out

        res["cp_assign"], res["dp_assign"] = bucket_of_row(cp), bucket_of_row(dp)

        def busiest(assign):  # busiest replica under the CP cost model
            return np.bincount(assign, weights=res["cp_rows"], minlength=ctx.dp).max()

        res["busiest_cp"], res["busiest_dp"] = busiest(res["cp_assign"]), busiest(res["dp_assign"])
        return cp.plan()

    plan_with(cp_spec(), strategy, meta=pattern_meta)
    assert np.allclose(res["cp_rows"], 2 * res["shard_max"])  # the cost model of 'CP'
    assert res["cp_rows"][0] > res["sum_rows"][0] * 1.01  # [768, 128, 128]: uneven shards cost more than their sum
    assert np.allclose(res["cp_rows"][3], res["sum_rows"][3])  # 8 x 128: even shards, same as the sum
    assert not np.array_equal(res["cp_assign"], res["dp_assign"])  # the cost model changes the assignment
    assert res["busiest_cp"] < res["busiest_dp"] * (1 - 1e-3)


def test_level_both_orders_documents_then_deals_rows():
    res = {}

    def strategy(ctx):
        def fresh():
            g = DGraph(ctx).mix().distribute("CP").cost(backbone_cost(ctx.spec))
            return g
        base = fresh()
        res["mix_rows"] = sorted(map(tuple, (np.sort(base.pieces.key[base.rows() == r]) for r in range(ctx.rows))))
        res["mix_busiest"] = base.bucket_costs().max()
        intra = fresh().balance("greedy", level="intra")
        res["intra_row_costs"] = np.sort(intra.row_costs())
        both = fresh().balance("greedy", level="both")
        res["both_rows"] = sorted(map(tuple, (np.sort(both.pieces.key[both.rows() == r]) for r in range(ctx.rows))))
        res["both_row_costs"] = np.sort(both.row_costs())
        res["both_busiest"] = both.bucket_costs().max()
        res["both_stats"] = dict(both.balanced)
        return both.plan()

    for plan in plan_with(make_spec(dp=4, cp=2, rows=16, microbatches=2, seq_len=1024, model=MODEL), strategy, steps=2):
        check_coverage(plan.layout, plan.pieces)
        assert res["both_rows"] == res["mix_rows"]  # whole rows move, documents only reorder inside them
        assert np.allclose(res["both_row_costs"], res["intra_row_costs"])  # intra's orders survive the dealing
        assert res["both_busiest"] < res["mix_busiest"]  # and the dealing evens the replicas
        assert res["both_stats"]["level"] == "both"


def test_broadcast_at_accepts_tp_pp_cp_and_refuses_dp():
    spec = make_spec(model=MODEL)
    errors = {}

    def strategy(ctx):
        g = DGraph(ctx).mix()
        for dim in ("DP", "XX"):
            with pytest.raises(ValueError, match="allowed: TP, PP, CP") as e:
                g.broadcast_at(dim)
            errors[dim] = str(e.value)
        assert g.broadcast_at("tp").broadcast == ["tp"] and ctx.broadcast == ["tp"]
        g.broadcast_at("CP").broadcast_at("pp")
        assert ctx.broadcast == ["tp", "cp", "pp"]
        assert np.array_equal(g.fetchers(), g.module.fetchers(["tp", "cp", "pp"]))
        return g.plan()

    plan_with(spec, strategy)
    assert "different data" in errors["DP"] and "unknown" in errors["XX"]


def test_cp_shards_follow_the_zigzag_split():
    from mixplane.planner.cost import BackboneCost
    from mixplane.spec import ModelDims

    cost = BackboneCost(ModelDims(hidden=64, layers=1, heads=4, vocab=1))
    S, cp = 16, 2  # chunks of 4 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    rows = np.array([0])
    L = np.array([16])
    c = cost({"length": L})
    sc = _cp_shard_costs(rows, np.array([0]), L, c, cost, 1, S, cp)
    assert sc.sum() == pytest.approx(c.sum())
    lin, pair = cost.flops.linear_per_token, cost.flops.per_pair
    r0 = 8 * lin + pair * (sum(range(1, 5)) + sum(range(13, 17)))
    assert sc[0, 0] == pytest.approx(r0)
    # one causal document over the whole row: zig-zag balances it exactly
    assert sc[0, 0] == pytest.approx(sc[0, 1])


def test_vlm_images_go_to_every_encoder_rank():
    spec = make_spec(dp=2, pp=2, tp=2, encoder=True, rows=16, microbatches=2, seq_len=512, window=128,
                     model={"backbone": MODEL["backbone"], "encoder": {"hidden": 256, "layers": 4, "heads": 4}})
    res = {}

    def strategy(ctx):
        g = DGraph(ctx).mix().distribute("DP").cost(backbone_cost(ctx.spec)).balance("greedy")
        img = g.images().distribute("WORLD").cost(encoder_cost(ctx.spec)).balance("greedy")
        lay = g.broadcast_at("TP").plan(img)
        van = DGraph(ctx).plan()
        res["van"], res["lay"] = van, lay
        return lay

    plans = plan_with(spec, strategy, steps=2, images=True)
    lay, van = res["lay"], res["van"]
    assert len(lay.img_key) > 0
    ec = encoder_cost(spec)
    bal_loads = np.bincount(lay.img_rank, weights=ec({"patches": lay.img_patches.astype(np.int64)}), minlength=8)
    van_loads = np.bincount(van.img_rank, weights=ec({"patches": van.img_patches.astype(np.int64)}), minlength=8)
    assert set(lay.img_rank.tolist()) <= set(range(8)) and (bal_loads > 0).sum() == 8
    assert bal_loads.max() <= van_loads.max()
    # vanilla keeps images on their own replica's ranks
    tree = StepPlanner(spec).tree
    img_rows = {}
    for r, k in zip(van.seg_row.tolist(), van.seg_key.tolist()):
        img_rows.setdefault(k, r)
    for k, rank in zip(van.img_key.tolist(), van.img_rank.tolist()):
        assert tree.backbone.coords_of(rank).dp == img_rows[k] // van.rows_per_rank
    assert plans[-1].broadcast == ("tp",)


def test_primitives_reject_misuse():
    spec = make_spec(model=MODEL)
    errors = []

    def strategy(ctx):
        g = DGraph(ctx).mix()
        for bad in (lambda: g.distribute("TP"), lambda: g.balance("greedy"), lambda: g.cost(lambda m: np.ones(3)),
                    lambda: g.cost(lambda m: -np.ones(len(g))), lambda: g.broadcast_at("XX"),
                    lambda: g.distribute("DP").cost(token_cost).balance("random"),
                    lambda: g.balance("greedy", level="sideways"), lambda: g.on("never", print)):
            with pytest.raises(DGraphError) as e:
                bad()
            errors.append(str(e.value))
        return g.plan()

    plan_with(spec, strategy)
    assert all(e.startswith("step 0") or "hook" in e for e in errors)


def test_hooks_and_low_level_rows():
    spec = make_spec(dp=2, rows=8, microbatches=2, seq_len=256, model=MODEL)
    calls = []

    def strategy(ctx):
        g = DGraph(ctx).mix()
        g.on("cost", lambda gg: calls.append("cost")).on("balance", lambda gg: calls.append("balance"))
        g.on("plan", lambda gg: calls.append("plan"))
        g.distribute("DP").cost(token_cost).balance("none")
        # reverse the rows with the low-level hook
        g.assign_rows(np.arange(ctx.rows)[::-1].copy())
        assert g.summary_buffer()["s0"]["samples"] >= 0
        return g.plan()

    plans = plan_with(spec, strategy)
    assert calls == ["cost", "balance", "plan"]
    check_coverage(plans[0].layout, plans[0].pieces)


def test_a_strategy_that_drops_a_piece_is_refused_and_state_rolls_back():
    spec = make_spec(model=MODEL)
    planner = StepPlanner(spec, lambda ctx: DGraph(ctx).mix().plan_raw(np.zeros(len(ctx.pieces), np.int64)))
    fill(planner)
    before = planner.cursor()
    with pytest.raises(ValueError):  # everything in row 0 overflows seq_len
        planner.plan()
    assert planner.cursor() == before

    def dropper(ctx):
        lay = DGraph(ctx).mix().plan()
        keep = np.arange(len(lay.seg_row)) > 0
        lay.seg_row, lay.seg_source, lay.seg_key = lay.seg_row[keep], lay.seg_source[keep], lay.seg_key[keep]
        lay.seg_start, lay.seg_len = lay.seg_start[keep], lay.seg_len[keep]
        return lay

    p2 = StepPlanner(spec, dropper)
    fill(p2)
    with pytest.raises(CoverageError, match="step 0"):
        p2.plan()
    assert p2.next_step == 0


def test_remix_with_exclusions_and_a_custom_schedule():
    spec = make_spec(sources=3, weights={"s0": 1, "s1": 1, "s2": 1}, model=MODEL)
    res = {}

    def strategy(ctx):
        g = DGraph(ctx).mix()
        first = set(zip(ctx.pieces.source.tolist(), ctx.pieces.key.tolist()))
        victim = next(iter(first))
        g.mix(exclude=[victim])
        res["excluded_absent"] = victim not in set(zip(ctx.pieces.source.tolist(), ctx.pieces.key.tolist()))
        g.mix({"s0": 1.0, "s1": 0.0, "s2": 0.0})
        res["only_s0"] = set(ctx.pieces.source.tolist()) == {0}
        return g.plan()

    plans = plan_with(spec, strategy)
    assert res["excluded_absent"] and res["only_s0"]
    assert set(plans[0].pieces.source.tolist()) == {0}


def test_a_place_tree_broadcast_reaches_the_plan():
    """The paper's way to broadcast selectively: override the ClientPlaceTree; the plan carries it to constructors."""
    spec = make_spec(dp=2, pp=2, cp=2, model=MODEL, options={"place_tree": {"broadcast": ["pp", "cp"]}})
    seen = {}

    def strategy(ctx):
        g = DGraph(ctx).mix()
        seen["fetchers"] = int(g.fetchers().sum())
        return g.plan()

    plans = plan_with(spec, strategy)
    assert plans[-1].broadcast == ("pp", "cp") and seen["fetchers"] == 2  # one rank per DP replica fetches
