"""A loader process as a *host* of partitions (partition handoff, shadow loaders).

Every `mixplane loader` process is a host: it registers with the planner under its name (HELLO role
"host", on its own DEALER `host:<name>`), listing the partitions it was launched with (possibly none)
and whether it was launched as a shadow. The planner's partition table (planner.partitions) answers
with ADOPT per partition — serve it as primary at an epoch, or keep it warm as a shadow — and can send
ADOPT later for partitions the host was not started with (failover, scaling, rebalancing). A partition
served as primary has its own planner socket (named for its epoch) like any Source Loader; a shadow
has none: it follows the cursor the planner sends (FOLLOW), reads ahead and sends nothing, so its
promotion to primary starts from a warm window in a running interpreter.

Thin shell: one :class:`~mixplane.loader.server.LoaderServer` per partition (kept across mode changes,
so its stream and window stay open), one poll loop (`serve_loaders`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from mixplane import protocol, wire
from mixplane.component import PlannerFollower
from mixplane.loader.server import EXIT_LISTING, LoaderServer, serve_loaders
from mixplane.metrics import handoff_metrics, serve_merged
from mixplane.spec import DataMixtureSpec
from mixplane.wire import Kind, WireError

log = logging.getLogger("mixplane.loader")
FAILOVER_BEATS = 4  # a host beats this many times per runtime.failover_after_s


class LoaderHost(PlannerFollower):
    component = "loader"

    def __init__(self, spec: DataMixtureSpec, planner_endpoint: str, name: str, *,
                 partitions: list[tuple[int, int]] | None = None, shadow: bool = False, shadow_of: str | None = None,
                 context: zmq.Context | None = None, metrics: bool = True, metrics_port: int = 0,
                 state_dir: str | None = None):
        super().__init__(spec, protocol.host_identity(name), context=context, metrics_port=None, logger=log)
        self.host_name = name
        self.process_incarnation = os.urandom(8).hex()  # told to the planner in HELLO (a restart changes it)
        self.planner_endpoint = planner_endpoint
        self.wants = list(partitions or [])
        self.launched_as_shadow = shadow
        self.shadow_of = shadow_of  # the primary host it was launched beside: stands by for what that host serves
        self.metrics = metrics
        # a fixed port (a pod's `metrics` port): the host and every partition it serves, merged on that one port;
        # 0: the first partition's metrics on a free port of its own, the others on free ports too
        self.merged_metrics = bool(metrics and metrics_port > 0)
        self._first_metrics_port: int | None = metrics_port if metrics and not self.merged_metrics else None
        self.hm = handoff_metrics(self.m)
        # failure detection: a thread beats on a socket of its own (`beat:<name>`) FAILOVER_BEATS times per
        # runtime.failover_after_s, with the age of the poll loop's last turn: a dead or stopped process (SIGKILL,
        # SIGSTOP) falls silent at once, while a long tokenizer call in the loop does not look like death
        # (the planner gives a stuck loop a longer budget, planner.hosting)
        self.beat_interval_s = float(spec.runtime.failover_after_s) / FAILOVER_BEATS
        self.loop_turn: float | None = time.monotonic()  # None while an ADOPT is being carried out
        self.started_at = time.monotonic()
        self.exit_code = 0  # what `mixplane loader` returns once stopped (a sidecar's end: mixplane.podend)
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self.planner = self.ctx.socket(zmq.DEALER)
        self.planner.setsockopt(zmq.IDENTITY, self.name.encode())
        wire.configure_socket(self.planner, heartbeat_s=spec.runtime.heartbeat_s,
                              max_msgsize=protocol.max_message_bytes(spec, "loader"))
        self.security.client(self.planner).connect(planner_endpoint)
        self.add_endpoint(self.planner, "planner", {
            Kind.WELCOME: self._on_welcome, Kind.ADOPT: self._on_adopt, Kind.FOLLOW: self._on_follow,
            Kind.SHUTDOWN: self._on_shutdown, Kind.HEARTBEAT: self._on_planner_heartbeat, Kind.ERROR: self._on_error})
        self.welcomed = False
        self.state_dir = state_dir
        self.loaders: dict[tuple[int, int], LoaderServer] = {}
        if self.merged_metrics:
            self.metrics_port = serve_merged(lambda: [self.m.registry, *(ld.m.registry for ld in list(self.loaders.values()))],
                                             spec.runtime.host, metrics_port)
        # the partitions it was launched with are opened at once (stream, tokenizer), dormant until adopted;
        # a partition with a differential checkpoint starts reading ahead from it (loader.snapshot)
        for key in self.wants:
            self._open(key).restore_snapshot()

    # -- partitions --------------------------------------------------------------------------------------
    def _open(self, key: tuple[int, int], partitioning: list[dict[str, Any]] | None = None) -> LoaderServer:
        """The server of a partition, opened if needed. `partitioning` (ADOPT of a re-partitioned source): the
        source's re-partition records; a server opened with other records (the old partition of that number)
        is closed and the partition opened again with its new read order."""
        recs = list(partitioning or [])
        ld = self.loaders.get(key)
        if ld is not None and ld.partitioning != recs:
            log.warning("%s: partition %s:%d re-partitioned (%d -> %s partitions): opened again", self.name,
                        ld.source.name, key[1], ld.source.replicas if not ld.partitioning else
                        ld.partitioning[-1]["partitions"], recs[-1]["partitions"] if recs else ld.source.replicas)
            ld.release()
            ld.close()
            del self.loaders[key]
            ld = None
        if ld is None:
            si, r = key
            parts = int(recs[-1]["partitions"]) if recs else (self.spec.sources[si].replicas
                                                              if 0 <= si < len(self.spec.sources) else 0)
            if not 0 <= si < len(self.spec.sources) or not 0 <= r < parts:
                raise WireError(f"no partition: source {si} replica {r}")
            port, self._first_metrics_port = (self._first_metrics_port, None) if self._first_metrics_port is not None \
                else (0 if self.metrics and not self.merged_metrics else None, None)
            try:
                ld = LoaderServer(self.spec, si, r, self.planner_endpoint, context=self.ctx, metrics_port=port,
                                  host=self.host_name, mode="dormant", state_dir=self.state_dir, partitioning=recs)
            except (ValueError, KeyError, TypeError) as e:  # records that do not fit the files: named, not fatal
                raise WireError(f"ADOPT of {self.spec.sources[si].name}:{r}: {e}") from None
            self.loaders[key] = ld
        return ld

    def serving(self) -> list[LoaderServer]:
        return list(self.loaders.values())

    def quiet_for(self, now: float) -> float:
        """Seconds since the planner last asked any partition of this host for a step, 0 while one still has samples
        to send (safe to call from another thread: it only reads)."""
        lds = list(self.loaders.values())
        if any(ld.outbox_messages for ld in lds):
            return 0.0
        return max(0.0, now - max((ld.last_plan for ld in lds), default=self.started_at))

    # -- planner messages --------------------------------------------------------------------------------
    def hello(self) -> None:
        wire.send(self.planner, Kind.HELLO, {"role": "host", "host": self.host_name,
                                             # this process: a HELLO repeated by it is not a restart
                                             "incarnation": self.process_incarnation,
                                             "partitions": [[si, r] for si, r in self.wants],
                                             # what it serves or held for a re-partitioned source (a restarted
                                             # planner may have told it to release already): handed back to it
                                             "serving": [[si, r] for (si, r), ld in sorted(self.loaders.items())
                                                         if ld.mode == "primary" or ld.partitioning],
                                             "shadow": self.launched_as_shadow,
                                             **({"shadow_of": self.shadow_of} if self.shadow_of else {})})
        self.mark_hello()

    def _on_welcome(self, _: bytes, msg: wire.Message) -> None:
        self.note_incarnation(msg)  # a restarted planner (new incarnation) makes this host register again
        self.welcomed = True

    def _on_error(self, _: bytes, msg: wire.Message) -> None:
        log.error("%s: the planner refused this host: %s", self.name, msg.meta.get("error"))

    def _on_adopt(self, _: bytes, msg: wire.Message) -> None:
        # opening a partition and filling its window (a cold start, a promotion) is this host's work, not a hung
        # loop: the loop's clock counts from when it is done (the planner's stall rule, planner.hosting)
        self.loop_turn = None
        try:
            self._adopt(msg)
        finally:
            self.loop_turn = time.monotonic()

    def _adopt(self, msg: wire.Message) -> None:
        key = (msg.get("source", int), msg.get("replica", int))
        epoch, mode = msg.get("epoch", int), msg.get("mode", str)
        recs = msg.meta.get("partitioning")
        if recs is not None and not (isinstance(recs, list) and all(isinstance(r, dict) for r in recs)):
            raise WireError("ADOPT: field 'partitioning' must be a list of re-partition records")
        if mode == "dormant" and key not in self.loaders:
            return
        ld = self._open(key, recs if mode != "dormant" else (self.loaders[key].partitioning if key in self.loaders
                                                              else None))
        if mode == "primary":
            if ld.mode == "primary" and ld.epoch == epoch:
                return
            t0 = time.perf_counter()
            ld.serve(epoch)
            log.warning("%s: serving %s as primary (epoch %d, %s window)", self.name, ld.name, epoch,
                        "warm" if ld.window.staged else "cold")
            self.m.loader_read_seconds.observe(time.perf_counter() - t0)
        elif mode == "shadow":
            cursor = msg.meta.get("cursor")
            if isinstance(cursor, dict):
                ld.follow(cursor)
            else:
                ld.release()
                ld.mode = "shadow"
                ld._shadow_budget()
            log.info("%s: shadowing %s:%d (primary at epoch %d)", self.name, ld.source.name, ld.replica, epoch)
        elif mode == "dormant":
            ld.release()
        else:
            raise WireError(f"ADOPT: unknown mode {mode!r}")
        self._gauges()

    def _on_follow(self, _: bytes, msg: wire.Message) -> None:
        key = (msg.get("source", int), msg.get("replica", int))
        ld = self.loaders.get(key)
        if ld is not None and ld.shadow:
            ld.follow(msg.get("cursor", dict))

    def _gauges(self) -> None:
        self.hm.partitions_hosted.set(sum(1 for ld in self.loaders.values() if ld.mode == "primary"))
        self.hm.partitions_shadowed.set(sum(1 for ld in self.loaders.values() if ld.shadow))

    def status(self) -> dict[str, Any]:
        return {"host": self.host_name, "partitions": {f"{ld.source.name}:{ld.replica}": {"mode": ld.mode, "epoch": ld.epoch}
                                                       for ld in self.loaders.values()}}

    def tick(self) -> None:
        self.loop_turn = time.monotonic()
        refused = [ld for ld in self.loaders.values() if ld.refused is not None]
        if refused and not self.stopped:  # the run's listing cannot be read here: restarting would not change that
            log.error("%s: stopping: %s", self.name, "; ".join(str(ld.refused) for ld in refused))
            self.exit_code = EXIT_LISTING
            self.stopped = True

    def _beat(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, protocol.beat_identity(self.host_name).encode())
        wire.configure_socket(sock, sndhwm=4, linger_ms=0)
        self.security.client(sock).connect(self.planner_endpoint)
        try:
            while not self._beat_stop.wait(self.beat_interval_s):
                try:
                    turn = self.loop_turn
                    wire.send(sock, Kind.HEARTBEAT, {"host": self.host_name,
                                                     "loop_s": 0.0 if turn is None else round(time.monotonic() - turn, 3)},
                              flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # the planner is away or slow: its own liveness check reports that
        finally:
            sock.close(0)

    def run(self, *, max_seconds: float | None = None) -> None:
        self.loop_turn = time.monotonic()  # liveness counts from readiness: opening the partitions is start-up
        self._beat_thread = threading.Thread(target=self._beat, name="host-beat", daemon=True)
        self._beat_thread.start()
        try:
            serve_loaders(self.serving, lambda: self.stopped, max_seconds=max_seconds, host=self)
        finally:
            self._beat_stop.set()
            self._beat_thread.join(5)


def parse_members(spec: DataMixtureSpec, text: str) -> list[tuple[int, int]]:
    """The partitions named on a loader's command line (``--sources a,b:1``: source name [: replica]) as
    (source index, replica) pairs; an unknown source name is an error naming it."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, rep = item.partition(":")
        out.append((spec.source_index(name), int(rep or 0)))
    return out
