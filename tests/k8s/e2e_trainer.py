"""The end-to-end tests' trainer (mounted from a ConfigMap into the mixplane-trainer image): what a user's training
script does with mixplane -- `MixtureLoader()` with the environment the pod webhook injected (MIXPLANE_PLANNER, the
pod's rank-bound CURVE key) -- for STEPS steps, printing one JSON line per step with a digest of the batch, and reporting a stand-in loss per
source (`MixtureLoader.report_loss`, what the dashboard's loss panel shows).
Also imported by the tests for the same digest of the embedded reference run."""

from __future__ import annotations

import hashlib
import json
import os
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

    rank, world, steps = int(os.environ["TRAINER_RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["STEPS"])
    step_s = float(os.environ.get("STEP_SECONDS", "0"))  # a training step's time
    print(json.dumps({"rank": rank, "planner": os.environ.get("MIXPLANE_PLANNER"),
                      "curve_name": os.environ.get("MIXPLANE_CURVE_NAME")}), flush=True)
    loader = MixtureLoader(rank=rank, world_size=world)
    n = 0
    for batch in loader:
        print(json.dumps({"step": int(batch["step"]), "rank": rank, "digest": digest(batch), "t": time.time()}), flush=True)
        if "source_ids" in batch:  # a stand-in token loss (no model here), reported per source as a trainer does
            token_loss = (batch["source_ids"].to(torch.float64) + 1.0) * 0.5
            loader.report_loss(int(batch["step"]), *source_loss(token_loss, batch["source_ids"], len(loader.sources),
                                                                batch.get("labels")))
        n += 1
        time.sleep(step_s)
        if n >= steps:
            break
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
