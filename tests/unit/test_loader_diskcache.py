"""The disk cache of remote byte ranges: bounded by size (least recently used evicted, recency kept
across restarts), never serving damaged or stale bytes."""

import os
import time

from mixplane.loader.diskcache import DiskCache


def ids(table):
    return lambda f: table[f]


def test_roundtrip_bound_and_lru(tmp_path):
    root = str(tmp_path / "c")
    c = DiskCache(root, max_bytes=3 * 1008, object_id=ids({0: "s3://b/a|100|1", 1: "s3://b/b|100|1"}))
    blobs = {(0, i * 1000, 1000): os.urandom(1000) for i in range(3)}
    for r, b in blobs.items():
        c.put(r, b)
    assert c.total == 3 * 1008 and all(c.has(r) for r in blobs)
    assert c.get((0, 0, 1000)) == blobs[(0, 0, 1000)]  # now the most recent
    c.put((1, 0, 1000), b"y" * 1000)  # over the bound: the least recently used one goes
    assert not c.has((0, 1000, 1000)) and c.has((0, 0, 1000)) and c.has((1, 0, 1000))
    assert c.total <= c.max_bytes and c.evictions == 1
    assert c.get((1, 0, 1000)) == b"y" * 1000
    assert c.get((0, 5000, 1000)) is None  # never stored
    files = [f for d in os.scandir(root) for f in os.scandir(d.path)]
    assert len(files) == 3 and sum(f.stat().st_size for f in files) == c.total


def test_restart_keeps_contents_and_recency(tmp_path):
    root = str(tmp_path / "c")
    oid = ids({0: "s3://b/a|100|1"})
    c = DiskCache(root, max_bytes=10_000, object_id=oid)
    for i in range(3):
        c.put((0, i * 100, 100), bytes([i]) * 100)
        time.sleep(0.01)
    time.sleep(0.01)
    assert c.get((0, 0, 100)) == bytes([0]) * 100  # refreshed: the most recent on disk too
    c2 = DiskCache(root, max_bytes=2 * 108, object_id=oid)  # a smaller bound on restart evicts the oldest
    assert c2.has((0, 0, 100)) and c2.has((0, 200, 100)) and not c2.has((0, 100, 100))
    assert c2.get((0, 200, 100)) == bytes([2]) * 100


def test_damaged_or_stale_entries_are_misses(tmp_path):
    root = str(tmp_path / "c")
    table = {0: "s3://b/a|100|1"}
    c = DiskCache(root, max_bytes=10_000, object_id=ids(table))
    c.put((0, 0, 100), b"a" * 100)
    c.put((0, 100, 100), b"b" * 100)
    path = c._path((0, 0, 100))
    with open(path, "r+b") as f:  # one flipped byte
        f.seek(10)
        f.write(b"X")
    assert c.get((0, 0, 100)) is None and not os.path.exists(path) and c.damaged == 1
    with open(c._path((0, 100, 100)), "r+b") as f:  # cut short
        f.truncate(50)
    assert c.get((0, 100, 100)) is None and c.damaged == 2
    c.put((0, 0, 100), b"a" * 100)
    c2 = DiskCache(root, max_bytes=10_000, object_id=ids({0: "s3://b/a|100|2"}))  # the object was rewritten
    assert c2.get((0, 0, 100)) is None
    assert c.get((0, 0, 100)) == b"a" * 100
    c.put((0, 300, 100), b"short")  # a size that does not match the range is refused
    assert not c.has((0, 300, 100))
