"""Built-in planning strategies and loading user strategies by import path."""

from __future__ import annotations

import importlib

from mixplane.planner.core import Strategy, vanilla_strategy
from mixplane.spec import DataMixtureSpec

BUILTIN: dict[str, Strategy] = {
    "vanilla": vanilla_strategy,
    # placeholders until the DGraph balancers land: same layout as vanilla
    "llm_balance": vanilla_strategy,
    "vlm_balance": vanilla_strategy,
}


def resolve_strategy(spec: DataMixtureSpec) -> Strategy:
    name = spec.strategy.name
    if name in BUILTIN:
        return BUILTIN[name]
    mod, _, fn = name.partition(":")
    return getattr(importlib.import_module(mod), fn)
