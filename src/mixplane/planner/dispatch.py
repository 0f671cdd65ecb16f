"""A planned step turned into what the planner sends: every loader's PLAN_LOADER and every constructor's
PLAN_CONSTRUCTOR, encoded once, with no socket in sight — the planner's server sends these frames, and
bench/plan_scale.py times this same code instead of a copy of it.

Two phases, timed apart by the benchmark: :func:`route` (who needs which span, image and layout rows:
planner.routing's vectorised rules) and the encoders (:func:`loader_messages`, :func:`constructor_messages`:
the routed columns as wire frames, each message's bytes the same as ``wire.encode`` of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixplane import wire
from mixplane.planner.core import StepPlan
from mixplane.planner.routing import (ConstructorColumns, Fanout, ImageParts, LoaderRoutes, constructor_columns,
                                      image_parts, image_routing, image_segments, loader_routes)
from mixplane.protocol import CURSOR_ARRAY, STEP_IMAGES
from mixplane.spec import DataMixtureSpec
from mixplane.topology import constructor_groups, dp_ranks_of_group
from mixplane.wire import Column, Kind


@dataclass(frozen=True)
class DispatchTopology:
    """Who serves whom in a topology: the constructor groups and the fan-outs routing looks up."""

    groups: list[list[int]]  # constructor -> the global ranks it serves
    dp_fanout: Fanout  # dp rank -> constructors serving it
    rank_fanout: Fanout  # global rank -> its constructor
    leader_fanout: Fanout | None  # encoder leader rank -> constructors (None: no image split)
    merge: int | None  # the image sources' shared merge (None: they differ, or none)
    world: int

    @classmethod
    def of(cls, spec: DataMixtureSpec) -> "DispatchTopology":
        groups = constructor_groups(spec)
        dp_to: list[list[int]] = [[] for _ in range(spec.topology.backbone()[1].dp)]
        rank_to: list[list[int]] = [[] for _ in range(spec.world_size)]
        for ci, ranks in enumerate(groups):
            for r in ranks:
                rank_to[int(r)].append(ci)
            for d in dp_ranks_of_group(spec, ranks):
                dp_to[d].append(ci)
        leader_fanout, merge = image_routing(spec, groups)
        return cls(groups, Fanout.from_lists(dp_to), Fanout.from_lists(rank_to), leader_fanout, merge,
                   spec.world_size)


@dataclass
class Routed:
    """One step routed: each loader's instructions, and each constructor's layout (in `peers` order)."""

    per_loader: LoaderRoutes
    columns: ConstructorColumns
    images: ImageParts | None
    cut: tuple[np.ndarray, list[int]] | None  # the images of `peers`, concatenated, and their bounds
    peers: list[tuple[int, Sequence[int]]]  # (constructor index, its DP ranks) in message order


def route(plan: StepPlan, topo: DispatchTopology, retired: np.ndarray, peers: Sequence[tuple[int, Sequence[int]]]) -> Routed:
    """Route `plan`: `retired` flags the pieces whose samples leave their loader's window with this step;
    `peers` are the constructors the step goes to, as (constructor index, its DP ranks), in message order."""
    lay, p = plan.layout, plan.pieces
    seg_of_img = plan.seg_of_img if plan.seg_of_img is not None else image_segments(lay, plan.piece_of_seg, p.patches)
    per_loader = loader_routes(lay, p.source, p.key, p.start, p.replica, p.pos, retired, topo.dp_fanout,
                               topo.rank_fanout, plan.piece_of_seg, seg_of_img)
    img = image_parts(lay, seg_of_img, topo.dp_fanout, topo.leader_fanout, len(topo.groups), topo.merge, topo.world)
    cut = None if img is None else img.cut([ci for ci, _ in peers])
    cols = constructor_columns(lay, [list(d) for _, d in peers], cut)
    return Routed(per_loader, cols, img, cut, list(peers))


def loader_messages(routed: Routed, session: int, step: int, released_through: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """(the PLAN_LOADER meta every loader gets, each loader's frames in `routed.per_loader.loaders` order)."""
    meta = {"session": session, "step": step, "released_through": released_through}
    return meta, list(wire.encode_columns(Kind.PLAN_LOADER, meta, routed.per_loader.columns()))


def constructor_messages(routed: Routed, plan: StepPlan, session: int, cursor: np.ndarray) -> list[tuple[dict[str, Any], list[Any]]]:
    """Each peer's (PLAN_CONSTRUCTOR meta, frames), in `peers` order: its layout of the step, the planner's cursor
    after it (`cursor`: serialised once, referenced by every message) and its images."""
    lay, img, cut = plan.layout, routed.images, routed.cut
    extra = {} if img is None else {STEP_IMAGES: len(lay.img_key)}
    base = lay.meta()
    metas = [{"session": session, **base, "dp": dp, "dp_ranks": ranks, **extra,
              "broadcast": list(plan.broadcast)}  # axes the trainer broadcasts along (constructor: TP views)
             for (_, ranks), dp in zip(routed.peers, routed.columns.dp)]
    columns = [*routed.columns.columns, Column(CURSOR_ARRAY, cursor),
               *([] if img is None or cut is None else img.columns(cut))]
    return list(zip(metas, wire.encode_columns(Kind.PLAN_CONSTRUCTOR, metas, columns)))
