"""Rebuild any past step offline: the plan from the journal's cursor, the batch from the sources.

A step's plan is a pure function of (spec generation, seed, step, cursor); replay restores the
planner from the cursor the journal recorded before that step, lets in-process loader windows
re-announce exactly what the live loaders announced, plans the step again, checks the layout's
digest against the journal, and materialises one rank's batch (Blender's "re-fetch any past
batch", e.g. to investigate a loss spike).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mixplane.constructor.collate import SpanStore, materialize_rank
from mixplane.layout import layout_digest
from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.planner.core import StepPlan, StepPlanner
from mixplane.planner.strategies import resolve_strategy
from mixplane.runtime import default_run_dir
from mixplane.spec import DataMixtureSpec
from mixplane.topology import backbone_coords


class ReplayError(RuntimeError):
    pass


def journal_record(run_dir: Path, step: int) -> dict[str, Any]:
    path = run_dir / "journal.jsonl"
    if not path.exists():
        raise ReplayError(f"no journal at {path}")
    found = None
    with open(path) as f:
        for line in f:
            if line.startswith(f'{{"step":{step},'):
                found = line
    if found is None:
        raise ReplayError(f"step {step} is not in {path}")
    return json.loads(found)


class OfflineLoaders:
    """Loader windows of every source replica, in this process."""

    def __init__(self, spec: DataMixtureSpec, planner: StepPlanner):
        self.windows: dict[tuple[int, int], LoaderWindow] = {}
        for si, s in enumerate(spec.sources):
            for r in range(s.replicas):
                stream = open_stream(s, seed=spec.mixture.seed, partition=r, num_partitions=s.replicas)
                lw = LoaderWindow(stream, make_transform(s), spec.window_bounds(si))
                lw.seek(planner.window(si, r).cursor())
                self.windows[(si, r)] = lw
        self.planner = planner

    def fill(self) -> None:
        for (si, r), lw in self.windows.items():
            a = lw.fill()
            self.planner.window(si, r).add(a.pos, a.key, a.tokens, a.patches)

    def spans_for(self, plan: StepPlan) -> SpanStore:
        """Hand over the step's spans like loaders do, retiring what the plan consumed."""
        store = SpanStore.empty()
        p = plan.pieces
        for i in range(len(p)):
            lw = self.windows[(int(p.source[i]), int(p.replica[i]))]
            key, toks = lw.span(int(p.pos[i]), int(p.start[i]), int(p.length[i]))
            store.spans[(int(p.source[i]), key, int(p.start[i]))] = toks
        for (si, r), lw in self.windows.items():
            w = self.planner.window(si, r)
            for pos in [q for q in lw.buffer if q < w.low or q in w.skip]:
                lw.retire(pos)
        return store


def replan(spec: DataMixtureSpec, cursor: dict[str, Any]) -> tuple[StepPlan, SpanStore]:
    planner = StepPlanner(spec, resolve_strategy(spec))
    planner.restore(cursor)
    loaders = OfflineLoaders(spec, planner)
    loaders.fill()
    plan = planner.plan()
    return plan, loaders.spans_for(plan)


def replay_step(spec: DataMixtureSpec, *, step: int, rank: int, run_dir: str | None = None, save: str | None = None) -> dict[str, Any]:
    rd = Path(run_dir) if run_dir else default_run_dir(spec)
    rec = journal_record(rd, step)
    plan, spans = replan(spec, rec["cursor"])
    digest = layout_digest(plan.layout)
    coords = backbone_coords(spec, rank)
    batch = materialize_rank(plan.layout, coords.dp, spans, spec.batch.pad_id)
    names = spec.source_names()
    src = batch["source_ids"]
    out = {
        "step": step, "rank": rank, "coords": coords.as_dict(), "phase": plan.layout.phase, "lr_scale": plan.layout.lr_scale,
        "digest": digest, "journal_digest": rec.get("digest"), "digest_match": rec.get("digest") == digest,
        "tokens_by_source": {n: int((src == i).sum()) for i, n in enumerate(names)},
        "segments": [{"source": names[int(s)], "key": int(k), "start": int(st), "len": int(ln), "row": int(r)}
                     for s, k, st, ln, r in zip(batch["segment_source"], batch["segment_key"], batch["segment_start"],
                                                batch["segment_len"], batch["segment_row"])],
    }
    if save:
        np.savez(save, **batch)
        out["saved"] = save
    return out
