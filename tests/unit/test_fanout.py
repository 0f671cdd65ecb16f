"""Selective broadcast on CP, PP and TP (pure part): what each rank receives under broadcast_at, fanned out the
way the client does it, is exactly what it receives without the broadcast — for every rank, every combination
of axes, both CP layouts and a hook's extra token field; only coordinate-0 ranks get tensors from the constructor."""

import itertools

import numpy as np
import pytest

from mixplane.parallelism import (META_ONLY, BroadcastError, broadcast_axes, bytes_per_step, fanout_meta,
                                  fanout_options, holds_whole, narrow, rank_view, receive_axis, serves, view_key)
from mixplane.topology import ModuleMesh

AXES = ("cp", "pp", "tp")


def _batch(rows=2, S=48, seed=0, extra=False):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, size=(rows, S)).astype(np.int32)
    b = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1), "position_ids": np.tile(np.arange(S, dtype=np.int32), (rows, 1)),
         "source_ids": rng.integers(0, 3, size=(rows, S)).astype(np.int16), "loss_mask": (ids % 3 > 0),
         "cu_seqlens": np.arange(0, rows * S + 1, S, dtype=np.int32), "cu_seqlens_mb": np.array([0, rows], np.int32),
         "max_seqlen": S, "step": 7, "lr_scale": 1.0}
    if extra:
        b["doc_start"] = (b["position_ids"] == 0).astype(np.int8)
    return b


def _thd_batch(cp, seed=0):
    rng = np.random.default_rng(seed)
    lens = (rng.integers(1, 6, size=5) * 2 * cp).astype(np.int64)
    ids = rng.integers(0, 1000, size=int(lens.sum())).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return {"input_ids": ids, "labels": np.roll(ids, -1), "cu_seqlens": cu, "max_seqlen": int(lens.max()), "step": 3}


def _arrays(v):
    return {k: x for k, x in v.items() if isinstance(x, np.ndarray)}


def simulate(batch, *, cp, pp, tp, axes, cp_mode="row", extra=()):
    """Every rank's tensors after the fan-out, run as client.fan_out runs it (numpy instead of torch)."""
    coords = [dict(cp=c, pp=p, tp=t) for p in range(pp) for c in range(cp) for t in range(tp)]
    key = lambda c: (c["cp"], c["pp"], c["tp"])  # noqa: E731
    msgs = {key(c): rank_view(batch, cp=cp, cp_rank=c["cp"], pp=pp, pp_stage=c["pp"], tp_rank=c["tp"], broadcast_at=axes,
                              cp_mode=cp_mode, extra_token_fields=extra) for c in coords}
    opts = fanout_options(fanout_meta(broadcast_axes(axes), cp=cp, pp=pp, cp_mode=cp_mode,
                                      seq_len=batch["input_ids"].shape[-1], token_fields=extra))
    held = {k: (None if m.get(META_ONLY) else _arrays(m)) for k, m in msgs.items()}
    for a in broadcast_axes(axes):
        size = {"cp": cp, "pp": pp, "tp": tp}[a]
        for c in coords:
            if not serves(a, c, broadcast_axes(axes)) or c[a] != 0:
                continue
            mine = held[key(c)]
            assert mine is not None, f"{c} sends along {a} before it holds data"
            for j in range(1, size):
                peer = key({**c, a: j})
                part = _arrays(narrow(mine, a, j, **opts))
                want = msgs[peer]["shapes"]  # the receive buffers its metadata allocated
                assert {k: [str(v.dtype), list(v.shape)] for k, v in part.items()} == want, (c, a, j)
                assert held[peer] is None, f"{peer} receives twice"
                held[peer] = part
            held[key(c)] = _arrays(narrow(mine, a, 0, **opts))
    return msgs, held


@pytest.mark.parametrize("axes", [s for n in range(1, 4) for s in itertools.combinations(("TP", "PP", "CP"), n)],
                         ids=lambda s: "+".join(s))
@pytest.mark.parametrize("extra", [(), ("doc_start",)], ids=["plain", "hook-field"])
def test_every_rank_ends_with_the_view_it_gets_without_broadcast(axes, extra):
    cp, pp, tp = 2, 3, 2
    b = _batch(extra=bool(extra))
    msgs, held = simulate(b, cp=cp, pp=pp, tp=tp, axes=axes, extra=extra)
    for (c, p, t), got in held.items():
        want = rank_view(b, cp=cp, cp_rank=c, pp=pp, pp_stage=p, tp_rank=t, extra_token_fields=extra)
        assert got is not None and set(got) == set(_arrays(want)), (c, p, t)
        for k, v in _arrays(want).items():
            assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (c, p, t, k)
        scalars = {k: v for k, v in msgs[(c, p, t)].items() if not isinstance(v, np.ndarray) and k not in ("shapes", META_ONLY)}
        assert scalars == {k: v for k, v in want.items() if not isinstance(v, np.ndarray) and k != "shapes"}
    mesh = ModuleMesh("backbone", "backbone", {"cp": cp, "pp": pp, "tp": tp}, ("tp", "cp", "dp", "pp"))
    fetch = mesh.fetchers([a.lower() for a in axes])
    for r in range(mesh.world):  # the constructor sends tensors to exactly topology.fetchers' ranks
        co = mesh.coords_of(r)
        assert (not msgs[(co.cp, co.pp, co.tp)].get(META_ONLY)) == bool(fetch[r])


def test_document_layout_fans_out_exactly_too():
    b = _thd_batch(cp=2)
    msgs, held = simulate(b, cp=2, pp=2, tp=1, axes=("CP", "PP"), cp_mode="document")
    for (c, p, t), got in held.items():
        want = rank_view(b, cp=2, cp_rank=c, pp=2, pp_stage=p, cp_mode="document")
        assert all(np.array_equal(got[k], v) for k, v in _arrays(want).items()) and set(got) == set(_arrays(want))
        assert msgs[(c, p, t)]["max_seqlen"] == want["max_seqlen"]  # the rank's own scalars, not the whole's


def test_the_fetcher_of_a_cp_and_pp_group_holds_the_whole_sequence_and_every_stages_fields():
    b = _batch()
    v = rank_view(b, cp=2, cp_rank=0, pp=2, pp_stage=0, broadcast_at=["CP", "PP"])
    assert v["input_ids"] is b["input_ids"] and "labels" in v and "cp_token_index" not in v
    last = rank_view(b, cp=2, cp_rank=1, pp=2, pp_stage=1, broadcast_at=["CP", "PP"])
    assert last[META_ONLY] and set(last["shapes"]) == {"labels", "source_ids", "loss_mask", "cu_seqlens",
                                                       "cu_seqlens_mb", "cp_token_index"}
    # the PP receiver that still serves nothing, the CP receiver that serves its PP group
    assert receive_axis({"cp": 1, "pp": 1, "tp": 0}, ("cp", "pp")) == "pp"
    assert receive_axis({"cp": 1, "pp": 0, "tp": 0}, ("cp", "pp")) == "cp"
    assert holds_whole("pp", {"cp": 1, "pp": 0, "tp": 0}, ("cp", "pp"))
    assert not serves("cp", {"cp": 1, "pp": 1, "tp": 0}, ("cp", "pp"))
    assert view_key(0, 0, 2, 0, ["cp", "pp"]) != view_key(0, 0, 2, 0, ["tp"])


def test_middle_stages_are_cut_by_cp_without_a_token_field():
    b = _batch()
    mid = narrow(rank_view(b, cp=1, pp=3, pp_stage=1), "cp", 1, cp=2, pp=3, seq_len=48)
    assert mid["cp_token_index"].tolist() == list(range(12, 36))
    with pytest.raises(ValueError, match="no token field"):
        narrow(rank_view(b, cp=1, pp=3, pp_stage=1), "cp", 1, cp=2, pp=3)


def test_dp_and_unknown_axes_are_refused():
    with pytest.raises(BroadcastError, match="DP replicas receive different data"):
        broadcast_axes(["TP", "DP"])
    with pytest.raises(BroadcastError, match="cannot broadcast along 'ep'"):
        broadcast_axes(["ep"])
    assert broadcast_axes(["TP", "cp", "Pp"]) == ("cp", "pp", "tp")


def test_constructor_bytes_and_messages_per_step():
    b = _batch(rows=4, S=64)
    coords = [(c, p, t) for p in range(4) for c in range(2) for t in range(2)]
    none = bytes_per_step(b, coords, cp=2, pp=4)
    tp = bytes_per_step(b, coords, cp=2, pp=4, broadcast_at=["TP"])
    all3 = bytes_per_step(b, coords, cp=2, pp=4, broadcast_at=["TP", "PP", "CP"])
    assert none[1] == 16 and tp[1] == 8 and all3[1] == 1
    assert none[0] > tp[0] > all3[0]
    # the one fetcher receives the DP batch's tensors, nothing more
    assert all3[0] == sum(v.nbytes for v in _arrays(b).values())
