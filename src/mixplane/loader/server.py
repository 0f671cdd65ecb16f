"""Source Loader: reads one partition of one source, keeps a window of transformed samples,
reports their metadata to the planner and ships planned spans straight to constructors.

Thin shell: the stream (`loader.stream`) and transforms (`loader.transforms`) do the work.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from mixplane import wire
from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.metrics import make_metrics, serve_metrics
from mixplane.planner.core import window_full
from mixplane.spec import DataMixtureSpec
from mixplane.wire import Kind, WireError

log = logging.getLogger("mixplane.loader")

CHUNK = 64  # samples read and transformed per refill step


@dataclass
class Buffered:
    pos: int
    key: int
    tokens: np.ndarray
    patches: np.ndarray | None
    npatches: int = 0
    done: int = 0  # tokens already planned


class LoaderServer:
    def __init__(self, spec: DataMixtureSpec, source_index: int, replica: int, planner_endpoint: str,
                 *, context: zmq.Context | None = None, metrics_port: int | None = 0):
        self.spec = spec
        self.si = source_index
        self.source = spec.sources[source_index]
        self.replica = replica
        self.name = f"loader:{self.source.name}:{replica}"
        self.win_min, self.win_tokens, self.win_max = spec.window_bounds(source_index)
        self.ctx = context or zmq.Context.instance()
        self.planner = self.ctx.socket(zmq.DEALER)
        self.planner.setsockopt(zmq.IDENTITY, self.name.encode())
        self.planner.setsockopt(zmq.LINGER, 0)
        self.planner.connect(planner_endpoint)
        self.pushers: list[zmq.Socket] = []
        self.stream = open_stream(self.source, seed=spec.mixture.seed, partition=replica, num_partitions=self.source.replicas)
        self.transform = make_transform(self.source)
        self.buffer: dict[int, Buffered] = {}  # announced to the planner, not yet fully consumed
        self.staged: deque[Buffered] = deque()  # read and transformed, not yet announced
        self.unconsumed_tokens = 0
        self.partial: dict[int, int] = {}
        self.skip: set[int] = set()
        self.session = -1
        self.welcomed = False
        self.stopped = False
        self.m = make_metrics("loader")
        self.metrics_port = serve_metrics(self.m, spec.runtime.host, metrics_port) if (spec.runtime.metrics and metrics_port is not None) else None
        self._last_hello = 0.0

    # -- protocol -----------------------------------------------------------------------
    def _send_planner(self, kind: Kind, meta: dict[str, Any] | None = None, arrays: dict[str, np.ndarray] | None = None) -> None:
        wire.send(self.planner, kind, meta, arrays)

    def _hello(self) -> None:
        self._send_planner(Kind.HELLO, {"role": "loader", "source": self.si, "replica": self.replica,
                                        "source_name": self.source.name, "metrics_port": self.metrics_port})
        self._last_hello = time.monotonic()

    def _on_welcome(self, msg: wire.Message) -> None:
        endpoints = msg.get("constructors", list)
        for s in self.pushers:
            s.close(0)
        self.pushers = []
        for ep in endpoints:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            s.setsockopt(zmq.SNDHWM, 64)
            s.connect(ep)
            self.pushers.append(s)
        self._seek(msg.get("session", int), msg.get("cursor", dict))
        self.welcomed = True

    def _seek(self, session: int, cursor: dict[str, Any]) -> None:
        self.session = session
        self.buffer.clear()
        self.staged.clear()
        self.unconsumed_tokens = 0
        self.skip = {int(p) for p in cursor.get("skip", [])}
        self.partial = {int(p): int(d) for p, d in cursor.get("partial", {}).items()}
        self.stream.seek(int(cursor["low"]))
        log.info("%s: session %d from position %d", self.name, session, cursor["low"])

    @property
    def window_full(self) -> bool:
        return window_full(len(self.buffer), self.unconsumed_tokens, self.win_min, self.win_tokens, self.win_max)

    def _read(self) -> None:
        """Read and transform one chunk into the staging queue."""
        t0 = time.perf_counter()
        raw = self.stream.take(CHUNK)
        out = self.transform(raw)
        for i, p in enumerate(raw.positions):
            p = int(p)
            if p in self.skip:  # consumed before the cursor was taken
                self.skip.discard(p)
                continue
            if out.ntokens[i] <= 0:  # empty documents carry nothing to train on
                continue
            self.staged.append(Buffered(p, int(raw.keys[i]), out.tokens[i],
                                        out.patches[i] if out.patches is not None else None,
                                        int(out.npatches[i]), self.partial.pop(p, 0)))
        self.m.loader_read_seconds.observe(time.perf_counter() - t0)
        self.m.loader_samples_read.labels(self.source.name).inc(len(raw))
        self.m.loader_tokens.labels(self.source.name).inc(int(out.ntokens.sum()))

    def _fill(self) -> bool:
        """Announce staged samples one by one until the window is exactly full; True if it did work."""
        if not self.welcomed or self.window_full:
            return False
        new: list[Buffered] = []
        while not self.window_full:
            if not self.staged:
                self._read()
                continue
            b = self.staged.popleft()
            self.buffer[b.pos] = b
            self.unconsumed_tokens += len(b.tokens) - b.done
            new.append(b)
        self.m.loader_buffer_samples.labels(self.source.name).set(len(self.buffer))
        if new:
            self._send_planner(Kind.LOADER_META, {"session": self.session, "source": self.si, "replica": self.replica},
                               {"pos": np.array([b.pos for b in new], np.int64), "key": np.array([b.key for b in new], np.int64),
                                "tokens": np.array([len(b.tokens) for b in new], np.int32),
                                "patches": np.array([b.npatches for b in new], np.int32)})
        return True

    def _on_plan(self, msg: wire.Message) -> None:
        if msg.get("session", int) != self.session:
            return  # a plan of an older session: the planner has moved on
        step = msg.get("step", int)
        pos = msg.array("pos")
        start = msg.array("start")
        length = msg.array("len")
        dest = msg.array("dest")
        retire = msg.array("retire")
        n = len(pos)
        if not (len(start) == len(length) == len(dest) == len(retire) == n):
            raise WireError("PLAN_LOADER: arrays differ in length")
        if n and (dest.min() < 0 or dest.max() >= len(self.pushers)):
            raise WireError(f"PLAN_LOADER: constructor index out of range at step {step}")
        for c in np.unique(dest):
            sel = np.flatnonzero(dest == c)
            keys = np.empty(len(sel), np.int64)
            spans = []
            for j, i in enumerate(sel):
                b = self.buffer.get(int(pos[i]))
                if b is None:
                    raise WireError(f"step {step}: planned sample at position {int(pos[i])} is not in the buffer")
                keys[j] = b.key
                s0 = int(start[i])
                spans.append(b.tokens[s0 : s0 + int(length[i]) + 1])  # +1: the label of the span's last token
                end = s0 + int(length[i])
                if end > b.done:
                    self.unconsumed_tokens -= end - b.done
                    b.done = end
            offsets = np.zeros(len(spans) + 1, np.int64)
            np.cumsum([len(s) for s in spans], out=offsets[1:])
            values = np.concatenate(spans).astype(np.int32) if spans else np.zeros(0, np.int32)
            wire.send(self.pushers[int(c)], Kind.SAMPLES,
                      {"session": self.session, "step": step, "source": self.si, "replica": self.replica},
                      {"key": keys, "start": start[sel].astype(np.int64), "len": length[sel].astype(np.int64),
                       "offsets": offsets, "values": values})
            self.m.loader_bytes_sent.labels(self.source.name).inc(values.nbytes)
        for i in np.flatnonzero(retire):
            b = self.buffer.pop(int(pos[i]), None)
            if b is not None:
                self.unconsumed_tokens -= len(b.tokens) - b.done

    def handle(self, msg: wire.Message) -> None:
        if msg.kind == Kind.WELCOME:
            self._on_welcome(msg)
        elif msg.kind == Kind.PLAN_LOADER:
            self._on_plan(msg)
        elif msg.kind == Kind.SEEK:
            self._seek(msg.get("session", int), msg.get("cursor", dict))
        elif msg.kind == Kind.SHUTDOWN:
            self.stopped = True
        elif msg.kind == Kind.HEARTBEAT:
            pass
        else:
            raise WireError(f"unexpected {msg.kind.name} at a loader")

    def run(self, *, max_seconds: float | None = None) -> None:
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        poller = zmq.Poller()
        poller.register(self.planner, zmq.POLLIN)
        self._hello()
        try:
            while not self.stopped and (deadline is None or time.monotonic() < deadline):
                busy = self.welcomed and not self.window_full
                events = dict(poller.poll(0 if busy else 100))
                if self.planner in events:
                    while True:
                        try:
                            _, msg = wire.recv(self.planner, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except WireError as e:
                            self.m.bad_messages.labels("loader", "decode").inc()
                            log.warning("%s: dropped a bad message: %s", self.name, e)
                            continue
                        try:
                            self.handle(msg)
                        except WireError as e:
                            self.m.bad_messages.labels("loader", "content").inc()
                            log.error("%s: %s", self.name, e)
                elif not self.welcomed and time.monotonic() - self._last_hello > 1.0:
                    self._hello()
                if busy:
                    self._fill()
        finally:
            self.close()

    def close(self) -> None:
        for s in self.pushers:
            s.close(0)
        self.planner.close(0)
        self.stream.close()
