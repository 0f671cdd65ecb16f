"""Built-in strategies, the paper's two example strategies (<= 10 lines each), and user strategies by path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mixplane.planner.balance import imbalance
from mixplane.planner.core import StepPlanner, check_coverage
from mixplane.planner.cost import backbone_cost, encoder_cost
from mixplane.planner.strategies import StrategyError, load_callable, resolve_strategy

from .planner_helpers import make_spec, run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "strategies"
MODEL = {"backbone": {"hidden": 512, "layers": 4, "heads": 8, "vocab": 1000},
         "encoder": {"hidden": 256, "layers": 4, "heads": 4, "gated_mlp": False}}


def rank_costs(spec, lay):
    c = backbone_cost(spec)({"length": lay.seg_len.astype(np.int64)})
    return np.bincount(lay.seg_row // lay.rows_per_rank, weights=c, minlength=lay.dp)


@pytest.mark.parametrize("name", ["llm_balance.py", "vlm_balance.py"])
def test_examples_are_at_most_ten_lines(name):
    lines = [ln for ln in (EXAMPLES / name).read_text().splitlines() if ln.strip()]
    assert len(lines) <= 10


def test_llm_balance_builtin_and_example_agree_and_balance():
    spec = make_spec(dp=4, rows=64, microbatches=4, seq_len=1024, tp=2, window=256,
                     model={"backbone": MODEL["backbone"]}, strategy="llm_balance")
    builtin = run(StepPlanner(spec, resolve_strategy(spec)), 3)
    example = load_callable(f"{EXAMPLES / 'llm_balance.py'}:llm_balance")
    ex = run(StepPlanner(spec, example), 3)
    van = run(StepPlanner(make_spec(dp=4, rows=64, microbatches=4, seq_len=1024, tp=2, window=256,
                                    model={"backbone": MODEL["backbone"]})), 3)
    for b, e, v in zip(builtin, ex, van):
        check_coverage(b.layout, b.pieces)
        assert np.array_equal(b.layout.seg_row, e.layout.seg_row)  # same primitives, same plan
        assert imbalance(rank_costs(spec, b.layout)) <= imbalance(rank_costs(spec, v.layout)) + 1e-12
        assert imbalance(rank_costs(spec, b.layout)) < 1.02
        assert b.broadcast == ("tp",)


def test_vlm_balance_example_balances_the_encoder():
    spec = make_spec(dp=2, pp=2, tp=2, encoder=True, rows=16, microbatches=2, seq_len=512, window=128,
                     model=MODEL, strategy=f"{EXAMPLES / 'vlm_balance.py'}:vlm_balance")
    plans = run(StepPlanner(spec, resolve_strategy(spec)), 3, images=True)
    vans = run(StepPlanner(make_spec(dp=2, pp=2, tp=2, encoder=True, rows=16, microbatches=2, seq_len=512,
                                     window=128, model=MODEL)), 3, images=True)
    ec = encoder_cost(spec)
    for p, v in zip(plans, vans):
        check_coverage(p.layout, p.pieces)
        lb = np.bincount(p.layout.img_rank, weights=ec({"patches": p.layout.img_patches.astype(np.int64)}), minlength=8)
        lv = np.bincount(v.layout.img_rank, weights=ec({"patches": v.layout.img_patches.astype(np.int64)}), minlength=8)
        assert lb.max() <= lv.max() and imbalance(lb) < imbalance(lv)


def test_options_reach_the_strategy_and_unknown_ones_are_named():
    spec = make_spec(strategy="llm_balance", options={"method": "karmarkar_karp", "group_size": 2},
                     model={"backbone": MODEL["backbone"]}, dp=4, rows=16, microbatches=2)
    plans = run(StepPlanner(spec, resolve_strategy(spec)), 1)
    assert plans[0].stats["text"]["method"] == "karmarkar_karp"
    bad = make_spec(strategy="llm_balance", options={"methd": "greedy"})
    with pytest.raises(StrategyError, match="methd"):
        resolve_strategy(bad)


def test_user_strategy_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_strategies.py").write_text(
        "from mixplane.planner.dgraph import DGraph\n"
        "def reverse(ctx, flip=True):\n"
        "    g = DGraph(ctx).mix()\n"
        "    import numpy as np\n"
        "    if flip:\n"
        "        g.assign_rows(np.arange(ctx.rows)[::-1].copy())\n"
        "    return g.plan()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = make_spec(strategy="my_strategies:reverse", options={"flip": True})
    plans = run(StepPlanner(spec, resolve_strategy(spec)), 2)
    for p in plans:
        check_coverage(p.layout, p.pieces)
    with pytest.raises(StrategyError, match="cannot import"):
        load_callable("no_such_module_xyz:fn")
    with pytest.raises(StrategyError, match="expected"):
        load_callable("just_a_name")
