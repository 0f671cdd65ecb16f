"""torchtitan fed by a mixture (``pip install mixplane[torchtitan]``).

torchtitan builds its dataloader from the job config (``config.dataloader.build(dp_rank=, dp_world_size=,
tokenizer=, seq_len=, local_batch_size=, ...)``) and iterates ``(input_dict, labels)`` pairs, one per microbatch;
its checkpointer saves the dataloader as a ``Stateful`` through DCP. :class:`MixplaneDataLoader` is a torchtitan
``BaseDataLoader`` for that slot::

    from mixplane.integrations.torchtitan import MixplaneDataLoader
    config.dataloader = MixplaneDataLoader.Config()     # in the job's config function, instead of the HF dataset loader

Each microbatch is ``({"input": tokens [b, s], "positions": [b, s]}, labels [b, s])``: ``positions`` restart at
0 at every document (torchtitan's variable-length / flex attention build their document masks from them, and
RoPE takes them), labels are the next token with ``-100`` (torchtitan's ``IGNORE_INDEX``) at document ends and
padding. The loader is the rank's own part of every step (``dp_rank`` / ``dp_world_size`` are checked against
the mixture's topology, ``seq_len`` and ``local_batch_size`` against its batch); one optimizer step takes
``batch.microbatches`` microbatches (torchtitan's gradient accumulation).

State: ``state_dict()`` is the global position (one key, the same on every rank: DCP keeps one copy), so a
checkpoint resumes at another DP size — unlike ``ParallelAwareDataloader``, which keys state by DP rank and
refuses a different ``dp_world_size``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torchtitan.components.dataloader import BaseDataLoader

from mixplane.client import MixtureLoader
from mixplane.integrations.steps import MicrobatchStream

STATE_KEY = "mixplane"


def titan_batch(mb: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A mixture microbatch as torchtitan's ``(input_dict, labels)``."""
    return ({"input": mb["input_ids"].to(torch.int64), "positions": mb["position_ids"].to(torch.int64)},
            mb["labels"].to(torch.int64))


class MixplaneDataLoader(BaseDataLoader):
    """A rank's microbatches of a mixture as torchtitan's dataloader (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        planner: str | None = None
        """The planner endpoint (default MIXPLANE_PLANNER, printed by ``mixplane run``)."""

        microbatches: int | None = None
        """torchtitan's gradient-accumulation steps per optimizer step, checked against ``batch.microbatches``."""

    def __init__(self, config: "MixplaneDataLoader.Config | None" = None, *, dp_rank: int = 0, dp_world_size: int = 1,
                 seq_len: int | None = None, local_batch_size: int | None = None,
                 mixture_loader: MixtureLoader | None = None, **kwargs: Any) -> None:
        cfg = config if config is not None else MixplaneDataLoader.Config()
        self.config = cfg
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        loader = mixture_loader if mixture_loader is not None else MixtureLoader(cfg.planner)
        self.stream = MicrobatchStream(loader, accumulation=cfg.microbatches,
                                       what="MixplaneDataLoader.Config.microbatches (gradient accumulation)")
        self._checked = False

    def _check(self, mb: dict[str, torch.Tensor]) -> None:
        coords = self.stream.loader.coords
        if coords and coords.get("dp", self.dp_rank) != self.dp_rank:
            raise ValueError(f"torchtitan's dp_rank is {self.dp_rank} but the mixture serves this rank as dp "
                             f"{coords.get('dp')} (coords {coords})")
        s = int(mb["input_ids"].shape[1])
        if self.seq_len is not None and "cp_token_index" not in mb and self.seq_len != s:
            raise ValueError(f"training.seq_len is {self.seq_len} but the mixture's batch.seq_len is {s}")
        rows = int(mb["input_ids"].shape[0])
        if self.local_batch_size is not None and self.local_batch_size != rows:
            raise ValueError(f"torchtitan's microbatch has {self.local_batch_size} rows per rank but the mixture's has "
                             f"{rows} (batch.sequences / dp / batch.microbatches)")
        self._checked = True

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for mb in self.stream:
            if not self._checked:
                self._check(mb)
            yield titan_batch(mb)

    @property
    def step(self) -> int | None:
        return self.stream.step

    @property
    def lr_scale(self) -> float:
        return self.stream.lr_scale

    def state_dict(self) -> dict[str, Any]:
        # one JSON text (DCP loads a value into the template's structure: a nested cursor would not fit the empty
        # one of a fresh loader); the same on every rank, so DCP keeps one copy
        return {STATE_KEY: json.dumps(self.stream.state_dict(), sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # torchtitan loads an empty state for a fresh start
            return
        if STATE_KEY not in state_dict:
            raise ValueError(f"dataloader state has no {STATE_KEY!r} entry (keys {sorted(state_dict)}): not a mixplane "
                             "checkpoint")
        v = state_dict[STATE_KEY]
        self.stream.load_state_dict(json.loads(v) if isinstance(v, (str, bytes)) else v)
