"""Selective broadcast on CP and PP against real processes: a planner, loaders and a constructor (EmbeddedRuntime)
and one trainer process per rank with gloo. Under broadcast_at('CP', 'PP') (and 'TP') only the group's
coordinate-0 rank gets tensors from its constructor and the client fans them out; every rank's tensors at every
step equal those of the same run without the broadcast. Prints the bytes constructors sent per step, before/after."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from mixplane.client import MixtureLoader
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

pytestmark = pytest.mark.timeout(420)
STEPS = 3


def _spec(root, sizes, broadcast):
    return parse_spec(token_mixture(root, topology={"modules": {"backbone": {"dp": 1, **sizes}}},
                                    batch={"sequences": 4, "seq_len": 256, "microbatches": 2},
                                    strategy={"name": "llm_balance", "options": {"broadcast": list(broadcast)}}))


def _plain(endpoint, world):
    out, received = {}, 0
    for r in range(world):
        loader = MixtureLoader(endpoint, rank=r, max_steps=STEPS, timeout_s=120)
        out[r] = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
        received += loader.received_bytes
        loader.close()
    return out, received


def _rank(rank, world, init, endpoint, groups_spec, q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        groups = {}
        for axis, lists in groups_spec.items():  # every rank creates every group, in the same order
            for ranks in lists:
                g = dist.new_group(ranks)
                if rank in ranks:
                    groups[axis] = g
        loader = MixtureLoader(endpoint, rank=rank, max_steps=STEPS, timeout_s=120, groups=groups)
        got = []
        for b in loader:
            got.append({k: v.numpy().copy() for k, v in b.items()})
        q.put((rank, got, loader.received_bytes, loader.fanout_bytes))
        loader.close()
    except BaseException as e:  # the parent names the failing rank
        q.put((rank, repr(e), 0, 0))
        raise
    finally:
        dist.destroy_process_group()


def _groups(sizes):
    """CP / PP / TP groups of a dp = 1 mesh in the default rank order (tp fastest, then cp, dp, pp)."""
    tp, cp, pp = sizes.get("tp", 1), sizes.get("cp", 1), sizes.get("pp", 1)
    rank = lambda t, c, p: t + tp * (c + cp * p)  # noqa: E731
    return {"cp": [[rank(t, c, p) for c in range(cp)] for p in range(pp) for t in range(tp)],
            "pp": [[rank(t, c, p) for p in range(pp)] for c in range(cp) for t in range(tp)],
            "tp": [[rank(t, c, p) for t in range(tp)] for p in range(pp) for c in range(cp)]}


@pytest.mark.parametrize("sizes,broadcast", [({"pp": 2, "cp": 2}, ("CP", "PP")), ({"cp": 2, "tp": 2}, ("TP", "CP"))],
                         ids=["pp2-cp2", "cp2-tp2"])
def test_broadcast_batches_equal_the_plain_ones(token_sources, tmp_path, sizes, broadcast):
    world = int(np.prod(list(sizes.values())))
    with EmbeddedRuntime(_spec(token_sources["root"], sizes, ()), tmp_path / "plain", log_level="WARNING") as rt:
        plain, plain_bytes = _plain(rt.planner_endpoint, world)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with EmbeddedRuntime(_spec(token_sources["root"], sizes, broadcast), tmp_path / "bc", log_level="WARNING") as rt:
        ps = [ctx.Process(target=_rank, args=(r, world, f"file://{tmp_path / 'pg'}", rt.planner_endpoint,
                                              {a: g for a, g in _groups(sizes).items() if a.upper() in broadcast}, q))
              for r in range(world)]
        for p in ps:
            p.start()
        res = {}
        for _ in range(world):
            r, got, received, sent = q.get(timeout=360)
            assert not isinstance(got, str), f"rank {r}: {got}"
            res[r] = (got, received, sent)
        for p in ps:
            p.join(60)
    fetchers = [r for r in range(world) if res[r][1] > 0]
    assert fetchers == [0], f"ranks that got tensors from the constructor: {fetchers}"
    for r in range(world):
        for step in range(STEPS):
            want, got = plain[r][step], res[r][0][step]
            assert set(got) == set(want), (r, step, set(got) ^ set(want))
            for k in want:
                assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), f"rank {r} step {step}: {k}"
    bc_bytes = sum(x[1] for x in res.values())
    moved = sum(x[2] for x in res.values())
    print(f"\n{'+'.join(broadcast)} {sizes}: constructor -> clients {plain_bytes / STEPS:.0f} B/step without broadcast, "
          f"{bc_bytes / STEPS:.0f} B/step with; trainer-side fan-out {moved / STEPS:.0f} B/step; "
          f"clients receiving tensors {world} -> 1")
    assert bc_bytes < plain_bytes
