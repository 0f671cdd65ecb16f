"""Benchmark: `mixplane prep` on Spark (local mode) -- deduplication precision / recall against planted truth, its
throughput, and depsort's respected dependency edges (seed 004).

Dedup corpus: `--bases` random documents (150 words from a 20k vocabulary), each with copies at planted
similarities (a fraction of its words replaced: 1%, 3%, 8%, 15%, 25%, 40%, 60%, giving weighted Jaccard
similarities from ~0.98 down to ~0.2), plus unrelated documents. The truth of a pair is its exact weighted Jaccard
similarity over the bags the pipeline builds (term frequency x ln(1 + N / df) over the corpus); per threshold,
precision and recall of the similarity edges the pipeline found against the pairs at or above it, and the kept /
removed counts after the vertex cover. Throughput: documents per second per core of the whole dedup (signatures,
LSH, verification, components, cover) for all thresholds.

Depsort: `--repos` synthetic Python repositories of 20-60 modules whose import graph is known (each module
imports a few earlier ones: a DAG), with a few back-imports added (cycles); the respected fraction of all import
edges for mixplane's order (Eades-Lin-Smyth) and for seed 004's DFS, and of the DAG's own edges.

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from mixplane.prep.depsort import depsort, dfs_order, respected, symbols, dependency_edges  # noqa: E402
from mixplane.prep.minhash import token_id, tokens, weighted_bag, weighted_jaccard  # noqa: E402

FRACTIONS = (0.01, 0.03, 0.08, 0.15, 0.25, 0.4, 0.6)
THRESHOLDS = (0.5, 0.7, 0.9)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def corpus(bases: int, singles: int, seed: int = 0) -> tuple[list[tuple[int, str]], list[list[int]]]:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(20_000)]
    rows, groups = [], []
    for b in range(bases):
        base = [rng.choice(vocab) for _ in range(150)]
        gid = b * 100
        group = [gid]
        rows.append((gid, " ".join(base)))
        for v, frac in enumerate(FRACTIONS, 1):
            d = list(base)
            for i in rng.sample(range(150), max(1, int(frac * 150))):
                d[i] = rng.choice(vocab)
            rows.append((gid + v, " ".join(d)))
            group.append(gid + v)
        groups.append(group)
    for s in range(singles):
        rows.append((10_000_000 + s, " ".join(rng.choice(vocab) for _ in range(150))))
    return rows, groups


def truth(rows: list[tuple[int, str]], groups: list[list[int]]) -> dict[tuple[int, int], float]:
    toks = {i: tokens(t) for i, t in rows}
    df = Counter(x for ts in toks.values() for x in {token_id(t) for t in ts})
    bags = {i: weighted_bag(ts, df, len(rows)) for i, ts in toks.items()}
    out = {}
    for g in groups:
        for a in g:
            for b in g:
                if a < b:
                    out[(a, b)] = weighted_jaccard(bags[a], bags[b])
    return out


# how each language writes a module i, its import of module j (with the DAG), its use of a later module j (against
# it), and its definition of f_i
LANGS = {
    "python": ("pkg/m{i}.py", "from pkg.m{j} import f{j}", "import pkg.m{j}", "def f{i}():\n    return {i}\n"),
    "javascript": ("lib/m{i}.js", "import {{ f{j} }} from './m{j}.js';", "const m{j} = require('./m{j}');",
                   "export function f{i}() {{ return {i}; }}\n"),
}


def synthetic_repo(rng: random.Random, n: int, back: int, lang: str = "python") -> tuple[dict[str, str], set[tuple[str, str]]]:
    """A repository of n modules with a known import graph: a random DAG (each module imports 1-3 earlier ones) and
    `back` uses of a later module against it, written in `lang`."""
    path, imp, back_imp, define = LANGS[lang]
    names = [path.format(i=i) for i in range(n)]
    dag: set[tuple[str, str]] = set()
    body: dict[str, list[str]] = {p: [] for p in names}
    for i in range(1, n):
        for j in rng.sample(range(i), min(i, rng.randint(1, 3))):
            dag.add((names[i], names[j]))
            body[names[i]].append(imp.format(j=j))
    extra = set()
    for _ in range(back):
        i, j = sorted(rng.sample(range(n), 2))
        extra.add((names[i], names[j]))
        body[names[i]].append(back_imp.format(j=j))
    files = {p: "\n".join(body[p] + [define.format(i=k)]) for k, p in enumerate(names)}
    if lang == "python":
        files["pkg/__init__.py"] = ""
    return files, dag | extra


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--bases", type=int, default=None)
    ap.add_argument("--repos", type=int, default=None)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args()
    bases = args.bases or (20 if args.quick else 150)
    n_repos = args.repos or (10 if args.quick else 100)
    rows, groups = corpus(bases, singles=bases * 2)
    t0 = time.perf_counter()
    pairs = truth(rows, groups)
    log(f"{len(rows)} documents, {len(pairs)} planted pairs; exact similarities in {time.perf_counter() - t0:.1f}s")

    from mixplane.prep.spark import DedupOptions, dedup, session, signatures, similarity_edges

    spark = session(master=args.master)
    cores = int(spark.sparkContext.defaultParallelism)
    try:
        df = spark.createDataFrame(rows, "id long, text string").repartition(cores)
        opts = DedupOptions()
        t1 = time.perf_counter()
        sigs = signatures(df, opts).cache()
        sigs.count()
        per = []
        for th in THRESHOLDS:
            found = {(r.src, r.dst) for r in similarity_edges(sigs, th, opts).collect()}
            want = {p for p, j in pairs.items() if j >= th}
            tp = len(found & want)
            per.append({"threshold": th, "true_pairs": len(want), "found": len(found),
                        "precision": round(tp / len(found), 4) if found else 1.0,
                        "recall": round(tp / len(want), 4) if want else 1.0})
        reports = dedup(df, list(THRESHOLDS), opts)
        for row in per:
            rep = reports[row["threshold"]][1]
            row.update(kept=rep["kept"], removed=rep["removed"], components=rep["components"])
        secs = time.perf_counter() - t1
    finally:
        spark.stop()
    for row in per:
        log(f"threshold {row['threshold']}: precision {row['precision']} recall {row['recall']} "
            f"({row['found']} found, {row['true_pairs']} true), kept {row['kept']}")
    rng = random.Random(5)
    mine, dfs, dag_kept = [], [], []
    for _ in range(n_repos):
        files, edges = synthetic_repo(rng, rng.randint(20, 60), back=rng.randint(0, 4))
        order, _ = depsort(files)
        real = dependency_edges(symbols(p, s) for p, s in files.items() if p.endswith(".py"))
        real = {e for e in real if not e[1].endswith("__init__.py")}
        assert edges <= real, "the import graph as written was not recovered from the syntax trees"
        mine.append(respected(order, edges))
        dfs.append(respected(dfs_order(list(files), real), edges))
        dag_kept.append(respected(order, {e for e in edges if int(e[0][5:-3]) > int(e[1][5:-3])}))
    js_mine = []
    for _ in range(n_repos):
        files, edges = synthetic_repo(rng, rng.randint(20, 60), back=rng.randint(0, 4), lang="javascript")
        order, report = depsort(files)
        assert report["edges"] == len(edges) and not report["unparsed"], "the JavaScript import graph was not recovered"
        js_mine.append(respected(order, edges))
    out = {"documents": len(rows), "planted_pairs": len(pairs), "thresholds": per, "num_hashes": opts.num_hashes,
           "dedup_s": round(secs, 1), "cores": cores,
           "docs_per_s_per_core": round(len(rows) * len(THRESHOLDS) / secs / cores, 1),
           "load_avg": round(os.getloadavg()[0], 2),
           "depsort": {"repos": n_repos, "respected_edges": round(sum(mine) / len(mine), 4),
                       "respected_edges_dfs": round(sum(dfs) / len(dfs), 4),
                       "respected_dag_edges": round(sum(dag_kept) / len(dag_kept), 4),
                       "worst_repo": round(min(mine), 4),
                       "javascript": {"repos": n_repos, "respected_edges": round(sum(js_mine) / len(js_mine), 4),
                                      "worst_repo": round(min(js_mine), 4)}}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
