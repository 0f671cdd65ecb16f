"""The kept listing (`loader/listing.py`): a static source's listing kept in the index cache and, for a remote source,
served from there while younger than `sources[].listing_max_age_s`. A `file://` uri is a remote uri to mixplane
(listed through pyarrow.fs, kept and reused like s3://) on this machine's disk, so these tests see what a start read
by the files it names: a file written after the listing was kept is in the source only once the store is listed
again. The S3 side (no LIST request at all, the pods' case): tests/integration/test_listing_s3.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import pyarrow.fs as pafs
import pytest

from mixplane.cli import main
from mixplane.loader import listing
from mixplane.loader.files import list_source, listing_digest
from mixplane.loader.listing import find_kept, keep_listing, source_listing
from mixplane.loader.stream import open_stream
from mixplane.spec import SourceSpec
from tests.unit.loader_testdata import write_source

T0 = 1_800_000_000.0  # the injected clock


def _spec(uri: str, **kw) -> SourceSpec:
    return SourceSpec(name="web", uri=uri, columns=["text", "row", "ids"], kind="text", shuffle="page", **kw)


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "data"
    write_source(str(root), nfiles=3, rows=300, page_size=2048, row_group_size=100)
    return root


def _add_file(root, name: str) -> str:
    """Another file under the source's directory (a copy of its first)."""
    shutil.copy(root / "part-00.parquet", root / name)
    return str(root / name)


def _key_dir(cache, source: SourceSpec) -> str:
    return os.path.join(cache, listing.LISTINGS_DIR, listing.cache_key(source.uri, source.endpoint, source.region))


def test_digest_is_deterministic_and_names_the_files(src):
    a, b = list_source(_spec(str(src))), list_source(_spec(str(src)))
    assert a.digest == b.digest == listing_digest(a) and len(a.digest) == 16 and int(a.digest, 16) >= 0
    assert a.digest == "{:016x}".format(int(a.digest, 16))
    changed = [a.paths[:2], a.sizes[:1] + [a.sizes[1] + 1] + a.sizes[2:], a.mtimes_ns[:2] + [a.mtimes_ns[2] - 1]]
    for field_, value in zip(("paths", "sizes", "mtimes_ns"), changed):
        other = list_source(_spec(str(src)))
        setattr(other, field_, value)
        if field_ == "paths":
            other.sizes, other.mtimes_ns = other.sizes[:2], other.mtimes_ns[:2]
        assert other.digest != a.digest, field_
    swapped = list_source(_spec(str(src)))
    swapped.paths = swapped.paths[::-1]
    swapped.sizes, swapped.mtimes_ns = swapped.sizes[::-1], swapped.mtimes_ns[::-1]
    assert swapped.digest != a.digest  # listing order counts
    _add_file(src, "part-09.parquet")
    assert list_source(_spec(str(src))).digest != a.digest


@pytest.mark.parametrize("remote", [False, True])
def test_keep_and_find_round_trip(src, tmp_path, remote):
    cache = str(tmp_path / "cache")
    sp = _spec(f"file://{src}" if remote else str(src))
    files = list_source(sp)
    digest = keep_listing(sp, files, cache_dir=cache)
    assert digest == files.digest
    got = find_kept(sp, digest, cache_dir=cache)
    assert got is not None and got is not files
    assert (got.paths, got.sizes, got.mtimes_ns, got.uri) == (files.paths, files.sizes, files.mtimes_ns, sp.uri)
    assert got.digest == digest and got.listed_at == pytest.approx(files.listed_at)
    assert isinstance(got.filesystem, pafs.LocalFileSystem)
    assert got.kept_from == os.path.join(_key_dir(cache, sp), f"{digest}.npz") and os.path.isfile(got.kept_from)
    assert find_kept(sp, "0123456789abcdef", cache_dir=cache) is None  # not kept
    assert find_kept(sp, digest, cache_dir=str(tmp_path / "other")) is None  # another machine's cache
    assert find_kept(sp, digest, cache_dir="") is None  # no cache
    other_uri = _spec(f"file://{src}/" if remote else f"{src}/*.parquet")
    assert find_kept(other_uri, digest, cache_dir=cache) is None  # another uri's listings are its own
    # a stream opened from the found listing reads the files it names
    s = open_stream(sp, seed=0, files=got, cache_dir=None, buffer_rows=50)
    try:
        assert s.index.num_rows == 300 + 337 + 374 and not s.index.bad_files
    finally:
        s.close()


def test_a_remote_source_is_served_from_its_kept_listing_until_it_is_too_old(src, tmp_path):
    cache = str(tmp_path / "cache")
    T0 = time.time() - 3650  # noqa: N806 - the listing at T0 + 3600 is young at the real clock (the stream below)
    sp = _spec(f"file://{src}", listing_max_age_s=3600)
    first = source_listing(sp, cache_dir=cache, now=T0)
    assert first.kept_from is None and first.listed_at == T0 and len(first.paths) == 3
    new = _add_file(src, "part-09.parquet")
    young = source_listing(sp, cache_dir=cache, now=T0 + 3599)
    assert young.kept_from is not None and young.paths == first.paths and new not in young.paths
    assert young.listed_at == T0 and young.digest == first.digest
    old = source_listing(sp, cache_dir=cache, now=T0 + 3600)  # as old as the max age: listed again
    assert old.kept_from is None and new in old.paths and old.listed_at == T0 + 3600
    # the new listing is kept and served from now on, the new file in it
    again = source_listing(sp, cache_dir=cache, now=T0 + 3700)
    assert again.kept_from is not None and again.paths == old.paths
    # a stream of the source opens from the kept listing too (the default cache: MIXPLANE_INDEX_CACHE)
    os.environ["MIXPLANE_INDEX_CACHE"] = cache
    try:
        os.unlink(new)  # gone since the listing was kept: quarantined by name, the rest served
        s = open_stream(sp, seed=0, buffer_rows=50)
        try:
            assert s.files.kept_from is not None and new in s.files.paths
            assert list(s.index.bad_files) == [new] and s.index.num_rows == 300 + 337 + 374
        finally:
            s.close()
    finally:
        del os.environ["MIXPLANE_INDEX_CACHE"]
    # listing_max_age_s 0: listed at every start
    zero = _spec(f"file://{src}", listing_max_age_s=0)
    assert source_listing(zero, cache_dir=cache, now=T0 + 3701).kept_from is None
    assert source_listing(zero, cache_dir=cache, now=T0 + 3702).kept_from is None


def test_local_and_live_sources_are_listed_at_every_start(src, tmp_path):
    cache = str(tmp_path / "cache")
    sp = _spec(str(src))
    first = source_listing(sp, cache_dir=cache, now=T0)
    new = _add_file(src, "part-09.parquet")
    second = source_listing(sp, cache_dir=cache, now=T0 + 1)
    assert first.kept_from is None and second.kept_from is None and new in second.paths and new not in first.paths
    for f in (first, second):  # both kept: a run pinned to either finds it by its digest
        got = find_kept(sp, f.digest, cache_dir=cache)
        assert got is not None and got.paths == f.paths
    live = _spec(f"file://{src}", live=True)
    assert source_listing(live, cache_dir=cache).kept_from is None
    assert not os.path.exists(_key_dir(cache, live))  # a live source's listing is never kept
    # no cache: listed, nothing kept
    remote = _spec(f"file://{src}")
    for _ in range(2):
        assert source_listing(remote, cache_dir="", now=T0).kept_from is None


def test_a_damaged_kept_listing_is_ignored_with_a_warning(src, tmp_path, caplog):
    cache = str(tmp_path / "cache")
    sp = _spec(f"file://{src}")
    first = source_listing(sp, cache_dir=cache, now=T0)
    kept = os.path.join(_key_dir(cache, sp), f"{first.digest}.npz")
    new = _add_file(src, "part-09.parquet")
    data = open(kept, "rb").read()
    for damage in (data[: len(data) // 2], b"not a listing", data[:200] + bytes(300) + data[500:], b""):
        with open(kept, "wb") as f:
            f.write(damage)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mixplane.loader.listing"):
            assert find_kept(sp, first.digest, cache_dir=cache) is None
        assert any(kept in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING), damage[:20]
        with caplog.at_level(logging.WARNING, logger="mixplane.loader.listing"):
            got = source_listing(sp, cache_dir=cache, now=T0 + 1)
        assert got.kept_from is None and new in got.paths  # listed afresh
        assert any(kept in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        # the listing made now is kept and served next time; put the first one back for the next damage
        assert source_listing(sp, cache_dir=cache, now=T0 + 2).digest == got.digest
        with open(os.path.join(_key_dir(cache, sp), listing.LATEST), "wb") as f:
            f.write(listing.latest_bytes([(first.digest, T0)]))
    # a listing whose files do not give its digest (another listing's file under this name) is not served
    shutil.copy(os.path.join(_key_dir(cache, sp), f"{got.digest}.npz"), kept)
    assert find_kept(sp, first.digest, cache_dir=cache) is None
    # a damaged latest.json: warned, listed afresh, rewritten
    latest = os.path.join(_key_dir(cache, sp), listing.LATEST)
    with open(latest, "wb") as f:
        f.write(b"{\"recent\": [[\"zz\"")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mixplane.loader.listing"):
        assert source_listing(sp, cache_dir=cache, now=T0 + 3).kept_from is None
    assert any(latest in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert source_listing(sp, cache_dir=cache, now=T0 + 4).kept_from is not None


def test_only_the_newest_listings_are_kept(src, tmp_path):
    cache = str(tmp_path / "cache")
    sp = _spec(f"file://{src}", listing_max_age_s=0)  # listed every time: each start keeps a new listing
    digests = []
    for k in range(listing.KEEP_LISTINGS + 2):
        _add_file(src, f"part-{10 + k}.parquet")
        digests.append(source_listing(sp, cache_dir=cache, now=T0 + k).digest)
    assert len(set(digests)) == len(digests)
    names = sorted(os.listdir(_key_dir(cache, sp)))
    newest = digests[-listing.KEEP_LISTINGS:]
    assert names == sorted([f"{d}.npz" for d in newest] + [listing.LATEST]), names
    recent = listing.parse_latest(open(os.path.join(_key_dir(cache, sp), listing.LATEST), "rb").read(), "latest")
    assert recent == [(d, T0 + k) for k, d in reversed(list(enumerate(digests)))][: listing.KEEP_LISTINGS]
    assert all(find_kept(sp, d, cache_dir=cache) is None for d in digests[:2])
    assert all(find_kept(sp, d, cache_dir=cache) is not None for d in newest)
    # the same listing again moves to the front (its time renewed), nothing new written
    assert listing.remember(recent, digests[-2], T0 + 99)[0][0] == (digests[-2], T0 + 99)
    # an older listing kept again (a run pinned to it) stays, the oldest of the others goes
    old = list_source(sp)
    old.paths, old.sizes, old.mtimes_ns, old.listed_at = old.paths[:3], old.sizes[:3], old.mtimes_ns[:3], T0 - 50
    assert keep_listing(sp, old, cache_dir=cache) == old.digest
    assert find_kept(sp, old.digest, cache_dir=cache) is not None and find_kept(sp, newest[0], cache_dir=cache) is None
    assert all(find_kept(sp, d, cache_dir=cache) is not None for d in newest[1:])
    assert source_listing(sp.model_copy(update={"listing_max_age_s": 3600.0}), cache_dir=cache,
                          now=T0 + 100).digest == digests[-1]  # the newest is still the one served


def test_listing_command_prints_and_refreshes(src, tmp_path, monkeypatch, capsys):
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", cache)
    doc = {"name": "m", "sources": [{"name": "web", "uri": f"file://{src}", "kind": "text", "columns": ["text"], "tokenizer": "tok.json"},
                                    {"name": "loc", "uri": str(src), "kind": "text", "columns": ["text"], "tokenizer": "tok.json"}],
           "mixture": {"weights": {"web": 0.5, "loc": 0.5}}, "batch": {"sequences": 2, "seq_len": 64},
           "topology": {"modules": {"backbone": {"dp": 1}}}}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(doc))

    def run(*args: str) -> list[dict]:
        assert main(["listing", str(path), *args]) == 0
        return [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    first = run()
    assert [(r["source"], r["files"], r["kept_from"]) for r in first] == [("web", 3, "listed"), ("loc", 3, "listed")]
    new = _add_file(src, "part-09.parquet")
    kept = run("--source", "web")
    assert len(kept) == 1 and kept[0]["files"] == 3 and kept[0]["kept_from"].endswith(f"{first[0]['digest']}.npz")
    assert kept[0]["digest"] == first[0]["digest"] and kept[0]["age_s"] >= 0
    fresh = run("--refresh", "--source", "web")
    assert fresh[0]["files"] == 4 and fresh[0]["kept_from"] == "listed" and fresh[0]["digest"] != first[0]["digest"]
    after = run()
    assert after[0]["files"] == 4 and after[0]["kept_from"] != "listed" and after[0]["digest"] == fresh[0]["digest"]
    assert after[1]["files"] == 4 and after[1]["kept_from"] == "listed"  # a local source: listed every time
    s = open_stream(_spec(f"file://{src}"), seed=0, buffer_rows=50)  # the next start reads the new file
    try:
        assert new in s.files.paths and s.index.num_rows == 2 * 300 + 337 + 374
    finally:
        s.close()
    assert main(["listing", str(path), "--source", "nope"]) == 2
