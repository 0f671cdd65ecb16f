"""Read-ahead planning: coalescing, request order and size, the byte bound and pinning (a fetched range
is not evicted before its planned read). Real reads of a local file through RangeReader."""

import os

import pytest

from mixplane.loader.parquet import IOStats, RangeReader
from mixplane.loader.readahead import ReadAhead, coalesce, request_limit
from mixplane.loader.remote import RemoteIO


def test_coalesce_merges_close_ranges_and_orders_requests_by_need():
    ranges = [(1, 5000, 100), (0, 0, 100), (0, 150, 100), (0, 10_000, 50), (1, 5100, 10)]
    reqs = coalesce(ranges, gap=100, max_request=1 << 20)
    spans = [(q.file, q.start, q.end) for q in reqs]
    # (1, 5000..5110) is needed first, then file 0's first two ranges (hole 50 <= gap), then the far one
    assert spans == [(1, 5000, 5110), (0, 0, 250), (0, 10_000, 10_050)]
    assert [q.need for q in reqs] == [0, 1, 3]
    # no merge across a hole wider than the gap, nor past max_request
    assert len(coalesce([(0, 0, 100), (0, 301, 100)], gap=200, max_request=1 << 20)) == 2
    assert len(coalesce([(0, 0, 100), (0, 100, 100)], gap=0, max_request=150)) == 2
    assert coalesce([(0, 0, 100), (0, 0, 100)], gap=0, max_request=10) == coalesce([(0, 0, 100)], gap=0, max_request=10)


def test_request_limit_spreads_a_batch_over_the_slots():
    io = RemoteIO(max_inflight=4, max_request=8 << 20, min_request=1 << 20)
    assert request_limit(40 << 20, io) == 8 << 20  # capped
    assert request_limit(16 << 20, io) == 4 << 20  # a quarter per slot
    assert request_limit(1 << 20, io) == 1 << 20  # never below min_request


@pytest.fixture
def data_file(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(1 << 20))
    return str(p)


def make(data_file, **kw):
    stats = IOStats()
    reader = RangeReader(data_file, None, stats)
    io = RemoteIO(max_inflight=2, coalesce_gap=0, **kw)
    return ReadAhead(io, stats, lambda f: reader), reader


def test_pinned_ranges_stay_until_read_and_the_bound_holds(data_file):
    ra, reader = make(data_file, cache_bytes=3000)
    units = [[(0, i * 10_000, 1000)] for i in range(5)]
    assert ra.schedule(units) == 3  # room for three 1000-byte ranges
    assert ra.held_bytes == 3000
    assert ra.schedule(units[3:]) == 0  # all pinned: nothing evicted, nothing scheduled
    assert ra.get(0, 0, 1000) == reader.read_at(0, 1000)
    assert ra.schedule(units[3:]) == 1  # the read range was unpinned and evicted for the next one
    assert ra.held_bytes <= 3000
    for i in (1, 2, 3):
        assert ra.get(0, i * 10_000, 1000) == reader.read_at(i * 10_000, 1000)
    assert ra.get(0, 0, 1000) is None  # evicted: the caller reads it itself
    assert ra.stats.cache_hits == 4
    ra.close()


def test_a_range_planned_twice_is_pinned_twice(data_file):
    ra, reader = make(data_file, cache_bytes=2000)
    assert ra.schedule([[(0, 0, 1000)], [(0, 0, 1000)]]) == 2  # one request, two planned reads
    assert ra.requests_issued == 1
    assert ra.get(0, 0, 1000) is not None
    assert ra.schedule([[(0, 5000, 1000)], [(0, 9000, 1000)]]) == 1  # (0, 0) still pinned once
    assert ra.get(0, 0, 1000) is not None
    assert ra.schedule([[(0, 9000, 1000)]]) == 1
    assert ra._entries[(0, 5000, 1000)].fut.result(timeout=10) and ra._entries[(0, 9000, 1000)].fut.result(timeout=10)
    ra.unpin_all()
    assert ra.schedule([[(0, 20_000, 1500)]]) == 1  # nothing pinned any more: room made
    ra.close()


def test_failed_request_is_read_by_the_caller(tmp_path):
    p = tmp_path / "short.bin"
    p.write_bytes(b"x" * 100)
    stats = IOStats()
    reader = RangeReader(str(p), None, stats)
    ra = ReadAhead(RemoteIO(), stats, lambda f: reader)
    assert ra.schedule([[(0, 50, 100)]]) == 1  # runs past the end: the request fails in the background
    assert ra.get(0, 50, 100, timeout=10) is None
    assert ra.held_bytes == 0
    ra.close()


def test_endpoint_override_for_s3_and_gcs():
    from mixplane.loader.remote import endpoint_options, gcs_filesystem, s3_filesystem

    assert endpoint_options(None) == {} and endpoint_options("") == {}
    assert endpoint_options("http://127.0.0.1:9000/") == {"endpoint_override": "127.0.0.1:9000", "scheme": "http"}
    assert endpoint_options("minio.local:9000") == {"endpoint_override": "minio.local:9000", "scheme": "https"}
    # both clients take it (built, not connected: no request is made)
    assert s3_filesystem(endpoint="http://127.0.0.1:9", region="eu-west-1").region == "eu-west-1"
    assert gcs_filesystem(endpoint="http://127.0.0.1:9").type_name == "gcs"
