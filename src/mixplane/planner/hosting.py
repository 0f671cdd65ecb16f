"""The planner's side of partition handoff: loader hosts, ADOPT / RELEASE / FENCE / FOLLOW,
shadow promotion and the HANDOFF control request. Owned by :class:`~mixplane.planner.server.PlannerServer`
(``server.hosting``), which it reaches only through :class:`HostingServer`: what it reads of the server and how it
sends is that interface, so the server's other concerns (recovery, resharding, scaling) are edited elsewhere.

A handoff happens between two planned steps: the partition leaves ``loaders`` (planning waits for it),
the old server is told to RELEASE it, constructors are FENCEd to drop its older epochs, and the new host
is told to ADOPT it; the new server's HELLO is then welcomed like a restarted loader's — it re-reads from
the lowest position of the steps planned but not complete everywhere, resends exactly their spans and
continues from the planner's cursor (planner.inflight), so nothing is lost, repeated or reordered.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from mixplane import protocol
from mixplane.component import Membership, peer_name
from mixplane.metrics import HandoffMetrics
from mixplane.planner.inflight import InFlight
from mixplane.planner.partitions import HandoffError, Host, Move, PartitionKey, PartitionTable, parse_partition
from mixplane.wire import Kind, Message, WireError

if TYPE_CHECKING:
    from mixplane.planner.core import StepPlanner
    from mixplane.spec import DataMixtureSpec

log = logging.getLogger("mixplane.planner")
LOOP_STALL_FACTOR = 10.0  # a host whose poll loop has not turned for this many failover intervals is hung
LOOP_STALL_MIN_S = 10.0
FAILOVER_CHECK_S = 0.05  # how often silent primaries are looked for (the detection itself is failover_after_s)
RETIRED_KEEP_S = 300.0  # old servers of moved partitions are remembered (and told to release) this long
FOLLOW_EVERY_S = 0.2  # shadows learn where their primary stands at most this often
RESHADOW_EVERY_S = 0.5  # how often partitions short of shadows look for a host to keep one
FRESH_BEATS = 2  # a shadow is promoted only if heard from within this many of its beats (failover_after_s / 4 each)
DEAF_GAP_BEATS = 1  # a planner loop turn longer than this many host beats is time the planner did not listen


class HostingServer(Protocol):
    """What partition hosting needs of the planner server that owns it. Read through the server each time, never
    copied: the server replaces its spec, constructors and session on a reshard or a restart."""

    spec: DataMixtureSpec
    core: StepPlanner
    names: list[str]
    loaders: dict[PartitionKey, bytes]  # partition -> the identity of the loader that serves it now
    constructors: dict[int, Any]  # constructor index -> its peer (``.identity``)
    pending_loader_welcome: set[PartitionKey]
    inflight: InFlight
    members: Membership
    session: int
    incarnation: str  # the planner process (recovery): a host welcomed by another one registers again
    hm: HandoffMetrics

    @property
    def planned_through(self) -> int: ...

    def send(self, identity: bytes, kind: Kind, meta: dict[str, Any] | None = None) -> bool:
        """Send without blocking; an undeliverable message is logged and counted, never fatal."""
        ...

    def send_quietly(self, identity: bytes, kind: Kind, meta: dict[str, Any]) -> None:
        """Send without blocking and without a log line when it cannot go (a peer that is known to be gone)."""
        ...


class PartitionHosting:
    """Partition table, loader hosts and handoffs of one planner (its :class:`HostingServer`)."""

    def __init__(self, server: HostingServer) -> None:
        self.server = server
        # the re-partitions the partition table and the loader hosts follow (source -> records), kept here because
        # ADOPT carries them; written by planner.repartitioning after a change, or from the journal after a restart
        self.table_records: dict[int, list[dict[str, Any]]] = {}
        runtime = server.spec.runtime
        keys = [(w.source, w.replica) for w in server.core.windows]
        self.partitions = PartitionTable(keys, shadows_wanted=int(runtime.shadow_loaders))
        self.host_ids: dict[str, bytes] = {}
        self.host_incarnations: dict[str, str] = {}  # host -> the process that registered under that name last
        self.host_loop_s: dict[str, float] = {}  # host -> age of its poll loop's last turn, from its beats
        self.failover_after_s = float(runtime.failover_after_s)
        self.retired_loaders: dict[bytes, tuple[PartitionKey, int, float]] = {}  # old identity -> key, epoch, last RELEASE
        self.handoff_started: dict[PartitionKey, tuple[float, str]] = {}  # partition moving -> (since, reason)
        self.handoff_log: list[dict[str, Any]] = []  # the last handoffs, for STATUS (bounded)
        self._followed: dict[tuple[PartitionKey, str], int] = {}
        self._next_follow = 0.0
        self._next_reshadow = 0.0
        self._next_failover = 0.0
        # when the planner's own loop did not turn (a long plan, a re-plan after a restart, no CPU): a host is
        # failed over for the beats *it* missed, not for the ones the planner was too busy to read
        self._deaf: deque[tuple[float, float]] = deque(maxlen=64)
        self._last_turn: float | None = None
        self._hostless: set[PartitionKey] = set()
        self._hosting_started = False

    def release(self, identity: bytes, key: PartitionKey, epoch: int) -> None:
        """RELEASE to a partition's old server; quiet: a dead one cannot take it, and that is why it moved."""
        self.server.send_quietly(identity, Kind.RELEASE, {"source": key[0], "replica": key[1], "epoch": epoch})

    # -- state --------------------------------------------------------------------------------------------
    def partitioning_meta(self, key: PartitionKey) -> dict[str, Any]:
        """What ADOPT carries for a partition of a re-partitioned source: the source's re-partition records, from
        which the host builds the partition's read order (mixplane.repartition); nothing for the others."""
        recs = self.table_records.get(key[0])
        return {"partitioning": recs} if recs else {}

    def partition_name(self, key: PartitionKey) -> str:
        return f"{self.server.names[key[0]]}:{key[1]}"

    def host_silent_s(self, host: str) -> float | None:
        """Seconds since the host was last heard from (its beat thread, or its loop's socket)."""
        times = [t for t in (self.server.members.silent_for(protocol.beat_identity(host)),
                             self.server.members.silent_for(protocol.host_identity(host))) if t is not None]
        return min(times) if times else None

    def host_missed_s(self, host: str) -> float | None:
        """How long the host has been silent while the planner listened: its silence less the stretches in
        which the planner's own loop did not turn (its beats may be waiting unread, not missing)."""
        quiet = self.host_silent_s(host)
        if quiet is None or not self._deaf:
            return quiet
        now = time.monotonic()
        since = now - quiet
        deaf = sum(max(0.0, min(b, now) - max(a, since)) for a, b in self._deaf if b > since)
        return max(0.0, quiet - deaf)

    def host_alive(self, host: str) -> bool:
        """Heard from within runtime.failover_after_s of the planner listening (dead or SIGSTOPped processes fall
        silent at once), and its poll loop turned within LOOP_STALL_FACTOR times that (a loop stuck in one call is
        hung too; the host counts its loop from its readiness, planner.hosting's beats)."""
        quiet = self.host_missed_s(host)
        if host not in self.host_ids or quiet is None or quiet > self.failover_after_s:
            return False
        return self.host_loop_s.get(host, 0.0) <= max(LOOP_STALL_MIN_S, LOOP_STALL_FACTOR * self.failover_after_s)

    def host_fresh(self, host: str) -> bool:
        """Alive and heard from within FRESH_BEATS of its beats: what a shadow must be to be promoted (a shadow
        that died a moment after its primary is still 'alive' when the primary's silence crosses the window)."""
        quiet = self.host_missed_s(host)
        return (self.host_alive(host) and quiet is not None
                and quiet <= FRESH_BEATS * self.failover_after_s / 4)

    def on_host_beat(self, msg: Message) -> None:
        host, age = msg.meta.get("host"), msg.meta.get("loop_s")
        if isinstance(host, str) and isinstance(age, (int, float)) and host in self.host_ids:
            self.host_loop_s[host] = float(age)

    def hosting_status(self) -> dict[str, Any]:
        st = self.partitions.status(self.server.names, self.host_alive, self.host_silent_s)
        st["handoffs"] = self.handoff_log[-20:]
        # partitions no live host serves (their steps wait): STATUS and mixplane_partitions_without_host
        st["without_host"] = [self.partition_name(k) for k in self.hostless()]
        return st

    # -- messages -----------------------------------------------------------------------------------------
    def on_host_hello(self, identity: bytes, msg: Message) -> None:
        name = msg.get("host", str)
        wants_in = msg.meta.get("partitions", [])
        if not isinstance(wants_in, list):
            raise WireError("HELLO (host): field 'partitions' must be a list of [source, replica]")
        wants: list[PartitionKey] = []
        for p in wants_in:
            if not (isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)):
                raise WireError("HELLO (host): field 'partitions' must be a list of [source, replica]")
            wants.append((int(p[0]), int(p[1])))
        if self.table_records:  # re-partitioned sources: what the table gives this host, not its launch list
            moved = set(self.table_records)
            serving = msg.meta.get("serving", [])  # after a planner restart: what it served (planner.repartitioning)
            had = {(int(p[0]), int(p[1])) for p in serving if isinstance(p, list) and len(p) == 2
                   and all(isinstance(x, int) and not isinstance(x, bool) for x in p)} if isinstance(serving, list) else set()
            wants = [k for k in wants if k[0] not in moved] + \
                [k for k, a in sorted(self.partitions.parts.items()) if k[0] in moved
                 and (a.host == name or (a.host is None and k in had))]
        shadow = bool(msg.meta.get("shadow", False))
        shadow_of = msg.meta.get("shadow_of")  # the primary host it was launched beside: it stands by for what that serves
        if shadow_of is not None and not (isinstance(shadow_of, str) and shadow_of):
            raise WireError("HELLO (host): field 'shadow_of' must be a loader host's name")
        inc = msg.meta.get("incarnation")
        if isinstance(inc, str) and self.host_incarnations.get(name) == inc and self.host_ids.get(name) == identity:
            # the same process's HELLO again (queued while the planner was unreachable and delivered in a burst,
            # or a retry whose WELCOME crossed it): it is registered; registering it again would hand its
            # partitions over to itself under new epochs, once per queued HELLO
            self.server.send(identity, Kind.WELCOME, {"session": self.server.session, "incarnation": self.server.incarnation})
            return
        if isinstance(inc, str):
            self.host_incarnations[name] = inc
        if name in self.host_ids and self.host_ids[name] != identity:
            log.warning("loader host %s registered again (restart?)", name)
        self.host_ids[name] = identity
        try:
            moves = self.partitions.register(Host(name, tuple(wants), shadow, shadow_of), self.host_alive)
        except HandoffError as e:
            self.server.send(identity, Kind.ERROR, {"error": f"host {name}: {e}"})
            return
        self.server.send(identity, Kind.WELCOME, {"session": self.server.session, "incarnation": self.server.incarnation})
        for m in moves:
            self.apply_move(m, "restart" if m.previous == name else ("failover" if m.previous else "start"))

    def loader_claim(self, identity: bytes, key: PartitionKey, msg: Message) -> bool:
        """A loader's HELLO: True if it serves `key` now; a stale one (an older epoch) is RELEASEd and counted."""
        host = msg.meta.get("host")
        epoch = msg.meta.get("epoch")
        ok = self.partitions.claim(key, host if isinstance(host, str) else None,
                                   epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else None)
        if not ok:
            self.fenced(identity, key, "HELLO", epoch if isinstance(epoch, int) else 0)
        else:
            self.retired_loaders.pop(identity, None)
        return ok

    def stale_loader_meta(self, identity: bytes, key: PartitionKey, msg: Message) -> bool:
        """LOADER_META of a partition's older epoch (its old host, resumed): dropped and counted."""
        epoch = msg.meta.get("epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch < self.partitions.epoch(key):
            self.fenced(identity, key, "LOADER_META", epoch)
            return True
        if identity in self.retired_loaders:
            self.fenced(identity, key, "LOADER_META", self.retired_loaders[identity][1])
            return True
        return False

    def fenced(self, identity: bytes, key: PartitionKey, kind: str, epoch: int) -> None:
        self.server.hm.fenced.labels(kind).inc()
        now = time.monotonic()
        _, _, last = self.retired_loaders.get(identity, (key, epoch, 0.0))
        if now - last > 1.0:  # tell it (again) that it lost the partition; at most once a second
            log.warning("%s from %s: partition %s is at epoch %d, this is epoch %d: dropped, told to release",
                        kind, peer_name(identity), self.partition_name(key), self.partitions.epoch(key), epoch)
            self.release(identity, key, epoch)
        self.retired_loaders[identity] = (key, epoch, now)

    def on_handoff(self, identity: bytes, msg: Message) -> None:
        try:
            result = self.handoff(msg.get("partition", str), msg.get("to", str))
        except HandoffError as e:
            self.server.send(identity, Kind.ERROR, {"error": f"handoff: {e}"})
            return
        self.server.send(identity, Kind.ACK, result)

    # -- the mechanism ------------------------------------------------------------------------------------
    def handoff(self, partition: str | PartitionKey, to: str, reason: str = "request") -> dict[str, Any]:
        """Move a partition to loader host `to` at the next step boundary (the Python API of HANDOFF)."""
        key = parse_partition(partition, self.server.names) if isinstance(partition, str) else partition
        if not self.host_alive(to):
            quiet = self.host_silent_s(to)
            raise HandoffError(f"loader host {to!r} is not alive (" + (
                "never registered" if to not in self.host_ids else f"silent for {quiet:.1f} s") + ")")
        move = self.partitions.move(key, to)
        self.apply_move(move, reason)
        return {"partition": self.partition_name(key), "from": move.previous, "to": to, "epoch": move.epoch,
                "after_step": self.server.planned_through}

    def apply_move(self, m: Move, reason: str) -> None:
        """Carry out a decided change of the partition table on the wire."""
        key = m.key
        host = self.host_ids.get(m.to)
        if m.mode == "dormant":  # a shadow let go (planner.partitions.wanted_shadows): it stops following
            self._followed.pop((key, m.to), None)
            if host is not None:
                self.server.send(host, Kind.ADOPT, {"source": key[0], "replica": key[1], "epoch": m.epoch, "mode": "dormant"})
            return
        if m.mode == "shadow":
            if host is not None:
                self.server.send(host, Kind.ADOPT, {"source": key[0], "replica": key[1], "epoch": m.epoch, "mode": "shadow",
                                              "cursor": self.follow_cursor(key), **self.partitioning_meta(key)})
                self._followed.pop((key, m.to), None)
            return
        old = self.server.loaders.pop(key, None)
        self.server.pending_loader_welcome.discard(key)
        if old is not None:
            self.retired_loaders[old] = (key, m.epoch - 1, time.monotonic())
            self.release(old, key, m.epoch - 1)
        if m.previous is not None:
            for c in self.server.constructors.values():  # their SAMPLES of older epochs are dropped from now on
                self.server.send(c.identity, Kind.FENCE, {"source": key[0], "replica": key[1], "epoch": m.epoch})
            self.server.hm.handoffs.labels(reason).inc()
            log.warning("partition %s: %s -> %s (epoch %d, %s) after step %d", self.partition_name(key), m.previous,
                        m.to, m.epoch, reason, self.server.planned_through)
            self.handoff_started[key] = (time.monotonic(), reason)
            self.handoff_log.append({"partition": self.partition_name(key), "from": m.previous, "to": m.to,
                                     "epoch": m.epoch, "reason": reason, "after_step": self.server.planned_through,
                                     "t": time.time()})
            del self.handoff_log[:-100]
        if host is not None:
            self.server.send(host, Kind.ADOPT, {"source": key[0], "replica": key[1], "epoch": m.epoch, "mode": "primary",
                                          **self.partitioning_meta(key)})

    def fence_constructor(self, identity: bytes) -> None:
        """A constructor (re)registered: tell it the epoch of every partition that moved."""
        for key, a in sorted(self.partitions.parts.items()):
            if a.epoch > 1:
                self.server.send(identity, Kind.FENCE, {"source": key[0], "replica": key[1], "epoch": a.epoch})

    def adopted(self, key: PartitionKey) -> None:
        """The new server of a moved partition said HELLO: the handoff is done once it is welcomed."""
        started = self.handoff_started.pop(key, None)
        if started is not None:
            log.warning("partition %s: adopted %.3f s after the %s handoff began", self.partition_name(key),
                        time.monotonic() - started[0], started[1])

    def follow_cursor(self, key: PartitionKey) -> dict[str, Any]:
        """Where a shadow keeps its window: from the lowest position a promotion would re-read."""
        replay = self.server.inflight.for_loader(key)
        cur = self.server.core.window(*key).cursor()
        low = int(cur["low"])
        if replay:
            low = min(low, InFlight.low_position(replay))
        return {"low": low, "next": low, **({"listing": cur["listing"]} if "listing" in cur else {})}  # live: its listing

    def hosting_tick(self, now: float) -> None:
        """Promote shadows of silent primaries, find shadows for partitions short of them, and tell shadows
        where their primaries stand."""
        if self._last_turn is not None and now - self._last_turn > DEAF_GAP_BEATS * self.failover_after_s / 4:
            self._deaf.append((self._last_turn, now))  # the loop did not turn: nothing was read meanwhile
        self._last_turn = now
        if now < self._next_failover:  # the planner loop turns often: look at most every FAILOVER_CHECK_S
            return
        self._next_failover = now + FAILOVER_CHECK_S

        def silent(h: str) -> bool:
            return not self.host_alive(h)

        for m in self.partitions.failover(silent, self.host_fresh):
            quiet = self.host_silent_s(m.previous or "")
            log.warning("loader host %s silent for %s s: promoting shadow %s for partition %s", m.previous,
                        "?" if quiet is None else f"{quiet:.2f}", m.to, self.partition_name(m.key))
            self.apply_move(m, "failover")
        if now >= self._next_reshadow:
            self._next_reshadow = now + RESHADOW_EVERY_S
            self._note_hostless()
            for old in [i for i, (_, _, t) in self.retired_loaders.items() if now - t > RETIRED_KEEP_S]:
                del self.retired_loaders[old]  # bounded: an old server silent this long is gone
            for m in self.partitions.wanted_shadows(self.host_alive):
                self.apply_move(m, "shadow")
        if now >= self._next_follow:
            self._next_follow = now + FOLLOW_EVERY_S
            for key, a in self.partitions.parts.items():
                if not a.shadows or key not in self.server.loaders:
                    continue
                cur = self.follow_cursor(key)
                for h in a.shadows:
                    ident = self.host_ids.get(h)
                    if ident is not None and self._followed.get((key, h)) != cur["low"]:
                        self._followed[(key, h)] = cur["low"]
                        self.server.send(ident, Kind.FOLLOW, {"source": key[0], "replica": key[1], "cursor": cur})

    def _note_hostless(self) -> None:
        """Partitions that lost their host with no live shadow to take over: logged once, counted in the gauge;
        their steps wait for a restart of the host or another one (register)."""
        now = set(self.hostless())
        if not self._hosting_started:  # before every partition was served once it is start-up, not a loss
            self._hosting_started = not now
            return
        for key in sorted(now - self._hostless):
            a = self.partitions.parts[key]
            quiet = self.host_silent_s(a.host) if a.host else None
            log.warning("partition %s is without a host: %s, no live shadow (%s); its steps wait for a restart of "
                        "the host or another host", self.partition_name(key),
                        "never assigned" if a.host is None else f"host {a.host} silent for "
                        + ("?" if quiet is None else f"{quiet:.2f} s"),
                        ", ".join(f"{h} silent for {q:.2f} s" if (q := self.host_silent_s(h)) is not None else h
                                  for h in a.shadows) or "none")
        for key in sorted(self._hostless - now):
            a = self.partitions.parts[key]
            log.warning("partition %s has a host again: %s", self.partition_name(key), a.host)
        self._hostless = now
        self.server.hm.without_host.set(len(now))

    def hostless(self) -> list[PartitionKey]:
        """Partitions no live host serves (a loader started without a host, outside the table, counts as one)."""
        return [k for k in self.partitions.without_host(self.host_alive)
                if not (self.partitions.parts[k].host is None and k in self.server.loaders)]

    def hosts_watched(self) -> dict[str, str]:
        """Peer names of the hosts' beat threads, for the planner's silence report (STATUS `silent`)."""
        return {protocol.beat_identity(h): "loader host" for h in self.host_ids}
