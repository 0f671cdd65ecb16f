"""Built-in planning strategies (MegaScale-Data Fig. 9) and loading user strategies by import path.

A strategy is a function ``strategy(ctx, **options) -> StepLayout``; ``options`` are the spec's
``strategy.options`` (keys a function does not accept are an error, named at load time, except
``place_tree`` which configures the ClientPlaceTree). User strategies are named
``package.module:function`` (importable from the Python path) or ``path/to/file.py:function``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable

from mixplane import usercode
from mixplane.layout import StepLayout
from mixplane.planner.context import PlanContext, Strategy
from mixplane.planner.dgraph import vanilla_strategy
from mixplane.planner.cost import backbone_cost, encoder_cost
from mixplane.planner.dgraph import DGraph
from mixplane.spec import BUILTIN_STRATEGIES, DataMixtureSpec

TREE_OPTIONS = ("place_tree",)


def llm_balance(ctx: PlanContext, method: str = "greedy", level: str = "inter", keep_global_batch: bool = True,
                group_size: int | None = None, axis: str = "DP", broadcast: Iterable[str] = ("TP",),
                hybrid_cp: bool = False) -> StepLayout:
    """LLMBalance: distribute over DP, cost by backbone FLOPs, balance microbatches, broadcast over TP.
    `hybrid_cp`: deliver hybrid DP x CP consumers (DGraph.hybrid_cp(deliver=True)): every piece on a group of
    the DP x CP ranks sized by its length, short ones whole on one rank."""
    g = DGraph(ctx).mix()
    g.distribute(axis, group_size).cost(backbone_cost(ctx.spec)).balance(method, level, keep_global_batch)
    if hybrid_cp:
        g.hybrid_cp(deliver=True)
    for d in broadcast:
        g.broadcast_at(d)
    return g.plan()


def vlm_balance(ctx: PlanContext, method: str = "greedy", level: str = "inter", keep_global_batch: bool = True,
                group_size: int | None = None, axis: str = "DP", encoder_axis: str = "WORLD",
                broadcast: Iterable[str] = ("TP",)) -> StepLayout:
    """VLM hybrid balance: images balanced over every encoder rank (world-wide DP), plus LLMBalance."""
    g = DGraph(ctx).mix()
    g.distribute(axis, group_size).cost(backbone_cost(ctx.spec)).balance(method, level, keep_global_batch)
    g.images().distribute(encoder_axis, group_size).cost(encoder_cost(ctx.spec)).balance(method)
    for d in broadcast:
        g.broadcast_at(d)
    return g.plan()


# names from the spec's one list (validation knows them without importing the planner), functions in its order
BUILTIN: dict[str, Callable[..., StepLayout]] = dict(zip(BUILTIN_STRATEGIES, (vanilla_strategy, llm_balance, vlm_balance), strict=True))


class StrategyError(usercode.UserCodeError):
    """A strategy that cannot be loaded or does not accept its options."""


def load_callable(name: str, base_dir: str | os.PathLike | None = None) -> Callable[..., Any]:
    """`package.module:function` or `path/to/file.py:function` (relative paths against base_dir)."""
    return usercode.load_callable(name, base_dir, "strategy", StrategyError)


def bind_options(fn: Callable[..., StepLayout], options: dict[str, Any], name: str) -> Strategy:
    """A one-argument strategy: fn(ctx, **options), checked against fn's signature now."""
    return usercode.bind_options(fn, options, name, "strategy", StrategyError, ignore=TREE_OPTIONS)


def resolve_strategy(spec: DataMixtureSpec, base_dir: str | os.PathLike | None = None) -> Strategy:
    name = spec.strategy.name
    fn = BUILTIN.get(name) or load_callable(name, base_dir)
    return bind_options(fn, dict(spec.strategy.options), name)
