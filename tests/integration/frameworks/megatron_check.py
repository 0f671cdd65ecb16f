"""One rank of a Megatron-Core job's data path fed by mixplane, on the CPU (run under torchrun by
test_integration_megatron.py): tensor parallel 1, context parallel 2 (both ranks one CP group, gloo).

    megatron_check.py OUT_DIR MODE(train|resume) STEPS SAVE_AT

Megatron-Core cannot train on the CPU (its attention asks CUDA for buffers), so what runs here are Megatron's own
functions that consume a batch: `get_batch_on_this_cp_rank` (the rows gathered from both CP ranks and cut again by
Megatron must be exactly what mixplane gave this rank), and a tiny `GPTModel`'s embedding, output layer and
`compute_language_model_loss` with `loss_mask` (Megatron's masked token loss must equal cross entropy over the
mixture's own labels). `train` appends one JSON line per microbatch to OUT_DIR/rec-rank{R}.jsonl and saves the
iterator's state after SAVE_AT steps the way Megatron-LM's checkpointing does; `resume` restores it and goes on.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_batch_on_this_cp_rank

from mixplane.client import MixtureLoader
from mixplane.integrations.megatron import (MegatronDataIterator, get_batch, load_megatron_state, megatron_groups,
                                            save_megatron_state)

MB = 2


def mb_labels(it: MegatronDataIterator, step: int, mb: int, idx: torch.Tensor) -> torch.Tensor:
    """The mixture's own labels (-100 kept) of microbatch `mb` of the step, as this CP rank holds them."""
    lab = it.last_batch["labels"].to(torch.int64)  # this rank's CP shard of the whole step
    rows = lab.shape[0] // MB
    return lab[mb * rows : (mb + 1) * rows]


def main() -> int:
    out, mode, steps, save_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                             context_parallel_size=2)
    cp_group = parallel_state.get_context_parallel_group()
    cp_rank = parallel_state.get_context_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, use_cpu_initialization=True,
                            bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                            gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
                            hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=1024, max_sequence_length=256)
    with torch.no_grad():  # larger embeddings (shared with the output layer): logits far from uniform
        model.embedding.word_embeddings.weight.normal_(0.0, 1.0)

    # mode "broadcast": the plan says broadcast_at('CP'); CP rank 0 fetches whole rows and fans them out
    groups = megatron_groups() if mode == "broadcast" else None
    loader = MixtureLoader(coords={"dp": dp_rank, "pp": 0, "cp": cp_rank, "tp": 0}, groups=groups)
    it = MegatronDataIterator(loader, num_microbatches=MB)
    first = 0
    if mode == "resume":
        it.restore_state(load_megatron_state(os.path.join(out, "dataloader"), save_at, dp_rank))
        first = save_at
    rec = open(os.path.join(out, f"rec-rank{rank}.jsonl"), "a")
    for step in range(first, steps):
        for mb in range(MB):
            tokens, labels, loss_mask, attention_mask, position_ids, packed = get_batch(it)
            b = it.last_batch
            assert attention_mask is None and packed.qkv_format == "thd" and int(b["step"]) == step
            assert loader.coords["cp"] == cp_rank
            # Megatron's CP cut of the rows gathered from both CP ranks = what mixplane delivered to this rank
            idx = torch.as_tensor(b["cp_token_index"], dtype=torch.int64)
            mine = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
            full = {}
            for k, v in mine.items():
                parts = [torch.empty_like(v) for _ in range(2)]
                idxs = [torch.empty_like(idx) for _ in range(2)]
                dist.all_gather(parts, v.contiguous(), group=cp_group)
                dist.all_gather(idxs, idx, group=cp_group)
                whole = torch.empty(v.shape[0], 2 * v.shape[1], dtype=v.dtype)
                for p, i in zip(parts, idxs):
                    whole[:, i] = p
                full[k] = whole
            cut = get_batch_on_this_cp_rank(dict(full), cp_group=cp_group)
            for k in mine:
                assert torch.equal(cut[k], mine[k]), f"step {step} mb {mb}: Megatron's CP cut of {k} differs"
            # the model's batch-consuming functions: embedding, output layer, Megatron's masked token loss
            emb = model.embedding(input_ids=tokens, position_ids=position_ids)
            logits, _ = model.output_layer(emb)
            plain = logits.detach().clone()  # Megatron's cross entropy works on the logits in place
            tok_loss = model.compute_language_model_loss(labels, logits)  # [b, s]
            mloss = (tok_loss * loss_mask).sum() / loss_mask.sum()  # pretrain_gpt's loss_func
            # the same from the logits and the mixture's own labels (-100 ignored), token for token
            own = mb_labels(it, step, mb, idx)
            ref = F.cross_entropy(plain.transpose(0, 1).reshape(-1, logits.shape[-1]).float(), own.reshape(-1),
                                  ignore_index=-100, reduction="none").reshape(own.shape)
            assert torch.equal(own != -100, loss_mask > 0)
            assert torch.allclose(tok_loss * loss_mask, ref, rtol=1e-4, atol=1e-5), float((tok_loss * loss_mask - ref).abs().max())
            assert float(ref.std()) > 0.1  # informative logits: a label mix-up would not pass
            rec.write(json.dumps({"step": step, "mb": mb, "ids": tokens.reshape(-1).tolist(), "loss": float(mloss),
                                  "full": full["tokens"].reshape(-1).tolist(), "masked": int((loss_mask == 0).sum())}) + "\n")
            rec.flush()
        if mode == "train" and step + 1 == save_at:
            save_megatron_state(it, os.path.join(out, "dataloader"), save_at, dp_rank)
    rec.close()
    if mode == "broadcast":  # only CP rank 0 got tensors from its constructor
        assert (loader.received_bytes > 0) == (cp_rank == 0) and (loader.fanout_bytes > 0) == (cp_rank == 0)
    loader.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
