"""The loader hook (the paper's `loader_do_plan`): user code in how a Source Loader consumes its part of a plan.

`hooks.loader` in the spec names ``fn(plan, ctx, **options) -> dict | None``. A loader calls it on its part of each
step's plan before it gathers anything: ``plan`` holds one entry per planned span (read-only numpy arrays of equal
length): ``pos`` (window position), ``key`` (sample key), ``start``, ``len`` (the span's tokens), ``dest`` (index of
the constructor it goes to), ``img`` (1: the sample's image travels with it), ``retire`` (1: its last span),
``tokens`` (the sample's length). ``ctx``: step, source, replica, constructors, window_samples, window_tokens,
read_ahead_tokens. What it may decide (a dict of these keys, each optional; None: as planned):

* ``order``: a permutation of the entries -- the order in which the loader gathers the spans and serves its
  constructors (each constructor's message goes out in the order of its first entry, its spans in that order);
* ``read_ahead_tokens``: how many tokens the loader reads ahead past its window when idle (a prefetch hint).

Which samples go to which constructor, and which tokens, is the plan's: the hook cannot change it, so the batches,
cursors and resume of a run with a hook are those of the run without it (the constructor places spans by their
address, not by their order in a message). Its result is checked: anything but these keys, an order that is not a
permutation of the step's entries, a read-ahead that is not a non-negative integer, or an exception in the hook is
a `LoaderHookError` naming the hook, the step, the source and replica, and the field; the loader stops with it
rather than serve a step other than the plan says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixplane import usercode
from mixplane.spec import DataMixtureSpec

LoaderHook = Callable[[dict[str, np.ndarray], dict[str, Any]], Any]

PLAN_FIELDS = ("pos", "key", "start", "len", "dest", "img", "retire", "tokens")
RESULT_FIELDS = ("order", "read_ahead_tokens")
MAX_READ_AHEAD = 1 << 28  # tokens (1 GiB of int32): a hint past this is a bug, not a prefetch


class LoaderHookError(usercode.UserCodeError):
    """A loader hook that cannot be loaded, or whose result is not a way to consume the plan; names hook, step, field."""


@dataclass(frozen=True)
class LoaderDecision:
    """What the hook decided for one step: the serving order (None: the plan's) and the read-ahead (None: as it is)."""

    order: np.ndarray | None = None
    read_ahead_tokens: int | None = None


def runs_hook(spec: DataMixtureSpec, source: str) -> bool:
    """Whether the loaders of `source` run the spec's loader hook."""
    h = spec.hooks.loader
    return h is not None and (h.sources is None or source in h.sources)


def load_loader_hook(spec: DataMixtureSpec, source: str | None = None, base_dir: str | None = None) -> LoaderHook | None:
    """The spec's loader hook with its options bound, or None when there is none (or `source` does not run it);
    LoaderHookError when it cannot be loaded or refuses its options."""
    h = spec.hooks.loader
    if h is None or (source is not None and not runs_hook(spec, source)):
        return None
    fn = usercode.load_callable(h.name, base_dir, "hooks.loader", LoaderHookError)
    return usercode.bind_options(fn, dict(h.options), h.name, "hooks.loader", LoaderHookError)


def apply_loader_hook(hook: LoaderHook, name: str, plan: Mapping[str, np.ndarray], ctx: Mapping[str, Any]) -> LoaderDecision:
    """`hook` on read-only views of `plan`, its result checked against the plan's entries."""
    n = len(plan["pos"])
    given = {}
    for k, v in plan.items():
        v = np.asarray(v).view()
        v.flags.writeable = False
        given[k] = v
    where = (f"hooks.loader {name!r} at step {ctx.get('step')} (source {ctx.get('source')!r}, "
             f"replica {ctx.get('replica')})")
    try:
        out = hook(given, dict(ctx))
    except LoaderHookError:
        raise
    except Exception as e:  # noqa: BLE001 - user code may raise anything; the step must not be served wrong
        raise LoaderHookError(f"{where} raised {type(e).__name__}: {e}") from e
    if out is None:
        return LoaderDecision()
    if not isinstance(out, Mapping):
        raise LoaderHookError(f"{where} returned {type(out).__name__}, not None or a mapping with "
                              f"{' / '.join(RESULT_FIELDS)}")
    unknown = sorted(str(k) for k in out if k not in RESULT_FIELDS)
    if unknown:
        raise LoaderHookError(f"{where}: unknown field(s) {', '.join(unknown)} (a loader hook decides "
                              f"{', '.join(RESULT_FIELDS)}; which samples go where is the plan's)")
    order = out.get("order")
    if order is not None:
        try:
            arr = np.asarray(order)
        except Exception:  # noqa: BLE001 - whatever the hook returned
            arr = np.zeros(0, np.float64)
        if arr.ndim != 1 or len(arr) != n or (n and arr.dtype.kind not in "iu") or \
                (n and not np.array_equal(np.sort(arr), np.arange(n))):
            shown = f"{arr.dtype} array of shape {arr.shape}" if arr.ndim != 1 or arr.dtype.kind not in "iu" else \
                f"{arr[:8].tolist()}{' ...' if len(arr) > 8 else ''}"
            raise LoaderHookError(f"{where}: field 'order' must be a permutation of the step's {n} planned "
                                  f"span(s) (0..{n - 1}, each once), got {shown}")
        order = arr.astype(np.int64)
    ahead = out.get("read_ahead_tokens")
    if ahead is not None:
        if isinstance(ahead, (bool, np.bool_)) or not isinstance(ahead, (int, np.integer)) or not 0 <= int(ahead) <= MAX_READ_AHEAD:
            raise LoaderHookError(f"{where}: field 'read_ahead_tokens' must be an integer in 0..{MAX_READ_AHEAD}, "
                                  f"got {ahead!r}")
        ahead = int(ahead)
    return LoaderDecision(order, ahead)
