"""The end-to-end tests' trainer (mounted from a ConfigMap into the mixplane-trainer image): what a user's training
script does with mixplane -- `MixtureLoader()` with the environment the pod webhook injected (MIXPLANE_PLANNER, the
pod's rank-bound CURVE key) -- for STEPS steps, printing one JSON line per step with a digest of the batch.
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
    from mixplane.client import MixtureLoader

    import time

    rank, world, steps = int(os.environ["TRAINER_RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["STEPS"])
    step_s = float(os.environ.get("STEP_SECONDS", "0"))  # a training step's time
    print(json.dumps({"rank": rank, "planner": os.environ.get("MIXPLANE_PLANNER"),
                      "curve_name": os.environ.get("MIXPLANE_CURVE_NAME")}), flush=True)
    loader = MixtureLoader(rank=rank, world_size=world)
    n = 0
    for batch in loader:
        print(json.dumps({"step": int(batch["step"]), "rank": rank, "digest": digest(batch), "t": time.time()}), flush=True)
        n += 1
        time.sleep(step_s)
        if n >= steps:
            break
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
