"""What a restarted planner recovers from its journal. Pure, no I/O.

A planner killed mid-run leaves its journal behind: the session it served, every step it planned (with
the digest of its layout), checkpoints of its cursor and the runtime mixture updates it applied. A new
planner on the same journal continues that session instead of starting over:

* :func:`read_state` finds the session, its start cursor, the last step planned (``planned_through``),
  the anchors (records with a cursor) of the session and the digests of its steps;
* once every constructor said which steps it holds complete, :meth:`RecoveryState.anchor` picks the
  newest anchor at or before the first step some constructor may still miss; the planner restores its
  cursor and plans again from there — a step's plan is a pure function of the cursor and of the
  loaders' announcements, which the loaders repeat after seeking to the anchor's window cursors — so
  every re-planned step is the one planned before (checked against the journaled digest);
* ``listings``: the static sources' listings pinned for the run (journal ``listing`` records, and the
  cursors that name listings, which replace them: ``planner.journal.pinned_listings``, what a replay
  reads them with too), pinned again by the restarted planner;
* :meth:`RecoveryState.updates_after` lists the journaled mixture updates the anchor's cursor does not
  contain yet, each with the step before which it was applied the first time; ``history`` holds every update
  of the journal (any session), so their update ids stay acknowledged (an update sent again after a restart
  is a duplicate) and a later rewind keeps the ones newer than its cursor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mixplane.planner.journal import ANCHORS, JournalError, pinned_listings
from mixplane.protocol import ListingPin


@dataclass
class Anchor:
    step: int
    cursor: dict[str, Any]
    event: str
    index: int  # position in the journal (newer anchors of the same step win)


@dataclass
class RecoveryState:
    """A running session as the journal records it."""

    session: int
    session_start: dict[str, Any]  # the cursor the session started from (open / resume record)
    initial_cursor: dict[str, Any]  # the cursor of the journal's first open record
    planned_through: int  # last step planned in the session (-1: none)
    anchors: list[Anchor] = field(default_factory=list)
    digests: dict[int, str] = field(default_factory=dict)  # step -> digest of its newest record
    updates: list[dict[str, Any]] = field(default_factory=list)  # mixture updates of the session, one per generation
    history: list[dict[str, Any]] = field(default_factory=list)  # every update of the journal (any session), newest record per generation
    listings: dict[int, ListingPin] = field(default_factory=dict)  # source -> the listing pinned for the run

    def anchor(self, first_needed: int) -> Anchor:
        """The newest anchor at or before `first_needed` (the first step some constructor may miss)."""
        ok = [a for a in self.anchors if a.step <= max(first_needed, 0)]
        if not ok:
            raise JournalError(f"no cursor of session {self.session} at or before step {first_needed}")
        return max(ok, key=lambda a: (a.step, a.index))

    def updates_after(self, cursor_generation: int) -> list[tuple[int, dict[str, Any]]]:
        """(apply before planning this step, update record) of every update newer than the cursor's schedule
        (generations only grow), in the order they were applied."""
        return [(int(u.get("planned_through", -1)) + 1, u) for u in self.updates
                if int(u["generation"]) > cursor_generation]


def same_mixture(open_record: dict[str, Any], spec: Any) -> bool:
    """Whether a journal was written for this mixture (name, seed, sources, world): a restarted planner
    recovers only its own run, never another mixture that reused the run directory."""
    js = open_record.get("spec") or {}
    try:
        return (js.get("name") == spec.name and int(open_record.get("seed", -1)) == int(spec.mixture.seed)
                and [s.get("name") for s in js.get("sources", [])] == spec.source_names())
    except (AttributeError, TypeError, ValueError):
        return False


def read_state(records: list[dict[str, Any]]) -> RecoveryState | None:
    """The session a journal's last records belong to; None when there is nothing to recover (no open record)."""
    opens = [r for r in records if r.get("event") == "open"]
    if not opens:
        return None
    initial = opens[0]["cursor"]
    # the session in force: the last record that started one (open, resume); recover records continue it
    start_i = max(i for i, r in enumerate(records) if r.get("event") in ("open", "resume"))
    start = records[start_i]
    session = int(start.get("session", 0))
    st = RecoveryState(session, start["cursor"], initial, int(start["step"]) - 1)
    newest: dict[int, dict[str, Any]] = {}
    for r in records:  # the ids of every update applied stay acknowledged across restarts and sessions
        if r.get("event") == "update":
            newest.pop(int(r["generation"]), None)
            newest[int(r["generation"])] = r
    st.history = list(newest.values())
    # pins outlive a session; a cursor that names some replaces them (JournalError: the journal is not read)
    st.listings = pinned_listings(records)
    seen_gen: set[int] = set()
    for i in range(start_i, len(records)):
        r = records[i]
        ev = r.get("event")
        if int(r.get("session", session)) != session:
            continue
        if ev in ANCHORS and "cursor" in r:
            st.anchors.append(Anchor(int(r["step"]), r["cursor"], str(ev), i))
            if ev == "recover":  # its predecessor had planned this far (a crash may come before re-planning it)
                st.planned_through = max(st.planned_through, int(r.get("planned_through", -1)))
        elif ev == "step":
            s = int(r["step"])
            st.planned_through = max(st.planned_through, s)
            if "digest" in r:
                st.digests[s] = str(r["digest"])
        elif ev == "update":
            g = int(r["generation"])
            if g not in seen_gen:  # a recovered planner journals the updates it applies again
                seen_gen.add(g)
                st.updates.append(r)
    return st


def cursor_generation(cursor: dict[str, Any]) -> int:
    """The newest mixture generation a cursor's schedule holds (0: the spec as written)."""
    try:
        segs = cursor["schedule"]["segments"]
        return max((int(s.get("generation", 0)) for s in segs), default=0)
    except (KeyError, TypeError, AttributeError, ValueError):
        return 0


@dataclass
class LayoutRecord:
    """The PLAN_CONSTRUCTOR messages of recent steps (meta and the encoded frames), per constructor, until
    every constructor released the step (handed it to all its ranks): what a restarted constructor gets again. Bounded like
    planner.inflight; beyond `max_steps` the oldest step is forgotten (counted in `overflowed`)."""

    max_steps: int
    steps: list[tuple[int, dict[int, tuple[dict[str, Any], list]]]] = field(default_factory=list)
    overflowed: int = 0

    def record(self, step: int, per_constructor: dict[int, tuple[dict[str, Any], list]]) -> None:
        if self.steps and step <= self.steps[-1][0]:
            # re-planned after a recovery: the newer message replaces the older ones from this step on
            self.steps = [(s, p) for s, p in self.steps if s < step]
        self.steps.append((step, per_constructor))
        if len(self.steps) > self.max_steps:
            drop = len(self.steps) - self.max_steps
            self.overflowed += drop
            del self.steps[:drop]

    def release(self, through: int) -> None:
        """Every constructor handed every step up to `through` to all its ranks."""
        keep = [(s, p) for s, p in self.steps if s > through]
        self.steps = keep

    def clear(self) -> None:
        self.steps.clear()

    def for_constructor(self, index: int) -> list[tuple[int, tuple[dict[str, Any], list]]]:
        return [(s, p[index]) for s, p in self.steps if index in p]

    @property
    def first_step(self) -> int | None:
        return self.steps[0][0] if self.steps else None
