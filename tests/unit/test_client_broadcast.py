"""broadcast_tp: under broadcast_at('TP') tp = 0 fills the other TP ranks' empty buffers (gloo, 2 processes)."""

import multiprocessing as mp
import os

import pytest
import torch

from mixplane.client import broadcast_encoder, broadcast_tp


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


def _encoder_worker(rank: int, init: str, q) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        # encoder {dp: world}: each TP rank encodes its own images (different counts), the backbone is broadcast
        own = torch.full((3 + 2 * rank, 12), 10 + rank, dtype=torch.uint8)
        batch = {"input_ids": torch.arange(6).reshape(1, 6) if rank == 0 else torch.empty((1, 6), dtype=torch.int64),
                 "pixel_patches": own.clone(), "patch_cu_seqlens": torch.tensor([0, 3 + 2 * rank], dtype=torch.int32),
                 "image_ids": torch.tensor([rank]), "meta_only": torch.tensor(rank == 1)}
        broadcast_tp(batch, group)
        tp = (batch["input_ids"].tolist(), torch.equal(batch["pixel_patches"], own), batch["image_ids"].tolist())
        # image module = backbone: rank 0 leads the bucket, rank 1 got the leader's shapes only
        enc = {"pixel_patches": torch.full((4, 12), 7, dtype=torch.uint8) if rank == 0 else torch.empty((4, 12), dtype=torch.uint8),
               "image_ids": torch.tensor([5]) if rank == 0 else torch.empty(1, dtype=torch.int64),
               "encoder_leader": torch.tensor(0), "encoder_meta_only": torch.tensor(rank == 1)}
        broadcast_encoder(enc, group)
        q.put((rank, tp, (int(enc["pixel_patches"].sum()), enc["image_ids"].tolist(), bool(enc["encoder_meta_only"]))))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_tp_broadcast_leaves_each_ranks_encoder_batch_and_broadcast_encoder_fills_peers(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"file://{tmp_path / 'pg'}"
    ps = [ctx.Process(target=_encoder_worker, args=(r, init, q)) for r in range(2)]
    for p in ps:
        p.start()
    got = dict((r, rest) for r, *rest in (q.get(timeout=90) for _ in range(2)))
    for p in ps:
        p.join(30)
    for r in (0, 1):
        tp, enc = got[r]
        assert tp == ([list(range(6))], True, [r])  # backbone from tp 0, own pixels and image ids kept
        assert enc == (4 * 12 * 7, [5], False)
