"""Where each trainer rank sits in the device mesh, and which Data Constructor serves it.

Ranks are numbered with the spec's axis order, fastest-varying first (default tp, cp, dp, pp as in
Megatron): rank = tp + TP * (cp + CP * (dp + DP * pp)).
"""

from __future__ import annotations

from dataclasses import dataclass

from mixplane.spec import DataMixtureSpec, ModuleSpec


@dataclass(frozen=True)
class RankCoords:
    rank: int
    dp: int
    pp: int
    cp: int
    tp: int

    def as_dict(self) -> dict[str, int]:
        return {"rank": self.rank, "dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}


def rank_coords(module: ModuleSpec, order: list[str], rank: int) -> RankCoords:
    if not 0 <= rank < module.world:
        raise ValueError(f"rank {rank} outside world of size {module.world}")
    sizes = {"tp": module.tp, "cp": module.cp, "dp": module.dp, "pp": module.pp}
    rest = rank
    c: dict[str, int] = {}
    for axis in order:
        c[axis] = rest % sizes[axis]
        rest //= sizes[axis]
    return RankCoords(rank, c["dp"], c["pp"], c["cp"], c["tp"])


def backbone_coords(spec: DataMixtureSpec, rank: int) -> RankCoords:
    return rank_coords(spec.topology.backbone()[1], list(spec.topology.order), rank)


def constructor_groups(spec: DataMixtureSpec) -> list[list[int]]:
    """Global ranks served by each Data Constructor (one per DP group, or one per node)."""
    world = spec.world_size
    if spec.runtime.constructors == "per_node":
        n = spec.topology.ranks_per_node
        return [list(range(i, min(i + n, world))) for i in range(0, world, n)]
    bb = spec.topology.backbone()[1]
    groups: list[list[int]] = [[] for _ in range(bb.dp)]
    for r in range(world):
        groups[backbone_coords(spec, r).dp].append(r)
    return groups


def dp_ranks_of_group(spec: DataMixtureSpec, ranks: list[int]) -> list[int]:
    return sorted({backbone_coords(spec, r).dp for r in ranks})
