"""Which near-duplicates go: a greedy vertex cover of the similarity graph (poolside's Model Factory). Pure.

Similarity edges are not transitive: a component of the LSH graph may hold documents that are not similar to
each other, so keeping one per component loses content. Removing a *vertex cover* (a set of documents that
touches every similarity edge) leaves an independent set: no two kept documents are near-duplicates, and a
component keeps as many as its structure allows. The cover is greedy: take the document with the most remaining
edges -- on ties, the one the metadata prefers to lose (fewer stars first), then the
larger id -- remove its edges, repeat. Metadata can outrank the degree (repository level: a fork goes before
any original, whatever its degree). Deterministic: the same graph gives the same cover in any process.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from typing import Any


def vertex_cover(edges: Iterable[tuple[Hashable, Hashable]],
                 lose_first: Mapping[Hashable, tuple[int, float]] | None = None) -> set[Hashable]:
    """A greedy vertex cover of the undirected graph `edges` (self loops ignored). `lose_first`: per node
    (tier, rank), smaller = rather removed; the tier comes before the degree (forks go before any original),
    the rank after it (among equally connected originals, the one with fewer stars goes). Nodes without one:
    (1, 0.0)."""
    adj: dict[Hashable, set[Hashable]] = defaultdict(set)
    for u, v in edges:
        if u != v:
            adj[u].add(v)
            adj[v].add(u)
    pref = lose_first or {}

    def key(n: Hashable) -> tuple:
        tier, rank = pref.get(n, (1, 0.0))
        return (tier, -len(adj[n]), rank, _neg(n))

    heap = [(key(n), n) for n in adj]
    heapq.heapify(heap)
    cover: set[Hashable] = set()
    while heap:
        k, n = heapq.heappop(heap)
        if n in cover or not adj[n]:
            continue
        if k != key(n):  # its degree dropped since it was pushed: push it again with the current key
            heapq.heappush(heap, (key(n), n))
            continue
        cover.add(n)
        for m in list(adj[n]):
            adj[m].discard(n)
            if adj[m]:
                heapq.heappush(heap, (key(m), m))
        adj[n].clear()
    return cover


class _Neg:
    """Reverses the order of a value inside a sort key (larger ids first)."""

    __slots__ = ("v",)

    def __init__(self, v: Any) -> None:
        self.v = v

    def __lt__(self, other: "_Neg") -> bool:
        return _cmp(other.v, self.v)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Neg) and self.v == other.v

    def __hash__(self) -> int:
        return hash(self.v)


def _cmp(a: Any, b: Any) -> bool:
    try:
        return bool(a < b)
    except TypeError:
        return str(a) < str(b)


def _neg(n: Hashable) -> _Neg:
    return _Neg(n)


def is_vertex_cover(edges: Iterable[tuple[Hashable, Hashable]], cover: set[Hashable]) -> bool:
    return all(u == v or u in cover or v in cover for u, v in edges)
