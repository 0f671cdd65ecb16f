"""`mixplane prep` on Spark: deduplication (poolside's Model Factory) and depsort, every step distributed.

Deduplication of a DataFrame of documents (`id`, `text` [, `repo`, `fork`, `stars`]):

1. vocabulary and document frequencies: tokens exploded per document, counted per token (a shuffle, no driver);
2. weighted bags (term frequency x ln(1 + N / df), joined per token) and their weighted MinHash signatures
   (:mod:`mixplane.prep.minhash`, per partition with pandas);
3. per threshold: LSH bands (`lsh_params`, leaning towards recall), documents grouped by (band, bucket); each
   bucket's members paired (a bucket larger than `max_bucket` is linked as a star around its smallest id: its
   members are duplicates of one another at this threshold with high probability, and a star keeps it connected
   without m^2 pairs); candidate pairs verified by their exact weighted Jaccard similarity (their bags);
4. connected components by min-label propagation over the edge DataFrame (each round a join and a groupBy;
   rounds = the graph's diameter, LSH graphs are shallow; a checkpoint every few rounds keeps the plan short);
5. per component, the greedy vertex cover (:mod:`mixplane.prep.graph`, `applyInPandas`): its documents go, the
   rest stay -- no two kept documents are near-duplicates, and a component keeps as many as its structure allows;
6. repository-level (`repo_level=True`): components' documents mapped to their repositories, repository edges
   where any of their documents are similar, and the cover prefers to drop forks, then fewer stars: originals stay.

Depsort: per repository (`repo`, `path`, `text`), the files in dependency order (:mod:`mixplane.prep.depsort`)
with `applyInPandas`, as a column `order`.

A shell: imports pyspark; the rules are the pure modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixplane.prep.minhash import band_keys, lsh_params, signature, token_id, tokens, weighted_jaccard

MAX_BUCKET = 64
FP_WEIGHT = 0.25  # LSH banding: a false negative costs 3x a false positive (the exact check drops the latter)


@dataclass(frozen=True)
class DedupOptions:
    num_hashes: int = 128
    seed: int = 1
    code: bool = False  # code tokeniser (identifiers, numbers, punctuation) instead of words
    max_bucket: int = MAX_BUCKET
    max_rounds: int = 64  # connected-component rounds at most (a guard: an error names it when exceeded)


def session(app: str = "mixplane-prep", master: str = "local[2]", **conf: str) -> Any:
    """A SparkSession bound to loopback (tests and single machines; a cluster passes its own master)."""
    import os
    import sys

    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # the Python workers run this interpreter (its packages: numpy, pandas, pyarrow, mixplane), not the first
    # python3 on PATH
    b = (SparkSession.builder.master(master).appName(app).config("spark.ui.enabled", "false")
         .config("spark.pyspark.python", sys.executable).config("spark.pyspark.driver.python", sys.executable)
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.sql.shuffle.partitions", "4"))
    for k, v in conf.items():
        b = b.config(k, v)
    return b.getOrCreate()


def signatures(docs: Any, opts: DedupOptions) -> Any:
    """(id, sig, toks, ws) of every document: its weighted bag over the corpus' document frequencies (token ids,
    weights) and its weighted MinHash signature."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    code = opts.code

    @F.udf(T.ArrayType(T.LongType()))
    def token_ids(text: str | None) -> list[int]:
        return [token_id(t) for t in tokens(text or "", code=code)]

    toks = docs.select("id", F.explode(token_ids("text")).alias("tok"))
    tf = toks.groupBy("id", "tok").agg(F.count(F.lit(1)).alias("tf"))
    n_docs = docs.count()
    df = tf.groupBy("tok").agg(F.count(F.lit(1)).alias("df"))
    bag = (tf.join(df, "tok").withColumn("w", F.col("tf") * F.log1p(F.lit(float(n_docs)) / F.col("df")))
           .groupBy("id").agg(F.collect_list("tok").alias("toks"), F.collect_list("w").alias("ws")))
    num, seed = opts.num_hashes, opts.seed

    def sign(frames: Any) -> Any:
        import pandas as pd

        for pdf in frames:
            sigs = [signature(np.asarray(t, np.int64), np.asarray(w, np.float64), num, seed).view(np.int64).tolist()
                    for t, w in zip(pdf["toks"], pdf["ws"])]
            yield pd.DataFrame({"id": pdf["id"], "sig": sigs, "toks": pdf["toks"], "ws": pdf["ws"]})

    id_type = docs.schema["id"].dataType.simpleString()
    return bag.mapInPandas(sign, schema=f"id {id_type}, sig array<bigint>, toks array<bigint>, ws array<double>")


def similarity_edges(sigs: Any, threshold: float, opts: DedupOptions) -> Any:
    """(src, dst) with src < dst: pairs that share an LSH bucket and whose weighted Jaccard similarity -- exact,
    over their bags -- is at least `threshold`. The banding leans towards recall (false negatives weigh 3x false
    positives in `lsh_params`): the exact check removes the false positives it lets through."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T
    from pyspark.sql.window import Window

    bands, rows = lsh_params(threshold, opts.num_hashes, fp_weight=FP_WEIGHT)

    @F.udf(T.ArrayType(T.LongType()))
    def keys(sig: list[int]) -> list[int]:
        return band_keys(np.asarray(sig, np.int64).view(np.uint64), bands, rows)

    buckets = sigs.select("id", F.explode(keys("sig")).alias("bucket"))
    w = Window.partitionBy("bucket")
    sized = buckets.withColumn("size", F.count(F.lit(1)).over(w)).withColumn("first", F.min("id").over(w))
    small = sized.filter((F.col("size") > 1) & (F.col("size") <= opts.max_bucket))
    pairs = (small.alias("a").join(small.alias("b"), "bucket")
             .where(F.col("a.id") < F.col("b.id")).select(F.col("a.id").alias("src"), F.col("b.id").alias("dst")))
    stars = (sized.filter(F.col("size") > opts.max_bucket).where(F.col("id") != F.col("first"))
             .select(F.col("first").alias("src"), F.col("id").alias("dst")))
    cand = pairs.union(stars).distinct()
    b = sigs.select("id", "toks", "ws")

    @F.udf(T.DoubleType())
    def similarity(ta: list[int], wa: list[float], tb: list[int], wb: list[float]) -> float:
        return weighted_jaccard((np.asarray(ta), np.asarray(wa)), (np.asarray(tb), np.asarray(wb)))

    verified = (cand.join(b.toDF("src", "ta", "wa"), "src").join(b.toDF("dst", "tb", "wb"), "dst")
                .withColumn("sim", similarity("ta", "wa", "tb", "wb")).where(F.col("sim") >= threshold)
                .select("src", "dst"))
    return verified


def components(edges: Any, opts: DedupOptions) -> Any:
    """(id, comp) for every node of `edges`: comp = the smallest id of its connected component (min-label
    propagation; each round one join and one aggregation, until no label changes)."""
    from pyspark.sql import functions as F

    und = edges.select("src", "dst").union(edges.select(F.col("dst").alias("src"), F.col("src").alias("dst"))).distinct()
    labels = und.groupBy("src").agg(F.min("dst").alias("m")).select(
        F.col("src").alias("id"), F.least(F.col("src"), F.col("m")).alias("comp")).cache()
    for r in range(opts.max_rounds):
        # every node takes the smallest label among itself and its neighbours
        nxt = (und.join(labels.withColumnRenamed("id", "dst").withColumnRenamed("comp", "nl"), "dst")
               .groupBy("src").agg(F.min("nl").alias("nl"))
               .join(labels.withColumnRenamed("id", "src"), "src")
               .select(F.col("src").alias("id"), F.least("comp", "nl").alias("comp"))).cache()
        changed = nxt.join(labels.withColumnRenamed("comp", "old"), "id").where(F.col("comp") != F.col("old")).count()
        labels.unpersist()
        labels = nxt
        if r % 4 == 3:
            labels = labels.localCheckpoint()
        if changed == 0:
            return labels
    raise RuntimeError(f"connected components did not converge within {opts.max_rounds} rounds "
                       "(DedupOptions.max_rounds): a similarity graph of that diameter")


def cover_removed(edges: Any, comps: Any, prefer: Any | None = None) -> Any:
    """(id) of the documents (or repositories) the greedy vertex cover removes, component by component.
    `prefer`: (id, tier, rank), smaller = rather removed (graph.vertex_cover)."""
    from pyspark.sql import functions as F

    from mixplane.prep.graph import vertex_cover

    e = edges.join(comps.withColumnRenamed("id", "src"), "src")
    if prefer is None:
        prefer = comps.select("id", F.lit(1).alias("tier"), F.lit(0.0).alias("rank")).limit(0)
    p = prefer.select("id", F.col("tier").cast("int"), F.col("rank").cast("double"))
    e = (e.join(p.toDF("src", "tier_src", "rank_src"), "src", "left")
         .join(p.toDF("dst", "tier_dst", "rank_dst"), "dst", "left"))
    id_type = edges.schema["src"].dataType.simpleString()

    def cover(pdf: Any) -> Any:
        import pandas as pd

        lose: dict[Any, tuple[int, float]] = {}
        for side in ("src", "dst"):
            for n, t, r in zip(pdf[side], pdf[f"tier_{side}"], pdf[f"rank_{side}"]):
                if t is not None and t == t:
                    lose[n] = (int(t), float(r))
        gone = vertex_cover(zip(pdf["src"], pdf["dst"]), lose)
        return pd.DataFrame({"id": sorted(gone, key=str)})

    return e.select("comp", "src", "dst", "tier_src", "rank_src", "tier_dst", "rank_dst").groupBy("comp").applyInPandas(
        cover, schema=f"id {id_type}")


def dedup(docs: Any, thresholds: list[float], opts: DedupOptions = DedupOptions(), *,
          repo_level: bool = False) -> dict[float, tuple[Any, dict[str, Any]]]:
    """Per threshold: (the kept documents, a report). `repo_level`: whole repositories are kept or removed
    (originals over forks, then more stars), by the similarity of their documents."""
    from pyspark.sql import functions as F

    sigs = signatures(docs, opts).cache()
    total = docs.count()
    out: dict[float, tuple[Any, dict[str, Any]]] = {}
    for th in thresholds:
        edges = similarity_edges(sigs, th, opts).cache()
        n_edges = edges.count()
        report: dict[str, Any] = {"threshold": th, "documents": total, "edges": n_edges,
                                  "lsh": dict(zip(("bands", "rows"), lsh_params(th, opts.num_hashes, fp_weight=FP_WEIGHT)))}
        if repo_level:
            repo_of = docs.select("id", "repo")
            redges = (edges.join(repo_of.withColumnRenamed("id", "src").withColumnRenamed("repo", "rs"), "src")
                      .join(repo_of.withColumnRenamed("id", "dst").withColumnRenamed("repo", "rd"), "dst")
                      .where(F.col("rs") != F.col("rd"))
                      .select(F.least("rs", "rd").alias("src"), F.greatest("rs", "rd").alias("dst")).distinct())
            meta = docs.groupBy("repo").agg(F.max(F.col("fork").cast("int")).alias("fork"),
                                            F.max("stars").alias("stars"))
            # smaller = rather removed: forks before any original, then (among equally connected) fewer stars
            prefer = meta.select(F.col("repo").alias("id"),
                                 F.when(F.col("fork") == 1, F.lit(0)).otherwise(F.lit(1)).alias("tier"),
                                 F.coalesce(F.col("stars"), F.lit(0)).cast("double").alias("rank"))
            if redges.count():
                comps = components(redges, opts)
                gone = cover_removed(redges, comps, prefer)
                report["components"] = comps.select("comp").distinct().count()
            else:
                gone = docs.select(F.col("repo").alias("id")).limit(0)
                report["components"] = 0
            kept = docs.join(gone.withColumnRenamed("id", "repo"), "repo", "left_anti")
            report["repositories_removed"] = gone.count()
        else:
            if n_edges:
                comps = components(edges, opts)
                gone = cover_removed(edges, comps)
                report["components"] = comps.select("comp").distinct().count()
            else:
                gone = docs.select("id").limit(0)
                report["components"] = 0
            kept = docs.join(gone, "id", "left_anti")
        report["kept"] = kept.count()
        report["removed"] = total - report["kept"]
        out[th] = (kept, report)
    return out


def depsort(files: Any) -> Any:
    """(repo, path, order): each repository's files in dependency order (0 first)."""
    from mixplane.prep.depsort import depsort as order_of

    def per_repo(pdf: Any) -> Any:
        import pandas as pd

        order, _ = order_of(dict(zip(pdf["path"], pdf["text"])))
        pos = {p: i for i, p in enumerate(order)}
        return pd.DataFrame({"repo": pdf["repo"], "path": pdf["path"], "order": [pos[p] for p in pdf["path"]]})

    return files.select("repo", "path", "text").groupBy("repo").applyInPandas(
        per_repo, schema="repo string, path string, order int")


def report_json(reports: list[dict[str, Any]]) -> str:
    return json.dumps(reports)
