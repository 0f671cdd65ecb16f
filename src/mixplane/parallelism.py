"""Parallelism transforms: what each rank of a CP / PP / TP group receives (pure functions on numpy).

Shared by the Data Constructor, which cuts every rank's view, and the trainer client, which runs its part of
a selective broadcast's fan-out with the very same cuts.

A Data Constructor materialises one batch per data-parallel rank and microbatch (see
:mod:`mixplane.constructor.collate`), then derives every rank's view with these functions. Ranks of
one CP / PP / TP group therefore share one delivery path: the batch is read and decoded once, CP
shards are slices of it, PP stages drop fields, and TP copies are the very same buffers.

Batch convention: a ``dict`` whose numpy values with the sequence on their last axis are *token
fields* (``input_ids``, ``labels``, ``position_ids``, ``source_ids``, ``loss_mask``, ...); other numpy
values (``cu_seqlens``, ...) and Python scalars (``step``, ``lr_scale``, ``max_seqlen``) are metadata.

Context parallelism, causal-balanced (zig-zag): a sequence of length ``S`` is cut into ``2·cp``
equal chunks; CP rank ``i`` gets chunks ``i`` and ``2·cp−1−i``. With causal attention the work of
chunk ``k`` grows with ``k``, so pairing an early with a late chunk gives every rank the same work.
Two layouts:

* ``mode="row"`` (Megatron ``get_batch_on_this_cp_rank``, BSHD): every packed row is zig-zagged as a
  whole; position_ids keep their per-document values, ``cu_seqlens`` stays the full row's (ring
  attention needs the global document boundaries) and ``cp_token_index`` says which positions of the
  row this rank holds.
* ``mode="document"`` (TransformerEngine THD): every document (segment of ``cu_seqlens``, each a
  multiple of ``2·cp`` long — pack with ``align=2*cp``) is zig-zagged on its own; the rank's tokens are
  flat and its ``cu_seqlens`` is the full one divided by ``cp``. This balances packed rows of many
  short documents too, where the row layout balances only the long ones.

Pipeline parallelism: the first stage gets the model inputs, the last stage the labels and what the
loss needs, middle stages only metadata (``cu_seqlens``, ``max_seqlen``, step, shapes).
Tensor parallelism: without ``broadcast_at('TP')`` every TP rank gets identical copies (the same
buffers); with it only tp = 0 receives tensors and the others get metadata (names, dtypes, shapes)
so they can allocate the receive buffers of the trainer-side broadcast.

Selective broadcast on CP and PP (``broadcast_at('CP')`` / ``('PP')``): the group's coordinate-0 rank
fetches what the whole group needs and the trainer fans it out (:func:`mixplane.client.fan_out`). The
fan-out runs top-down over the ClientPlaceTree, one axis after the other in :data:`FANOUT_ORDER` (CP, PP,
TP); at each axis the ranks whose coordinates on the later broadcast axes are 0 take part, coordinate 0
sends and the others receive. What a rank *holds* when it has received (:func:`holding`) is the DP batch
narrowed (:func:`narrow`) to its own coordinate on every axis, except an axis it still has to serve:
there it holds the whole sequence (CP) or the fields of every stage (PP). Narrowing a holding to the
rank's own coordinates gives exactly :func:`rank_view`'s cut, so batches are identical with or
without the broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from mixplane.errors import MixplaneError

# per-token fields whose last axis is the sequence
TOKEN_FIELDS = ("input_ids", "labels", "position_ids", "source_ids", "loss_mask", "doc_ids", "image_token_mask",
                "image_token_index")
# which fields each pipeline stage needs (anything else named below goes to every stage)
FIRST_STAGE_FIELDS = frozenset({"input_ids", "position_ids", "image_token_mask", "image_token_index"})
LAST_STAGE_FIELDS = frozenset({"labels", "source_ids", "loss_mask", "doc_ids"})
ALL_STAGE_FIELDS = frozenset({"cu_seqlens", "cu_seqlens_mb", "max_seqlen", "encoder_tokens", "cp_token_index", "step", "lr_scale", "phase",
                              "generation", "tokens", "rows", "seq_len", "dp_rank", "microbatch"})
META_ONLY = "meta_only"  # key set to True on a view that carries no tensors


# ---------------------------------------------------------------------------- context parallelism
def zigzag_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) that CP rank `cp_rank` holds."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} outside a context-parallel group of size {cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_index(seq_len: int, cp: int, cp_rank: int) -> np.ndarray:
    """Positions of a length-seq_len sequence held by `cp_rank`, in the order the rank stores them."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not a multiple of 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    a, b = zigzag_chunks(cp, cp_rank)
    return np.concatenate([np.arange(a * c, (a + 1) * c), np.arange(b * c, (b + 1) * c)]).astype(np.int64)


def document_zigzag_index(cu_seqlens: np.ndarray, cp: int, cp_rank: int) -> np.ndarray:
    """Flat token positions held by `cp_rank` when every document is zig-zagged on its own (THD)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    if np.any(lens % (2 * cp)):
        bad = int(np.flatnonzero(lens % (2 * cp))[0])
        raise ValueError(f"document {bad} has length {int(lens[bad])}, not a multiple of 2*cp = {2 * cp} "
                         f"(pack with align={2 * cp})")
    a, b = zigzag_chunks(cp, cp_rank)
    c = lens // (2 * cp)  # chunk size of each document
    # for each document: [start + a*c, start + (a+1)*c) then [start + b*c, start + (b+1)*c)
    starts = np.stack([cu[:-1] + a * c, cu[:-1] + b * c], axis=1).reshape(-1)
    sizes = np.repeat(c, 2)
    total = int(sizes.sum())
    run = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
    return run + np.arange(total, dtype=np.int64)


def _token_fields(batch: Mapping[str, Any], seq_len: int, fields: Iterable[str] | None) -> list[str]:
    if fields is not None:
        return [f for f in fields if f in batch]
    return [k for k, v in batch.items()
            if k in TOKEN_FIELDS and isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[-1] == seq_len]


def cp_split(batch: Mapping[str, Any], cp: int, cp_rank: int, *, mode: str = "row",
             token_fields: Iterable[str] | None = None, seq_len: int | None = None) -> dict[str, Any]:
    """This CP rank's shard of a batch. cp = 1 returns the batch unchanged (same buffers). `seq_len`: the
    row length when the batch holds no token field (a middle pipeline stage's fields)."""
    if cp == 1:
        return dict(batch)
    if mode == "row":
        ids = batch["input_ids"] if "input_ids" in batch else next(
            (batch[f] for f in (*TOKEN_FIELDS, *(token_fields or ())) if f in batch), None)
        if ids is None and seq_len is None:
            raise ValueError("row CP layout: the batch has no token field and no seq_len was given")
        S = int(ids.shape[-1]) if ids is not None else int(seq_len)  # type: ignore[arg-type]
        idx = zigzag_index(S, cp, cp_rank)
        out = dict(batch)
        for f in _token_fields(batch, S, token_fields):
            out[f] = np.ascontiguousarray(np.take(batch[f], idx, axis=-1))
        out["cp_token_index"] = idx.astype(np.int32)
        return out
    if mode == "document":
        cu = np.asarray(batch["cu_seqlens"], dtype=np.int64)
        T = int(cu[-1])
        idx = document_zigzag_index(cu, cp, cp_rank)
        out = dict(batch)
        for f in _token_fields(batch, T, token_fields):
            a = batch[f]
            if a.ndim != 1:
                raise ValueError(f"document CP layout needs flat (THD) token fields; {f!r} has shape {a.shape}")
            out[f] = np.ascontiguousarray(a[idx])
        out["cu_seqlens"] = (cu // cp).astype(np.asarray(batch["cu_seqlens"]).dtype)
        if "max_seqlen" in batch:
            out["max_seqlen"] = int(batch["max_seqlen"]) // cp
        out["cp_token_index"] = idx.astype(np.int64 if T >= 2**31 else np.int32)
        return out
    raise ValueError(f"unknown context-parallel layout {mode!r} (expected 'row' or 'document')")


def cp_merge(shards: list[Mapping[str, Any]], *, mode: str = "row",
             token_fields: Iterable[str] | None = None) -> dict[str, Any]:
    """Inverse of :func:`cp_split`: put the shards of ranks 0..cp-1 back in sequence order."""
    cp = len(shards)
    if cp == 1:
        return dict(shards[0])
    first = shards[0]
    idx = [np.asarray(s["cp_token_index"], dtype=np.int64) for s in shards]
    total = sum(len(i) for i in idx)
    out = {k: v for k, v in first.items() if k != "cp_token_index"}
    if mode == "document":
        out["cu_seqlens"] = (np.asarray(first["cu_seqlens"], dtype=np.int64) * cp).astype(np.asarray(first["cu_seqlens"]).dtype)
        if "max_seqlen" in first:
            out["max_seqlen"] = int(first["max_seqlen"]) * cp
    fields = [f for f in (token_fields or TOKEN_FIELDS) if f in first and isinstance(first[f], np.ndarray)
              and first[f].shape[-1] == len(idx[0])]
    for f in fields:
        parts = [np.asarray(s[f]) for s in shards]
        full = np.empty(parts[0].shape[:-1] + (total,), dtype=parts[0].dtype)
        for i, p in zip(idx, parts):
            full[..., i] = p
        out[f] = full
    return out


def causal_work(index: np.ndarray, cu_seqlens: np.ndarray | None = None) -> int:
    """Causal-attention work of the tokens at `index`: sum over tokens of (position in document + 1)."""
    index = np.asarray(index, dtype=np.int64)
    if cu_seqlens is None:
        return int((index + 1).sum())
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    doc = np.searchsorted(cu, index, side="right") - 1
    return int((index - cu[doc] + 1).sum())


# ---------------------------------------------------------------------------- pipeline / tensor parallelism
def pp_role(stage: int, pp: int) -> str:
    if pp < 1 or not 0 <= stage < pp:
        raise ValueError(f"pipeline stage {stage} outside {pp} stages")
    if pp == 1:
        return "only"
    return "first" if stage == 0 else ("last" if stage == pp - 1 else "middle")


def pp_fields(stage: int, pp: int, names: Iterable[str]) -> list[str]:
    """Fields of `names` that pipeline stage `stage` receives."""
    role = pp_role(stage, pp)
    out = []
    for n in names:
        if role == "only" or n in ALL_STAGE_FIELDS:
            out.append(n)
        elif n in FIRST_STAGE_FIELDS:
            if role == "first":
                out.append(n)
        elif n in LAST_STAGE_FIELDS:
            if role == "last":
                out.append(n)
        elif role != "middle":  # unknown tensors: inputs and loss both may need them, middle stages don't
            out.append(n)
    return out


def pp_filter(batch: Mapping[str, Any], stage: int, pp: int) -> dict[str, Any]:
    """What pipeline stage `stage` of `pp` receives; buffers are shared, not copied."""
    if pp_role(stage, pp) == "only":
        return dict(batch)
    keep = set(pp_fields(stage, pp, batch.keys()))
    out = {k: v for k, v in batch.items() if k in keep}
    out["shapes"] = {k: [str(np.asarray(v).dtype), list(np.shape(v))] for k, v in batch.items()
                     if isinstance(v, np.ndarray)}
    return out


def metadata_only(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A view with no tensors: scalars plus the dtype and shape of each tensor it replaces (the receive
    buffers of the trainer-side broadcast from tp = 0)."""
    shapes = {k: [str(v.dtype), list(v.shape)] for k, v in batch.items() if isinstance(v, np.ndarray)}
    out = {k: v for k, v in batch.items() if not isinstance(v, np.ndarray) and k != "shapes"}
    out["shapes"] = shapes
    out[META_ONLY] = True
    return out


def tp_receives(tp_rank: int, broadcast_at: Iterable[str] = ()) -> bool:
    """Whether this TP rank receives tensors (only tp = 0 does under broadcast_at('TP'))."""
    return tp_rank == 0 or "TP" not in {a.upper() for a in broadcast_at}


def position_ids_from_cu_seqlens(cu_seqlens: np.ndarray) -> np.ndarray:
    """Per-document positions of a flat packed sequence (for stages that did not receive position_ids)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lens = np.diff(cu)
    return (np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lens)).astype(np.int32)


# ---------------------------------------------------------------------------- selective broadcast
#: the order the trainer fans a group's data out in: top-down over the ClientPlaceTree (a CP consumer
#: above the pipeline stages and TP peers that share its data)
FANOUT_ORDER = ("cp", "pp", "tp")
WHOLE = -1  # ViewKey.cp_rank of a holding that keeps the whole sequence (it still serves its CP group)
UNION = "union"  # ViewKey.pp_role of a holding that keeps every stage's fields (it still serves its PP group)


class BroadcastError(MixplaneError, ValueError):
    """An axis the trainer cannot broadcast along (names the axis and why)."""


def broadcast_axes(broadcast_at: Iterable[str]) -> tuple[str, ...]:
    """The broadcast axes, lower case, in fan-out order. DP is refused: DP replicas train on different
    data, so there is nothing a DP group shares that one rank could fetch for the others."""
    got = {str(a).lower() for a in broadcast_at}
    if "dp" in got:
        raise BroadcastError("broadcast_at('DP'): DP replicas receive different data, there is nothing to "
                             "fetch once for a DP group (distribute('CP') makes DP x CP ranks uniform consumers)")
    bad = sorted(got - set(FANOUT_ORDER))
    if bad:
        raise BroadcastError(f"cannot broadcast along {', '.join(map(repr, bad))} (axes: TP, PP, CP)")
    return tuple(a for a in FANOUT_ORDER if a in got)


def serves(axis: str, coords: Mapping[str, int], axes: Iterable[str]) -> bool:
    """Whether a rank at `coords` takes part in the fan-out along `axis` (coordinate 0 of every later
    broadcast axis: it holds data by then); with coordinate 0 on `axis` it sends, else it receives."""
    axes = tuple(axes)
    if axis not in axes:
        return False
    return all(int(coords[b]) == 0 for b in axes[axes.index(axis) + 1:])


def holds_whole(axis: str, coords: Mapping[str, int], axes: Iterable[str]) -> bool:
    """Whether a rank's holding keeps `axis` whole: it is the sender of the fan-out along it."""
    return serves(axis, coords, axes) and int(coords[axis]) == 0


def receive_axis(coords: Mapping[str, int], axes: Iterable[str]) -> str | None:
    """The axis along which a rank receives its holding (None: it fetches from its constructor)."""
    got = None
    for a in axes:
        if int(coords[a]) != 0:
            got = a
    return got


def narrow(view: Mapping[str, Any], axis: str, coord: int, *, cp: int, pp: int, cp_mode: str = "row",
           seq_len: int | None = None, token_fields: Iterable[str] | None = None) -> dict[str, Any]:
    """A holding narrowed to coordinate `coord` of `axis`: CP rank `coord`'s shard, PP stage `coord`'s
    fields, the same view for a TP rank."""
    if axis == "cp":
        return cp_split(view, cp, coord, mode=cp_mode, token_fields=token_fields, seq_len=seq_len)
    if axis == "pp":
        return pp_filter(view, coord, pp)
    if axis == "tp":
        return dict(view)
    raise BroadcastError(f"cannot narrow along {axis!r}")


def holding(batch: Mapping[str, Any], coords: Mapping[str, int], axes: Iterable[str], *, cp: int, pp: int,
            cp_mode: str = "row", seq_len: int | None = None, token_fields: Iterable[str] | None = None) -> dict[str, Any]:
    """What a rank at `coords` ({cp, pp, tp}) holds once it has its data: the DP batch narrowed to its
    coordinates, except along the axes it still serves (:func:`holds_whole`)."""
    axes = tuple(axes)
    v = dict(batch)
    for a in ("cp", "pp"):
        if not holds_whole(a, coords, axes):
            v = narrow(v, a, int(coords[a]), cp=cp, pp=pp, cp_mode=cp_mode, seq_len=seq_len, token_fields=token_fields)
    return v


def fanout_meta(axes: Iterable[str], *, cp: int, pp: int, cp_mode: str, seq_len: int,
                token_fields: Iterable[str] = ()) -> dict[str, Any]:
    """What a client needs to run its part of the fan-out (sent with every STEP_DATA under CP / PP broadcasts);
    `token_fields`: those a constructor hook added (CP cuts them like input_ids)."""
    return {"axes": list(axes), "cp": int(cp), "pp": int(pp), "cp_mode": cp_mode, "seq_len": int(seq_len),
            "token_fields": list(token_fields)}


def fanout_options(fanout: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`narrow`'s options from a :func:`fanout_meta` (the token fields as :func:`rank_view` cuts them)."""
    extra = tuple(str(f) for f in fanout.get("token_fields") or ())
    return {"cp": int(fanout["cp"]), "pp": int(fanout["pp"]), "cp_mode": str(fanout["cp_mode"]),
            "seq_len": int(fanout["seq_len"]), "token_fields": (*TOKEN_FIELDS, *extra) if extra else None}


# ---------------------------------------------------------------------------- one rank's view
@dataclass(frozen=True)
class ViewKey:
    """Ranks with equal keys receive byte-identical messages: the constructor builds one and sends it to all.
    cp_rank is WHOLE and pp_role UNION for a holding that still serves its CP / PP group."""

    cp_rank: int
    pp_role: str
    receives: bool


def view_key(cp_rank: int, pp_stage: int, pp: int, tp_rank: int, broadcast_at: Iterable[str] = ()) -> ViewKey:
    axes = broadcast_axes(broadcast_at)
    c = {"cp": cp_rank, "pp": pp_stage, "tp": tp_rank}
    return ViewKey(WHOLE if holds_whole("cp", c, axes) else cp_rank,
                   UNION if holds_whole("pp", c, axes) else pp_role(pp_stage, pp),
                   receive_axis(c, axes) is None)


def rank_view(batch: Mapping[str, Any], *, cp: int = 1, cp_rank: int = 0, pp: int = 1, pp_stage: int = 0,
              tp_rank: int = 0, broadcast_at: Iterable[str] = (), cp_mode: str = "row",
              extra_token_fields: Iterable[str] = ()) -> dict[str, Any]:
    """Exactly what one backbone rank receives of a data-parallel rank's batch: CP shard, PP filter, TP rule.
    `extra_token_fields`: fields a constructor hook added that context parallelism cuts like input_ids.

    Under broadcasts the rank receives its :func:`holding` (tensors when it fetches, else metadata only:
    the shapes of what the fan-out will bring it) with the scalars of its own view."""
    extra = tuple(extra_token_fields)
    fields = (*TOKEN_FIELDS, *extra) if extra else None
    axes = broadcast_axes(broadcast_at)
    view = cp_split(batch, cp, cp_rank, mode=cp_mode, token_fields=fields)
    view = pp_filter(view, pp_stage, pp)
    c = {"cp": cp_rank, "pp": pp_stage, "tp": tp_rank}
    fetches = receive_axis(c, axes) is None
    if not (holds_whole("cp", c, axes) or holds_whole("pp", c, axes)):  # the holding is the view
        return view if fetches else metadata_only(view)
    held = holding(batch, c, axes, cp=cp, pp=pp, cp_mode=cp_mode, token_fields=fields)
    scalars = {k: v for k, v in view.items() if not isinstance(v, np.ndarray) and k != "shapes"}
    if not fetches:
        return {**metadata_only(held), **scalars}
    return {**{k: v for k, v in held.items() if isinstance(v, np.ndarray)}, **scalars}


def group_views(batch: Mapping[str, Any], coords: Iterable[tuple[int, int, int]], *, cp: int, pp: int,
                broadcast_at: Iterable[str] = (), cp_mode: str = "row") -> tuple[dict[ViewKey, dict[str, Any]], list[ViewKey]]:
    """Views of every (cp_rank, pp_stage, tp_rank) in `coords`, each distinct view built once.

    Returns the distinct views by key and the key of each coordinate in input order.
    """
    broadcast_at = tuple(broadcast_at)
    views: dict[ViewKey, dict[str, Any]] = {}
    keys: list[ViewKey] = []
    for cp_rank, pp_stage, tp_rank in coords:
        key = view_key(cp_rank, pp_stage, pp, tp_rank, broadcast_at)
        keys.append(key)
        if key not in views:
            views[key] = rank_view(batch, cp=cp, cp_rank=cp_rank, pp=pp, pp_stage=pp_stage, tp_rank=tp_rank,
                                   broadcast_at=broadcast_at, cp_mode=cp_mode)
    return views, keys


def bytes_per_step(batch: Mapping[str, Any], coords: Iterable[tuple[int, int, int]], *, cp: int, pp: int,
                   broadcast_at: Iterable[str] = (), cp_mode: str = "row") -> tuple[int, int]:
    """(tensor bytes, messages carrying tensors) a constructor sends for one DP batch to the ranks at `coords`."""
    views, keys = group_views(batch, coords, cp=cp, pp=pp, broadcast_at=broadcast_at, cp_mode=cp_mode)
    per = [sum(v.nbytes for v in views[k].values() if isinstance(v, np.ndarray)) for k in keys]
    return sum(per), sum(1 for k in keys if views[k] and not views[k].get(META_ONLY))
