"""Megatron-Core fed by a mixture (``pip install mixplane[megatron]``).

Megatron's schedules (``forward_backward_func``) call ``next(data_iterator)`` once per microbatch and hand the
result to the user's ``forward_step``, whose ``get_batch`` returns ``tokens, labels, loss_mask, attention_mask,
position_ids`` (and, for packed sequences, ``PackedSeqParams``). :class:`MegatronDataIterator` is that data
iterator; :func:`get_batch` is that function::

    from mixplane.integrations.megatron import MegatronDataIterator, get_batch, load_megatron_state

    it = MegatronDataIterator(MixtureLoader(coords={"dp": dp, "pp": pp, "cp": cp, "tp": tp}, groups=megatron_groups()))
    if resuming: it.restore_state(load_megatron_state(args.dataloader_save, iteration, dp_rank))
    def forward_step(data_iterator, model):
        tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(data_iterator)
        output = model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=packed)
        ...

Batches (one microbatch, the mixture's rows of packed documents): ``tokens`` [b, s] int64, ``labels`` [b, s]
int64 (the next token; 0 where the mixture says -100, which ``loss_mask`` [b, s] float zeroes: Megatron's
vocab-parallel cross entropy needs valid ids everywhere), ``position_ids`` [b, s] restarting at every document,
``attention_mask`` None and ``packed_seq_params`` = ``PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv,
max_seqlen_q/kv)`` over the flattened rows (``packed=False``: no packed params and a boolean document-causal
``attention_mask`` [b, 1, s, s], True where attention is masked, Megatron's convention, for the local
(non-TransformerEngine) attention).

Where Megatron reads them: the data plane delivers each rank its view — the first pipeline stage gets the
inputs (``tokens``, ``position_ids``), the last the targets (``labels``, ``loss_mask``), middle stages None for
all of them (as Megatron's ``get_batch`` returns on those stages); under ``broadcast_at('TP')`` TP rank 0
receives and ``MixtureLoader(groups=...)`` broadcasts to the other TP ranks, and under ``broadcast_at('CP')`` /
``('PP')`` the group's rank 0 receives for the group and the client fans it out (:func:`megatron_groups` gives
Megatron's CP / PP / TP groups, each ordered by its coordinate); a CP rank gets its zig-zag shard
of every row — chunks ``r`` and ``2·cp−1−r``, exactly what Megatron's ``get_batch_on_this_cp_rank`` cuts (do not
cut it again) — with ``cp_token_index`` naming the positions it holds.

State: ``save_state()`` / ``restore_state()`` (and Energon's ``restore_state_rank``) are what Megatron-LM's
checkpointing calls on ``train_data_iterator.iterable`` (``maybe_save_dataloader_state``: first PP stage, TP
rank 0, one ``train_dataloader_dprank{dp:03d}.pt`` per DP rank under ``--dataloader-save``);
:func:`load_megatron_state` reads such a file back (rank 0's when this DP rank has none: a resume at another DP
size). ``apply_lr_scale(optimizer, it)`` scales Megatron's optimizer steps by the mixture's ``lr_scale``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mixplane.client import MixtureLoader
from mixplane.integrations.steps import LRScale, MicrobatchStream, unwrap_optimizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids", "packed_seq_params")


def document_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool, True where a query may NOT attend a key (Megatron's convention): keys after the query
    or in another document (a document starts where its position is 0)."""
    doc = torch.cumsum((position_ids == 0).to(torch.int32), dim=1)
    s = position_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (doc[:, :, None] == doc[:, None, :]) & causal
    return ~allowed[:, None]


def megatron_groups() -> dict[str, Any]:
    """Megatron-Core's process groups for the client's fan-outs (``MixtureLoader(groups=...)``): context, pipeline
    and tensor parallel, each ordered by its coordinate. Call after ``initialize_model_parallel``."""
    from megatron.core import parallel_state as mpu

    return {"cp": mpu.get_context_parallel_group(), "pp": mpu.get_pipeline_model_parallel_group(),
            "tp": mpu.get_tensor_model_parallel_group()}


def megatron_batch(mb: dict[str, torch.Tensor], *, packed: bool = True) -> dict[str, Any]:
    """One mixture microbatch in the contract of Megatron's ``get_batch`` (fields this pipeline stage does not
    hold are None)."""
    out: dict[str, Any] = dict.fromkeys(BATCH_KEYS)
    if "input_ids" in mb:
        out["tokens"] = mb["input_ids"].to(torch.int64)
    if "labels" in mb:
        labels = mb["labels"].to(torch.int64)
        keep = labels != -100
        out["labels"] = labels.masked_fill(~keep, 0)
        out["loss_mask"] = keep.to(torch.float32)
    if "position_ids" in mb:
        out["position_ids"] = mb["position_ids"].to(torch.int64)
    if packed:
        cu = mb["cu_seqlens"].to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
        out["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                   max_seqlen_q=longest, max_seqlen_kv=longest)
    elif out["position_ids"] is not None and "cp_token_index" not in mb:
        out["attention_mask"] = document_causal_mask(out["position_ids"])
    for k in ("cp_token_index", "source_ids", "step", "lr_scale"):
        if k in mb:
            out[k] = mb[k]
    return out


class MegatronDataIterator(MicrobatchStream):
    """A rank's microbatches as Megatron's ``get_batch`` dicts; ``num_microbatches`` (Megatron's
    ``get_num_microbatches()``) is checked against the mixture's ``batch.microbatches``."""

    def __init__(self, loader: MixtureLoader | None = None, *, num_microbatches: int | None = None,
                 packed: bool = True) -> None:
        super().__init__(loader, transform=lambda mb: megatron_batch(mb, packed=packed), accumulation=num_microbatches,
                         what="Megatron's num_microbatches")

    @property
    def iterable(self) -> "MegatronDataIterator":
        """What Megatron-LM's checkpointing calls ``save_state`` on (``train_data_iterator.iterable``)."""
        return self

    def save_state(self) -> dict[str, Any]:
        return self.state_dict()

    def restore_state(self, state: dict[str, Any]) -> None:
        self.load_state_dict(state.get("dataloader_state_dict", state))

    restore_state_rank = restore_state  # Megatron-Energon's name


def get_batch(data_iterator: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """``tokens, labels, loss_mask, attention_mask, position_ids, packed_seq_params`` of the next microbatch
    (None on stages that hold no such field; None for every field when `data_iterator` is None, as Megatron's
    middle pipeline stages call it)."""
    if data_iterator is None:
        return (None,) * 6
    b = next(data_iterator)
    return tuple(b[k] for k in BATCH_KEYS)


def state_file(dataloader_save: str, iteration: int, dp_rank: int) -> str:
    """Where Megatron-LM's ``maybe_save_dataloader_state`` puts a DP rank's state (``get_checkpoint_name``
    with its basename, no model-parallel suffix)."""
    return os.path.join(dataloader_save, f"iter_{iteration:07d}", f"train_dataloader_dprank{dp_rank:03d}.pt")


def save_megatron_state(it: MegatronDataIterator, dataloader_save: str, iteration: int, dp_rank: int) -> str:
    """What ``maybe_save_dataloader_state`` writes, for a loop without Megatron-LM's checkpointing."""
    path = state_file(dataloader_save, iteration, dp_rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"dataloader_state_dict": it.save_state()}, path)
    return path


def load_megatron_state(dataloader_save: str, iteration: int, dp_rank: int) -> dict[str, Any]:
    """A DP rank's saved state, else DP rank 0's (the state names the global step: any DP size resumes from it)."""
    for r in (dp_rank, 0):
        path = state_file(dataloader_save, iteration, r)
        if os.path.isfile(path):
            state: dict[str, Any] = torch.load(path, weights_only=True)
            return state
    raise FileNotFoundError(f"no {state_file(dataloader_save, iteration, dp_rank)} nor dprank000's")


def apply_lr_scale(optimizer: Any, it: MicrobatchStream) -> LRScale:
    """Scale the steps of Megatron's optimizer (its torch optimizer inside ``.optimizer``) by the lr_scale of the
    mixture step of the microbatches fetched last (Megatron fetches a step's microbatches, then steps)."""
    return LRScale(unwrap_optimizer(optimizer), it.train_lr_scale, it.train_step)
