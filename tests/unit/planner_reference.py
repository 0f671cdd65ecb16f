"""The planner's step selection as it was before it ran the mixing sampler incrementally (kept verbatim
as the reference the equivalence tests compare `StepPlanner.select` with, pick for pick)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mixplane.planner.packing import OnlinePacker
from mixplane.mixing import MixturePoint, slack
from mixplane.planner.core import Pieces, StepPlanner


def old_select(self: StepPlanner, step: int, point: MixturePoint, exclude: Any = None) -> Pieces:
    """Mix and pack: choose token spans by deficit and place them best-fit into the step's rows.

    The source picked next is always the one furthest behind its share (DeficitSampler's rule,
    inlined here for speed); its oldest window sample that still fits somewhere is placed.
    `exclude`: (source, key) pairs that must not be picked this step.
    """
    spec = self.spec
    S = spec.batch.seq_len
    R = spec.rows_per_step
    packer = OnlinePacker(R, S, spec.batch.packing)
    truncate = spec.batch.overlong == "truncate"
    self.sampler.enter(point)
    n = self.n_sources
    excl = {(int(a), int(b)) for a, b in exclude} if exclude else None
    # candidates per source: (window index, entry index), in (stream position, replica) order
    cw: list[list[int]] = [[] for _ in range(n)]
    ce: list[list[int]] = [[] for _ in range(n)]
    parts: list[list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(n)]
    for wi, w in enumerate(self.windows):
        if len(w):
            m = len(w)
            parts[w.source].append((w.pos, np.full(m, w.replica), np.full(m, wi), np.arange(m)))
    for si in range(n):
        if not parts[si]:
            continue
        pos = np.concatenate([p[0] for p in parts[si]])
        rep = np.concatenate([p[1] for p in parts[si]])
        wis = np.concatenate([p[2] for p in parts[si]])
        eis = np.concatenate([p[3] for p in parts[si]])
        o = np.lexsort((rep, pos))
        wis, eis = wis[o], eis[o]
        if excl:
            keep = np.array([(si, int(self.windows[a].key[b])) not in excl for a, b in zip(wis, eis)], dtype=bool)
            wis, eis = wis[keep], eis[keep]
        cw[si] = wis.tolist()
        ce[si] = eis.tolist()
    ptr = [0] * n
    counts = [len(c) for c in cw]
    probs = [float(x) for x in point.probs]
    inv_p = [1.0 / x if x > 0 else 0.0 for x in probs]
    realized = [float(x) for x in self.sampler.realized]
    total = float(self.sampler.realized.sum())
    active = [i for i in range(n) if counts[i] > 0 and probs[i] > 0]
    unit_samples = self.unit_samples
    windows = self.windows

    def size_of(i: int) -> float:
        w = windows[cw[i][ptr[i]]]
        ei = ce[i][ptr[i]]
        d = int(w.done[ei])
        if unit_samples:
            return 1.0 if d == 0 else 0.0
        rem = int(w.tokens[ei]) - d
        return float(rem if rem < S else S)

    # scale of "one sample": 1, or (tokens) the largest piece among the segment's candidates so far
    if unit_samples:
        L = 1.0
    else:
        big = [int(min(S, int((w.tokens - w.done).max()))) for w in windows if len(w)]
        L = max(self.sampler.unit_max, float(max(big)) if big else 1.0)
        self.sampler.unit_max = L
    dL = slack(sum(1 for x in probs if x > 0)) * L
    tol = 1e-9 * L
    lsz = [size_of(i) if counts[i] > 0 else 0.0 for i in range(n)]
    # sources with a target share but no candidate left this step (window exhausted or nothing fits)
    starved = [i for i in range(n) if probs[i] > 0 and counts[i] == 0]
    o_bin: list[int] = []
    o_src: list[int] = []
    o_key: list[int] = []
    o_start: list[int] = []
    o_len: list[int] = []
    o_patch: list[int] = []
    o_rep: list[int] = []
    o_pos: list[int] = []
    while active and packer.largest_gap > 0:
        # earliest deadline among released sources (DeficitSampler.pick, inlined)
        best = -1
        bd = np.inf
        for i in active:
            li = lsz[i]
            if realized[i] + li - probs[i] * (total + li) <= dL + tol:
                d = (realized[i] + dL) * inv_p[i]
                if d < bd:
                    bd = d
                    best = i
        if best < 0:
            # every source that could still place something is a full sample ahead: the ones behind
            # have nothing that fits; end the step rather than drift
            break
        if starved:
            # a source with nothing left that fits may not fall a sample behind: rather end the step
            # here (its rows keep some padding) and let it catch up first thing next step
            li = lsz[best]
            if any(probs[i] * (total + li) - realized[i] > dL + tol for i in starved):
                break
        k = ptr[best]
        wi = cw[best][k]
        ei = ce[best][k]
        w = windows[wi]
        start = int(w.done[ei])
        tokens = int(w.tokens[ei])
        remaining = tokens - start
        piece = remaining if remaining < S else S
        row = packer.place(piece)
        if row < 0:
            ptr[best] = k + 1  # does not fit this step; stays in the window for the next
            if k + 1 >= counts[best]:
                active.remove(best)
                starved.append(best)
            else:
                lsz[best] = size_of(best)
            continue
        o_bin.append(row)
        o_src.append(best)
        o_key.append(int(w.key[ei]))
        o_start.append(start)
        o_len.append(piece)
        o_patch.append(int(w.patches[ei]) if start == 0 else 0)
        o_rep.append(w.replica)
        o_pos.append(int(w.pos[ei]))
        done = tokens if truncate else start + piece
        w.done[ei] = done
        if unit_samples:
            if start == 0:  # a sample counts once, at its first piece
                realized[best] += 1.0
                total += 1.0
        else:
            realized[best] += piece
            total += piece
        if done >= tokens:
            ptr[best] = k + 1
            if k + 1 >= counts[best]:
                active.remove(best)
                starved.append(best)
                continue
        lsz[best] = size_of(best)
    self.sampler.realized[:] = realized
    return Pieces(np.asarray(o_bin, np.int64), np.asarray(o_src, np.int16), np.asarray(o_key, np.int64),
                  np.asarray(o_start, np.int64), np.asarray(o_len, np.int64), np.asarray(o_patch, np.int64),
                  np.asarray(o_rep, np.int64), np.asarray(o_pos, np.int64))
