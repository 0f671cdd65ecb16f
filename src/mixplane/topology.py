"""ClientPlaceTree: where every trainer rank sits, for every module, and who fetches which data.

MegaScale-Data §4.1: the ClientPlaceTree is the logical model of the trainer's device mesh. Several
*modules* share one world (e.g. a ViT encoder with world-wide data parallelism and an LLM
backbone with PP x DP x CP x TP); each module has its own mesh over the same global ranks.

Ranks are numbered with an axis order, fastest-varying first (default tp, cp, dp, pp as in
Megatron): ``rank = tp + TP * (cp + CP * (dp + DP * pp))``. A module may override the order, and
the whole tree may carry a ``rank_map`` (logical mesh position -> physical global rank) when the
trainer lays its process groups out differently.

The tree seen from the data's point of view has three levels below the root:

    world ─ DP replicas ─ CP consumers (dp, cp) ─ ranks that share the same data (pp stages, tp peers)

`consumers(axis)` gives the buckets of `DGraph.distribute(axis)`: 'DP' -> one per DP replica,
'CP' -> one per (dp, cp) pair, 'WORLD' -> one per distinct data consumer of the module across
the whole world (for an encoder declared {dp: world} that is every rank). `fetchers(...)`
implements `broadcast_at`: only the ranks at coordinate 0 of the broadcast axes fetch from their
Data Constructor, the others receive by the trainer's own broadcast.

Everything is computed with numpy over the whole world at once, so rebuilding the tree when
the topology changes (elastic resharding, a new spec generation) costs microseconds to a few
milliseconds even for tens of thousands of ranks; `ClientPlaceTree.from_spec` also caches.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from mixplane.spec import AXES, DataMixtureSpec, ModuleSpec, place_tree_problems

DATA_AXES = ("DP", "CP", "WORLD")


@dataclass(frozen=True)
class RankCoords:
    rank: int
    dp: int
    pp: int
    cp: int
    tp: int

    def as_dict(self) -> dict[str, int]:
        return {"rank": self.rank, "dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}


def _check_order(order: Iterable[str]) -> tuple[str, ...]:
    order = tuple(str(a).lower() for a in order)
    if sorted(order) != sorted(AXES):
        raise ValueError(f"axis order must name each of {', '.join(AXES)} once, got {list(order)}")
    return order


class ModuleMesh:
    """One module's mesh over the world: coordinates of every rank as arrays (vectorised)."""

    def __init__(self, name: str, role: str, sizes: dict[str, int], order: Iterable[str],
                 rank_map: np.ndarray | None = None):
        self.name = name
        self.role = role
        self.sizes = {a: int(sizes.get(a, 1)) for a in AXES}
        for a, s in self.sizes.items():
            if s < 1:
                raise ValueError(f"module {name!r}: {a} must be >= 1, got {s}")
        self.order = _check_order(order)
        self.world = int(np.prod([self.sizes[a] for a in AXES]))
        logical = np.arange(self.world, dtype=np.int64)
        rest = logical.copy()
        coords: dict[str, np.ndarray] = {}
        for a in self.order:
            coords[a] = rest % self.sizes[a]
            rest //= self.sizes[a]
        # physical global rank of each logical mesh position, and the inverse
        if rank_map is None:
            self.phys = logical
        else:
            rank_map = np.asarray(rank_map, dtype=np.int64)
            if len(rank_map) != self.world or not np.array_equal(np.sort(rank_map), logical):
                raise ValueError(f"module {name!r}: rank_map must be a permutation of 0..{self.world - 1}")
            self.phys = rank_map
        inv = np.empty(self.world, dtype=np.int64)
        inv[self.phys] = logical
        # coordinates indexed by *global* rank
        self.coord = {a: coords[a][inv] for a in AXES}
        self._strides = {}
        s = 1
        for a in self.order:
            self._strides[a] = s
            s *= self.sizes[a]

    # -- sizes ---------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.sizes["dp"]

    @property
    def pp(self) -> int:
        return self.sizes["pp"]

    @property
    def cp(self) -> int:
        return self.sizes["cp"]

    @property
    def tp(self) -> int:
        return self.sizes["tp"]

    def __repr__(self) -> str:
        s = " ".join(f"{a}{self.sizes[a]}" for a in self.order)
        return f"ModuleMesh({self.name!r}, {self.role}, {s}, world={self.world})"

    # -- ranks and coordinates -----------------------------------------------------------
    def coords_of(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside world of size {self.world}")
        c = {a: int(self.coord[a][rank]) for a in AXES}
        return RankCoords(int(rank), c["dp"], c["pp"], c["cp"], c["tp"])

    def rank_of(self, *, dp: Any = 0, pp: Any = 0, cp: Any = 0, tp: Any = 0) -> Any:
        """Global rank(s) at the given coordinates (scalars or arrays)."""
        c = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        logical = sum(np.asarray(c[a], dtype=np.int64) * self._strides[a] for a in AXES)
        out = self.phys[logical]
        return int(out) if np.ndim(out) == 0 else out

    def group(self, axis: str, rank: int) -> np.ndarray:
        """The communication group along `axis` containing `rank` (ranks differing only in that axis)."""
        axis = axis.lower()
        c = {a: int(self.coord[a][rank]) for a in AXES}
        c[axis] = np.arange(self.sizes[axis])  # type: ignore[assignment]
        return np.asarray(self.rank_of(**c), dtype=np.int64).reshape(-1)

    def groups(self, axis: str) -> np.ndarray:
        """All groups along `axis`: shape (world / size, size), each row ordered by the axis coordinate."""
        axis = axis.lower()
        firsts = np.nonzero(self.coord[axis] == 0)[0]
        inv = np.empty(self.world, dtype=np.int64)
        inv[self.phys] = np.arange(self.world)
        steps = np.arange(self.sizes[axis], dtype=np.int64) * self._strides[axis]
        return self.phys[inv[firsts][:, None] + steps[None, :]]

    # -- data consumers (buckets of `distribute`) ----------------------------------------
    def consumer_index(self, axis: str) -> np.ndarray:
        """Bucket index of every global rank for `distribute(axis)`; ranks sharing data share an index."""
        axis = axis.upper()
        dp, cp = self.coord["dp"], self.coord["cp"]
        if axis == "DP":
            return dp.copy()
        if axis in ("CP", "WORLD"):
            return dp * self.cp + cp
        raise ValueError(f"unknown distribution axis {axis!r} (expected one of {', '.join(DATA_AXES)})")

    def consumers(self, axis: str) -> int:
        axis = axis.upper()
        if axis == "DP":
            return self.dp
        if axis in ("CP", "WORLD"):
            return self.dp * self.cp
        raise ValueError(f"unknown distribution axis {axis!r} (expected one of {', '.join(DATA_AXES)})")

    def consumer_ranks(self, axis: str, index: int) -> np.ndarray:
        """Global ranks that consume bucket `index` of `distribute(axis)`, ascending."""
        return np.nonzero(self.consumer_index(axis) == index)[0]

    def consumer_leader(self, axis: str) -> np.ndarray:
        """For each bucket of `distribute(axis)`, its lowest global rank (the rank a layout names)."""
        idx = self.consumer_index(axis)
        n = self.consumers(axis)
        lead = np.full(n, self.world, dtype=np.int64)
        np.minimum.at(lead, idx, np.arange(self.world, dtype=np.int64))
        return lead

    def fetchers(self, broadcast: Iterable[str] = ()) -> np.ndarray:
        """Mask of ranks that fetch from their constructor when the trainer broadcasts along `broadcast`."""
        mask = np.ones(self.world, dtype=bool)
        for a in broadcast:
            a = a.lower()
            if a not in AXES:
                raise ValueError(f"cannot broadcast along {a!r} (axes: {', '.join(AXES)})")
            mask &= self.coord[a] == 0
        return mask


class ClientPlaceTree:
    """Every module's mesh over one world, the constructor groups, and user overrides."""

    def __init__(self, modules: dict[str, ModuleMesh], *, ranks_per_node: int = 8,
                 constructors: str | list[list[int]] = "per_dp_group", broadcast: Iterable[str] = ()):
        if not modules:
            raise ValueError("a ClientPlaceTree needs at least one module")
        worlds = {n: m.world for n, m in modules.items()}
        if len(set(worlds.values())) != 1:
            raise ValueError(f"modules disagree on the world size: {worlds}")
        self.modules = dict(modules)
        self.world = next(iter(worlds.values()))
        self.ranks_per_node = int(ranks_per_node)
        backbones = [m for m in modules.values() if m.role == "backbone"]
        if len(backbones) != 1:
            raise ValueError(f"exactly one backbone module is needed, found {len(backbones)}")
        self.backbone = backbones[0]
        encs = [m for m in modules.values() if m.role == "encoder"]
        self.encoder: ModuleMesh | None = encs[0] if encs else None
        self.broadcast = tuple(a.lower() for a in broadcast)
        self._groups = self._make_groups(constructors)
        self.constructor_of_rank = np.full(self.world, -1, dtype=np.int64)
        for i, g in enumerate(self._groups):
            self.constructor_of_rank[np.asarray(g, dtype=np.int64)] = i

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec: DataMixtureSpec, overrides: dict[str, Any] | None = None) -> "ClientPlaceTree":
        """The tree the spec describes; `overrides` (or `strategy.options['place_tree']`) adjusts it.

        Override keys: ``order`` (all modules), ``modules: {name: {order, rank_map}}``, ``rank_map``
        (all modules), ``constructors`` ('per_dp_group' | 'per_node' | explicit list of rank lists),
        ``broadcast`` (axes), ``ranks_per_node``, and ``function`` ('pkg.mod:fn' called with the
        built tree, returning the tree to use).
        """
        if overrides is None:
            overrides = spec.strategy.options.get("place_tree") if spec.strategy.options else None
        overrides = dict(overrides or {})
        key = _cache_key(spec, overrides)
        hit = _CACHE.get(key)
        if hit is not None:
            return hit
        t = spec.topology
        bad = place_tree_problems(overrides, list(t.modules), "place_tree")
        if bad:  # the same rules `mixplane validate` reports, for overrides given in code
            raise ValueError("; ".join(map(str, bad)))
        order = overrides.get("order", list(t.order))
        per_mod = overrides.get("modules", {}) or {}
        meshes = {}
        for name, m in t.modules.items():
            o = per_mod.get(name, {})
            meshes[name] = ModuleMesh(name, m.resolved_role(name), {a: getattr(m, a) for a in AXES},
                                      o.get("order", order), o.get("rank_map", overrides.get("rank_map")))
        tree = cls(meshes, ranks_per_node=int(overrides.get("ranks_per_node", t.ranks_per_node)),
                   constructors=overrides.get("constructors", spec.runtime.constructors),
                   broadcast=overrides.get("broadcast", ()))
        fn = overrides.get("function")
        if fn:
            mod, _, attr = str(fn).partition(":")
            tree = getattr(importlib.import_module(mod), attr)(tree)
            if not isinstance(tree, ClientPlaceTree):
                raise TypeError(f"place_tree function {fn} must return a ClientPlaceTree")
        if len(_CACHE) > 64:
            _CACHE.clear()
        _CACHE[key] = tree
        return tree

    def with_overrides(self, *, constructors: str | list[list[int]] | None = None,
                       broadcast: Iterable[str] | None = None, ranks_per_node: int | None = None) -> "ClientPlaceTree":
        """A copy with some settings replaced (meshes are shared: they are immutable)."""
        return ClientPlaceTree(self.modules, ranks_per_node=ranks_per_node or self.ranks_per_node,
                               constructors=self._groups if constructors is None else constructors,
                               broadcast=self.broadcast if broadcast is None else broadcast)

    def _make_groups(self, constructors: str | list[list[int]]) -> list[list[int]]:
        if isinstance(constructors, str):
            if constructors == "per_node":
                n = self.ranks_per_node
                return [list(range(i, min(i + n, self.world))) for i in range(0, self.world, n)]
            if constructors == "per_dp_group":
                dp = self.backbone.coord["dp"]
                order = np.argsort(dp, kind="stable")
                bounds = np.searchsorted(dp[order], np.arange(self.backbone.dp + 1))
                return [order[bounds[d]:bounds[d + 1]].tolist() for d in range(self.backbone.dp)]
            raise ValueError(f"unknown constructor placement {constructors!r} (per_dp_group, per_node or explicit groups)")
        groups = [sorted(int(r) for r in g) for g in constructors]
        flat = [r for g in groups for r in g]
        if sorted(flat) != list(range(self.world)) or any(not g for g in groups):
            raise ValueError(f"explicit constructor groups must cover every rank 0..{self.world - 1} exactly once")
        return groups

    # -- queries --------------------------------------------------------------------------
    def module(self, name: str) -> ModuleMesh:
        try:
            return self.modules[name]
        except KeyError:
            raise KeyError(f"no module {name!r} (modules: {', '.join(self.modules)})") from None

    @property
    def image_module(self) -> ModuleMesh:
        """The module that encodes images: the encoder if there is one, else the backbone."""
        return self.encoder or self.backbone

    def coords(self, rank: int, module: str | None = None) -> RankCoords:
        m = self.backbone if module is None else self.module(module)
        return m.coords_of(rank)

    def all_coords(self, rank: int) -> dict[str, RankCoords]:
        return {n: m.coords_of(rank) for n, m in self.modules.items()}

    def constructor_groups(self) -> list[list[int]]:
        return [list(g) for g in self._groups]

    def dp_ranks_of_group(self, ranks: Iterable[int]) -> list[int]:
        r = np.asarray(list(ranks), dtype=np.int64)
        return sorted(set(self.backbone.coord["dp"][r].tolist()))

    def fetchers(self, module: str | None = None, broadcast: Iterable[str] | None = None) -> np.ndarray:
        m = self.backbone if module is None else self.module(module)
        return m.fetchers(self.broadcast if broadcast is None else broadcast)

    def vanilla_image_consumers(self, dp: int) -> np.ndarray:
        """Image-module consumer leaders (global ranks) that hold backbone DP replica `dp`'s images
        when nothing is balanced: the image-module replicas of that replica's own ranks."""
        mod = self.image_module
        ranks = np.nonzero(self.backbone.coord["dp"] == dp)[0]
        idx = np.unique(mod.consumer_index("WORLD")[ranks])
        return mod.consumer_leader("WORLD")[idx]

    def describe(self) -> str:
        """A readable rendering of the tree (for `mixplane validate --explain` and logs)."""
        lines = [f"world {self.world} ranks, {len(self._groups)} constructors, broadcast {list(self.broadcast) or '-'}"]
        for n, m in self.modules.items():
            s = " x ".join(f"{a.upper()}{m.sizes[a]}" for a in reversed(m.order))
            lines.append(f"  {n} ({m.role}): {s}; DP buckets {m.consumers('DP')}, CP buckets {m.consumers('CP')}, "
                         f"WORLD buckets {m.consumers('WORLD')}")
        return "\n".join(lines)


_CACHE: dict[str, ClientPlaceTree] = {}


def _cache_key(spec: DataMixtureSpec, overrides: dict[str, Any]) -> str:
    import json

    return json.dumps([spec.topology.model_dump(), spec.runtime.constructors, overrides], sort_keys=True, default=str)


# ---- module-level helpers kept for the servers ----------------------------------------------

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


def place_tree(spec: DataMixtureSpec) -> ClientPlaceTree:
    return ClientPlaceTree.from_spec(spec)


def backbone_coords(spec: DataMixtureSpec, rank: int) -> RankCoords:
    return place_tree(spec).backbone.coords_of(rank)


def backbone_rank(spec: DataMixtureSpec, coords: Any) -> int:
    """The global rank at explicit backbone coordinates {dp, pp, cp, tp} (unnamed axes: 0), for
    clients configured by their mesh position instead of RANK; ValueError naming what is wrong."""
    if not isinstance(coords, dict):
        raise ValueError(f"coordinates must be a mapping of {', '.join(AXES)}, got {type(coords).__name__}")
    mesh = place_tree(spec).backbone
    bad = [k for k in coords if k not in AXES]
    if bad:
        raise ValueError(f"unknown coordinate(s) {', '.join(map(str, bad))} (axes: {', '.join(AXES)})")
    for a, v in coords.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < mesh.sizes[a]:
            raise ValueError(f"coordinate {a}={v!r} outside 0..{mesh.sizes[a] - 1}")
    return int(mesh.rank_of(**{a: int(v) for a, v in coords.items()}))


def constructor_groups(spec: DataMixtureSpec) -> list[list[int]]:
    """Global ranks served by each Data Constructor (one per DP group, or one per node)."""
    return place_tree(spec).constructor_groups()


def dp_ranks_of_group(spec: DataMixtureSpec, ranks: list[int]) -> list[int]:
    return place_tree(spec).dp_ranks_of_group(ranks)


TreeFunction = Callable[[ClientPlaceTree], ClientPlaceTree]


def encoder_leaders(spec: DataMixtureSpec) -> np.ndarray:
    """Global rank -> the rank its images are assigned to: the lowest rank of its image-module DP x CP
    bucket (consumer_leader; every rank of an encoder declared {dp: world}). The constructor hands a
    rank its leader's images; the planner lists those images in the rank's constructor's plan."""
    mod = place_tree(spec).image_module
    return np.asarray(mod.consumer_leader("WORLD")[mod.consumer_index("WORLD")], np.int64)


def topology_digest(spec: DataMixtureSpec) -> str:
    """A short digest of the spec's topology and of how constructors are placed on it: a constructor whose spec
    file says another topology than the planner's (a ConfigMap mounted before a live reshard) must not serve."""
    import hashlib
    import json

    doc = {"topology": spec.topology.model_dump(mode="json"), "constructors": spec.runtime.constructors}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]
