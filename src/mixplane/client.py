"""Trainer-side client: one dict of torch tensors per step for this rank.

    from mixplane.client import MixtureLoader
    loader = MixtureLoader()                 # planner endpoint and rank from the environment (torchrun)
    for batch in loader:                     # input_ids, labels, position_ids, cu_seqlens, source_ids, step, lr_scale, phase, generation, ...
        ...
    state = loader.state_dict()              # save with the model checkpoint
    loader.load_state_dict(state)            # resume exactly: same batches, no repeats, no gaps
    loader.report_loss(step, *source_loss(token_loss, batch["source_ids"], len(loader.sources), batch["labels"]))
                                             # per-source loss to the planner, at most one report per MIXPLANE_LOSS_REPORT_S

Configuration (argument, else environment): ``planner`` / MIXPLANE_PLANNER; ``rank`` / RANK (torchrun),
checked against WORLD_SIZE and the mixture's topology — or ``coords={"dp": .., "pp": .., "cp": .., "tp": ..}``,
the rank's backbone mesh position, which the planner maps to its global rank; ``prefetch_s`` / MIXPLANE_PREFETCH_S
(seconds of training held ready ahead, default the mixture's ``runtime.prefetch_s``: the client measures the
trainer's time per step and keeps that many seconds of steps requested — at least 2, at most the mixture's
``max_lead_steps`` — so a component failover or restart shorter than it costs the trainer no wait); ``prefetch``
/ MIXPLANE_PREFETCH (a fixed number of steps requested ahead instead; with ``prefetch_s`` too, the least);
``timeout_s`` / MIXPLANE_TIMEOUT_S (default: the mixture's ``runtime.step_timeout_s``, sent by the planner; 120 until then); ``heartbeat_s`` / MIXPLANE_HEARTBEAT_S (ZMTP heartbeat
interval of both sockets, default 2, 0 disables); CURVE from ``curve=`` or MIXPLANE_CURVE_DIR (+
MIXPLANE_CURVE_NAME, default ``client``; the servers' public key is ``server.key`` there). The client
knows only the planner's address and asks it which constructor serves its rank.

What a rank receives follows its coordinates: a CP rank gets its zig-zag shard (``cp_token_index``
says which positions), the first PP stage the inputs, the last the labels, middle stages metadata;
under ``broadcast_at('TP')`` only tp = 0 receives tensors and the other TP ranks get empty tensors of
the right shapes (``meta_only`` is 1) — pass ``tp_group=`` and the client broadcasts into them. Under
``broadcast_at('CP')`` / ``('PP')`` only the group's coordinate-0 rank receives tensors (the whole sequence,
every stage's fields) and the client fans them out (:func:`fan_out`; pass ``groups={"cp": .., "pp": ..}``): every
rank ends with the tensors it would have received without the broadcast. The
encoder batch (``pixel_patches``, ...) is per rank and never part of that broadcast: the rank that
encodes images gets them as tensors; its image-module TP / PP peers get empty buffers of its shapes
(``encoder_meta_only``) that :func:`broadcast_encoder` fills.

Receive is zero-copy: tensors are views of the received ZeroMQ frames (no copy between the socket
and torch). Every message is checked (step, rank, shapes, cu_seqlens) before it is handed out.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import time
from collections import deque
from typing import Any, Iterator

import numpy as np
import torch
import zmq

from mixplane.errors import MixplaneError
from mixplane.imagedecode import ImageDecodeError, decode_encoder_images
from mixplane import podend, settings, wire
from mixplane.parallelism import fanout_options, group_token_index, narrow, serves
from mixplane.protocol import ENCODER_FIELDS
from mixplane.wire import Kind, WireError

STATE_VERSION = 1
log = logging.getLogger("mixplane.client")
PROBE_S = 1.0  # the client beats to its constructor this often (a restarted one is noticed before its steps are due)
DEFAULT_PREFETCH = 2  # steps requested ahead at least (and before the trainer's step time is known)
STEP_TIMES = 9  # the trainer's time per step is the median of this many recent steps
LOSS_REPORT_S = 1.0  # per-source losses go to the planner at most this often (report_loss)
CLOSE_REPORT_LINGER_MS = 1000  # a loss report sent by close() may take this long to leave
RETRY_S = 0.2  # a planner request refused with a retry flag (the planner is recovering) is sent again this often
# An unanswered ROUTE is asked again this often, on a new socket (a new connection; an answer to the old ask goes
# to the closed socket, never mistaken for the answer to a later request): a request the planner never got (its
# process restarted, its pod replaced behind the Service while the request was on the way) is otherwise waited
# for until the step timeout. ROUTE changes nothing at the planner, so asking twice is harmless.
ROUTE_RESEND_S = 5.0
_TORCH_DTYPES = {"int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32,
                 "int64": torch.int64, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
                 "bool": torch.bool}


def resume_attempt() -> str | None:
    """What the ranks of one (re)launch of a job share, so their resumes restart delivery once:
    MIXPLANE_RESUME_ID if set, else torchrun's run id and restart count, else the rendezvous address."""
    env = os.environ
    if settings.get("MIXPLANE_RESUME_ID"):
        return settings.get("MIXPLANE_RESUME_ID")
    if "TORCHELASTIC_RESTART_COUNT" in env:
        return f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env['TORCHELASTIC_RESTART_COUNT']}/{env.get('MASTER_PORT', '')}"
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    return None


def lookahead_steps(prefetch_s: float | None, step_s: float | None, least: int, most: int) -> int:
    """Steps to keep requested ahead so that `prefetch_s` seconds of training are ready: a failure the data
    plane recovers from within that time never reaches the trainer. `least` until the step time is known
    (and when the look-ahead is off), never more than `most` (what constructors and loaders hold for it)."""
    if not prefetch_s or step_s is None or step_s <= 0:
        return least
    return max(least, min(most, math.ceil(prefetch_s / step_s)))


class DeliveryError(MixplaneError, RuntimeError):
    """The data plane did not deliver a step; the text names the endpoint and step."""


_WIDENED = frozenset({np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64)})


def _torch_dtype(dt: np.dtype) -> torch.dtype | None:
    """The torch dtype a received array of numpy dtype `dt` becomes (unsigned > 8 bit widen to int64,
    as :func:`_tensor` does); None when torch has no equivalent."""
    return torch.int64 if dt in _WIDENED else _TORCH_DTYPES.get(dt.name)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor sharing `a`'s memory (frames received with copy=False are writable, so this is the
    zero-copy path); copies only when it must: unsigned > 8 bit (widened: torch lacks most ops on them)
    and read-only buffers (torch cannot guard them, a write would corrupt the sender's bytes)."""
    if a.dtype in _WIDENED:
        return torch.from_numpy(a.astype(np.int64))
    if a.flags.writeable:
        return torch.from_numpy(a)  # shares the frame's memory
    return torch.from_numpy(a.copy())


def check_step_data(msg: wire.Message, step: int, rank: int, where: str) -> None:
    """Reject a STEP_DATA message whose content is inconsistent (raises DeliveryError naming `where`)."""
    def bad(what: str) -> DeliveryError:
        return DeliveryError(f"rank {rank}: step {step} from {where}: {what}")

    if msg.meta.get("rank", rank) != rank:
        raise bad(f"addressed to rank {msg.meta.get('rank')}")
    arrays = msg.arrays
    lead = None
    for name in ("input_ids", "labels", "position_ids", "source_ids"):
        if name in arrays:
            if arrays[name].ndim != 2:
                raise bad(f"{name} has {arrays[name].ndim} dimensions, expected 2")
            if lead is None:
                lead = arrays[name].shape
            elif arrays[name].shape != lead:
                raise bad(f"{name} has shape {arrays[name].shape}, others {lead}")
    cu = arrays.get("cu_seqlens")
    if cu is not None:
        S = msg.meta.get("seq_len")
        if cu.ndim != 1 or len(cu) < 1 or cu[0] != 0 or np.any(np.diff(cu.astype(np.int64)) <= 0):
            raise bad("cu_seqlens is not strictly increasing from 0")
        if "cp_group_size" in arrays:  # hybrid DP x CP: one row of this rank's parts of its CP groups
            if lead is not None and (lead[0] != 1 or int(cu[-1]) != lead[1]):
                raise bad(f"hybrid CP step: cu_seqlens ends at {int(cu[-1])}, tokens have shape {lead}")
        elif isinstance(S, int) and lead is not None and "cp_token_index" not in arrays and int(cu[-1]) != lead[0] * S:
            raise bad(f"cu_seqlens ends at {int(cu[-1])}, rows hold {lead[0] * S} tokens")


class MixtureLoader:
    def __init__(self, planner: str | None = None, *, rank: int | None = None, prefetch: int | None = None,
                 prefetch_s: float | None = None, timeout_s: float | None = None, max_steps: int | None = None, context: zmq.Context | None = None,
                 curve: wire.CurveSetup | None = None, tp_group: Any = None, world_size: int | None = None,
                 heartbeat_s: float | None = None, encoder_group: Any = None, coords: dict[str, int] | None = None,
                 groups: dict[str, Any] | None = None):
        self.planner_endpoint = planner or settings.get("MIXPLANE_PLANNER")
        if not self.planner_endpoint:
            raise ValueError("no planner endpoint: pass planner= or set MIXPLANE_PLANNER (printed by `mixplane run`)")
        if coords is not None and rank is not None:
            raise ValueError("pass rank= or coords=, not both")
        # explicit backbone coordinates {dp, pp, cp, tp}: the planner maps them to the global rank on connect
        self.requested_coords = dict(coords) if coords is not None else None
        r = rank if rank is not None else (settings.get("RANK") if settings.get("RANK") is not None else settings.get("MIXPLANE_RANK"))
        self.rank = -1 if coords is not None else int(r if r is not None else 0)
        self.world_size = world_size if world_size is not None else settings.get("WORLD_SIZE")
        if coords is None and self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside WORLD_SIZE {self.world_size}")
        self.local_rank = settings.get("LOCAL_RANK")
        pf = prefetch if prefetch is not None else settings.get("MIXPLANE_PREFETCH")
        self.prefetch = max(0, int(pf if pf is not None else DEFAULT_PREFETCH))
        # time-sized look-ahead: unless a fixed depth is asked for, the mixture's runtime.prefetch_s (route reply)
        ps = prefetch_s if prefetch_s is not None else settings.get("MIXPLANE_PREFETCH_S")
        self._prefetch_s_fixed = ps is not None
        self.prefetch_s: float | None = max(0.0, float(ps)) if ps is not None else None
        if pf is not None and ps is None:
            self.prefetch_s = 0.0  # prefetch= alone: exactly that many steps, as before
            self._prefetch_s_fixed = True
        self.max_ahead = 32  # the mixture's max_lead_steps (route reply): what constructors and loaders hold for it
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES)  # the trainer's recent time per step
        self._handed: float | None = None  # when the last batch was handed to the trainer
        self._probed = 0.0  # when the client last beat to its constructor
        # the spec's runtime.step_timeout_s (from the planner's route reply) unless set here or in the environment
        env_timeout = settings.get("MIXPLANE_TIMEOUT_S")
        self._timeout_fixed = timeout_s is not None or env_timeout is not None
        self.timeout_s = timeout_s if timeout_s is not None else (env_timeout if env_timeout is not None else 120.0)
        self.max_steps = max_steps
        hb = heartbeat_s if heartbeat_s is not None else settings.get("MIXPLANE_HEARTBEAT_S")
        self.heartbeat_s = hb if hb > 0 else None  # ZMTP heartbeats: a dead server is noticed, its pipe dropped
        self.ctx = context or zmq.Context.instance()
        self.tp_group = tp_group
        # process groups of the broadcast axes ({'cp': .., 'pp': .., 'tp': ..}): the fan-out of broadcast_at('CP' / 'PP')
        self.groups = {str(k).lower(): v for k, v in (groups or {}).items()}
        if tp_group is not None:
            self.groups.setdefault("tp", tp_group)
        bad = sorted(set(self.groups) - {"cp", "pp", "tp"})
        if bad:
            raise ValueError(f"groups: unknown axis {', '.join(map(repr, bad))} (cp, pp, tp)")
        self.received_bytes = 0  # tensor bytes received from the constructor
        self.image_decode_cpu_s = 0.0  # CPU seconds this client spent decoding images (image.decode_at client)
        # images this client decoded whose pixels did not (header read, file truncated): (step, the error naming the
        # source, column, sample key, file and row); delivered as zeros of their grid with image_quarantined 1
        self.quarantined_images: list[tuple[int, str]] = []
        self.fanout_bytes = 0  # tensor bytes this rank sent its peers in fan-outs (broadcast_at CP / PP / TP)
        self._fanout: dict[str, Any] | None = None  # the fan-out of the step received last
        self.encoder_group = encoder_group  # the image-module bucket's group: broadcast_encoder after each step
        self._planner: zmq.Socket | None = None
        self._sock: zmq.Socket | None = None
        self.endpoint: str | None = None
        self.coords: dict[str, int] = {}
        self.sources: list[str] = []
        self.next_step = 0
        self._resume_cursor: dict[str, Any] | None = None
        self._cursor: dict[str, Any] | None = None
        self._inflight: deque[int] = deque()
        self._early: dict[int, wire.Message] = {}
        self._started = False
        self._from_start = False
        self._rejoined: dict[str, Any] | None = None  # the state this rank rejoined a running session with
        self._session = -1  # the delivery session this rank last resumed into (stale answers are older)
        self._server_incarnation: str | None = None  # the constructor process that answers (changes on a restart)
        self._heard = time.time()  # when the constructor last sent anything
        self.re_requests = 0  # GET_STEPs sent again after the constructor was restarted
        self.damaged = 0  # STEP_DATA messages refused as damaged or truncated (and asked for again)
        self._require_sums = False
        # per-source loss reports to the planner (report_loss): sums since the last report, sent at most every
        # loss_report_s seconds (MIXPLANE_LOSS_REPORT_S, default 1)
        lr_s = settings.get("MIXPLANE_LOSS_REPORT_S")
        self.loss_report_s = float(lr_s) if lr_s is not None else LOSS_REPORT_S
        self._loss_sum: np.ndarray | None = None
        self._loss_tokens: np.ndarray | None = None
        self._loss_from: int | None = None
        self._loss_through = -1
        self._loss_sent = time.monotonic()
        self.loss_reports_sent = 0
        self._server_silent: dict[str, float] = {}  # peers the constructor reports silent (name -> seconds), from its beats  # the mixture checksums payloads: STEP_DATA without them is refused
        if curve is None and settings.get("MIXPLANE_CURVE_DIR"):
            curve = wire.CurveSetup.from_dir(settings.get("MIXPLANE_CURVE_DIR"), settings.get("MIXPLANE_CURVE_NAME"))
        self.curve = curve
        # a shared `client` key gives way to this rank's own key when the key directory has one
        # (runtime.rank_binding: a rank's batches go only to the holder of its key)
        self._rank_keys = bool(curve is not None and curve.key_dir and os.path.isfile(
            os.path.join(curve.key_dir, "client" + wire.SECRET_SUFFIX)) and wire.load_keys(curve.key_dir, "client") == curve.keys)
        # sidecar placement: the directory shared with the pod's loader containers (mixplane.podend): this rank
        # holds its lock there while the process runs, and close() marks a clean end, so the loaders end with it
        self.pod_dir: str | None = settings.get("MIXPLANE_POD_DIR")
        self._pod_marked = False
        self._mark_running()

    def _mark_running(self) -> None:
        """(Again on every connect: a loader used again after close() is running again, its done mark cleared.)"""
        if self.pod_dir and self.rank >= 0:
            podend.mark_running(self.pod_dir, self.rank)
            self._pod_marked = True

    def _curve_keys(self) -> wire.CurveKeys | None:
        if self.curve is None:
            return None
        if self._rank_keys and self.rank >= 0:
            name = wire.rank_key_name(self.curve.key_dir, self.rank)
            if name is not None:
                return wire.load_keys(self.curve.key_dir, name)
        return self.curve.keys

    def _socket(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        wire.configure_socket(s, heartbeat_s=self.heartbeat_s)
        keys = self._curve_keys()
        if self.curve is not None and keys is not None:
            wire.curve_client(s, keys, self.curve.server_key("server"))
        return s

    # -- connection -----------------------------------------------------------------------
    def _request(self, sock: zmq.Socket, kind: Kind, meta: dict[str, Any], what: str,
                 resend_s: float | None = None) -> wire.Message:
        """One request to the planner; a refusal with a retry flag (a restarted planner still recovering its
        session) is asked again every RETRY_S until `timeout_s`. `resend_s` (idempotent requests only): without
        an answer after that long, asked again on a new planner socket (it becomes `self._planner`)."""
        deadline = time.monotonic() + self.timeout_s
        asks = 0
        while True:
            wire.send(sock, kind, meta)
            asks += 1
            try:
                wait = deadline - time.monotonic()
                if resend_s is not None and wait > resend_s:
                    if not sock.poll(int(resend_s * 1000)):
                        sock.close(0)
                        sock = self._planner = self._socket()
                        sock.connect(self.planner_endpoint)
                        continue
                    wait = deadline - time.monotonic()
                _, msg = wire.recv_timeout(sock, max(0.001, wait), what=f"answer to {what}")
            except wire.PeerTimeout:
                raise DeliveryError(f"rank {self.rank}: no answer to {what} from the planner at {self.planner_endpoint} "
                                    f"within {self.timeout_s:g}s" + (f" (asked {asks} times)" if asks > 1 else "")
                                    + self._why_waiting()) from None
            except WireError as e:
                raise DeliveryError(f"rank {self.rank}: malformed answer to {what} from {self.planner_endpoint}: {e}") from None
            if msg.kind == Kind.ERROR and msg.meta.get("retry") is True and time.monotonic() + RETRY_S < deadline:
                time.sleep(RETRY_S)
                continue
            if msg.kind == Kind.ERROR:
                raise DeliveryError(f"rank {self.rank}: {what} refused by {self.planner_endpoint}: {msg.meta.get('error')}")
            return msg

    def _connect(self) -> None:
        p = self._socket()
        p.connect(self.planner_endpoint)
        self._planner = p
        ask = {"rank": self.rank} if self.requested_coords is None else {"coords": self.requested_coords}
        route = self._request(p, Kind.ROUTE, ask, "route", resend_s=ROUTE_RESEND_S)
        p = self._planner  # (a new socket when the route was asked again)
        if self.requested_coords is not None:
            self.rank = route.get("rank", int)
            if self._rank_keys and wire.rank_key_name(self.curve.key_dir, self.rank) is not None:  # type: ignore[union-attr]
                p.close(0)  # from here on as this rank's key holder (resume, steps)
                p = self._socket()
                p.connect(self.planner_endpoint)
                self._planner = p
        self._mark_running()
        self._require_sums = route.meta.get("checksum_payloads") is True
        ps, lead = route.meta.get("prefetch_s"), route.meta.get("max_lead_steps")
        if not self._prefetch_s_fixed and isinstance(ps, (int, float)) and math.isfinite(ps) and ps >= 0:
            self.prefetch_s = float(ps)
        if isinstance(lead, int) and not isinstance(lead, bool) and lead >= 1:
            self.max_ahead = lead
        spec_timeout = route.meta.get("step_timeout_s")
        if not self._timeout_fixed and isinstance(spec_timeout, (int, float)) and math.isfinite(spec_timeout) and spec_timeout > 0:
            self.timeout_s = float(spec_timeout)
        world = route.meta.get("world_size")
        if self.world_size is not None and isinstance(world, int) and world != self.world_size:
            # a smaller torchrun world would silently train on part of every global batch
            raise DeliveryError(f"rank {self.rank}: WORLD_SIZE is {self.world_size} but the mixture served by "
                                f"{self.planner_endpoint} has a topology of {world} ranks")
        resume = self._resume_cursor
        if resume is None and self._from_start:
            resume = route.meta.get("initial_cursor")  # a state saved before the first step: restart at step 0
        if resume is not None:
            meta = {"cursor": resume, "rank": self.rank}
            attempt = resume_attempt()
            if attempt is not None:
                meta["attempt"] = attempt
            ack = self._request(p, Kind.RESUME, meta, "resume")
            if ack.kind != Kind.ACK:
                raise DeliveryError(f"rank {self.rank}: unexpected {ack.kind.name} to resume")
            self._cursor = copy.deepcopy(resume)
            # rejoined the running session (this rank restarted alone): if its constructor released the
            # step after all, resume again with a rewind (see _rewind)
            self._rejoined = copy.deepcopy(resume) if ack.meta.get("rejoin") is True else None
            if isinstance(ack.meta.get("session"), int):
                self._session = ack.meta["session"]
        elif route.meta.get("start_step") == self.next_step and isinstance(route.meta.get("session_start"), dict):
            self._cursor = copy.deepcopy(route.meta["session_start"])  # state_dict() works before the first step
        self._resume_cursor = None
        self._from_start = False
        self.endpoint = route.get("endpoint", str)
        self.coords = dict(route.get("coords", dict))
        self.sources = list(route.get("sources", list))
        s = self._socket()
        s.setsockopt(zmq.RCVHWM, max(4, 2 * (max(self.prefetch, self.max_ahead) + 1)))
        s.connect(self.endpoint)
        self._sock = s
        self._started = True

    @property
    def lookahead(self) -> int:
        """Steps this rank keeps requested ahead now (time-sized from the trainer's measured step time)."""
        step_s = sorted(self._step_times)[len(self._step_times) // 2] if self._step_times else None
        return lookahead_steps(self.prefetch_s, step_s, self.prefetch, max(self.prefetch, self.max_ahead))

    def _ask(self, step: int, ahead: int | None = None) -> None:
        """GET_STEP; `ahead` tells the constructor how far this rank asks past the step it consumes (it keeps
        what the rank may still need after a restart: steps past last request - ahead - 1)."""
        assert self._sock is not None
        wire.send(self._sock, Kind.GET_STEP, {"step": step, "rank": self.rank,
                                              "ahead": self.lookahead if ahead is None else ahead})
        self._inflight.append(step)

    def _ask_again(self, steps: list[int]) -> None:
        """Ask again for `steps` (requests its server lost), keeping what already arrived."""
        for s in steps:
            self._inflight.remove(s)
        for s in steps:
            self._ask(s)
        self._inflight = deque(sorted(self._inflight))

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.max_steps is not None and self.next_step >= self.max_steps:
            raise StopIteration
        now = time.monotonic()
        if self._handed is not None:
            self._step_times.append(now - self._handed)  # the trainer's step (waiting for data not included)
        if not self._started:
            self._connect()
        self._pump(now)
        ahead = self.lookahead
        while len(self._inflight) <= ahead:
            nxt = self._inflight[-1] + 1 if self._inflight else self.next_step
            if self.max_steps is not None and nxt >= self.max_steps:
                break
            self._ask(nxt, ahead)
        out = self._receive(self._inflight[0])
        if self._fanout is not None:
            self.fanout_bytes += fan_out(out, self._fanout, self.coords, self.groups)
        elif self.groups.get("tp") is not None:
            self.fanout_bytes += _broadcast_tp_counted(out, self.groups["tp"], self.coords.get("tp") == 0)
        if self.encoder_group is not None and "encoder_leader" in out:
            broadcast_encoder(out, self.encoder_group)
        self._handed = time.monotonic()
        return out

    def _pump(self, now: float) -> None:
        """Between steps: beat to the constructor once per PROBE_S and take in whatever arrived, so a
        restarted constructor is noticed (and asked again) while the steps already here feed the trainer."""
        if now - self._probed >= PROBE_S:
            self._probe()
        assert self._sock is not None
        while self._sock.poll(0):
            self._take(self._sock.recv_multipart(copy=False), f"constructor {self.endpoint}")

    def _probe(self) -> None:
        """Beat to the constructor: its answer carries its incarnation (a restarted one gets our requests again)."""
        self._probed = time.monotonic()
        try:
            wire.send(self._sock, Kind.HEARTBEAT, {"rank": self.rank}, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _note_incarnation(self, msg: wire.Message) -> None:
        inc = msg.meta.get("incarnation")
        if not isinstance(inc, str):
            return
        if self._server_incarnation is not None and inc != self._server_incarnation and self._inflight:
            # the constructor was restarted: what we asked of its predecessor and did not get is gone; ask
            # again (steps already here are the same steps: same session, same plan)
            pending = [s for s in self._inflight if s not in self._early]
            self._ask_again(pending)
            self.re_requests += len(pending)
        self._server_incarnation = inc

    def _damaged(self, frames: list[Any], err: WireError, where: str) -> None:
        """A damaged or truncated message from the constructor: count it, say so, ask again for the step it
        names (every step in flight when even that cannot be read)."""
        self.damaged += 1
        step = wire.peek_meta(frames).get("step")
        again = [step] if isinstance(step, int) and step in self._inflight else list(self._inflight)
        log.warning("rank %d: refused a damaged message from %s (%s); asking again for step(s) %s", self.rank,
                    where, err, again)
        for s in again:
            assert self._sock is not None
            wire.send(self._sock, Kind.GET_STEP, {"step": s, "rank": self.rank})

    def _silence(self, where: str) -> str:
        """Who is silent, as this client sees it: its constructor (no answer to beats), or what the constructor
        reports silent (the planner)."""
        quiet = time.time() - self._heard
        if quiet >= 3 * PROBE_S:
            return (f"; {where} silent since {time.strftime('%H:%M:%S', time.localtime(self._heard))} "
                    f"({quiet:.0f} s: no answer to heartbeats)")
        if self._server_silent:
            return f"; {where} reports " + ", ".join(
                f"{n} silent since {time.strftime('%H:%M:%S', time.localtime(self._heard - q))} ({q:.0f} s)"
                for n, q in sorted(self._server_silent.items()))
        return ""

    def _take(self, frames: list[Any], where: str) -> None:
        """One message from the constructor: beats (its incarnation, what it reports silent), errors, and
        STEP_DATA kept until its step is due (steps complete out of order; stale answers are dropped)."""
        try:
            msg = wire.decode(frames)
        except WireError as e:
            self._damaged(frames, e, where)  # refused, never delivered: asked for again
            return
        self._heard = time.time()
        if msg.kind == Kind.HEARTBEAT:
            self._note_incarnation(msg)
            silent = msg.meta.get("silent")
            self._server_silent = ({str(k): float(v) for k, v in silent.items() if isinstance(v, (int, float))}
                                   if isinstance(silent, dict) else {})
            return
        if msg.kind == Kind.ERROR:
            step = msg.meta.get("step")
            if msg.meta.get("released") is True:
                sess = msg.meta.get("session")
                if isinstance(sess, int) and sess < self._session:
                    return  # an answer from before this rank's rewind: it asked again since
                if not isinstance(step, int) or step not in self._inflight or step in self._early:
                    return  # an answer to a request this rank no longer waits for
                cur = self._rejoined if self._rejoined is not None else self._own_cursor()
                if cur is not None:
                    # the step this rank needs is no longer held (it rejoined behind the others, or delivery was
                    # rewound past it): delivery restarts from this rank's own state, the others ask again
                    self._rewind(cur)
                    return
            if msg.meta.get("retry"):
                # delivery restarted (another rank rolled back): the steps already here are the same steps (same
                # plan from the same cursor), so only what has not arrived is asked for again
                again = ([step] if isinstance(step, int) else list(self._inflight))
                again = [s for s in again if s in self._inflight and s not in self._early]
                if again:
                    self._ask_again(again)
                    self.re_requests += len(again)
                return
            raise DeliveryError(f"rank {self.rank}: {where}: {msg.meta.get('error')}")
        if msg.kind != Kind.STEP_DATA:
            return
        if self._require_sums and not msg.flags & wire.FLAG_END:
            self._damaged(frames, WireError("STEP_DATA without checksums and end-of-message marker"), where)
            return
        self._note_incarnation(msg)
        try:
            got = msg.get("step", int)
        except WireError as e:
            raise DeliveryError(f"rank {self.rank}: malformed message from {where}: {e}") from None
        if got in self._inflight:
            self._early[got] = msg  # kept until its turn
        # else a stale answer from before a restart

    def _receive(self, step: int) -> dict[str, torch.Tensor]:
        assert self._sock is not None
        where = f"constructor {self.endpoint}"
        since = time.time()
        deadline = time.monotonic() + self.timeout_s
        while step not in self._early:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeliveryError(f"rank {self.rank}: step {step} not delivered by {where} within {self.timeout_s:g}s "
                                    f"(waiting since {time.strftime('%H:%M:%S', time.localtime(since))})"
                                    f"{self._silence(where)}{self._why_waiting()}")
            wait = min(left, max(0.0, self._probed + PROBE_S - time.monotonic()))
            if not self._sock.poll(max(1, int(wait * 1000))):
                if time.monotonic() - self._probed >= PROBE_S:
                    self._probe()
                continue
            self._take(self._sock.recv_multipart(copy=False), where)
        msg = self._early.pop(step)
        check_step_data(msg, step, self.rank, where)
        self._rejoined = None
        self._inflight.popleft()
        self.next_step = step + 1
        self._cursor = msg.meta.get("cursor_after")
        self.received_bytes += sum(a.nbytes for a in msg.arrays.values())
        fan = msg.meta.get("fanout")
        self._fanout = fan if isinstance(fan, dict) else None
        return self._to_tensors(msg, step)

    def _own_cursor(self) -> dict[str, Any] | None:
        """The cursor of this rank's next step (after the last step it received), when it has one."""
        cur = self._cursor
        if isinstance(cur, dict) and cur.get("step") == self.next_step:
            return cur
        return None

    def _rewind(self, cur: dict[str, Any]) -> None:
        """The rank's next step is no longer held by its constructor (it rejoined a running session behind the
        others, or delivery was rewound past it): ask the planner to restart delivery at this rank's state (a
        new session; every rank asks again for what it has not received, nobody's steps change)."""
        self._rejoined = None
        assert self._planner is not None
        meta: dict[str, Any] = {"cursor": cur, "rank": self.rank, "rewind": True}
        attempt = resume_attempt()
        if attempt is not None:
            meta["attempt"] = attempt
        ack = self._request(self._planner, Kind.RESUME, meta, "resume (rewind)")
        if ack.kind != Kind.ACK:
            raise DeliveryError(f"rank {self.rank}: unexpected {ack.kind.name} to resume")
        if isinstance(ack.meta.get("session"), int):
            self._session = ack.meta["session"]
        again = [s for s in self._inflight if s not in self._early]
        if again:
            self._ask_again(again)

    def _why_waiting(self, timeout_s: float = 2.0) -> str:
        """What the planner says the data plane waits for (components gone silent, loader windows not
        full), for the error of a client that waited in vain; empty when the planner does not answer."""
        p = self._planner
        if p is None:
            return ""
        try:
            wire.send(p, Kind.STATUS, {}, flags=zmq.NOBLOCK)
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0 and p.poll(int(left * 1000) + 1):
                _, msg = wire.recv(p)
                if msg.kind == Kind.STATUS_REPLY:
                    return _waiting_text(msg.meta, self.planner_endpoint or "")
        except (zmq.ZMQError, WireError):
            pass
        return f"; the planner at {self.planner_endpoint} did not answer a status request within {timeout_s:g}s"

    def _to_tensors(self, msg: wire.Message, step: int) -> dict[str, torch.Tensor]:
        arrays = msg.arrays
        if "image_bytes" in arrays:  # image.decode_at client: this rank's images came raw
            arrays = self._decode_images(arrays, (msg.meta.get("extra") or {}).get("image_decode"), step)
        out = {name: _tensor(a) for name, a in arrays.items()}
        meta_only = bool(msg.meta.get("meta_only", False))
        if meta_only:  # empty receive buffers of the right shapes for the trainer-side TP broadcast
            self._allocate(out, msg.meta.get("shapes"), step)
        enc_shapes = msg.meta.get("encoder_shapes")
        if enc_shapes is not None:  # a peer of the encoding rank: buffers for broadcast_encoder
            self._allocate(out, {k: v for k, v in enc_shapes.items() if k in ENCODER_FIELDS}, step)
            out["encoder_meta_only"] = torch.tensor(True)
        elif "pixel_patches" in out:
            out["encoder_meta_only"] = torch.tensor(False)
        out["step"] = torch.tensor(step, dtype=torch.int64)
        out["lr_scale"] = torch.tensor(float(msg.get("lr_scale", (int, float))), dtype=torch.float64)
        out["phase"] = torch.tensor(msg.get("phase", int), dtype=torch.int64)
        gen = msg.meta.get("generation")  # which runtime mixture update is in force (0: the spec as written)
        if isinstance(gen, int) and not isinstance(gen, bool):
            out["generation"] = torch.tensor(gen, dtype=torch.int64)
        if isinstance(msg.meta.get("seq_len"), int):
            out["seq_len"] = torch.tensor(msg.meta["seq_len"], dtype=torch.int64)
        out["meta_only"] = torch.tensor(meta_only)
        for k, v in (msg.meta.get("extra") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in out:
                out[k] = torch.tensor(v)
        return out

    def _decode_images(self, arrays: dict[str, np.ndarray], how: Any, step: int) -> dict[str, np.ndarray]:
        """``pixel_patches`` from the raw image bytes of a step (the same decode a loader or constructor runs,
        imagedecode.decode_encoder_images); an image whose pixels do not decode is quarantined as the loader or the
        constructor would: zeros of its grid, ``image_quarantined`` 1, logged and kept in ``quarantined_images``
        naming its source, file and row."""
        if not (isinstance(how, dict) and isinstance(how.get("patch_size"), int) and isinstance(how.get("merge"), int)
                and isinstance(how.get("where"), list)):
            raise DeliveryError(f"rank {self.rank}: step {step}: raw images without their decode settings")
        t0 = time.thread_time()
        try:
            pix, bad, errors = decode_encoder_images(arrays["image_bytes"], arrays["image_bytes_offsets"],
                                                     arrays["image_grid"], arrays["image_max_side"],
                                                     patch=how["patch_size"], merge=how["merge"],
                                                     where=[str(w) for w in how["where"]])
        except (ImageDecodeError, KeyError) as e:
            raise DeliveryError(f"rank {self.rank}: step {step}: {e} (decoded at the client)") from None
        self.image_decode_cpu_s += time.thread_time() - t0
        for err in errors:
            self.quarantined_images.append((step, err))
            log.warning("rank %d: step %d: %s (decoded at the client): quarantined, delivered as zeros of its planned "
                        "grid (image_quarantined)", self.rank, step, err)
        rest = {k: v for k, v in arrays.items() if k not in ("image_bytes", "image_bytes_offsets", "image_max_side")}
        prior = rest.get("image_quarantined")
        flags = bad if prior is None or len(prior) != len(bad) else np.maximum(bad, prior).astype(np.int8)
        return {"pixel_patches": pix, **rest, "image_quarantined": flags}

    def _allocate(self, out: dict[str, torch.Tensor], shapes: Any, step: int) -> None:
        """Empty tensors for the [dtype, shape] entries of `shapes` that `out` lacks."""
        if not isinstance(shapes, dict):
            return
        for name, (dt, shape) in shapes.items():
            if name in out:
                continue
            try:
                tdt = _torch_dtype(np.dtype(dt))
            except TypeError:
                tdt = None
            if tdt is None:
                raise DeliveryError(f"rank {self.rank}: step {step}: tensor {name!r} has dtype {dt}")
            out[name] = torch.empty(tuple(shape), dtype=tdt)

    # -- per-source loss to the planner ------------------------------------------------------
    def report_loss(self, step: int, loss_sum: Any, tokens: Any, *, flush: bool = False) -> bool:
        """Add what this rank trained on at `step` — per source (``self.sources`` order) the sum of its tokens'
        losses and how many tokens had a label (:func:`source_loss` computes both from ``source_ids``) — and send
        the sums to the planner when ``loss_report_s`` has passed since the last report (or `flush`): one
        LOSS_REPORT per interval whatever the step rate. The planner does not answer; True when one was sent."""
        ls = np.asarray(loss_sum.detach().cpu() if isinstance(loss_sum, torch.Tensor) else loss_sum, np.float64).reshape(-1)
        tk = np.asarray(tokens.detach().cpu() if isinstance(tokens, torch.Tensor) else tokens, np.float64).reshape(-1)
        if self.sources and (len(ls) != len(self.sources) or len(tk) != len(self.sources)):
            raise ValueError(f"rank {self.rank}: report_loss for {len(ls)} / {len(tk)} sources, the mixture has "
                             f"{len(self.sources)} ({', '.join(self.sources)})")
        if self._loss_sum is None or len(self._loss_sum) != len(ls):
            self._loss_sum, self._loss_tokens = np.zeros(len(ls)), np.zeros(len(ls))
        assert self._loss_tokens is not None
        self._loss_sum += ls
        self._loss_tokens += tk
        step = int(step)
        if self._loss_from is None:
            self._loss_from = step
        self._loss_through = max(self._loss_through, step)
        if flush or time.monotonic() - self._loss_sent >= self.loss_report_s:
            return self.flush_loss()
        return False

    def flush_loss(self) -> bool:
        """Send what report_loss gathered since the last report (nothing when there is nothing)."""
        if self._loss_sum is None or self._loss_from is None or self._planner is None:
            return False
        assert self._loss_tokens is not None
        tokens = [int(round(t)) for t in self._loss_tokens]
        loss = [float(v) if t else 0.0 for v, t in zip(self._loss_sum, tokens)]
        meta = {"rank": self.rank, "from_step": self._loss_from, "step": self._loss_through, "loss": loss, "tokens": tokens}
        try:
            wire.send(self._planner, Kind.LOSS_REPORT, meta, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False  # the planner's queue is full: the sums stay and go with the next report
        self._loss_sum = self._loss_tokens = None
        self._loss_from, self._loss_through = None, -1
        self._loss_sent = time.monotonic()
        self.loss_reports_sent += 1
        return True

    # -- resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue right after the last step this rank received."""
        return {"version": STATE_VERSION, "next_step": self.next_step,
                "cursor": copy.deepcopy(self._cursor if self._cursor is not None else self._resume_cursor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state_dict version {got} is not {STATE_VERSION}")
        if self._started:
            self.close()
        next_step = int(state["next_step"])
        cur = state.get("cursor")
        if cur is None and next_step != 0:
            raise ValueError(f"state_dict for step {next_step} has no cursor: it cannot be resumed exactly")
        if cur is not None and int(cur["step"]) != next_step:
            raise ValueError(f"state_dict is inconsistent: cursor for step {cur['step']}, next_step {next_step}")
        self.next_step = next_step
        self._resume_cursor = copy.deepcopy(cur)
        self._from_start = cur is None
        self._cursor = None

    def close(self) -> None:
        """Close the sockets (the last loss report still goes). Called with no exception on the way (not from an
        `except` or a `finally` an exception passes through; `sys.exit(0)` and StopIteration are clean), it marks
        this rank's clean end for the pod's loader containers (sidecar placement, mixplane.podend)."""
        self._close_sockets()
        self._mark_end(sys.exc_info()[1])

    def _mark_end(self, exc: BaseException | None) -> None:
        if self._pod_marked and self.pod_dir:
            if podend.ending_cleanly(exc):
                podend.mark_done(self.pod_dir, self.rank)
            else:
                podend.mark_failed(self.pod_dir, self.rank)

    def _close_sockets(self) -> None:
        reported = False
        if self._planner is not None:
            try:
                reported = self.flush_loss()
            except Exception:  # closing never fails on a report
                pass
        for s in (self._sock, self._planner):
            if s is not None:
                s.close(CLOSE_REPORT_LINGER_MS if reported and s is self._planner else 0)  # the last report still goes
        self._sock = self._planner = None
        self._inflight.clear()
        self._early.clear()
        self._started = False

    def __enter__(self) -> "MixtureLoader":
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._close_sockets()
        self._mark_end(exc)

    def __del__(self) -> None:
        try:
            self._close_sockets()  # garbage collection or interpreter exit: no clean-end mark (a crash ends so too)
        except Exception:  # a finaliser must not raise (at interpreter exit what it needs may be gone already)
            pass


def _waiting_text(status: dict[str, Any], planner: str) -> str:
    """'; planner at X: silent: loader:a:0 for 12.3 s; next step waits for loader windows a/0' (or nothing)."""
    parts = []
    have, want = status.get("constructors"), status.get("constructors_expected")
    if isinstance(have, int) and isinstance(want, int) and have < want:  # ROUTE is answered once every one registered
        parts.append(f"{have} of {want} constructors registered (routes are answered once all are)")
    silent = status.get("silent")
    if isinstance(silent, dict) and silent:
        parts.append("silent: " + ", ".join(f"{n} for {s} s" for n, s in silent.items()))
    waiting = status.get("waiting")
    if isinstance(waiting, list) and waiting:
        parts.append("next step waits for loader windows " + ", ".join(map(str, waiting)))
    if not parts:
        parts.append(f"planned through step {status.get('planned_through')}, no component silent")
    return f"; planner at {planner}: " + "; ".join(parts)


def source_loss(token_loss: torch.Tensor, source_ids: torch.Tensor, n_sources: int,
                labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per source: the sum of the tokens' losses and how many tokens count — those of a source (``source_ids`` >= 0)
    whose label is not -100 (when `labels` is given; else every token of a source). `token_loss`: the unreduced
    loss of each token, same shape as `source_ids`. Float64 sums and int64 counts, for MixtureLoader.report_loss."""
    src = source_ids.reshape(-1).to(torch.int64)
    keep = src >= 0
    if labels is not None:
        keep &= labels.reshape(-1) != -100
    s = src[keep]
    w = token_loss.detach().reshape(-1)[keep].to(torch.float64)
    return (torch.bincount(s, weights=w, minlength=n_sources)[:n_sources],
            torch.bincount(s, minlength=n_sources)[:n_sources].to(torch.int64))


def broadcast_tp(batch: dict[str, torch.Tensor], group: Any) -> None:
    """Trainer-side half of broadcast_at('TP'): tp = 0 (group rank 0) sends its tensors to the other TP ranks.

    Tensors go in name order; scalars every rank already has are skipped, and so is the encoder batch
    (ENCODER_FIELDS): it is per rank, each encoding rank received its own (see :func:`broadcast_encoder`).
    """
    import torch.distributed as dist

    src = dist.get_global_rank(group, 0)
    for name in sorted(batch):
        t = batch[name]
        if t.dim() == 0 or name in ENCODER_FIELDS or name in RANK_FIELDS:
            continue
        dist.broadcast(t, src=src, group=group)
    batch["meta_only"] = torch.tensor(False)


def _broadcast_tp_counted(batch: dict[str, torch.Tensor], group: Any, sender: bool) -> int:
    """broadcast_tp; the bytes the sender sent (its tensors once per peer), 0 for a receiver."""
    import torch.distributed as dist

    sent = sum(t.nbytes for k, t in batch.items() if t.dim() and k not in ENCODER_FIELDS and k not in RANK_FIELDS) * (dist.get_world_size(group) - 1)
    broadcast_tp(batch, group)
    return sent if sender else 0


def fan_out(batch: dict[str, torch.Tensor], fanout: dict[str, Any], coords: dict[str, int],
            groups: dict[str, Any]) -> int:
    """Trainer-side half of broadcast_at('CP') / ('PP') (and 'TP'): the group's coordinate-0 rank, which fetched
    what its group needs, sends each peer its part and keeps its own (the cut of
    :func:`mixplane.parallelism.holding`, so the batch equals the one delivered without broadcast).

    `fanout`: the STEP_DATA's ``fanout`` meta (axes in fan-out order, sizes, CP layout); `coords`: this rank's
    backbone coordinates; `groups`: ``{axis: process group}`` for each broadcast axis, its ranks ordered by the
    axis coordinate (Megatron's CP / PP / TP groups are). CP and PP peers get point-to-point sends (each its
    own part), TP peers a broadcast. Every rank of the job calls it each step. Returns the bytes this rank sent.
    """
    import torch.distributed as dist

    axes = [str(a) for a in fanout["axes"]]
    missing = [a for a in axes if a != "tp" and groups.get(a) is None]
    if missing:
        raise DeliveryError(f"the plan broadcasts along {', '.join(a.upper() for a in axes)}: pass "
                            f"groups={{{', '.join(repr(a) + ': ...' for a in missing)}}} to MixtureLoader")
    opts = fanout_options(fanout)
    sent = 0
    for a in axes:
        if not serves(a, coords, axes):
            continue
        g = groups.get(a)
        if a == "tp":
            if g is None:  # left to the trainer, as without a CP / PP broadcast: broadcast_tp(batch, tp_group)
                if coords["tp"] != 0:
                    return sent
                continue
            sent += _broadcast_tp_counted(batch, g, coords["tp"] == 0)
            continue
        names = sorted(k for k, t in batch.items() if t.dim() and k not in ENCODER_FIELDS)
        assert g is not None  # every axis but tp was checked for its group above
        if coords[a] != 0:  # receive this rank's holding into the buffers its metadata allocated
            src = dist.get_global_rank(g, 0)
            for k in names:
                dist.recv(batch[k], src=src, group=g)
            continue
        held = {k: batch[k].numpy() for k in names}
        for j in range(1, dist.get_world_size(g)):
            part = narrow(held, a, j, **opts)
            dst = dist.get_global_rank(g, j)
            for k in sorted(n for n, v in part.items() if isinstance(v, np.ndarray)):
                t = torch.from_numpy(np.ascontiguousarray(part[k]))
                dist.send(t, dst=dst, group=g)
                sent += t.nbytes
        own = narrow(held, a, 0, **opts)
        for k in names:
            del batch[k]
        batch.update({k: _tensor(v) for k, v in own.items() if isinstance(v, np.ndarray)})
    batch["meta_only"] = torch.tensor(False)
    return sent


def broadcast_encoder(batch: dict[str, torch.Tensor], group: Any) -> None:
    """Copy the encoder batch from the rank that received it (``encoder_leader``) to its peers.

    Images go to the lowest rank of each image-module DP x CP bucket; its TP / PP peers get empty
    buffers of the leader's shapes (``encoder_meta_only``). A trainer whose encoder is TP- or
    PP-sharded calls this with the bucket's group (it must contain the leader); every rank of the
    group calls it. The gather layout (``encoder_tokens``) still counts the images at the leader only.
    """
    import torch.distributed as dist

    src = int(batch["encoder_leader"])
    for name in ENCODER_FIELDS:
        if name in batch:
            dist.broadcast(batch[name], src=src, group=group)
    batch["encoder_meta_only"] = torch.tensor(False)


#: fields every rank receives for itself, never part of a TP broadcast (a hybrid CP group's global ranks)
RANK_FIELDS = ("cp_group_ranks",)


def cp_groups(batch: dict[str, torch.Tensor]) -> Iterator[dict[str, Any]]:
    """A hybrid DP x CP step (``llm_balance`` option ``hybrid_cp``) as the sub-samples the trainer runs, one per
    context-parallel group this rank belongs to: its token fields ``[1, t]`` (every document zig-zagged over the
    group, as TransformerEngine's THD context parallelism expects; a group of one holds its documents whole),
    ``cu_seqlens`` of its part (int32, from 0), ``cp_token_index`` (positions in the group's sequence, derived
    here: parallelism.group_token_index),
    ``cp_size``, ``cp_rank`` (this rank's place in the group), ``ranks`` (the group's global ranks, in CP order:
    the attention's process group) and ``max_seqlen``. A rank may belong to no group in a step (nothing to yield)."""
    if "cp_group_size" not in batch:
        raise ValueError("cp_groups: this batch is not a hybrid DP x CP step (no cp_group_size)")
    cu = batch["cu_seqlens"].to(torch.int64)
    docs = batch["cp_group_docs"].tolist()
    sizes = batch["cp_group_size"].tolist()
    ranks = batch["cp_group_ranks"].tolist()
    tokens = {k: v for k, v in batch.items() if v.dim() == 2}
    at = 0
    for g, k in enumerate(sizes):
        lo, hi = int(cu[docs[g]]), int(cu[docs[g + 1]])
        c = cu[docs[g]: docs[g + 1] + 1] - lo
        out: dict[str, Any] = {name: v[:, lo:hi] for name, v in tokens.items()}
        out["cu_seqlens"] = c.to(torch.int32)
        out["cp_size"] = int(k)
        out["cp_rank"] = int(batch["cp_group_rank"][g])
        out["cp_token_index"] = torch.from_numpy(group_token_index(c.numpy(), int(k), out["cp_rank"]))
        out["ranks"] = ranks[at: at + k]
        out["max_seqlen"] = int((c[1:] - c[:-1]).max()) if len(c) > 1 else 0
        at += k
        yield out


def microbatches(batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Split a step's batch into its microbatches, with cu_seqlens rebased per microbatch.

    Works for every view a rank may get (CP shard, any PP stage): per-token tensors are split by rows,
    cu_seqlens (which always covers full rows) by cu_seqlens_mb.
    """
    if "cp_group_size" in batch:
        raise ValueError("microbatches: a hybrid DP x CP step has no fixed microbatches; iterate cp_groups(batch)")
    cu = batch["cu_seqlens"]
    mb = batch["cu_seqlens_mb"]
    n = len(mb) - 1
    token = {k: v for k, v in batch.items() if v.dim() == 2}
    any_tok = next(iter(token.values()), None)
    total_rows = any_tok.shape[0] if any_tok is not None else None
    S = int(batch["seq_len"]) if "seq_len" in batch else (any_tok.shape[1] if any_tok is not None else 0)
    if total_rows is None:
        total_rows = (int(cu[-1]) // S) if S else 0
    rows = total_rows // n
    for m in range(n):
        sl = slice(m * rows, (m + 1) * rows)
        c = cu[int(mb[m]) : int(mb[m + 1]) + 1].to(torch.int64) - m * rows * S
        out = {k: v[sl] for k, v in token.items()}
        out["cu_seqlens"] = c.to(torch.int32)
        for k in ("cp_token_index",):
            if k in batch:
                out[k] = batch[k]
        yield out
