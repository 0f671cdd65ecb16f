"""A constructor hook (hooks.constructor, the paper's constructor_do_plan): custom collation and an extra field.

    hooks:
      constructor:
        name: examples/strategies/loss_only_on.py:loss_only_on
        options: {sources: [code]}
        token_fields: [doc_start]

The trainer sees every source as context but computes its loss only on the sources named (labels -100 elsewhere),
and gets `doc_start` (1 at each document's first token) beside input_ids, cut by context parallelism like them.
A function of the batch alone: `mixplane replay` calls it again and gets what the trainer got.
"""

import numpy as np


def loss_only_on(batch, ctx, sources=()):
    keep = [ctx["sources"].index(s) for s in sources]
    labels = batch["labels"].copy()
    labels[~np.isin(batch["source_ids"], keep)] = -100
    doc_start = (batch["position_ids"] == 0) & (batch["source_ids"] >= 0)
    return {**batch, "labels": labels, "doc_start": doc_start.astype(np.int8)}
