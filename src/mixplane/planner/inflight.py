"""Plans a loader may have to send again after a restart of that loader.

A loader's spans of a planned step live only in its memory (and its outbox) until every constructor
holds them; a loader killed in between takes them along. The planner keeps, per loader replica, the
PLAN_LOADER instructions of every step some constructor may still need, and forgets a step once every
constructor released it (``released_through`` of NEED_STEPS) — not merely completed it: a constructor
restarted after a step completed rebuilds it from the loaders, and a loader restarted at the same time
has lost the frames it kept, so only this record can rebuild its spans. A restarted
loader re-reads its stream from the lowest position these steps name and sends exactly their spans
again; constructors drop a (step, loader) message they already hold. Pure bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from mixplane.planner.routing import Instructions

LoaderKey = tuple[int, int]  # (source, replica)


@dataclass
class InFlight:
    """Instructions of the steps not yet complete at every constructor, oldest first, bounded."""

    max_steps: int
    steps: deque[tuple[int, Mapping[LoaderKey, Instructions]]] = field(default_factory=deque)
    overflowed: int = 0  # steps forgotten before every constructor confirmed them (a restart then loses them)
    # loader -> the first step whose instructions are its (a re-partitioned source's partition: earlier steps were
    # another partition's of the same number, which read another order)
    since: dict[LoaderKey, int] = field(default_factory=dict)

    def record(self, step: int, per_loader: Mapping[LoaderKey, Instructions]) -> None:
        if self.steps and step <= self.steps[-1][0]:
            raise ValueError(f"step {step} recorded after step {self.steps[-1][0]}")
        self.steps.append((step, per_loader))
        while len(self.steps) > self.max_steps:
            self.steps.popleft()
            self.overflowed += 1

    def release(self, through: int) -> None:
        """Every constructor holds every span of the steps up to `through`: no loader resends them."""
        while self.steps and self.steps[0][0] <= through:
            self.steps.popleft()

    def clear(self) -> None:
        self.steps.clear()
        self.since.clear()

    def for_loader(self, key: LoaderKey) -> list[tuple[int, Instructions]]:
        """(step, instructions) this loader replica must send again after a restart, in plan order."""
        first = self.since.get(key, 0)
        return [(s, per[key]) for s, per in self.steps if s >= first and key in per and len(per[key].pos)]

    @staticmethod
    def low_position(replay: list[tuple[int, Instructions]]) -> int:
        """The stream position a restarted loader re-reads from: the lowest one these steps name."""
        return min(int(ins.pos.min()) for _, ins in replay)
