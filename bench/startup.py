"""Start-up on many files (issue 24): how long a source of 1k / 10k / 100k Parquet files takes to its first
batch, and what grows with the file count.

Corpus: small token files with realistic footers -- 4 row groups of 32 rows, ~4 data pages per row group
(write_batch_size 8, data_page_size 1 kB), page and offset indexes, a dictionary-encoded ``lang`` column beside
the ``ids`` list<int32> column -- written once as 32 distinct templates and copied to N files (fast: the bytes
are written, not encoded), cached in ~/.cache/mixplane/startup-corpus/n<N>/ (MIXPLANE_STARTUP_CORPUS).
Half the files form source ``a``, half source ``b``: a mixture of two sources.

Per row (files, storage, start):
* ``first_batch_s``: from EmbeddedRuntime.start (what ``mixplane run`` does) to the first batch a
  MixtureLoader (rank 0 of 1) receives; cold: the page-index cache emptied; warm: the indexes of the cold
  run kept (MIXPLANE_INDEX_CACHE of this benchmark).
* ``full_index_s``: in this process, listing plus ``build_source_index`` of source ``a`` (what a loader does
  before it serves), with the same cache state; ``requests`` / ``bytes_read``: its IOStats; ``listing_s``: the
  listing alone (``loader.listing.source_listing``, as a loader gets it: warm on S3 the listing kept by the cold
  row, ``listing_from`` "cache"; a local source is listed every time, "listed");
  ``index_bytes_per_page``: SourceIndex.bytes_per_page.
* ``loader_rss_mb``: the largest RSS of the runtime's loader processes after the first batch; ``loader_cpu_s``:
  the most CPU seconds (user + system) one of them used up to then -- on a shared machine a figure that depends
  far less on the others' load than the wall times.
* ``cursor_bytes``: the JSON of the cursor in the journal's ``open`` record; ``journal_bytes_per_step``: the
  mean size of a ``step`` record (both from <run_dir>/journal.jsonl after ``--steps`` steps).
* ``pyarrow_dataset_s``: pyarrow.dataset discovering the same files and reading every footer
  (``Fragment.ensure_complete_metadata``), the lower bound of reading every footer.
``exponents``: least-squares slope of log(metric) over log(files) across the cold local rows.

    python bench/startup.py [--quick] [--files 1000,10000] [--steps 20] [--s3]
``--quick``: 1,000 and 3,000 files, local only (under a minute once the corpus is cached). Last line: one JSON
object {"rows": [...], "exponents": {...}, "load": "<uptime>"}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
# the runtime's processes (planner, loaders, constructor) import this tree too, not whatever tree the environment's
# mixplane is installed from (an editable install names one checkout: runs of another measured that one's loaders)
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])

TEMPLATES = 32
PER_DIR = 1000
ROW_GROUPS, ROWS_PER_GROUP, TOKENS = 4, 32, 32
SEQ_LEN, SEQUENCES = 256, 4


def corpus_root() -> Path:
    return Path(os.environ.get("MIXPLANE_STARTUP_CORPUS", Path.home() / ".cache" / "mixplane" / "startup-corpus"))


def _templates() -> list[bytes]:
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    for t in range(TEMPLATES):
        rng = np.random.default_rng(t)
        n = ROW_GROUPS * ROWS_PER_GROUP
        lens = rng.integers(TOKENS // 2, TOKENS * 2, n)
        ids = pa.ListArray.from_arrays(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                                       pa.array(rng.integers(3, 1000, int(lens.sum())), pa.int32()))
        lang = pa.array(rng.choice(["en", "de", "fr", "code"], n))
        table = pa.table({"ids": ids, "lang": lang, "id": pa.array(np.arange(n) + t * n, pa.int64())})
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=ROWS_PER_GROUP, write_batch_size=8, data_page_size=1024,
                       write_page_index=True, use_dictionary=["lang"], compression="zstd")
        out.append(buf.getvalue())
    return out


def ensure_corpus(n: int) -> Path:
    """n files (n/2 under a/, n/2 under b/, PER_DIR per directory), made once and kept."""
    root = corpus_root() / f"n{n}"
    done = root / ".complete"
    if done.exists():
        return root
    if root.exists():
        shutil.rmtree(root)
    t0 = time.monotonic()
    tpl = _templates()
    for src in ("a", "b"):
        half = n // 2
        for i in range(half):
            d = root / src / f"d{i // PER_DIR:04d}"
            if i % PER_DIR == 0:
                d.mkdir(parents=True, exist_ok=True)
            (d / f"part-{i:06d}.parquet").write_bytes(tpl[(i * 7 + (src == "b")) % TEMPLATES])
    done.write_text(str(n))
    print(f"corpus n={n}: written in {time.monotonic() - t0:.1f}s at {root}", file=sys.stderr)
    return root


# ------------------------------------------------------------------------------------------------


def index_source(uri: str, cache_dir: str, storage) -> dict:
    """What a loader does for source `a` before it serves: list, then index every file (timed here)."""
    import resource

    from mixplane.loader.indexscan import build_source_index
    from mixplane.loader.listing import source_listing
    from mixplane.loader.parquet import IOStats

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    # what a loader calls: on S3 the listing kept by the cold row's start (in this benchmark's own cache) while it
    # is younger than sources[].listing_max_age_s; a local source is listed every time
    files = source_listing(_source_spec(uri, storage), cache_dir=cache_dir)
    t1 = time.perf_counter()
    stats = IOStats()
    idx = build_source_index(files.paths, ["ids"], sizes=files.sizes, mtimes=files.mtimes_ns,
                             filesystem=files.filesystem if storage else None, stats=stats, cache_dir=cache_dir)
    t2 = time.perf_counter()
    return {"listing_s": round(t1 - t0, 3), "listing_from": files.kept_from or "listed", "full_index_s": round(t2 - t0, 3),
            "requests": int(stats.requests or stats.reads), "bytes_read": int(stats.bytes_read),
            "index_bytes_per_page": round(idx.bytes_per_page, 1), "pages": idx.num_pages, "indexed_files": len(idx.files),
            "bad_files": len(idx.bad_files), "bench_maxrss_growth_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024, 1)}


def pyarrow_dataset_s(uri: str, storage) -> float:
    import pyarrow.dataset as pds

    t0 = time.perf_counter()
    if storage is None:
        dset = pds.dataset(uri, format="parquet")
    else:
        dset = pds.dataset(uri.split("://", 1)[1], format="parquet", filesystem=storage.filesystem())
    for frag in dset.get_fragments():
        frag.ensure_complete_metadata()
    return round(time.perf_counter() - t0, 3)


def run_mixture(uris: dict[str, str], storage, steps: int, run_dir: Path) -> dict:
    import psutil

    from mixplane import runtime
    from mixplane.client import MixtureLoader
    from mixplane.runtime import EmbeddedRuntime
    from mixplane.spec import parse_spec

    spec = parse_spec({
        "name": "bench-startup",
        "sources": [{"name": n, "uri": u, "kind": "tokens", "columns": ["ids"],
                     **({"endpoint": storage.endpoint} if storage else {})} for n, u in uris.items()],
        "mixture": {"weights": {n: 1.0 for n in uris}, "seed": 1},
        "batch": {"sequences": SEQUENCES, "seq_len": SEQ_LEN, "microbatches": 1, "pad_id": 0},
        "topology": {"modules": {"backbone": {"dp": 1}}, "ranks_per_node": 8},
        "runtime": {"constructors": "per_node", "prefetch_steps": 2, "metrics": False, "security": "open"},
    })
    # a loader is ready once its source is indexed: at 100k files that can take longer than the default 120 s
    runtime.READY_TIMEOUT_S = max(runtime.READY_TIMEOUT_S, 3600.0)
    t0 = time.perf_counter()
    rt = EmbeddedRuntime(spec, run_dir, log_level="WARNING")
    try:
        rt.start()
        t_ready = time.perf_counter() - t0
        loader = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=steps, prefetch=2, timeout_s=600)
        first = None
        got = 0
        for _ in loader:
            if first is None:
                first = time.perf_counter() - t0
                procs = [psutil.Process(c.proc.pid) for c in rt.children if "loader" in c.name]
                rss = max(p.memory_info().rss for p in procs)
                cpu = max(sum(p.cpu_times()[:2]) for p in procs)
            got += 1
        loader.close()
    finally:
        rt.stop()
    cursor_bytes, step_bytes = 0, []
    for line in (run_dir / "journal.jsonl").read_text().splitlines():
        rec = json.loads(line)
        kind = rec.get("event")
        if kind == "open":
            cursor_bytes = len(json.dumps(rec.get("cursor", rec.get("cursor_z")), separators=(",", ":")))
        elif kind == "step":
            step_bytes.append(len(line) + 1)
    return {"first_batch_s": round(first or float("nan"), 3), "ready_s": round(t_ready, 3), "steps": got,
            "loader_rss_mb": round(rss / 2**20, 1), "loader_cpu_s": round(cpu, 2), "cursor_bytes": cursor_bytes,
            "journal_bytes_per_step": round(sum(step_bytes) / max(len(step_bytes), 1), 1)}


def _source_spec(uri: str, storage=None):
    from mixplane.spec import SourceSpec

    return SourceSpec(name="a", uri=uri, kind="tokens", columns=["ids"],
                      **({"endpoint": storage.endpoint} if storage else {}))


def lazy_indexing(source, files: int) -> bool:
    from mixplane.loader.blocks import lazy_indexing as lazy

    return lazy(source, files)


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return round(sum((p[0] - mx) * (p[1] - my) for p in pts) / den, 3) if den else None


class S3Storage:
    """s3rver (or moto) behind the latency proxy of tests/s3server.py, the corpus uploaded once per run."""

    def __init__(self, latency_s: float, server: str = "auto") -> None:
        sys.path.insert(0, str(ROOT))
        from tests.s3server import S3RVER_KEY, MotoS3, S3Proxy, S3rver, credentials_env

        self.kind = server if server != "auto" else ("s3rver" if S3rver.available() else "moto")
        os.environ.update(credentials_env(S3RVER_KEY if self.kind == "s3rver" else None))
        self.server = S3rver(("startup",)) if self.kind == "s3rver" else MotoS3(process=True)
        self.proxy = S3Proxy(self.server.endpoint, latency_s=latency_s)
        self.endpoint = self.proxy.endpoint
        self.uploaded: set[str] = set()

    def filesystem(self):
        return self.server.filesystem(self.endpoint)

    def upload(self, local: Path, prefix: str) -> str:
        if prefix not in self.uploaded:
            if self.kind == "moto" and not self.uploaded:  # the bucket, once
                self.server.filesystem().create_dir("startup")
            t0 = time.monotonic()
            self._upload_tree(local, prefix)
            print(f"uploaded {local} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
            self.uploaded.add(prefix)
        return f"s3://startup/{prefix}"

    def _upload_tree(self, local: Path, prefix: str) -> None:
        """Every file under `local` (its subdirectories too) to startup/<prefix>/..., 16 at a time, straight to the
        server (not through the latency proxy)."""
        from concurrent.futures import ThreadPoolExecutor

        import boto3

        c = boto3.client("s3", endpoint_url=self.server.endpoint, region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
        files = sorted(p for p in local.rglob("*.parquet"))
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda p: c.upload_file(str(p), "startup", f"{prefix}/{p.relative_to(local).as_posix()}"), files))

    def stop(self) -> None:
        self.proxy.stop()
        self.server.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--files", default="1000,10000")
    ap.add_argument("--s3-files", default="", help="file counts also measured on S3 (20 ms per request)")
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--server", choices=["auto", "s3rver", "moto"], default="auto",
                    help="S3-compatible server (s3rver failed ListObjectsV2 under 5,000 keys here: INTERNAL_FAILURE)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-runtime", action="store_true", help="index figures only (no mixplane run)")
    ap.add_argument("--pyarrow-s3-max", type=int, default=1000, help="largest source the S3 pyarrow reference reads")
    ap.add_argument("--no-warmup", action="store_true", help="measure the session's first runtime start too")
    args = ap.parse_args()
    counts = [1000, 3000] if args.quick else [int(x) for x in args.files.split(",") if x]
    s3_counts = [] if args.quick else [int(x) for x in args.s3_files.split(",") if x]
    steps = 5 if args.quick else args.steps
    # every process of a run imports mixplane: compiled once here, as an installed package is, so the first row does
    # not pay for compiling it in each of them
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "src")], check=False)
    work = Path(tempfile.mkdtemp(prefix="mixplane-startup-"))
    cache = work / "pageindex"
    os.environ["MIXPLANE_INDEX_CACHE"] = str(cache)  # the loaders' cache (children inherit it)
    rows = []
    storage = None
    if not args.no_runtime and not args.no_warmup:
        # the first runtime of a session reads the interpreter's libraries from disk (40-55 s here on a loaded
        # machine, whatever the file count): one unmeasured start over a 2-file corpus takes that out of the rows
        tiny = ensure_corpus(2)
        run_mixture({s: str(tiny / s) for s in ("a", "b")}, None, 1, work / "warmup")
        shutil.rmtree(cache, ignore_errors=True)
    try:
        for storage_kind, ns in (("local", counts), ("s3", s3_counts)):
            if ns and storage_kind == "s3":
                storage = S3Storage(args.latency_ms / 1000, args.server)
            for n in ns:
                root = ensure_corpus(n)
                if storage is None:
                    uris = {s: str(root / s) for s in ("a", "b")}
                else:
                    uris = {s: storage.upload(root / s, f"n{n}/{s}") for s in ("a", "b")}
                shutil.rmtree(cache, ignore_errors=True)
                # pyarrow.dataset reads the fragments' footers one after another: on S3 at 20 ms that is ~75 ms a
                # file (38 s for 500 files); beyond --pyarrow-s3-max files per source it is not run (null)
                ref = (pyarrow_dataset_s(uris["a"], storage) if storage is None or n // 2 <= args.pyarrow_s3_max
                       else None)
                for start in ("cold", "warm"):
                    if start == "cold":
                        shutil.rmtree(cache, ignore_errors=True)
                    idx_cache = str(work / f"bench-index-{storage_kind}-{n}")  # own cache: the loaders' stays as theirs
                    if start == "cold":
                        shutil.rmtree(idx_cache, ignore_errors=True)
                    row = {"files": n, "storage": storage_kind, "start": start}
                    if not args.no_runtime:
                        row.update(run_mixture(uris, storage, steps, work / f"run-{storage_kind}-{n}-{start}"))
                    row.update(index_source(uris["a"], idx_cache, storage))
                    row["pyarrow_dataset_s"] = ref
                    row["files_per_source"] = n // 2
                    # how the loaders read it: block by block (sources[].lazy_index_files, default) or in the whole
                    # source's page order; full_index_s is the whole source's index either way
                    row["order"] = "blocks" if lazy_indexing(_source_spec(uris["a"]), n // 2) else "pages"
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    finally:
        if storage is not None:
            storage.stop()
        shutil.rmtree(work, ignore_errors=True)
    cold = [r for r in rows if r["start"] == "cold" and r["storage"] == "local"]
    exps = {k: fit_exponent([r["files"] for r in cold], [r.get(k) for r in cold])
            for k in ("first_batch_s", "full_index_s", "loader_rss_mb", "cursor_bytes", "journal_bytes_per_step")}
    s3 = [r for r in rows if r["start"] == "cold" and r["storage"] == "s3"]
    if len(s3) > 1:
        exps.update({f"s3_{k}": fit_exponent([r["files"] for r in s3], [r.get(k) for r in s3])
                     for k in ("first_batch_s", "full_index_s")})
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"rows": rows, "exponents": exps, "load": load}))


if __name__ == "__main__":
    main()
