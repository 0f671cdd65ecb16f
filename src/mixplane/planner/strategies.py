"""Built-in planning strategies (seed 001 Fig. 9) and loading user strategies by import path.

A strategy is a function ``strategy(ctx, **options) -> StepLayout``; ``options`` are the spec's
``strategy.options`` (keys a function does not accept are an error, named at load time, except
``place_tree`` which configures the ClientPlaceTree). User strategies are named
``package.module:function`` (importable from the Python path) or ``path/to/file.py:function``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Iterable

from mixplane.errors import MixplaneError
from mixplane.layout import StepLayout
from mixplane.planner.core import PlanContext, Strategy, vanilla_strategy
from mixplane.planner.cost import backbone_cost, encoder_cost
from mixplane.planner.dgraph import DGraph
from mixplane.spec import BUILTIN_STRATEGIES, DataMixtureSpec

TREE_OPTIONS = ("place_tree",)


def llm_balance(ctx: PlanContext, method: str = "greedy", level: str = "inter", keep_global_batch: bool = True,
                group_size: int | None = None, axis: str = "DP", broadcast: Iterable[str] = ("TP",)) -> StepLayout:
    """LLMBalance: distribute over DP, cost by backbone FLOPs, balance microbatches, broadcast over TP."""
    g = DGraph(ctx).mix()
    g.distribute(axis, group_size).cost(backbone_cost(ctx.spec)).balance(method, level, keep_global_batch)
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


class StrategyError(MixplaneError, ValueError):
    """A strategy that cannot be loaded or does not accept its options."""


def load_callable(name: str, base_dir: str | os.PathLike | None = None) -> Callable[..., Any]:
    """`package.module:function` or `path/to/file.py:function` (relative paths against base_dir)."""
    mod, sep, fn = name.rpartition(":")
    if not sep or not mod or not fn:
        raise StrategyError(f"strategy {name!r}: expected package.module:function or file.py:function")
    try:
        if mod.endswith(".py"):
            path = mod if os.path.isabs(mod) or base_dir is None else os.path.join(str(base_dir), mod)
            path = os.path.abspath(os.path.expanduser(path))
            modname = "mixplane_user_" + os.path.splitext(os.path.basename(path))[0]
            spec = importlib.util.spec_from_file_location(modname, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[modname] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(mod)
        obj = getattr(module, fn)
    except Exception as e:  # noqa: BLE001 - user code may raise anything at import (SyntaxError, ...)
        raise StrategyError(f"strategy {name!r}: cannot import: {type(e).__name__}: {e}") from None
    if not callable(obj):
        raise StrategyError(f"strategy {name!r} is not callable")
    return obj


def bind_options(fn: Callable[..., StepLayout], options: dict[str, Any], name: str) -> Strategy:
    """A one-argument strategy: fn(ctx, **options), checked against fn's signature now."""
    opts = {k: v for k, v in options.items() if k not in TREE_OPTIONS}
    if not opts:
        return fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = list(sig.parameters.values())
        has_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
        accepted = {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = sorted(set(opts) - accepted) if not has_kwargs else []
        if unknown:
            raise StrategyError(f"strategy {name!r} does not accept option(s) {', '.join(unknown)} "
                                f"(it takes: {', '.join(sorted(accepted)) or 'none'})")
    return functools.partial(fn, **opts)


def resolve_strategy(spec: DataMixtureSpec, base_dir: str | os.PathLike | None = None) -> Strategy:
    name = spec.strategy.name
    fn = BUILTIN.get(name) or load_callable(name, base_dir)
    return bind_options(fn, dict(spec.strategy.options), name)
