"""One rank of a Hugging Face Trainer job fed by mixplane (run under torchrun by test_integration_hf.py).

    hf_train.py OUT_DIR MAX_STEPS SAVE_STEPS DIE_AT RESUME(0|1) GRAD_ACCUM

A tiny Llama (random weights, no download) trained on the CPU with DDP over gloo. Each rank appends one JSON
line per microbatch to OUT_DIR/rec-rank{R}.jsonl (mixture step, microbatch, tokens, the learning rate the
optimizer step used and the scheduler's), and SIGKILLs itself after optimizer step DIE_AT (-1: never).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

from mixplane.integrations.hf import SOURCE_KEY, MixplaneTrainer


def main() -> int:
    out, max_steps, save_steps, die_at, resume, accum = sys.argv[1], *map(int, sys.argv[2:7])
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    config = LlamaConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    args = TrainingArguments(output_dir=out, max_steps=max_steps, save_steps=save_steps, save_strategy="steps",
                             gradient_accumulation_steps=accum, learning_rate=1e-3, lr_scheduler_type="linear",
                             logging_steps=1, report_to=[], use_cpu=True, ddp_backend="gloo", seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    rec = open(os.path.join(out, f"rec-rank{rank}.jsonl"), "a")

    seen_mb: dict[int, int] = {}

    class Recording(MixplaneTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # type: ignore[override]
            counted = int(((inputs["shift_labels"] != -100) & (inputs[SOURCE_KEY] >= 0)).sum())
            loss = super().training_step(model, inputs, num_items_in_batch)
            s = self.mixplane
            mb = seen_mb[s.step] = seen_mb.get(s.step, -1) + 1  # the Trainer trains a step's microbatches in order
            rec.write(json.dumps({"step": s.step, "mb": mb, "ids": inputs["input_ids"].reshape(-1).tolist(),
                                  "keys": sorted(inputs), "loss": float(loss), "n": counted}) + "\n")
            rec.flush()
            return loss

    class Watch(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
            inner = getattr(optimizer, "optimizer", optimizer)
            sched = lambda: lr_scheduler.get_last_lr()[0]  # noqa: E731 (the scheduler of this run)

            def seen(opt, a, k) -> None:
                rec.write(json.dumps({"lr_step": trainer.mixplane.step, "lr": opt.param_groups[0]["lr"],
                                      "sched": sched()}) + "\n")

            inner.register_step_pre_hook(seen)

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == die_at:
                rec.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = Recording(model=model, args=args)
    trainer.add_callback(Watch())  # after the MixplaneCallback: its pre-hook sees the scaled learning rate
    trainer.train(resume_from_checkpoint=True if resume else None)
    rec.close()
    if torch.distributed.is_initialized():  # gloo's worker threads abort the process at exit otherwise (SIGABRT)
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
