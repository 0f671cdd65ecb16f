"""Which loader process (host) serves each partition, with a fencing epoch per assignment.

A partition is one Source Loader: a (source, replica) pair. A host is one loader process; it hosts any
number of partitions and can open partitions it was not started with. The planner keeps this table and
moves a partition between hosts at a step boundary (:meth:`PartitionTable.move`) — one mechanism for
failover (a silent primary's partitions go to a live shadow), scaling (an added host adopts partitions,
a host being removed hands them away) and rebalancing.

Every assignment bumps the partition's *epoch*. The loader that serves it carries the epoch in everything
it sends; constructors and the planner drop what an older epoch sends, so a host that was stopped
(SIGSTOP), lost its partitions and then resumed delivers nothing. Pure bookkeeping: no sockets, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from mixplane.errors import MixplaneError
from mixplane.protocol import loader_identity

__all__ = ["Assignment", "HandoffError", "Host", "Move", "PartitionKey", "PartitionTable", "loader_identity",
           "parse_partition"]

PartitionKey = tuple[int, int]  # (source index, replica)
Mode = Literal["primary", "shadow", "dormant"]  # dormant: a shadow no longer wanted (it stops following)


@dataclass
class Assignment:
    """Where one partition is served: its primary host (None until assigned), the epoch of that
    assignment, and the hosts keeping a warm shadow of it."""

    host: str | None = None
    epoch: int = 0
    shadows: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Host:
    """A loader process as it registered: the partitions it was launched with, whether it was launched as a
    shadow (it then never takes a free partition as primary on its own), and the primary host it was launched
    beside (`shadow_of`; a shadow's). A host and the shadows launched beside it are one *group*: each stands by
    for what another of its group serves, whatever its launch list names (a re-partition's new partitions,
    a partition handed to the group's primary)."""

    name: str
    wants: tuple[PartitionKey, ...] = ()
    shadow: bool = False
    shadow_of: str | None = None

    @property
    def group(self) -> str:
        return self.shadow_of or self.name


@dataclass(frozen=True)
class Move:
    """One decided assignment change: `key` goes to `to` (as primary with `epoch`, or as a shadow), or `to` stops
    shadowing it (dormant)."""

    key: PartitionKey
    to: str
    mode: Mode
    epoch: int
    previous: str | None = None  # the primary it replaces (None: the partition was free)


class HandoffError(MixplaneError, ValueError):
    """A handoff that cannot be done; the text says why (unknown partition or host, nothing to do)."""


class PartitionTable:
    def __init__(self, keys: Iterable[PartitionKey], *, shadows_wanted: int = 0):
        self.parts: dict[PartitionKey, Assignment] = {k: Assignment() for k in keys}
        self.hosts: dict[str, Host] = {}
        self.shadows_wanted = shadows_wanted

    # -- queries ------------------------------------------------------------------------------------------
    def __getitem__(self, key: PartitionKey) -> Assignment:
        try:
            return self.parts[key]
        except KeyError:
            raise HandoffError(f"no partition {key}") from None

    def epoch(self, key: PartitionKey) -> int:
        return self[key].epoch

    def hosted_by(self, host: str) -> list[PartitionKey]:
        return sorted(k for k, a in self.parts.items() if a.host == host)

    # -- changes --------------------------------------------------------------------------------------------
    def _assign(self, key: PartitionKey, host: str) -> Move:
        a = self[key]
        previous = a.host
        a.host = host
        a.epoch += 1
        if host in a.shadows:
            a.shadows.remove(host)
        return Move(key, host, "primary", a.epoch, previous)

    def _shadow(self, key: PartitionKey, host: str) -> Move | None:
        a = self[key]
        if host in a.shadows or a.host == host:
            return None
        a.shadows.append(host)
        return Move(key, host, "shadow", a.epoch, a.host)

    def register(self, host: Host, alive: Callable[[str], bool]) -> list[Move]:
        """A host (re)registered: what it opens. A partition it was launched with that is free goes to it
        (unless it is a shadow); one it served before is re-adopted under a new epoch (the process was
        restarted: the old incarnation is fenced); one a live host serves gets it as a shadow; one a
        silent host serves moves to it. Unknown partitions raise HandoffError."""
        for key in host.wants:
            self[key]
        self.hosts[host.name] = host
        moves: list[Move] = []
        for key in host.wants:
            a = self.parts[key]
            if a.host is None:
                m = self._shadow(key, host.name) if host.shadow else self._assign(key, host.name)
            elif a.host == host.name or not alive(a.host):
                m = self._assign(key, host.name)
            elif host.name in a.shadows:  # a restarted shadow: a new process, to be told again what to follow
                m = Move(key, host.name, "shadow", a.epoch, a.host)
            else:
                m = self._shadow(key, host.name)
            if m is not None:
                moves.append(m)
        return moves

    def claim(self, key: PartitionKey, host: str | None, epoch: int | None) -> bool:
        """A loader said HELLO for `key` from `host` with `epoch`: True if it is the partition's current
        server. A loader without a host (started on its own, not by a host) claims a partition no host
        serves, at the current epoch; anything else from an older epoch is stale."""
        a = self[key]
        if host is None:
            return a.host is None and (epoch is None or epoch == a.epoch)
        return a.host == host and (epoch is None or epoch == a.epoch)

    def move(self, key: PartitionKey, to: str) -> Move:
        """Hand `key` to host `to` under a new epoch (HandoffError if either is unknown or it is there)."""
        a = self[key]
        if to not in self.hosts:
            raise HandoffError(f"no loader host {to!r} registered (known: {', '.join(sorted(self.hosts)) or 'none'})")
        if a.host == to:
            raise HandoffError(f"partition {key} is already served by {to!r}")
        return self._assign(key, to)

    def repartition(self, source: int, old: int, hosts: list[str]) -> list[Move]:
        """Source `source` goes from `old` partitions to ``len(hosts)``, partition k served by ``hosts[k]``: the old
        partitions' entries go (with their shadows: they read the old orders); a new partition with the number of an
        old one takes the next epoch (the old server's messages are fenced), the others start at epoch 1. Returns the
        primary moves to carry out (HandoffError for an unknown host: nothing changes)."""
        unknown = sorted({h for h in hosts if h not in self.hosts})
        if unknown:
            raise HandoffError(f"no loader host {', '.join(map(repr, unknown))} registered (known: "
                               f"{', '.join(sorted(self.hosts)) or 'none'})")
        prev = {r: self.parts.pop((source, r)) for r in range(old) if (source, r) in self.parts}
        moves = []
        for k, host in enumerate(hosts):
            before = prev.get(k)
            a = Assignment(host=host, epoch=(before.epoch if before is not None else 0) + 1)
            self.parts[(source, k)] = a
            moves.append(Move((source, k), host, "primary", a.epoch, before.host if before is not None else None))
        return moves

    def failover(self, silent: Callable[[str], bool], fresh: Callable[[str], bool] | None = None) -> list[Move]:
        """Promote a shadow of every partition whose primary host is silent (dead or hung) -- only a shadow
        that is `fresh` (heard from recently: by default, not silent). A partition with no fresh shadow keeps
        its silent primary and waits (:meth:`without_host`): for a shadow that beats again, a restart of the
        primary or another host (:meth:`register`)."""
        moves = []
        quiet: dict[str, bool] = {}  # one liveness look per host, not per partition
        recent: dict[str, bool] = {}

        def is_silent(h: str) -> bool:
            if h not in quiet:
                quiet[h] = silent(h)
            return quiet[h]

        def is_fresh(h: str) -> bool:
            if h not in recent:
                recent[h] = not is_silent(h) and (fresh is None or fresh(h))
            return recent[h]

        for key, a in sorted(self.parts.items()):
            if a.host is None or not a.shadows or not is_silent(a.host):
                continue
            live = [h for h in a.shadows if is_fresh(h)]
            if live:
                moves.append(self._assign(key, live[0]))
        return moves

    def without_host(self, alive: Callable[[str], bool]) -> list[PartitionKey]:
        """Partitions no live host serves: never assigned, or their primary is silent and no shadow took over."""
        seen: dict[str, bool] = {}
        out = []
        for key, a in sorted(self.parts.items()):
            if a.host is not None and a.host not in seen:
                seen[a.host] = alive(a.host)
            if a.host is None or not seen[a.host]:
                out.append(key)
        return out

    def group_of(self, host: str) -> str:
        h = self.hosts.get(host)
        return h.group if h is not None else host

    def wanted_shadows(self, alive: Callable[[str], bool]) -> list[Move]:
        """Give every partition with fewer than `shadows_wanted` live shadows one more, from the live hosts
        launched with it or of the group of its server (:class:`Host`) that neither serve nor shadow it: an old
        primary that came back, a restarted shadow, the shadows launched beside the host of a re-partition's new
        partition. A host of the server's group is preferred: it is offered the partition while fewer than
        `shadows_wanted` of the group shadow it, and once that many do, the shadows of other groups are let go
        (dormant: a partition handed to another pod keeps its old pod's shadow only until the new pod's shadow
        stands by -- placed apart from the new pod, sized for one pod's partitions). Linear in the hosts' launch
        partitions and the partitions times the group sizes (runs every RESHADOW_EVERY_S at any scale)."""
        if self.shadows_wanted <= 0:
            return []
        served: dict[str, list[PartitionKey]] = {}  # group -> the partitions its hosts serve (one pass)
        for key, a in sorted(self.parts.items()):
            if a.host is not None:
                served.setdefault(self.group_of(a.host), []).append(key)
        moves = []
        for h in sorted(self.hosts.values(), key=lambda x: x.name):
            launched = set(h.wants)
            offered = [*h.wants, *(k for k in served.get(h.group, ()) if k not in launched)]
            if not offered or not alive(h.name):
                continue
            for key in offered:
                part = self.parts.get(key)  # a launch partition a re-partition to fewer took away: none
                if part is None or part.host is None or part.host == h.name or h.name in part.shadows:
                    continue
                group = self.group_of(part.host)
                mates = h.group == group  # of the server's group: only the group's own shadows count
                if sum(1 for s in part.shadows if alive(s) and (not mates or self.group_of(s) == group)) \
                        < self.shadows_wanted:
                    m = self._shadow(key, h.name)
                    if m is not None:
                        moves.append(m)
        for key, a in sorted(self.parts.items()):
            if a.host is None or len(a.shadows) < 2:
                continue
            group = self.group_of(a.host)
            if sum(1 for s in a.shadows if alive(s) and self.group_of(s) == group) >= self.shadows_wanted:
                for s in [s for s in a.shadows if self.group_of(s) != group]:
                    a.shadows.remove(s)
                    if alive(s):  # a dead one is only forgotten
                        moves.append(Move(key, s, "dormant", a.epoch, a.host))
        return moves

    def status(self, names: list[str], alive: Callable[[str], bool],
               silent_s: Callable[[str], float | None]) -> dict[str, Any]:
        """The table for STATUS: partitions ("source:replica") and hosts (one pass over the table)."""
        parts: dict[str, Any] = {}
        served: dict[str, list[str]] = {}
        shadowing: dict[str, list[str]] = {}
        for k, a in sorted(self.parts.items()):
            name = f"{names[k[0]]}:{k[1]}"
            parts[name] = {"host": a.host, "epoch": a.epoch, "shadows": list(a.shadows)}
            if a.host is not None:
                served.setdefault(a.host, []).append(name)
            for sh in a.shadows:
                shadowing.setdefault(sh, []).append(name)
        hosts = {}
        for hname, h in sorted(self.hosts.items()):
            quiet = silent_s(hname)
            hosts[hname] = {"partitions": served.get(hname, []), "shadows": shadowing.get(hname, []),
                            "launched_as_shadow": h.shadow, "shadow_of": h.shadow_of, "alive": alive(hname),
                            "silent_s": None if quiet is None else round(quiet, 3)}
        return {"partitions": parts, "hosts": hosts}


def parse_partition(text: str, names: list[str]) -> PartitionKey:
    """'source:replica' (replica defaults to 0) -> (source index, replica); HandoffError naming what is wrong."""
    name, _, rep = str(text).rpartition(":") if ":" in str(text) else (str(text), "", "0")
    if name not in names:
        raise HandoffError(f"unknown source {name!r} in partition {text!r} (sources: {', '.join(names)})")
    try:
        replica = int(rep)
    except ValueError:
        raise HandoffError(f"partition {text!r}: replica {rep!r} is not an integer") from None
    return names.index(name), replica
