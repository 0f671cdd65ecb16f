"""broadcast_tp: under broadcast_at('TP') tp = 0 fills the other TP ranks' empty buffers (gloo, 2 processes)."""

import multiprocessing as mp
import os

import pytest
import torch

from mixplane.client import broadcast_tp


def _worker(rank: int, init: str, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        if rank == 0:
            batch = {"input_ids": torch.arange(12, dtype=torch.int64).reshape(2, 6),
                     "cu_seqlens": torch.tensor([0, 6, 12], dtype=torch.int32), "step": torch.tensor(3),
                     "meta_only": torch.tensor(False)}
        else:  # what the client yields on a metadata-only rank: empty buffers of the right shapes
            batch = {"input_ids": torch.empty((2, 6), dtype=torch.int64), "cu_seqlens": torch.empty(3, dtype=torch.int32),
                     "step": torch.tensor(3), "meta_only": torch.tensor(True)}
        broadcast_tp(batch, group)
        q.put((rank, batch["input_ids"].tolist(), batch["cu_seqlens"].tolist(), bool(batch["meta_only"])))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_broadcast_fills_tp_peers(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path / 'pg'}"
    ps = [ctx.Process(target=_worker, args=(r, init, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = dict((r, rest) for r, *rest in (q.get(timeout=90) for _ in range(2)))
    for p in ps:
        p.join(30)
    assert got[1] == got[0]
    assert got[1][0] == torch.arange(12).reshape(2, 6).tolist() and got[1][2] is False
