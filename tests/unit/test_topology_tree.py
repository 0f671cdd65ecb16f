"""ClientPlaceTree: coordinates and groups of every rank for several modules over one world."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mixplane.spec import ModuleSpec
from mixplane.topology import (ClientPlaceTree, ModuleMesh, backbone_coords, constructor_groups,
                               dp_ranks_of_group, rank_coords)

from .planner_helpers import make_spec

MEGATRON = ["tp", "cp", "dp", "pp"]


def mesh(tp=2, cp=2, dp=3, pp=2, order=MEGATRON, rank_map=None):
    return ModuleMesh("bb", "backbone", {"tp": tp, "cp": cp, "dp": dp, "pp": pp}, order, rank_map)


def test_default_order_is_megatron_rank_formula():
    m = mesh()
    TP, CP, DP = 2, 2, 3
    for pp, dp, cp, tp in itertools.product(range(2), range(3), range(2), range(2)):
        r = tp + TP * (cp + CP * (dp + DP * pp))
        c = m.coords_of(r)
        assert (c.dp, c.pp, c.cp, c.tp) == (dp, pp, cp, tp)
        assert m.rank_of(dp=dp, pp=pp, cp=cp, tp=tp) == r


def test_mesh_agrees_with_scalar_rank_coords_for_any_order():
    spec_mod = ModuleSpec(dp=3, pp=2, cp=2, tp=2)
    for order in (MEGATRON, ["dp", "tp", "pp", "cp"], ["pp", "cp", "tp", "dp"]):
        m = mesh(order=order)
        for r in range(m.world):
            assert m.coords_of(r) == rank_coords(spec_mod, order, r)


def test_groups_partition_the_world_along_each_axis():
    m = mesh()
    for axis in ("tp", "cp", "dp", "pp"):
        g = m.groups(axis)
        assert g.shape == (m.world // m.sizes[axis], m.sizes[axis])
        assert sorted(g.reshape(-1).tolist()) == list(range(m.world))
        for row in g:
            cs = [m.coords_of(int(r)) for r in row]
            assert [getattr(c, axis) for c in cs] == list(range(m.sizes[axis]))
            others = {tuple(getattr(c, a) for a in ("dp", "pp", "cp", "tp") if a != axis) for c in cs}
            assert len(others) == 1
        assert m.group(axis, 5).tolist() == g[[5 in row for row in g.tolist()].index(True)].tolist()


def test_consumers_of_each_distribution_axis():
    m = mesh()
    dp_idx = m.consumer_index("DP")
    assert np.array_equal(dp_idx, m.coord["dp"]) and m.consumers("DP") == 3
    cp_idx = m.consumer_index("CP")
    assert m.consumers("CP") == 6 and set(cp_idx.tolist()) == set(range(6))
    for i in range(6):
        ranks = m.consumer_ranks("CP", i)
        assert len(ranks) == m.pp * m.tp  # pp stages and tp peers share a CP consumer's data
        assert len({(m.coords_of(int(r)).dp, m.coords_of(int(r)).cp) for r in ranks}) == 1
    lead = m.consumer_leader("DP")
    assert lead.tolist() == [int(m.consumer_ranks("DP", d).min()) for d in range(3)]
    with pytest.raises(ValueError, match="unknown distribution axis"):
        m.consumer_index("TP")


def test_encoder_with_world_wide_dp_next_to_a_4d_backbone():
    spec = make_spec(dp=2, pp=2, cp=2, tp=2, encoder=True, rows=8, microbatches=2)
    tree = ClientPlaceTree.from_spec(spec)
    assert tree.world == 16 and tree.encoder is not None
    assert np.array_equal(tree.encoder.consumer_index("WORLD"), np.arange(16))
    assert tree.backbone.consumers("DP") == 2 and tree.image_module is tree.encoder
    per = tree.all_coords(13)
    assert per["encoder"].dp == 13 and per["backbone"].as_dict() == backbone_coords(spec, 13).as_dict()
    # without balancing, a replica's images stay on that replica's own ranks
    for d in range(2):
        own = set(np.nonzero(tree.backbone.coord["dp"] == d)[0].tolist())
        assert set(tree.vanilla_image_consumers(d).tolist()) == own


def test_broadcast_leaves_only_coordinate_zero_fetching():
    m = mesh()
    tp_only = m.fetchers(["tp"])
    assert tp_only.sum() == m.world // m.tp and np.all(m.coord["tp"][tp_only] == 0)
    both = m.fetchers(["tp", "cp"])
    assert both.sum() == m.world // (m.tp * m.cp)
    with pytest.raises(ValueError, match="cannot broadcast"):
        m.fetchers(["xx"])


def test_constructor_groups_per_dp_group_and_per_node():
    spec = make_spec(dp=3, pp=2, tp=2, rows=6, microbatches=1)
    groups = constructor_groups(spec)
    assert len(groups) == 3 and sorted(sum(groups, [])) == list(range(12))
    for d, g in enumerate(groups):
        assert {backbone_coords(spec, r).dp for r in g} == {d}
        assert dp_ranks_of_group(spec, g) == [d]
    node = make_spec(dp=3, pp=2, tp=2, rows=6, microbatches=1, constructors="per_node")
    tree = ClientPlaceTree.from_spec(node, {"ranks_per_node": 4})
    assert tree.constructor_groups() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert np.array_equal(tree.constructor_of_rank, np.repeat([0, 1, 2], 4))


def test_overrides_order_rank_map_and_explicit_groups():
    spec = make_spec(dp=2, tp=2, rows=4, microbatches=1)
    base = ClientPlaceTree.from_spec(spec)
    swapped = ClientPlaceTree.from_spec(spec, {"order": ["dp", "tp", "cp", "pp"]})
    assert base.coords(1).tp == 1 and swapped.coords(1).dp == 1
    rmap = [3, 2, 1, 0]
    mapped = ClientPlaceTree.from_spec(spec, {"rank_map": rmap})
    for logical in range(4):
        assert mapped.coords(rmap[logical]).as_dict() | {"rank": logical} == base.coords(logical).as_dict()
    explicit = ClientPlaceTree.from_spec(spec, {"constructors": [[0, 3], [1, 2]]})
    assert explicit.constructor_groups() == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="cover every rank"):
        ClientPlaceTree.from_spec(spec, {"constructors": [[0, 1]]})
    with pytest.raises(ValueError, match="permutation"):
        ClientPlaceTree.from_spec(spec, {"rank_map": [0, 0, 1, 2]})
    with pytest.raises(ValueError, match="unknown module"):
        ClientPlaceTree.from_spec(spec, {"modules": {"vision": {"order": MEGATRON}}})



def test_user_function_override_from_the_spec(tmp_path, monkeypatch):
    mod = tmp_path / "my_tree.py"
    mod.write_text("def wide(tree):\n    return tree.with_overrides(broadcast=('tp', 'cp'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = make_spec(dp=2, tp=2, cp=2, rows=4, microbatches=1, options={"place_tree": {"function": "my_tree:wide"}})
    tree = ClientPlaceTree.from_spec(spec)
    assert tree.broadcast == ("tp", "cp") and tree.fetchers().sum() == 2


def test_rebuild_is_cached_and_follows_topology_changes():
    a = make_spec(dp=2, tp=2, rows=4, microbatches=1)
    b = make_spec(dp=4, tp=1, rows=4, microbatches=1)
    assert ClientPlaceTree.from_spec(a) is ClientPlaceTree.from_spec(a)
    tb = ClientPlaceTree.from_spec(b)
    assert tb.backbone.dp == 4 and tb.world == 4 and tb is not ClientPlaceTree.from_spec(a)


def test_large_world_is_built_vectorised():
    m = ModuleMesh("bb", "backbone", {"tp": 8, "cp": 4, "dp": 64, "pp": 8}, MEGATRON)
    assert m.world == 16384
    assert m.groups("tp").shape == (2048, 8) and m.consumers("CP") == 256
    assert m.coords_of(16383).as_dict() == {"rank": 16383, "dp": 63, "pp": 7, "cp": 3, "tp": 7}


def test_modules_must_share_one_world():
    a = ModuleMesh("bb", "backbone", {"dp": 4}, MEGATRON)
    b = ModuleMesh("enc", "encoder", {"dp": 8}, MEGATRON)
    with pytest.raises(ValueError, match="world size"):
        ClientPlaceTree({"bb": a, "enc": b})
    with pytest.raises(ValueError, match="exactly one backbone"):
        ClientPlaceTree({"enc": ModuleMesh("enc", "encoder", {"dp": 4}, MEGATRON)})


def test_describe_names_every_module():
    tree = ClientPlaceTree.from_spec(make_spec(dp=2, pp=2, tp=2, encoder=True, rows=4, microbatches=2))
    text = tree.describe()
    assert "backbone (backbone)" in text and "encoder (encoder)" in text and "world 8 ranks" in text
