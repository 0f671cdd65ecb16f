"""The run's pinned listing of a static source: the planner pins the first listing a loader says in HELLO (or the one
of a cursor it resumes from), journals it and keeps it in its cursor; a loader of another listing is told to reopen
its stream with the run's, one reading it in another order (lazy_index_files / block_files) is refused."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zmq

from mixplane import wire
from mixplane.planner import journal
from mixplane.planner.recovery import read_state
from mixplane.planner.server import PlannerServer
from mixplane.protocol import (REFUSAL_MAX_CHARS, ListingPin, listing_not_kept, listing_verdict, order_refusal,
                               parse_listing_pins, parse_refusal)
from mixplane.spec import parse_spec
from mixplane.wire import Kind, WireError

A = ListingPin("0123456789abcdef", 12, "pages")
B = ListingPin("fedcba9876543210", 13, "pages")


def test_verdict_of_a_hello():
    assert listing_verdict(None, A) == "pin"  # the first listing of a new run is the run's
    assert listing_verdict(A, A) == "ok"
    assert listing_verdict(A, None) == "ok"  # a live source, an older loader: nothing to check
    assert listing_verdict(A, B) == "reopen"  # files added or removed since: the run's kept listing
    assert listing_verdict(A, ListingPin(A.digest, 12, "blocks:64")) == "refuse"


def test_refusal_names_the_spec_fields_and_both_orders():
    why = order_refusal("web", ListingPin(A.digest, 12, "blocks:64"), A)
    assert "'web'" in why and "lazy_index_files" in why and "block_files" in why
    assert "'pages'" in why and "'blocks:64'" in why and A.digest in why and "12 files" in why


def test_pin_forms_and_bad_input():
    assert ListingPin.parse(A.to_json()) == A == ListingPin.parse(A.text())
    assert ListingPin.parse(None) is None
    for bad in ({"digest": "xyz", "files": 1, "order": "pages"}, {"digest": A.digest, "files": -1, "order": "pages"},
                {"digest": A.digest, "files": 1}, "nonsense", 7):
        with pytest.raises(WireError, match="listing is malformed"):
            ListingPin.parse(bad)
    assert parse_listing_pins({"1": B.text()}, 2) == {1: B}
    with pytest.raises(ValueError, match="source 5"):
        parse_listing_pins({"5": B.text()}, 2)


@pytest.fixture()
def spec(tmp_path):
    rows = [list(range(1, 1 + n)) for n in range(3, 40)]
    pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}), tmp_path / "s.parquet")
    return parse_spec({"name": "pin", "batch": {"sequences": 2, "seq_len": 32},
                       "sources": [{"name": "s", "uri": str(tmp_path / "s.parquet"), "kind": "tokens", "columns": ["tokens"]},
                                   {"name": "t", "uri": str(tmp_path / "s.parquet"), "kind": "tokens", "columns": ["tokens"]}],
                       "topology": {"modules": {"backbone": {"dp": 1}}}, "runtime": {"metrics": False}})


def hello(planner: PlannerServer, ident: bytes, source: int, pin: ListingPin | None, **extra) -> None:
    meta = {"role": "loader", "source": source, "replica": 0, "epoch": 0, "source_name": "s", **extra}
    if pin is not None:
        meta["listing"] = pin.to_json()
    planner.handle(ident, wire.Message(Kind.HELLO, meta))


def test_planner_pins_refuses_journals_and_recovers(spec, tmp_path):
    ctx = zmq.Context()
    run = tmp_path / "run"
    run.mkdir()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, run_dir=str(run), metrics_port=None)
    try:
        assert "listings" not in planner.core.cursor()  # nothing pinned: the cursor as before
        hello(planner, b"l0", 0, A)
        assert planner.core.listings == {0: A} and (0, 0) in planner.loaders
        hello(planner, b"l1", 1, None)  # a loader saying no listing (live, older) pins nothing
        assert 1 not in planner.core.listings and (1, 0) in planner.loaders
        # the same partition restarted over another listing: not registered until it reads the run's
        hello(planner, b"l0", 0, B)
        assert (0, 0) not in planner.loaders and planner.core.listings == {0: A}
        hello(planner, b"l0", 0, A)
        assert (0, 0) in planner.loaders
        # the run's listing in another read order: refused, named in STATUS, never registered
        hello(planner, b"l0", 0, ListingPin(A.digest, A.files, "blocks:8"))
        assert (0, 0) not in planner.loaders
        why = planner.status()["refused_loaders"]["s/0"]
        assert "lazy_index_files" in why and "'blocks:8'" in why
        assert planner.status()["listings"] == {"s": A.to_json()}
        cur = planner.core.cursor()
        assert cur["listings"] == {"0": A.text()}
        assert json.loads(planner.core.cursor_later().json()) == cur  # the constructors' form says the same
    finally:
        planner.journal.close()  # the process "dies": its journal stays as written
        planner.sock.close(0)
    records = journal.read_journal(run / "journal.jsonl")
    assert [r for r in records if r["event"] == "listing"] == [{"event": "listing", "session": 0, "source": 0, "pin": A.text()}]
    assert read_state(records).listings == {0: A}
    again = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, run_dir=str(run), metrics_port=None)
    try:
        assert again.core.listings == {0: A}  # recovered: a restarted loader of today's listing is told the run's
        hello(again, b"l0", 0, B)
        assert (0, 0) not in again.loaders
        # a cursor that names another pin (a resume into this run from another run's trainer) replaces it;
        # one without pins (an older cursor) keeps the run's
        cur = again.core.cursor()
        again.core.restore({**cur, "listings": {"0": B.text()}})
        assert again.core.listings == {0: B}
        again.core.restore({k: v for k, v in cur.items() if k != "listings"})
        assert again.core.listings == {0: B}
        with pytest.raises(ValueError, match="listing"):
            again.core.restore({**cur, "listings": {"0": "bad"}})
    finally:
        again.close()
        ctx.term()


def test_a_refusal_in_hello_is_text_cut_to_its_bound_and_garbage_is_named():
    why = listing_not_kept("web", A, B)
    assert parse_refusal(None) is None and parse_refusal(why) == why
    cut = parse_refusal("x" * 5000)
    assert cut is not None and len(cut) == REFUSAL_MAX_CHARS and cut.endswith("...")
    for bad in (7, "", "  ", {"why": "x"}, ["x"], True):
        with pytest.raises(WireError, match="HELLO: field 'refused' is not a non-empty text"):
            parse_refusal(bad, "HELLO: field 'refused'")


def test_a_loader_that_refuses_the_run_itself_is_named_in_the_planners_status(spec):
    """HELLO `refused` (a loader that cannot find the run's kept listing, and stops): STATUS `refused_loaders` names it
    with its reason, once per partition, it is not registered, and a loader serving the run's listing clears it."""
    ctx = zmq.Context()
    planner = PlannerServer(spec, "tcp://127.0.0.1:0", context=ctx, metrics_port=None)
    try:
        hello(planner, b"l0", 0, A)
        hello(planner, b"l1", 1, A)
        assert (0, 0) in planner.loaders
        why = listing_not_kept("s", A, B)
        hello(planner, b"l0", 0, B, refused=why)
        assert (0, 0) not in planner.loaders and (1, 0) in planner.loaders
        assert planner.status()["refused_loaders"] == {"s/0": why}
        hello(planner, b"l0b", 0, B, refused=why + " (again)")  # restarted, refusing again: one entry, the newest
        hello(planner, b"l1", 1, B, refused="x" * 5000)
        refused = planner.status()["refused_loaders"]
        assert refused == {"s/0": why + " (again)", "t/0": "x" * (REFUSAL_MAX_CHARS - 3) + "..."}
        for bad in (7, "", {"why": why}):  # garbage: named, nothing recorded
            with pytest.raises(WireError, match="HELLO: field 'refused'"):
                hello(planner, b"l0", 0, B, refused=bad)
        assert planner.status()["refused_loaders"] == refused
        hello(planner, b"l0", 0, A)  # served again with the run's listing
        assert (0, 0) in planner.loaders and set(planner.status()["refused_loaders"]) == {"t/0"}
    finally:
        planner.close()
        ctx.term()


def test_pins_a_replay_reads_the_journal_with():
    """journal.pinned_listings (what replay and a restarted planner read): a listing record pins a source, a cursor
    naming pins replaces them, one naming none keeps them; locate hands them to the replay of a step."""
    records = [
        {"event": "open", "step": 0, "cursor": {"step": 0}, "spec": {}, "generation": 0},
        {"event": "listing", "source": 0, "pin": A.text()},
        {"event": "step", "step": 0},
        {"event": "checkpoint", "step": 1, "cursor": {"step": 1, "listings": {"0": A.text(), "1": B.text()}}},
        {"event": "step", "step": 1},
        {"event": "resume", "step": 0, "cursor": {"step": 0}},  # an older trainer's cursor: no pins, kept
        {"event": "step", "step": 0},
        {"event": "resume", "step": 1, "cursor": {"step": 1, "listings": {"0": B.text()}}},
        {"event": "step", "step": 1},
    ]
    assert journal.pinned_listings(records[:1]) == {}  # an older run's journal: no pins, replayed as before
    assert journal.pinned_listings(records[:3]) == {0: A}
    assert journal.pinned_listings(records[:7]) == {0: A, 1: B}
    assert journal.pinned_listings(records) == {0: B, 1: B}
    assert journal.locate(records[:3], 0).listings == {0: A}
    assert read_state(records).listings == {0: B, 1: B}
    with pytest.raises(journal.JournalError, match="listing record"):
        journal.pinned_listings([{"event": "listing", "source": 0, "pin": "bad"}])


def test_replay_checks_the_read_order_as_the_planner_does(spec):
    """A replay's stream over the run's listing counts positions in its spec's order: another order than the run's
    is refused with the planner's words (protocol.listing_verdict / order_refusal), another listing too."""
    from mixplane.loader.files import listing_digest
    from mixplane.loader.stream import open_stream
    from mixplane.replay import ReplayError, check_order

    src = spec.sources[0]
    stream = open_stream(src, seed=1)
    try:
        run = ListingPin(listing_digest(stream.files), 1, "pages")
        check_order(src, run, stream)  # the run's listing and order
        with pytest.raises(ReplayError, match=r"order 'pages', the run reads it in the order 'blocks:8'"):
            check_order(src, ListingPin(run.digest, 1, "blocks:8"), stream)
        with pytest.raises(ReplayError, match=f"is not the run's \\(12 files, digest {A.digest}\\)"):
            check_order(src, A, stream)
    finally:
        stream.close()
