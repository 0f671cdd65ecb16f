"""Packing within buckets (sources[].pack_by) through the embedded runtime: a depsorted-like source packed by
`repo` reaches the trainer as documents that are each a contiguous span of one repository's files concatenated in
order (spans crossing file boundaries included), the buckets taken oldest first and each delivered whole and in order, and a
replay of a step is bit-exact. docs/mixtures.md."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.client import MixtureLoader
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

STEPS = 10


def test_buckets_reach_the_trainer_whole_and_in_order(token_sources, tmp_path):
    rng = np.random.default_rng(3)
    ids, repo, concat, bounds = [], [], {}, {}
    for r in range(40):
        files = [rng.integers(3, 1000, int(rng.integers(20, 200)), dtype=np.int32) for _ in range(int(rng.integers(1, 6)))]
        concat[r] = np.concatenate(files)
        bounds[r] = set(np.cumsum([len(f) for f in files])[:-1].tolist())  # file boundaries inside the bucket
        ids += files
        repo += [f"repo-{r}"] * len(files)
    (tmp_path / "code").mkdir()
    pq.write_table(pa.table({"ids": pa.array(ids, pa.list_(pa.int32())), "repo": pa.array(repo, pa.string())}),
                   tmp_path / "code" / "part-000.parquet", row_group_size=16, write_page_index=True)
    doc = token_mixture(token_sources["root"], topology={"modules": {"backbone": {"dp": 1}}})
    doc["sources"] = [doc["sources"][0], {"name": "code", "uri": str(tmp_path / "code"), "kind": "tokens",
                                          "columns": ["ids", "repo"], "shuffle": "sequential", "append_eos": False,
                                          "pack_by": "repo"}]
    doc["mixture"] = {"weights": {"a": 0.5, "code": 0.5}, "seed": 7}
    spec = parse_spec(doc)
    run_dir = tmp_path / "run"
    with EmbeddedRuntime(spec, run_dir) as rt:
        loader = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=STEPS, timeout_s=90)
        got = [{k: v.numpy().copy() for k, v in b.items() if k in ("input_ids", "source_ids", "cu_seqlens")}
               for b in loader]
        loader.close()
    # every `code` segment is a contiguous span of one bucket; collect where it lies
    text = {r: c.tobytes() for r, c in concat.items()}
    covered: dict[int, list[tuple[int, int]]] = {}
    crossing = 0
    for b in got:
        flat, src, cu = b["input_ids"].reshape(-1), b["source_ids"].reshape(-1), b["cu_seqlens"]
        for a, z in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if src[a] != 1:
                continue
            seg = flat[a:z].astype(np.int32).tobytes()
            hits = [(r, t.find(seg)) for r, t in text.items() if t.find(seg) >= 0 and t.find(seg) % 4 == 0]
            assert len(hits) == 1, f"a code segment of {z - a} tokens is not a span of exactly one bucket"
            r, at = hits[0][0], hits[0][1] // 4
            covered.setdefault(r, []).append((at, z - a))
            crossing += any(at < x < at + (z - a) for x in bounds[r])
    assert crossing > 0, "no delivered segment crossed a file boundary: the files were not joined"
    # the buckets delivered in full over the run are covered exactly, without overlap, in order of the stream
    whole = [r for r, spans in covered.items() if sum(n for _, n in spans) == len(concat[r])]
    assert len(whole) >= 5
    for r in whole:
        spans = sorted(covered[r])
        assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:])), r
    # buckets are taken oldest first (a later one may go first when an earlier one fits in no row that is left)
    assert set(range(20)) <= set(covered)
    out = replay_step(spec, step=STEPS - 1, rank=0, run_dir=str(run_dir), save=str(tmp_path / "r.npz"))
    assert out["digest_match"]
    assert np.array_equal(np.load(tmp_path / "r.npz")["input_ids"], got[-1]["input_ids"])
