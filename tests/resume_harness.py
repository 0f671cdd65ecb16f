"""One save/load harness for every stateful part (as torchdata's ``run_test_save_load_state``).

A part is described by a :class:`Resumable`: how to make a fresh one, produce its next item, save
its state and load a state into a fresh one. :func:`check_save_load_state` then, for each
midpoint m:

1. runs a fresh part ``total`` items without interruption (the reference);
2. runs a fresh part m items, saves, and finishes — saving must not change what follows;
3. loads the state (after a JSON round trip: states are plain data, never pickled) into a fresh
   part and finishes — it must deliver exactly the reference's items m..total;
4. loads the same state once more — loading must not consume or alter the state.

``epoch_of`` (item -> epochs it holds) makes the harness assert that the reference crosses an epoch
boundary and that some midpoint lies in a later epoch than the first, so "also across the next
epoch" is checked rather than assumed.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, TypeVar

T = TypeVar("T")


@dataclass
class Resumable(Generic[T]):
    make: Callable[[], T]  # a fresh part in its initial state
    next_item: Callable[[T], Any]  # the next item, as plain comparable data (tuples, bytes, ints)
    save: Callable[[T], Any]  # the part's state
    load: Callable[[T, Any], None]  # restore a state into a fresh part
    close: Callable[[T], None] = lambda part: None
    epoch_of: Callable[[Any], Iterable[int]] | None = None  # epochs an item's samples belong to


def _run(r: Resumable[T], part: T, n: int) -> list[Any]:
    return [r.next_item(part) for _ in range(n)]


def _first_difference(a: list[Any], b: list[Any]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"item {i} differs"
    return f"lengths {len(a)} != {len(b)}"


def check_save_load_state(r: Resumable[T], *, total: int, midpoints: Iterable[int]) -> list[Any]:
    """Assert resume-equals-uninterrupted at every midpoint; returns the reference items."""
    part = r.make()
    try:
        ref = _run(r, part, total)
    finally:
        r.close(part)
    assert len(ref) == total
    mids = sorted(set(int(m) for m in midpoints))
    assert mids and all(0 < m < total for m in mids), f"midpoints {mids} must lie inside (0, {total})"
    if r.epoch_of is not None:
        first = min(min(r.epoch_of(x), default=0) for x in ref)
        later = [m for m in mids if min(r.epoch_of(ref[m - 1]), default=first) > first]
        assert max(max(r.epoch_of(x), default=0) for x in ref) > first, "the reference never reaches the next epoch"
        assert later, "no midpoint lies past the first epoch boundary"
    for m in mids:
        part = r.make()
        try:
            head = _run(r, part, m)
            state = json.loads(json.dumps(r.save(part)))  # plain data, as a checkpoint stores it
            frozen = copy.deepcopy(state)
            tail = _run(r, part, total - m)
        finally:
            r.close(part)
        assert head + tail == ref, f"midpoint {m}: saving changed the run ({_first_difference(head + tail, ref)})"
        for attempt in (1, 2):
            part = r.make()
            try:
                r.load(part, state)
                again = _run(r, part, total - m)
            finally:
                r.close(part)
            assert state == frozen, f"midpoint {m}: loading the state modified it"
            assert again == ref[m:], (f"midpoint {m}, restore {attempt}: resumed run differs from the uninterrupted "
                                      f"one ({_first_difference(again, ref[m:])})")
    return ref
