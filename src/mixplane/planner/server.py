"""Planner server: the rendezvous of a mixture and the one place where steps are planned.

Thin shell over `planner.core.StepPlanner`: registers loaders and constructors, feeds loader
metadata into windows, plans steps when constructors need them, tells each loader what to send
where and each constructor what to build, journals every step, answers status and updates.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from mixplane import protocol, wire
from mixplane.component import Component, peer_name
from mixplane.metrics import handoff_metrics
from mixplane.planner.hosting import PartitionHosting
from mixplane.planner.repartitioning import PlannerRepartition
from mixplane.planner import dispatch, layoutloop, routeloop, selectloop
from mixplane.planner.inflight import InFlight
from mixplane.planner import journal as journal_file
from mixplane.planner.journal import Journal, JournalError
from mixplane.planner.adaptation import Adaptation
from mixplane.planner.losses import SourceLosses
from mixplane.planner.recovery import Anchor, LayoutRecord, RecoveryState, cursor_generation, read_state, same_mixture
from mixplane.protocol import cursor_array, cursor_text_array
from mixplane.layout import layout_digest
from mixplane.mixing import MixturePoint, SourcesExhausted
from mixplane.planner.core import RowsShortError, StepPlan, StepPlanner
from mixplane.planner.windows import WindowError
from mixplane.planner.strategies import resolve_strategy
from mixplane.spec import DataMixtureSpec
from mixplane.topology import backbone_coords, backbone_rank, constructor_groups, dp_ranks_of_group, topology_digest
from mixplane.wire import Kind, WireError

log = logging.getLogger("mixplane.planner")
PLANNER_HWM = 10_000  # messages queued per peer: far above a step's plan messages, bounded still


@dataclass
class ConstructorPeer:
    index: int
    identity: bytes
    data_endpoint: str
    client_endpoint: str
    ranks: list[int]
    dp_ranks: list[int]


@dataclass
class PlannerState:
    """Progress that status replies and the progress line report."""

    started: float = field(default_factory=time.monotonic)
    tokens_planned: int = 0
    # per source: tokens of every planned step, and (time, totals) samples for the delivered rate
    source_tokens: list[int] = field(default_factory=list)
    rate_samples: deque[tuple[float, tuple[int, ...]]] = field(default_factory=deque)
    rate_window_s: float = 30.0

    def add_source_tokens(self, tokens: Any, now: float) -> None:
        """Count a planned step's tokens per source (they are delivered once its step is built)."""
        if not self.source_tokens:
            self.source_tokens = [0] * len(tokens)
            self.rate_samples.append((self.started, tuple(self.source_tokens)))
        for i, x in enumerate(tokens):
            self.source_tokens[i] += int(x)
        self.rate_samples.append((now, tuple(self.source_tokens)))
        while len(self.rate_samples) > 2 and now - self.rate_samples[1][0] >= self.rate_window_s:
            self.rate_samples.popleft()

    def source_rates(self, now: float) -> list[float]:
        """Tokens per second per source over the last `rate_window_s` (from the oldest kept sample to now):
        the measured throughput the operator's scaling compares with the loaders it sized."""
        if not self.rate_samples:
            return []
        t0, first = self.rate_samples[0]
        dt = max(now - t0, 1e-6)
        return [round((c - f) / dt, 3) for c, f in zip(self.source_tokens, first)]


def tune_gc() -> None:
    """For the planner's own process, once it has started: objects alive then (numba's compiled code, the
    spec, metrics, ...) are frozen out of garbage collection. A step at 1,024 sources allocates some 20k
    containers, so a full collection runs every few steps, and it traversed all of those every time:
    bench/plan_scale.py at 16,384 GPUs x 1,024 sources, 10 steps: step CPU p99 278-284 ms -> 212-217 ms
    (p50 and RSS unchanged; raising the young threshold as well saved no more and kept ~180 MB more garbage
    alive). Process-wide, hence not done by PlannerServer itself (tests and embedded uses keep theirs)."""
    gc.freeze()


class StepMetrics:
    """The per-step Prometheus updates of a plan: steps, packing, and per source (tokens, samples, target and
    realised share) and per window (samples held) -- the last two as arrays exported at scrape time
    (metrics.PlannerSourceSeries)."""

    def __init__(self, m: Any, names: list[str], windows: list[Any]):
        self.m = m
        self.windows = windows
        m.planner_sources.label(names, [(names[w.source], str(w.replica)) for w in windows])

    def record(self, plan: StepPlan, probs: Any, realized: Any) -> None:
        lay = plan.layout
        m = self.m
        m.steps_planned.inc()
        m.planner_step.set(lay.step)
        m.packing_efficiency.set(int(lay.seg_len.sum(dtype=np.int64)) / float(lay.rows * lay.seq_len))  # = row_fill().sum()
        real = np.asarray(realized, np.float64)
        total = float(real.sum())
        share = real / total if total else np.zeros(len(real))
        held = np.fromiter((len(w) for w in self.windows), np.float64, len(self.windows))
        m.planner_sources.add_step(plan.tokens_by_source, plan.samples_by_source, probs, share, held)


STATUS_UPDATES = 32  # acknowledged mixture updates listed in STATUS
RESHARDS_KEPT = 32  # acknowledged reshard ids (listed in STATUS; answered as duplicates)
CLOSE_LINGER_MS = 5000  # how long a closed planner socket keeps sending what was queued before it


class PlannerServer(Component):
    component = "planner"

    def __init__(self, spec: DataMixtureSpec, endpoint: str, *, context: zmq.Context | None = None,
                 run_dir: str | None = None, metrics_port: int | None = 0):
        # the compiled planning and routing loops: compiled (or loaded from numba's cache) before the socket
        # exists, so the first step does not stall heartbeats for the seconds a cold compile takes
        jit_s = selectloop.warm() + routeloop.warm() + layoutloop.warm()
        super().__init__(spec, "planner", context=context, metrics_port=metrics_port, logger=log)
        if jit_s > 1.0:
            log.info("planning loop compiled in %.1f s (cached for the next start)", jit_s)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # heartbeats drop dead peers' pipes; a send to a vanished or stuck peer raises (counted, logged)
        # instead of vanishing silently; the high-water mark bounds what one stuck peer can hold
        wire.configure_socket(self.sock, sndhwm=PLANNER_HWM, rcvhwm=PLANNER_HWM, heartbeat_s=spec.runtime.heartbeat_s,
                              router_mandatory=True, max_msgsize=protocol.max_message_bytes(spec, "planner"))
        self.security.server(self.sock).bind(endpoint)  # CURVE when configured
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.add_endpoint(self.sock, "planner", {
            Kind.HELLO: self._on_hello, Kind.LOADER_META: self._on_loader_meta, Kind.NEED_STEPS: self._on_need_steps,
            Kind.ROUTE: self._on_route, Kind.RESUME: self._on_resume, Kind.STATUS: self._on_status,
            Kind.UPDATE_MIXTURE: self._update, Kind.SHUTDOWN: self._on_shutdown, Kind.HEARTBEAT: self._on_heartbeat,
            Kind.RESEND: self._on_resend_request,
            Kind.RESHARD: self._on_reshard,
            Kind.HANDOFF: self._on_handoff,
            Kind.REPARTITION: self._on_repartition,
            Kind.LOSS_REPORT: self._on_loss_report,
        }, routed=True, server=True)
        self.core = StepPlanner(spec, resolve_strategy(spec))
        self.groups = constructor_groups(spec)
        self.constructors: dict[int, ConstructorPeer] = {}
        self.loaders: dict[tuple[int, int], bytes] = {}
        self.pending_loader_welcome: set[tuple[int, int]] = set()
        # static sources: the listing each registered loader said it reads (protocol.ListingPin), and the loaders
        # refused for reading the run's listing in another order or refusing it themselves (the run's kept listing
        # not found there: HELLO `refused`): name -> why, one per partition (STATUS `refused_loaders`)
        self.loader_listings: dict[tuple[int, int], protocol.ListingPin] = {}
        self.refused_loaders: dict[str, str] = {}
        self.pending_routes: list[tuple[bytes, int]] = []
        self.session = 0
        self.session_start: dict[str, Any] = self.core.cursor()
        self.session_attempt: str | None = None  # the launch whose ranks resumed into this session
        self.initial_cursor: dict[str, Any] = json.loads(json.dumps(self.session_start))
        self.need_through = -1
        self.need_by: dict[bytes, int] = {}  # constructor identity -> the step it needs planned through
        # loader restart: the instructions of steps some constructor may still miss, resent to a loader that
        # says HELLO again; forgotten once every constructor reports them complete (bounded)
        self.complete_by: dict[bytes, int] = {}  # constructor identity -> every step up to it complete there
        lead = spec.runtime.max_lead_steps + 2 * spec.runtime.prefetch_steps + 2
        self.inflight = InFlight(max_steps=4 * lead + 64)
        self.names = spec.source_names()
        self.losses = SourceLosses(len(self.names))  # trainers' per-source loss reports (LOSS_REPORT)
        self.adaptation = Adaptation(self.names, spec.mixture.model_dump(mode="json"))  # mixture.adaptive
        self._step_metrics: StepMetrics | None = None
        self.hm = handoff_metrics(self.m)
        self.hosting = PartitionHosting(self)  # partition table and loader hosts
        self.repartitioning = PlannerRepartition(self, self.hosting)  # re-partitions of running sources
        self.state = PlannerState()
        self.run_dir = run_dir
        # recovery: this process's incarnation, in WELCOME and heartbeats, so followers notice a
        # restarted planner and register again; the PLAN_CONSTRUCTOR messages a restarted constructor needs
        self.incarnation = os.urandom(8).hex()
        self.layouts = LayoutRecord(max_steps=4 * lead + 64)
        self.released_by: dict[bytes, int] = {}  # constructor identity -> every step up to it handed to all its ranks
        self.rebuild: dict[bytes, int] = {}  # restarted constructor -> the first step loaders resend to it
        self.recovering: RecoveryState | None = None
        self.recover_through = -1  # steps the predecessor planned: planned again without waiting for NEED_STEPS
        self.recover_digests: dict[int, str] = {}
        self.replay_updates: list[tuple[int, dict[str, Any]]] = []
        self.hello_complete: dict[int, int | None] = {}  # constructor -> complete_through it reported (None: holds nothing)
        self.hello_cursor: dict[int, dict[str, Any]] = {}  # constructor -> the cursor after its complete_through
        self.journal = None
        # why planning stopped for good (every share source ended; a rows source's documents did not fit): the
        # data of the mixture, as written, is over; a resume to an earlier step plans again
        self.halted: str | None = None
        self.reshard_acks: dict[str, dict[str, Any]] = {}  # reshard id -> its acknowledgment (oldest first)
        if run_dir:
            path = os.path.join(run_dir, "journal.jsonl")
            # the journal is read once (a restart's start-up: the whole file, parsed, is most of its own work)
            self.recovering, records = self._read_journal_state(path)
            self.journal = Journal(path, every=spec.runtime.journal_every)
            if self.recovering is None:
                self.journal.open(spec, self.generation, self.session_start, self.session)
            else:
                self._adopt_session(self.recovering)
                self._restore_losses(path, records)
                self._journaled_reshards(records)
                try:  # the partitions the session ended with (planner.repartitioning)
                    self.repartitioning.journaled_partitioning(records)
                except (JournalError, OSError, ValueError) as e:
                    log.error("re-partitions in %s not read (%s): the partition table follows the spec", path, e)
        # trainer restart: digests of the cursors this session planned, by the step they precede (a rank
        # resuming from one of them rejoins the session instead of rewinding every rank; bounded)
        self.cursor_digests: dict[int, bytes] = {}
        self._adopt_topology(self.spec)

    def _adopt_topology(self, spec: DataMixtureSpec) -> None:
        """Constructor groups and the dp-rank / rank fan-outs of `spec`'s topology (start, reshard)."""
        self.dispatch_topology = dispatch.DispatchTopology.of(spec)
        self.groups = self.dispatch_topology.groups
        self.topology_digest = topology_digest(spec)

    @property
    def planned_through(self) -> int:
        return self.core.next_step - 1

    @property
    def generation(self) -> int:
        return self.core.generation

    # -- helpers ------------------------------------------------------------------------
    def _send(self, identity: bytes, kind: Kind, meta: dict[str, Any] | None = None, arrays: dict[str, np.ndarray] | None = None,
              *, frames: list | None = None) -> bool:
        """Send without blocking; a peer that vanished or stopped reading is logged and counted
        (mixplane_wire_bad_messages_total{reason="undeliverable"}), never fatal. `frames`: the message
        (`meta` and its arrays) already encoded."""
        return self.send_routed(self.sock, identity, kind, meta, arrays, frames=frames) is True

    # -- what partition hosting and re-partitioning reach the server through (their HostingServer and
    # RepartitionServer interfaces) -------------------------------------------------------------------
    def send(self, identity: bytes, kind: Kind, meta: dict[str, Any] | None = None) -> bool:
        return self._send(identity, kind, meta)

    def send_quietly(self, identity: bytes, kind: Kind, meta: dict[str, Any]) -> None:
        self.send_routed(self.sock, identity, kind, meta, quiet=True)

    def windows_changed(self) -> None:
        self._step_metrics = None  # per-window metrics: labelled again for the new windows

    def _on_handoff(self, identity: bytes, msg: wire.Message) -> None:
        self.hosting.on_handoff(identity, msg)

    def _on_repartition(self, identity: bytes, msg: wire.Message) -> None:
        self.repartitioning.on_repartition(identity, msg)

    @property
    def all_constructors(self) -> bool:
        return len(self.constructors) == len(self.groups)

    def _welcome_loader(self, key: tuple[int, int]) -> None:
        eps = [self.constructors[i].data_endpoint for i in range(len(self.groups))]
        w = self.core.window(*key)
        # the window restarts from its cursor: the loader re-sends every unconsumed sample
        cur = w.cursor()
        w.restore(cur)
        ident = self.loaders[key]
        replay = self.inflight.for_loader(key)
        if not replay:
            self._send(ident, Kind.WELCOME, {"session": self.session, "constructors": eps, "cursor": cur,
                                             "incarnation": self.incarnation})
            return
        # a (re)started loader first re-reads its stream from the lowest position of the steps planned but
        # not yet complete at every constructor and sends their spans again (constructors drop what they
        # hold), then seeks to the window's cursor and announces the rest as usual
        low = InFlight.low_position(replay)
        start = {"low": low, "next": low, **({"listing": cur["listing"]} if "listing" in cur else {})}
        self._send(ident, Kind.WELCOME, {"session": self.session, "constructors": eps, "cursor": start,
                                         "replay_through": replay[-1][0], "incarnation": self.incarnation})
        for step, ins in replay:
            self._send(ident, Kind.PLAN_LOADER, {"session": self.session, "step": step, "replay": True}, ins.arrays())
        self._send(ident, Kind.SEEK, {"session": self.session, "cursor": cur})
        self.m.replayed_steps.inc(len(replay))
        log.warning("loader %s/%d: resending the spans of %d planned step(s) %d..%d from position %d",
                    self.names[key[0]], key[1], len(replay), replay[0][0], replay[-1][0], low)

    def _listing_ok(self, identity: bytes, key: tuple[int, int]) -> bool:
        """Whether a loader reads the run's listing of its static source in the run's order (the first one pins
        it, journaled). Another listing: the loader is told the run's (WELCOME `reopen`) and registers again once
        its stream reads it; another order: refused (SHUTDOWN with the error; it does not serve)."""
        si, theirs = key[0], self.loader_listings.get(key)
        pinned = self.core.listings.get(si)
        verdict = protocol.listing_verdict(pinned, theirs)
        name = f"{self.names[si]}/{key[1]}"
        if verdict in ("ok", "pin"):
            self.refused_loaders.pop(name, None)  # served again by a loader that reads the run's listing
        if verdict == "ok":
            return True
        if verdict == "pin":
            assert theirs is not None
            self.core.listings[si] = theirs
            if self.journal is not None:
                self.journal.listing(si, theirs.text())
            log.info("source %s: the run's listing is pinned: %d files, digest %s, order %s", self.names[si],
                     theirs.files, theirs.digest, theirs.order)
            return True
        assert pinned is not None and theirs is not None
        if self.loaders.get(key) == identity:  # nothing is planned with it until it reads the run's listing
            del self.loaders[key]
        self.pending_loader_welcome.discard(key)
        if verdict == "reopen":
            log.warning("loader %s reads another listing of %s (%d files, digest %s) than the run (%d files, digest "
                        "%s): told to reopen its stream with the run's", name, self.names[si], theirs.files,
                        theirs.digest, pinned.files, pinned.digest)
            self._send(identity, Kind.WELCOME, {"session": self.session, "incarnation": self.incarnation,
                                                "listing": pinned.to_json(), "reopen": True})
            return False
        why = protocol.order_refusal(self.names[si], pinned, theirs)
        log.error("loader %s refused: %s", name, why)
        self.refused_loaders[name] = why
        self._send(identity, Kind.SHUTDOWN, {"error": why, "refused": "listing"})
        return False

    def _loader_refused(self, identity: bytes, key: tuple[int, int], why: str) -> None:
        """A loader that refuses to serve the run (HELLO `refused`: it cannot read the run's listing of its source) and
        stops: named with its reason in STATUS `refused_loaders` (one entry per partition: a restarted one that refuses
        again replaces it; one that serves again clears it), not registered, and acknowledged so that it stops knowing
        it was heard."""
        name = f"{self.names[key[0]]}/{key[1]}"
        if self.refused_loaders.get(name) != why:
            log.error("loader %s refuses the run: %s", name, why)
        self.refused_loaders[name] = why
        if self.loaders.get(key) == identity:
            del self.loaders[key]
        self.pending_loader_welcome.discard(key)
        self._send(identity, Kind.ACK, {"refused": name})

    def _route_reply(self, identity: bytes, rank: int) -> None:
        if not 0 <= rank < self.spec.world_size:
            self._send(identity, Kind.ERROR, {"error": f"rank {rank} outside world of size {self.spec.world_size}"})
            return
        ci = next(i for i, g in enumerate(self.groups) if rank in g)
        c = self.constructors[ci]
        self._send(identity, Kind.ROUTE_REPLY, {
            "constructor": ci, "endpoint": c.client_endpoint, "session": self.session, "world_size": self.spec.world_size,
            "rank": rank,
            "coords": backbone_coords(self.spec, rank).as_dict(), "sources": self.names,
            "seq_len": self.spec.batch.seq_len, "microbatches": self.spec.batch.microbatches,
            "step_timeout_s": self.spec.runtime.step_timeout_s,  # the client's wait per step unless it sets its own
            # time-sized look-ahead: seconds of training a client keeps requested, and at most this many steps
            "prefetch_s": self.spec.runtime.prefetch_s, "max_lead_steps": self.spec.runtime.max_lead_steps,
            "checksum_payloads": self.spec.runtime.checksum_payloads,  # the client refuses STEP_DATA without them
            "start_step": int(self.session_start["step"]),
            # lets a client make a resumable state_dict before its first step, and restart from step 0
            "session_start": self.session_start, "initial_cursor": self.initial_cursor,
        })

    # -- message handling (one handler per kind; the component base checks schema and sender role) ----------
    def handle(self, identity: bytes, msg: wire.Message) -> None:
        """Handle one message as if it arrived on the planner socket from `identity` (WireError if bad)."""
        self.dispatch(self.entry("planner"), identity, msg)

    def _on_hello(self, identity: bytes, msg: wire.Message) -> None:
        role = msg.get("role", str)
        if role == "loader":
            key = (msg.get("source", int), msg.get("replica", int))
            try:
                self.core.window(*key)
            except KeyError:
                raise WireError(f"HELLO from unknown loader source {key[0]} replica {key[1]}") from None
            if not self.hosting.loader_claim(identity, key, msg):  # an older epoch's server of this partition (fenced)
                return
            refused = protocol.parse_refusal(msg.meta.get("refused"), "HELLO: field 'refused'")
            if refused is not None:  # the loader refuses the run itself (the run's listing is not kept there)
                self._loader_refused(identity, key, refused)
                return
            theirs = protocol.ListingPin.parse(msg.meta.get("listing"), "HELLO: field 'listing'")
            if theirs is not None:
                self.loader_listings[key] = theirs
            if not self._listing_ok(identity, key):  # another listing: reopen it first, or refused
                return
            self.hosting.adopted(key)
            if key in self.loaders and key not in self.pending_loader_welcome:  # a restarted loader (or a HELLO retry): counted and named
                self.m.loader_rejoins.labels(f"{self.names[key[0]]}/{key[1]}").inc()
                log.warning("loader %s/%d said HELLO again (restart?): welcoming it back", self.names[key[0]], key[1])
            self.loaders[key] = identity
            if self.all_constructors:
                self._welcome_loader(key)
            else:
                self.pending_loader_welcome.add(key)
        elif role == "host":
            self.hosting.on_host_hello(identity, msg)
        elif role == "constructor":
            ci = msg.get("index", int)
            if not 0 <= ci < len(self.groups):
                raise WireError(f"HELLO from constructor {ci}, but the topology has {len(self.groups)}")
            theirs = msg.meta.get("topology")
            if isinstance(theirs, str) and theirs != self.topology_digest:
                # its spec file is of another topology (a ConfigMap mounted before a reshard): it would cut the
                # batches for other ranks. Stopped; restarted, it reads the spec again
                log.warning("constructor %d registers with another topology (%s, the planner serves %s): told to stop",
                            ci, theirs, self.topology_digest)
                self._send(identity, Kind.SHUTDOWN)
                return
            ranks = self.groups[ci]
            old = self.constructors.get(ci)
            self.constructors[ci] = ConstructorPeer(ci, identity, msg.get("data_endpoint", str),
                                                    msg.get("client_endpoint", str), ranks,
                                                    dp_ranks_of_group(self.spec, ranks))
            fresh = self._constructor_hello(ci, identity, msg, old)
            self._send(identity, Kind.WELCOME, {"session": self.session, "ranks": ranks,
                                                "dp_ranks": self.constructors[ci].dp_ranks,
                                                "start_step": int(self.session_start["step"]),
                                                # what ranks may already ask for: a recovering planner counts
                                                # the steps its predecessor planned (it plans them again)
                                                "planned_through": max(self.planned_through, self.recover_through,
                                                                       self.recovering.planned_through
                                                                       if self.recovering is not None else -1),
                                                "incarnation": self.incarnation})
            self.hosting.fence_constructor(identity)  # partitions that moved: their older epochs are dropped there too
            if fresh:
                self._rebuild_constructor(ci, identity)
            if self.all_constructors and self.recovering is not None:
                self._recover()
            if self.all_constructors:
                for key in sorted(self.pending_loader_welcome):
                    self._welcome_loader(key)
                self.pending_loader_welcome.clear()
                for ident, rank in self.pending_routes:
                    self._route_reply(ident, rank)
                self.pending_routes.clear()
        else:
            raise WireError(f"HELLO with unknown role {role!r}")

    def _on_loader_meta(self, identity: bytes, msg: wire.Message) -> None:
        if msg.get("session", int) != self.session:
            return
        key = (msg.get("source", int), msg.get("replica", int))
        if key in self.hosting.partitions.parts and self.hosting.stale_loader_meta(identity, key, msg):
            return
        if self.loaders.get(key) != identity:  # only the registered loader may fill its window
            raise WireError(f"LOADER_META for source {key[0]} replica {key[1]} from a peer that is not its loader")
        try:
            w = self.core.window(*key)
            w.add(msg.array("pos"), msg.array("key"), msg.array("tokens"), msg.array("patches"))
            listing = protocol.parse_listing(msg.meta.get("listing"))
        except (KeyError, WindowError, TypeError) as e:
            raise WireError(f"LOADER_META: {e}") from None
        if listing is not None:  # a live source's listing changed: cursors name it from now on
            w.listing = [list(seg) for seg in listing]

    def _on_need_steps(self, identity: bytes, msg: wire.Message) -> None:
        if not any(c.identity == identity for c in self.constructors.values()):
            # a constructor registered with a predecessor of this planner learns of the restart from the reply
            self.send_routed(self.sock, identity, Kind.HEARTBEAT, {"t": time.time(), "incarnation": self.incarnation}, quiet=True)
            # an unknown peer's low 'through' would cap planning (need_through follows the slowest)
            raise WireError("NEED_STEPS from a peer that is not a registered constructor")
        if msg.get("session", int) == self.session:
            self.need_by[identity] = max(self.need_by.get(identity, -1), msg.get("through", int))
            # pull model: plan what the most advanced constructor needs, but no further than
            # max_lead_steps ahead of the slowest one that is running (bounds constructors' memory)
            self.need_through = min(max(self.need_by.values()), min(self.need_by.values()) + self.spec.runtime.max_lead_steps)
            self._constructor_progress(identity, msg)
            done = msg.meta.get("complete_through")
            if isinstance(done, int):
                self.complete_by[identity] = max(self.complete_by.get(identity, -1), done)

    def _on_route(self, identity: bytes, msg: wire.Message) -> None:
        if "coords" in msg.meta:  # a client configured by its mesh position
            try:
                rank = backbone_rank(self.spec, msg.meta["coords"])
            except ValueError as e:
                self._send(identity, Kind.ERROR, {"error": f"route: {e}"})
                return
        else:
            rank = msg.get("rank", int)
        if self.all_constructors:
            self._route_reply(identity, rank)
        else:
            # a client asks again on a new socket when unanswered (client.ROUTE_RESEND_S): the newest ask of a rank
            # is the one answered, so the list stays bounded by the world size however long registration takes
            self.pending_routes = [(i, r) for i, r in self.pending_routes if r != rank]
            self.pending_routes.append((identity, rank))

    def _recovering_refusal(self, identity: bytes, what: str) -> bool:
        """A restarted planner that has not yet re-planned its predecessor's steps cannot rewind or reshard (its
        recovery would then restore the journal's anchor over it): the request is refused with a retry flag."""
        if self.recovering is None and self.planned_through >= self.recover_through:
            return False
        self._send(identity, Kind.ERROR, {"error": f"{what} refused: the planner is recovering its session (re-planning "
                                          f"through step {max(self.recover_through, self.planned_through)}); retry",
                                          "retry": True})
        return True

    def _on_resume(self, identity: bytes, msg: wire.Message) -> None:
        if self._recovering_refusal(identity, "resume"):
            return
        cursor = msg.get("cursor", dict)
        attempt = msg.meta.get("attempt")
        self._resume(identity, cursor, attempt if isinstance(attempt, str) else None, rewind=msg.meta.get("rewind") is True)

    def _on_status(self, identity: bytes, msg: wire.Message) -> None:
        self._send(identity, Kind.STATUS_REPLY, self.status())

    def _on_loss_report(self, identity: bytes, msg: wire.Message) -> None:
        """A trainer rank's per-source loss sums (one-way: no answer). Gathered (STATUS `source_loss`), exported
        (mixplane_planner_source_loss{source}, ..._loss_tokens_total{source}) and journaled as received."""
        report = protocol.parse_loss_report(msg.meta, len(self.names))  # WireError: counted and dropped
        self.losses.add(report)
        self.m.loss_reports.inc()
        for name, recent, t in zip(self.names, self.losses.recent(), report.tokens):
            if t:
                self.m.source_loss_tokens.labels(name).inc(t)
            if recent is not None:
                self.m.source_loss.labels(name).set(recent)
        if self.journal is not None:
            self.journal.loss(report)
        self._adapt()

    def _adapt(self) -> None:
        """mixture.adaptive: once the reports cover the next interval, its weights as the next generation
        (planner.adaptation); never while the journal's own updates are still being applied again."""
        if self.recovering is not None or self.replay_updates or self.planned_through < self.recover_through:
            return
        nxt = self.adaptation.next_update(self.losses.loss_sum.tolist(), self.losses.tokens.tolist(),
                                          self.losses.rank_through().values(), self.core.next_step)
        if nxt is None:
            return
        meta, record = nxt
        try:
            event, duplicate = self.core.apply_update(meta)
        except (ValueError, TypeError, ArithmeticError) as e:
            log.error("adaptive mixture update %s not applied: %s", meta["update_id"], e)
            return
        self.adaptation.applied(record, meta["mixture"])
        if not duplicate:
            event["adaptive"] = record
            if self.journal is not None:
                self.journal.update(event)
        log.info("adaptive mixture: update %d, generation %d from step %d%s: %s", record["k"], int(event["generation"]),
                 int(event["effective_step"]), " (late)" if record["late"] else "",
                 ", ".join(f"{n} {w:.4f}" for n, w in zip(self.names, record["weights"])))

    def _restore_losses(self, path: str, records: list[dict[str, Any]]) -> None:
        """A restarted planner's loss totals (the reports its predecessors journaled as received) and its adaptive
        mixture's state (the last journaled adaptive update, and the mixture updates after it)."""
        try:
            for r in records:
                if r.get("event") == "loss":
                    self.losses.add(protocol.parse_loss_report(r, len(self.names)))
                elif r.get("event") == "update" and isinstance(r.get("mixture"), dict):
                    if isinstance(r.get("adaptive"), dict):
                        self.adaptation.restore(r["adaptive"], r["mixture"])
                    else:
                        self.adaptation.replaced(r["mixture"])
        except (JournalError, WireError, ValueError, KeyError, TypeError) as e:
            log.warning("loss reports in %s not restored (%s): totals start again", path, e)

    def _on_shutdown(self, identity: bytes, msg: wire.Message) -> None:
        self.stopped = True

    def _on_heartbeat(self, identity: bytes, msg: wire.Message) -> None:
        if "loop_s" in msg.meta:  # a loader host's beat thread (planner.hosting)
            self.hosting.on_host_beat(msg)
        # the component base recorded the peer as seen
        # a component that beats without being registered here
        # was registered with a predecessor of this planner: the reply's incarnation makes it say HELLO again
        if msg.meta.get("role") in ("loader", "constructor") and not self._registered(identity):
            self.send_routed(self.sock, identity, Kind.HEARTBEAT, {"t": time.time(), "incarnation": self.incarnation}, quiet=True)

    def _resume(self, identity: bytes, cursor: dict[str, Any], attempt: str | None = None, rewind: bool = False) -> None:
        if not rewind and self._rejoins(cursor):
            # one trainer rank restarted from its own state_dict: its constructor still holds the steps it
            # misses (it keeps a step until every rank it serves moved past it), so nobody rewinds; if the
            # step is gone after all, the client is told so by its constructor and asks again with rewind
            self.m.trainer_rejoins.inc()
            log.warning("a trainer rank resumed at step %d of session %d: rejoining without a rewind", cursor["step"], self.session)
            self._send(identity, Kind.ACK, {"session": self.session, "step": int(cursor["step"]), "rejoin": True})
            return
        same_start = json.dumps(cursor, sort_keys=True) == json.dumps(self.session_start, sort_keys=True)
        if same_start and ((attempt is not None and attempt == self.session_attempt)
                           or self.planned_through < int(cursor["step"])):
            # other ranks of the same (re)launch resuming to the point this session starts at: nothing to
            # redo. A resume from another launch to the same point, after steps of this session were
            # planned (and may be gone), starts a new session that re-creates them.
            self._send(identity, Kind.ACK, {"session": self.session, "step": int(cursor["step"])})
            return
        try:
            realign = self.repartitioning.partitioning_plan(cursor)  # another partitioning of a source (planner.repartitioning)
            kept = self.core.restore(cursor, keep_updates=True)
        except Exception as e:  # noqa: BLE001 - a peer's cursor must never take the planner down
            self._send(identity, Kind.ERROR, {"error": f"cannot resume from this state: {e}"})
            return
        self.repartitioning.realign_partitions(realign)
        self.halted = None
        self.session += 1
        self.session_start = json.loads(json.dumps(cursor))
        self.session_attempt = attempt
        self.cursor_digests.clear()
        # another rank resuming at this very point (every rank of a restarted job) rejoins this session
        self._remember_cursor(int(cursor["step"]), cursor_array(cursor))
        self.need_through = -1
        self.need_by.clear()
        self.complete_by.clear()
        self.inflight.clear()
        self.layouts.clear()
        self.released_by.clear()
        self.rebuild.clear()
        self.recover_through = -1
        for key, ident in list(self.loaders.items()):
            if self._listing_ok(ident, key):  # a cursor of the run's listing (a resume into a new run)
                self._send(ident, Kind.SEEK, {"session": self.session, "cursor": self.core.window(*key).cursor()})
        for c in self.constructors.values():
            self._send(c.identity, Kind.RESET, {"session": self.session, "start_step": int(cursor["step"])})
        if self.journal is not None:
            self.journal.resume(cursor, self.session)
            for event in kept:  # runtime mixture updates newer than the cursor stay in force
                self.journal.update(event)
        log.info("resumed at step %d (session %d)", cursor["step"], self.session)
        self._send(identity, Kind.ACK, {"session": self.session, "step": int(cursor["step"])})

    # -- trainer restart and elastic resharding ------------------------------
    def _remember_cursor(self, step: int, cursor: np.ndarray) -> None:
        self.cursor_digests[step] = hashlib.blake2b(cursor.tobytes(), digest_size=16).digest()
        if len(self.cursor_digests) > max(1024, self.inflight.max_steps):
            del self.cursor_digests[min(self.cursor_digests)]

    def _rejoins(self, cursor: dict[str, Any]) -> bool:
        """Whether `cursor` is one this session planned (a rank that restarted mid-session): same bytes as
        the cursor the constructors handed out before that step."""
        try:
            step = int(cursor["step"])
            got = hashlib.blake2b(cursor_array(cursor).tobytes(), digest_size=16).digest()
        except (KeyError, TypeError, ValueError):
            return False
        return self.cursor_digests.get(step) == got

    def _on_reshard(self, identity: bytes, msg: wire.Message) -> None:
        """Elastic resharding in a running system: plan for a new topology (DP / TP / PP / CP; the global batch
        stays what it was) from a step on. Two forms:

        * with a trainer's `cursor` (EmbeddedRuntime.reshard): from the cursor's step, rewinding to it;
        * with a `reshard_id` and no cursor (the operator, for a patch of the DataMixture's spec.topology): from
          the first step this planner has not planned, with its own cursor there (nothing planned is re-planned).
          An id is acknowledged once: the same id again gets the same answer (``duplicate``) and changes nothing,
          also after a restart (the journal's spec record holds it).

        The mixing does not depend on the topology, so the global sequence of samples is the one the old topology
        would have got, only distributed differently. The planner starts a new session at that step, tells the old
        constructors to stop, waits for the new topology's constructors to register, then welcomes the loaders
        again (new constructor endpoints, the window's cursor). The journal records the new spec before the
        session's resume record, so `mixplane replay` plans every later step with the new topology."""
        from mixplane.spec import SpecError, parse_spec

        rid = msg.meta.get("reshard_id")
        if rid is not None and not isinstance(rid, str):
            self._send(identity, Kind.ERROR, {"error": "reshard rejected: reshard_id must be text"})
            return
        if rid is not None and rid in self.reshard_acks:
            self._send(identity, Kind.ACK, {**self.reshard_acks[rid], "duplicate": True,
                                            "spec": self.spec.model_dump(mode="json")})
            return
        if self._recovering_refusal(identity, "reshard"):
            return
        cursor = msg.meta.get("cursor")
        if cursor is None:
            if rid is None:
                self._send(identity, Kind.ERROR, {"error": "reshard rejected: give a cursor (a trainer's state) or a "
                                                  "reshard_id (from the first step not planned yet)"})
                return
            cursor = self.core.cursor()  # the first step not planned, as this planner stands there
        elif not isinstance(cursor, dict):
            self._send(identity, Kind.ERROR, {"error": "reshard rejected: cursor must be a mapping"})
            return
        doc = self.spec.model_dump(mode="json")
        doc["topology"] = msg.get("topology", dict)
        try:
            new = parse_spec(doc, origin="reshard")
            if (new.rows_per_step, new.batch.seq_len) != (self.spec.rows_per_step, self.spec.batch.seq_len):
                raise ValueError("the global batch must stay the same")
            strategy = resolve_strategy(new)
            step = int(cursor["step"])
            realign = self.repartitioning.partitioning_plan(cursor)  # a cursor of another partitioning (planner.repartitioning)
            kept = self.core.restore(cursor, keep_updates=True)  # validates before changing anything
        except (SpecError, ValueError, KeyError, TypeError) as e:
            self._send(identity, Kind.ERROR, {"error": f"reshard rejected: {e}"})
            return
        self.repartitioning.realign_partitions(realign)
        old = list(self.constructors.values())
        generation = self.core.generation + 1
        self.core.reconfigure(new, generation)
        self.core.strategy = strategy
        self.spec = new
        self._adopt_topology(new)
        self.session += 1
        self.session_start = json.loads(json.dumps(cursor))
        attempt = msg.meta.get("attempt")
        self.session_attempt = attempt if isinstance(attempt, str) else None
        self.cursor_digests.clear()
        self._remember_cursor(step, cursor_array(cursor))  # the new world's ranks resuming at this very step rejoin
        self.need_through = -1
        self.need_by.clear()
        self.complete_by.clear()
        self.inflight.clear()
        self.layouts.clear()
        self.released_by.clear()
        self.rebuild.clear()
        self.constructors = {}
        self.pending_routes = []
        self.pending_loader_welcome = set(self.loaders)  # welcomed once the new constructors registered
        for c in old:
            self._send(c.identity, Kind.SHUTDOWN)
        if self.journal is not None:
            self.journal.spec_change(new, generation, step, step - 1, mode="reconfigure", reshard_id=rid)
            self.journal.resume(cursor, self.session)
            for event in kept:
                self.journal.update(event)
        self.m.reshards.inc()
        bb = new.topology.backbone()[1]
        log.warning("resharded at step %d (session %d, generation %d%s): dp %d pp %d cp %d tp %d, %d constructor(s)",
                    step, self.session, generation, f", reshard {rid}" if rid else "", bb.dp, bb.pp, bb.cp, bb.tp,
                    len(self.groups))
        ack = {"session": self.session, "step": step, "generation": generation, "world_size": new.world_size,
               "constructors": len(self.groups)}
        if rid is not None:
            self._remember_reshard({"reshard_id": rid, **ack})
        self._send(identity, Kind.ACK, {**ack, **({"reshard_id": rid, "duplicate": False} if rid is not None else {}),
                                        "spec": new.model_dump(mode="json")})

    def trainer_keys(self) -> list[str]:
        """Names of the rank-bound trainer keys in the key dir (`client-r<A>-<B>`), sorted; empty for an open run."""
        d = self.security.key_dir
        if not d:
            return []
        try:
            names = os.listdir(d)
        except OSError:
            return []
        return sorted(n[: -len(wire.PUBLIC_SUFFIX)] for n in names if n.startswith("client-r") and n.endswith(wire.PUBLIC_SUFFIX)
                      and wire.ranks_of_key_name(n[: -len(wire.PUBLIC_SUFFIX)]) is not None)

    def _remember_reshard(self, ack: dict[str, Any]) -> None:
        self.reshard_acks.pop(str(ack["reshard_id"]), None)
        self.reshard_acks[str(ack["reshard_id"])] = ack
        while len(self.reshard_acks) > RESHARDS_KEPT:
            del self.reshard_acks[next(iter(self.reshard_acks))]

    def _journaled_reshards(self, records: list[dict[str, Any]]) -> None:
        """After a restart: the reshard ids the journal acknowledged (answered as duplicates from now on), and the
        topology of the newest reshard, which this planner serves whatever its spec file says (a ConfigMap may be
        mounted late; the journal is what the session ran)."""
        from mixplane.spec import parse_spec

        last = None
        for r in records:
            if r.get("event") == "spec" and r.get("mode") == "reconfigure":
                last = r
                if isinstance(r.get("reshard_id"), str):
                    try:
                        sp = parse_spec(r["spec"])
                    except (OSError, ValueError, KeyError, TypeError):  # a record we cannot read names no world: skip it
                        continue
                    self._remember_reshard({"reshard_id": r["reshard_id"], "session": int(r.get("session", 0)) + 1,
                                            "step": int(r["effective_step"]), "generation": int(r["generation"]),
                                            "world_size": sp.world_size, "constructors": len(constructor_groups(sp))})
        if last is None:
            return
        try:
            journaled = parse_spec({**self.spec.model_dump(mode="json"), "topology": last["spec"]["topology"]})
        except (OSError, ValueError, KeyError, TypeError) as e:  # a damaged record: keep the spec file's topology, say why
            log.error("the journal's last reshard cannot be read (%s): serving the spec file's topology", e)
            return
        if journaled.topology != self.spec.topology:
            log.warning("the journal's last reshard (step %s) changed the topology: serving it, not the spec file's",
                        last.get("effective_step"))
            self.core.reconfigure(journaled, max(self.core.generation, int(last["generation"])))
            self.core.strategy = resolve_strategy(journaled)
            self.spec = journaled

    def _update(self, identity: bytes, msg: wire.Message) -> None:
        """UPDATE_MIXTURE: a whole mixture (mixing.mixture_update_meta) or new weights from a step on, as the next
        generation, journaled; an update id seen before is acknowledged again (``duplicate``) and changes nothing."""
        uid = msg.meta.get("update_id")
        known = isinstance(uid, str) and uid in self.core.acked
        if not known and (self.recovering is not None or self.replay_updates or self.planned_through < self.recover_through):
            self._send(identity, Kind.ERROR, {"error": "mixture update refused: the planner is recovering its session "
                                              f"(re-planning through step {max(self.recover_through, self.planned_through)}); retry"})
            return
        try:
            event, duplicate = self.core.apply_update(dict(msg.meta))
        except (ValueError, TypeError, ArithmeticError) as e:  # a peer's request must never take the planner down
            self._send(identity, Kind.ERROR, {"error": f"mixture update rejected: {e}"})
            return
        step = int(event["effective_step"])
        ack: dict[str, Any] = {"generation": int(event["generation"]), "effective_step": step, "duplicate": duplicate,
                               "planned_through": self.planned_through}
        if uid is not None:
            ack["update_id"] = uid
        if not duplicate:
            if self.journal is not None:
                self.journal.update(event)
            # a live update replaces the weights an adaptive mixture goes on from (and its configuration)
            if "mixture" in event:
                self.adaptation.replaced(event["mixture"])
            else:  # weights only: the sources it names change, the others keep their weight
                self.adaptation.reweighted(event.get("weights") or {})
            ack["phase"] = self.core.schedule.at(step).phase
            what = "mixture" if "mixture" in event else f"weights {event.get('weights')}"
            log.info("mixture generation %d from step %d (update %s): %s", self.generation, step, uid, what)
        self._send(identity, Kind.ACK, ack)

    # -- planning -----------------------------------------------------------------------
    def try_plan(self) -> int:
        planned = 0
        self.repartitioning.repartition_tick()
        while (self.halted is None and self.all_constructors and self.recovering is None
               and len(self.loaders) == len(self.core.windows)
               and not self.repartitioning.repartition_holds()
               and not self.pending_loader_welcome and self.planned_through < max(self.need_through, self.recover_through)
               and self.core.ready):
            t0 = time.perf_counter()
            self._apply_replayed_updates()
            try:
                plan = self.core.plan()
            except (SourcesExhausted, RowsShortError) as e:
                self.halted = str(e)
                log.error("planning stops: %s", e)
                break
            self._check_recovered(plan)
            self._dispatch(plan)
            self.m.plan_seconds.observe(time.perf_counter() - t0)
            planned += 1
        self.m.planner_waiting.set(len(self.core.waiting_for()))
        return planned

    def _dispatch(self, plan: StepPlan) -> None:
        lay = plan.layout
        step = lay.step
        cursor_after = self.core.cursor_later()  # its JSON written straight from the windows' state (below)
        # loader instructions: spans to the constructors of their dp rank, pixels to the encoder's; each
        # constructor's layout (select_ranks of its DP ranks) and images
        retired = plan.retired if plan.retired is not None else self.core.retired(plan.pieces)
        peers = list(self.constructors.values())
        routed = dispatch.route(plan, self.dispatch_topology, retired, [(c.index, c.dp_ranks) for c in peers])
        per_loader = routed.per_loader
        released = min(self.released_by.values(), default=-1) if len(self.released_by) == len(self.constructors) else -1
        # every PLAN_LOADER encoded at once, column by column (the same bytes as wire.encode of each)
        meta_l, loader_frames = dispatch.loader_messages(routed, self.session, step, released)
        for key, frames in zip(per_loader.loaders, loader_frames):
            self._send(self.loaders[key], Kind.PLAN_LOADER, meta_l, frames=frames)
        overflowed = self.inflight.overflowed
        self.inflight.record(step, per_loader)
        if self.inflight.overflowed > overflowed:
            log.warning("step %d: planned steps kept for loader restarts exceed %d; the oldest is forgotten before "
                        "every constructor confirmed it", step, self.inflight.max_steps)
        cursor = cursor_text_array(cursor_after.json())  # serialised once, referenced by every constructor's message
        self._remember_cursor(step + 1, cursor)
        sent: dict[int, tuple[dict[str, Any], list]] = {}
        for c, (meta, frames) in zip(peers, dispatch.constructor_messages(routed, plan, self.session, cursor)):
            self._send(c.identity, Kind.PLAN_CONSTRUCTOR, meta, frames=frames)
            sent[c.index] = (meta, frames)
        self.layouts.record(step, sent)  # what a restarted constructor gets again (the same frames)
        # bookkeeping
        if self.journal is not None:
            self.journal.step(plan)
        tok = plan.tokens_by_source
        if self._step_metrics is None:
            self._step_metrics = StepMetrics(self.m, self.names, self.core.windows)
        self._step_metrics.record(plan, self._probs_at(step), self.core.sampler.realized)
        self.m.planner_phase.set(lay.phase)
        self.m.mixture_generation.set(self.generation)
        for part, st in (plan.stats or {}).items():  # the balancer's result, per part (text, image)
            if isinstance(st, dict) and "imbalance_after" in st:
                self.m.rank_imbalance.labels(part).set(float(st["imbalance_after"]))
        self.state.tokens_planned += int(tok.sum())
        self.state.add_source_tokens(tok, time.monotonic())

    def _probs_at(self, step: int) -> np.ndarray:
        """The mixture's target at `step` (zeros once every share source has ended)."""
        try:
            return self.core.schedule.at(step).probs
        except SourcesExhausted:
            return np.zeros(len(self.names))

    def status(self) -> dict[str, Any]:
        try:
            point = self.core.schedule.at(max(self.planned_through, 0))
        except SourcesExhausted:  # the last share source ended in that step: its segment, without the mask
            seg = self.core.schedule.segment_at(max(self.planned_through, 0))
            point = MixturePoint(np.zeros(len(self.names)), seg.phase, seg.lr_scale, seg.generation, seg.start_step)
        realized = self.core.sampler.realized
        total = realized.sum()
        return {
            "planned_through": self.planned_through, "need_through": self.need_through, "session": self.session,
            "generation": self.generation, "phase": point.phase, "lr_scale": point.lr_scale,
            "sources": self.names, "target": [float(x) for x in point.probs],
            "realized_phase": [float(x / total) if total else 0.0 for x in realized],
            "tokens_planned": self.state.tokens_planned, "uptime_s": time.monotonic() - self.state.started,
            # per source (in `sources` order): tokens of every planned step, and tokens/s over the last 30 s
            "source_tokens": list(self.state.source_tokens) or [0] * len(self.names),
            "source_tokens_per_s": self.state.source_rates(time.monotonic()) or [0.0] * len(self.names),
            "waiting": [f"{self.names[w.source]}/{w.replica}" for w in self.core.waiting_for()],
            # sources that reached their end (max_epochs, oversample: false): name -> the step they ended in;
            # why planning stopped for good, if it did (docs/mixtures.md)
            "ended": dict(self.core.schedule.ended), "halted": self.halted,
            # static sources: the listing the run's positions count over, and loaders refused for reading it in
            # another order or refusing it themselves (their error)
            "listings": {self.names[si]: p.to_json() for si, p in sorted(self.core.listings.items())},
            "refused_loaders": dict(self.refused_loaders),
            "constructors": len(self.constructors), "constructors_expected": len(self.groups), "loaders": len(self.loaders),
            "peers": self.membership_status(),
            # registered components silent past the liveness miss budget: name -> seconds silent
            "silent": {n: round(s, 1) for n, s in sorted(self.silent.items())},  # every peer heard from, with seconds since its last message
            **self.hosting.hosting_status(),  # partition table: "partitions", "hosts", "handoffs" (planner.hosting)
            **self.repartitioning.repartition_status(),  # "repartitions" pending and applied, "source_partitions" now
            "incarnation": self.incarnation, "recovering": self.recovering is not None,
            "recover_through": self.recover_through,
            # the mixture updates acknowledged (newest last): update_id, generation, effective_step
            "updates": self.core.recent_updates(STATUS_UPDATES),
            # trainers' per-source loss reports: reports, through (newest step), tokens, mean (all reports) and
            # recent (the newest report of each rank) per source, None where no token was reported
            "source_loss": self.losses.status(),
            # mixture.adaptive: updates made and the weights in force (None: the mixture does not adapt)
            "adaptive": self.adaptation.status(),
            # the topology served and the reshards acknowledged by id (newest last): reshard_id, step, generation
            "world_size": self.spec.world_size, "topology_digest": self.topology_digest,
            "reshards": list(self.reshard_acks.values())[-RESHARDS_KEPT:],
            # the trainer keys this planner's key dir holds now (a projected Secret refreshed by the kubelet): the
            # operator reshards to a new world once its trainers' keys are here
            "trainer_keys": self.trainer_keys(),
        }

    # -- recovery: a restarted planner continues its session from the journal -----------------
    def _read_journal_state(self, path: str) -> tuple[RecoveryState | None, list[dict[str, Any]]]:
        """The session a predecessor of this planner left in `path` and the journal's records, or (None, [])
        (nothing to recover: a new run). A journal of another mixture, or one that cannot be read, is kept aside
        (journals/) and the run starts afresh, logged."""
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            return None, []
        try:
            records = journal_file.read_journal(path)
            opens = [r for r in records if r.get("event") == "open"]
            if opens and not same_mixture(opens[0], self.spec):
                kept = journal_file.rotate(path)
                log.warning("journal %s belongs to another mixture: kept as %s, starting afresh", path, kept)
                return None, []
            st = read_state(records)
        except (JournalError, KeyError, TypeError, ValueError) as e:
            kept = journal_file.rotate(path)
            log.error("journal %s cannot be recovered from (%s): kept as %s, starting afresh", path, e, kept)
            return None, []
        return st, (records if st is not None else [])

    def _adopt_session(self, st: RecoveryState) -> None:
        self.session = st.session
        self.session_start = json.loads(json.dumps(st.session_start))
        self.initial_cursor = json.loads(json.dumps(st.initial_cursor))
        self.core.restore(st.session_start)
        self.core.listings.update({si: pin for si, pin in st.listings.items() if 0 <= si < len(self.names)})
        self.core.remember_updates(st.history)  # their ids stay acknowledged; the newer ones are applied by _recover
        self.core.generation = max(self.core.generation, cursor_generation(st.session_start))
        # partition epochs continue above any its predecessor handed out (they are not journaled): loader
        # messages of the old incarnation's epochs are fenced, those of the re-adopted partitions are not
        base = int(time.time())
        for part in self.hosting.partitions.parts.values():
            part.epoch = max(part.epoch, base)
        log.warning("planner restarted (incarnation %s): recovering session %d (planned through step %d) from the "
                    "journal once every constructor has registered", self.incarnation, st.session, st.planned_through)

    def _registered(self, identity: bytes) -> bool:
        return (identity in self.loaders.values() or identity in self.hosting.host_ids.values()
                or any(c.identity == identity for c in self.constructors.values()))

    def _constructor_hello(self, ci: int, identity: bytes, msg: wire.Message, old: ConstructorPeer | None) -> bool:
        """Note what a registering constructor holds; True when it is a restarted constructor of a running
        session that must get the recorded layouts and spans again."""
        sess, done = msg.meta.get("session"), msg.meta.get("complete_through")
        holds = isinstance(sess, int) and sess == self.session and isinstance(done, int)
        self.hello_complete[ci] = done if holds and isinstance(done, int) else None
        cur = msg.meta.get("cursor")  # the cursor after complete_through (recovery starts there, not at the journal's)
        if holds and isinstance(cur, dict):
            self.hello_cursor[ci] = cur
        else:
            self.hello_cursor.pop(ci, None)
        if old is not None:
            self.m.constructor_rejoins.labels(str(ci)).inc()
            self.need_by.pop(old.identity, None)
            self.complete_by.pop(old.identity, None)
            self.released_by.pop(old.identity, None)
            log.warning("constructor %d said HELLO again (%s)", ci, "re-registering, it keeps its steps" if holds
                        else "restarted: it gets the layouts and spans of its recent steps again")
        return (not holds and self.recovering is None and self.layouts.first_step is not None)

    def _rebuild_constructor(self, ci: int, identity: bytes) -> None:
        """A restarted constructor: send it the recorded layouts now; the loaders are told to push their recent
        SAMPLES to it again once it asks for steps (after processing its WELCOME, so none is dropped)."""
        steps = self.layouts.for_constructor(ci)
        for _, (meta, frames) in steps:
            self._send(identity, Kind.PLAN_CONSTRUCTOR, meta, frames=frames)
        first = self.layouts.first_step
        if first is not None:
            self.rebuild[identity] = first
        log.warning("constructor %d: re-sent the layouts of %d step(s) %s", ci, len(steps),
                    f"{steps[0][0]}..{steps[-1][0]}" if steps else "")

    def _constructor_progress(self, identity: bytes, msg: wire.Message) -> None:
        """NEED_STEPS of a constructor: release layouts every constructor handed out; a restarted constructor's
        first request triggers the loaders' resend of its spans."""
        rel = msg.meta.get("released_through")
        if isinstance(rel, int):
            self.released_by[identity] = max(self.released_by.get(identity, -1), rel)
            if self.all_constructors and all(c.identity in self.released_by for c in self.constructors.values()):
                through = min(self.released_by[c.identity] for c in self.constructors.values())
                self.layouts.release(through)
                # loader plans live as long as the layouts and the loaders' kept SAMPLES frames: a step complete
                # everywhere but not yet released can still be lost by a constructor restart, and if the loader
                # that holds its frames dies too, only a replay of its plan (re-read from the stream) rebuilds it
                self.inflight.release(through)
        first = self.rebuild.pop(identity, None)
        if first is not None:
            ci = next(c.index for c in self.constructors.values() if c.identity == identity)
            for ident in self.loaders.values():
                self._send(ident, Kind.RESEND, {"session": self.session, "constructor": ci, "from_step": first})
            log.warning("constructor %d: loaders told to resend their spans of steps from %d", ci, first)

    def _on_resend_request(self, identity: bytes, msg: wire.Message) -> None:
        """A constructor got a damaged (or no) SAMPLES message of a step: every loader pushes its spans of that
        step to it again from what it kept (it drops the ones it holds)."""
        c = next((c for c in self.constructors.values() if c.identity == identity), None)
        if c is None or msg.get("constructor", int) != c.index:
            raise WireError("RESEND from a peer that is not that registered constructor")
        if msg.get("session", int) != self.session:
            return
        meta = {"session": self.session, "constructor": c.index, "from_step": msg.get("from_step", int)}
        if isinstance(msg.meta.get("to_step"), int):
            meta["to_step"] = msg.meta["to_step"]
        for ident in self.loaders.values():
            self._send(ident, Kind.RESEND, meta)

    def _recover(self) -> None:
        """Every constructor registered: restore the newest journal anchor at or before the first step one of
        them may miss, and plan again from there through the predecessor's last step (identical plans)."""
        st = self.recovering
        assert st is not None
        start = int(self.session_start["step"])
        first = min(start if done is None else done + 1 for done in self.hello_complete.values())
        anchor = st.anchor(first)
        # re-plan only what a constructor may miss: from the cursor of `first` that a constructor holds (the
        # cursor after its last complete step), else from the journal's newest anchor before it (up to
        # journal_every steps earlier). Each re-planned step is checked against its journaled digest.
        held = [c for ci, c in sorted(self.hello_cursor.items()) if self.hello_complete.get(ci) == first - 1]
        if held and first > anchor.step and self.recovering_cursor_ok(held[0], first):
            anchor = Anchor(first, held[0], "constructor", -1)
        anchor = self.repartitioning.recovery_anchor(anchor, st.anchors)  # never across a re-partition (planner.repartitioning)
        self.core.restore(anchor.cursor)
        gen = cursor_generation(anchor.cursor)
        self.replay_updates = st.updates_after(gen)
        self.core.generation = max([gen, *(int(u["generation"]) for _, u in self.replay_updates)])
        self.recover_through = st.planned_through
        self.recover_digests = dict(st.digests)
        self.need_through = max(self.need_through, st.planned_through)
        if self.journal is not None:
            self.journal.recover(anchor.cursor, self.session, st.planned_through, self.incarnation)
        self.recovering = None
        self.m.planner_recoveries.inc()
        done = {i: d for i, d in sorted(self.hello_complete.items())}
        if anchor.step > st.planned_through:
            log.warning("recovering session %d: nothing to re-plan (constructors complete through %s); recovery "
                        "complete: planning continues at step %d", self.session, done, anchor.step)
            return
        log.warning("recovering session %d: re-planning steps %d..%d from the %s at step %d (constructors "
                    "complete through %s)", self.session, anchor.step, st.planned_through,
                    "cursor a constructor holds" if anchor.index < 0 else f"journal's {anchor.event}", anchor.step, done)

    def recovering_cursor_ok(self, cursor: dict[str, Any], step: int) -> bool:
        """A constructor's cursor for `step` that this planner can restore (else the journal's anchor is used)."""
        try:
            if int(cursor["step"]) != step:
                return False
            self.core.restore(cursor)  # validates it (restored again by the caller)
        except Exception as e:  # noqa: BLE001 - a peer's cursor must never take the planner down
            log.warning("a constructor's cursor of step %d cannot be restored (%s): recovering from the journal", step, e)
            return False
        return True

    def _apply_replayed_updates(self) -> None:
        """Journaled mixture updates newer than the recovery anchor, applied where they were applied first."""
        while self.replay_updates and self.replay_updates[0][0] <= self.core.next_step:
            _, u = self.replay_updates.pop(0)
            event = self.core.apply_event(u)
            if "adaptive" in u:  # the adaptive state it carried stays with it (the next restart reads it)
                event["adaptive"] = u["adaptive"]
            if self.journal is not None:
                self.journal.update(event)

    def _check_recovered(self, plan: StepPlan) -> None:
        step = plan.layout.step
        if step > self.recover_through:
            return
        self.m.recovered_steps.inc()
        want = self.recover_digests.get(step)
        if want is not None and want != layout_digest(plan.layout):
            self.m.recovery_mismatches.inc()
            log.error("step %d re-planned after the restart differs from the journal (digest %s != %s): the loaders' "
                      "announcements were not those of the first planning", step, layout_digest(plan.layout), want)
        if step == self.recover_through:
            log.warning("recovery complete: steps through %d planned again", step)

    # -- loop ---------------------------------------------------------------------------
    def on_liveness(self, now: float) -> None:
        """Beat to every registered loader, loader host and constructor each interval; report the ones gone silent
        (a host watches the planner on its own socket: without beats it reported the planner silent 3 beats after
        registering, in every run, which read like a cause in the k8s tier's failure logs)."""
        if not self.liveness.due():
            return
        peers = {ident: "loader" for ident in self.loaders.values()}
        peers.update({c.identity: "constructor" for c in self.constructors.values()})
        for ident in [*peers, *self.hosting.host_ids.values()]:  # a beat that cannot go out is what the silence check reports
            self.send_routed(self.sock, ident, Kind.HEARTBEAT, {"t": time.time(), "incarnation": self.incarnation}, quiet=True)
        self.watch({**{peer_name(i): what for i, what in peers.items()}, **self.hosting.hosts_watched()})

    def tick(self) -> None:
        self.hosting.hosting_tick(time.monotonic())
        self.try_plan()

    def close(self) -> None:
        for ident in [*self.loaders.values(), *self.hosting.host_ids.values()]:
            self._send(ident, Kind.SHUTDOWN)
        for c in self.constructors.values():
            self._send(c.identity, Kind.SHUTDOWN)
        if self.journal is not None:
            self.journal.close()
            self.journal = None
        # plans and SHUTDOWNs still queued leave after close (bounded): linger 0 dropped the last steps' plans
        self.sock.close(linger=CLOSE_LINGER_MS)
