"""The constructor hook's result is checked before anything is sent (constructor.hooks.apply_hook)."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.constructor.hooks import HookError, apply_hook

BATCH = {"input_ids": np.arange(8, dtype=np.int64).reshape(2, 4), "labels": np.ones((2, 4), np.int64), "microbatches": 1}
CTX = {"step": 3, "dp_rank": 1}


def test_changes_and_additions_pass_and_keep_dtypes():
    out = apply_hook(lambda b, c: {**b, "labels": b["labels"] * 0 - 100, "w": np.ones(2, np.float32)}, "h", BATCH, CTX)
    assert out["labels"].dtype == np.int64 and (out["labels"] == -100).all() and out["w"].dtype == np.float32
    assert out["input_ids"] is not BATCH["input_ids"] or np.shares_memory(out["input_ids"], BATCH["input_ids"])


@pytest.mark.parametrize("hook, what", [
    (lambda b, c: None, "returned NoneType, not a mapping"),
    (lambda b, c: {k: v for k, v in b.items() if k != "labels"}, "dropped field(s) labels"),
    (lambda b, c: {**b, "labels": b["labels"][:1]}, "field 'labels' must stay a int64 array of shape (2, 4)"),
    (lambda b, c: {**b, "labels": b["labels"].astype(np.float32)}, "field 'labels' must stay"),
    (lambda b, c: {**b, "microbatches": 2}, "field 'microbatches' is not a tensor and cannot change"),
    (lambda b, c: {**b, "note": "text"}, "added field 'note' must be a numeric numpy array"),
    (lambda b, c: b["labels"].__setitem__((0, 0), 5), "raised ValueError: assignment destination is read-only"),
])
def test_a_broken_result_names_the_hook_step_and_field(hook, what):
    with pytest.raises(HookError, match=r"hooks.constructor 'h' at step 3 \(dp rank 1\)") as e:
        apply_hook(hook, "h", BATCH, CTX)
    assert what in str(e.value)
    assert BATCH["labels"][0, 0] == 1  # the batch it was given is unchanged
