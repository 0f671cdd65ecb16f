"""Iceberg tables and snapshots as sources, through pyiceberg's SQL catalog (SQLite) over local files and over the
S3-compatible server: a snapshot's data files are what the source reads (exactly its rows, through the page-level
reader), `mixplane run` pins the current snapshot, and a replay after the table moved on reads the pinned one bit for
bit; bad references are named."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from mixplane.client import MixtureLoader
from mixplane.loader.files import SourceFilesError, list_source_files
from mixplane.loader.iceberg import IcebergError, parse_ref, pin, pin_sources
from mixplane.loader.stream import open_stream
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec, parse_spec
from tests.conftest import token_mixture


def docs(rng, n, start):
    lens = np.maximum(1, rng.lognormal(np.log(80), 0.8, n).astype(np.int64))
    return pa.table({"tokens": pa.array([rng.integers(3, 1000, k) for k in lens], pa.list_(pa.int64())),
                     "id": pa.array(np.arange(start, start + n), pa.int64())})


@pytest.fixture()
def table(tmp_path, monkeypatch):
    """Catalog `test` (SQLite, warehouse under tmp_path) with table ns.docs written in two appends."""
    from pyiceberg.catalog import load_catalog

    monkeypatch.setenv("PYICEBERG_CATALOG__TEST__URI", f"sqlite:///{tmp_path}/catalog.db")
    monkeypatch.setenv("PYICEBERG_CATALOG__TEST__WAREHOUSE", f"file://{tmp_path}/warehouse")
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / "index-cache"))
    cat = load_catalog("test", uri=f"sqlite:///{tmp_path}/catalog.db", warehouse=f"file://{tmp_path}/warehouse")
    cat.create_namespace("ns")
    rng = np.random.default_rng(0)
    first, second = docs(rng, 900, 0), docs(rng, 600, 900)
    t = cat.create_table("ns.docs", schema=first.schema)
    t.append(first)
    s1 = t.current_snapshot().snapshot_id
    t.append(second)
    t = cat.load_table("ns.docs")
    return {"catalog": cat, "table": t, "s1": s1, "s2": t.current_snapshot().snapshot_id, "first": first,
            "second": second, "more": docs(rng, 500, 1500)}


def test_a_snapshot_is_exactly_its_data_files_and_rows(table):
    s1, s2 = table["s1"], table["s2"]
    f1 = list_source_files(f"iceberg://test/ns.docs@{s1}")
    f2 = list_source_files("iceberg://test/ns.docs")
    assert len(f1.paths) == 1 and len(f2.paths) == 2 and set(f1.paths) < set(f2.paths)
    assert all(p.startswith("/") and p.endswith(".parquet") for p in f2.paths) and sum(f2.sizes) > 0
    assert pin("iceberg://test/ns.docs") == f"iceberg://test/ns.docs@{s2}"
    assert parse_ref(f"iceberg://test/ns.docs@{s1}").snapshot == s1
    # the page-level reader over the snapshot: one epoch is every row of the snapshot once, none of the later one
    for sid, want in ((s1, table["first"]), (s2, pa.concat_tables([table["first"], table["second"]]))):
        src = SourceSpec(name="ice", uri=f"iceberg://test/ns.docs@{sid}", kind="tokens", columns=["tokens", "id"],
                         shuffle="page")
        r = open_stream(src, seed=3).take(want.num_rows + 5)
        first_epoch = key_epoch(r.keys) == 0
        assert first_epoch.sum() == want.num_rows
        ids = r.columns["id"].to_numpy()[first_epoch]
        assert sorted(ids.tolist()) == want.column("id").to_pylist()
        got = {int(i): t for i, t in zip(ids, r.columns["tokens"].to_pylist()[: first_epoch.sum()])}
        assert all(got[int(i)] == t for i, t in zip(want.column("id").to_pylist(), want.column("tokens").to_pylist()))


def test_bad_references_are_named(table):
    for uri, what in [("iceberg://test/ns.nope", "no table 'ns.nope'"), ("iceberg://test/docs", "not an Iceberg source uri"),
                      (f"iceberg://test/ns.docs@{table['s2'] + 1}", "has no snapshot"),
                      ("iceberg://nocat/ns.docs", "catalog 'nocat' cannot be loaded")]:
        with pytest.raises(SourceFilesError, match=what):
            list_source_files(uri)
    with pytest.raises(IcebergError, match="no table"):
        pin("iceberg://test/ns.nope")


def test_a_run_pins_the_snapshot_and_replay_reads_it_after_the_table_moved_on(table, token_sources, tmp_path):
    doc = token_mixture(token_sources["root"])
    doc["sources"] = [*doc["sources"][:2], {"name": "ice", "uri": "iceberg://test/ns.docs", "kind": "tokens",
                                            "columns": ["tokens"], "shuffle": "page"}]
    doc["mixture"] = {"weights": {"a": 0.3, "b": 0.3, "ice": 0.4}, "seed": 7}
    spec = parse_spec(doc)
    assert pin_sources(spec).sources[2].uri == f"iceberg://test/ns.docs@{table['s2']}"
    run_dir = tmp_path / "run"
    got = []
    with EmbeddedRuntime(spec, run_dir) as rt:
        assert rt.spec.sources[2].uri.endswith(f"@{table['s2']}")
        loader = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=12, timeout_s=90)
        for b in loader:
            got.append(b["input_ids"].numpy().copy())
        loader.close()
    assert f"@{table['s2']}" in (run_dir / "spec.json").read_text()
    table["table"].append(table["more"])  # the table moves on
    assert len(list_source_files("iceberg://test/ns.docs").paths) == 3
    out = replay_step(spec, step=11, rank=0, run_dir=str(run_dir), save=str(tmp_path / "r.npz"))
    assert out["digest_match"] and out["tokens_by_source"]["ice"] > 0
    assert np.array_equal(np.load(tmp_path / "r.npz")["input_ids"], got[11])


def test_a_table_on_the_s3_compatible_server_is_read_through_its_catalog(tmp_path, monkeypatch):
    """The catalog (SQLite) names data files on object storage (the warehouse is an s3:// bucket on a real
    S3-compatible server): the listing plans the snapshot into s3:// objects, and the page-level reader reads them
    through the source's endpoint -- exactly the snapshot's rows, none of a later append's."""
    from pyiceberg.catalog import load_catalog

    from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, MotoS3, credentials_env

    for k, v in credentials_env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    server = MotoS3()
    try:
        server.filesystem().create_dir("lake")
        props = {"uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": "s3://lake/warehouse",
                 "s3.endpoint": server.endpoint, "s3.access-key-id": ACCESS_KEY, "s3.secret-access-key": SECRET_KEY,
                 "s3.region": REGION}
        for k, v in props.items():
            monkeypatch.setenv(f"PYICEBERG_CATALOG__LAKE__{k.upper().replace('.', '__').replace('-', '_')}", v)
        cat = load_catalog("lake", **props)
        cat.create_namespace("ns")
        rng = np.random.default_rng(1)
        first, later = docs(rng, 700, 0), docs(rng, 300, 700)
        t = cat.create_table("ns.docs", schema=first.schema)
        t.append(first)
        snap = t.current_snapshot().snapshot_id
        t.append(later)
        files = list_source_files(f"iceberg://lake/ns.docs@{snap}", endpoint=server.endpoint, region=REGION)
        assert len(files.paths) == 1 and all("lake/warehouse/" in p for p in files.paths)
        src = SourceSpec(name="ice", uri=f"iceberg://lake/ns.docs@{snap}", kind="tokens", columns=["tokens", "id"],
                         shuffle="page", endpoint=server.endpoint, region=REGION)
        r = open_stream(src, seed=2).take(first.num_rows + 5)
        first_epoch = key_epoch(r.keys) == 0
        assert first_epoch.sum() == first.num_rows
        assert sorted(r.columns["id"].to_numpy()[first_epoch].tolist()) == first.column("id").to_pylist()
    finally:
        server.stop()


def test_prep_output_registered_as_a_snapshot_is_read_back_and_a_second_run_replaces_it(tmp_path, monkeypatch):
    """prep.iceberg.publish: the files a stage wrote become the table's snapshot in place (created with their
    schema); a second run's files replace the rows in a new snapshot while the first stays readable; a run into the
    directory the current snapshot's files live in is refused before anything is written."""
    import pyarrow.parquet as pq

    from mixplane.prep.iceberg import check_target, publish

    monkeypatch.setenv("PYICEBERG_CATALOG__OUT__URI", f"sqlite:///{tmp_path}/catalog.db")
    monkeypatch.setenv("PYICEBERG_CATALOG__OUT__WAREHOUSE", f"file://{tmp_path}/warehouse")
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")
    rng = np.random.default_rng(3)
    runs = []
    for run, n in ((1, 400), (2, 250)):
        out = tmp_path / f"run{run}"
        out.mkdir()
        table = docs(rng, n, 10_000 * run)
        check_target("iceberg://out/blend.docs", str(out))
        for i, part in enumerate((table.slice(0, n // 2), table.slice(n // 2))):
            pq.write_table(part, out / f"part-{i}.parquet")
        rep = publish("iceberg://out/blend.docs", list_source_files(str(out)).paths)
        assert rep["files"] == 2 and rep["uri"] == f"iceberg://out/blend.docs@{rep['snapshot']}"
        runs.append((rep["uri"], table))
    for uri, table in runs:  # each snapshot is exactly its run's rows
        src = SourceSpec(name="p", uri=uri, kind="tokens", columns=["tokens", "id"], shuffle="page")
        r = open_stream(src, seed=0).take(table.num_rows + 3)
        first = key_epoch(r.keys) == 0
        assert sorted(r.columns["id"].to_numpy()[first].tolist()) == table.column("id").to_pylist()
    with pytest.raises(IcebergError, match="current snapshot's data files lie in"):
        check_target("iceberg://out/blend.docs", str(tmp_path / "run2"))
    with pytest.raises(IcebergError, match="without @<snapshot-id>"):
        check_target(runs[0][0], str(tmp_path / "run3"))
