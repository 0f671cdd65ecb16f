"""Hybrid DP x CP delivered end to end on real processes (EmbeddedRuntime: planner, loaders, constructors over
ZeroMQ; trainer clients in threads, and one gloo process per rank for a TP broadcast): every token of every planned
piece arrives exactly once across the dp x cp ranks, at the ranks of the group the journaled plan names; a group's
parts merged give the document; resume and `mixplane replay` give the same tensors. Prints the bytes constructors
sent per step beside the same run without hybrid placement."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from mixplane.client import cp_groups
from mixplane.parallelism import cp_merge
from mixplane.planner.journal import replan
from mixplane.replay import ReplayLoaders, replay_step
from mixplane.runtime import EmbeddedRuntime
from mixplane.samples import key_row
from mixplane.spec import parse_spec
from mixplane.topology import place_tree
from tests.conftest import token_mixture
from tests.integration.test_runtime import fetch

pytestmark = pytest.mark.timeout(600)
STEPS = 4


def _spec(root, sizes, hybrid=True, broadcast=()):
    return parse_spec(token_mixture(root, topology={"modules": {"backbone": sizes}},
                                    batch={"sequences": 8, "seq_len": 256, "microbatches": 2},
                                    strategy={"name": "llm_balance", "options": {"axis": "CP", "hybrid_cp": hybrid,
                                                                                 "broadcast": list(broadcast)}}))


def _check_step(spec, layout, got, docs, step):
    """got: rank -> that rank's numpy batch of `step`."""
    mesh = place_tree(spec).backbone
    names = spec.source_names()
    rpr = layout.rows_per_rank
    assert layout.hybrid_cp == mesh.cp
    where: dict[tuple[int, int, int], list[int]] = {}
    real = 0
    for r, b in got.items():
        assert int(b["step"]) == step
        real += int((b["source_ids"] >= 0).sum())
        for key in zip(b["segment_source"].tolist(), b["segment_key"].tolist(), b["segment_start"].tolist()):
            where.setdefault(key, []).append(r)
    assert real == int(layout.seg_len.sum()), "every planned token once across the ranks (padding aside)"
    for s, k, st, row, f, g in zip(layout.seg_source.tolist(), layout.seg_key.tolist(), layout.seg_start.tolist(),
                                   layout.seg_row.tolist(), layout.seg_cp_first.tolist(), layout.seg_cp_size.tolist()):
        want = sorted(int(mesh.rank_of(dp=row // rpr, cp=f + j)) for j in range(g))
        assert sorted(where.get((s, k, st), [])) == want, f"step {step}: piece {names[s]}/{k}@{st} at the plan's ranks"
    # per group: the trainer's view (client.cp_groups), merged over its ranks, is its documents in order
    seen_groups = set()
    for r, b in got.items():
        t = {n: torch.from_numpy(v) for n, v in b.items() if isinstance(v, np.ndarray)}
        for g in cp_groups(t):
            key = tuple(g["ranks"])
            assert r in key and key[g["cp_rank"]] == r and len(key) == g["cp_size"]
            if key in seen_groups:
                continue
            seen_groups.add(key)
            parts = []
            for member in key:
                sub = [x for x in cp_groups({n: torch.from_numpy(v) for n, v in got[member].items()
                                             if isinstance(v, np.ndarray)}) if tuple(x["ranks"]) == key]
                assert len(sub) == 1
                parts.append({n: (v[0].numpy() if n != "cu_seqlens" and n != "cp_token_index" else v.numpy())
                              for n, v in sub[0].items() if isinstance(v, torch.Tensor)})
            whole = cp_merge(parts, mode="document") if len(key) > 1 else parts[0]
            cu = np.asarray(whole["cu_seqlens"], np.int64)
            lo_doc = int(b["cp_group_docs"][[tuple(x) for x in zip(b["cp_group_first"].tolist(), b["cp_group_size"].tolist())]
                                            .index((int(mesh.coords_of(key[0]).cp), len(key)))])
            for i in range(len(cu) - 1):
                s, k, st, ln = (int(b[n][lo_doc + i]) for n in ("segment_source", "segment_key", "segment_start", "segment_len"))
                doc = docs[names[s]][int(key_row(k))]
                a = int(cu[i])
                assert np.array_equal(whole["input_ids"][a:a + ln], doc[st:st + ln]), f"step {step}: {names[s]}/{k}"
                assert np.array_equal(whole["labels"][a:a + ln - 1], doc[st + 1:st + ln])
                assert int(whole["labels"][a + ln - 1]) == (int(doc[st + ln]) if st + ln < len(doc) else -100)
                assert np.all(whole["source_ids"][a + ln:int(cu[i + 1])] == -1)
    return seen_groups


def _bytes(endpoint, world, steps):
    from mixplane.client import MixtureLoader

    total = 0
    for r in range(world):
        loader = MixtureLoader(endpoint, rank=r, max_steps=steps, timeout_s=120)
        for _ in loader:
            pass
        total += loader.received_bytes
        loader.close()
    return total / steps


def test_hybrid_delivery_exact_resume_and_replay(token_sources, tmp_path):
    sizes = {"dp": 2, "cp": 4}
    world = 8
    spec = _spec(token_sources["root"], sizes)
    with EmbeddedRuntime(spec, tmp_path / "full", log_level="WARNING") as rt:
        states: dict = {"at": 1}
        full = fetch(rt.planner_endpoint, world, STEPS, states=states)
    journal = tmp_path / "full" / "journal.jsonl"
    kinds = set()
    with ReplayLoaders() as loaders:
        for step in range(STEPS):
            plan = replan(journal, step, loaders)  # the journaled plan, digest checked (groups included)
            groups = _check_step(spec, plan.layout, {r: full[r][step] for r in range(world)}, token_sources["docs"], step)
            kinds |= {len(g) for g in groups}
    assert kinds >= {1, 2}, f"group sizes delivered: {sorted(kinds)}"  # whole documents and spread ones
    # resume from the state saved after step 1: the same tensors for steps 2.. on every rank
    with EmbeddedRuntime(spec, tmp_path / "resumed", log_level="WARNING") as rt:
        resumed = fetch(rt.planner_endpoint, world, STEPS, start=states["saved"])
    for r in range(world):
        assert [int(b["step"]) for b in resumed[r]] == list(range(2, STEPS))
        for a, b in zip(full[r][2:], resumed[r]):
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]), (r, int(a["step"]), k)
    # mixplane replay: the rank's tensors as delivered
    for rank, step in ((5, 2), (2, 3)):
        out = replay_step(spec, step=step, rank=rank, run_dir=str(tmp_path / "full"), save=str(tmp_path / f"r{rank}.npz"))
        assert out["digest_match"]
        saved = np.load(tmp_path / f"r{rank}.npz")
        for k in saved.files:
            assert np.array_equal(saved[k], full[rank][step][k]), (rank, step, k)
        assert {"input_ids", "cu_seqlens", "cp_group_ranks", "cp_group_size"} <= set(saved.files)
    # bytes per step beside the same run with the fixed CP scheme
    with EmbeddedRuntime(spec, tmp_path / "bytes", log_level="WARNING") as rt:
        hybrid_b = _bytes(rt.planner_endpoint, world, STEPS)
    with EmbeddedRuntime(_spec(token_sources["root"], sizes, hybrid=False), tmp_path / "fixed", log_level="WARNING") as rt:
        fixed_b = _bytes(rt.planner_endpoint, world, STEPS)
    print(f"\nhybrid DP x CP dp2 x cp4, 8 x 256 tokens: constructor -> clients {hybrid_b:.0f} B/step hybrid, "
          f"{fixed_b:.0f} B/step fixed CP")
    assert hybrid_b > 0 and fixed_b > 0


def _rank(rank, world, init, endpoint, tp_groups, q):
    import torch.distributed as dist

    from mixplane.client import MixtureLoader

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mine = None
        for ranks in tp_groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks)
            if rank in ranks:
                mine = g
        loader = MixtureLoader(endpoint, rank=rank, max_steps=STEPS, timeout_s=120, groups={"tp": mine})
        got = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
        q.put((rank, got, loader.received_bytes))
        loader.close()
    except BaseException as e:  # the parent names the failing rank
        q.put((rank, repr(e), 0))
        raise
    finally:
        dist.destroy_process_group()


def test_hybrid_delivery_with_tp_broadcast_over_gloo(token_sources, tmp_path):
    """dp 1 x cp 2 x tp 2 under broadcast_at('TP'): only tp = 0 gets tensors; the client broadcasts them to its TP
    peer, whose CP group's ranks stay its own (cp_group_ranks is per rank)."""
    sizes = {"dp": 1, "cp": 2, "tp": 2}
    world = 4
    spec = _spec(token_sources["root"], sizes, broadcast=("TP",))
    mesh = place_tree(spec).backbone
    tp_groups = sorted({tuple(int(x) for x in mesh.group("tp", r)) for r in range(world)})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with EmbeddedRuntime(spec, tmp_path / "run", log_level="WARNING") as rt:
        ps = [ctx.Process(target=_rank, args=(r, world, f"file://{tmp_path / 'pg'}", rt.planner_endpoint,
                                              [list(g) for g in tp_groups], q)) for r in range(world)]
        for p in ps:
            p.start()
        res = {}
        for _ in range(world):
            r, got, received = q.get(timeout=400)
            assert not isinstance(got, str), f"rank {r}: {got}"
            res[r] = (got, received)
        for p in ps:
            p.join(60)
    for r in range(world):  # a TP peer got from its constructor only its groups' ranks; the tokens came from tp 0
        if mesh.coords_of(r).tp:
            assert res[r][1] == sum(b["cp_group_ranks"].nbytes for b in res[r][0]), r
        else:
            assert res[r][1] > 100 * sum(b["cp_group_ranks"].nbytes for b in res[r][0]), r
    with ReplayLoaders() as loaders:
        for step in range(STEPS):
            plan = replan(Path(tmp_path / "run" / "journal.jsonl"), step, loaders)
            tp0 = {r: res[r][0][step] for r in range(world) if mesh.coords_of(r).tp == 0}
            _check_step(spec, plan.layout, tp0, token_sources["docs"], step)
            for r in range(world):
                c = mesh.coords_of(r)
                if c.tp == 0:
                    continue
                peer = int(mesh.rank_of(cp=c.cp, tp=0))
                mine, theirs = res[r][0][step], res[peer][0][step]
                for k in theirs:
                    if k in ("cp_group_ranks", "meta_only"):
                        continue
                    assert np.array_equal(mine[k], theirs[k]), (r, step, k)
                want = [int(mesh.rank_of(cp=int(f) + j, tp=1)) for f, g in zip(theirs["cp_group_first"], theirs["cp_group_size"])
                        for j in range(int(g))]
                assert mine["cp_group_ranks"].tolist() == want


def test_hybrid_delivery_over_pipeline_stages(token_sources, tmp_path):
    """dp 1 x cp 2 x pp 2: each stage gets its fields of its CP rank's parts (first stage the inputs, last the
    labels), the same documents and groups, and its own stage's group ranks."""
    sizes = {"dp": 1, "cp": 2, "pp": 2}
    spec = _spec(token_sources["root"], sizes)
    mesh = place_tree(spec).backbone
    with EmbeddedRuntime(spec, tmp_path / "run", log_level="WARNING") as rt:
        got = fetch(rt.planner_endpoint, 4, STEPS)
    with ReplayLoaders() as loaders:
        for step in range(STEPS):
            plan = replan(tmp_path / "run" / "journal.jsonl", step, loaders)
            merged = {}
            for c in range(2):
                first, last = (got[int(mesh.rank_of(cp=c, pp=p))][step] for p in (0, 1))
                assert "input_ids" in first and "labels" not in first and "labels" in last and "input_ids" not in last
                for k in ("cu_seqlens", "cp_group_size", "cp_group_first", "cp_group_docs", "segment_key"):
                    assert np.array_equal(first[k], last[k]), (step, c, k)
                for p, b in ((0, first), (1, last)):
                    want = [int(mesh.rank_of(cp=int(f) + j, pp=p)) for f, g in zip(b["cp_group_first"], b["cp_group_size"])
                            for j in range(int(g))]
                    assert b["cp_group_ranks"].tolist() == want
                merged[int(mesh.rank_of(cp=c, pp=0))] = {**last, **first}
            _check_step(spec, plan.layout, merged, token_sources["docs"], step)
