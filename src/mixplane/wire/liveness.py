"""Application-level liveness of peers: who was heard from recently, and when to beat."""

from __future__ import annotations

import time


class Liveness:
    """Application-level liveness of peers: who was heard from recently (any message counts)."""

    def __init__(self, interval_s: float, misses: int = 3, clock=time.monotonic):
        self.interval_s = interval_s
        self.misses = misses
        self.clock = clock
        self.last: dict[bytes, float] = {}
        self._next_beat = 0.0

    def seen(self, peer: bytes) -> None:
        self.last[peer] = self.clock()

    def forget(self, peer: bytes) -> None:
        self.last.pop(peer, None)

    def expired(self) -> list[bytes]:
        """Peers silent for longer than misses * interval (removed from the table)."""
        limit = self.clock() - self.misses * self.interval_s
        dead = [p for p, t in self.last.items() if t < limit]
        for p in dead:
            del self.last[p]
        return dead

    def due(self) -> bool:
        """True once per interval: time to send our own HEARTBEAT."""
        now = self.clock()
        if now >= self._next_beat:
            self._next_beat = now + self.interval_s
            return True
        return False
