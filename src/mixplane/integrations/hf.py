"""Hugging Face Trainer and accelerate fed by a mixture (``pip install mixplane[hf]``).

Trainer (one line changes: the class)::

    from mixplane.integrations.hf import MixplaneTrainer
    trainer = MixplaneTrainer(model=model, args=args)      # no train_dataset / data_collator: the mixture is the data
    trainer.train(resume_from_checkpoint=True)              # resumes the data exactly, no skip_first_batches replay

Every rank reads its own part of each mixture step from the data plane (a per-rank stateful loader; the
Trainer never wraps it in accelerate's ``DataLoaderDispatcher`` / ``IterableDatasetShard``, which would
make rank 0 read for everyone or every rank read everything). One optimizer step takes one mixture step:
``gradient_accumulation_steps`` must equal the mixture's ``batch.microbatches`` (checked), and each
microbatch is one padding-free batch as ``DataCollatorWithFlattening`` gives it — ``input_ids``,
``labels`` (``-100`` at each sequence's first token), ``position_ids`` restarting at every document, all
``[1, tokens]``, plus ``shift_labels`` (the mixture's next-token labels, exact also where a document
continues into the next row, used by the model's loss and the Trainer's token count) and, with
``flash_attn_kwargs``, ``cu_seq_lens_q/k`` and ``max_length_q/k``.

State: each checkpoint folder gets ``mixplane_rank{R}.json`` (the rank's stream state, written by the
``on_save`` callback); ``train(resume_from_checkpoint=...)`` loads it before the first batch and sets
``ignore_data_skip`` so that the Trainer does not fast-forward (re-read) the data. A checkpoint resumes
at another data-parallel size too: the state names the global step, not this rank's share (a rank
without a file of its own takes rank 0's).

lr_scale: the optimizer's step runs with the scheduler's learning rate times the ``lr_scale`` of the
mixture step it trains on (:class:`mixplane.integrations.steps.LRScale`, installed on ``on_train_begin``);
the scheduler and the logged ``learning_rate`` stay unscaled.

accelerate without the Trainer: ``loader = hf_loader()`` is a plain iterable with ``state_dict`` /
``load_state_dict``; ``accelerator.prepare`` passes it through unchanged (it is no ``torch`` DataLoader,
so nothing dispatches or shards it) and ``accelerator.register_for_checkpointing(loader)`` puts its
state into ``save_state`` / ``load_state``; ``apply_lr_scale(optimizer, loader)`` scales the steps.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from mixplane.client import MixtureLoader, source_loss
from mixplane.integrations.steps import LRScale, MicrobatchStream, unwrap_optimizer

log = logging.getLogger("mixplane.integrations.hf")
STATE_FILE = "mixplane_rank{rank}.json"
SOURCE_KEY = "mixplane_source_ids"  # per-token source index in a batch (MixplaneTrainer removes it before the model)


def flatten(mb: dict[str, torch.Tensor], *, flash_attn_kwargs: bool = True, with_sources: bool = False) -> dict[str, Any]:
    """A mixture microbatch (rows of packed documents) as one padding-free ``[1, tokens]`` batch in the layout
    of ``DataCollatorWithFlattening``: documents (and each row's padding tail) are its sequences. `with_sources`:
    also ``SOURCE_KEY`` (the tokens' source indices), which MixplaneTrainer takes out before the model sees it."""
    ids = mb["input_ids"].reshape(1, -1).to(torch.int64)
    pos = mb["position_ids"].reshape(1, -1).to(torch.int64)
    nxt = mb["labels"].reshape(1, -1).to(torch.int64)  # label of token t = the next token of its document
    labels = torch.full_like(nxt, -100)
    labels[:, 1:] = nxt[:, :-1]  # the collator's form: the token itself, -100 where a sequence starts
    labels[pos == 0] = -100
    out: dict[str, Any] = {"input_ids": ids, "labels": labels, "shift_labels": nxt, "position_ids": pos}
    if with_sources:
        out[SOURCE_KEY] = mb["source_ids"].reshape(1, -1)
    if flash_attn_kwargs:
        cu = mb["cu_seqlens"].to(torch.int32)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
        out["max_length_q"] = out["max_length_k"] = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    return out


class HFMixtureLoader(MicrobatchStream):
    """A rank's padding-free microbatches (see :func:`flatten`) with ``state_dict`` / ``load_state_dict``."""

    def __init__(self, loader: MixtureLoader | None = None, *, accumulation: int | None = None,
                 flash_attn_kwargs: bool = True, with_sources: bool = False) -> None:
        super().__init__(loader, transform=lambda mb: flatten(mb, flash_attn_kwargs=flash_attn_kwargs,
                                                              with_sources=with_sources),
                         accumulation=accumulation, what="TrainingArguments.gradient_accumulation_steps")


def hf_loader(loader: MixtureLoader | None = None, **kw: Any) -> HFMixtureLoader:
    """The per-rank loader for an accelerate training loop (a MixtureLoader from the environment by default)."""
    return HFMixtureLoader(loader, **kw)


def apply_lr_scale(optimizer: Any, loader: MicrobatchStream) -> LRScale:
    """Scale every step of `optimizer` (a torch optimizer or accelerate's wrapper) by the lr_scale of the
    mixture step `loader` handed out last (accelerate loops fetch a step's microbatches, then step)."""
    return LRScale(unwrap_optimizer(optimizer), loader.train_lr_scale, loader.train_step)


class MixplaneCallback(TrainerCallback):
    """Saves the rank's stream state into each checkpoint folder and applies lr_scale to the optimizer."""

    def __init__(self, stream: MicrobatchStream, rank: int) -> None:
        self.stream, self.rank = stream, rank
        self.lr_scale: LRScale | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        opt = kwargs.get("optimizer")
        if opt is not None and self.lr_scale is None:
            self.lr_scale = apply_lr_scale(opt, self.stream)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The training loop ended (the Trainer calls this only after its last step): the last per-source losses go,
        and the rank's loader closes -- a clean end, so under sidecar placement the pod's loader containers end with
        the trainer (mixplane.podend). A later train() connects again."""
        if self.lr_scale is not None:
            self.lr_scale.remove()
            self.lr_scale = None
        self.stream.close()  # MixtureLoader.close sends the losses gathered since the last report first

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        save_state(folder, self.rank, self.stream.state_dict())


def save_state(folder: str, rank: int, state: dict[str, Any]) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)
    return path


def load_state(folder: str, rank: int) -> dict[str, Any]:
    """This rank's state from a checkpoint folder, else rank 0's (a resume at another DP size)."""
    for r in (rank, 0):
        path = os.path.join(folder, STATE_FILE.format(rank=r))
        if os.path.isfile(path):
            with open(path) as f:
                state: dict[str, Any] = json.load(f)
            return state
    raise FileNotFoundError(f"{folder}: no {STATE_FILE.format(rank=rank)} nor {STATE_FILE.format(rank=0)}: "
                            "the checkpoint was not written by a MixplaneTrainer, its data position is unknown")


class MixplaneTrainerMixin:
    """Put before ``Trainer`` (or a subclass of it, e.g. TRL's) in a class's bases to feed it from a mixture:
    ``class MyTrainer(MixplaneTrainerMixin, SFTTrainer): ...``. Keyword arguments: ``mixture_loader`` (a
    :class:`MixtureLoader`; default: one from the environment, rank = the Trainer's process index) and
    ``flash_attn_kwargs`` (default True)."""

    def __init__(self, *args: Any, mixture_loader: MixtureLoader | None = None, flash_attn_kwargs: bool = True,
                 report_loss: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        targs = self.args  # type: ignore[attr-defined]
        if not targs.ignore_data_skip:
            targs.ignore_data_skip = True  # the stream resumes itself: the Trainer must not re-read batches to skip
        loader = mixture_loader if mixture_loader is not None else MixtureLoader(rank=targs.process_index)
        self.mixplane_report_loss = report_loss
        self.mixplane = HFMixtureLoader(loader, accumulation=targs.gradient_accumulation_steps,
                                        flash_attn_kwargs=flash_attn_kwargs, with_sources=report_loss)
        self.mixplane_callback = MixplaneCallback(self.mixplane, targs.process_index)
        self.add_callback(self.mixplane_callback)  # type: ignore[attr-defined]

    def get_train_dataloader(self) -> Any:
        return self.mixplane

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The Trainer's loss; with ``report_loss``, also each source's token losses of this microbatch (from the
        model's logits and ``shift_labels``) to the planner (MixtureLoader.report_loss: at a bounded rate)."""
        src = inputs.pop(SOURCE_KEY, None)
        if src is None or not self.mixplane_report_loss or not model.training:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,  # type: ignore[misc]
                                        num_items_in_batch=num_items_in_batch)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,  # type: ignore[misc]
                                             num_items_in_batch=num_items_in_batch)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
        if logits is not None and "shift_labels" in inputs:
            self.mixplane_report(logits, inputs["shift_labels"], src)
        return (loss, outputs) if return_outputs else loss

    def mixplane_report(self, logits: torch.Tensor, shift_labels: torch.Tensor, source_ids: torch.Tensor) -> None:
        loader = self.mixplane.loader
        with torch.no_grad():
            tok = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                    shift_labels.reshape(-1), ignore_index=-100, reduction="none")
            n = len(loader.sources) or int(source_ids.max()) + 1
            s, c = source_loss(tok, source_ids, n, shift_labels)
        if self.mixplane.step is not None:
            loader.report_loss(self.mixplane.step, s, c)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
            if resume_from_checkpoint is None:
                raise ValueError(f"no checkpoint in {self.args.output_dir}")  # type: ignore[attr-defined]
        if isinstance(resume_from_checkpoint, str):
            self.mixplane.load_state_dict(load_state(resume_from_checkpoint, self.args.process_index))  # type: ignore[attr-defined]
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]


class MixplaneTrainer(MixplaneTrainerMixin, Trainer):
    """``transformers.Trainer`` fed by a mixture (see :class:`MixplaneTrainerMixin`)."""
