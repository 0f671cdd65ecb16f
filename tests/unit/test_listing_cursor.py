"""A live source's cursor names its file listing (issue 11 item 7): wire form, planner window, stream."""

from __future__ import annotations

import shutil

import pytest

from mixplane.loader.stream import open_stream
from mixplane.planner.windows import ReplicaWindow
from mixplane.protocol import WindowCursor
from mixplane.spec import SourceSpec
from tests.conftest import write_token_source


def test_window_cursor_listing_round_trips_and_is_validated():
    c = WindowCursor.parse({"low": 3, "next": 5, "listing": [["a/x.parquet"], ["a/y.parquet", "a/z.parquet"]]})
    assert c.listing == (("a/x.parquet",), ("a/y.parquet", "a/z.parquet"))
    assert WindowCursor.parse(c.to_json()) == c
    assert "listing" not in WindowCursor.parse({"low": 0}).to_json()  # static sources: no listing
    with pytest.raises(ValueError, match="listing"):
        WindowCursor.parse({"low": 0, "listing": [[1, 2]]})


def test_planner_window_keeps_the_listing_through_cursor_and_restore():
    w = ReplicaWindow(0, 0, 4)
    assert "listing" not in w.cursor()
    w.listing = [["f0", "f1"]]
    cur = w.cursor()
    assert cur["listing"] == [["f0", "f1"]]
    other = ReplicaWindow(0, 0, 4)
    other.restore(cur)
    assert other.listing == [["f0", "f1"]] and other.cursor() == cur


def test_stream_counts_positions_over_a_recorded_listing(tmp_path):
    staging = tmp_path / "staging"
    write_token_source(staging, rows=900, files=3, mean_len=20, seed=4, rows_per_group=50)
    live = tmp_path / "live"
    live.mkdir()
    parts = sorted(staging.glob("*.parquet"))
    for p in parts[:2]:
        shutil.copy(p, live / p.name)
    spec = SourceSpec(name="fresh", uri=str(live / "*.parquet"), columns=["tokens"], kind="tokens", shuffle="rowgroup", live=True)
    a = open_stream(spec, seed=9, buffer_rows=100)
    listing = a.listing()
    first = a.take(200).keys
    rest = a.take(300).keys
    shutil.copy(parts[2], live / "part--new.parquet")  # sorts first: today's listing numbers rows differently
    b = open_stream(spec, seed=9, buffer_rows=100)
    assert b.listing() != listing
    b.restore_listing(listing)
    assert b.listing()[: len(listing)] == listing
    b.seek(200)
    assert list(b.take(300).keys) == list(rest)
    c = open_stream(spec, seed=9, buffer_rows=100)
    c.seek(200)
    assert list(c.take(300).keys) != list(rest)  # without the listing the positions would be others
    assert len(first) == 200
