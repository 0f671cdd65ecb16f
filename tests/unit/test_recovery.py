"""planner.recovery (pure): what a restarted planner reads from its journal; runtime.pinned."""

from __future__ import annotations

import pytest

from mixplane.launch import Component
from mixplane.planner.journal import JournalError
from mixplane.planner.recovery import LayoutRecord, cursor_generation, read_state
from mixplane.runtime import pinned


def cur(step: int, gen: int = 0) -> dict:
    return {"step": step, "windows": [], "sampler": {}, "schedule": {"segments": [{"generation": g} for g in range(gen + 1)]}}


def journal() -> list[dict]:
    return [
        {"event": "open", "session": 0, "step": 0, "seed": 7, "spec": {"name": "m"}, "cursor": cur(0)},
        {"event": "checkpoint", "session": 0, "step": 0, "cursor": cur(0)},
        *({"event": "step", "session": 0, "step": s, "digest": f"d{s}"} for s in range(0, 5)),
        {"event": "checkpoint", "session": 0, "step": 5, "cursor": cur(5)},
        {"event": "step", "session": 0, "step": 5, "digest": "d5"},
        {"event": "update", "session": 0, "generation": 1, "effective_step": 9, "planned_through": 5, "weights": {}},
        *({"event": "step", "session": 0, "step": s, "digest": f"d{s}"} for s in range(6, 9)),
    ]


def test_state_of_a_session_and_the_anchor_before_the_first_missing_step():
    st = read_state(journal())
    assert st is not None and st.session == 0 and st.planned_through == 8
    assert st.digests[7] == "d7" and st.session_start["step"] == 0
    assert st.anchor(7).step == 5 and st.anchor(5).step == 5 and st.anchor(4).step == 0
    assert st.anchor(4).event == "checkpoint"  # the newest anchor of step 0 (after the open record)
    # the update arrived after step 5 was planned: applied again before step 6 unless the cursor holds it
    assert [(at, u["generation"]) for at, u in st.updates_after(0)] == [(6, 1)]
    assert st.updates_after(1) == []


def test_a_recover_record_continues_the_session_and_a_resume_starts_a_new_one():
    recs = journal() + [{"event": "recover", "session": 0, "step": 5, "planned_through": 8, "cursor": cur(5)},
                        {"event": "step", "session": 0, "step": 5, "digest": "d5"}]
    st = read_state(recs)
    assert st is not None and st.planned_through == 8 and st.anchor(9).event == "recover"
    recs.append({"event": "resume", "session": 1, "step": 3, "cursor": cur(3)})
    st = read_state(recs)
    assert st is not None and st.session == 1 and st.planned_through == 2 and [a.step for a in st.anchors] == [3]
    with pytest.raises(JournalError, match="no cursor of session 1 at or before step 2"):
        st.anchor(2)
    assert read_state([]) is None


def test_cursor_generation():
    assert cursor_generation(cur(0, 3)) == 3 and cursor_generation({}) == 0


def test_layout_record_is_bounded_released_and_replaced_when_replanned():
    rec = LayoutRecord(max_steps=3)
    for s in range(5):
        rec.record(s, {0: ({"s": s}, {}), 1: ({"s": s}, {})})
    assert [s for s, _ in rec.steps] == [2, 3, 4] and rec.overflowed == 2 and rec.first_step == 2
    rec.record(3, {0: ({"again": 3}, {})})  # re-planned after a planner restart
    assert [s for s, _ in rec.steps] == [2, 3] and rec.for_constructor(1) == [(2, ({"s": 2}, {}))]
    rec.release(2)
    assert rec.for_constructor(0) == [(3, ({"again": 3}, {}))]


def test_a_restarted_component_binds_the_endpoints_of_its_first_incarnation():
    planner = Component("planner", "planner", ("planner", "--bind", "tcp://127.0.0.1:*", "--run-dir", "/r"))
    assert pinned(planner, {"endpoint": "tcp://127.0.0.1:4242"}).args == ("planner", "--bind", "tcp://127.0.0.1:4242",
                                                                          "--run-dir", "/r")
    con = Component("constructor", "constructor-0", ("constructor", "--index", "0"))
    got = pinned(con, {"data_endpoint": "tcp://127.0.0.1:5001", "client_endpoint": "tcp://127.0.0.1:5002"}).args
    assert got == ("constructor", "--index", "0", "--data-port", "5001", "--client-port", "5002")
    fixed = Component("constructor", "constructor-0", ("constructor", "--data-port", "7", "--client-port", "8"))
    assert pinned(fixed, {"data_endpoint": "tcp://h:7", "client_endpoint": "tcp://h:8"}).args == fixed.args
    loader = Component("loader", "loader-a-0", ("loader", "--source", "a"))
    assert pinned(loader, {}).args == loader.args
