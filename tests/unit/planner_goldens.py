"""Recorded planner outputs: what the planner's decisions produce on fixed inputs.

``tests/unit/data/planner_goldens.json`` was written by ``python -m tests.unit.planner_goldens`` at commit
793b0dd. At that commit the planner still equalled, on these same cases, the former versions that the tests
then kept verbatim beside it (the per-window core, the Python pick-and-place loop and the former compiled
loop); those copies were removed when the record replaced them. test_planner_goldens.py checks that today's
planner still produces every recorded output, so a change of behaviour -- a tie-break, a cursor field, a
dtype -- shows up as a changed digest and has to be recorded on purpose (run the module again and say why in
the commit).

The cases (each a SHA-256 of everything observed, and a few values in clear for readable diffs):

* ``loop/*``: `selectloop.run` over three steps of random windows (every packing policy, unit and overlong
  mode, tiny rows, ties of lengths, free space and deadlines; counters from zero to ~1e12), and ``loop-scale/*``,
  ``loop-full/*`` in the bench's shape (hundreds of sources, thousands of 8k rows; the full ones fill them):
  every output array, and the consumption and counters written back.
* ``plans/*``: a StepPlanner on a random spec through plans, re-mixes with exclusions, a strategy that fails
  after mixing (rollback) and restores of earlier cursors: every window's state, the cursors, the sampler's
  state and every plan (layout, pieces, retire flags, the pairing of pieces and segments).
* ``window/*``: one ReplicaWindow under random adds (valid and not: the refusals' texts are recorded),
  consumption, compactions, cursors and restores.
* ``select-exclusions``, ``one-by-one``, ``coverage-swap``: a re-mix without given samples, windows
  filled one at a time between steps, and a layout edited after build_layout (paired by the search).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any, Callable

import numpy as np

from mixplane.layout import layout_digest
from mixplane.planner.context import PlanContext
from mixplane.planner.core import StepPlanner
from mixplane.planner.dgraph import vanilla_strategy
from mixplane.planner.windows import ReplicaWindow, WindowError
from mixplane.planner.routing import image_segments

from tests.unit.planner_helpers import fill, make_spec

HERE = os.path.dirname(os.path.abspath(__file__))
RECORD = os.path.join(HERE, "data", "planner_goldens.json")
PIECE_FIELDS = ("bin", "source", "key", "start", "length", "patches", "replica", "pos")


class Digest:
    """A SHA-256 over a sequence of observations: arrays by dtype, shape and bytes; the rest as canonical JSON."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.n = 0

    def add(self, *objs: Any) -> None:
        for o in objs:
            self.n += 1
            if isinstance(o, np.ndarray):
                a = np.ascontiguousarray(o)
                self.h.update(f"A{a.dtype.str}{a.shape}".encode())
                self.h.update(a.tobytes())
            else:
                self.h.update(b"J" + json.dumps(o, sort_keys=True, default=_plain).encode())

    def hex(self) -> str:
        return self.h.hexdigest()


def _plain(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, bytes):
        return o.hex()
    raise TypeError(f"cannot record {type(o).__name__}")


# ---- the compiled pick-and-place loop ------------------------------------------------------------------

def _lengths(rng: np.random.Generator, kind: str, m: int, S: int) -> np.ndarray:
    if kind == "small":
        return rng.integers(1, max(2, S // 4) + 1, m)
    if kind == "equal":  # ties everywhere: equal pieces, equal free space, equal deadlines
        return np.full(m, max(1, S // 3))
    if kind == "row":  # exactly a row each
        return np.full(m, S)
    if kind == "long":  # split over several rows
        return rng.integers(S, 4 * S + 2, m)
    if kind == "ones":
        return np.ones(m, np.int64)
    if kind == "phased":  # a run of rows left with the same free space, then pieces that fit only there
        c = S // 2 + 1
        return np.concatenate([np.full(m // 2, c), rng.integers(1, max(2, S - c + 1), m - m // 2)])
    if kind == "bimodal":  # over half a row (one per row: many rows left with equal free space) or small
        big = rng.integers(S // 2 + 1, S + 1, m) if rng.random() < 0.5 else np.full(m, S // 2 + 1)
        return np.where(rng.random(m) < 0.5, big, rng.integers(1, max(2, S // 2), m))
    return np.maximum(1, np.minimum(5 * S, rng.lognormal(np.log(max(1.0, S / 3)), 1.2, m).astype(np.int64)))


def select_case(rng: np.random.Generator, *, sources: int, rows: int, seq_len: int, per_source: int) -> dict:
    """A random loop input: sources with weights from zero to dominant, windows of assorted length
    distributions (some empty, some with partly or fully consumed samples), counters from zero to ~1e12."""
    w = rng.choice([0.0, 1e-6, 0.01, 0.3, 1.0, 5.0], sources)
    if rng.random() < 0.15:
        w = np.zeros(sources)
        w[int(rng.integers(0, sources))] = 1.0  # one source: p = 1
    if w.sum() <= 0:
        w[0] = 1.0
    probs = w / w.sum()
    counts = rng.integers(0, per_source + 1, sources)
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    kinds = ["small", "equal", "row", "long", "ones", "bimodal", "phased", "phased", "mixed"]
    tok = np.concatenate([_lengths(rng, str(rng.choice(kinds)), int(c), seq_len) for c in counts]).astype(np.int64) \
        if counts.sum() else np.zeros(0, np.int64)
    done = np.zeros(len(tok), np.int64)
    if len(tok):
        part = rng.random(len(tok)) < 0.1
        done[part] = (tok[part] * rng.random(int(part.sum()))).astype(np.int64)
        gone = rng.random(len(tok)) < 0.04
        done[gone] = tok[gone]  # fully consumed, still listed
    scale = float(rng.choice([1.0, float(seq_len), float(max(1, seq_len // 2))]))
    base = float(rng.choice([0.0, 1e3, 1e9, 1e12]))
    realized = np.where(probs > 0, np.floor(base * probs + rng.integers(0, 50, sources) * scale), 0.0)
    n_pos = int((probs > 0).sum())
    delta = (1.0 - 1.0 / (2 * n_pos - 2) if n_pos > 1 else 0.5) * scale
    return dict(c_tok=tok, c_done=done, off=off, probs=probs, realized=realized, scale=scale, delta=delta,
                limit=delta + 1e-9 * scale, unit_samples=bool(rng.random() < 0.25), truncate=bool(rng.random() < 0.25),
                seq_len=seq_len, rows=rows, policy=str(rng.choice(["best_fit", "best_fit", "next_fit", "none"])))


def run_loop(case: dict, steps: int, d: Digest) -> list[int]:
    """Several steps over the same windows (consumption and counters carried over, as the planner does)."""
    from mixplane.planner import selectloop

    done, real = case["c_done"].copy(), case["realized"].copy()
    fixed = {k: case[k] for k in ("unit_samples", "truncate", "seq_len", "rows", "policy")}
    first: list[int] = []
    for _ in range(steps):
        out = selectloop.run(case["c_tok"], done, case["off"], case["probs"], real, case["scale"], case["delta"],
                             case["limit"], **fixed)
        d.add(*out, done, real)
        if not first:
            first = out[0][:8].tolist()
    return first


def _loop_small(i: int, d: Digest) -> list[int]:
    rng = np.random.default_rng([11, i])
    seq_len = int(rng.choice([1, 2, 3, 7, 16, 64, 100]))
    rows = int(rng.choice([1, 2, 3, 5, 17, 64, 130]))
    sources = int(rng.integers(1, 15))
    case = select_case(rng, sources=sources, rows=rows, seq_len=seq_len, per_source=int(rng.integers(0, 40)))
    return run_loop(case, 3, d)


def _loop_scale(i: int, d: Digest) -> list[int]:
    """select_case at the bench's size: mostly held back by the starved-source bound (a handful of pieces)."""
    case = select_case(np.random.default_rng(1000 + i), sources=300, rows=2048, seq_len=8192, per_source=200)
    case.update(unit_samples=False, truncate=False, policy="best_fit" if i < 3 else "next_fit")
    return run_loop(case, 3, d)


def _loop_full(i: int, d: Digest) -> list[int]:
    """Windows sized to the shares (Dirichlet weights, some sources off in case 2), lognormal lengths: two steps
    of ~8-9k placements filling 2,048 rows of 8k (deep best-fit buckets, a full ready heap), then the windows
    run dry in the third."""
    rng = np.random.default_rng([19, i])
    S, n, R = 8192, 300, 2048
    probs = rng.dirichlet(np.full(n, 0.5))
    if i == 2:
        probs[rng.choice(n, 40, replace=False)] = 0
        probs /= probs.sum()
    mean = np.exp(np.log(S / 8) + 1.2 ** 2 / 2)
    counts = (np.ceil(probs * R * S / mean * 3) + rng.integers(0, 20, n)).astype(np.int64)
    tok = np.maximum(1, np.minimum(5 * S, rng.lognormal(np.log(S / 8), 1.2, int(counts.sum())).astype(np.int64)))
    delta = (1.0 - 1.0 / (2 * int((probs > 0).sum()) - 2)) * S
    case = dict(c_tok=tok, c_done=np.zeros(len(tok), np.int64), off=np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
                probs=probs, realized=np.zeros(n), scale=float(S), delta=delta, limit=delta + 1e-9 * S,
                unit_samples=False, truncate=False, seq_len=S, rows=R, policy="best_fit" if i < 3 else "next_fit")
    return run_loop(case, 3, d)


# ---- the planner: windows, cursors and whole plans ----------------------------------------------------

def window_state(w: ReplicaWindow) -> tuple:
    return (w.source, w.replica, w.pos.tolist(), w.key.tolist(), w.tokens.tolist(), w.patches.tolist(),
            w.done.tolist(), w.low, w.next_pos, sorted(w.skip), sorted(w.restored_done.items()), w.dry,
            w.unconsumed_tokens, w.ready, len(w))


def observe_planner(p: StepPlanner, d: Digest, *, arrays: bool = True) -> None:
    """The windows (arrays=False leaves their arrays unread: reading them joins what `add` took into arrays
    of the window's own, and the store's gather then takes its general path -- both are exercised), the
    cursor, readiness, what the next step waits for and the buffer summary."""
    if arrays:
        d.add([window_state(w) for w in p.windows])
    d.add([len(w) for w in p.windows], p.cursor(), p.ready, [(w.source, w.replica) for w in p.waiting_for()],
          p.summary_buffer())
    # the JSON the planner sends every constructor, written without the dicts: json.dumps' text
    assert p.cursor_later().json() == json.dumps(p.cursor(), separators=(",", ":"))


def observe_plan(p: StepPlanner, plan: Any, d: Digest) -> None:
    d.add(layout_digest(plan.layout), *(getattr(plan.pieces, f) for f in PIECE_FIELDS), plan.cursor_before,
          plan.tokens_by_source, plan.samples_by_source, plan.retired, plan.piece_of_seg,
          p.sampler.state_dict())
    assert plan.retired is not None and plan.retired.dtype == np.uint8
    want = image_segments(plan.layout, plan.piece_of_seg, plan.pieces.patches)
    if plan.seg_of_img is not None:
        assert want is not None and np.array_equal(plan.seg_of_img, want)
    assert (plan.seg_of_img is not None) == bool(len(plan.layout.img_key))  # build_layout's layouts: known
    assert np.array_equal(plan.retired, p.retired(plan.pieces))


def remixing(every: int) -> Callable[[PlanContext], Any]:
    """A strategy that mixes, then re-mixes without every `every`-th piece's sample (rollback + general path)."""
    def strategy(ctx: PlanContext):
        p = ctx.mix()
        ctx.mix(exclude=list(zip(p.source.tolist(), p.key.tolist()))[::every])
        return vanilla_strategy(ctx)
    return strategy


class Boom(RuntimeError):
    pass


def failing(ctx: PlanContext):
    ctx.mix()
    raise Boom("strategy failed after mixing")


def _plans(i: int, d: Digest) -> list[int]:
    rng = np.random.default_rng([13, i])
    sources = int(rng.integers(1, 6))
    weights = {f"s{k}": float(rng.choice([0.0, 0.3, 1.0, 3.0])) for k in range(sources)}
    if sum(weights.values()) <= 0:
        weights["s0"] = 1.0
    images = bool(rng.random() < 0.5)
    spec = make_spec(sources=sources, weights=weights, unit=str(rng.choice(["tokens", "samples"])),
                     packing=str(rng.choice(["best_fit", "next_fit", "none"])),
                     overlong=str(rng.choice(["split", "truncate"])), rows=int(rng.choice([4, 8, 16])),
                     seq_len=int(rng.choice([64, 256])), replicas=int(rng.integers(1, 4)),
                     window=int(rng.choice([4, 16, 64])), dp=2, microbatches=2, encoder=images,
                     strategy="vlm_balance" if images else "llm_balance")
    events = rng.choice(["plan", "plan", "plan", "remix", "fail", "restore"], int(rng.integers(4, 11))).tolist()
    p = StepPlanner(spec)
    default = p.strategy
    cursors: list[dict] = []
    first: list[int] = []
    d.add(events)
    for ev in events:
        fill(p, images=images)
        observe_planner(p, d, arrays=len(cursors) % 2 == 1)
        if ev == "restore" and cursors:
            p.restore(cursors[len(cursors) // 2])
            observe_planner(p, d)
            continue
        if ev == "fail":
            p.strategy = failing
            try:
                p.plan()
                raise AssertionError("a failing strategy planned")
            except Boom:
                pass
            observe_planner(p, d)
        p.strategy = remixing(3) if ev == "remix" else default
        plan = p.plan()
        observe_plan(p, plan, d)
        observe_planner(p, d)
        cursors.append(p.cursor())
        if not first:
            first = plan.pieces.key[:6].tolist()
    return first


def as_sent(arrays: tuple, form: int) -> tuple:
    """LOADER_META arrays in the forms `add` may get: int64 arrays (its compiled path), read-only ones as the
    wire decodes them, one of them int32, lists, or the key as floats (the step-by-step path)."""
    if form == 1:
        return tuple(np.frombuffer(np.asarray(a, np.int64).tobytes(), np.int64) for a in arrays)
    if form == 2:
        return (arrays[0], arrays[1], np.asarray(arrays[2], np.int32), arrays[3])
    if form == 3:
        return tuple(np.asarray(a).tolist() for a in arrays)
    if form == 4:
        return (arrays[0], np.asarray(arrays[1], np.float64), *arrays[2:])
    return arrays


def _window(i: int, d: Digest) -> list[int]:
    """Random adds (valid and not), partial and whole consumption written into `done`, compactions,
    cursors and restores. (`unconsumed_tokens` counts what `done` says as of the last add / compact / restore.)"""
    rng = np.random.default_rng([17, i])
    lo, tokens, hi = int(rng.integers(1, 6)), int(rng.integers(0, 200)), int(rng.integers(6, 12))
    w = ReplicaWindow(0, 0, lo, tokens, hi)
    saved = [w.cursor()]
    refused = 0
    for _ in range(40):
        op = rng.random()
        if op < 0.45:
            start = w.next_pos + int(rng.integers(-2, 3)) if rng.random() < 0.2 else w.next_pos
            n = int(rng.integers(0, 5))
            pos = start + np.cumsum(rng.integers(0 if rng.random() < 0.05 else 1, 3, n))
            tok = rng.integers(0 if rng.random() < 0.05 else 1, 60, n)
            args = as_sent((pos, pos * 7 + 1, tok, rng.integers(0, 3, n)), int(rng.integers(0, 5)))
            try:
                w.add(*args)
                d.add("added")
            except WindowError as e:
                refused += 1
                d.add(str(e))
        elif op < 0.7 and len(w):  # consumption written into `done`, then compacted (as the planner does)
            for k in rng.choice(len(w), int(rng.integers(1, len(w) + 1)), replace=False).tolist():
                done = int(w.done[k]) + int(rng.integers(1, max(0, int(w.tokens[k] - w.done[k])) + 2))
                w.done[k] = min(done, int(w.tokens[k]))
            d.add(w.compact())
        elif op < 0.85:
            d.add(w.compact())
        elif op < 0.95:
            saved.append(w.cursor())
        else:
            w.restore(saved[int(rng.integers(0, len(saved)))])
        d.add(window_state(w), w.cursor())
    return [refused, len(w)]


def _select_exclusions(d: Digest) -> list[int]:
    p = StepPlanner(make_spec(sources=4, weights={"s0": 1, "s1": 2, "s2": 1, "s3": 0.5}, rows=8, seq_len=128))
    fill(p)
    pt = p.schedule.at(0)
    snap = p._snapshot()
    first = p.select(0, pt)
    keys = list(zip(first.source.tolist(), first.key.tolist()))[::3]
    p._rollback(snap)
    again = p.select(0, pt, keys)
    assert not set(zip(again.source.tolist(), again.key.tolist())) & set(keys)
    for pieces in (first, again):
        d.add(*(getattr(pieces, f) for f in PIECE_FIELDS))
    return again.key[:6].tolist()


def _one_by_one(d: Digest) -> list[int]:
    """Adds between steps detach single windows; the next step gathers them again."""
    p = StepPlanner(make_spec(sources=3, rows=8, seq_len=128, window=16))
    for _ in range(5):
        fill(p)
        assert any(w.stored is None for w in p.windows)
        plan = p.plan()
        observe_plan(p, plan, d)
        observe_planner(p, d)
        assert all(w.stored is p.store for w in p.windows)
    return p.windows[0].key[:6].tolist()


def edited(edit: Callable[[Any], None]) -> Callable[[PlanContext], Any]:
    def strategy(ctx: PlanContext):
        lay = vanilla_strategy(ctx)
        edit(lay)
        return lay
    return strategy


def swap_rows(lay: Any) -> None:
    """Segments 0 and 1 trade places (rows included): still a cover, but not build_layout's pairing."""
    for f in ("seg_row", "seg_source", "seg_key", "seg_start", "seg_len"):
        a = getattr(lay, f)
        a[[0, 1]] = a[[1, 0]]


def _coverage_swap(d: Digest) -> list[int]:
    p = StepPlanner(make_spec(sources=3, rows=8, seq_len=128, window=16))
    p.strategy = edited(swap_rows)
    for _ in range(3):
        fill(p)
        plan = p.plan()
        observe_plan(p, plan, d)
    return plan.piece_of_seg[:6].tolist()


LOOP_CASES, PLAN_CASES, WINDOW_CASES, SCALE_CASES = 300, 40, 60, 4
CASES: dict[str, Callable[[Digest], list[int]]] = {}
for _i in range(LOOP_CASES):
    CASES[f"loop/{_i}"] = lambda d, i=_i: _loop_small(i, d)
for _i in range(SCALE_CASES):
    CASES[f"loop-scale/{_i}"] = lambda d, i=_i: _loop_scale(i, d)
    CASES[f"loop-full/{_i}"] = lambda d, i=_i: _loop_full(i, d)
for _i in range(PLAN_CASES):
    CASES[f"plans/{_i}"] = lambda d, i=_i: _plans(i, d)
for _i in range(WINDOW_CASES):
    CASES[f"window/{_i}"] = lambda d, i=_i: _window(i, d)
CASES["select-exclusions"] = _select_exclusions
CASES["one-by-one"] = _one_by_one
CASES["coverage-swap"] = _coverage_swap


def run_case(name: str) -> dict[str, Any]:
    d = Digest()
    first = CASES[name](d)
    return {"first": first, "n": d.n, "sha256": d.hex()}


def main() -> int:
    out = {name: run_case(name) for name in CASES}
    os.makedirs(os.path.dirname(RECORD), exist_ok=True)
    with open(RECORD, "w") as f:  # one case per line: a changed case is a one-line diff
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(out[k])}" for k in sorted(out)) + "\n}\n")
    print(f"recorded {len(out)} cases into {RECORD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
