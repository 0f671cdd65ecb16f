"""The end-to-end tests' trainer (mounted from a ConfigMap into the mixplane-trainer image): what a user's training
script does with mixplane -- `MixtureLoader()` with the environment the pod webhook injected (MIXPLANE_PLANNER, the
pod's rank-bound CURVE key) -- for STEPS steps, printing one JSON line per step with a digest of the batch, and reporting a stand-in loss per
source (`MixtureLoader.report_loss`, what the dashboard's loss panel shows).

With CHECKPOINT_DIR (a volume that outlives the pod) it checkpoints as a trainer does: every CHECKPOINT_EVERY steps
the loader's `state_dict()` (with the steps done) goes to `rank-<r>.pt` (written aside, then renamed); a pod started
again by its Job loads it (`load_state_dict`) and goes on from there, so the steps after the checkpoint are trained
again. Each step's line is also appended to `digests-rank<r>.jsonl` there, with the pod's name (a deleted pod's log
is gone), and a restarted pod first writes `{"resumed": next_step, ...}`.
Also imported by the tests for the same digest of the embedded reference run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from typing import Any


def digest(batch: Any) -> str:
    """sha256 over every array of the batch (name, dtype, shape, bytes), names in order; the step itself apart."""
    h = hashlib.sha256()
    for k in sorted(batch):
        v = batch[k]
        if hasattr(v, "detach"):  # a torch tensor
            v = v.detach().cpu().contiguous().numpy()
        if hasattr(v, "dtype") and hasattr(v, "tobytes") and getattr(v, "ndim", 0) > 0:
            h.update(f"{k}|{v.dtype}|{tuple(v.shape)}|".encode())
            h.update(v.tobytes())
    return h.hexdigest()


def main() -> int:
    import torch

    from mixplane.client import MixtureLoader, source_loss

    import time

    # the container's PID 1 gets no default action for SIGTERM: without a handler a deleted pod's trainer would go on
    # for the grace period, beside the pod its Job started again; it ends at once, as a lost pod does (no checkpoint)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    rank, world, steps = int(os.environ["TRAINER_RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["STEPS"])
    step_s = float(os.environ.get("STEP_SECONDS", "0"))  # a training step's time
    print(json.dumps({"rank": rank, "planner": os.environ.get("MIXPLANE_PLANNER"),
                      "curve_name": os.environ.get("MIXPLANE_CURVE_NAME")}), flush=True)
    loader = MixtureLoader(rank=rank, world_size=world)
    ckpt_dir = os.environ.get("CHECKPOINT_DIR")
    every = int(os.environ.get("CHECKPOINT_EVERY", "4"))
    pod = os.environ.get("HOSTNAME", "")
    n = 0
    out = None
    if ckpt_dir:
        ckpt = os.path.join(ckpt_dir, f"rank-{rank}.pt")
        out = open(os.path.join(ckpt_dir, f"digests-rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115 - to the end
        if os.path.exists(ckpt):
            state = torch.load(ckpt, weights_only=False)  # our own file (the cursor holds numpy values)
            loader.load_state_dict(state["loader"])
            n = int(state["steps_done"])
            line = json.dumps({"resumed": int(state["loader"]["next_step"]), "rank": rank, "pod": pod, "t": time.time()})
            print(line, flush=True)
            out.write(line + "\n")
    batches = iter(loader)
    while n < steps:
        batch = next(batches)
        line = json.dumps({"step": int(batch["step"]), "rank": rank, "digest": digest(batch), "t": time.time(), "pod": pod})
        print(line, flush=True)
        if out is not None:
            out.write(line + "\n")
        if "source_ids" in batch:  # a stand-in token loss (no model here), reported per source as a trainer does
            token_loss = (batch["source_ids"].to(torch.float64) + 1.0) * 0.5
            loader.report_loss(int(batch["step"]), *source_loss(token_loss, batch["source_ids"], len(loader.sources),
                                                                batch.get("labels")))
        n += 1
        time.sleep(step_s)
        if ckpt_dir and n % every == 0:
            torch.save({"loader": loader.state_dict(), "steps_done": n}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
