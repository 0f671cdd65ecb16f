"""Data Constructor: collects planned spans from loaders, builds each rank's batch, serves clients.

Thin shell: `constructor.collate` builds batches; this file only moves messages. Pull model: a
client's request for step s makes the constructor ask the planner for steps up to s + prefetch.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from mixplane import protocol, wire
from mixplane.component import PlannerFollower
from mixplane.constructor.collate import MissingPayload, SpanStore, hybrid_view, materialize_rank
from mixplane.constructor.hooks import apply_hook, hook_context, load_hook
from mixplane.constructor.multimodal import EncodedImage, QuarantinedImage, encoder_batch, encoder_shapes, fuse_batch
from mixplane.parallelism import (META_ONLY, broadcast_axes, cp_group_ranks, fanout_meta, metadata_only, pp_filter,
                                  rank_view, tp_receives, view_key)
from mixplane.layout import StepLayout
from mixplane.metrics import handoff_metrics
from mixplane.protocol import plan_cursor
from mixplane.spec import DataMixtureSpec
from mixplane.tokens import resolve_image_token_id
from mixplane.topology import backbone_coords, place_tree, topology_digest
from mixplane.wire import Kind, WireError

log = logging.getLogger("mixplane.constructor")
ENCODER_SHAPES = "encoder_shapes"
NEED_RETRY_S = 1.0
REPAIR_AFTER_S = 2.0  # a requested step whose spans stay missing this long is asked of the loaders again  # NEED_STEPS is asked again when requested steps stay unplanned this long  # a peer's view of its bucket leader's encoder batch (metadata only)


def encoder_leaders(spec: DataMixtureSpec) -> dict[int, int]:
    """Global rank -> the rank its images are assigned to: the lowest rank of its image-module
    DP x CP bucket (topology.consumer_leader; every rank of an encoder declared {dp: world})."""
    mod = place_tree(spec).image_module
    lead = mod.consumer_leader("WORLD")[mod.consumer_index("WORLD")]
    return {r: int(lead[r]) for r in range(spec.world_size)}


@dataclass
class StepState:
    layout: StepLayout | None = None
    spans: SpanStore = field(default_factory=SpanStore.empty)
    cursor_after: dict[str, Any] | None = None
    batches: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    views: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict)  # (dp_local, ViewKey) or a hybrid rank's
    broadcast: tuple[str, ...] = ()  # axes the trainer broadcasts along (from the plan's broadcast_at)
    images: dict[tuple[int, int], tuple[Any, tuple[int, int]]] = field(default_factory=dict)  # patches or EncodedImage
    created: float = field(default_factory=time.monotonic)
    # spans still missing, as (source, key, start) arrays; set when the layout arrives
    need_spans: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.zeros(0, np.int64),) * 3
    need_images: set[tuple[int, int]] = field(default_factory=set)
    # (source, replica) of every SAMPLES message held: a loader sends one per (step, constructor), and a
    # restarted loader sends again what may not have arrived, so a second one is a duplicate
    senders: set[tuple[int, int]] = field(default_factory=set)
    # images: the plan lists only this constructor's (protocol.IMG_BASE / ENCODER_TOKENS given) or all of them
    img_base: np.ndarray | None = None
    encoder_tokens: np.ndarray | None = None
    step_images: int = 0

    def expect(self, layout: StepLayout, ranks: list[int]) -> None:
        """What must arrive before the step can be built: every span of the layout, and the pixels
        of every image one of this constructor's ranks encodes."""
        self.layout = layout
        self.need_spans = (layout.seg_source, layout.seg_key, layout.seg_start)
        mine = np.isin(layout.img_rank, np.asarray(ranks, dtype=np.int64))
        self.need_images = set(zip(layout.img_source[mine].tolist(), layout.img_key[mine].tolist()))

    @property
    def missing_spans(self) -> int:
        return len(self.need_spans[0])

    @property
    def complete(self) -> bool:
        if self.layout is None:
            return False
        if self.missing_spans:
            src, key, start = self.need_spans
            missing = ~self.spans.contains(src, key, start)
            self.need_spans = (src[missing], key[missing], start[missing])
        if self.need_images:
            self.need_images = {k for k in self.need_images if k not in self.images}
        return not self.missing_spans and not self.need_images


def wire_advertised(bound: str, host: str | None) -> str:
    """`tcp://0.0.0.0:PORT` as `tcp://HOST:PORT` when an advertised host is given."""
    return bound if not host else f"tcp://{host}:{bound.rsplit(':', 1)[1]}"


class ConstructorServer(PlannerFollower):
    component = "constructor"

    def __init__(self, spec: DataMixtureSpec, index: int, planner_endpoint: str, *, host: str = "127.0.0.1",
                 context: zmq.Context | None = None, metrics_port: int | None = 0, ports: tuple[int, int] = (0, 0),
                 advertise_host: str | None = None):
        super().__init__(spec, f"constructor:{index}", context=context, metrics_port=metrics_port, logger=log)
        self.index = index
        # hooks.constructor: loaded before any socket opens (a hook that cannot be loaded stops the start, named)
        self.hook = load_hook(spec)
        self.hook_token_fields = tuple(spec.hooks.constructor.token_fields) if spec.hooks.constructor else ()
        # CURVE when runtime.curve is enabled: both bound sockets are servers, the planner link a client
        self.planner = self.ctx.socket(zmq.DEALER)
        self.planner.setsockopt(zmq.IDENTITY, self.name.encode())
        hb = spec.runtime.heartbeat_s  # ZMTP heartbeats on every socket: dead peers' pipes are dropped
        wire.configure_socket(self.planner, heartbeat_s=hb, max_msgsize=protocol.max_message_bytes(spec, "loader"))
        self.security.client(self.planner).connect(planner_endpoint)
        self.data = self.ctx.socket(zmq.PULL)
        wire.configure_socket(self.data, rcvhwm=256, heartbeat_s=hb, max_msgsize=protocol.max_message_bytes(spec, "data"))
        self.security.server(self.data).bind(f"tcp://{host}:{ports[0]}")
        self.clients = self.ctx.socket(zmq.ROUTER)
        self.clients.setsockopt(zmq.LINGER, 0)
        self.clients.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # bounded per-client queue (prefetch depth + slack); an unknown / vanished client raises instead of silently dropping
        # (a client keeps up to max_lead_steps requested: runtime.prefetch_s of training, time-sized)
        wire.configure_socket(self.clients, sndhwm=max(8, 4 * (spec.runtime.prefetch_steps + 1), 2 * (spec.runtime.max_lead_steps + 1)), rcvhwm=1000,
                              heartbeat_s=spec.runtime.heartbeat_s, router_mandatory=True,
                              max_msgsize=protocol.max_message_bytes(spec, "clients"))
        self.security.server(self.clients).bind(f"tcp://{host}:{ports[1]}")
        # what peers connect to (announced to the planner): the bound address, or advertise_host (a pod's IP
        # when binding 0.0.0.0) with the bound port
        self.data_endpoint = wire_advertised(self.data.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        self.client_endpoint = wire_advertised(self.clients.getsockopt_string(zmq.LAST_ENDPOINT), advertise_host)
        self.add_endpoint(self.planner, "planner", {
            Kind.WELCOME: self._on_welcome, Kind.PLAN_CONSTRUCTOR: self._on_plan, Kind.RESET: self._on_reset,
            Kind.SHUTDOWN: self._on_shutdown, Kind.HEARTBEAT: self._on_planner_heartbeat, Kind.ACK: self._ignore,
            Kind.FENCE: self._on_fence})
        self.add_endpoint(self.data, "data", {Kind.SAMPLES: self._on_samples}, server=True, members=False)
        self.add_endpoint(self.clients, "client", {Kind.GET_STEP: self._on_get_step, Kind.HEARTBEAT: self._on_client_heartbeat},
                          routed=True, server=True)
        self.welcomed = False
        # partition handoff: the newest epoch of each (source, replica) seen (FENCE, or SAMPLES carrying it);
        # SAMPLES of an older epoch come from a loader that lost its partition and are dropped
        self.fences: dict[tuple[int, int], int] = {}
        self.hm = handoff_metrics(self.m)
        self.session = -1
        self.incarnation = os.urandom(8).hex()  # clients re-request what they wait for when this changes
        self.ranks: list[int] = []
        self.dp_ranks: list[int] = []
        self.steps: dict[int, StepState] = {}
        self.pending: list[tuple[bytes, int, int, float]] = []  # identity, step, rank, since
        self.asked_through = -1
        self.last_request: dict[int, int] = {}  # rank -> last step it asked for
        self.ahead: dict[int, int] = {}  # rank -> how far past its consumed step that request asked (GET_STEP ahead)
        # rank -> last step handed to its socket: what releases steps and bounds requests, so requests
        # from peers that vanish (or claim a rank) cannot make a constructor drop steps a rank still needs
        self.delivered: dict[int, int] = {}
        # rank -> the furthest step ever handed to it, across sessions: a rewind (another rank rolled back) resets
        # `delivered`, but a rank that keeps running still asks up to its look-ahead past this (never refused)
        self.served_high: dict[int, int] = {}
        self.start_step = 0
        self.released_through = -1
        self.released_cursor: dict[str, Any] | None = None  # the cursor after step released_through (if known)
        self.planned_seen = -1  # the last step a PLAN_CONSTRUCTOR of this session announced
        self._need_sent = 0.0
        self._repair_asked: dict[int, float] = {}  # step -> when its spans were last asked for again
        self.prefetch = spec.runtime.prefetch_steps
        bb = spec.topology.backbone()[1]
        self.cp, self.pp = bb.cp, bb.pp
        # image placeholder id of each image_text source: the rule loaders apply (mixplane.tokens)
        self._image_token_ids = {si: resolve_image_token_id(src.image.image_token_id, src.tokenizer)
                                 for si, src in enumerate(spec.sources) if src.kind == "image_text"}
        self._coords = {r: backbone_coords(spec, r) for r in range(spec.world_size)}  # rank -> backbone coordinates
        self._backbone = place_tree(spec).backbone  # coordinates -> rank (a hybrid CP group's ranks)
        self._encoder_leader = encoder_leaders(spec)
        # the server builds the 'row' zig-zag layout; the per-document (THD) layout of mixplane.parallelism
        # needs rows packed with align=2*cp, which the planner does not do yet
        self.cp_layout = "row"
        if self.cp > 1 and spec.batch.seq_len % (2 * self.cp):
            raise ValueError(f"{self.name}: batch.seq_len {spec.batch.seq_len} must be a multiple of 2*cp = {2 * self.cp} "
                             "for the zig-zag context-parallel split")

    def hello(self) -> None:
        wire.send(self.planner, Kind.HELLO, {"role": "constructor", "index": self.index, "data_endpoint": self.data_endpoint,
                                             "client_endpoint": self.client_endpoint, "metrics_port": self.metrics_port,
                                             # what it holds: a restarted planner recovers from the first step missing here
                                             "session": self.session, "complete_through": self.complete_through,
                                             **({"cursor": cur} if (cur := self.cursor_after_complete()) else {}),
                                             # the planner stops a constructor whose spec is of another topology
                                             "topology": topology_digest(self.spec)})
        self.mark_hello()

    def cursor_after_complete(self) -> dict[str, Any] | None:
        """The cursor of the first step not complete here (after complete_through), when this constructor has it: a
        restarted planner re-plans from there instead of from its journal's last checkpoint (up to journal_every
        steps earlier)."""
        done = self.complete_through
        if done < 0 or self.session < 0:
            return None
        st = self.steps.get(done)
        cur = st.cursor_after if st is not None else (self.released_cursor if done == self.released_through else None)
        return cur if isinstance(cur, dict) and cur.get("step") == done + 1 else None

    def _reset(self, session: int, start_step: int) -> None:
        self.session = session
        self.released_cursor = None
        self.steps.clear()
        self.asked_through = start_step - 1
        self.start_step = start_step
        self.released_through = start_step - 1
        self.planned_seen = start_step - 1
        self.last_request.clear()
        self.ahead.clear()
        self.delivered.clear()
        # requests of the old session cannot be answered any more; clients re-request
        for ident, step, _rank, _ in self.pending:
            self._to_client(ident, Kind.ERROR, {"error": "delivery restarted (resume); request again", "step": step,
                                                "retry": True, "session": session})
        self.pending.clear()

    # -- planner / loader messages (one handler per kind; the component base checks schema and role) ------
    def on_planner(self, msg: wire.Message) -> None:
        """Handle one message from the planner (WireError if bad)."""
        self.dispatch(self.entry("planner"), b"", msg)

    def _on_welcome(self, _: bytes, msg: wire.Message) -> None:
        self.fences.clear()  # a (re)started planner numbers the epochs of its partition table afresh
        self.ranks = list(msg.get("ranks", list))
        self.dp_ranks = list(msg.get("dp_ranks", list))
        session = msg.get("session", int)
        again = self.session >= 0 and session == self.session  # a restarted planner continuing this session
        if not again:
            self._reset(session, msg.get("start_step", int))
        self.note_incarnation(msg)
        planned = msg.meta.get("planned_through")
        if isinstance(planned, int):  # a restarted constructor gets steps planned before it started
            self.planned_seen = max(self.planned_seen, planned)
        self.welcomed = True
        if again or self.session >= 0:
            self._need_steps()  # the planner learns what is needed (and that this WELCOME was processed)

    def _need_steps(self) -> None:
        """Ask the planner to plan through `asked_through`, saying what is complete and released here."""
        wire.send(self.planner, Kind.NEED_STEPS, {"session": self.session, "through": self.asked_through,
                                                  "complete_through": self.complete_through,
                                                  "released_through": self.released_through})
        self._need_sent = time.monotonic()

    def _on_plan(self, _: bytes, msg: wire.Message) -> None:
        if msg.get("session", int) != self.session:
            return
        try:
            layout = StepLayout.from_parts(msg.meta, msg.arrays)
        except ValueError as e:
            raise WireError(f"PLAN_CONSTRUCTOR: {e}") from None
        self.planned_seen = max(self.planned_seen, layout.step)
        if layout.step <= self.released_through:
            return  # re-planned after a planner restart, but every rank here already has it
        st = self.steps.setdefault(layout.step, StepState())
        if st.layout is not None:
            return  # sent again (planner or constructor restart): the step is the same
        st.expect(layout, self.ranks)
        st.cursor_after = plan_cursor(msg)
        st.img_base, st.encoder_tokens, st.step_images = protocol.plan_images(msg, len(layout.img_key), self.spec.world_size)
        bc = msg.meta.get("broadcast", [])
        if not (isinstance(bc, list) and all(isinstance(a, str) for a in bc)):
            raise WireError("PLAN_CONSTRUCTOR: field 'broadcast' must be a list of axis names")
        try:
            broadcast_axes(bc)
        except ValueError as e:
            raise WireError(f"PLAN_CONSTRUCTOR: field 'broadcast': {e}") from None
        st.broadcast = tuple(a.upper() for a in bc)
        self.m.constructor_pending_steps.set(sum(1 for s in self.steps.values() if not s.complete))

    def _on_reset(self, _: bytes, msg: wire.Message) -> None:
        self._reset(msg.get("session", int), msg.get("start_step", int))

    @property
    def sample_horizon(self) -> int:
        """The last step SAMPLES may be for: the planner plans at most max_lead_steps past what the
        slowest constructor asked for, and tells every constructor about every step it plans."""
        return max(self.planned_seen, self.asked_through, self.start_step - 1) + self.spec.runtime.max_lead_steps

    def on_samples(self, msg: wire.Message) -> None:
        """Handle one message of the data socket (WireError if bad)."""
        self.dispatch(self.entry("data"), b"", msg)

    def _on_samples(self, _: bytes, msg: wire.Message) -> None:
        if self.spec.runtime.checksum_payloads and not msg.flags & wire.FLAG_END:
            raise WireError("SAMPLES without checksums and end-of-message marker (runtime.checksum_payloads is on)")
        if msg.get("session", int) != self.session:
            return
        replica = msg.meta.get("replica", -1)
        if not isinstance(replica, int):
            raise WireError("SAMPLES: field 'replica' must be an integer")
        if self._fenced((msg.get("source", int), replica), msg):  # from a loader that lost its partition
            return
        step = msg.get("step", int)
        if step <= self.released_through or step < self.start_step or (step in self.steps and self.steps[step].batches):
            return
        horizon = self.sample_horizon
        if step > horizon:  # never planned, so never freed: refuse rather than hold it forever
            raise WireError(f"SAMPLES for step {step} beyond the planned horizon {horizon} "
                            f"(steps planned or asked for + max_lead_steps {self.spec.runtime.max_lead_steps})")
        keys, starts, offsets, values = msg.array("key"), msg.array("start"), msg.array("offsets"), msg.array("values")
        lens = msg.array("len")
        n = len(keys)
        if not (len(starts) == len(lens) == n and len(offsets) == n + 1) or (n and (offsets[0] != 0 or offsets[-1] != len(values) or np.any(np.diff(offsets) < lens))):
            raise WireError(f"SAMPLES for step {step}: inconsistent arrays")
        st = self.steps.setdefault(step, StepState())
        source = msg.get("source", int)
        replica = msg.meta.get("replica", -1)
        if not isinstance(replica, int):
            raise WireError(f"SAMPLES for step {step}: field 'replica' must be an integer")
        sender = (source, replica)
        if sender in st.senders:
            self.m.constructor_duplicate_samples.inc()
            return
        st.senders.add(sender)
        if "img_key" in msg.arrays:
            self._store_images(st, source, msg)
        st.spans.add(source, keys, starts, offsets, values)

    def _fenced(self, sender: tuple[int, int], msg: wire.Message) -> bool:
        epoch = msg.meta.get("epoch", 0)
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise WireError("SAMPLES: field 'epoch' must be an integer")
        fence = self.fences.get(sender, 0)
        if epoch < fence:
            self.hm.fenced.labels("SAMPLES").inc()
            self.limited.log(logging.WARNING, "fenced", "%s: dropped SAMPLES of %s from epoch %d (the partition is at "
                             "epoch %d: its old loader lost it)", self.name, sender, epoch, fence)
            return True
        if epoch > fence:
            self.fences[sender] = epoch
        return False

    def _on_fence(self, _: bytes, msg: wire.Message) -> None:
        key = (msg.get("source", int), msg.get("replica", int))
        self.fences[key] = max(self.fences.get(key, 0), msg.get("epoch", int))

    def _store_images(self, st: StepState, source: int, msg: wire.Message) -> None:
        if not 0 <= source < len(self.spec.sources):
            raise WireError(f"SAMPLES: unknown source {source}")
        ik, grid, off, val = msg.array("img_key"), msg.array("img_grid"), msg.array("img_offsets"), msg.array("img_values")
        p = self.spec.sources[source].image.patch_size
        dim = p * p * 3
        n = len(ik)
        if grid.shape != (n, 2) or len(off) != n + 1 or (n and (off[0] != 0 or off[-1] != len(val))) or np.any(np.diff(off) < 0):
            raise WireError("SAMPLES: inconsistent image arrays")
        if msg.meta.get("img_encoded"):  # raw encoded bytes: decoded here or by the client (image.decode_at)
            self._store_encoded(st, source, ik, grid, off, val, msg.meta.get("img_where"))
            return
        bad = msg.arrays.get("img_bad")  # the loader's decode: a header that read, pixels that did not
        if bad is not None and len(bad) != n:
            raise WireError("SAMPLES: img_bad must flag every image")
        for i in range(n):
            g = (int(grid[i, 0]), int(grid[i, 1]))
            flat = val[off[i]:off[i + 1]]
            if bad is not None and bad[i]:
                if len(flat):
                    raise WireError(f"SAMPLES: quarantined image of sample {int(ik[i])} carries {len(flat)} bytes")
                st.images[(source, int(ik[i]))] = (QuarantinedImage(p, "quarantined by its loader"), g)
                continue
            if len(flat) != g[0] * g[1] * dim:
                raise WireError(f"SAMPLES: image of sample {int(ik[i])} has {len(flat)} bytes, grid {g} needs {g[0] * g[1] * dim}")
            st.images[(source, int(ik[i]))] = (flat.reshape(g[0] * g[1], dim), g)

    def _store_encoded(self, st: StepState, source: int, ik: np.ndarray, grid: np.ndarray, off: np.ndarray,
                       val: np.ndarray, where: Any) -> None:
        src = self.spec.sources[source]
        if not isinstance(where, list) or len(where) != len(ik) or not all(isinstance(w, str) for w in where):
            raise WireError("SAMPLES: img_where must name every encoded image")
        if val.dtype != np.uint8:
            raise WireError(f"SAMPLES: encoded images are {val.dtype}, expected uint8")
        at_client = src.image.decode_at == "client"
        for i in range(len(ik)):
            g = (int(grid[i, 0]), int(grid[i, 1]))
            enc = EncodedImage(val[off[i]:off[i + 1]], src.image.patch_size, src.image.max_side,
                               f"source {src.name!r}, column {src.columns[0]!r}: {where[i]}", at_client)
            st.images[(source, int(ik[i]))] = (enc, g)

    # -- clients ------------------------------------------------------------------------
    def _batch_for(self, st: StepState, rank: int) -> dict[str, np.ndarray]:
        coords = self._coords[rank]
        dp_local = self.dp_ranks.index(coords.dp)
        b = st.batches.get(dp_local)
        if b is None:
            t0 = time.perf_counter()
            b = materialize_rank(st.layout, dp_local, st.spans, self.spec.batch.pad_id)  # type: ignore[arg-type]
            lay = st.layout
            if lay is not None and st.step_images:
                self._attach_images(b, lay, st)
            if self.hook is not None and lay is not None:  # hooks.constructor: before the CP / PP / TP cut
                b = apply_hook(self.hook, self.spec.hooks.constructor.name,
                               b, hook_context(self.spec, lay, coords.dp))
            st.batches[dp_local] = b
            self.m.constructor_build_seconds.observe(time.perf_counter() - t0)
            self.m.constructor_steps.inc()
        return b

    def _to_client(self, ident: bytes, kind: Kind, meta: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> bool | None:
        """Send to one client without blocking: True when sent, None when its queue is full (the
        caller may retry later: backpressure), False when it is gone (logged)."""
        return self.send_routed(self.clients, ident, kind, meta, arrays,
                                checksum=self.spec.runtime.checksum_payloads if kind in wire.PAYLOAD_KINDS else None)

    def _view_for(self, st: StepState, rank: int) -> dict[str, Any]:
        """What `rank` receives of its data-parallel batch: each distinct CP / PP / TP view is built once
        per step and shared (same buffers) by every rank that receives it."""
        c = self._coords[rank]
        dp_local = self.dp_ranks.index(c.dp)
        if st.layout is not None and st.layout.hybrid_cp:
            return self._hybrid_view(st, rank, dp_local)
        key = (dp_local, view_key(c.cp, c.pp, self.pp, c.tp, st.broadcast))
        v = st.views.get(key)
        if v is None:
            batch = self._batch_for(st, rank)
            v = rank_view(batch, cp=self.cp, cp_rank=c.cp, pp=self.pp, pp_stage=c.pp, tp_rank=c.tp,
                          broadcast_at=st.broadcast, cp_mode=self.cp_layout, extra_token_fields=self.hook_token_fields)
            st.views[key] = v
        if st.layout is not None and st.step_images:
            # the encoder batch is per rank, outside the backbone's TP rule: real tensors for the rank
            # that encodes them even when its backbone view is metadata-only
            v = {**v, **self._encoder_for(st, rank)}
        return v

    def _hybrid_view(self, st: StepState, rank: int, dp_local: int) -> dict[str, Any]:
        """A hybrid DP x CP step: the rank's parts of the CP groups it belongs to (parallelism.hybrid_rank_batch,
        built once per DP replica and CP rank), cut for its pipeline stage and TP rule, with the global ranks of
        each group (``cp_group_ranks``, CSR by ``cp_group_size``: per rank, so never part of a TP broadcast)."""
        lay = st.layout
        assert lay is not None
        c = self._coords[rank]
        if lay.hybrid_cp != self.cp:
            raise ValueError(f"hybrid layout for cp {lay.hybrid_cp}, the backbone has cp {self.cp}")
        key = (dp_local, "hybrid", c.cp)
        base = st.views.get(key)
        if base is None:
            base = hybrid_view(lay, dp_local, self._batch_for(st, rank), c.cp, self.spec.batch.pad_id)
            st.views[key] = base
        v = pp_filter(base, c.pp, self.pp)
        if not tp_receives(c.tp, st.broadcast):
            v = metadata_only(v)
        v["cp_group_ranks"] = cp_group_ranks(base, lambda cp: self._backbone.rank_of(dp=c.dp, pp=c.pp, cp=cp, tp=c.tp))
        return v

    def _image_settings(self, lay: StepLayout) -> tuple[int, int, int]:
        """(merge, placeholder id, patch vector size) shared by the step's image sources."""
        srcs = sorted({int(s) for s in lay.img_source}) or sorted(self._image_token_ids)  # none of them listed here
        specs = [self.spec.sources[s].image for s in srcs]
        merge, token_id, p = specs[0].merge, self._image_token_ids[srcs[0]], specs[0].patch_size
        if any((x.merge, x.patch_size) != (merge, p) for x in specs) or any(self._image_token_ids[s] != token_id for s in srcs):
            raise ValueError(f"step {lay.step}: image sources of one step must share image.merge, patch_size and placeholder")
        return merge, token_id, p * p * 3

    def _attach_images(self, b: dict[str, np.ndarray], lay: StepLayout, st: StepState) -> None:
        merge, token_id, _ = self._image_settings(lay)
        fuse_batch(b, img_source=lay.img_source, img_key=lay.img_key, img_rank=lay.img_rank, img_patches=lay.img_patches,
                   world=self.spec.world_size, image_token_id=token_id, merge=merge, pad_id=self.spec.batch.pad_id,
                   img_base=st.img_base, encoder_tokens=st.encoder_tokens)

    def _encoder_for(self, st: StepState, rank: int) -> dict[str, Any]:
        """The encoder part of `rank`'s message. Images are assigned to the lowest rank of an image-module
        DP x CP bucket (its leader); the leader gets the pixels, its TP / PP peers the leader's shapes
        (``encoder_shapes``: receive buffers for a trainer-side broadcast from ``encoder_leader``)."""
        lay = st.layout
        assert lay is not None
        merge, _, dim = self._image_settings(lay)
        leader = self._encoder_leader[rank]
        if leader != rank:
            return {ENCODER_SHAPES: encoder_shapes(leader, img_rank=lay.img_rank, img_patches=lay.img_patches, patch_dim=dim),
                    "encoder_leader": leader}
        try:
            return {**encoder_batch(rank, img_source=lay.img_source, img_key=lay.img_key, img_rank=lay.img_rank,
                                    img_patches=lay.img_patches, images=st.images, merge=merge, patch_dim=dim,
                                    on_quarantine=lambda err: self._quarantined_image(lay.step, err)),
                    "encoder_leader": rank}
        except KeyError as e:
            raise MissingPayload(f"step {lay.step}: {e.args[0]}") from None

    def _quarantined_image(self, step: int, error: str) -> None:
        """An image decoded here whose pixels did not decode: delivered as zeros of its grid (image_quarantined),
        counted and logged naming its source, column, sample key, file and row; the stream goes on."""
        self.m.constructor_quarantined_images.inc()
        self.limited.log(logging.WARNING, "bad_image", "%s: step %d: %s (decoded at the constructor): quarantined, "
                         "delivered as zeros of its planned grid (image_quarantined)", self.name, step, error)

    def _reply(self, ident: bytes, step: int, rank: int, since: float) -> bool:
        """Answer one request; False when it must wait (the client's queue is full)."""
        st = self.steps[step]
        lay = st.layout
        assert lay is not None
        try:
            view = self._view_for(st, rank)
        except MissingPayload as e:
            self._to_client(ident, Kind.ERROR, {"error": f"{self.name}: {e}", "step": step})
            return True
        except ValueError as e:  # a layout the parallel transforms cannot split: name it, keep serving
            self._to_client(ident, Kind.ERROR, {"error": f"{self.name}: step {step}: {e}", "step": step})
            return True
        arrays = {k: v for k, v in view.items() if isinstance(v, np.ndarray)}
        meta = {"step": step, "rank": rank, "incarnation": self.incarnation, "phase": lay.phase, "lr_scale": lay.lr_scale, "generation": lay.generation,
                "session": self.session, "microbatches": lay.microbatches, "seq_len": lay.seq_len,
                "cursor_after": st.cursor_after, "meta_only": bool(view.get(META_ONLY, False)),
                "coords": self._coords[rank].as_dict()}
        for k in ("shapes", ENCODER_SHAPES):
            if k in view:
                meta[k] = view[k]
        axes = broadcast_axes(st.broadcast)
        if "cp" in axes or "pp" in axes:  # the client's part of the fan-out (client.fan_out)
            meta["fanout"] = fanout_meta(axes, cp=self.cp, pp=self.pp, cp_mode=self.cp_layout, seq_len=lay.seq_len,
                                         token_fields=self.hook_token_fields)
        extra = {k: v for k, v in view.items() if not isinstance(v, np.ndarray) and k not in ("shapes", ENCODER_SHAPES, META_ONLY)}
        if extra:
            meta["extra"] = extra
        sent = self._to_client(ident, Kind.STEP_DATA, meta, arrays)
        if sent is None:
            return False  # the client's queue is full: keep the request, send when it drains
        if not sent:
            return True
        self.delivered[rank] = max(self.delivered.get(rank, self.start_step - 1), step)
        self.served_high[rank] = max(self.served_high.get(rank, -1), step)
        self.m.constructor_bytes_sent.inc(sum(a.nbytes for a in arrays.values()))
        self.m.constructor_client_wait_seconds.observe(time.monotonic() - since)
        return True

    def on_client(self, ident: bytes, msg: wire.Message) -> None:
        """Handle one message from the client `ident` (WireError if bad)."""
        self.dispatch(self.entry("client"), ident, msg)

    def _on_client_heartbeat(self, ident: bytes, msg: wire.Message) -> None:
        # what this constructor waits for: a client that times out names it (a hung or restarting planner)
        self._to_client(ident, Kind.HEARTBEAT, {"incarnation": self.incarnation,
                                                "silent": {n: round(q, 1) for n, q in self.silent.items()}})  # the client may be gone already: counted, never raised

    def _on_get_step(self, ident: bytes, msg: wire.Message) -> None:
        step = msg.get("step", int)
        rank = msg.get("rank", int)
        if self.session < 0:
            # a restarted constructor that the planner has not welcomed yet (it does not know its ranks): the request
            # waits; the WELCOME's session start answers it with a retry (see _reset), and the client asks again
            if not any(p[0] == ident and p[1] == step and p[2] == rank for p in self.pending):
                self.pending.append((ident, step, rank, time.monotonic()))
            return
        if rank not in self.ranks:
            self._to_client(ident, Kind.ERROR, {"error": f"{self.name} does not serve rank {rank} (serves {self.ranks})"})
            return
        if step <= self.released_through:
            self._to_client(ident, Kind.ERROR, {"error": f"{self.name}: step {step} was already delivered to every rank "
                                                f"and released (steps up to {self.released_through}); resume from a "
                                                "state_dict to get it again", "step": step, "released": True,
                                                "session": self.session})
            return
        if step < self.start_step:
            # not held here (delivery was rewound past it): a rank that rejoined resumes with a rewind
            self._to_client(ident, Kind.ERROR, {"error": f"{self.name}: step {step} is before this session's first step "
                                                f"{self.start_step}", "step": step, "released": True,
                                                "session": self.session})
            return
        # a client asks at most its look-ahead past what it received (in this session or, for a rank that kept
        # running through another rank's rewind, before it)
        horizon = (max(max(self.delivered.values(), default=self.start_step - 1), self.served_high.get(rank, -1),
                       self.planned_seen) + self.prefetch + 1 + self.spec.runtime.max_lead_steps)
        if step > horizon:  # clients ask in order: a far-future step is a bug or garbage, not a prefetch
            self._to_client(ident, Kind.ERROR, {"error": f"{self.name}: step {step} is more than max_lead_steps "
                                                f"({self.spec.runtime.max_lead_steps}) ahead of what ranks asked for", "step": step})
            return
        if step > self.last_request.get(rank, -1):
            self.last_request[rank] = step
            self.ahead[rank] = self._client_ahead(msg)
        if not any(p[0] == ident and p[1] == step and p[2] == rank for p in self.pending):  # a client's retry
            self.pending.append((ident, step, rank, time.monotonic()))
        want = step + self.prefetch
        if want > self.asked_through:
            self.asked_through = want
            self._need_steps()

    def _client_ahead(self, msg: wire.Message) -> int:
        """How many steps past the one it consumes a client asks (GET_STEP `ahead`, its time-sized look-ahead;
        clients that do not say ask prefetch_steps ahead)."""
        a = msg.meta.get("ahead")
        if isinstance(a, int) and not isinstance(a, bool) and 0 <= a <= max(self.prefetch, self.spec.runtime.max_lead_steps):
            return a
        return self.prefetch

    @property
    def complete_through(self) -> int:
        """Every step up to this one holds all its spans here (or was released): no loader needs to resend it."""
        s = self.released_through
        while (st := self.steps.get(s + 1)) is not None and st.complete:
            s += 1
        return s

    def serve_pending(self) -> None:
        still = []
        for ident, step, rank, since in self.pending:
            st = self.steps.get(step)
            if st is not None and st.complete and self._reply(ident, step, rank, since):
                continue
            else:
                still.append((ident, step, rank, since))
        self.pending = still
        if self.ranks:
            # every served rank consumes every step: keep a step until the slowest rank has moved past it
            # (asked its look-ahead + 1 steps further) and it was handed to that rank (requests alone can lie);
            # a rank that restarts from its state_dict finds its next step here
            before = self.start_step - 1
            floor = min(min(self.delivered.get(r, before),
                            self.last_request.get(r, before) - self.ahead.get(r, self.prefetch) - 1)
                        for r in self.ranks)
            waiting = {step for _, step, _, _ in self.pending}
            for s in sorted(s for s in self.steps if s < floor and s not in waiting):
                if s > self.released_through:
                    self.released_through = s
                    self.released_cursor = self.steps[s].cursor_after
                del self.steps[s]

    # -- loop ---------------------------------------------------------------------------
    # -- payload integrity: a damaged SAMPLES message is refused, counted by sender and asked for again --------
    def on_damaged(self, e: Any, identity: bytes, frames: list[Any], err: WireError) -> None:
        if e.label != "data":
            return
        meta = wire.peek_meta(frames)
        source, replica, step = meta.get("source"), meta.get("replica"), meta.get("step")
        names = self.spec.source_names()
        sender = (f"loader:{names[source]}:{replica}" if isinstance(source, int) and 0 <= source < len(names)
                  else "unknown loader")
        self.m.payload_damaged.labels(self.component, "SAMPLES", sender).inc()
        self.limited.log(logging.WARNING, "damaged", "%s: refused a damaged SAMPLES message from %s (step %s): %s; "
                         "asking for it again", self.name, sender, step, err)
        if isinstance(step, int):
            self._ask_again(step, force=True)

    def _ask_again(self, step: int, *, force: bool = False) -> None:
        """Ask the loaders (through the planner) to push their spans of `step` here again: a SAMPLES message was
        damaged or lost. Only for a step this constructor still builds, at most once per REPAIR_AFTER_S."""
        st = self.steps.get(step)
        now = time.monotonic()
        if (not self.welcomed or st is None or st.layout is None or st.complete
                or now - self._repair_asked.get(step, -1e9) < (0.2 if force else REPAIR_AFTER_S)):
            return
        self._repair_asked[step] = now
        wire.send(self.planner, Kind.RESEND, {"session": self.session, "constructor": self.index, "from_step": step,
                                              "to_step": step})

    def _repair(self) -> None:
        """Requested steps whose spans stay missing past REPAIR_AFTER_S are asked for again."""
        now = time.monotonic()
        for _, step, _, since in self.pending:
            if now - since > REPAIR_AFTER_S:
                self._ask_again(step)
        for s in [s for s in self._repair_asked if s <= self.released_through or s not in self.steps]:
            del self._repair_asked[s]

    def tick(self) -> None:
        self.serve_pending()
        self._repair()
        # a request the planner lost (it restarted, or the message was dropped): ask again, at most once a second
        if (self.welcomed and self.pending and self.planned_seen < max(p[1] for p in self.pending)
                and time.monotonic() - self._need_sent > NEED_RETRY_S):
            self._need_steps()
