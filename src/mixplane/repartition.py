"""Re-partitioning a source at a step boundary: the pure rule (no I/O, no data).

A partition's read order is a *layout*: a short prefix of :class:`Piece` s — each a slot range of one
epoch plan of some partitioning, (epoch, partition, num_partitions)[lo, hi), minus the slots in
``skip`` — then its own epochs (partition, num_partitions) from ``epoch`` on. A partition that was
never re-partitioned has no prefix and starts at epoch 0. Positions count slots from 0 over the
prefix, then over the epochs.

Re-partitioning a source from N to M partitions when old partition i stands at position ``low_i``
(every slot below it consumed, plus the slots in ``skip_i``; a planner window cursor):

1. the *remainder* of old partition i is the rest of the piece or epoch that ``low_i`` lies in, its
   later prefix pieces, and its own whole epochs up to ``E - 1``, where ``E`` is one past the latest
   epoch any old partition has started (so every epoch before ``E`` is finished by the remainders);
   consumed slots at or above ``low_i`` go into the pieces' ``skip``;
2. the remainders are concatenated in old-partition order and new partition k of M takes the
   contiguous share ``[k*R // M, (k+1)*R // M)`` of the R slots — a few pieces, never a row list;
3. each new partition then continues with its own epochs (k, M) from ``E``.

So every row of every epoch is read exactly once (keys stay ``make_key(epoch, row)``), and the result
is a pure function of the old layouts, the cursors, M and the epoch sizes, which a stream computes
from (seed, files) (:meth:`mixplane.loader.stream.SourceStream.epoch_rows`). The planner's journal
records the cursors; loaders, restarts and ``mixplane replay`` recompute the same layouts from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from mixplane.errors import MixplaneError

MAX_PARTITIONS = 1024  # spec.SourceSpec.replicas has the same bound

EpochRows = Callable[[int, int, int], int]  # (epoch, partition, num_partitions) -> slots of that epoch plan


class RepartitionError(MixplaneError, ValueError):
    """A re-partition that cannot be made; the message names the field."""


@dataclass(frozen=True)
class Piece:
    """Slots [lo, hi) of the epoch plan (epoch, partition, num_partitions), except the plan slots in ``skip``
    (already consumed before the re-partition: their slots stay, empty)."""

    epoch: int
    partition: int
    num_partitions: int
    lo: int
    hi: int
    skip: tuple[int, ...] = ()

    def __len__(self) -> int:
        return self.hi - self.lo

    def to_json(self) -> list[Any]:
        return [self.epoch, self.partition, self.num_partitions, self.lo, self.hi, list(self.skip)]

    @classmethod
    def parse(cls, v: Any) -> "Piece":
        try:
            e, p, n, lo, hi, skip = v
            piece = cls(int(e), int(p), int(n), int(lo), int(hi), tuple(sorted(int(s) for s in skip)))
        except (TypeError, ValueError) as err:
            raise RepartitionError(f"piece {v!r} is malformed ({err}): [epoch, partition, num_partitions, lo, hi, "
                                   "skip]") from None
        if piece.epoch < 0 or not 0 <= piece.partition < piece.num_partitions or not 0 <= piece.lo <= piece.hi \
                or any(not piece.lo <= s < piece.hi for s in piece.skip):
            raise RepartitionError(f"piece {v!r} is inconsistent")
        return piece


@dataclass(frozen=True)
class Layout:
    """What one partition reads: ``prefix`` pieces from position 0, then its own epochs from ``epoch``."""

    partition: int
    num_partitions: int
    prefix: tuple[Piece, ...] = ()
    epoch: int = 0

    @property
    def prefix_rows(self) -> int:
        return sum(len(p) for p in self.prefix)

    def to_json(self) -> dict[str, Any]:
        return {"partition": self.partition, "num_partitions": self.num_partitions, "epoch": self.epoch,
                "prefix": [p.to_json() for p in self.prefix]}

    @classmethod
    def parse(cls, v: Any) -> "Layout":
        if not isinstance(v, Mapping):
            raise RepartitionError(f"a partition layout is a mapping, not {type(v).__name__}")
        try:
            lay = cls(int(v["partition"]), int(v["num_partitions"]),
                      tuple(Piece.parse(p) for p in v.get("prefix", [])), int(v.get("epoch", 0)))
        except (KeyError, TypeError, ValueError) as e:
            raise RepartitionError(f"partition layout is malformed ({e})") from None
        if not 0 <= lay.partition < lay.num_partitions or lay.epoch < 0:
            raise RepartitionError(f"partition layout {dict(v)!r} is inconsistent")
        return lay


def initial_layouts(num_partitions: int) -> list[Layout]:
    """The layouts of a source that was never re-partitioned."""
    return [Layout(i, num_partitions) for i in range(num_partitions)]


@dataclass
class _Remainder:
    pieces: list[Piece] = field(default_factory=list)
    own_from: int = 0  # first own epoch not yet in pieces


def _remainder(lay: Layout, low: int, skip: Sequence[int], epoch_rows: EpochRows, source: str) -> _Remainder:
    """The rest of ``lay`` from position ``low`` up to its next own epoch not started (pieces; consumed
    positions ``skip`` >= low excluded). Positions past its start of the next own epoch are refused:
    a cursor is never more than a window ahead."""
    skips = sorted(int(s) for s in skip if int(s) >= low)
    out = _Remainder(own_from=lay.epoch)
    pos = 0

    def cut(piece_start: int, epoch: int, p: int, n: int, lo: int, hi: int, consumed: Sequence[int] = ()) -> None:
        # the part of slots [lo, hi) of plan (epoch, p, n) at positions >= low; piece_start = position of lo;
        # ``consumed``: plan slots of [lo, hi) already consumed before an earlier re-partition
        a = max(low, piece_start)
        b = piece_start + (hi - lo)
        if a >= b:
            return
        new_lo = lo + (a - piece_start)
        sk = {lo + (s - piece_start) for s in skips if a <= s < b} | {s for s in consumed if s >= new_lo}
        out.pieces.append(Piece(epoch, p, n, new_lo, hi, tuple(sorted(sk))))

    for pc in lay.prefix:
        cut(pos, pc.epoch, pc.partition, pc.num_partitions, pc.lo, pc.hi, pc.skip)
        pos += len(pc)
    e = lay.epoch
    guard = 0
    while pos <= low or (skips and pos <= skips[-1]):
        n = int(epoch_rows(e, lay.partition, lay.num_partitions))
        if n < 0:
            raise RepartitionError(f"source {source!r}: epoch {e} of partition {lay.partition} has {n} rows")
        if n == 0:
            guard += 1
            if guard > 1000:
                raise RepartitionError(f"source {source!r}: partition {lay.partition} of {lay.num_partitions} "
                                       "has no rows")
            e += 1
            continue
        if pos + n > low:
            cut(pos, e, lay.partition, lay.num_partitions, 0, n)
        pos += n
        e += 1
    out.own_from = max(e, lay.epoch)
    return out


def repartition(layouts: Sequence[Layout], cursors: Sequence[tuple[int, Sequence[int]]], new_partitions: int,
                epoch_rows: EpochRows, *, source: str = "?") -> list[Layout]:
    """The layouts of ``new_partitions`` partitions that read exactly what ``layouts`` had not consumed at
    ``cursors`` (per old partition: (low, consumed positions >= low)), then own epochs from a common one."""
    n_old = len(layouts)
    if not 1 <= int(new_partitions) <= MAX_PARTITIONS:
        raise RepartitionError(f"source {source!r}: partitions must be in [1, {MAX_PARTITIONS}], not {new_partitions}")
    if len(cursors) != n_old or n_old == 0:
        raise RepartitionError(f"source {source!r}: {len(cursors)} cursors for {n_old} partitions")
    for i, lay in enumerate(layouts):
        if (lay.partition, lay.num_partitions) != (i, n_old):
            raise RepartitionError(f"source {source!r}: layout {i} is partition {lay.partition} of "
                                   f"{lay.num_partitions}, not {i} of {n_old}")
    M = int(new_partitions)
    rems = []
    for lay, (low, skip) in zip(layouts, cursors):
        if int(low) < 0:
            raise RepartitionError(f"source {source!r}: cursor low {low} of partition {lay.partition} is negative")
        rems.append(_remainder(lay, int(low), skip, epoch_rows, source))
    E = max(r.own_from for r in rems)
    allp: list[Piece] = []
    for lay, r in zip(layouts, rems):
        allp.extend(r.pieces)
        for e in range(r.own_from, E):
            n = int(epoch_rows(e, lay.partition, lay.num_partitions))
            if n:
                allp.append(Piece(e, lay.partition, lay.num_partitions, 0, n))
    total = sum(len(p) for p in allp)
    bounds = [k * total // M for k in range(M + 1)]
    out: list[Layout] = []
    at, i = 0, 0  # position of allp[i].lo in the concatenation
    for k in range(M):
        a, b = bounds[k], bounds[k + 1]
        mine: list[Piece] = []
        while i < len(allp) and at < b:
            p = allp[i]
            lo = p.lo + max(0, a - at)
            hi = p.lo + min(len(p), b - at)
            if lo < hi:
                mine.append(Piece(p.epoch, p.partition, p.num_partitions, lo, hi,
                                  tuple(s for s in p.skip if lo <= s < hi)))
            if at + len(p) <= b:
                at += len(p)
                i += 1
            else:
                break
        out.append(Layout(k, M, tuple(mine), E))
    return out


def parse_cursors(v: Any, n: int, source: str) -> list[tuple[int, tuple[int, ...]]]:
    """[(low, skip)] of a journal record; RepartitionError naming what is wrong."""
    if not isinstance(v, (list, tuple)) or len(v) != n:
        raise RepartitionError(f"source {source!r}: cursors must be a list of {n} [low, skip] pairs")
    out = []
    for c in v:
        try:
            low, skip = c
            out.append((int(low), tuple(int(s) for s in skip)))
        except (TypeError, ValueError):
            raise RepartitionError(f"source {source!r}: cursor {c!r} is not [low, [skip...]]") from None
    return out


def parse_record(v: Any, old_partitions: int, names: Sequence[str]) -> dict[str, Any]:
    """A re-partition record (the planner's, the journal's) checked and normalised:
    {source, name, step, from, partitions, cursors: [[low, [consumed...]] per old partition]}.
    RepartitionError naming the field."""
    if not isinstance(v, Mapping):
        raise RepartitionError(f"a re-partition record is a mapping, not {type(v).__name__}")
    try:
        si = int(v["source"])
    except (KeyError, TypeError, ValueError):
        raise RepartitionError("re-partition: source must be a source index") from None
    if not 0 <= si < len(names):
        raise RepartitionError(f"re-partition: source {si} is not a source of the mixture (it has {len(names)})")
    name = names[si]
    if v.get("name", name) != name:
        raise RepartitionError(f"re-partition: source {si} is {name!r}, the record says {v.get('name')!r}")
    try:
        step, frm, m = int(v["step"]), int(v["from"]), int(v["partitions"])
    except (KeyError, TypeError, ValueError) as e:
        raise RepartitionError(f"source {name!r}: re-partition record needs integer step, from and partitions ({e})") \
            from None
    if step < 0:
        raise RepartitionError(f"source {name!r}: re-partition step {step} is negative")
    if frm != old_partitions:
        raise RepartitionError(f"source {name!r}: the record re-partitions from {frm} partitions, the source has "
                               f"{old_partitions}")
    if not 1 <= m <= MAX_PARTITIONS:
        raise RepartitionError(f"source {name!r}: partitions must be in [1, {MAX_PARTITIONS}], not {m}")
    if m == frm:
        raise RepartitionError(f"source {name!r}: partitions: the source already has {m} partitions")
    cursors = parse_cursors(v.get("cursors"), frm, name)
    if any(low < 0 for low, _ in cursors):
        raise RepartitionError(f"source {name!r}: cursors: a low position is negative")
    return {"source": si, "name": name, "step": step, "from": frm, "partitions": m,
            "cursors": [[low, sorted(set(skip))] for low, skip in cursors]}


def parse_partitioning(v: Any, replicas: Sequence[int], names: Sequence[str]) -> dict[int, list[dict[str, Any]]]:
    """A planner cursor's ``partitioning`` ({source index: [records, oldest first]}; None: none) checked: each
    source's chain starts at its spec replicas and each record starts where the one before left off."""
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise RepartitionError("partitioning must be a mapping of source index to records")
    out: dict[int, list[dict[str, Any]]] = {}
    for k, recs in v.items():
        try:
            si = int(k)
        except (TypeError, ValueError):
            raise RepartitionError(f"partitioning: {k!r} is not a source index") from None
        if not 0 <= si < len(names):
            raise RepartitionError(f"partitioning: no source {si}")
        if not isinstance(recs, (list, tuple)) or not recs:
            raise RepartitionError(f"partitioning of source {names[si]!r}: a non-empty list of records")
        chain, n, step = [], int(replicas[si]), 0
        for r in recs:
            rec = parse_record(r, n, names)
            if rec["source"] != si or rec["step"] < step:
                raise RepartitionError(f"partitioning of source {names[si]!r}: records out of order")
            chain.append(rec)
            n, step = rec["partitions"], rec["step"]
        out[si] = chain
    return out


def layouts_after(replicas: int, records: Sequence[Mapping[str, Any]], epoch_rows: EpochRows, *,
                  source: str = "?") -> list[Layout]:
    """The partitions' layouts after the records (oldest first) of a source of ``replicas`` partitions."""
    lays = initial_layouts(int(replicas))
    for rec in records:
        lays = repartition(lays, parse_cursors(rec["cursors"], len(lays), source), int(rec["partitions"]), epoch_rows,
                           source=source)
    return lays
