"""The step's pick-and-place rule written plainly, one piece at a time (slow): what the compiled select loop
(`selectloop.run`) must produce, and a property test holds it to it, piece for piece, on random inputs.

One step fills `rows` rows of `seq_len` tokens from per-source candidate lists (each source's samples in the order
it takes them; `c_done` says how much of each is already consumed). Repeated until one of the stops below:

1. *Stop* when the packer has no room left (`OnlinePacker.largest_gap` is 0) or no source may be served.
2. *Rows-weighted sources first* (``quota[i] > 0``: `mixture.rows`, probability 0), one after the other in source
   order: source i's current candidate is taken while documents of its quota are left to begin, or while the
   current one is already begun (it is finished first). A source is served no further this step once it has
   neither, has no candidate left, or its piece fits nowhere. Its pieces move no mixing counter.
3. *Then the share sources*: the mixing rule picks one, `mixing.DeficitSampler.pick(probs, eligible, sizes=...,
   scale=scale, fallback=False)` over the sources with a probability and a candidate left, `sizes` being what each
   one's current candidate would add (tokens: its next piece; samples: 1 if not begun, else 0). No source released
   (-1): stop -- the step ends rather than let a source run ahead of its share.
4. *The starved-source bound*: a source with a share but no candidate left may not fall behind: if counting the
   picked source's size would put any such source i more than the rule's limit behind its share
   (``probs[i] * (T + size) - realized[i] > limit``, T the counters' sum), stop.
5. *Placement* (`packing.OnlinePacker`: best fit, next fit, none): the candidate's next piece (what is left of it,
   at most a row) goes where the packer puts it. Where it fits nowhere (or nothing is left of it) the source moves
   on to its next candidate, and that one is offered at the next pick; the sample stays unconsumed for a later step.
6. *What a placed piece does*: the piece (candidate, row, start, length) is output; the candidate's consumption
   grows by the piece, or (``truncate``) to the whole sample: what did not fit the row is dropped. A share source's
   counter grows by the piece's tokens (``unit_samples``: by 1 for a sample's first piece). A finished candidate
   moves the source on to its next one.
7. *Sources' ends* (docs/mixtures.md): ``ends[i]`` is one past source i's last allowed candidate; ``final[i]``: no
   later row of it is allowed. When a final source finishes its last unfinished allowed candidate it ends there.
   A share source that ends leaves the mix: its probability is set to 0, the others' renormalised (their sum
   taken in source order), every counter reset to 0 (the rest of the step is a new segment), so the rule's slack
   and limit follow the sources left; with no share source left the step stops.

The rule's slack and limit are the sampler's: ``delta = mixing.slack(sources with a probability) * scale`` and
``limit = delta + 1e-9 * scale`` (what `StepPlanner.select` passes the compiled loop). The counters are whole
numbers (tokens or samples) in the planner, so their sum T is exact however it is taken.
"""

from __future__ import annotations

import numpy as np

from mixplane.mixing import DeficitSampler, slack
from mixplane.planner.packing import OnlinePacker


def rule_limits(probs: np.ndarray, scale: float) -> tuple[float, float]:
    """(delta, limit) of the mixing rule for these probabilities: what `selectloop.run` takes as arguments."""
    delta = slack(int((np.asarray(probs) > 0).sum())) * scale
    return delta, delta + 1e-9 * scale


def select(c_tok: np.ndarray, c_done: np.ndarray, off: np.ndarray, probs: np.ndarray, realized: np.ndarray,
           scale: float, *, unit_samples: bool, truncate: bool, seq_len: int, rows: int, policy: str,
           ends: np.ndarray | None = None, final: np.ndarray | None = None, quota: np.ndarray | None = None,
           outcome: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`selectloop.run` by the rules above, with the same arguments but delta and limit (they follow from `probs`
    and `scale`): (candidate, row, start, length) per piece, in the order placed; `c_done` and `realized` are
    updated in place, and `outcome` receives "ended" (uint8 per source) and "short" (documents of each quota that
    did not begin)."""
    n = len(probs)
    S = int(seq_len)
    probs = np.array(probs, np.float64)  # a copy: an end renormalises it
    end = [int(x) for x in (off[1:] if ends is None else ends)]
    is_final = [False] * n if final is None else [bool(x) for x in final]
    left = [0] * n if quota is None else [int(x) for x in quota]  # documents of each quota still to begin
    ptr = [int(off[i]) for i in range(n)]  # each source's current candidate
    unfinished = [sum(1 for k in range(ptr[i], end[i]) if c_done[k] < c_tok[k]) for i in range(n)]
    ended = np.zeros(n, np.uint8)
    sampler = DeficitSampler(n, realized=realized)  # the same array: its counters are the caller's
    packer = OnlinePacker(rows, S, policy)
    rows_sources = [i for i in range(n) if left[i] > 0]  # served first, in source order
    out: list[tuple[int, int, int, int]] = []

    def has_candidate(i: int) -> bool:
        return ptr[i] < end[i]

    def size(i: int) -> float:
        """What source i's current candidate adds to its counter."""
        k = ptr[i]
        if unit_samples:
            return 1.0 if c_done[k] == 0 else 0.0
        return float(min(c_tok[k] - c_done[k], S))

    def place(i: int) -> tuple[int, int, int]:
        """Source i's current candidate's next piece into the packer: (row or -1, start, length)."""
        k = ptr[i]
        start = int(c_done[k])
        length = min(int(c_tok[k]) - start, S)
        return packer.place(length), start, length

    def consume(i: int, row: int, start: int, length: int) -> bool:
        """The piece output and consumed; True when it finished a final source's last unfinished candidate."""
        k = ptr[i]
        out.append((k, row, start, length))
        c_done[k] = c_tok[k] if truncate else start + length
        if c_done[k] < c_tok[k]:
            return False
        ptr[i] += 1
        unfinished[i] -= 1
        return is_final[i] and unfinished[i] == 0

    while True:
        share = np.array([probs[i] > 0 and has_candidate(i) for i in range(n)], bool)
        if not rows_sources and not share.any():
            break
        if packer.largest_gap <= 0:
            break
        if rows_sources:  # 2. rows-weighted sources
            i = rows_sources[0]
            if not (has_candidate(i) and (left[i] > 0 or c_done[ptr[i]] > 0)):
                rows_sources.pop(0)
                continue
            row, start, length = place(i)
            if row < 0:
                rows_sources.pop(0)
                continue
            if start == 0:
                left[i] -= 1
            if consume(i, row, start, length):
                ended[i] = 1
            continue
        # 3. the mixing rule
        sizes = np.array([size(i) if share[i] else 0.0 for i in range(n)])
        i = sampler.pick(probs, share, sizes=sizes, scale=scale, fallback=False)
        if i < 0:
            break
        # 4. the starved-source bound
        _, limit = rule_limits(probs, scale)
        x = float(realized.sum()) + sizes[i]
        if any(probs[j] > 0 and not has_candidate(j) and probs[j] * x - realized[j] > limit for j in range(n)):
            break
        # 5. placement
        row, start, length = place(i)
        if row < 0:
            ptr[i] += 1
            continue
        # 6. the counters
        sampler.record(i, (1.0 if start == 0 else 0.0) if unit_samples else float(length))
        if consume(i, row, start, length):  # 7. the source ends: the rest of the step is mixed over the others
            ended[i] = 1
            probs[i] = 0.0
            psum = 0.0
            for p in probs.tolist():  # in source order, one addition at a time (as the compiled loop adds them)
                if p > 0:
                    psum += p
            if psum == 0:
                break
            probs = probs / psum
            realized[:] = 0.0
    if outcome is not None:
        outcome["ended"] = ended
        outcome["short"] = np.array(left, np.int64)
    cols = np.array(out, np.int64).reshape(-1, 4)
    return cols[:, 0].copy(), cols[:, 1].copy(), cols[:, 2].copy(), cols[:, 3].copy()
