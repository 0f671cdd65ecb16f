"""Rebuild what one rank received at any past step, from the planner's journal and the sources.

`planner.journal.replan` plans the step again from the nearest journaled cursor (checking every
replanned step's digest against the journal); the step's token spans are then read back from the
sources with the loaders' own stream and transform, and the rank's batch is materialised exactly
as its Data Constructor did (Blender's "re-fetch any past batch", e.g. to investigate a loss spike).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mixplane.constructor.collate import SpanStore, materialize_rank
from mixplane.layout import layout_digest
from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.planner.core import StepPlan
from mixplane.planner.journal import read_journal, replan
from mixplane.runtime import default_run_dir
from mixplane.spec import DataMixtureSpec
from mixplane.topology import backbone_coords


class ReplayError(RuntimeError):
    pass


def fetch_spans(spec: DataMixtureSpec, plan: StepPlan) -> SpanStore:
    """The token spans of a planned step, read from the sources by stream position."""
    store = SpanStore.empty()
    p = plan.pieces
    by_replica: dict[tuple[int, int], list[int]] = {}
    for i in range(len(p)):
        by_replica.setdefault((int(p.source[i]), int(p.replica[i])), []).append(i)
    for (si, r), idx in by_replica.items():
        src = spec.sources[si]
        stream = open_stream(src, seed=spec.mixture.seed, partition=r, num_partitions=src.replicas)
        transform = make_transform(src)
        cache: dict[int, np.ndarray] = {}
        for i in sorted(idx, key=lambda j: int(p.pos[j])):
            pos = int(p.pos[i])
            if pos not in cache:
                stream.seek(pos)
                raw = stream.take(1)
                if len(raw) == 0 or int(raw.positions[0]) != pos:
                    raise ReplayError(f"source {src.name!r}: stream position {pos} cannot be read back (quarantined since?)")
                if int(raw.keys[0]) != int(p.key[i]):
                    raise ReplayError(f"source {src.name!r}: position {pos} now holds sample {int(raw.keys[0])}, "
                                      f"the plan says {int(p.key[i])} (did the files change?)")
                cache[pos] = transform(raw).tokens[0]
            s0, ln = int(p.start[i]), int(p.length[i])
            store.spans[(si, int(p.key[i]), s0)] = cache[pos][s0 : s0 + ln + 1]
        stream.close()
    return store


def replay_step(spec: DataMixtureSpec, *, step: int, rank: int, run_dir: str | None = None, save: str | None = None) -> dict[str, Any]:
    rd = Path(run_dir) if run_dir else default_run_dir(spec)
    path = rd / "journal.jsonl"
    if not path.exists():
        raise ReplayError(f"no journal at {path}")
    journaled = {int(r["step"]): r for r in read_journal(path) if r.get("event") == "step"}
    if step not in journaled:
        raise ReplayError(f"step {step} is not in {path} (journaled: {min(journaled, default=0)}..{max(journaled, default=-1)})")
    plan = replan(path, step)  # raises ReplayMismatch naming the first step that differs
    digest = layout_digest(plan.layout)
    coords = backbone_coords(spec, rank)
    batch = materialize_rank(plan.layout, coords.dp, fetch_spans(spec, plan), spec.batch.pad_id)
    names = spec.source_names()
    src = batch["source_ids"]
    out = {
        "step": step, "rank": rank, "coords": coords.as_dict(), "phase": plan.layout.phase, "lr_scale": plan.layout.lr_scale,
        "digest": digest, "journal_digest": journaled[step].get("digest"), "digest_match": journaled[step].get("digest") == digest,
        "tokens_by_source": {n: int((src == i).sum()) for i, n in enumerate(names)},
        "segments": [{"source": names[int(s)], "key": int(k), "start": int(st), "len": int(ln), "row": int(r)}
                     for s, k, st, ln, r in zip(batch["segment_source"], batch["segment_key"], batch["segment_start"],
                                                batch["segment_len"], batch["segment_row"])],
    }
    if save:
        np.savez(save, **batch)
        out["saved"] = save
    return out
