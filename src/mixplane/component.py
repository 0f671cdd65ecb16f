"""The base of the three servers (planner, Data Constructor, Source Loader).

What every component does with its sockets lives here once, so that liveness, reconnects and
failover are written once too:

- a handler table per socket keyed by message :class:`~mixplane.wire.Kind` (no if/elif chains);
  every received message is decoded, checked against its schema (:func:`protocol.check`) and
  against the sender's role (:func:`protocol.allowed`) before its handler runs;
- bad messages (undecodable, wrong content, wrong role, undeliverable replies) are counted in
  ``mixplane_wire_bad_messages_total{reason}`` / ``mixplane_wire_refused_total`` and logged at a
  bounded rate (:class:`RateLimitedLog`), so a hostile peer can neither crash a component nor
  flood its log;
- routed, non-blocking sends that survive every error a departed or misbehaving peer can cause
  (:meth:`Component.send_routed`);
- registration (HELLO) with retry until the planner answers;
- membership: every peer heard from, with its last-seen time (:class:`Membership`, in STATUS);
- the poll loop with a liveness hook (:meth:`Component.on_liveness`) where heartbeats and peer
  timeouts plug in.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import zmq

from mixplane import protocol, wire
from mixplane.metrics import make_metrics, serve_metrics
from mixplane.wire import Kind, WireError

Handler = Callable[[bytes, wire.Message], None]
DRAIN_BATCH = 1000  # messages taken from one socket before the others (and the component's own work) get a turn
HELLO_RETRY_S = 1.0
LIVENESS_MAX_INTERVAL_S = 1.0  # application heartbeats at least this often (runtime.heartbeat_s if smaller)
LIVENESS_MISSES = 3  # a peer silent for this many intervals is reported silent


# ------------------------------------------------------------------------------------------------ pure parts
class RateLimitedLog:
    """At most `burst` lines per `every_s` seconds per key; the next line says how many were suppressed.

    A peer sending thousands of bad messages costs a few lines, and the counts stay in the metrics."""

    def __init__(self, logger: logging.Logger, *, every_s: float = 10.0, burst: int = 5,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.every_s = every_s
        self.burst = burst
        self.clock = clock
        self._window: dict[str, tuple[float, int, int]] = {}  # key -> (window start, lines, suppressed)

    def log(self, level: int, key: str, fmt: str, *args: Any) -> bool:
        """Log unless `key` spent its burst in the current window; True when a line was written."""
        now = self.clock()
        start, lines, suppressed = self._window.get(key, (now, 0, 0))
        if now - start >= self.every_s:
            start, lines = now, 0
        if lines >= self.burst:
            self._window[key] = (start, lines, suppressed + 1)
            return False
        if suppressed:
            fmt = fmt + " (%d similar lines suppressed)"
            args = (*args, suppressed)
        self._window[key] = (start, lines + 1, 0)
        self.logger.log(level, fmt, *args)
        return True


@dataclass
class Peer:
    """One peer a component has heard from."""

    name: str
    role: str = ""
    first_seen: float = 0.0
    last_seen: float = 0.0
    messages: int = 0


class Membership:
    """Who a component has heard from and when (monotonic clock); peers that stop talking stay
    visible with a growing silence, before anything acts on it. Bounded: beyond `max_peers` the
    longest-silent peer is forgotten (a flood of one-shot peers cannot grow memory)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_peers: int = 1024):
        self.clock = clock
        self.max_peers = max_peers
        self.peers: OrderedDict[str, Peer] = OrderedDict()  # least recently seen first

    def seen(self, name: str, role: str = "") -> None:
        now = self.clock()
        p = self.peers.get(name)
        if p is None:
            while len(self.peers) >= self.max_peers:
                self.peers.popitem(last=False)
            p = self.peers[name] = Peer(name, role, now, now)
        else:
            self.peers.move_to_end(name)
        p.last_seen = now
        p.messages += 1
        if role:
            p.role = role

    def silent_for(self, name: str) -> float | None:
        p = self.peers.get(name)
        return None if p is None else self.clock() - p.last_seen

    def forget(self, name: str) -> None:
        self.peers.pop(name, None)

    def status(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        return {n: {"role": p.role, "last_seen_s": round(now - p.last_seen, 3), "messages": p.messages}
                for n, p in sorted(self.peers.items())}


def peer_name(identity: bytes) -> str:
    """A printable name of a ROUTER identity (component identities are ASCII, random ones are not)."""
    try:
        s = identity.decode("ascii")
        if s.isprintable():
            return s
    except UnicodeDecodeError:
        pass
    return "0x" + identity.hex()


def message_identity(frame: Any, curve: bool) -> tuple[str, protocol.Ranks | None]:
    """The sender's role and bound ranks: from the ZAP User-Id of a CURVE peer (set by
    wire.Authenticator from its key file), else anonymous and unbound."""
    if not curve:
        return protocol.ANONYMOUS, None
    try:
        uid = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError, TypeError):
        return protocol.ANONYMOUS, None
    uid = uid.decode() if isinstance(uid, bytes) else str(uid or "")
    return protocol.parse_user_id(uid)  # authenticated, unknown role: a client without control rights


# ------------------------------------------------------------------------------------------------ the base
@dataclass
class Endpoint:
    """One socket of a component and what to do with what arrives on it."""

    sock: Any
    label: str  # "planner", "data", "client": names the socket in logs
    handlers: dict[Kind, Handler]
    routed: bool = False  # a ROUTER: the first frame is the peer's identity
    server: bool = False  # bound: anyone who can reach it may send (a connected socket talks to the peer we chose)
    curve: bool = False  # a CURVE server: the sender's role comes from its key
    members: bool = True  # record senders in the membership table
    monitor: Any = None  # CURVE servers: handshake failures (peers refused before any message) are counted
    connects: bool = False  # the monitor also reports (re)connections (a follower's planner socket)


#: socket-monitor events of a refused connection, by the reason label they are counted under
HANDSHAKE_FAILURES: dict[int, str] = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth", zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
                      zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "other"}


class Component:
    """Sockets, handler tables, accounting and the poll loop; subclasses add their sockets and work."""

    component = "component"  # metrics label and log prefix of the kind of component

    def __init__(self, spec: Any, name: str, *, context: zmq.Context | None = None, metrics_port: int | None = 0,
                 logger: logging.Logger | None = None):
        self.spec = spec
        self.name = name
        self.ctx = context or zmq.Context.instance()
        self.log = logger or logging.getLogger(f"mixplane.{self.component}")
        self.limited = RateLimitedLog(self.log)
        self.m = make_metrics(self.component)
        rt = spec.runtime
        self.metrics_port = serve_metrics(self.m, rt.host, metrics_port) if (rt.metrics and metrics_port is not None) else None
        self.security = wire.Security(self.ctx, rt.curve, role=protocol.COMPONENT)
        # anonymous peers may send control kinds only when the spec opens the run on purpose
        self.open_run = rt.security == "open"
        # rank claims (GET_STEP, ROUTE, RESUME) bound to rank keys: required when the spec says so, or
        # (auto) when the key directory holds rank-bound client keys
        binding = rt.rank_binding
        self.ranks_required = self.security.enabled and (
            binding == "required" or (binding == "auto" and wire.has_rank_keys(self.security.key_dir or "")))
        self.members = Membership()
        # application-level liveness: beat every interval; peers silent past the miss budget are reported
        self.liveness = wire.Liveness(min(LIVENESS_MAX_INTERVAL_S, float(rt.heartbeat_s)), LIVENESS_MISSES)
        self.silent: dict[str, float] = {}  # watched peer -> seconds it had been silent when it was found silent
        self.endpoints: list[Endpoint] = []
        self.stopped = False
        self.welcomed = True  # components that register (HELLO) set this False until the planner answers
        self._last_hello = 0.0

    # -- sockets --------------------------------------------------------------------------------------------
    def add_endpoint(self, sock: Any, label: str, handlers: Mapping[Kind, Handler], *, routed: bool = False,
                     server: bool = False, members: bool = True) -> Endpoint:
        """Register a socket (configured and bound / connected by the caller) and its handler table."""
        e = Endpoint(sock, label, dict(handlers), routed, server, server and self.security.enabled, members)
        # a follower's planner socket: a reconnection (a restarted planner bound its endpoint again) is acted on at
        # once (on_connected), not at the next beat
        e.connects = label == "planner" and not server and getattr(self, "follows_planner", False)
        if e.curve or e.connects:
            events = zmq.EVENT_CONNECTED if e.connects else 0
            for ev in HANDSHAKE_FAILURES if e.curve else ():
                events |= ev
            try:
                e.monitor = sock.get_monitor_socket(events)
            except zmq.ZMQError as err:  # counting is best effort; the socket works without it
                self.log.warning("%s: no handshake monitor on the %s socket (%s)", self.name, label, err)
        self.endpoints.append(e)
        return e

    def drain_monitors(self) -> int:
        """Count connections refused during the handshake (no CURVE, a stranger's key, garbage): the
        peer never got a message in, so this is where an unauthenticated SHUTDOWN shows up."""
        from zmq.utils.monitor import parse_monitor_message

        n = 0
        for e in self.endpoints:
            while e.monitor is not None:
                try:
                    frames = e.monitor.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.ZMQError:  # zmq.Again: nothing (more) to read
                    break
                try:
                    ev = parse_monitor_message(frames)
                except (ValueError, IndexError, TypeError):
                    continue
                if e.connects and int(ev.get("event", 0)) == zmq.EVENT_CONNECTED:
                    self.on_connected(e)
                    continue
                reason = HANDSHAKE_FAILURES.get(int(ev.get("event", 0)))
                if reason is None:
                    continue
                n += 1
                self.m.handshakes_failed.labels(self.component, e.label, reason).inc()
                self.limited.log(logging.WARNING, f"handshake-{reason}", "%s: refused a connection to the %s socket "
                                 "during the handshake (%s: %s)", self.name, e.label, reason,
                                 ev.get("endpoint", b"").decode(errors="replace") if isinstance(ev.get("endpoint"), bytes)
                                 else ev.get("endpoint"))
        return n

    def on_connected(self, e: Endpoint) -> None:
        """A connected socket (re)connected to its peer (see Endpoint.connects)."""

    def entry(self, label: str) -> Endpoint:
        return next(e for e in self.endpoints if e.label == label)

    # -- accounting -----------------------------------------------------------------------------------------
    def bad(self, reason: str, what: str, *args: Any, level: int = logging.WARNING) -> None:
        """Count a dropped message under `reason` and log it at a bounded rate."""
        self.m.bad_messages.labels(self.component, reason).inc()
        self.limited.log(level, reason, "%s: " + what, self.name, *args)

    def refuse(self, kind: Kind, role: str, sender: str) -> None:
        self.m.refused.labels(self.component, kind.name, role).inc()
        self.m.bad_messages.labels(self.component, "refused").inc()
        self.limited.log(logging.WARNING, "refused", "%s: refused %s from %s (role %s%s)", self.name, kind.name,
                         sender, role, "" if role != protocol.ANONYMOUS else ": control needs an authenticated peer "
                         "(CURVE) unless runtime.security is 'open'")

    def refuse_rank(self, e: Endpoint, identity: bytes, msg: wire.Message, role: str, ranks: protocol.Ranks | None,
                    sender: str) -> None:
        """A rank claim the sender's key does not cover: counted and logged like any refusal, and answered
        (the peer is authenticated) so that a misconfigured trainer fails at once, not after its timeout."""
        self.m.refused.labels(self.component, msg.kind.name, role).inc()
        self.m.bad_messages.labels(self.component, "refused").inc()
        claim = msg.meta.get("rank", "none")
        held = "no rank (a shared client key)" if ranks is None else f"ranks {ranks[0]}..{ranks[1]}"
        why = f"{msg.kind.name} for rank {claim} refused: this client's key is bound to {held}"
        if ranks is None:
            why += " and this run requires rank-bound keys (client-r<rank> in the key directory)"
        self.limited.log(logging.WARNING, "refused-rank", "%s: %s (from %s)", self.name, why, sender)
        if e.routed:
            self.send_routed(e.sock, identity, Kind.ERROR, {"error": why}, quiet=True)

    # -- receiving ------------------------------------------------------------------------------------------
    def dispatch(self, e: Endpoint, identity: bytes, msg: wire.Message, role: str = protocol.COMPONENT) -> None:
        """Run the handler of `msg.kind` on endpoint `e` after the schema and role checks (WireError if bad)."""
        handler = e.handlers.get(msg.kind)
        if handler is None:
            raise WireError(f"unexpected {msg.kind.name} on the {e.label} socket")
        protocol.check(msg)
        handler(identity, msg)

    def drain(self, e: Endpoint, limit: int = DRAIN_BATCH) -> int:
        """Handle up to `limit` waiting messages of one socket; every bad one is counted and dropped."""
        n = 0
        for n in range(1, limit + 1):
            try:
                frames = e.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n - 1
            except zmq.ZMQError as err:  # e.g. the socket was closed under us: nothing more to read
                self.bad("receive", "receive on the %s socket failed: %s", e.label, err)
                return n - 1
            identity = b""
            if e.routed:
                if len(frames) < 2:
                    self.bad("decode", "dropped an empty message on the %s socket", e.label)
                    continue
                identity = frames[0].bytes
                frames = frames[1:]
            try:
                msg = wire.decode(frames)
            except WireError as err:
                self.bad("decode", "dropped a bad message on the %s socket from %s: %s", e.label, peer_name(identity), err)
                self.on_damaged(e, identity, frames, err)
                continue
            # on a socket we connected (to the planner, whose server key we checked) the peer is a component
            role, ranks = message_identity(frames[0], e.curve) if e.server else (protocol.COMPONENT, None)
            sender = peer_name(identity) if e.routed else e.label
            if not protocol.allowed(msg.kind, role, open_run=self.open_run):
                self.refuse(msg.kind, role, sender)
                continue
            if not protocol.rank_claim_ok(msg.kind, msg.meta, role, ranks, required=self.ranks_required):
                self.refuse_rank(e, identity, msg, role, ranks, sender)
                continue
            if e.members:
                self.members.seen(sender, role)
            try:
                self.dispatch(e, identity, msg, role)
            except WireError as err:
                self.bad("content", "dropped a %s message from %s: %s", e.label, sender, err)
        return n

    # -- sending --------------------------------------------------------------------------------------------
    def send_routed(self, sock: Any, identity: bytes, kind: Kind, meta: Mapping[str, Any] | None = None,
                    arrays: Mapping[str, np.ndarray] | None = None, *, checksum: bool | None = None,
                    quiet: bool = False, frames: list | None = None) -> bool | None:
        """Send to one peer of a ROUTER without blocking: True when sent, None when its queue is full
        (the caller may retry: backpressure), False when it cannot be delivered (gone, unknown, any
        other transport error): counted as undeliverable and logged at a bounded rate, never raised.
        ``quiet``: a liveness beat, whose loss is what liveness measures, is not counted as a bad message.
        ``frames``: the message already encoded (wire.encode_columns: many messages encoded at once)."""
        try:
            if frames is None:
                wire.send(sock, kind, meta, arrays, route=[identity], flags=zmq.NOBLOCK, checksum=checksum)
            else:  # send_multipart's sends, without its per-frame checks; copied (ZeroMQ copies frames under
                # 64 kB even with copy=False, and a zero-copy frame costs more than copying a plan's sizes)
                send, more = sock.send, zmq.SNDMORE | zmq.NOBLOCK
                send(identity, more)
                for f in frames[:-1]:
                    send(f, more)
                send(frames[-1], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return None
        except zmq.ZMQError as err:  # EHOSTUNREACH (ROUTER_MANDATORY), ENOTSOCK, ETERM, ...
            if not quiet:
                self.bad("undeliverable", "%s to %s not delivered: %s", kind.name, peer_name(identity), err)
            return False

    def send_direct(self, sock: Any, kind: Kind, meta: Mapping[str, Any] | None = None,
                    arrays: Mapping[str, np.ndarray] | None = None, *, checksum: bool | None = None,
                    quiet: bool = False) -> bool:
        """Send on a connected DEALER / PUSH socket without blocking; False (counted unless ``quiet``) when
        it cannot go now."""
        try:
            wire.send(sock, kind, meta, arrays, flags=zmq.NOBLOCK, checksum=checksum)
            return True
        except zmq.ZMQError as err:
            if not quiet:
                self.bad("undeliverable", "%s not sent: %s", kind.name, err)
            return False

    # -- registration ---------------------------------------------------------------------------------------
    def hello(self) -> None:
        """Send the registration message (components that register override this)."""

    def registration_tick(self, now: float) -> None:
        if not self.welcomed and now - self._last_hello > HELLO_RETRY_S:
            self.hello()

    def mark_hello(self) -> None:
        self._last_hello = time.monotonic()

    # -- hooks ----------------------------------------------------------------------------------------------
    def on_damaged(self, e: Endpoint, identity: bytes, frames: list[Any], err: WireError) -> None:
        """A message that failed to decode (damaged, truncated): payload integrity handling plugs in here
        (count it by sender, ask for it again). It was counted and logged as a bad message already."""

    def on_liveness(self, now: float) -> None:
        """Called every loop turn: heartbeats and peer timeouts of the fault-tolerance work plug in here."""

    def watch(self, watched: Mapping[str, str]) -> None:
        """Check the peers this component depends on (name -> what they are, for the log line): one found
        silent for longer than the miss budget is logged with its name, counted and listed in
        :attr:`silent` (STATUS) until it talks again."""
        budget = self.liveness.misses * self.liveness.interval_s
        for name, what in watched.items():
            quiet = self.members.silent_for(name)
            if quiet is None:
                continue
            if quiet > budget:
                if name not in self.silent:
                    self.m.liveness_detections.labels(self.component, name).inc()
                    self.log.warning("%s: %s %s silent for %.1f s (missed %d heartbeats of %.1f s)", self.name, what, name,
                                     quiet, self.liveness.misses, self.liveness.interval_s)
                self.silent[name] = quiet
            elif name in self.silent:
                self.log.warning("%s: %s %s talks again after %.1f s", self.name, what, name, self.silent.pop(name))
        for name in [n for n in self.silent if n not in watched]:
            del self.silent[name]
        self.m.silent_peers.labels(self.component).set(len(self.silent))

    def tick(self) -> None:
        """The component's own work after the sockets were drained (planning, serving pending requests)."""

    def poll_timeout_ms(self) -> int:
        return 100

    # -- loop -----------------------------------------------------------------------------------------------
    def run(self, *, max_seconds: float | None = None) -> None:
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        poller = zmq.Poller()
        for e in self.endpoints:
            poller.register(e.sock, zmq.POLLIN)
        if not self.welcomed:
            self.hello()
        try:
            while not self.stopped and (deadline is None or time.monotonic() < deadline):
                events = dict(poller.poll(self.poll_timeout_ms()))
                now = time.monotonic()
                self.registration_tick(now)
                for e in self.endpoints:
                    if e.sock in events:
                        self.drain(e)
                self.drain_monitors()
                self.on_liveness(now)
                self.tick()
        finally:
            self.close()

    def membership_status(self) -> dict[str, dict[str, Any]]:
        return self.members.status()

    def close(self) -> None:
        for e in self.endpoints:
            if e.monitor is not None:
                try:
                    e.sock.disable_monitor()
                except zmq.ZMQError:
                    pass
                e.monitor.close(0)
                e.monitor = None
            e.sock.close(0)


class PlannerFollower(Component):
    """A component the planner steers (Source Loaders, Data Constructors): it registers with HELLO, stops on
    the planner's SHUTDOWN, and beats to the planner so that either side notices the other going silent."""

    planner: Any  # the DEALER to the planner, set by the subclass
    planner_incarnation: str | None = None  # the incarnation of the planner that welcomed this component
    follows_planner = True  # its planner socket reports reconnections (on_connected)

    def _on_shutdown(self, _: bytes, msg: wire.Message) -> None:
        self.stopped = True

    def _ignore(self, _: bytes, msg: wire.Message) -> None:
        pass

    def note_incarnation(self, msg: wire.Message) -> None:
        """Remember which planner process welcomed this component (WELCOME's ``incarnation``)."""
        inc = msg.meta.get("incarnation")
        if isinstance(inc, str):
            self.planner_incarnation = inc

    def _on_planner_heartbeat(self, _: bytes, msg: wire.Message) -> None:
        """A beat of another planner incarnation than the one that welcomed us: the planner was restarted
        (and recovers from its journal). Register again; the WELCOME says where to continue."""
        inc = msg.meta.get("incarnation")
        if not isinstance(inc, str) or self.planner_incarnation is None or inc == self.planner_incarnation:
            return
        if self.welcomed:
            self.log.warning("%s: the planner was restarted (incarnation %s -> %s): saying HELLO again", self.name,
                             self.planner_incarnation, inc)
            self.welcomed = False
            self.hello()

    def on_connected(self, e: Endpoint) -> None:
        """The planner socket reconnected: a restarted planner may be listening there now. Beat to it at once (it
        answers a component it has not registered with its incarnation: we say HELLO again) instead of at the
        next interval -- up to a second of a planner's restart."""
        if e.label == "planner" and self.welcomed:
            self.send_direct(self.planner, Kind.HEARTBEAT, {"t": time.time(), "role": self.component}, quiet=True)

    def on_liveness(self, now: float) -> None:
        """Beat to the planner each interval (once registered) and report it when it goes silent."""
        if self.welcomed and self.liveness.due():
            self.send_direct(self.planner, Kind.HEARTBEAT, {"t": time.time(), "role": self.component}, quiet=True)
            self.watch({"planner": "planner"})
