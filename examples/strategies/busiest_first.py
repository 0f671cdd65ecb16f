"""A loader hook (hooks.loader, the paper's loader_do_plan): how a Source Loader consumes its part of a plan.

    hooks:
      loader:
        name: examples/strategies/busiest_first.py:busiest_first
        options: {read_ahead_steps: 2}
        sources: [web]          # default: every source

Each step, the loader serves first the constructor that gets the most tokens from it (its batch takes the longest
to build, so its message should leave first), and gathers that constructor's spans longest first; with
`read_ahead_steps` it reads that many steps' worth of its tokens ahead past its window (a prefetch for a source
whose reads are slow). Which samples go where is the plan's: the batches are those of a run without the hook.
"""

import numpy as np


def busiest_first(plan, ctx, read_ahead_steps=0):
    per_constructor = np.bincount(plan["dest"], weights=plan["len"], minlength=ctx["constructors"])
    # most tokens first, ties by constructor index; inside a constructor the longest spans first, ties by position
    order = np.lexsort((plan["pos"], -plan["len"], plan["dest"], -per_constructor[plan["dest"]]))
    out = {"order": order}
    if read_ahead_steps:
        out["read_ahead_tokens"] = int(read_ahead_steps * plan["len"].sum())
    return out
