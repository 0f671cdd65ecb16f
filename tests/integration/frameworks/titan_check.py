"""One rank of a torchtitan job's data path fed by mixplane (run under torchrun by test_integration_torchtitan.py).

    titan_check.py OUT_DIR MODE(train|resume) STEPS SAVE_AT

The dataloader is built the way torchtitan's trainer builds it (``Config.build(dp_rank=, dp_world_size=, tokenizer=,
seq_len=, local_batch_size=, snapshot_every_n_steps=)``) and iterated as its ``batch_generator`` does; its state
goes through DCP (``torch.distributed.checkpoint``) as torchtitan's checkpointer saves a ``Stateful`` dataloader.
`train` saves after SAVE_AT steps and goes on; `resume` loads that checkpoint (at any DP size) and goes on. One
JSON line per microbatch in OUT_DIR/rec-rank{R}.jsonl.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.dataloader import BaseDataLoader

from mixplane.integrations.torchtitan import MixplaneDataLoader

MB = 2
IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX (that module needs spmd_types, not installed)


def main() -> int:
    out, mode, steps, save_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dl = MixplaneDataLoader.Config(microbatches=MB).build(dp_rank=rank, dp_world_size=world, tokenizer=None, seq_len=256,
                                                          local_batch_size=8 // world // MB, snapshot_every_n_steps=None)
    assert isinstance(dl, BaseDataLoader)
    ckpt = os.path.join(out, "ckpt")
    first = 0
    if mode == "resume":
        dcp.load({"dataloader": dl}, checkpoint_id=ckpt)
        first = save_at
    rec = open(os.path.join(out, f"rec-rank{rank}.jsonl"), "a")
    it = iter(dl)
    for step in range(first, steps):
        for mb in range(MB):
            input_dict, labels = next(it)
            assert set(input_dict) == {"input", "positions"} and dl.step == step
            pos = input_dict["positions"]
            # positions restart at every document: a document's tokens count up from 0, labels end with IGNORE_INDEX
            starts = pos == 0
            assert bool(starts[:, 0].all()) and bool(((pos[:, 1:] == pos[:, :-1] + 1) | starts[:, 1:]).all())
            ends = torch.zeros_like(starts)
            ends[:, :-1] = starts[:, 1:]
            assert bool((labels[ends] == IGNORE_INDEX).all())
            rec.write(json.dumps({"step": step, "mb": mb, "ids": input_dict["input"].reshape(-1).tolist()}) + "\n")
            rec.flush()
        if mode == "train" and step + 1 == save_at:
            dcp.save({"dataloader": dl}, checkpoint_id=ckpt)
    rec.close()
    dl.stream.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
