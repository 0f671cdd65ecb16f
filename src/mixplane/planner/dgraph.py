"""DGraph: the planner's programming model (MegaScale-Data §4, Fig. 8 / 9).

A DGraph holds the metadata of one step's samples (never payloads) and records, primitive by
primitive, how they are to be distributed over the ClientPlaceTree:

    g = DGraph(ctx).mix()                          # which samples train this step (exact, stratified)
    g.distribute(axis="DP")                        # buckets = DP replicas, bins = their microbatches
    g.cost(backbone_cost(ctx.spec))                # per-sample cost (FLOPs) from metadata
    g.balance(method="greedy", level="inter")      # move work so every bucket / bin costs the same
    g.broadcast_at("TP")                           # only tp = 0 ranks fetch; the trainer broadcasts (also PP, CP)
    layout = g.plan()                              # the StepLayout constructors materialise

Nodes are *pieces*: token spans of samples (a document longer than seq_len is split into pieces,
each its own attention segment); `mix` packs them into the step's rows, which `balance` moves
around. What each primitive does (balance levels, keep_global_batch, the axes of distribute, the
image graph, the low-level hooks for custom policies): docs/planner.md, "DGraph in ten lines".
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.layout import StepLayout, segment_offsets
from mixplane.planner import balance as B
from mixplane.planner import hybridcp, layoutloop
from mixplane.planner.context import PlanContext
from mixplane.planner.cost import CostFn, TransformerFlops
from mixplane.topology import ClientPlaceTree

LEVELS = ("inter", "intra", "both")
BROADCAST_DIMS = ("tp", "pp", "cp")  # the broadcasts constructors and the client implement (parallelism.FANOUT_ORDER)


class DGraphError(MixplaneError, ValueError):
    """A primitive used in a way that cannot work (names the primitive and the step)."""


class DGraph:
    """One step's samples and the orchestration decisions taken on them."""

    def __init__(self, ctx: PlanContext, *, kind: str = "text", parent: "DGraph | None" = None):
        if kind not in ("text", "image"):
            raise DGraphError(f"unknown DGraph kind {kind!r}")
        self.ctx = ctx
        self.tree = ctx.tree
        self.kind = kind
        self.parent = parent
        self.module = self.tree.backbone if kind == "text" else self.tree.image_module
        self.axis: str | None = None
        self.group_size: int | None = None
        self.cost_fn: CostFn | None = None
        self.costs: np.ndarray | None = None
        self.broadcast: list[str] = []
        self.balanced: dict[str, Any] | None = None
        self._hooks: dict[str, list[Callable[["DGraph"], None]]] = {}
        self._image_graph: DGraph | None = None
        # text state: global row of each piece and its ordering key inside the row
        self._row: np.ndarray | None = None
        self._key: np.ndarray | None = None
        # image state: index (into pieces) of each image node, and its encoder rank
        self._img_idx: np.ndarray | None = None
        self._img_rank: np.ndarray | None = None
        # hybrid_cp(deliver=True): (cp, first CP rank of each piece's group in its replica, group size)
        self._hybrid: tuple[int, np.ndarray, np.ndarray] | None = None

    def __repr__(self) -> str:
        n = len(self.ctx.pieces) if self.ctx.mixed else "?"
        return (f"DGraph({self.kind}, step {self.ctx.step}, {n} pieces, axis={self.axis}, "
                f"cost={self.cost_fn!r}, balanced={self.balanced and self.balanced.get('method')})")

    # ---- Extract -------------------------------------------------------------------------------
    def mix(self, schedule: Any = None, *, exclude: Iterable[tuple[int, int]] | None = None) -> "DGraph":
        """Select this step's samples by deterministic stratified sampling of `schedule` (default: the
        mixture's schedule). Only mixed samples take part in what follows. Calling it again re-mixes."""
        root = self.root
        root.ctx.mix(schedule, exclude=exclude)
        root._row = root._key = None
        root._hybrid = None
        if root._image_graph is not None:
            root._image_graph._img_idx = root._image_graph._img_rank = None
        return self

    @property
    def root(self) -> "DGraph":
        return self.parent.root if self.parent is not None else self

    @property
    def pieces(self):
        return self.ctx.pieces

    def images(self) -> "DGraph":
        """The image DGraph over the same buffer: one node per image (its patch count is the metadata)."""
        root = self.root
        if root._image_graph is None:
            root._image_graph = DGraph(self.ctx, kind="image", parent=root)
        return root._image_graph

    def nodes(self) -> dict[str, np.ndarray]:
        """Metadata of this graph's nodes as arrays (what cost functions see)."""
        p = self.pieces
        if self.kind == "text":
            return {"length": p.length, "patches": p.patches, "source": p.source, "key": p.key,
                    "start": p.start, "row": self.rows(), "replica": p.replica, "pos": p.pos}
        idx = self._images_idx()
        return {"patches": p.patches[idx], "length": p.length[idx], "source": p.source[idx], "key": p.key[idx],
                "start": p.start[idx], "piece": idx}

    def summary_buffer(self) -> dict[str, Any]:
        """What the loaders' windows hold (MegaScale-Data's `summary_buffer`): per source samples and tokens."""
        return self.ctx.summary_buffer()

    def __len__(self) -> int:
        return len(self.pieces) if self.kind == "text" else len(self._images_idx())

    # ---- Orchestrate ---------------------------------------------------------------------------
    def distribute(self, axis: str = "DP", group_size: int | None = None) -> "DGraph":
        """Text: buckets are the DP replicas whatever the axis; 'CP' / 'WORLD' make a row cost its busiest
        zig-zag CP shard x cp (see row_costs). Images: buckets are the module's consumers at `axis`.
        With group_size, balancing happens within groups of that many buckets."""
        axis = str(axis).upper()
        if axis not in ("DP", "CP", "WORLD"):
            raise DGraphError(f"step {self.ctx.step}: distribute: unknown axis {axis!r} (DP, CP or WORLD)")
        if group_size is not None and int(group_size) < 1:
            raise DGraphError(f"step {self.ctx.step}: distribute: group_size must be >= 1")
        self.axis = axis
        self.group_size = int(group_size) if group_size else None
        return self

    @property
    def buckets(self) -> int:
        if self.kind == "image":
            return self.module.consumers(self.axis or "WORLD")
        return self.ctx.dp

    @property
    def capacity(self) -> int:
        """Token limit of one bin (microbatch): rows_per_microbatch x seq_len."""
        return self.ctx.rows_per_microbatch * self.ctx.seq_len

    def cost(self, fn: CostFn) -> "DGraph":
        """Register a cost function of node metadata (vectorised) and evaluate it."""
        if not callable(fn):
            raise DGraphError(f"step {self.ctx.step}: cost: {fn!r} is not callable")
        c = np.asarray(fn(self.nodes()), dtype=np.float64)
        if c.shape != (len(self),):
            raise DGraphError(f"step {self.ctx.step}: cost function returned shape {c.shape}, expected ({len(self)},)")
        if len(c) and (not np.all(np.isfinite(c)) or c.min() < 0):
            raise DGraphError(f"step {self.ctx.step}: cost function returned negative or non-finite costs")
        self.cost_fn = fn
        self.costs = c
        self._run_hooks("cost")
        return self

    def balance(self, method: str = "greedy", level: str = "inter", keep_global_batch: bool = True) -> "DGraph":
        """Even the cost over buckets and bins (see the module docstring for levels)."""
        step = self.ctx.step
        if method not in B.METHODS:
            raise DGraphError(f"step {step}: balance: unknown method {method!r} (greedy, karmarkar_karp, none)")
        if level not in LEVELS:
            raise DGraphError(f"step {step}: balance: unknown level {level!r} (inter, intra, both)")
        if self.axis is None:
            self.distribute("WORLD" if self.kind == "image" else "DP")
        if self.costs is None:
            raise DGraphError(f"step {step}: balance needs cost(fn) first")
        if self.kind == "image":
            self._balance_images(method)
        else:
            self._balance_text(method, level, keep_global_batch)
        self._run_hooks("balance")
        return self

    def broadcast_at(self, dim: str) -> "DGraph":
        """The trainer broadcasts along `dim` ('TP', 'PP' or 'CP'): only the group's coordinate-0 rank fetches
        what the group needs (CP: the whole sequence; PP: every stage's fields) and the client fans it out
        (`client.fan_out`; TP: `broadcast_tp`). 'DP' is refused: DP replicas train on different data, a DP
        group shares nothing one rank could fetch for the others."""
        d = str(dim).lower()
        if d not in BROADCAST_DIMS:
            allowed = ", ".join(a.upper() for a in BROADCAST_DIMS)
            why = ("DP replicas receive different data: nothing is shared within a DP group" if d == "dp"
                   else "unknown dimension")
            raise DGraphError(f"step {self.ctx.step}: broadcast_at: {dim!r}: {why}; allowed: {allowed}")
        if d not in self.broadcast:
            self.broadcast.append(d)
        root = self.root
        if d not in root.ctx.broadcast:
            root.ctx.broadcast.append(d)
        return self

    def fetchers(self) -> np.ndarray:
        """Mask of global ranks that fetch from their Data Constructor under the step's broadcasts (those
        recorded here and the ClientPlaceTree's)."""
        return self.module.fetchers(self.root.ctx.broadcast)

    def on(self, event: str, fn: Callable[["DGraph"], None]) -> "DGraph":
        """Call fn(graph) after 'cost', 'balance' or before 'plan' (hooks for custom policies)."""
        if event not in ("cost", "balance", "plan"):
            raise DGraphError(f"unknown hook event {event!r} (cost, balance, plan)")
        self._hooks.setdefault(event, []).append(fn)
        return self

    def _run_hooks(self, event: str) -> None:
        for fn in self._hooks.get(event, []):
            fn(self)

    # ---- text internals --------------------------------------------------------------------------
    def rows(self) -> np.ndarray:
        """Current global row of every piece (initially mix's packing)."""
        root = self.root
        if root._row is None:
            root._row = self.pieces.bin.astype(np.int64).copy()
            root._key = np.arange(len(self.pieces), dtype=np.int64)
        return root._row

    def within_row_key(self) -> np.ndarray:
        self.rows()
        return self.root._key  # type: ignore[return-value]

    def set_rows(self, row_of_piece: np.ndarray, within_row_key: np.ndarray | None = None) -> "DGraph":
        """Low-level: put pieces in these rows (ordered inside a row by within_row_key)."""
        root = self.root
        r = np.asarray(row_of_piece, dtype=np.int64)
        if r.shape != (len(self.pieces),):
            raise DGraphError(f"step {self.ctx.step}: set_rows: need one row per piece ({len(self.pieces)})")
        if len(r) and (r.min() < 0 or r.max() >= self.ctx.rows):
            raise DGraphError(f"step {self.ctx.step}: set_rows: row out of range 0..{self.ctx.rows - 1}")
        root._row = r.copy()
        root._key = np.arange(len(r), dtype=np.int64) if within_row_key is None else np.asarray(within_row_key, np.int64).copy()
        return self

    def assign_rows(self, row_of_row: np.ndarray) -> "DGraph":
        """Low-level: move whole rows: current row i becomes row row_of_row[i] (a permutation)."""
        perm = np.asarray(row_of_row, dtype=np.int64)
        if (perm.shape != (self.ctx.rows,) or (len(perm) and (perm.min() < 0 or perm.max() >= self.ctx.rows))
                or np.any(np.bincount(perm, minlength=self.ctx.rows) != 1)):
            raise DGraphError(f"step {self.ctx.step}: assign_rows needs a permutation of the {self.ctx.rows} rows")
        root = self.root
        root._row = perm[self.rows()]
        return self

    def piece_costs(self) -> np.ndarray:
        if self.costs is None:
            raise DGraphError(f"step {self.ctx.step}: no cost function registered")
        return self.costs

    def offsets_in_row(self) -> np.ndarray:
        """Token offset of every piece inside its row, given the current order."""
        return _offsets(self.rows(), self.within_row_key(), self.pieces.length)

    def shard_costs(self) -> np.ndarray:
        """(rows, cp) cost of every row's zig-zag context-parallel shards under the current order."""
        cp = self.module.cp
        return _cp_shard_costs(self.rows(), self.offsets_in_row(), self.pieces.length, self.piece_costs(),
                               self.cost_fn, self.ctx.rows, self.ctx.seq_len, cp)

    def row_costs(self) -> np.ndarray:
        """Cost of every row as its consumers experience it: the sum of its pieces, or with axis 'CP'
        (and cp > 1) the busiest zig-zag shard times cp (CP ranks work on a row in lock-step)."""
        if self.axis in ("CP", "WORLD") and self.module.cp > 1:
            return self.shard_costs().max(axis=1) * self.module.cp
        return np.bincount(self.rows(), weights=self.piece_costs(), minlength=self.ctx.rows)

    def bucket_costs(self) -> np.ndarray:
        return self.row_costs().reshape(self.ctx.dp, -1).sum(axis=1)

    def _balance_text(self, method: str, level: str, keep_global_batch: bool) -> None:
        ctx = self.ctx
        stats: dict[str, Any] = {"method": method, "level": level, "keep_global_batch": keep_global_batch,
                                 "axis": self.axis}
        before = self.bucket_costs()
        stats["imbalance_before"] = B.imbalance(before)
        if not keep_global_batch and method != "none" and ctx.spec.batch.packing == "none":
            stats["repack"] = "skipped: batch.packing is 'none' (one document per row)"
        elif not keep_global_batch and method != "none":
            rows = B.pack_balanced(self.pieces.length, self.piece_costs(), ctx.rows, ctx.seq_len, method)
            if rows is None:
                stats["repack"] = "kept mix packing (balanced re-packing could not place every piece)"
            else:
                self.set_rows(rows)
                stats["repack"] = "balanced"
        if level in ("intra", "both") and self.module.cp > 1 and method != "none":
            self._order_for_cp()
        if level in ("inter", "both"):
            rc = self.row_costs()
            perm = _deal_rows(rc, ctx.dp, ctx.microbatches, ctx.rows_per_microbatch, method, self.group_size)
            cur = rc.reshape(ctx.dp, -1).sum(axis=1).max()
            new = np.bincount(perm // (ctx.microbatches * ctx.rows_per_microbatch), weights=rc, minlength=ctx.dp).max()
            if method == "none" or new <= cur * (1 + 1e-12):
                self.assign_rows(perm)
            else:  # never worse than the order mix produced
                stats["kept_mix_order"] = True
        after = self.bucket_costs()
        stats["imbalance_after"] = B.imbalance(after)
        self.balanced = stats
        ctx.stats["text"] = stats

    def hybrid_cp(self, deliver: bool = False) -> hybridcp.HybridPlacement:
        """Hybrid DP x CP consumers (planner/hybridcp.py, Megatron-LM's hybrid data x context parallelism): every
        piece on a power-of-two group of the dp x cp ranks sized by its length -- long pieces spread over CP,
        short ones whole on one rank -- balanced by cost, beside the fixed scheme (rows as balanced now, each cut
        over its replica's CP group). Both balances go into the step's stats (``ctx.stats['hybrid_cp']``).

        ``deliver=True``: the step's layout carries the placement (``StepLayout.hybrid_cp``; pieces moved into
        rows of their group's replica) and constructors cut every piece over its group; needs cp a power of two,
        text only, no CP / PP broadcast. Without it the layout stays the fixed scheme's."""
        if self.kind != "text":
            raise DGraphError(f"step {self.ctx.step}: hybrid_cp places text pieces; call it on the text graph")
        ctx, cp = self.ctx, self.module.cp
        cost = self.piece_costs()
        n = ctx.dp * cp
        if ctx.seq_len % cp:
            raise DGraphError(f"step {ctx.step}: hybrid_cp: seq_len {ctx.seq_len} is not a multiple of cp {cp}")
        if deliver and cp & (cp - 1):
            raise DGraphError(f"step {ctx.step}: hybrid_cp(deliver=True): cp {cp} is not a power of two (a group "
                              "of the DP x CP ranks must stay inside one DP replica)")
        if deliver and len(self.pieces) and bool(np.any(self.pieces.patches > 0)):
            raise DGraphError(f"step {ctx.step}: hybrid_cp(deliver=True) delivers text only; this step has images")
        per_rank = ctx.seq_len // cp
        lengths = self.pieces.length.astype(np.int64)
        capacity = ctx.rows // ctx.dp * per_rank
        fixed = hybridcp.fixed_loads(self.shard_costs(), ctx.dp)
        try:
            placed = hybridcp.place(lengths, cost, n, per_rank, capacity)
        except ValueError as e:
            raise DGraphError(f"step {ctx.step}: hybrid_cp: {e}") from None
        stats: dict[str, Any] = {}
        if deliver:
            rpr = ctx.rows // ctx.dp
            try:
                got = hybridcp.place_in_rows(lengths, cost, ctx.dp, cp, per_rank, capacity, rpr, ctx.seq_len)
            except ValueError as e:
                raise DGraphError(f"step {ctx.step}: hybrid_cp: {e}") from None
            if got is None:  # a piece found no row in any replica: place inside the replicas as balanced
                rep = self.rows() // rpr
                within = hybridcp.within_replicas(lengths, cost, rep, ctx.dp, cp, per_rank, capacity)
                spread = hybridcp.spread_replicas(lengths, cost, rep, ctx.dp, cp)
                placed = within if within.loads.max() <= spread.loads.max() else spread
                stats["delivered"] = "within_replicas" if placed is within else "spread_replicas"
            else:
                placed, rows = got
                self.set_rows(rows)
                stats["delivered"] = "dp_x_cp"
            self.root._hybrid = (cp, placed.first % cp, placed.group_size)
        ctx.stats["hybrid_cp"] = {"consumers": n, "imbalance_fixed": B.imbalance(fixed),
                                  "imbalance_hybrid": B.imbalance(placed.loads),
                                  "busiest_ratio": float(placed.loads.max() / max(fixed.max(), 1e-300)),
                                  "cp_token_fraction": placed.cp_token_fraction(lengths) if cp > 1 else 0.0,
                                  "overflow": placed.overflow, **stats}
        return placed

    def _order_for_cp(self) -> None:
        """Intra-row: choose for every row the document order whose busiest zig-zag shard is lightest."""
        rows = self.rows()
        n = len(rows)
        if n == 0:
            return
        length = self.pieces.length
        cost = self.piece_costs()
        base = self.within_row_key()
        # candidate orders, as ranks inside the row
        cands = {
            "mix": base,
            "long_first": _rank_within(rows, -length, base),
            "long_last": _rank_within(rows, length, base),
            "alternate": _alternate_within(rows, length, base),
            "reverse": _rank_within(rows, -base, base),
        }
        best_cost = None
        best_key = base
        for key in cands.values():
            off = _offsets(rows, key, length)
            sc = _cp_shard_costs(rows, off, length, cost, self.cost_fn, self.ctx.rows, self.ctx.seq_len, self.module.cp).max(axis=1)
            if best_cost is None:
                best_cost, best_key = sc, key.copy()
                continue
            better = sc < best_cost * (1 - 1e-12)
            if better.any():
                take = better[rows]
                best_key = np.where(take, key, best_key)
                best_cost = np.where(better, sc, best_cost)
        self.root._key = best_key

    # ---- image internals ---------------------------------------------------------------------------
    def _images_idx(self) -> np.ndarray:
        if self._img_idx is None:
            self._img_idx = np.nonzero(self.pieces.patches > 0)[0]
        return self._img_idx

    def set_image_ranks(self, ranks: np.ndarray) -> "DGraph":
        """Low-level: the global rank (an image-module consumer leader) that encodes each image node."""
        r = np.asarray(ranks, dtype=np.int64)
        if r.shape != (len(self._images_idx()),):
            raise DGraphError(f"step {self.ctx.step}: set_image_ranks: need one rank per image")
        valid = self.module.consumer_leader("WORLD")
        if len(r) and not np.all(np.isin(r, valid)):
            raise DGraphError(f"step {self.ctx.step}: set_image_ranks: a rank is not an encoder consumer")
        self._img_rank = r
        return self

    def _balance_images(self, method: str) -> None:
        axis = self.axis or "WORLD"
        n_b = self.module.consumers(axis)
        leaders = self.module.consumer_leader(axis)
        costs = self.piece_costs()
        stats: dict[str, Any] = {"method": method, "axis": axis, "buckets": n_b}
        if method == "none":
            self._img_rank = None  # vanilla placement at plan time
        else:
            b = B.assign(costs, n_b, method, group_size=self.group_size)
            self._img_rank = leaders[b]
            stats["imbalance_after"] = B.imbalance(np.bincount(b, weights=costs, minlength=n_b))
        self.balanced = stats
        self.ctx.stats["image"] = stats

    def image_ranks(self, row_of_piece: np.ndarray) -> np.ndarray:
        """Encoder rank of every image node: balanced, or the vanilla placement (each DP replica's images
        dealt round-robin, in row order, over its own encoder consumers)."""
        idx = self._images_idx()
        if self._img_rank is not None:
            return self._img_rank
        return vanilla_image_ranks(self.tree, row_of_piece[idx], self.ctx.rows_per_microbatch * self.ctx.microbatches)

    # ---- Finalize ------------------------------------------------------------------------------------
    def plan(self, *others: "DGraph") -> StepLayout:
        """The StepLayout of this graph (and of the image graph, if one was built or passed)."""
        root = self.root
        root._run_hooks("plan")
        img = None
        for g in (self, *others):
            if g.kind == "image":
                img = g
        if img is None:
            img = root._image_graph
        if img is not None:
            img._run_hooks("plan")
        rows = root.rows()
        img_rank = (img or root.images()).image_ranks(rows)
        if root._hybrid is not None:
            both = sorted({"cp", "pp"} & set(root.ctx.broadcast))
            if both:
                raise DGraphError(f"step {self.ctx.step}: hybrid_cp delivery with broadcast_at({', '.join(a.upper() for a in both)}): "
                                  "a hybrid step's CP groups change per sequence; only TP broadcasts")
            return build_layout(self.ctx, rows, root.within_row_key(), img_rank, hybrid=root._hybrid)
        return root.plan_raw(rows, root.within_row_key(), img_rank)

    def plan_raw(self, row_of_piece: np.ndarray, within_row_key: np.ndarray | None = None,
                 img_rank: np.ndarray | None = None) -> StepLayout:
        """Low-level: a layout straight from a row per piece, an order inside rows and image ranks."""
        return build_layout(self.ctx, row_of_piece, within_row_key, img_rank)


# ---- helpers ------------------------------------------------------------------------------------------

def _row_order(rows: np.ndarray, key: np.ndarray) -> np.ndarray:
    """np.lexsort((arange, key, rows)) -- by row, then key, then index -- without a three-key sort when
    the keys allow: one sort of the distinct codes (rows * span + key - min) * n + index while they fit in int64."""
    n = len(rows)
    if n == 0:
        return np.zeros(0, np.int64)
    got, done = layoutloop.order_by_row(rows, key)  # keys in index order, small rows: one compiled pass
    if done:
        return got
    kmin, kmax = int(key.min()), int(key.max())
    rmax = int(rows.max())
    if n == 1 or bool((key[1:] > key[:-1]).all()):  # keys in index order: a stable sort by row (radix for 16 bits)
        if int(rows.min()) >= 0 and rmax < 1 << 16:
            return np.argsort(rows.astype(np.uint16), kind="stable")
        return np.argsort(rows, kind="stable")
    span = kmax - kmin + 1
    if int(rows.min()) >= 0 and (rmax + 1) * span * n < 1 << 62:
        return np.argsort((rows * span + (key - kmin)) * n + np.arange(n, dtype=np.int64))
    return np.lexsort((np.arange(n), key, rows))


def build_layout(ctx: PlanContext, row_of_piece: np.ndarray, within_row_key: np.ndarray | None = None,
                 img_rank: np.ndarray | None = None, *, hybrid: tuple[int, np.ndarray, np.ndarray] | None = None) -> StepLayout:
    """StepLayout from one global row per piece; `img_rank` lists, for the image pieces in piece order
    (patches > 0), the global rank that encodes them (default: vanilla placement); `hybrid`: (cp, first CP
    rank of every piece's group, its size), in piece order, for a hybrid DP x CP layout."""
    p = ctx.pieces
    n = len(p)
    rows = np.asarray(row_of_piece, dtype=np.int64)
    key = np.arange(n, dtype=np.int64) if within_row_key is None else np.asarray(within_row_key, dtype=np.int64)
    order = _row_order(rows, key)
    if img_rank is None:
        img_rank = vanilla_image_ranks(ctx.tree, rows[p.patches > 0], ctx.microbatches * ctx.rows_per_microbatch)
    gathered, o_img = layoutloop.gather_columns(order, rows, p.source, p.key, p.start, p.length, p.patches, img_rank)
    cols: dict[str, Any] = dict(gathered)
    if hybrid is not None:
        cols["hybrid_cp"] = int(hybrid[0])
        cols["seg_cp_first"] = np.asarray(hybrid[1], np.int64)[order].astype(np.int16)
        cols["seg_cp_size"] = np.asarray(hybrid[2], np.int64)[order].astype(np.int16)
    layout = StepLayout(
        step=ctx.step, seq_len=ctx.seq_len, dp=ctx.dp, microbatches=ctx.microbatches,
        rows_per_microbatch=ctx.rows_per_microbatch, phase=ctx.point.phase, lr_scale=ctx.point.lr_scale,
        generation=ctx.point.generation, **cols,
    )
    ctx.built = (layout, order, o_img)  # the coverage check verifies this pairing instead of searching one
    return layout


def vanilla_image_ranks(tree: ClientPlaceTree, image_rows: np.ndarray, rows_per_rank: int) -> np.ndarray:
    """No balancing: images of backbone DP replica d go round-robin (in the given order) to d's own
    image-module consumers."""
    image_rows = np.asarray(image_rows, dtype=np.int64)
    if len(image_rows) == 0:
        return np.zeros(0, dtype=np.int64)
    dp = image_rows // rows_per_rank
    out = np.empty(len(image_rows), dtype=np.int64)
    for d in np.unique(dp):
        sel = np.nonzero(dp == d)[0]
        sel = sel[np.argsort(image_rows[sel], kind="stable")]
        cons = tree.vanilla_image_consumers(int(d))
        out[sel] = cons[np.arange(len(sel)) % len(cons)]
    return out


def _deal_rows(row_cost: np.ndarray, dp: int, microbatches: int, rows_per_mb: int, method: str,
               group_size: int | None) -> np.ndarray:
    """Permutation: current row -> new global row, so every DP bucket gets rows_per_rank rows and every
    microbatch rows_per_microbatch of them, with microbatch costs and bucket totals balanced.

    Two single-group balancing problems: rows onto the dp x microbatches bins (equal counts), then
    those bins onto the dp buckets (equal counts) — the second also evens the buckets when bins hold
    a single row and so cannot be evened themselves."""
    n_rows = len(row_cost)
    n_bins = dp * microbatches
    if rows_per_mb > 1:
        bin_of_row = B.assign(row_cost, n_bins, method, equal_count=True)
    else:
        bin_of_row = np.arange(n_rows, dtype=np.int64)
    bin_cost = np.bincount(bin_of_row, weights=row_cost, minlength=n_bins)
    if dp > 1:
        bucket_of_bin = B.assign(bin_cost, dp, method, equal_count=True, group_size=group_size)
    else:
        bucket_of_bin = np.zeros(n_bins, dtype=np.int64)
    if np.any(np.bincount(bucket_of_bin, minlength=dp) != microbatches):
        raise AssertionError("row dealing produced uneven buckets")  # equal-count balancers guarantee it
    if np.any(np.bincount(bin_of_row, minlength=n_bins) != rows_per_mb):
        raise AssertionError("row dealing produced uneven microbatches")
    # microbatch index of each bin inside its bucket, and slot of each row inside its bin (stable orders)
    mb_in_bucket = B.slots_in_bins(bucket_of_bin, dp)
    slot = B.slots_in_bins(bin_of_row, n_bins) if rows_per_mb > 1 else np.zeros(n_rows, dtype=np.int64)
    return (bucket_of_bin[bin_of_row] * microbatches + mb_in_bucket[bin_of_row]) * rows_per_mb + slot


def _offsets(rows: np.ndarray, key: np.ndarray, length: np.ndarray) -> np.ndarray:
    n = len(rows)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(n), key, rows))
    off = np.empty(n, dtype=np.int64)
    off[order] = segment_offsets(rows[order], length[order])
    return off


def _rank_within(rows: np.ndarray, primary: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """Ordering key: pieces of a row sorted by `primary` (then tiebreak)."""
    n = len(rows)
    order = np.lexsort((tiebreak, primary, rows))
    key = np.empty(n, dtype=np.int64)
    key[order] = np.arange(n)
    return key


def _alternate_within(rows: np.ndarray, length: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """Longest documents in the middle of the row, alternating outwards (a V shape)."""
    n = len(rows)
    order = np.lexsort((tiebreak, -length, rows))
    r = rows[order]
    first = np.searchsorted(r, r, side="left")
    q = np.arange(n) - first  # rank by length desc inside the row
    # even ranks go right of centre (ascending), odd ranks left (descending)
    pos = np.where(q % 2 == 0, q // 2, -(q // 2) - 1)
    key = np.empty(n, dtype=np.int64)
    key[order] = pos
    return key


def _cp_shard_costs(rows: np.ndarray, offsets: np.ndarray, length: np.ndarray, cost: np.ndarray,
                    cost_fn: Any, n_rows: int, seq_len: int, cp: int) -> np.ndarray:
    """(n_rows, cp) cost each context-parallel rank carries under the zig-zag split (2 cp chunks per
    row; rank k holds chunks k and 2cp-1-k). Token t of a causal document costs linear + pair * (its
    position + 1); for cost functions without that structure the cost is split by tokens."""
    out = np.zeros((n_rows, max(cp, 1)))
    n = len(rows)
    if n == 0:
        return out
    if cp <= 1:
        out[:, 0] = np.bincount(rows, weights=cost, minlength=n_rows)
        return out
    C = seq_len // (2 * cp)
    if C <= 0:
        raise DGraphError(f"seq_len {seq_len} is too short for cp={cp}")
    a = offsets.astype(np.int64)
    L = length.astype(np.int64)
    j0 = a // C
    j1 = (a + L - 1) // C
    cnt = j1 - j0 + 1
    pid = np.repeat(np.arange(n), cnt)
    first = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    j = j0[pid] + (np.arange(len(pid)) - first[pid])
    lo = np.maximum(a[pid], j * C)
    hi = np.minimum(a[pid] + L[pid], (j + 1) * C)
    ntok = (hi - lo).astype(np.float64)
    flops = getattr(cost_fn, "flops", None)
    if isinstance(flops, TransformerFlops) and flops.causal:
        u_hi = (hi - a[pid]).astype(np.float64)
        u_lo = (lo - a[pid]).astype(np.float64)
        pairs = u_hi * (u_hi + 1) * 0.5 - u_lo * (u_lo + 1) * 0.5
        w = flops.linear_per_token * ntok + flops.per_pair * pairs
    else:
        w = cost[pid] * ntok / np.maximum(L[pid], 1)
    jj = np.minimum(j, 2 * cp - 1)
    rank = np.where(jj < cp, jj, 2 * cp - 1 - jj)
    flat = rows[pid] * cp + rank
    out += np.bincount(flat, weights=w, minlength=n_rows * cp).reshape(n_rows, cp)
    return out


def layout_from_rows(ctx: PlanContext, row_of_bin: np.ndarray) -> StepLayout:
    """Turn packed bins into a layout, given the global row each bin goes to (a permutation)."""
    p = ctx.pieces
    rows = np.asarray(row_of_bin, np.int64)[p.bin] if len(p) else np.zeros(0, np.int64)
    return build_layout(ctx, rows)


def vanilla_strategy(ctx: PlanContext) -> StepLayout:
    """No balancing: bin b is row b (rank b // rows_per_rank); images stay on their replica's ranks."""
    return layout_from_rows(ctx, np.arange(ctx.rows))
