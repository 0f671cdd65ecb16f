"""Every shuffle mode delivers exactly the orders recorded before the stream was split into
policies (tests/unit/stream_orders.py says how they were recorded): same seed, same rows, same data."""

import json

import pytest

from tests.unit.stream_orders import CASES, RECORD, make_sources, run_case


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(str(tmp_path_factory.mktemp("orders")))


@pytest.fixture(autouse=True)
def _no_index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


with open(RECORD) as _f:
    RECORDED = json.load(_f)


def test_every_case_was_recorded():
    assert sorted(RECORDED) == sorted(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_order_equals_the_recorded_order(sources, name):
    got = run_case(sources, name)
    want = RECORDED[name]
    assert got["first_keys"] == want["first_keys"]
    assert got["n"] == want["n"]
    assert got["sha256"] == want["sha256"], f"{name}: the delivered sequence (keys, positions or data) changed"


def test_one_policy_per_shuffle_mode_of_the_spec():
    import typing

    from mixplane.loader.policies import POLICIES, OrderKey, policy_for
    from mixplane.spec import SourceSpec

    modes = typing.get_args(SourceSpec.model_fields["shuffle"].annotation)
    assert sorted(POLICIES) == sorted(modes)
    for m in modes:
        assert policy_for(m, OrderKey(1, "s")).mode == m
    with pytest.raises(ValueError, match="unknown shuffle mode 'zigzag'"):
        policy_for("zigzag", OrderKey(1, "s"))
