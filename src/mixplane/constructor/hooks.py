"""The constructor hook (the paper's `constructor_do_plan`): user code in how a constructor assembles its part of
a plan.

`hooks.constructor` in the spec names ``fn(batch, ctx, **options) -> batch``. The constructor calls it on each
data-parallel rank's collated batch (numpy arrays: input_ids, labels, position_ids, source_ids, cu_seqlens, ...)
before the batch is cut for context, pipeline and tensor parallelism, so every rank's view comes from the hooked
batch. ``ctx``: step, dp_rank, phase, generation, lr_scale, sources (names), seq_len. The hook may change a field
(same shape; a dtype of the same kind) or add fields (numpy arrays; those named in `token_fields` are cut by
context parallelism like input_ids). It must be a function of its inputs: `mixplane replay` calls it again on
the rebuilt batch, and the result must be what the trainer got.

What it returns is checked before anything is sent: a field removed, a shape changed, a value that is not a numpy
array is an error naming the hook, the step and the field -- the step is not delivered wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mixplane import usercode
from mixplane.spec import DataMixtureSpec

Hook = Callable[[dict[str, Any], dict[str, Any]], Any]


class HookError(usercode.UserCodeError):
    """A constructor hook that cannot be loaded, or whose result is not a batch; the text names hook, step, field."""


def load_hook(spec: DataMixtureSpec, base_dir: str | None = None) -> Hook | None:
    """The spec's constructor hook with its options bound, or None (HookError when it cannot be loaded)."""
    h = spec.hooks.constructor
    if h is None:
        return None
    fn = usercode.load_callable(h.name, base_dir, "hooks.constructor", HookError)
    return usercode.bind_options(fn, dict(h.options), h.name, "hooks.constructor", HookError)


def hook_context(spec: DataMixtureSpec, layout: Any, dp_rank: int) -> dict[str, Any]:
    return {"step": int(layout.step), "dp_rank": int(dp_rank), "phase": layout.phase, "generation": int(layout.generation),
            "lr_scale": float(layout.lr_scale), "sources": spec.source_names(), "seq_len": int(layout.seq_len)}


def apply_hook(hook: Hook, name: str, batch: Mapping[str, Any], ctx: Mapping[str, Any]) -> dict[str, Any]:
    """`hook` on a copy-on-write view of `batch` (the hook may not change the arrays in place: it gets them read-only),
    its result checked against the batch it was given."""
    given = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray):
            v = v.view()
            v.flags.writeable = False
        given[k] = v
    where = f"hooks.constructor {name!r} at step {ctx.get('step')} (dp rank {ctx.get('dp_rank')})"
    try:
        out = hook(dict(given), dict(ctx))
    except HookError:
        raise
    except Exception as e:  # noqa: BLE001 - user code may raise anything; the step must not be delivered wrong
        raise HookError(f"{where} raised {type(e).__name__}: {e}") from e
    if not isinstance(out, Mapping):
        raise HookError(f"{where} returned {type(out).__name__}, not a mapping of field -> array")
    missing = [k for k in batch if k not in out]
    if missing:
        raise HookError(f"{where} dropped field(s) {', '.join(sorted(missing))}")
    result: dict[str, Any] = {}
    for k, v in out.items():
        if not isinstance(k, str):
            raise HookError(f"{where}: field name {k!r} is not text")
        old = batch.get(k)
        if isinstance(old, np.ndarray):
            if not isinstance(v, np.ndarray) or v.shape != old.shape or v.dtype.kind != old.dtype.kind:
                got = f"{type(v).__name__}" if not isinstance(v, np.ndarray) else f"{v.dtype} {v.shape}"
                raise HookError(f"{where}: field {k!r} must stay a {old.dtype} array of shape {old.shape}, got {got}")
            result[k] = np.ascontiguousarray(v.astype(old.dtype, copy=False))
        elif k in batch:
            result[k] = v  # a scalar field (microbatches, seq_len, ...): as it was given
            if v != old:
                raise HookError(f"{where}: field {k!r} is not a tensor and cannot change ({old!r} -> {v!r})")
        else:
            if not isinstance(v, np.ndarray) or v.dtype.kind not in "biuf":
                raise HookError(f"{where}: added field {k!r} must be a numeric numpy array, got {type(v).__name__}")
            result[k] = np.ascontiguousarray(v)
    return result
