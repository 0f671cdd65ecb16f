"""The reshard control kind: admin only, schema checked; replay picks the topology in force at a step."""

from __future__ import annotations

import json

import pytest

from mixplane import protocol
from mixplane.planner.journal import Journal
from mixplane.planner.core import StepPlanner
from mixplane.replay import spec_at
from mixplane.wire import Kind, Message, WireError

from .planner_helpers import make_spec


def test_only_the_admin_may_reshard():
    assert Kind.RESHARD in protocol.CONTROL_KINDS
    assert protocol.allowed(Kind.RESHARD, protocol.ADMIN)
    for role in (protocol.CLIENT, protocol.COMPONENT, protocol.ANONYMOUS):
        assert not protocol.allowed(Kind.RESHARD, role)
    assert protocol.allowed(Kind.RESHARD, protocol.ANONYMOUS, open_run=False) is False
    with pytest.raises(WireError, match="topology"):
        protocol.check(Message(Kind.RESHARD, {"cursor": {}}))
    protocol.check(Message(Kind.RESHARD, {"topology": {}, "reshard_id": "ns/m/topology-2"}))  # by id: no cursor


def test_spec_at_follows_a_journaled_reconfigure(tmp_path):
    a, b = make_spec(dp=2), make_spec(dp=4)
    planner = StepPlanner(a)
    path = tmp_path / "journal.jsonl"
    with Journal(path, every=5) as j:
        j.open(a, 0, planner.cursor())
        cur = dict(planner.cursor(), step=7)
        j.spec_change(b, 1, 7, 6, mode="reconfigure")
        j.resume(cur, 1)
        j._write({"event": "step", "step": 7, "session": 1, "digest": "x"})
    assert json.loads(path.read_text().splitlines()[1])["mode"] == "reconfigure"
    assert spec_at(path, 3, a).topology.backbone()[1].dp == 2
    assert spec_at(path, 7, a).topology.backbone()[1].dp == 4
    assert spec_at(path, 9, a).topology.backbone()[1].dp == 4
    assert spec_at(tmp_path / "missing.jsonl", 9, a) is a
