"""One rank of a Lightning job fed by mixplane's MixtureDataModule (run under torchrun by test_integration_lightning.py).

    lightning_train.py OUT_DIR MAX_STEPS SAVE_STEPS DIE_AT CKPT(path or -) ACCUM

A tiny GPT (mixplane's demo model, document-masked attention from position_ids) trained on the CPU (DDP over gloo
when WORLD_SIZE > 1). Each rank appends one JSON line per microbatch to OUT_DIR/rec-rank{R}.jsonl (mixture step,
microbatch, tokens, loss) and one per optimizer step (the learning rate it used, the scheduler's), and SIGKILLs
itself after optimizer step DIE_AT (-1: never). Checkpoints: OUT_DIR/ckpt/step=N.ckpt every SAVE_STEPS steps.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from mixplane.demo.train import build_model
from mixplane.integrations.lightning import MixtureDataModule


def main() -> int:
    out, max_steps, save_steps, die_at, ckpt, accum = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                                       sys.argv[5], int(sys.argv[6]))
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    rec = open(os.path.join(out, f"rec-rank{rank}.jsonl"), "a")

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(1024, 256, d=32, layers=2, heads=2)
            self.seen: dict[int, int] = {}

        def training_step(self, batch, batch_idx):
            logits = self.model(batch["input_ids"].long(), batch["position_ids"].long())
            tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1).long(), ignore_index=-100,
                                  reduction="none")
            valid = batch["labels"].reshape(-1) != -100
            loss = tok.sum() / valid.sum()
            self.trainer.datamodule.report_loss(tok.reshape(batch["labels"].shape), batch)
            step = int(batch["step"])
            mb = self.seen[step] = self.seen.get(step, -1) + 1
            rec.write(json.dumps({"step": step, "mb": mb, "ids": batch["input_ids"].reshape(-1).tolist(),
                                  "loss": float(loss), "keys": sorted(batch),
                                  "n": int((valid & (batch["source_ids"].reshape(-1) >= 0)).sum())}) + "\n")
            rec.flush()
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * max_steps))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_train_start(self) -> None:
            sched = self.lr_schedulers()
            dm = self.trainer.datamodule

            def seen(opt, a, k) -> None:  # registered before mixplane's hooks: runs before its restore
                rec.write(json.dumps({"lr_step": dm.stream.train_step(), "lr": opt.param_groups[0]["lr"],
                                      "sched": sched.get_last_lr()[0]}) + "\n")

            self.optimizers().optimizer.register_step_post_hook(seen)

    class Die(pl.Callback):
        def on_train_batch_end(self, trainer, *a, **k):
            if trainer.global_step == die_at:
                rec.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    saver = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{step}", every_n_train_steps=save_steps,
                                         save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto", max_steps=max_steps,
                         accumulate_grad_batches=accum, callbacks=[Die(), saver], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Tiny(), datamodule=MixtureDataModule(), ckpt_path=None if ckpt == "-" else ckpt)
    rec.close()
    if torch.distributed.is_initialized():  # gloo's worker threads abort the process at exit otherwise (SIGABRT)
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
