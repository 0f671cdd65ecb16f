"""`mixplane prep` on Spark (local mode, a real JVM): deduplication finds the planted near-duplicates and keeps no
two of them, drops forks before originals at repository level, depsort orders each repository as the pure rule
does, and the CLI reads and writes Parquet and names a missing column."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.prep.depsort import depsort as pure_depsort
from mixplane.prep.minhash import token_id, tokens, weighted_bag, weighted_jaccard

pytestmark = pytest.mark.timeout(900)


def corpus(bases: int = 24, seed: int = 0):
    """Each base document with a near copy (3% of words replaced: similarity ~0.9) and a far one (60%: ~0.2),
    plus unrelated singletons. Rows: id, text, repo, fork, stars."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(20_000)]
    rows = []
    for b in range(bases):
        base = [rng.choice(vocab) for _ in range(150)]
        rows.append((b * 10, " ".join(base), f"repo{b}", False, 100 + b))
        for v, frac in ((1, 0.03), (2, 0.6)):
            d = list(base)
            for i in rng.sample(range(150), int(frac * 150)):
                d[i] = rng.choice(vocab)
            rows.append((b * 10 + v, " ".join(d), f"repo{b}-fork{v}", True, 1))
    for s in range(10):
        rows.append((10_000 + s, " ".join(rng.choice(vocab) for _ in range(150)), f"solo{s}", False, 5))
    return rows


def truth_pairs(rows, threshold):
    """Pairs whose exact weighted Jaccard (the bags the pipeline builds: tf x idf over this corpus) is >= threshold."""
    from collections import Counter

    toks = {r[0]: tokens(r[1]) for r in rows}
    df = Counter(t for ts in toks.values() for t in {token_id(x) for x in ts})
    bags = {i: weighted_bag(ts, df, len(rows)) for i, ts in toks.items()}
    ids = sorted(bags)
    by_base: dict[int, list[int]] = {}
    for i in ids:
        by_base.setdefault(i // 10 if i < 10_000 else i, []).append(i)
    out = set()
    for group in by_base.values():  # only planted relatives share words beyond chance
        for a in group:
            for b in group:
                if a < b and weighted_jaccard(bags[a], bags[b]) >= threshold:
                    out.add((a, b))
    return out


@pytest.fixture(scope="module")
def spark():
    assert shutil.which("java"), "Spark needs a JDK: apt-get install default-jre-headless"
    from mixplane.prep.spark import session

    s = session(master="local[2]")
    yield s
    s.stop()


def test_dedup_finds_the_planted_near_duplicates_and_keeps_no_two(spark):
    from mixplane.prep.spark import DedupOptions, components, dedup, signatures, similarity_edges

    rows = corpus()
    df = spark.createDataFrame(rows, "id long, text string, repo string, fork boolean, stars long")
    opts = DedupOptions(num_hashes=64)
    truth = truth_pairs(rows, 0.7)
    assert len(truth) == 24  # each base with its near copy; the far copies are below 0.7
    sigs = signatures(df, opts).cache()
    found = {(r.src, r.dst) for r in similarity_edges(sigs, 0.7, opts).collect()}
    tp = len(found & truth)
    assert tp / len(truth) >= 0.9 and tp / max(len(found), 1) >= 0.9, (len(found), tp)
    comps = {r.id: r.comp for r in components(spark.createDataFrame(sorted(found), "src long, dst long"), opts).collect()}
    assert all(comps[a] == comps[b] == min(a, b) for a, b in found)
    (kept, report), = dedup(df, [0.7], opts).values()
    ids = {r.id for r in kept.select("id").collect()}
    assert report["documents"] == len(rows) and report["kept"] == len(ids) == len(rows) - report["removed"]
    assert not any(a in ids and b in ids for a, b in found)  # no near-duplicates left
    assert report["removed"] == len(found)  # each planted pair loses one, nothing else goes
    assert all(10_000 + s in ids for s in range(10)) and all(b * 10 + 2 in ids for b in range(24))


def test_repository_level_drops_forks_and_keeps_originals(spark):
    from mixplane.prep.spark import DedupOptions, dedup

    rows = corpus(bases=12, seed=1)
    df = spark.createDataFrame(rows, "id long, text string, repo string, fork boolean, stars long")
    (kept, report), = dedup(df, [0.7], DedupOptions(num_hashes=64), repo_level=True).values()
    repos = {r.repo for r in kept.select("repo").distinct().collect()}
    assert all(f"repo{b}" in repos for b in range(12))  # every original stays
    near_forks = {f"repo{b}-fork1" for b in range(12)}
    assert len(near_forks & repos) <= 1 and report["repositories_removed"] >= 11


def test_depsort_on_spark_equals_the_rule(spark):
    from mixplane.prep.spark import depsort

    repos = {"a": {"m/__init__.py": "from .x import f\n", "m/x.py": "from m.y import g\ndef f(): pass\n",
                   "m/y.py": "def g(): pass\n", "run.py": "from m import f\n"},
             "b": {"one.py": "import two\n", "two.py": "X = 1\n"}}
    rows = [(r, p, t) for r, files in repos.items() for p, t in files.items()]
    got = depsort(spark.createDataFrame(rows, "repo string, path string, text string")).collect()
    for r, files in repos.items():
        order = [x.path for x in sorted((g for g in got if g.repo == r), key=lambda g: g.order)]
        assert order == pure_depsort(files)[0]


def test_the_cli_reads_and_writes_parquet_and_names_a_missing_column(tmp_path):
    rows = corpus(bases=6, seed=2)
    src = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [r[0] for r in rows], "text": [r[1] for r in rows]}), src)
    out = tmp_path / "kept"
    r = subprocess.run([sys.executable, "-m", "mixplane.cli", "prep", "dedup", str(src), str(out), "--threshold", "0.7",
                        "--num-hashes", "64", "--master", "local[1]"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (report,) = json.loads(r.stdout.strip().splitlines()[-1])
    kept = pq.read_table(out)
    assert kept.num_rows == report["kept"] == len(rows) - report["removed"] and report["removed"] >= 5
    bad = subprocess.run([sys.executable, "-m", "mixplane.cli", "prep", "dedup", str(src), str(tmp_path / "x"),
                          "--threshold", "0.7", "--repo-level", "--master", "local[1]"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "column(s) repo, fork, stars missing (has id, text)" in bad.stderr


def test_the_cli_registers_depsorts_output_as_an_iceberg_snapshot(tmp_path, monkeypatch):
    """`prep depsort --iceberg`: the Parquet Spark wrote is the table's snapshot (the report names it pinned), read
    back row for row; several dedup thresholds into one table are refused with the reason."""
    from pyiceberg.catalog import load_catalog

    env = {"PYICEBERG_CATALOG__OUT__URI": f"sqlite:///{tmp_path}/catalog.db",
           "PYICEBERG_CATALOG__OUT__WAREHOUSE": f"file://{tmp_path}/warehouse"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    files = {"m/__init__.py": "from .x import f\n", "m/x.py": "def f(): pass\n", "web/a.js": "import './b.js'\n",
             "web/b.js": "export const b = 1\n"}
    src = tmp_path / "repos.parquet"
    pq.write_table(pa.table({"repo": ["r"] * len(files), "path": list(files), "text": list(files.values())}), src)
    out = tmp_path / "sorted"
    r = subprocess.run([sys.executable, "-m", "mixplane.cli", "prep", "depsort", str(src), str(out), "--master",
                        "local[1]", "--iceberg", "iceberg://out/code.sorted"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    snap = report["iceberg"]["snapshot"]
    assert report["iceberg"]["uri"] == f"iceberg://out/code.sorted@{snap}"
    table = load_catalog("out", **{k.split("__")[-1].lower(): v for k, v in env.items()}).load_table("code.sorted")
    got = table.scan(snapshot_id=snap).to_arrow().sort_by("order")
    order = got.column("path").to_pylist()
    assert order == pure_depsort(files)[0] and order.index("m/x.py") < order.index("m/__init__.py")
    assert order.index("web/b.js") < order.index("web/a.js")
    docs = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [1, 2], "text": ["a b c", "d e f"]}), docs)
    bad = subprocess.run([sys.executable, "-m", "mixplane.cli", "prep", "dedup", str(docs), str(tmp_path / "d"),
                          "--threshold", "0.5", "--threshold", "0.7", "--iceberg", "iceberg://out/code.kept",
                          "--master", "local[1]"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "one table takes one --threshold's output" in bad.stderr
