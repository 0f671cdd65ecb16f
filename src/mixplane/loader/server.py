"""Source Loader: reads one partition of one source, keeps a window of transformed samples,
reports their metadata to the planner and ships planned spans straight to constructors.

Thin shell: the stream (`loader.stream`) and transforms (`loader.transforms`) do the work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

import numpy as np
import zmq

from mixplane import protocol, wire
from mixplane.component import DRAIN_BATCH, Component, Endpoint, PlannerFollower
from mixplane.loader import snapshot
from mixplane.loader.files import SourceFiles
from mixplane.loader.hooks import apply_loader_hook, load_loader_hook
from mixplane.loader.listing import find_kept, keep_listing, listing_digest
from mixplane.loader.stream import open_stream
from mixplane.repartition import layouts_after
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.loader.workers import resolve_workers
from mixplane.metrics import handoff_metrics
from mixplane.protocol import WindowCursor
from mixplane.spec import DataMixtureSpec, overlong_limit, pack_bucket
from mixplane.wire import Kind, WireError

log = logging.getLogger("mixplane.loader")
EXIT_LISTING = protocol.EXIT_LISTING  # the process's exit status when a partition must not serve the run
REFUSAL_ACK_S = 2.0  # how long a loader that refuses the run waits for the planner to acknowledge hearing it


class LoaderServer(PlannerFollower):
    component = "loader"

    def __init__(self, spec: DataMixtureSpec, source_index: int, replica: int, planner_endpoint: str,
                 *, context: zmq.Context | None = None, metrics_port: int | None = 0, epoch: int = 0,
                 host: str | None = None, mode: str = "primary", state_dir: str | None = None,
                 partitioning: list[dict[str, Any]] | None = None):
        """`mode`: "primary" serves the partition at `epoch` (connects to the planner and says HELLO);
        "shadow" keeps a warm window that follows the planner's cursor and sends nothing; "dormant"
        holds the partition open and does nothing. A host (loader.host) switches modes as the planner's
        partition table says (`serve`, `follow`, `release`). `partitioning`: the source's re-partition records
        (ADOPT of a re-partitioned source): the partition reads its layout (mixplane.repartition)."""
        source = spec.sources[source_index]
        super().__init__(spec, f"loader:{source.name}:{replica}", context=context, metrics_port=metrics_port, logger=log)
        self.si = source_index
        self.source = source
        self.replica = replica
        self.planner_endpoint = planner_endpoint
        self.host = host  # the loader process hosting this partition (None: started on its own)
        self.epoch = epoch  # fencing token of the current assignment (planner.partitions)
        self.mode = "dormant"
        self.planner: zmq.Socket | None = None
        self.hm = handoff_metrics(self.m)
        self.welcomed = False
        self.pushers: list[zmq.Socket] = []
        # per constructor: encoded SAMPLES messages in plan order, sent without blocking as room appears,
        # so a slow or dead constructor stalls only its own queue, never the poll loop (or a source group)
        self.outbox: list[deque[list[Any]]] = []
        self._outbox_stuck_since: float | None = None
        self.last_plan = time.monotonic()  # when the planner last asked for a step (a sidecar's end waits for quiet)
        self.constructor_endpoints: list[str] = []
        self.partitioning = list(partitioning or [])
        # hooks.loader: loaded before any file or socket opens (one that cannot be loaded stops the start, named)
        self.hook = load_loader_hook(spec, source.name)
        self.hook_calls = 0
        # why this loader must not serve (the run's listing of its source cannot be read here; it stops, and the
        # process exits with EXIT_LISTING): None while it may
        self.refused: str | None = None
        self._open_stream(None)  # a static source: its kept listing or the store listed (loader.listing)
        self._quarantined_seen = 0
        self._bad_samples_seen = 0
        self._dropped_seen = 0
        self._remote_seen = (0, 0, 0, 0)  # requests, bytes, retries, cache hits already counted
        self._overlong_seen: dict[str, int] = {}  # documents cut / split already counted
        self._listing_sent = -1  # files of the live listing the planner heard of this session (-1: none yet)
        self._last_status_line = 0.0
        self.session = -1
        # after a restart: re-reading the stream to resend the spans of steps planned before (no announcements
        # until the planner's SEEK to the window's cursor ends the replay)
        self.replaying = False
        self._warm_seen = 0
        self._release_pending = False
        # differential checkpoints (loader.snapshot): every `loader_snapshot_every` planned steps, into state_dir
        self.state_dir = state_dir
        self.snapshot_every = int(spec.runtime.loader_snapshot_every) if state_dir else 0
        self._plans_since_snapshot = 0
        self.snapshot_seconds = 0.0  # time spent writing snapshots (bench/loader_checkpoint.py reports it)
        self.snapshots_written = 0
        # SAMPLES already sent, per step and constructor, until every constructor handed the step to all its
        # ranks (PLAN_LOADER's released_through): pushed again to a restarted constructor (RESEND)
        lead = spec.runtime.max_lead_steps + 2 * spec.runtime.prefetch_steps + 2
        self.sent: dict[int, dict[int, list[Any]]] = {}
        self.sent_max_steps = 4 * lead + 64
        if mode == "primary":
            self.serve(epoch)
        elif mode == "shadow":
            self.mode = "shadow"
            self._shadow_budget()
        elif mode != "dormant":
            raise ValueError(f"loader mode {mode!r}: expected primary, shadow or dormant")

    def _open_stream(self, files: SourceFiles | None) -> None:
        """The partition's stream over `files` (None: the source's listing, `loader.listing.source_listing`) and its
        window."""
        spec, source = self.spec, self.source
        parts = int(self.partitioning[-1]["partitions"]) if self.partitioning else source.replicas
        self.stream = open_stream(source, seed=spec.mixture.seed, partition=self.replica, num_partitions=parts,
                                  **({"files": files} if files is not None else {}))
        if self.partitioning:
            self.stream.set_layout(layouts_after(source.replicas, self.partitioning, self.stream.epoch_rows,
                                                 source=source.name)[self.replica])
        self.window = LoaderWindow(self.stream, make_transform(source), spec.window_bounds(self.si), self._on_read,
                                   read_timeout=0.2 if source.live else None, drop_longer_than=overlong_limit(spec),
                                   workers=resolve_workers(source.workers), bucket=pack_bucket(source))
        # a static source: the listing and read order its positions count over (HELLO `listing`; the planner pins
        # the run's and has a loader of another listing reopen its stream with the run's kept one)
        self.listing_pin = None if source.live else protocol.ListingPin(
            listing_digest(self.stream.files), len(self.stream.files.paths), str(self.stream.order))

    def _reopen(self, pinned: protocol.ListingPin) -> None:
        """Read the run's listing `pinned` (WELCOME `reopen`: nothing was read for the planner yet): the stream is
        opened again over the listing the run kept, then this loader says HELLO again. Not kept here: refused."""
        assert self.listing_pin is not None
        files = find_kept(self.source, pinned.digest)
        if files is None:
            self._refuse(protocol.listing_not_kept(self.source.name, pinned, self.listing_pin))
            return
        keep_listing(self.source, files)  # kept again: the run's listing stays among the kept ones while it is read
        log.warning("%s: reopening its stream with the run's listing (%d files, digest %s; the store lists %d files, "
                    "digest %s now)", self.name, pinned.files, pinned.digest, self.listing_pin.files,
                    self.listing_pin.digest)
        self.window.close()
        self.stream.close()
        self._open_stream(files)
        self._warm_seen = self._quarantined_seen = self._bad_samples_seen = self._dropped_seen = 0
        self._remote_seen, self._overlong_seen = (0, 0, 0, 0), {}  # the new stream and window count from zero

    def _refuse(self, why: str, *, tell: bool = True) -> None:
        """This loader must not serve: said once (to the planner too unless it refused this loader: ``tell``), it
        stops (its process exits with EXIT_LISTING)."""
        if self.refused is not None:
            return
        log.error("%s: %s", self.name, why)
        self.refused = why
        if tell and not self._tell_refusal(why):
            log.warning("%s: the planner did not acknowledge the refusal within %.1f s (its STATUS may not name this "
                        "loader)", self.name, REFUSAL_ACK_S)
        self.welcomed = False
        self.stopped = True  # its sockets close with it (the poll loop leaves a stopped loader alone)

    def _tell_refusal(self, why: str) -> bool:
        """Say to the planner that this loader refuses the run (HELLO ``refused``: its STATUS ``refused_loaders`` names
        it with `why`), and wait up to REFUSAL_ACK_S for its ACK: the process stops right after, and a message still
        queued in the socket would go with it. What else arrives meanwhile is dropped (nothing is served any more).
        True when acknowledged."""
        if self.planner is None:
            return False
        try:
            wire.send(self.planner, Kind.HELLO, {**self._hello_meta(), "refused": why}, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("%s: the refusal was not sent to the planner: %s", self.name, e)
            return False
        deadline = time.monotonic() + REFUSAL_ACK_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                if not self.planner.poll(max(1, int(left * 1000)), zmq.POLLIN):
                    return False
                _, msg = wire.recv(self.planner, flags=zmq.NOBLOCK)
            except WireError:
                continue
            except zmq.ZMQError:
                return False
            if msg.kind == Kind.ACK and msg.meta.get("refused") == f"{self.source.name}/{self.replica}":
                return True
        return False

    # -- modes (partition handoff) ----------------------------------------------------------
    @property
    def shadow(self) -> bool:
        return self.mode == "shadow"

    def serve(self, epoch: int) -> None:
        """Become the partition's primary at `epoch`: a planner socket named for this epoch (an older
        incarnation's socket can never pass for it), then HELLO; the window stays as warm as it is."""
        self._disconnect()
        self.epoch = epoch
        self.mode = "primary"
        self.name = protocol.loader_identity(self.source.name, self.replica, epoch)
        self.planner = self.ctx.socket(zmq.DEALER)
        self.planner.setsockopt(zmq.IDENTITY, self.name.encode())
        wire.configure_socket(self.planner, heartbeat_s=self.spec.runtime.heartbeat_s,
                              max_msgsize=protocol.max_message_bytes(self.spec, "loader"))
        self.security.client(self.planner).connect(self.planner_endpoint)  # CURVE when configured
        self.add_endpoint(self.planner, "planner", {
            Kind.WELCOME: self._on_welcome, Kind.PLAN_LOADER: self._on_plan, Kind.SEEK: self._on_seek,
            Kind.RELEASE: self._on_release, Kind.SHUTDOWN: self._on_shutdown, Kind.HEARTBEAT: self._on_planner_heartbeat,
            Kind.RESEND: self._on_resend})
        self.window.read_ahead_tokens = self.window.min_tokens
        self.welcomed = False
        self.replaying = False
        self._last_hello = 0.0  # say HELLO on the next loop turn

    def release(self) -> None:
        """Stop serving (the partition moved to another host): nothing more leaves this loader — what
        its outbox still holds is dropped (the new primary resends every step not complete everywhere)."""
        if self.mode == "primary":
            log.warning("%s: released (epoch %d): the partition is served elsewhere now", self.name, self.epoch)
        self._disconnect()
        self.mode = "dormant"

    def follow(self, cursor: dict[str, Any]) -> None:
        """Shadow: keep the window warm from the primary's cursor on (read ahead, send nothing)."""
        if self.mode == "primary":
            self._disconnect()
        self.mode = "shadow"
        self._shadow_budget()
        try:
            self.window.seek(WindowCursor.parse(cursor))
        except ValueError as e:
            raise WireError(f"FOLLOW: {e}") from None
        self._count_warm()

    def _shadow_budget(self) -> None:
        # a promotion re-reads from the lowest position of the steps still in flight, then fills the window:
        # keep about three windows' tokens read ahead (the in-flight steps, the window, its read-ahead)
        self.window.read_ahead_tokens = 3 * max(1, self.window.min_tokens)

    def _disconnect(self) -> None:
        for s in self.pushers:
            s.close(0)
        self.pushers = []
        self.outbox = []
        self.constructor_endpoints = []
        if self.planner is not None:
            self.endpoints = [e for e in self.endpoints if e.sock is not self.planner]
            self.planner.close(0)
            self.planner = None
        self.welcomed = False
        self.replaying = False

    def _count_warm(self) -> None:
        n = self.window.warm_samples
        if n > self._warm_seen:
            self.hm.warm_samples.labels(self.source.name).inc(n - self._warm_seen)
            self._warm_seen = n

    def _on_shutdown(self, identity: bytes, msg: wire.Message) -> None:
        why = msg.meta.get("error")
        if isinstance(why, str) and msg.meta.get("refused") == "listing":  # the planner refused this loader
            self._refuse(why, tell=False)
            return
        super()._on_shutdown(identity, msg)

    def _on_release(self, _: bytes, msg: wire.Message) -> None:
        if msg.get("epoch", int) >= self.epoch:
            self._release_pending = True  # after this drain: its socket closes

    # -- protocol -----------------------------------------------------------------------
    def _send_planner(self, kind: Kind, meta: dict[str, Any] | None = None, arrays: dict[str, np.ndarray] | None = None) -> None:
        if self.planner is not None:
            wire.send(self.planner, kind, meta, arrays)

    def _hello_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"role": "loader", "source": self.si, "replica": self.replica,
                                "source_name": self.source.name, "metrics_port": self.metrics_port, "epoch": self.epoch}
        if self.host is not None:
            meta["host"] = self.host
        if self.listing_pin is not None:
            meta["listing"] = self.listing_pin.to_json()
        return meta

    def hello(self) -> None:
        if self.planner is None:
            return
        self._send_planner(Kind.HELLO, self._hello_meta())
        self.mark_hello()

    def registration_tick(self, now: float) -> None:
        if self.planner is not None:
            super().registration_tick(now)

    def on_liveness(self, now: float) -> None:
        if self.planner is not None:
            super().on_liveness(now)

    def _on_welcome(self, _: bytes, msg: wire.Message) -> None:
        if msg.meta.get("reopen") is True:  # the run reads another listing of this source: reopen, HELLO again
            pinned = protocol.ListingPin.parse(msg.meta.get("listing"), "WELCOME: field 'listing'")
            if pinned is None:
                raise WireError("WELCOME: 'reopen' without a 'listing'")
            self.note_incarnation(msg)
            for sock in self.pushers:
                sock.close(0)
            self.pushers, self.outbox, self.welcomed, self.replaying = [], [], False, False
            if pinned != self.listing_pin:
                self._reopen(pinned)
            self._last_hello = 0.0  # say HELLO on the next loop turn
            return
        endpoints = msg.get("constructors", list)
        cursor = self._cursor(msg)  # validated before the old session's sockets go
        for s in self.pushers:
            s.close(0)
        self.pushers = []
        self.outbox = [deque() for _ in endpoints]  # an older session's data is of no use to anyone
        self.constructor_endpoints = list(endpoints)
        for ep in endpoints:
            s = self.ctx.socket(zmq.PUSH)
            wire.configure_socket(s, sndhwm=64, linger_ms=1000, heartbeat_s=self.spec.runtime.heartbeat_s)
            self.security.client(s).connect(ep)
            self.pushers.append(s)
        if msg.get("session", int) != self.session:
            self.sent.clear()
        self.note_incarnation(msg)
        self._seek(msg.get("session", int), cursor)
        self.replaying = "replay_through" in msg.meta
        self.welcomed = True
        self._count_warm()

    def _cursor(self, msg: wire.Message) -> WindowCursor:
        try:
            return WindowCursor.parse(msg.get("cursor", dict))
        except ValueError as e:
            raise WireError(f"{msg.kind.name}: {e}") from None

    def _listing_changed(self) -> list[list[str]] | None:
        """A live source's file listing when it changed since the planner last heard it (this session), so
        the planner's cursor names the listing its positions count over."""
        listing = getattr(self.stream, "listing", None)
        segs = listing() if callable(listing) else None
        if segs is None or len(segs) == self._listing_sent:
            return None
        self._listing_sent = len(segs)
        return segs

    def _seek(self, session: int, cursor: WindowCursor) -> None:
        self._listing_sent = -1  # a new session: tell the planner the listing again
        self.session = session
        self.window.seek(cursor)
        log.info("%s: session %d from position %d", self.name, session, cursor.low)

    def _on_read(self, samples: int, tokens: int, seconds: float) -> None:
        self.m.loader_read_seconds.observe(seconds)
        self.m.loader_samples_read.labels(self.source.name).inc(samples)
        self.m.loader_tokens.labels(self.source.name).inc(tokens)

    def _remote_metrics(self) -> None:
        """Object-storage requests, bytes, retries, cache hits and latencies since the last call."""
        st = self.stream.stats
        if not st.requests and not st.cache_hits:
            return
        now = (st.requests, st.bytes_read, st.retries, st.cache_hits)
        name = self.source.name
        for metric, new, old in zip((self.m.loader_remote_requests, self.m.loader_remote_bytes,
                                     self.m.loader_remote_retries, self.m.loader_remote_cache_hits), now, self._remote_seen):
            if new > old:
                metric.labels(name).inc(new - old)
        self._remote_seen = now
        for s in st.drain_latencies():
            self.m.loader_remote_request_seconds.labels(name).observe(s)

    def _fill(self) -> bool:
        """Announce samples until the window is full; True if it did work."""
        if not self.welcomed or self.replaying or self.window.full:
            return False
        a = self.window.fill()
        self.m.loader_buffer_samples.labels(self.source.name).set(len(self.window.buffer))
        q = self.stream.quarantine.pages_total
        if q > self._quarantined_seen:
            self.m.loader_quarantined_pages.labels(self.source.name).inc(q - self._quarantined_seen)
            self._quarantined_seen = q
        dropped = self.window.dropped_overlong
        if dropped > self._dropped_seen:
            self.m.loader_dropped_overlong.labels(self.source.name).inc(dropped - self._dropped_seen)
            self._dropped_seen = dropped
        self._overlong_metrics()
        tq = getattr(self.window.transform, "quarantine", None)
        bad = tq.units_total if tq is not None else 0
        if bad > self._bad_samples_seen:
            self.m.loader_quarantined_samples.labels(self.source.name).inc(bad - self._bad_samples_seen)
            self._bad_samples_seen = bad
        self._remote_metrics()
        dry = bool(getattr(self.stream, "dry", False))
        self.m.loader_dry.labels(self.source.name).set(1 if dry else 0)
        if dry and time.monotonic() - self._last_status_line > 30.0:
            self._last_status_line = time.monotonic()
            log.warning("%s: %s", self.name, self.stream.status_line())
        if len(a):
            meta: dict[str, Any] = {"session": self.session, "source": self.si, "replica": self.replica, "epoch": self.epoch}
            listing = self._listing_changed()
            if listing is not None:
                meta["listing"] = listing
            self._send_planner(Kind.LOADER_META, meta, {"pos": a.pos, "key": a.key, "tokens": a.tokens, "patches": a.patches})
        return True

    def _overlong_metrics(self) -> None:
        """Documents cut or split since the last call (the window counts them; drops are counted above)."""
        seen = self._overlong_seen
        for action, n in (("cut", self.window.cut_overlong), ("split", self.window.split_overlong)):
            if n > seen.get(action, 0):
                self.m.loader_overlong_docs.labels(self.source.name, action).inc(n - seen.get(action, 0))
                seen[action] = n

    def _on_plan(self, _: bytes, msg: wire.Message) -> None:
        if msg.get("session", int) != self.session:
            return  # a plan of an older session: the planner has moved on
        step = msg.get("step", int)
        self.last_plan = time.monotonic()
        pos, start, length = msg.array("pos"), msg.array("start"), msg.array("len")
        dest, retire, img = msg.array("dest"), msg.array("retire"), msg.array("img")
        n = len(pos)
        if not (len(start) == len(length) == len(dest) == len(retire) == len(img) == n):
            raise WireError("PLAN_LOADER: arrays differ in length")
        if n and (dest.min() < 0 or dest.max() >= len(self.pushers)):
            raise WireError(f"PLAN_LOADER: constructor index out of range at step {step}")
        if self.replaying:  # resent steps: read the stream forward to the planned samples, announcing nothing
            self.window.ensure(np.unique(pos).tolist())
        missing = [int(q) for q in np.unique(pos) if int(q) not in self.window.buffer]
        if missing:  # checked before anything is sent: a step goes out whole or not at all
            raise WireError(f"step {step}: planned sample at position {missing[0]} is not in the window")
        if n and (np.any(length < 0) or np.any(start < 0)):
            raise WireError(f"PLAN_LOADER: negative span at step {step}")
        served = np.unique(dest)
        if self.hook is not None:  # hooks.loader: the order it gathers and serves the spans, its read-ahead
            order = self._consume_plan(step, pos, start, length, dest, retire, img)
            if order is not None:
                pos, start, length, dest, retire, img = (a[order] for a in (pos, start, length, dest, retire, img))
                first = np.unique(dest, return_index=True)[1]
                served = dest[np.sort(first)]  # constructors in the order of their first span
        for c in served:
            sel = np.flatnonzero(dest == c)
            spans_at = sel[length[sel] > 0]
            keys = np.empty(len(spans_at), np.int64)
            spans = []
            for j, i in enumerate(spans_at):
                keys[j], span = self.window.span(int(pos[i]), int(start[i]), int(length[i]))
                spans.append(span)
            offsets = np.zeros(len(spans) + 1, np.int64)
            np.cumsum([len(x) for x in spans], out=offsets[1:])
            values = np.concatenate(spans).astype(np.int32) if spans else np.zeros(0, np.int32)
            arrays: dict[str, np.ndarray] = {"key": keys, "start": start[spans_at].astype(np.int64), "len": length[spans_at].astype(np.int64),
                      "offsets": offsets, "values": values}
            meta = {"session": self.session, "step": step, "source": self.si, "replica": self.replica, "epoch": self.epoch}
            arrays.update(self._images(pos[sel[img[sel] > 0]], meta))
            frames = wire.encode(Kind.SAMPLES, meta, arrays,
                                 checksum=self.spec.runtime.checksum_payloads)
            self.outbox[int(c)].append(frames)
            self._keep_sent(step, int(c), frames, msg.meta.get("released_through"))
            self.m.loader_bytes_sent.labels(self.source.name).inc(sum(a.nbytes for a in arrays.values()))  # images too
        for i in np.flatnonzero(retire):
            self.window.retire(int(pos[i]))
        self.flush()
        if self.snapshot_every and not self.replaying:
            self._plans_since_snapshot += 1
            if self._plans_since_snapshot >= self.snapshot_every:
                self._plans_since_snapshot = 0
                self.write_snapshot(step)

    def _consume_plan(self, step: int, pos: np.ndarray, start: np.ndarray, length: np.ndarray, dest: np.ndarray,
                      retire: np.ndarray, img: np.ndarray) -> np.ndarray | None:
        """Ask the loader hook how to consume this step's part of the plan: the serving order (None: the plan's);
        its read-ahead hint is applied here. LoaderHookError (naming hook, step, field) stops the loader."""
        assert self.hook is not None and self.spec.hooks.loader is not None
        buf = self.window.buffer
        plan: dict[str, np.ndarray] = {"pos": pos.astype(np.int64), "key": np.asarray([buf[int(q)].key for q in pos.tolist()], np.int64),
                "start": start.astype(np.int64), "len": length.astype(np.int64), "dest": dest.astype(np.int64),
                "img": img.astype(np.int8), "retire": retire.astype(np.int8),
                "tokens": np.asarray([len(buf[int(q)].tokens) for q in pos.tolist()], np.int64)}
        ctx = {"step": step, "source": self.source.name, "replica": self.replica, "constructors": len(self.pushers),
               "window_samples": len(buf), "window_tokens": int(self.window.unconsumed_tokens),
               "read_ahead_tokens": int(self.window.read_ahead_tokens)}
        decision = apply_loader_hook(self.hook, self.spec.hooks.loader.name, plan, ctx)
        self.hook_calls += 1
        if decision.read_ahead_tokens is not None and self.mode == "primary":
            self.window.read_ahead_tokens = decision.read_ahead_tokens
        return decision.order

    def write_snapshot(self, step: int) -> None:
        """A differential checkpoint of this partition's position (loader.snapshot); never fatal."""
        assert self.state_dir is not None
        t0 = time.perf_counter()
        w = self.window
        held = list(w.buffer)
        cur = snapshot.window_cursor(held, {p: b.done for p, b in w.buffer.items()},
                                     int(w.position or 0) if not held else 0)
        try:
            state = self.stream.state_dict()
        except Exception:  # noqa: BLE001 - a stream without a state still has a position
            state = {}
        try:
            snapshot.write(self.state_dir, snapshot.LoaderSnapshot(
                self.source.name, self.replica, self.epoch, self.session, step, cur.to_json(), state, time.time()))
            self.snapshots_written += 1
        except OSError as e:
            self.limited.log(logging.WARNING, "snapshot", "%s: loader snapshot not written: %s", self.name, e)
        self.snapshot_seconds += time.perf_counter() - t0

    def restore_snapshot(self) -> snapshot.LoaderSnapshot | None:
        """At start: read this partition's snapshot and read ahead from it (sending nothing) until the planner
        says what to serve; its exact cursor then decides (a warm seek when the snapshot was recent)."""
        if not self.state_dir:
            return None
        try:
            snap = snapshot.read(self.state_dir, self.source.name, self.replica)
        except ValueError as e:
            log.warning("%s: %s; starting without it", self.name, e)
            return None
        if snap is None:
            return None
        self.follow(snap.cursor)
        log.warning("%s: restored its snapshot of step %d (%.1f s old): reading ahead from position %d",
                    self.name, snap.step, snapshot.age_s(snap), int(snap.cursor["low"]))
        return snap

    def _keep_sent(self, step: int, c: int, frames: list[Any], released: Any) -> None:
        """Keep what was sent for a restarted constructor (bounded; forgotten once every rank has the step)."""
        self.sent.setdefault(step, {})[c] = frames
        if isinstance(released, int):
            for s in [s for s in self.sent if s <= released]:
                del self.sent[s]
        while len(self.sent) > self.sent_max_steps:
            del self.sent[min(self.sent)]

    def _on_resend(self, _: bytes, msg: wire.Message) -> None:
        """A constructor was restarted: push the SAMPLES of its recent steps to it again (it drops what it has)."""
        if msg.get("session", int) != self.session:
            return
        c, first = msg.get("constructor", int), msg.get("from_step", int)
        last = msg.meta.get("to_step")
        last = last if isinstance(last, int) and not isinstance(last, bool) else None
        if not 0 <= c < len(self.outbox):
            raise WireError(f"RESEND: constructor index {c} out of range")
        again = [self.sent[s][c] for s in sorted(self.sent)
                 if s >= first and (last is None or s <= last) and c in self.sent[s]]
        self.outbox[c].extend(again)
        self.m.resent_samples.labels(self.source.name).inc(len(again))
        self.limited.log(logging.WARNING, "resend", "%s: pushing %d sample message(s) of steps %d..%s again to "
                         "constructor %s", self.name, len(again), first, "" if last is None else last,
                         self.constructor_endpoints[c])
        self.flush()

    @property
    def outbox_messages(self) -> int:
        return sum(len(q) for q in self.outbox)

    def flush(self) -> bool:
        """Send queued SAMPLES messages, in order per constructor, as far as the peers take them
        without blocking; True if anything was sent."""
        sent = False
        for c, q in enumerate(self.outbox):
            while q:
                try:
                    self.pushers[c].send_multipart(q[0], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                q.popleft()
                sent = True
        waiting = self.outbox_messages
        self.m.loader_outbox_messages.labels(self.source.name).set(waiting)
        now = time.monotonic()
        if not waiting or sent:
            self._outbox_stuck_since = None if not waiting else now
        elif self._outbox_stuck_since is None:
            self._outbox_stuck_since = now
        elif now - self._outbox_stuck_since > 30.0:
            self._outbox_stuck_since = now
            late = [self.constructor_endpoints[c] for c, q in enumerate(self.outbox) if q]
            log.warning("%s: %d sample messages wait for constructor(s) %s, which take nothing", self.name,
                        waiting, ", ".join(late))
        return sent

    def _images(self, pos: np.ndarray, meta: dict[str, Any]) -> dict[str, np.ndarray]:
        """Pixels of the image samples at these positions (the planner says which constructor needs them); with
        ``image.decode_at`` constructor or client their raw encoded bytes instead, marked ``img_encoded`` in
        `meta` with where each one was read (``img_where``: file and row, for the error of a bad image)."""
        keys, grids, parts = [], [], []
        for p in pos.tolist():
            b = self.window.buffer.get(int(p))
            if b is None or not b.npatches or b.patches is None or b.grid is None:
                continue
            keys.append(b.key)
            grids.append(b.grid)
            parts.append(np.asarray(b.patches, np.uint8).reshape(-1))
        if not keys:
            return {}
        off = np.zeros(len(parts) + 1, np.int64)
        np.cumsum([len(x) for x in parts], out=off[1:])
        out: dict[str, np.ndarray] = {"img_key": np.asarray(keys, np.int64), "img_grid": np.asarray(grids, np.int32).reshape(-1, 2),
               "img_offsets": off, "img_values": np.concatenate(parts)}
        if self.source.image.decode_at in ("constructor", "client"):
            meta["img_encoded"] = True
            meta["img_where"] = [self._where(k) for k in keys]
        elif any(len(x) == 0 for x in parts):  # decoded here: a header that read, pixels that did not (quarantined)
            out["img_bad"] = np.asarray([len(x) == 0 for x in parts], np.int8)
        return out

    def _where(self, key: int) -> str:
        """'file F, row R' of a sample key (as quarantine records name them), or just the key."""
        at = getattr(self.stream, "where_key", lambda _k: None)(key)
        return f"sample key {key} (file {at[0]}, row {at[1]})" if at is not None else f"sample key {key}"

    def handle(self, msg: wire.Message) -> None:
        """Handle one message from the planner (WireError if bad)."""
        self.dispatch(self.entry("planner"), b"", msg)

    def _on_seek(self, _: bytes, msg: wire.Message) -> None:
        self._seek(msg.get("session", int), self._cursor(msg))
        self._count_warm()
        if self.replaying:
            self.replaying = False
            log.warning("%s: resent the spans of the steps planned before its restart", self.name)

    @property
    def needs_work(self) -> bool:
        if self.shadow:
            return self.window.wants_read_ahead
        return self.welcomed and not self.replaying and (not self.window.full or self.window.wants_read_ahead)

    def work(self, idle: bool) -> bool:
        """One unit of background work: refill the window (critical path), else read ahead when idle
        (a shadow only reads ahead, when the loop is idle)."""
        if self.shadow:
            return idle and self.window.read_ahead()
        if not self.welcomed or self.replaying:
            return False
        if not self.window.full:
            return self._fill()
        if idle and self.window.wants_read_ahead:
            return self.window.read_ahead()
        return False

    def drain(self, e: Endpoint | None = None, limit: int = DRAIN_BATCH) -> int:
        """Handle every message waiting from the planner; bad ones are counted and dropped."""
        if e is None and self.planner is None:
            return 0
        n = super().drain(e or self.entry("planner"), limit)
        if self._release_pending:
            self._release_pending = False
            self.release()
        return n

    def run(self, *, max_seconds: float | None = None) -> None:
        serve_loaders([self], lambda: self.stopped, max_seconds=max_seconds)

    def close(self) -> None:
        self._disconnect()
        super().close()
        self.window.close()
        self.stream.close()


def serve_loaders(loaders: list[LoaderServer] | Callable[[], list[LoaderServer]], stopped: Callable[[], bool], *,
                  max_seconds: float | None = None, host: PlannerFollower | None = None) -> None:
    """The poll loop of one loader process, hosting one or several Source Loaders (source grouping).

    Messages first, then window refills (they are on the planner's critical path), then read-ahead
    one chunk at a time while nothing else is waiting — so every source gets its share of the CPU.
    `loaders` may be a callable: a host (loader.host) adopts and releases partitions while it runs, and
    the loop follows the sockets they open and close; `host` is its own planner link, polled too."""
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    current = loaders if callable(loaders) else (lambda: loaders)
    poller = zmq.Poller()
    by_sock: dict[Any, Component] = {}
    if host is not None:
        host.hello()
    for ld in current():
        ld.hello()
    try:
        while not stopped() and (deadline is None or time.monotonic() < deadline):
            lds = current()
            want: dict[Any, Component] = {ld.planner: ld for ld in lds if ld.planner is not None and not ld.stopped}
            if host is not None:
                want[host.planner] = host
            for sock in [x for x in by_sock if x not in want]:
                poller.unregister(sock)
                del by_sock[sock]
            for sock, comp in want.items():
                if sock not in by_sock:
                    poller.register(sock, zmq.POLLIN)
                    by_sock[sock] = comp
            live = [ld for ld in lds if not ld.stopped]
            if not live and host is None:
                break
            busy = any(ld.needs_work for ld in live)
            queued = any(ld.outbox_messages for ld in live)  # waiting on constructors: look again soon
            events = dict(poller.poll(0 if busy else (5 if queued else 100)))
            for sock in events:
                owner = by_sock.get(sock)
                if owner is not None and getattr(owner, "planner", None) is sock:  # not closed by an earlier message
                    owner.drain(owner.entry("planner"))
            for comp in by_sock.values():  # a reconnected planner socket (a restarted planner): beat to it now
                comp.drain_monitors()
            now = time.monotonic()
            if host is not None:
                host.registration_tick(now)
                host.on_liveness(now)
                host.tick()
            for ld in live:
                ld.registration_tick(now)
                ld.on_liveness(now)
            for ld in live:
                if ld.outbox_messages:
                    ld.flush()
            refills = [ld for ld in live if ld.mode == "primary" and ld.welcomed and not ld.replaying and not ld.window.full]
            for ld in refills:
                ld.work(idle=False)
            if not refills and not events:
                for ld in live:
                    if ld.work(idle=True):
                        break  # one chunk, then look at the sockets again
    finally:
        for ld in current():
            try:
                ld.close()
            except zmq.ZMQError:
                pass
        if host is not None:
            try:
                host.close()
            except zmq.ZMQError:
                pass
