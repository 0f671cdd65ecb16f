"""Who sends what where: a step's layout turned into per-loader instructions (pure, vectorised).

Every segment goes to every constructor that serves its data-parallel rank; an image sample's
pixels go only to the constructors serving the rank that encodes it (`img` flag) — with an
image-only instruction (0 tokens) when that constructor gets no token span of the sample. A
sample is retired from its loader's window with the last instruction that mentions it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixplane.layout import HYBRID_ARRAYS, IMAGE_ARRAYS, SEGMENT_ARRAYS, StepLayout
from mixplane.planner import routeloop
from mixplane.planner.selectloop import match
from mixplane.protocol import ENCODER_TOKENS, IMG_BASE
from mixplane.topology import encoder_leaders
from mixplane.wire.framing import Column


@dataclass
class Fanout:
    """A CSR map from an index (dp rank, or global rank) to the constructors that need it."""

    offsets: np.ndarray  # int64 [n + 1]
    targets: np.ndarray  # int32

    @classmethod
    def from_lists(cls, lists: list[list[int]]) -> "Fanout":
        counts = np.array([len(x) for x in lists], np.int64)
        offsets = np.zeros(len(lists) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = np.array([t for x in lists for t in x], np.int32)
        return cls(offsets, flat)

    def expand(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which input each output came from, its target) for every (input, target) pair."""
        idx = np.asarray(idx, np.int64)
        counts = self.offsets[idx + 1] - self.offsets[idx]
        src = np.repeat(np.arange(len(idx)), counts)
        first = np.repeat(self.offsets[idx], counts)
        within = np.arange(len(src)) - np.repeat(np.cumsum(counts) - counts, counts)
        return src, self.targets[first + within]


@dataclass
class Instructions:
    """One loader replica's part of a step (the arrays of a PLAN_LOADER message)."""

    pos: np.ndarray  # int64 stream position of the sample
    start: np.ndarray  # int64 token offset of the span
    len: np.ndarray  # int64 tokens (0: image only)
    dest: np.ndarray  # int32 constructor index
    retire: np.ndarray  # uint8: the loader may drop the sample after this step
    img: np.ndarray  # uint8: attach the sample's pixels for this destination

    def arrays(self) -> dict[str, np.ndarray]:
        return {"pos": self.pos, "start": self.start, "len": self.len, "dest": self.dest, "retire": self.retire, "img": self.img}


INSTRUCTION_ARRAYS = ("pos", "start", "len", "dest", "retire", "img")  # a PLAN_LOADER's arrays, in wire order


class LoaderRoutes(Mapping[tuple[int, int], Instructions]):
    """Every loader's instructions of a step as one set of columns, cut by loader (routeloop.route's output):
    the PLAN_LOADER messages are encoded column by column (`columns`, wire.encode_columns) instead of
    cutting 1,024 loaders' arrays one by one. As a Mapping (source, replica) -> Instructions, built when
    asked (planner.inflight keeps a step's routes for restarted loaders)."""

    def __init__(self, cols: tuple[np.ndarray, ...], keys: list[tuple[int, int]], bounds: list[int]):
        self.cols = cols  # INSTRUCTION_ARRAYS, grouped by loader
        self.loaders = keys  # (source, replica) of every loader, in message order
        self.bounds = bounds  # loader g's instructions are cols[:][bounds[g]:bounds[g + 1]]
        self._at = {k: g for g, k in enumerate(keys)}

    def __getitem__(self, key: tuple[int, int]) -> Instructions:
        g = self._at[key]
        lo, hi = self.bounds[g], self.bounds[g + 1]
        return Instructions(*(c[lo:hi] for c in self.cols))

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self.loaders)

    def __len__(self) -> int:
        return len(self.loaders)

    def columns(self) -> list[Column]:
        """The PLAN_LOADER arrays of every loader (in `loaders` order), for wire.encode_columns."""
        return [Column(n, c, self.bounds) for n, c in zip(INSTRUCTION_ARRAYS, self.cols)]


def loader_instructions(*args: Any, **kw: Any) -> dict[tuple[int, int], Instructions]:
    """Per (source, replica): what to send to which constructor (loader_routes, one Instructions each)."""
    return dict(loader_routes(*args, **kw).items())


def loader_routes(layout: StepLayout, piece_source: np.ndarray, piece_key: np.ndarray, piece_start: np.ndarray,
                  piece_replica: np.ndarray, piece_pos: np.ndarray, retired: np.ndarray,
                  dp_fanout: Fanout, rank_fanout: Fanout,
                  piece_of_seg: np.ndarray | None = None,
                  seg_of_img: np.ndarray | None = None) -> LoaderRoutes:
    """Per (source, replica): what to send to which constructor.

    `retired[i]` says piece i's sample leaves its window with this step. Pieces and layout segments
    are the same spans (the planner checks coverage), matched here by (source, key, start) unless
    `piece_of_seg` (the coverage check's match: the piece of every segment) is given; an image's first
    span likewise unless `seg_of_img` (image_segments) is given.
    """
    n = len(layout.seg_row)
    if len(piece_source) != n:
        raise ValueError(f"step {layout.step}: {len(piece_source)} pieces for {n} segments")
    # align pieces with segments: the piece of every segment
    if piece_of_seg is not None and len(piece_of_seg) == n:
        pidx = np.asarray(piece_of_seg, np.int64)
    else:
        lo = np.lexsort((layout.seg_start, layout.seg_key, layout.seg_source))
        po = np.lexsort((piece_start, piece_key, piece_source))
        pidx = np.empty(n, np.int64)
        pidx[lo] = po
    # images: the first span of each (the instruction that carries its pixels, or beside which an image-only one goes)
    if len(layout.img_key) and seg_of_img is not None and len(seg_of_img) == len(layout.img_key):
        fseg = np.asarray(seg_of_img, np.int64)
    elif len(layout.img_key):
        src = layout.seg_source.astype(np.int64)
        first = layout.seg_start == 0
        fk = np.stack([src[first], layout.seg_key[first].astype(np.int64)])
        f_order = np.lexsort(fk[::-1])
        fk_sorted = fk[:, f_order]
        ik = np.stack([layout.img_source.astype(np.int64), layout.img_key.astype(np.int64)])
        # position of each image's first span among the start-0 segments
        key_f = fk_sorted[0] * (1 << 48) + fk_sorted[1]
        key_i = ik[0] * (1 << 48) + ik[1]
        at = np.searchsorted(key_f, key_i)
        if np.any(at >= len(key_f)) or np.any(key_f[np.minimum(at, len(key_f) - 1)] != key_i):
            raise ValueError(f"step {layout.step}: an image has no first span in the layout")
        fseg = np.flatnonzero(first)[f_order][at]
    else:
        fseg = np.zeros(0, np.int64)
    routes = routeloop.route(pidx, layout.seg_row, layout.rows_per_rank, layout.seg_source, layout.seg_start,
                             layout.seg_len, piece_replica, piece_pos, retired, dp_fanout.offsets, dp_fanout.targets,
                             fseg, layout.img_rank, rank_fanout.offsets, rank_fanout.targets)
    pos, start, length, dest, ret, img, g_src, g_rep, g_lo = routes
    return LoaderRoutes((pos, start, length, dest, ret, img), list(zip(g_src.tolist(), g_rep.tolist())), g_lo.tolist())


def _stable_order(key: np.ndarray) -> np.ndarray:
    """np.argsort(key, kind="stable"), as a radix sort when the keys fit 16 bits (ranks, constructors)."""
    key = np.asarray(key)
    if len(key) and 0 <= int(key.min()) and int(key.max()) < 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    return np.argsort(key, kind="stable")


def image_offsets(img_rank: np.ndarray, img_tokens: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each image's merged tokens sit in the all-gathered encoder output (ranks in order, images in
    step order within a rank) and every rank's merged tokens: constructor.multimodal.encoder_offsets,
    vectorised (an exclusive running sum in (rank, step order))."""
    img_rank = np.asarray(img_rank, np.int64)
    tok = np.asarray(img_tokens, np.int64)
    per_rank = np.bincount(img_rank, weights=tok, minlength=world).astype(np.int64) if len(tok) else np.zeros(world, np.int64)
    order = _stable_order(img_rank)
    t = tok[order]
    base = np.empty(len(tok), np.int64)
    base[order] = np.cumsum(t) - t
    return base, per_rank


def constructor_images(layout: StepLayout, seg_of_img: np.ndarray, dp_fanout: Fanout, leader_fanout: Fanout,
                       n_constructors: int) -> list[np.ndarray]:
    """The images each constructor needs (ascending indices into the step's image list): those whose text
    starts in its rows (its DP ranks: `dp_fanout`, from the image's first segment `seg_of_img`) and those
    encoded by an encoder leader of one of its ranks (`leader_fanout`: leader rank -> constructors), in
    one compiled pass (routeloop.image_lists) -- what a constructor is told about images grows with its
    share of them, not with the step's."""
    return _split(*_image_csr(layout, seg_of_img, dp_fanout, leader_fanout, n_constructors))


def _split(offsets: np.ndarray, flat: np.ndarray) -> list[np.ndarray]:
    b = offsets.tolist()
    return [flat[b[c]:b[c + 1]] for c in range(len(b) - 1)]


def _image_csr(layout: StepLayout, seg_of_img: np.ndarray, dp_fanout: Fanout, leader_fanout: Fanout,
               n_constructors: int) -> tuple[np.ndarray, np.ndarray]:
    """constructor_images as (offsets [n_constructors + 1], indices)."""
    if len(layout.img_key) == 0:
        return np.zeros(n_constructors + 1, np.int64), np.zeros(0, np.int64)
    img_dp = layout.seg_row[seg_of_img].astype(np.int64) // layout.rows_per_rank
    return routeloop.image_lists(img_dp, layout.img_rank, dp_fanout.offsets, dp_fanout.targets, leader_fanout.offsets,
                               leader_fanout.targets, n_constructors)


@dataclass
class ConstructorColumns:
    """Every constructor's layout of a step (`layout.select_ranks` of its DP ranks, array for array) as columns cut
    by constructor, for wire.encode_columns: the segments stay the layout's own arrays when the constructors
    hold the DP ranks in order (the row column rebased in one pass), the listed images are one gather per
    array -- per step a few passes over the layout instead of a StepLayout per constructor."""

    dp: list[int]  # each constructor's DP ranks (its layout's `dp`)
    columns: list[Column]  # SEGMENT_ARRAYS then IMAGE_ARRAYS, constructor c's part c (or every image, shared)

    def arrays(self, c: int) -> dict[str, np.ndarray]:
        """Constructor c's arrays (= layout.select_ranks(its DP ranks).arrays(), its images only)."""
        out = {}
        for col in self.columns:
            b = col.bounds
            out[col.name] = col.data if b is None else col.data[b[c]:b[c + 1]]
        return out


def constructor_columns(layout: StepLayout, dp_ranks: list[list[int]],
                        images: tuple[np.ndarray, Any] | None = None) -> ConstructorColumns:
    """Every constructor's `layout.select_ranks(ranks)` (with only its images) as columns (the rule, one constructor
    at a time: routespec.constructor_layout). `images` (ImageParts.cut): the images
    of every constructor in `dp_ranks` order, concatenated, and their bounds; default: every image of the
    step, to every constructor."""
    rpr = layout.rows_per_rank
    bounds = np.searchsorted(layout.seg_row, np.arange(layout.dp + 1, dtype=np.int64) * rpr)
    ranks = [sorted({int(x) for x in r}) for r in dp_ranks]
    pair_rank = np.array([d for r in ranks for d in r], np.int64)  # every (constructor, rank) pair in message order
    pair_at = np.array([j for r in ranks for j in range(len(r))], np.int64)  # the rank's place in its constructor
    lens = bounds[pair_rank + 1] - bounds[pair_rank]
    pair_b = np.zeros(len(pair_rank) + 1, np.int64)
    np.cumsum(lens, out=pair_b[1:])
    seg_b = pair_b[np.cumsum([0] + [len(r) for r in ranks])].tolist()
    shift = np.repeat((pair_at - pair_rank) * rpr, lens)  # rank d at place j: its rows move by (j - d) rows per rank
    names = SEGMENT_ARRAYS + (HYBRID_ARRAYS if layout.hybrid_cp else ())  # a hybrid layout's CP groups, cut alike
    if np.array_equal(pair_rank, np.arange(layout.dp)):  # the constructors hold the ranks in order: no gather
        cols = [getattr(layout, n) for n in names[1:]]
        row = layout.seg_row + shift
    else:
        idx = np.repeat(bounds[pair_rank] - pair_b[:-1], lens) + np.arange(pair_b[-1])
        cols = [getattr(layout, n)[idx] for n in names[1:]]
        row = layout.seg_row[idx] + shift
    seg = [row.astype(np.int32), *cols]
    columns = [Column(n, a, seg_b) for n, a in zip(names, seg)]
    if images is None:
        columns += [Column(n, getattr(layout, n)) for n in IMAGE_ARRAYS]
    else:
        flat, img_b = images
        columns += [Column(n, getattr(layout, n)[flat], img_b) for n in IMAGE_ARRAYS]
    return ConstructorColumns([len(r) for r in ranks], columns)


@dataclass
class ImageParts:
    """Per constructor, the images its PLAN_CONSTRUCTOR lists (`idx`), and for the step: each image's offset
    in the gathered encoder output (`base`, merged tokens) and every rank's merged tokens (`encoder_tokens`)."""

    idx: list[np.ndarray]
    base: np.ndarray
    encoder_tokens: np.ndarray
    offsets: np.ndarray | None = None  # idx as one CSR: constructor c's images are flat[offsets[c]:offsets[c + 1]]
    flat: np.ndarray | None = None

    def arrays(self, constructor: int) -> dict[str, np.ndarray]:
        return {IMG_BASE: self.base[self.idx[constructor]], ENCODER_TOKENS: self.encoder_tokens}

    def cut(self, order: list[int]) -> tuple[np.ndarray, list[int]]:
        """The images of constructors `order` (message order), concatenated, and their bounds."""
        if self.flat is not None and self.offsets is not None and order == list(range(len(self.idx))):
            return self.flat, self.offsets.tolist()
        parts = [self.idx[c] for c in order]
        b = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(x) for x in parts], out=b[1:])
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), b.tolist()

    def columns(self, images: tuple[np.ndarray, list[int]]) -> list[Column]:
        """arrays() of every constructor of `images` (cut) as columns, for wire.encode_columns."""
        flat, bounds = images
        return [Column(IMG_BASE, self.base[flat], bounds), Column(ENCODER_TOKENS, self.encoder_tokens)]


def image_segments(layout: StepLayout, piece_of_seg: np.ndarray | None, piece_patches: np.ndarray) -> np.ndarray | None:
    """The layout segment that carries each image (its sample's first piece), from the coverage check's
    pairing of segments with pieces; None without one (or if the images do not pair up)."""
    n = len(layout.img_key)
    if n == 0 or piece_of_seg is None or len(piece_of_seg) != len(layout.seg_row):
        return None
    seg_patches = np.asarray(piece_patches, np.int64)[piece_of_seg]
    first = np.flatnonzero(seg_patches > 0)
    zero = np.zeros(n, np.int64)
    got, _ = match((layout.img_source, layout.img_key, zero, layout.img_patches),
                   (layout.seg_source[first], layout.seg_key[first], np.zeros(len(first), np.int64), seg_patches[first]))
    return None if got is None else first[got]


def image_parts(layout: StepLayout, seg_of_img: np.ndarray | None, dp_fanout: Fanout, leader_fanout: Fanout | None,
                n_constructors: int, merge: int | None, world: int) -> ImageParts | None:
    """What each constructor is told about the step's images (see constructor_images), or None when the
    step has no images or the plan cannot be split that way (every constructor then gets every image):
    no image segments (image_segments), no encoder leaders, or image sources merging differently."""
    n = len(layout.img_key)
    if n == 0 or seg_of_img is None or leader_fanout is None or not merge:
        return None
    offsets, flat = _image_csr(layout, seg_of_img, dp_fanout, leader_fanout, n_constructors)
    idx = _split(offsets, flat)
    if int(layout.img_rank.min()) >= 0 and int(layout.img_rank.max()) < world:
        base, enc = routeloop.image_offsets(layout.img_rank, layout.img_patches, merge, world)
    else:  # not a valid plan; what the numpy version gives (bincount grows past `world`)
        base, enc = image_offsets(layout.img_rank, layout.img_patches.astype(np.int64) // merge, world)
    top = int(enc.max()) if len(enc) else 0
    # the one array every constructor gets whole: in the narrowest type that holds it (16,384 ranks: 32 kB
    # as uint16 when no rank encodes 64k merged tokens, else 64 kB as int32)
    enc = enc.astype(np.uint16 if top < 2**16 else np.int32 if top < 2**31 else np.int64)
    return ImageParts(idx, base, enc, offsets, flat)


def image_routing(spec: Any, groups: list[list[int]]) -> tuple[Fanout | None, int | None]:
    """(encoder leader rank -> the constructors serving a rank it leads, the image sources' shared merge)
    for image_parts; (None, None) when the spec has no image source or its image sources merge differently."""
    merges = {s.image.merge for s in spec.sources if s.kind == "image_text"}
    if len(merges) != 1:
        return None, None
    leaders = encoder_leaders(spec)
    lead_to: list[set[int]] = [set() for _ in range(spec.world_size)]
    for ci, ranks in enumerate(groups):
        for r in ranks:
            lead_to[int(leaders[int(r)])].add(ci)
    return Fanout.from_lists([sorted(x) for x in lead_to]), int(next(iter(merges)))
