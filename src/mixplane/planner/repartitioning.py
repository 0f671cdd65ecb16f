"""The planner's side of re-partitioning a running source (REPARTITION; the rule: mixplane.repartition).

Owned by :class:`~mixplane.planner.server.PlannerServer` (``server.repartitioning``). A request names a source, the new number of partitions
and optionally the step (default: the first one not planned) and the hosts of the new partitions. The planner
plans up to that step and holds there until every step before it is complete at every constructor (the old
partitions' servers have delivered everything planned for them); then, between two steps:

* `StepPlanner.repartition` turns the old windows' cursors into the journaled record and gives the source fresh
  windows (cursor 0);
* the old partitions' servers are told to RELEASE; the partition table gives partition k to its host under the
  next epoch of its number (constructors FENCE older epochs: nothing of the old order can be mixed in);
* each host is told to ADOPT its new partition, with the source's records (`partitioning`): it opens the stream
  with the partition's layout and says HELLO; the planner welcomes it at position 0 and planning goes on.

The trainers see a stall only if their prefetch runs out while the new partitions open and fill their windows.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

from mixplane.planner.partitions import Assignment, HandoffError, PartitionKey
from mixplane.repartition import MAX_PARTITIONS, RepartitionError, parse_partitioning
from mixplane.wire import Kind, Message

if TYPE_CHECKING:
    from mixplane.planner.core import StepPlanner
    from mixplane.planner.inflight import InFlight
    from mixplane.planner.partitions import Move, PartitionTable
    from mixplane.spec import DataMixtureSpec

log = logging.getLogger("mixplane.planner")
REPARTITIONS_KEPT = 32  # re-partitions listed in STATUS


class RepartitionServer(Protocol):
    """What re-partitioning needs of the planner server that owns it (read through the server each time: it
    replaces its spec and constructors on a reshard)."""

    spec: DataMixtureSpec
    core: StepPlanner
    names: list[str]
    loaders: dict[PartitionKey, bytes]
    constructors: dict[int, Any]  # constructor index -> its peer (``.identity``)
    complete_by: dict[bytes, int]  # constructor identity -> every step up to it complete there
    pending_loader_welcome: set[PartitionKey]
    inflight: InFlight
    journal: Any  # planner.journal.Journal, or None without a run directory
    recovering: Any  # the session being recovered after a restart, or None

    @property
    def planned_through(self) -> int: ...

    def send(self, identity: bytes, kind: Kind, meta: dict[str, Any] | None = None) -> bool: ...

    def windows_changed(self) -> None:
        """A source's windows were replaced: what is kept per window (metrics labels) is built again."""
        ...


class RepartitionHosting(Protocol):
    """What re-partitioning needs of partition hosting (planner.hosting): the table it changes, the hosts it
    assigns and how a move goes out on the wire."""

    partitions: PartitionTable
    host_ids: dict[str, bytes]
    retired_loaders: dict[bytes, tuple[PartitionKey, int, float]]
    table_records: dict[int, list[dict[str, Any]]]

    def host_alive(self, host: str) -> bool: ...

    def apply_move(self, m: Move, reason: str) -> None: ...

    def release(self, identity: bytes, key: PartitionKey, epoch: int) -> None: ...


class PlannerRepartition:
    """Pending and applied re-partitions of one planner (its :class:`RepartitionServer`), carried out through its
    partition hosting (:class:`RepartitionHosting`)."""

    def __init__(self, server: RepartitionServer, hosting: RepartitionHosting) -> None:
        self.server = server
        self.hosting = hosting
        self.pending_repartitions: dict[int, dict[str, Any]] = {}  # source -> the request waiting for its step
        self.repartition_log: list[dict[str, Any]] = []  # accepted and applied, for STATUS (bounded)

    # -- the request -------------------------------------------------------------------------------------------
    def on_repartition(self, identity: bytes, msg: Message) -> None:
        try:
            ack = self.request_repartition(msg.meta)
        except (RepartitionError, HandoffError, ValueError, TypeError) as e:
            self.server.send(identity, Kind.ERROR, {"error": f"repartition rejected: {e}"})
            return
        self.server.send(identity, Kind.ACK, ack)

    def request_repartition(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Check a REPARTITION request and keep it until its step (RepartitionError naming the field). A request
        with a `repartition_id` the planner accepted before (pending or applied, among the last REPARTITIONS_KEPT)
        is answered with that acceptance and `duplicate: true`, and nothing changes: a sender that died between
        sending and reading the ACK (the operator) repeats it harmlessly; STATUS `repartitions` lists the id."""
        rid = meta.get("repartition_id")
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise RepartitionError(f"repartition_id: must be non-empty text, not {rid!r}")
        if rid is not None:
            done = next((r for r in self.repartition_log if r.get("repartition_id") == rid), None)
            if done is not None:  # a repeat (the sender died before it read the ACK): the same answer, applied once
                return {**{k: done[k] for k in ("source", "from", "partitions", "step")}, "duplicate": True}
        name = meta.get("source")
        if name not in self.server.names:
            raise RepartitionError(f"source: no source {name!r} (the mixture has {', '.join(self.server.names)})")
        si = self.server.names.index(name)
        src = self.server.spec.sources[si]
        if src.live:
            raise RepartitionError(f"source {name!r}: a live source is read by one partition; it cannot be "
                                   "re-partitioned")
        m = meta.get("partitions")
        if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= MAX_PARTITIONS:
            raise RepartitionError(f"partitions: must be an integer in [1, {MAX_PARTITIONS}], not {m!r}")
        old = self.server.core.partitions(si)
        if m == old and si not in self.pending_repartitions:
            raise RepartitionError(f"partitions: source {name!r} already has {m} partitions")
        if self.server.recovering is not None:
            raise RepartitionError("the planner is recovering its session; retry")
        first = self.server.core.next_step
        step = meta.get("step", first)
        if not isinstance(step, int) or isinstance(step, bool) or step < first:
            raise RepartitionError(f"step: {step!r} is planned already (the first step not planned is {first})")
        hosts = meta.get("hosts")
        if hosts is not None:
            if not isinstance(hosts, list) or len(hosts) != m or not all(isinstance(h, str) for h in hosts):
                raise RepartitionError(f"hosts: a list of {m} loader host names, one per new partition")
            unknown = [h for h in hosts if h not in self.hosting.host_ids]
            if unknown:
                raise RepartitionError(f"hosts: no loader host {', '.join(map(repr, unknown))} registered")
        if si in self.pending_repartitions:
            raise RepartitionError(f"source {name!r}: a re-partition at step "
                                   f"{self.pending_repartitions[si]['step']} is pending")
        req = {"source": name, "from": old, "partitions": m, "step": step, "hosts": hosts, "applied": False,
               "t": time.time(), **({"repartition_id": rid} if rid is not None else {})}
        self.pending_repartitions[si] = req
        self.repartition_log.append(req)
        del self.repartition_log[:-REPARTITIONS_KEPT]
        log.warning("re-partition of source %r from %d to %d partitions accepted for step %d", name, old, m, step)
        return {k: req[k] for k in ("source", "from", "partitions", "step")}

    # -- applying it at its step -----------------------------------------------------------------------------
    def repartition_holds(self) -> bool:
        """Whether planning must wait: a re-partition is due at the next step and not applied yet."""
        return any(r["step"] <= self.server.core.next_step for r in self.pending_repartitions.values())

    def repartition_tick(self) -> None:
        """Apply the re-partitions due at the next step once every step before it is complete everywhere."""
        if not self.pending_repartitions:
            return
        nxt = self.server.core.next_step
        due = [si for si, r in self.pending_repartitions.items() if r["step"] <= nxt]
        if not due or not self.server.constructors:
            return
        done = [self.server.complete_by.get(c.identity, -1) for c in self.server.constructors.values()]
        if len(done) < len(self.server.constructors) or min(done) < nxt - 1:
            return
        for si in sorted(due):
            self._apply_repartition(si, self.pending_repartitions.pop(si))

    def _hosts_for(self, si: int, old: int, m: int, asked: list[str] | None) -> list[str]:
        """Partition k < old stays on its host if it is alive; the others go to the live hosts serving least."""
        if asked:
            dead = [h for h in asked if not self.hosting.host_alive(h)]
            if dead:
                raise HandoffError(f"hosts: loader host {', '.join(map(repr, sorted(set(dead))))} is not alive")
            return list(asked)
        live = [h for h, hh in sorted(self.hosting.partitions.hosts.items()) if not hh.shadow and self.hosting.host_alive(h)]
        if not live:
            raise HandoffError("no live loader host to serve the new partitions")
        load = {h: len(self.hosting.partitions.hosted_by(h)) for h in live}
        for r in range(old):
            a = self.hosting.partitions.parts.get((si, r))
            if a is not None and a.host in load:
                load[a.host] -= 1  # its old partition goes
        out: list[str] = []
        for k in range(m):
            a = self.hosting.partitions.parts.get((si, k))
            if k < old and a is not None and a.host in load:
                h = a.host
            else:
                h = min(live, key=lambda x: (load[x], x))
            load[h] += 1
            out.append(h)
        return out

    def _apply_repartition(self, si: int, req: dict[str, Any]) -> None:
        name = self.server.names[si]
        old = self.server.core.partitions(si)
        t0 = time.monotonic()
        try:
            hosts = self._hosts_for(si, old, int(req["partitions"]), req.get("hosts"))
            record = self.server.core.repartition(si, int(req["partitions"]))
        except (RepartitionError, HandoffError) as e:
            req["error"] = str(e)
            log.error("re-partition of source %r not applied: %s", name, e)
            return
        if self.server.journal is not None:
            self.server.journal.repartition(record)
            self.server.journal.checkpoint(self.server.core.cursor())  # a recovery after this never re-plans across it
        self._retable(si, old, hosts, int(record["step"]))
        req.update(applied=True, hosts=hosts, applied_after_s=round(time.monotonic() - t0, 4), applied_at=time.time())
        log.warning("source %r re-partitioned from %d to %d partitions at step %d (hosts %s)", name, old,
                    record["partitions"], record["step"], ", ".join(hosts))

    def _retable(self, si: int, old: int, hosts: list[str], step: int) -> None:
        """Source `si` is read by ``len(hosts)`` partitions from `step` on (the planner's windows are already
        theirs): the old servers are released, the table takes the new partitions, their hosts are told to ADOPT."""
        now = time.monotonic()
        for r in range(old):  # the old servers delivered everything planned for them: released
            key = (si, r)
            ident = self.server.loaders.pop(key, None)
            self.server.pending_loader_welcome.discard(key)
            epoch = self.hosting.partitions.parts[key].epoch if key in self.hosting.partitions.parts else 0
            for h in (self.hosting.partitions.parts[key].shadows if key in self.hosting.partitions.parts else []):
                hid = self.hosting.host_ids.get(h)
                if hid is not None:  # a shadow of the old order: dormant
                    self.server.send(hid, Kind.ADOPT, {"source": si, "replica": r, "epoch": epoch, "mode": "dormant"})
            if ident is not None:
                self.hosting.retired_loaders[ident] = (key, epoch, now)
                self.hosting.release(ident, key, epoch)
        self.server.windows_changed()  # per-window metrics: labelled again for the new windows
        self.hosting.table_records = {k: list(v) for k, v in self.server.core.partitioning.items()}
        moves = self.hosting.partitions.repartition(si, old, hosts)
        for k in range(len(hosts)):
            self.server.inflight.since[(si, k)] = step
        for mv in moves:
            self.hosting.apply_move(mv, "repartition")

    def partitioning_plan(self, cursor: Any) -> list[tuple[int, int, int, list[str]]]:
        """A cursor taken with other partitions of a source than the running ones (a trainer resuming from a state
        taken after a re-partition in a new run, or before one in this run): per such source (index, partitions now,
        partitions of the cursor, their hosts), checked before anything changes (RepartitionError / HandoffError)."""
        theirs = parse_partitioning(cursor.get("partitioning") if isinstance(cursor, dict) else None,
                                    [s.replicas for s in self.server.spec.sources], self.server.names)
        out = []
        for si in sorted(set(theirs) | set(self.server.core.partitioning)):
            if theirs.get(si, []) == self.server.core.partitioning.get(si, []):
                continue
            old = self.server.core.partitions(si)
            new = int(theirs[si][-1]["partitions"]) if theirs.get(si) else int(self.server.spec.sources[si].replicas)
            out.append((si, old, new, self._hosts_for(si, old, new, None)))
        return out

    def realign_partitions(self, plan: list[tuple[int, int, int, list[str]]]) -> None:
        """After `core.restore` adopted a cursor's partitioning (`partitioning_plan`): the partition table and the
        loader hosts follow it — the running partitions released, each of the cursor's opened by its host with the
        cursor's records (its read order) under a new epoch."""
        for si, old, new, hosts in plan:
            self._retable(si, old, hosts, self.server.core.next_step)
            log.warning("source %r: partitions %d -> %d to serve the resumed cursor (hosts %s)", self.server.names[si], old, new,
                        ", ".join(hosts))

    # -- a restarted planner ----------------------------------------------------------------------------------
    def journaled_partitioning(self, records: list[dict[str, Any]]) -> None:
        """After a restart (the session adopted from the journal): the partition table takes the partitions the
        session ended with -- its start cursor's, then every `repartition` record of the session -- so the loader
        hosts registering again are handed the partitions they serve (with the records). The planner's windows
        follow when the recovery restores its anchor (a re-partition writes one at its step)."""
        starts = [i for i, r in enumerate(records) if r.get("event") in ("open", "resume")]
        if not starts:
            return
        i0 = starts[-1]
        session = int(records[i0].get("session", 0))
        replicas = [s.replicas for s in self.server.spec.sources]
        try:
            final = parse_partitioning(records[i0]["cursor"].get("partitioning"), replicas, self.server.names)
            for r in records[i0 + 1:]:
                if r.get("event") == "repartition" and int(r.get("session", session)) == session:
                    si = int(r["source"])
                    final[si] = [*final.get(si, []), r]
            final = parse_partitioning({str(k): v for k, v in final.items()}, replicas, self.server.names) if final else {}
        except (RepartitionError, KeyError, TypeError, ValueError) as e:
            log.error("the journal's re-partitions cannot be read (%s): the table follows the spec", e)
            return
        if not final:
            return
        base = int(time.time())  # above any epoch the predecessor handed out, as planner recovery does
        for si, recs in final.items():
            self.hosting.partitions.repartition(si, int(self.server.spec.sources[si].replicas), [])
            for k in range(int(recs[-1]["partitions"])):
                self.hosting.partitions.parts[(si, k)] = Assignment(epoch=base)
        self.hosting.table_records = final
        log.warning("the journal re-partitioned %s: the partition table follows it", ", ".join(
            f"{self.server.names[si]!r} to {recs[-1]['partitions']} partitions" for si, recs in sorted(final.items())))

    def recovery_anchor(self, anchor: Any, anchors: list[Any]) -> Any:
        """A recovery that would re-plan across a re-partition (a constructor lost steps before it) starts at the
        re-partition's own checkpoint instead: the loaders serve only the new partitions now. Logged: the steps
        before it cannot be rebuilt for that constructor."""
        mine = anchor.cursor.get("partitioning") or {}
        later = [a for a in anchors if a.step > anchor.step and (a.cursor.get("partitioning") or {}) != mine]
        if not later:
            return anchor
        first = min(later, key=lambda a: (a.step, -a.index))
        log.error("recovery from step %d would re-plan across the re-partition at step %d: re-planning from step %d "
                  "(a constructor missing earlier steps cannot get them again)", anchor.step, first.step, first.step)
        return first

    def repartition_status(self) -> dict[str, Any]:
        return {"repartitions": [dict(r) for r in self.repartition_log[-REPARTITIONS_KEPT:]],
                "source_partitions": {n: self.server.core.partitions(i) for i, n in enumerate(self.server.names)}}
