"""Lightning fed by a mixture (``pip install mixplane[lightning]``).

::

    from mixplane.integrations.lightning import MixtureDataModule
    trainer = L.Trainer(max_steps=..., accumulate_grad_batches=<the mixture's batch.microbatches>, ...)
    trainer.fit(model, datamodule=MixtureDataModule(), ckpt_path=...)   # resumes the data exactly

``train_dataloader()`` is the rank's stream of microbatches (:class:`~mixplane.integrations.steps.MicrobatchStream`:
``input_ids``, ``labels`` (next-token, ``-100`` at document ends and padding), ``position_ids`` restarting at every
document, ``source_ids``, ``cu_seqlens`` and the step's ``step`` / ``lr_scale`` / ``phase``). It has
``state_dict`` / ``load_state_dict``, so Lightning's fit loop saves its state into every checkpoint and restores
it before the first batch (the stateful-dataloader contract of Lightning PR #19361). Lightning fetches one batch
ahead of the one it trains on; the state it saves is that of the batch trained on (each microbatch carries its
number, which ``on_before_batch_transfer`` takes out), so a resume neither skips nor repeats a batch (the
failure of pytorch-lightning #20550 / litData #775). The state is the global step's, not this rank's share: a
checkpoint (written by rank 0) resumes at another DP size.

lr_scale: every optimizer step runs at the learning rate the LR scheduler set times the ``lr_scale`` of the
mixture step it trains on (installed on the trainer's optimizers at the first batch); schedulers and logged
learning rates stay unscaled. ``lr_scale=False`` leaves the optimizers alone.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden

from mixplane.client import MixtureLoader, source_loss
from mixplane.integrations.steps import INDEX_KEY, LRScale, MicrobatchStream, unwrap_optimizer


class MixtureDataModule(pl.LightningDataModule):
    """A LightningDataModule whose train loader is this rank's part of a mixture. ``mixture_loader``: a
    :class:`MixtureLoader` (default: one from the environment, rank = the trainer's global rank)."""

    def __init__(self, mixture_loader: MixtureLoader | None = None, *, lr_scale: bool = True) -> None:
        super().__init__()
        self._given = mixture_loader
        self.apply_lr_scale = lr_scale
        self.stream: MicrobatchStream | None = None
        self.lr_scales: list[LRScale] = []

    def setup(self, stage: str) -> None:
        if self.stream is None and stage == "fit":
            assert self.trainer is not None
            loader = self._given if self._given is not None else MixtureLoader(rank=self.trainer.global_rank)
            self.stream = MicrobatchStream(loader, accumulation=self.trainer.accumulate_grad_batches,
                                           what="Trainer(accumulate_grad_batches=)", tag=True)

    def train_dataloader(self) -> MicrobatchStream:
        if self.stream is None:
            self.setup("fit")
        assert self.stream is not None
        return self.stream

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, dict) and INDEX_KEY in batch and self.stream is not None:
            self.stream.mark_consumed(int(batch.pop(INDEX_KEY)))
            if self.apply_lr_scale and not self.lr_scales and self.trainer is not None:
                stream = self.stream
                self.lr_scales = [LRScale(unwrap_optimizer(o), stream.train_lr_scale, stream.train_step)
                                  for o in self.trainer.optimizers]
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module):
            batch = module.on_before_batch_transfer(batch, dataloader_idx)  # Lightning calls only ours
        return batch

    def report_loss(self, token_loss: torch.Tensor, batch: dict[str, Any]) -> None:
        """Call from ``training_step`` with the unreduced loss of every token (the shape of ``batch["labels"]``):
        each source's token losses go to the planner (summed by ``source_ids``, sent at a bounded rate)."""
        if self.stream is None:
            return
        loader = self.stream.loader
        n = len(loader.sources) or int(batch["source_ids"].max()) + 1
        s, c = source_loss(token_loss, batch["source_ids"], n, batch["labels"])
        loader.report_loss(int(batch["step"]), s, c)

    def teardown(self, stage: str) -> None:
        """After fit: the last per-source losses go and the rank's loader closes, a clean end, so under sidecar
        placement the pod's loader containers end with a trainer that finished (mixplane.podend). Lightning calls
        this hook after a finished fit only (a failed one tears the trainer down without it); where it runs inside an
        exception handler (a tuner's exit), MixtureLoader.close takes the end for an unclean one."""
        for s in self.lr_scales:
            s.remove()
        self.lr_scales = []
        if self.stream is not None and stage == "fit":
            self.stream.close()  # MixtureLoader.close sends the losses gathered since the last report first
