"""`mixplane prep`: offline stages in front of the loaders (poolside's Model Factory pipeline), each writing Parquet the
loaders read in place.

* :mod:`minhash` -- Ioffe's weighted MinHash (consistent weighted sampling) of weighted bags of tokens, and the
  LSH banding for a similarity threshold (pure, numpy);
* :mod:`graph` -- the greedy vertex cover that decides which near-duplicates go (pure);
* :mod:`depsort` -- a repository's Python files in dependency order: symbols from syntax trees, a best-effort
  topological order that keeps the most dependency edges when there are cycles (pure, `ast`);
* :mod:`spark` -- the distributed pipeline on Spark (`pyspark`): vocabulary and document frequencies,
  signatures, LSH buckets, verified similarity edges, connected components by label propagation (no collect to
  the driver), the vertex cover per component, repository-level deduplication, depsort per repository.
"""
