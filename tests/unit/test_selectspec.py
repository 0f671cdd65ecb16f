"""The compiled pick-and-place loop (planner/selectloop.py) gives exactly what the step's rule written plainly gives
(planner/selectspec.py: DeficitSampler.pick, OnlinePacker, the starved-source bound, sources' ends and rows per
step): the same pieces in the same order, the same consumption and counters written back, bit for bit, the same
ends and quota shortfalls -- over several steps of the same windows, on the golden record's random and
adversarial loop inputs and on windows sized to fill the rows, with sources that end and sources weighted by rows."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.planner import selectloop, selectspec

from .planner_goldens import _lengths, select_case

SEQ_LENS = [1, 2, 3, 7, 16, 64, 100]
ROWS = [1, 2, 3, 5, 17, 64, 130]


def agree(case: dict, steps: int = 3) -> int:
    """`steps` steps through the compiled loop and through the rule, each on its own copy of the consumption and
    counters; between steps a source that ended leaves the mixture (as the planner's schedule then drops it).
    Returns the number of pieces placed."""
    fixed = {k: case[k] for k in ("unit_samples", "truncate", "seq_len", "rows", "policy")}
    done = [case["c_done"].copy(), case["c_done"].copy()]
    real = [case["realized"].copy(), case["realized"].copy()]
    probs, ends, final, quota = case["probs"].copy(), case.get("ends"), case.get("final"), case.get("quota")
    placed = 0
    for step in range(steps):
        delta, limit = selectspec.rule_limits(probs, case["scale"])
        if "delta" in case and step == 0:  # the golden record's cases carry the rule's values, reckoned there
            assert (delta, limit) == (case["delta"], case["limit"])
        outcome: list[dict[str, np.ndarray]] = [{}, {}]
        got = selectloop.run(case["c_tok"], done[0], case["off"], probs, real[0], case["scale"], delta, limit,
                             ends=ends, final=final, quota=None if quota is None else quota.copy(), outcome=outcome[0],
                             **fixed)
        want = selectspec.select(case["c_tok"], done[1], case["off"], probs, real[1], case["scale"], ends=ends,
                                 final=final, quota=None if quota is None else quota.copy(), outcome=outcome[1], **fixed)
        where = f"step {step}, {fixed}"
        for name, g, w in zip(("candidate", "row", "start", "length"), got, want):
            assert g.dtype == w.dtype and g.tolist() == w.tolist(), (where, name, g.tolist(), w.tolist())
        assert done[0].tolist() == done[1].tolist(), where
        assert real[0].tobytes() == real[1].tobytes(), (where, real[0].tolist(), real[1].tolist())
        for key in ("ended", "short"):
            g, w = outcome[0][key], outcome[1][key]
            assert g.dtype == w.dtype and g.tolist() == w.tolist(), (where, key, g.tolist(), w.tolist())
        placed += len(got[0])
        gone = outcome[0]["ended"].astype(bool)
        if gone.any():
            probs = np.where(gone, 0.0, probs)
            if probs.sum() > 0:
                probs = probs / probs.sum()
            final = None if final is None else final & ~gone
            quota = None if quota is None else np.where(gone, 0, quota)
    return placed


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**63 - 1), st.sampled_from(SEQ_LENS), st.sampled_from(ROWS), st.integers(1, 14),
       st.integers(0, 40))
def test_loop_equals_the_rule_on_the_golden_cases(seed, seq_len, rows, sources, per_source):
    """The golden record's loop inputs (planner_goldens.select_case: every packing policy, unit and overlong mode,
    one row or one token per row, ties of lengths, free space and deadlines, empty windows, partly and fully
    consumed samples, weights from 1e-6 to dominant, counters from zero to ~1e12)."""
    agree(select_case(np.random.default_rng(seed), sources=sources, rows=rows, seq_len=seq_len, per_source=per_source))


def filling_case(rng: np.random.Generator, *, sources: int, rows: int, seq_len: int, plenty: float) -> dict:
    """Windows sized to the shares (`plenty` times what the rows hold, some sources short, so they run out within the
    step), equal weights among some (ties of deadlines), counters from zero, on target or off it; some sources
    limited to a prefix of their window (`ends`), some `final` (they end when their last allowed sample is
    finished), and now and then one to three sources weighted by rows (`quota`, probability 0)."""
    n, S = sources, seq_len
    w = rng.choice([0.0, 0.01, 0.3, 1.0, 1.0, 1.0, 5.0], n)
    if w.sum() <= 0:
        w[0] = 1.0
    quota = np.zeros(n, np.int64)
    if rng.random() < 0.3:
        q = rng.choice(n, int(rng.integers(1, min(3, n) + 1)), replace=False)
        quota[q] = rng.integers(1, 8, len(q))
        w[q] = 0.0
    probs = w / w.sum() if w.sum() > 0 else w
    kinds = ["small", "equal", "row", "long", "ones", "bimodal", "phased", "mixed"]
    kind = str(rng.choice(kinds))
    toks, counts = [], []
    for i in range(n):
        lens = _lengths(rng, kind if rng.random() < 0.5 else str(rng.choice(kinds)), 400, S)
        share = probs[i] if probs[i] > 0 else (0.2 if quota[i] else 0.02)
        want = share * rows * S * plenty * rng.choice([0.2, 1.0, 1.0, 2.0])
        m = min(400, int(np.searchsorted(np.cumsum(np.minimum(lens, S)), want)) + int(rng.integers(0, 3)))  # (the rule is slow)
        lens = np.resize(lens, m) if m else lens[:0]
        toks.append(lens)
        counts.append(len(lens))
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    tok = np.concatenate(toks).astype(np.int64)
    done = np.zeros(len(tok), np.int64)
    part = rng.random(len(tok)) < 0.05
    done[part] = (tok[part] * rng.random(int(part.sum()))).astype(np.int64)
    gone = rng.random(len(tok)) < 0.02
    done[gone] = tok[gone]  # fully consumed, still listed
    unit_samples = bool(rng.random() < 0.25)
    # the planner's scale: one sample, or (tokens) at least the largest piece among the candidates
    scale = 1.0 if unit_samples else float(rng.choice([S, max(1, min(S, int((tok - done).max(initial=1))))]))
    realized = np.zeros(n)
    how = rng.random()
    if how < 0.3:  # on target, whole numbers
        realized = np.floor(probs * rng.integers(0, 10**6))
    elif how < 0.5:  # off target by a few units
        realized = np.where(probs > 0, np.floor(probs * 1e4 + rng.integers(0, 4, n) * scale), 0.0)
    ends = off[1:].copy()
    cut = rng.random(n) < 0.25
    ends[cut] = off[:-1][cut] + (np.diff(off)[cut] * rng.random(int(cut.sum()))).astype(np.int64)
    final = rng.random(n) < 0.4
    dry = np.array([not np.any(done[off[i]:ends[i]] < tok[off[i]:ends[i]]) for i in range(n)])
    if (probs[~dry] > 0).any() and rng.random() < 0.8:  # mostly, a source with nothing left has ended before
        probs = np.where(dry, 0.0, probs)
        probs /= probs.sum()
    return dict(c_tok=tok, c_done=done, off=off, probs=probs, realized=realized, scale=scale,
                unit_samples=unit_samples, truncate=bool(rng.random() < 0.25), seq_len=S, rows=rows,
                policy=str(rng.choice(["best_fit", "best_fit", "next_fit", "none"])), ends=ends, final=final,
                quota=quota)


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**63 - 1), st.sampled_from(SEQ_LENS), st.sampled_from(ROWS), st.integers(1, 12),
       st.sampled_from([0.3, 1.0, 3.0]))
def test_loop_equals_the_rule_on_filling_windows_with_ends_and_rows(seed, seq_len, rows, sources, plenty):
    """Steps that fill their rows or stop where a source runs dry, sources that end, sources weighted by rows."""
    agree(filling_case(np.random.default_rng(seed), sources=sources, rows=rows, seq_len=seq_len, plenty=plenty))


def test_loop_equals_the_rule_in_the_benchs_shape():
    """Hundreds of sources, rows of 8k: the golden record's loop-scale input (held back by the starved-source bound
    within a few pieces) and a smaller loop-full one (Dirichlet shares, lognormal lengths, some sources off: over a
    thousand placements a step into deep best-fit buckets, then the windows run dry)."""
    case = select_case(np.random.default_rng(1000), sources=300, rows=2048, seq_len=8192, per_source=200)
    case.update(unit_samples=False, truncate=False, policy="best_fit")
    agree(case)
    rng = np.random.default_rng([19, 2])
    S, n, R = 8192, 300, 256
    probs = rng.dirichlet(np.full(n, 0.5))
    probs[rng.choice(n, 40, replace=False)] = 0
    probs /= probs.sum()
    mean = np.exp(np.log(S / 8) + 1.2 ** 2 / 2)
    counts = (np.ceil(probs * R * S / mean * 2.5) + rng.integers(0, 3, n)).astype(np.int64)
    tok = np.maximum(1, np.minimum(5 * S, rng.lognormal(np.log(S / 8), 1.2, int(counts.sum())).astype(np.int64)))
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    case = dict(c_tok=tok, c_done=np.zeros(len(tok), np.int64), off=off, probs=probs, realized=np.zeros(n),
                scale=float(S), unit_samples=False, truncate=False, seq_len=S, rows=R, policy="best_fit")
    assert agree(case) > 1000  # the rows were filled, not stopped at once
    # thirty sources with a share final, allowed their first two samples (`ends`): they end within the step, each
    # end renormalising the shares of a few hundred sources and resetting the counters
    final = np.zeros(n, bool)
    final[rng.choice(np.flatnonzero(probs > 0), 30, replace=False)] = True
    ends = np.where(final, off[:-1] + np.minimum(counts, 2), off[1:])
    outcome: dict[str, np.ndarray] = {}
    delta, limit = selectspec.rule_limits(probs, float(S))
    selectloop.run(tok, np.zeros(len(tok), np.int64), off, probs, np.zeros(n), float(S), delta, limit,
                   unit_samples=False, truncate=False, seq_len=S, rows=R, policy="best_fit", ends=ends, final=final,
                   outcome=outcome)
    assert outcome["ended"].sum() >= 5
    agree(dict(case, final=final, ends=ends))
