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
                              "generation", "tokens", "rows", "seq_len", "dp_rank", "microbatch",
                              "cp_group_size", "cp_group_first", "cp_group_rank", "cp_group_docs", "cp_group_ranks"})
# what a hybrid DP x CP rank learns of the CP groups it belongs to (see hybrid_rank_batch)
CP_GROUP_FIELDS = ("cp_group_size", "cp_group_first", "cp_group_rank", "cp_group_docs")
IGNORE_LABEL = -100  # the label of a padding position (collate.IGNORE_INDEX)
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


# ---------------------------------------------------------------------------- hybrid DP x CP
# fields of a replica's batch that a hybrid rank's view replaces (rows and their layout: by its parts of its groups)
_HYBRID_REPLACED = frozenset({"cu_seqlens", "cu_seqlens_mb", "segment_row", "segment_offset", "segment_source",
                              "segment_key", "segment_start", "segment_len"})


def hybrid_groups(first: np.ndarray, size: np.ndarray, cp_rank: int) -> list[tuple[int, int]]:
    """The (first CP rank, size) of every hybrid CP group that `cp_rank` belongs to, ordered by size then first
    (the order its parts are concatenated in)."""
    f = np.asarray(first, np.int64)
    k = np.asarray(size, np.int64)
    mine = (f <= cp_rank) & (cp_rank < f + k)
    return sorted({(int(a), int(b)) for a, b in zip(f[mine], k[mine])}, key=lambda g: (g[1], g[0]))


def _pad_value(name: str, pad_id: int) -> int:
    return {"input_ids": pad_id, "labels": IGNORE_LABEL, "source_ids": -1}.get(name, 0)


def group_stream(batch: Mapping[str, Any], docs: np.ndarray, size: int, pad_id: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The whole sequence of a hybrid CP group of `size` ranks: its documents (segments `docs` of a replica's
    batch, in layout order) one after the other, each padded to a multiple of 2·size (padding: `pad_id` inputs,
    ignored labels, source -1, positions counting on); returns the flat token fields and its cu_seqlens."""
    rows = np.asarray(batch["segment_row"], np.int64)[docs]
    offs = np.asarray(batch["segment_offset"], np.int64)[docs]
    lens = np.asarray(batch["segment_len"], np.int64)[docs]
    S = int(np.asarray(batch["input_ids"]).shape[-1])
    a = 2 * size if size > 1 else 1
    padded = -(-lens // a) * a
    cu = np.zeros(len(docs) + 1, np.int64)
    np.cumsum(padded, out=cu[1:])
    T = int(cu[-1])
    real = np.repeat(cu[:-1], lens) + (np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens))
    src = np.repeat(rows * S + offs, lens) + (real - np.repeat(cu[:-1], lens))  # flat [R*S] position of each token
    out: dict[str, np.ndarray] = {}
    for name, v in batch.items():
        if not (isinstance(v, np.ndarray) and v.ndim == 2 and v.shape[-1] == S):
            continue
        col = np.full(T, _pad_value(name, pad_id), dtype=v.dtype)
        col[real] = v.reshape(-1)[src]
        if name == "position_ids":  # positions count on through a document's padding
            col = (np.arange(T, dtype=np.int64) - np.repeat(cu[:-1], padded)).astype(v.dtype)
        out[name] = col
    return out, cu


def hybrid_rank_batch(batch: Mapping[str, Any], first: np.ndarray, size: np.ndarray, cp_rank: int,
                      pad_id: int = 0) -> dict[str, Any]:
    """What CP rank `cp_rank` of a DP replica receives of the replica's batch (collate.materialize_rank's rows and
    segment_* fields) when every segment has its own CP group (`first`, `size`: the layout's seg_cp_first /
    seg_cp_size of the replica's segments, in the same order).

    For every group the rank belongs to (:func:`hybrid_groups`'s order) the group's sequence is built
    (:func:`group_stream`) and cut for the rank as context parallelism cuts a THD batch (:func:`cp_split`,
    ``mode="document"``: every document zig-zagged on its own over the group; a group of one keeps it whole).
    The parts are concatenated into one row ``[1, T]`` per token field, with ``cu_seqlens`` over the rank's
    documents, per group ``cp_group_size``, ``cp_group_first``, ``cp_group_rank`` (the rank's
    place in it) and ``cp_group_docs`` (its documents: cu_seqlens segments, CSR), and the rank's documents'
    ``segment_source`` / ``segment_key`` / ``segment_start`` / ``segment_len`` (unpadded). Where each token sits in
    its group's sequence is not sent: :func:`group_token_index` derives it (``cp_token_index`` for :func:`cp_merge`)."""
    f = np.asarray(first, np.int64)
    k = np.asarray(size, np.int64)
    n = len(np.asarray(batch["segment_len"]))
    if len(f) != n or len(k) != n:
        raise ValueError(f"hybrid layout: {len(f)} groups for {n} segments")
    groups = hybrid_groups(f, k, cp_rank)
    parts: list[dict[str, np.ndarray]] = []
    cus: list[np.ndarray] = []
    docs_of: list[np.ndarray] = []
    for g_first, g_size in groups:
        docs = np.flatnonzero((f == g_first) & (k == g_size))
        stream, cu = group_stream(batch, docs, g_size, pad_id)
        stream["cu_seqlens"] = cu
        if g_size > 1:
            part = cp_split(stream, g_size, cp_rank - g_first, mode="document",
                            token_fields=[n_ for n_ in stream if n_ != "cu_seqlens"])
        else:
            part = stream
        parts.append(part)
        cus.append(np.asarray(part["cu_seqlens"], np.int64))
        docs_of.append(docs)
    S = int(np.asarray(batch["input_ids"]).shape[-1])
    names = [n_ for n_, v in batch.items() if isinstance(v, np.ndarray) and v.ndim == 2 and v.shape[-1] == S]
    out: dict[str, Any] = {}
    for name in names:
        dt = np.asarray(batch[name]).dtype
        out[name] = np.concatenate([p[name] for p in parts] or [np.zeros(0, dt)]).astype(dt).reshape(1, -1)
    base = np.cumsum([0] + [int(c[-1]) for c in cus])
    cu_all = np.concatenate([[0]] + [c[1:] + b for c, b in zip(cus, base[:-1])]).astype(np.int32)
    out["cu_seqlens"] = cu_all
    out["cp_group_size"] = np.array([g[1] for g in groups], np.int32)
    out["cp_group_first"] = np.array([g[0] for g in groups], np.int32)
    out["cp_group_rank"] = np.array([cp_rank - g[0] for g in groups], np.int32)
    out["cp_group_docs"] = np.cumsum([0] + [len(d) for d in docs_of]).astype(np.int32)
    mine = np.concatenate(docs_of or [np.zeros(0, np.int64)]).astype(np.int64)
    for name in ("segment_source", "segment_key", "segment_start", "segment_len"):
        out[name] = np.asarray(batch[name])[mine]
    out["max_seqlen"] = int(np.diff(cu_all).max()) if len(cu_all) > 1 else 0
    for name, v in batch.items():  # anything else (a constructor hook's per-replica fields): whole, as without CP
        if name not in out and name not in _HYBRID_REPLACED and name not in names:
            out[name] = v
    return out


def group_token_index(cu_part: np.ndarray, size: int, rank_in_group: int) -> np.ndarray:
    """Where each token of a rank's part of a hybrid CP group sits in the group's sequence (the part's
    ``cu_seqlens`` from 0; every document padded to a multiple of 2·size): :func:`cp_merge`'s ``cp_token_index``."""
    cu = np.asarray(cu_part, np.int64)
    if size == 1:
        return np.arange(int(cu[-1]), dtype=np.int64)
    return document_zigzag_index(cu * size, size, rank_in_group)


def cp_group_ranks(view: Mapping[str, Any], rank_of_cp: Any) -> np.ndarray:
    """The global ranks of every group of a :func:`hybrid_rank_batch` view, in CP order, concatenated (CSR by
    ``cp_group_size``); ``rank_of_cp(c)``: the global rank at CP coordinate c with the rank's other coordinates."""
    ranks = [int(rank_of_cp(int(f) + j)) for f, k in zip(np.asarray(view["cp_group_first"]).tolist(),
                                                          np.asarray(view["cp_group_size"]).tolist()) for j in range(k)]
    return np.asarray(ranks, np.int32)


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
