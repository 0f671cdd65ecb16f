"""Trainer-side client: one dict of torch tensors per step for this rank.

    from mixplane.client import MixtureLoader
    loader = MixtureLoader()                 # planner endpoint and rank from the environment
    for batch in loader:                     # input_ids, labels, position_ids, cu_seqlens, source_ids, step, lr_scale, ...
        ...
    state = loader.state_dict()              # save with the model checkpoint
    loader.load_state_dict(state)            # resume exactly: same batches, no repeats, no gaps

Configuration: `planner=` or MIXPLANE_PLANNER; `rank=` or RANK (torchrun); the client knows
only the planner's address and asks it which constructor serves its rank.
"""

from __future__ import annotations

import copy
import os
from collections import deque
from typing import Any, Iterator

import numpy as np
import torch
import zmq

from mixplane import wire
from mixplane.wire import Kind, WireError

STATE_VERSION = 1


class DeliveryError(RuntimeError):
    """The data plane did not deliver a step; the text names the endpoint and step."""


def _tensor(a: np.ndarray) -> torch.Tensor:
    if a.dtype == np.uint16:
        a = a.astype(np.int32)
    if a.flags.writeable:
        return torch.from_numpy(a)
    return torch.from_numpy(a.copy())


class MixtureLoader:
    def __init__(self, planner: str | None = None, *, rank: int | None = None, prefetch: int = 2,
                 timeout_s: float | None = None, max_steps: int | None = None, context: zmq.Context | None = None):
        self.planner_endpoint = planner or os.environ.get("MIXPLANE_PLANNER")
        if not self.planner_endpoint:
            raise ValueError("no planner endpoint: pass planner= or set MIXPLANE_PLANNER (printed by `mixplane run`)")
        self.rank = int(rank if rank is not None else os.environ.get("RANK", os.environ.get("MIXPLANE_RANK", "0")))
        self.prefetch = max(0, prefetch)
        self.timeout_s = timeout_s if timeout_s is not None else float(os.environ.get("MIXPLANE_TIMEOUT_S", "120"))
        self.max_steps = max_steps
        self.ctx = context or zmq.Context.instance()
        self._planner: zmq.Socket | None = None
        self._sock: zmq.Socket | None = None
        self.endpoint: str | None = None
        self.coords: dict[str, int] = {}
        self.sources: list[str] = []
        self.next_step = 0
        self._resume_cursor: dict[str, Any] | None = None
        self._cursor: dict[str, Any] | None = None
        self._inflight: deque[int] = deque()
        self._started = False

    # -- connection -----------------------------------------------------------------------
    def _request(self, sock: zmq.Socket, kind: Kind, meta: dict[str, Any], what: str) -> wire.Message:
        wire.send(sock, kind, meta)
        if not sock.poll(int(self.timeout_s * 1000)):
            raise DeliveryError(f"rank {self.rank}: no answer to {what} from {self.planner_endpoint} within {self.timeout_s:.0f}s")
        _, msg = wire.recv(sock)
        if msg.kind == Kind.ERROR:
            raise DeliveryError(f"rank {self.rank}: {what} refused by {self.planner_endpoint}: {msg.meta.get('error')}")
        return msg

    def _connect(self) -> None:
        p = self.ctx.socket(zmq.DEALER)
        p.setsockopt(zmq.LINGER, 0)
        p.connect(self.planner_endpoint)
        self._planner = p
        if self._resume_cursor is not None:
            ack = self._request(p, Kind.RESUME, {"cursor": self._resume_cursor, "rank": self.rank}, "resume")
            if ack.kind != Kind.ACK:
                raise DeliveryError(f"rank {self.rank}: unexpected {ack.kind.name} to resume")
            self._resume_cursor = None
        route = self._request(p, Kind.ROUTE, {"rank": self.rank}, "route")
        self.endpoint = route.get("endpoint", str)
        self.coords = dict(route.get("coords", dict))
        self.sources = list(route.get("sources", list))
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, max(4, 2 * (self.prefetch + 1)))
        s.connect(self.endpoint)
        self._sock = s
        self._started = True

    def _ask(self, step: int) -> None:
        assert self._sock is not None
        wire.send(self._sock, Kind.GET_STEP, {"step": step, "rank": self.rank})
        self._inflight.append(step)

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.max_steps is not None and self.next_step >= self.max_steps:
            raise StopIteration
        if not self._started:
            self._connect()
        while len(self._inflight) <= self.prefetch:
            nxt = self._inflight[-1] + 1 if self._inflight else self.next_step
            if self.max_steps is not None and nxt >= self.max_steps:
                break
            self._ask(nxt)
        return self._receive(self._inflight[0])

    def _receive(self, step: int) -> dict[str, torch.Tensor]:
        assert self._sock is not None
        while True:
            if not self._sock.poll(int(self.timeout_s * 1000)):
                raise DeliveryError(f"rank {self.rank}: step {step} not delivered by constructor {self.endpoint} within {self.timeout_s:.0f}s")
            try:
                _, msg = wire.recv(self._sock)
            except WireError as e:
                raise DeliveryError(f"rank {self.rank}: malformed message from constructor {self.endpoint}: {e}") from None
            if msg.kind == Kind.ERROR:
                if msg.meta.get("retry"):
                    # delivery restarted (another rank resumed): ask again for what is in flight
                    pending = list(self._inflight)
                    self._inflight.clear()
                    for s in pending:
                        self._ask(s)
                    continue
                raise DeliveryError(f"rank {self.rank}: constructor {self.endpoint}: {msg.meta.get('error')}")
            if msg.kind != Kind.STEP_DATA:
                continue
            got = msg.get("step", int)
            if got != step:
                if got in self._inflight:
                    raise DeliveryError(f"rank {self.rank}: constructor {self.endpoint} answered step {got} before {step}")
                continue  # a stale answer from before a restart
            self._inflight.popleft()
            self.next_step = step + 1
            self._cursor = msg.meta.get("cursor_after")
            out = {name: _tensor(a) for name, a in msg.arrays.items()}
            out["step"] = torch.tensor(step, dtype=torch.int64)
            out["lr_scale"] = torch.tensor(float(msg.get("lr_scale", (int, float))), dtype=torch.float64)
            out["phase"] = torch.tensor(msg.get("phase", int), dtype=torch.int64)
            return out

    # -- resume ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue right after the last step this rank received."""
        return {"version": STATE_VERSION, "next_step": self.next_step,
                "cursor": copy.deepcopy(self._cursor if self._cursor is not None else self._resume_cursor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"state_dict version {state.get('version')} is not {STATE_VERSION}")
        if self._started:
            self.close()
        self.next_step = int(state["next_step"])
        cur = state.get("cursor")
        if cur is not None and int(cur["step"]) != self.next_step:
            raise ValueError(f"state_dict is inconsistent: cursor for step {cur['step']}, next_step {self.next_step}")
        self._resume_cursor = copy.deepcopy(cur)
        self._cursor = None

    def close(self) -> None:
        for s in (self._sock, self._planner):
            if s is not None:
                s.close(0)
        self._sock = self._planner = None
        self._inflight.clear()
        self._started = False

    def __enter__(self) -> "MixtureLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def microbatches(batch: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Split a step's batch into its microbatches, with cu_seqlens rebased per microbatch."""
    cu = batch["cu_seqlens"]
    mb = batch["cu_seqlens_mb"]
    n = len(mb) - 1
    rows = batch["input_ids"].shape[0] // n
    S = batch["input_ids"].shape[1]
    for m in range(n):
        sl = slice(m * rows, (m + 1) * rows)
        c = cu[int(mb[m]) : int(mb[m + 1]) + 1].to(torch.int64) - m * rows * S
        yield {"input_ids": batch["input_ids"][sl], "labels": batch["labels"][sl],
               "position_ids": batch["position_ids"][sl], "source_ids": batch["source_ids"][sl],
               "cu_seqlens": c.to(torch.int32)}
