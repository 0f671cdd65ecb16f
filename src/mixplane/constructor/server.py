"""Data Constructor: collects planned spans from loaders, builds each rank's batch, serves clients.

Thin shell: `constructor.collate` builds batches; this file only moves messages. Pull model: a
client's request for step s makes the constructor ask the planner for steps up to s + prefetch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from mixplane import wire
from mixplane.constructor.collate import MissingPayload, SpanStore, materialize_rank
from mixplane.layout import StepLayout
from mixplane.metrics import make_metrics, serve_metrics
from mixplane.spec import DataMixtureSpec
from mixplane.topology import backbone_coords
from mixplane.wire import Kind, WireError

log = logging.getLogger("mixplane.constructor")


@dataclass
class StepState:
    layout: StepLayout | None = None
    spans: SpanStore = field(default_factory=SpanStore.empty)
    cursor_after: dict[str, Any] | None = None
    batches: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)

    @property
    def complete(self) -> bool:
        return self.layout is not None and len(self.spans) >= len(self.layout.seg_row)


class ConstructorServer:
    def __init__(self, spec: DataMixtureSpec, index: int, planner_endpoint: str, *, host: str = "127.0.0.1",
                 context: zmq.Context | None = None, metrics_port: int | None = 0):
        self.spec = spec
        self.index = index
        self.name = f"constructor:{index}"
        self.ctx = context or zmq.Context.instance()
        self.planner = self.ctx.socket(zmq.DEALER)
        self.planner.setsockopt(zmq.IDENTITY, self.name.encode())
        self.planner.setsockopt(zmq.LINGER, 0)
        self.planner.connect(planner_endpoint)
        self.data = self.ctx.socket(zmq.PULL)
        self.data.setsockopt(zmq.RCVHWM, 256)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.bind(f"tcp://{host}:0")
        self.clients = self.ctx.socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.clients.bind(f"tcp://{host}:0")
        self.data_endpoint = self.data.getsockopt_string(zmq.LAST_ENDPOINT)
        self.client_endpoint = self.clients.getsockopt_string(zmq.LAST_ENDPOINT)
        self.session = -1
        self.ranks: list[int] = []
        self.dp_ranks: list[int] = []
        self.steps: dict[int, StepState] = {}
        self.pending: list[tuple[bytes, int, int, float]] = []  # identity, step, rank, since
        self.asked_through = -1
        self.last_request: dict[int, int] = {}  # rank -> last step it asked for
        self.start_step = 0
        self.stopped = False
        self.welcomed = False
        self.m = make_metrics("constructor")
        self.metrics_port = serve_metrics(self.m, spec.runtime.host, metrics_port) if (spec.runtime.metrics and metrics_port is not None) else None
        self.prefetch = spec.runtime.prefetch_steps
        self._last_hello = 0.0

    def _hello(self) -> None:
        wire.send(self.planner, Kind.HELLO, {"role": "constructor", "index": self.index, "data_endpoint": self.data_endpoint,
                                             "client_endpoint": self.client_endpoint, "metrics_port": self.metrics_port})
        self._last_hello = time.monotonic()

    def _reset(self, session: int, start_step: int) -> None:
        self.session = session
        self.steps.clear()
        self.asked_through = start_step - 1
        self.start_step = start_step
        self.last_request.clear()
        # requests of the old session cannot be answered any more; clients re-request
        for ident, step, rank, _ in self.pending:
            wire.send(self.clients, Kind.ERROR, {"error": "delivery restarted (resume); request again", "step": step,
                                                 "retry": True}, route=[ident])
        self.pending.clear()

    # -- planner / loader messages ------------------------------------------------------
    def on_planner(self, msg: wire.Message) -> None:
        k = msg.kind
        if k == Kind.WELCOME:
            self.ranks = list(msg.get("ranks", list))
            self.dp_ranks = list(msg.get("dp_ranks", list))
            self._reset(msg.get("session", int), msg.get("start_step", int))
            self.welcomed = True
        elif k == Kind.PLAN_CONSTRUCTOR:
            if msg.get("session", int) != self.session:
                return
            try:
                layout = StepLayout.from_parts(msg.meta, msg.arrays)
            except ValueError as e:
                raise WireError(f"PLAN_CONSTRUCTOR: {e}") from None
            st = self.steps.setdefault(layout.step, StepState())
            st.layout = layout
            st.cursor_after = msg.meta.get("cursor_after")
            self.m.constructor_pending_steps.set(sum(1 for s in self.steps.values() if not s.complete))
        elif k == Kind.RESET:
            self._reset(msg.get("session", int), msg.get("start_step", int))
        elif k == Kind.SHUTDOWN:
            self.stopped = True
        elif k in (Kind.HEARTBEAT, Kind.ACK):
            pass
        else:
            raise WireError(f"unexpected {k.name} from the planner")

    def on_samples(self, msg: wire.Message) -> None:
        if msg.kind != Kind.SAMPLES:
            raise WireError(f"unexpected {msg.kind.name} on the data socket")
        if msg.get("session", int) != self.session:
            return
        step = msg.get("step", int)
        if step < self.start_step or (step in self.steps and self.steps[step].batches):
            return
        keys, starts, offsets, values = msg.array("key"), msg.array("start"), msg.array("offsets"), msg.array("values")
        lens = msg.array("len")
        n = len(keys)
        if not (len(starts) == len(lens) == n and len(offsets) == n + 1) or (n and (offsets[0] != 0 or offsets[-1] != len(values) or np.any(np.diff(offsets) < lens))):
            raise WireError(f"SAMPLES for step {step}: inconsistent arrays")
        st = self.steps.setdefault(step, StepState())
        st.spans.add(msg.get("source", int), keys, starts, offsets, values)

    # -- clients ------------------------------------------------------------------------
    def _batch_for(self, st: StepState, rank: int) -> dict[str, np.ndarray]:
        coords = backbone_coords(self.spec, rank)
        dp_local = self.dp_ranks.index(coords.dp)
        b = st.batches.get(dp_local)
        if b is None:
            t0 = time.perf_counter()
            b = materialize_rank(st.layout, dp_local, st.spans, self.spec.batch.pad_id)  # type: ignore[arg-type]
            st.batches[dp_local] = b
            self.m.constructor_build_seconds.observe(time.perf_counter() - t0)
            self.m.constructor_steps.inc()
        return b

    def _reply(self, ident: bytes, step: int, rank: int, since: float) -> None:
        st = self.steps[step]
        lay = st.layout
        assert lay is not None
        try:
            batch = self._batch_for(st, rank)
        except MissingPayload as e:
            wire.send(self.clients, Kind.ERROR, {"error": f"{self.name}: {e}", "step": step}, route=[ident])
            return
        meta = {"step": step, "rank": rank, "phase": lay.phase, "lr_scale": lay.lr_scale, "generation": lay.generation,
                "session": self.session, "microbatches": lay.microbatches, "cursor_after": st.cursor_after}
        wire.send(self.clients, Kind.STEP_DATA, meta, batch, route=[ident])
        self.m.constructor_bytes_sent.inc(sum(a.nbytes for a in batch.values()))
        self.m.constructor_client_wait_seconds.observe(time.monotonic() - since)

    def on_client(self, ident: bytes, msg: wire.Message) -> None:
        if msg.kind == Kind.GET_STEP:
            step = msg.get("step", int)
            rank = msg.get("rank", int)
            if rank not in self.ranks:
                wire.send(self.clients, Kind.ERROR, {"error": f"{self.name} does not serve rank {rank} (serves {self.ranks})"}, route=[ident])
                return
            if step < self.start_step:
                wire.send(self.clients, Kind.ERROR, {"error": f"step {step} is before this session's first step {self.start_step}", "step": step}, route=[ident])
                return
            self.last_request[rank] = max(self.last_request.get(rank, -1), step)
            self.pending.append((ident, step, rank, time.monotonic()))
            want = step + self.prefetch
            if want > self.asked_through:
                self.asked_through = want
                wire.send(self.planner, Kind.NEED_STEPS, {"session": self.session, "through": want})
        elif msg.kind == Kind.HEARTBEAT:
            wire.send(self.clients, Kind.HEARTBEAT, {}, route=[ident])
        else:
            raise WireError(f"unexpected {msg.kind.name} from a client")

    def serve_pending(self) -> None:
        still = []
        for ident, step, rank, since in self.pending:
            st = self.steps.get(step)
            if st is not None and st.complete:
                self._reply(ident, step, rank, since)
            else:
                still.append((ident, step, rank, since))
        self.pending = still
        # forget steps every known rank has moved past (a rank asks ahead by at most `prefetch`)
        if self.last_request:
            floor = min(self.last_request.values()) - self.prefetch - 1
            waiting = {step for _, step, _, _ in self.pending}
            for s in [s for s in self.steps if s < floor and s not in waiting]:
                del self.steps[s]

    # -- loop ---------------------------------------------------------------------------
    def run(self, *, max_seconds: float | None = None) -> None:
        deadline = None if max_seconds is None else time.monotonic() + max_seconds
        poller = zmq.Poller()
        for s in (self.planner, self.data, self.clients):
            poller.register(s, zmq.POLLIN)
        self._hello()
        try:
            while not self.stopped and (deadline is None or time.monotonic() < deadline):
                events = dict(poller.poll(100))
                if not self.welcomed and time.monotonic() - self._last_hello > 1.0:
                    self._hello()
                for sock, routed, handler in ((self.planner, False, "planner"), (self.data, False, "data"), (self.clients, True, "client")):
                    if sock not in events:
                        continue
                    for _ in range(1000):
                        try:
                            route, msg = wire.recv(sock, routed=routed, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except WireError as e:
                            self.m.bad_messages.labels("constructor", "decode").inc()
                            log.warning("%s: dropped a bad %s message: %s", self.name, handler, e)
                            continue
                        try:
                            if handler == "planner":
                                self.on_planner(msg)
                            elif handler == "data":
                                self.on_samples(msg)
                            else:
                                self.on_client(route[0], msg)
                        except WireError as e:
                            self.m.bad_messages.labels("constructor", "content").inc()
                            log.warning("%s: dropped a %s message: %s", self.name, handler, e)
                self.serve_pending()
        finally:
            self.close()

    def close(self) -> None:
        for s in (self.planner, self.data, self.clients):
            s.close(0)
