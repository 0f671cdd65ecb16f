"""What the framework adapters share (torch only, no framework).

:class:`MicrobatchStream` turns a rank's :class:`~mixplane.client.MixtureLoader` into the stream of
microbatches a framework's loop takes (one mixture step = ``batch.microbatches`` microbatches = one
optimizer step after gradient accumulation), with a state at every microbatch — also in the middle of a
step — that resumes exactly; ``mark_consumed`` lets a framework that fetches ahead (Lightning) report the
state of what it trained on rather than what it fetched.

:class:`LRScale` applies the mixture's ``lr_scale`` (phases, anneal, live updates: what arrives with each
step) to an optimizer's step: the step runs with every group's learning rate multiplied by the scale of
the mixture step it trains on, and the learning rates are restored right after, so the framework's LR
scheduler never sees the scale (a chained scheduler does not compound it) and the scale is exact for
any scheduler.
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Any, Callable, Iterator

import torch

from mixplane.client import MixtureLoader, microbatches

STREAM_STATE_VERSION = 1
INDEX_KEY = "mixplane_index"
Transform = Callable[[dict[str, torch.Tensor]], dict[str, Any]]


class MicrobatchStream:
    """A rank's microbatches, in step order, each as ``transform`` makes it (default: the mixture's own
    microbatch dict — ``input_ids``, ``labels``, ``position_ids``, ``source_ids``, ``cu_seqlens`` ... —
    plus the step's ``step``, ``lr_scale`` and ``phase``).

    ``accumulation``: the framework's gradient-accumulation count; checked against the mixture's
    ``batch.microbatches`` on the first step (a mismatch would take optimizer steps across mixture steps).
    ``what`` names that setting in the error. ``tag``: each microbatch carries ``INDEX_KEY``, its number,
    which the framework hands back to :meth:`mark_consumed` when it trains on it.
    """

    def __init__(self, loader: MixtureLoader | None = None, *, transform: Transform | None = None,
                 accumulation: int | None = None, what: str = "gradient accumulation", tag: bool = False) -> None:
        self.tag = tag  # put INDEX_KEY (the microbatch's number) into each one, for mark_consumed
        self.loader = loader if loader is not None else MixtureLoader()
        self.transform = transform
        self.accumulation = accumulation
        self.what = what
        self._pending: deque[dict[str, Any]] = deque()  # this step's microbatches not yet handed out
        self._step_state: dict[str, Any] | None = None  # the loader's state before the current step
        self._done = 0  # microbatches of the current step handed out
        self._skip = 0  # microbatches of the first step to drop after a resume mid-step
        self._yielded = 0  # microbatches handed out since construction (or the last load_state_dict)
        # (yield index, state after it, its step, its lr_scale) of the last microbatches handed out
        self._states: deque[tuple[int, dict[str, Any], int | None, float]] = deque(maxlen=64)
        self._consumed: int | None = None  # the last yield index the framework reported consumed
        self.step: int | None = None  # the mixture step of the microbatch handed out last
        self.lr_scale = 1.0  # ... and its lr_scale
        self.trained_step: int | None = None  # the step / lr_scale of the microbatch marked consumed last
        self.trained_lr_scale = 1.0
        self.per_step: int | None = None  # microbatches per step (known from the first step)
        self.last_batch: dict[str, torch.Tensor] | None = None  # the current step's whole batch (source_ids, ...)

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self._pending:
            before = self.loader.state_dict()
            batch = next(self.loader)  # StopIteration ends the stream (max_steps)
            mbs = list(microbatches(batch))
            if self.per_step is None:
                self.per_step = len(mbs)
                if self.accumulation is not None and self.accumulation != len(mbs):
                    raise ValueError(f"{self.what} is {self.accumulation} but the mixture's batch.microbatches is "
                                     f"{len(mbs)}: one optimizer step must take exactly one mixture step")
            scalars: dict[str, torch.Tensor] = {k: batch[k] for k in ("step", "lr_scale", "phase") if k in batch}
            for mb in mbs:
                mb.update(scalars)
            self._step_state = before
            self._pending = deque(mbs)
            self._done = 0
            self.last_batch = batch
            self.step = int(batch["step"])
            self.lr_scale = float(batch["lr_scale"])
            while self._skip and self._pending:
                self._pending.popleft()
                self._done += 1
                self._skip -= 1
        mb = self._pending.popleft()
        self._done += 1
        self._yielded += 1
        self._states.append((self._yielded, self._position(), self.step, self.lr_scale))
        out: dict[str, Any] = self.transform(mb) if self.transform is not None else mb
        if self.tag and isinstance(out, dict):
            out[INDEX_KEY] = self._yielded
        return out

    # -- state -----------------------------------------------------------------------------
    def _position(self) -> dict[str, Any]:
        """The state right after the microbatch handed out last."""
        if not self._pending:  # at a step boundary: the loader's own state
            return {"version": STREAM_STATE_VERSION, "loader": self.loader.state_dict(), "microbatch": 0}
        return {"version": STREAM_STATE_VERSION, "loader": copy.deepcopy(self._step_state), "microbatch": self._done}

    def mark_consumed(self, index: int) -> None:
        """The framework trained on the microbatch with this ``INDEX_KEY`` (it may have fetched more)."""
        self._consumed = int(index)
        for idx, _, step, scale in self._states:
            if idx == self._consumed:
                self.trained_step, self.trained_lr_scale = step, scale

    def train_lr_scale(self) -> float:
        """The lr_scale of the microbatch the framework trains on: the one marked consumed last, else the one
        handed out last."""
        return self.trained_lr_scale if self._consumed is not None else self.lr_scale

    def train_step(self) -> int | None:
        return self.trained_step if self._consumed is not None else self.step

    def state_dict(self) -> dict[str, Any]:
        """Where to continue: after the microbatch marked consumed last, else after the one handed out last."""
        if self._consumed is not None:
            for idx, state, _, _ in self._states:
                if idx == self._consumed:
                    return copy.deepcopy(state)
        if self._yielded == 0:
            return {"version": STREAM_STATE_VERSION, "loader": self.loader.state_dict(), "microbatch": self._skip}
        return self._position()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STREAM_STATE_VERSION or "loader" not in state:
            got = state.get("version") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"mixplane stream state version {got} is not {STREAM_STATE_VERSION}")
        skip = int(state.get("microbatch", 0))
        if skip < 0:
            raise ValueError(f"mixplane stream state: microbatch {skip} < 0")
        self.loader.load_state_dict(state["loader"])
        self._pending.clear()
        self._skip = skip
        self._yielded = 0
        self._states.clear()
        self._consumed = None

    def close(self) -> None:
        self.loader.close()


class LRScale:
    """Scale an optimizer's step by the mixture's ``lr_scale``: a pre-step hook multiplies every group's
    ``lr`` by ``scale()`` and a post-step hook puts the learning rates back. ``applied`` lists
    (step, scale) for every optimizer step taken (``step()`` names the mixture step)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scale: Callable[[], float],
                 step: Callable[[], int | None] = lambda: None) -> None:
        self.optimizer = optimizer
        self.scale, self.step = scale, step
        self.applied: list[tuple[int | None, float]] = []
        self._saved: list[float] | None = None
        self._handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        s = float(self.scale())
        self._saved = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = g["lr"] * s
        self.applied.append((self.step(), s))

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._saved is not None:
            for g, lr in zip(opt.param_groups, self._saved):
                g["lr"] = lr
            self._saved = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def unwrap_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside a framework's wrapper (accelerate's AcceleratedOptimizer, Lightning's
    LightningOptimizer: ``.optimizer`` / ``._optimizer``)."""
    for _ in range(8):  # wrappers subclass Optimizer without its state (accelerate): go to the innermost
        inner = getattr(opt, "optimizer", None) or getattr(opt, "_optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"no torch.optim.Optimizer inside {type(opt).__name__}")
    return opt
