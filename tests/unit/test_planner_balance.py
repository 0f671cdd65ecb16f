"""Vectorised greedy (LPT) and Karmarkar-Karp balancers: every item placed once, counts, quality, init loads."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane.planner import balance as B


def heavy(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    L = np.minimum(16384, rng.pareto(1.1, n) * 300 + 8)
    return L * 1e6 + L * L * 300.0  # linear + quadratic, like backbone FLOPs


def loads(a, c, k):
    return np.bincount(a, weights=c, minlength=k)


@pytest.mark.parametrize("method", ["greedy", "karmarkar_karp"])
@pytest.mark.parametrize("n,k", [(2592, 18), (20000, 9), (5000, 1152)])
def test_equal_count_is_exact_and_balanced(method, n, k):
    c = heavy(n)
    a = B.assign(c, k, method, equal_count=True)
    cnt = np.bincount(a, minlength=k)
    assert cnt.max() - cnt.min() <= 1 and cnt.sum() == n
    naive = B.assign(c, k, "none", equal_count=True)
    assert B.imbalance(loads(a, c, k)) < B.imbalance(loads(naive, c, k))
    # with few items per bin the largest item bounds what any assignment can do
    bound = max(c.max(), c.sum() / k) / (c.sum() / k)
    assert B.imbalance(loads(a, c, k)) <= max(1.02, 1.02 * bound)
    smooth = np.random.default_rng(1).lognormal(0, 1, n)
    s = B.assign(smooth, k, method, equal_count=True)
    if n // k >= 100:
        assert B.imbalance(loads(s, smooth, k)) < 1.005  # the swap refinement stops below 0.5% spread


@pytest.mark.parametrize("method", ["greedy", "karmarkar_karp"])
def test_free_count_balances_heavy_tails(method):
    c = heavy(100_000, seed=3)
    k = 1152
    a = B.assign(c, k, method)
    assert a.min() >= 0 and a.max() < k
    assert B.imbalance(loads(a, c, k)) < 1.01
    assert B.imbalance(loads(B.assign(c, k, "none"), c, k)) > 1.2


@pytest.mark.parametrize("method", ["greedy", "karmarkar_karp"])
def test_a_huge_item_gets_a_bin_to_itself(method):
    c = np.array([10.0, 1, 1, 1])
    a = B.assign(c, 2, method)
    assert sorted(loads(a, c, 2).tolist()) == [3.0, 10.0]


def brute_force(c: np.ndarray, k: int) -> float:
    best = np.inf
    for combo in itertools.product(range(k), repeat=len(c)):
        best = min(best, loads(np.array(combo), c, k).max())
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=7), st.integers(2, 3))
def test_small_instances_within_lpt_bound_of_optimum(values, k):
    c = np.array(values, dtype=np.float64)
    opt = brute_force(c, k)
    for method in ("greedy", "karmarkar_karp"):
        a = B.assign(c, k, method)
        assert loads(a, c, k).max() <= (4 / 3) * opt + 1e-9, (method, values, k)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(0.0, 1e6, allow_nan=False), min_size=0, max_size=400), st.integers(1, 40),
       st.booleans(), st.sampled_from(["greedy", "karmarkar_karp", "none"]), st.sampled_from([None, 2, 3]))
def test_every_item_lands_in_one_valid_bin(values, k, equal, method, group):
    c = np.array(values, dtype=np.float64)
    a = B.assign(c, k, method, equal_count=equal, group_size=group)
    assert a.shape == c.shape and (len(a) == 0 or (a.min() >= 0 and a.max() < k))
    if equal and len(c):
        cnt = np.bincount(a, minlength=k)
        assert cnt.max() - cnt.min() <= 1


@pytest.mark.parametrize("method", ["greedy", "karmarkar_karp"])
@pytest.mark.parametrize("n", [40, 3000, 200_000])
def test_initial_loads_are_compensated(method, n):
    rng = np.random.default_rng(7)
    k = 8
    c = rng.random(n) + 0.5
    init = np.zeros(k)
    init[0] = c.sum() / k  # bin 0 is already a full bin's worth busy
    a = B.assign(c, k, method, init=init)
    total = loads(a, c, k) + init
    assert B.imbalance(total) < 1.05
    assert loads(a, c, k)[0] < loads(a, c, k)[1:].min()


def test_equal_count_kk_with_init_pins_bins():
    # many items per bin: the batched BLDM path; the initial load must stay on its own bin
    rng = np.random.default_rng(1)
    k = 4
    c = rng.random(4000) + 1
    init = np.array([0.0, 0.0, 500.0, 0.0])
    a = B.assign(c, k, "karmarkar_karp", equal_count=True, init=init)
    assert np.bincount(a, minlength=k).tolist() == [1000] * 4
    assert loads(a, c, k)[2] == loads(a, c, k).min()


def test_group_size_balances_within_groups():
    c = heavy(6000, seed=5)
    a = B.assign(c, 12, "greedy", group_size=4)
    assert B.imbalance(loads(a, c, 12)) < 1.02
    e = B.assign(c, 12, "greedy", equal_count=True, group_size=4)
    assert np.bincount(e, minlength=12).tolist() == [500] * 12


def test_deterministic():
    c = heavy(50_000, seed=9)
    for m in ("greedy", "karmarkar_karp"):
        assert np.array_equal(B.assign(c, 97, m), B.assign(c, 97, m))
        assert np.array_equal(B.assign(c, 97, m, equal_count=True), B.assign(c, 97, m, equal_count=True))


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="finite"):
        B.assign(np.array([1.0, np.nan]), 2)
    with pytest.raises(ValueError, match="unknown balance method"):
        B.assign(np.ones(3), 2, "random")
    with pytest.raises(ValueError, match="n_bins"):
        B.assign(np.ones(3), 0)
    with pytest.raises(ValueError, match="one load per bin"):
        B.assign(np.ones(3), 2, init=np.ones(3))


def test_desc_order_large_arrays_is_descending_up_to_key_resolution():
    c = heavy(100_000, seed=2)
    o = B.desc_order(c)
    assert sorted(o.tolist()) == list(range(len(c)))
    s = c[o]
    assert np.all(s[1:] <= s[:-1] * (1 + 1e-3))


def test_slots_in_bins():
    bins = np.array([2, 0, 2, 1, 0, 2])
    assert B.slots_in_bins(bins, 3).tolist() == [0, 0, 1, 0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=1, max_size=300), st.integers(0, 10_000))
def test_pack_balanced_respects_capacity_and_places_everything(lengths, seed):
    L = np.array(lengths)
    S = 512
    rows = int(np.ceil(L.sum() / S * 1.15)) + 1
    cost = L * 10.0 + L.astype(float) ** 2
    r = B.pack_balanced(L, cost, rows, S)
    if r is None:
        return  # allowed: the caller keeps a packing known to be feasible
    assert r.min() >= 0 and r.max() < rows
    assert np.bincount(r, weights=L, minlength=rows).max() <= S


def test_pack_balanced_spreads_long_documents():
    L = np.array([4000] * 8 + [100] * 320)
    rows = 8 + 4
    r = B.pack_balanced(L, L * 1.0 + L.astype(float) ** 2 / 100, rows, 8192)
    assert r is not None
    long_rows = r[:8]
    assert len(set(long_rows.tolist())) == 8  # one long document per row
    assert B.pack_balanced(L, L * 1.0, 2, 8192) is None  # does not fit


def _free_problem(rng):
    n = int(rng.integers(1, 5000))
    kind = int(rng.integers(0, 4))
    if kind == 0:
        costs = rng.pareto(1.2, n) + 1e-3  # heavy tail: native-resolution images
    elif kind == 1:
        costs = rng.integers(1, 4, n).astype(np.float64)  # ties everywhere
    elif kind == 2:
        costs = np.where(rng.random(n) < 0.1, 0.0, rng.lognormal(0, 1.5, n))  # zero-cost items
    else:
        costs = rng.lognormal(0, 0.3, n)
    n_bins = int(rng.integers(1, 2000))
    init = rng.random(n_bins) * float(costs.mean()) * int(rng.integers(1, 6)) if rng.random() < 0.4 else None
    return costs, n_bins, init


@pytest.mark.parametrize("seed", range(60))
def test_open_rounds_one_group_path_equals_the_general_rounds(seed, monkeypatch):
    """assign() in free count with the one-group rounds and with the general rounds: the same bin for every
    item (greedy and karmarkar_karp, with and without initial loads, with groups of bins too)."""
    from mixplane.planner import balance

    rng = np.random.default_rng(500 + seed)
    costs, n_bins, init = _free_problem(rng)
    method = "karmarkar_karp" if seed % 5 == 4 else "greedy"
    group_size = int(rng.integers(2, 50)) if seed % 3 == 2 else None
    got = balance.assign(costs, n_bins, method, init=init, group_size=group_size)
    monkeypatch.setattr(balance, "_lpt_open_rounds", balance.lpt_open_rounds_groups)
    want = balance.assign(costs, n_bins, method, init=init, group_size=group_size)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("seed", range(40))
def test_open_rounds_one_group_state(seed):
    """The rounds alone, one group: same bins, same loads, same items left, over 1 to 70 rounds."""
    from mixplane.planner import balance

    rng = np.random.default_rng(seed)
    costs, n_bins, init = _free_problem(rng)
    items = np.flatnonzero(rng.random(len(costs)) < 0.8)
    loads0 = np.zeros(n_bins) if init is None else init
    target = np.array([(costs[items].sum() + loads0.sum()) / n_bins])
    zg, bg = np.zeros(len(costs), np.int64), np.zeros(n_bins, np.int64)
    rounds = int(rng.integers(1, 70))
    la, lb = loads0.copy(), loads0.copy()
    oa, ob = np.full(len(costs), -1, np.int64), np.full(len(costs), -1, np.int64)
    left_a = balance._lpt_open_rounds(costs, items, zg, bg, la, oa, target, rounds)
    left_b = balance.lpt_open_rounds_groups(costs, items, zg, bg, lb, ob, target, rounds)
    assert np.array_equal(oa, ob) and np.array_equal(left_a, left_b) and np.array_equal(la, lb)
