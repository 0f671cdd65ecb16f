"""Loader I/O benchmark (issue 5): page shuffle vs row shuffle vs row-group shuffle vs Hugging Face
`datasets` streaming (10,000-sample shuffle buffer), on the same Parquet files.

Data: a real-text source built from the text files on this machine (Python sources and docs of the
installed packages and the standard library, /usr/share/doc): one row per file, like a code
dataset (The Stack layout), repeated in shuffled order until the source reaches the target size.
Layout like a production dataset: at most 16 files, pyarrow's default row-group size (each file
one row group, >= 64 MB compressed in the full run), pyarrow's defaults (snappy, dictionary on, ~1 MB data pages: the writer checks the page size
every `write_batch_size` rows, so that is set to about 1 MB of rows), plus an int64 `id` column
(the row's position in stored order, read only by the HF baseline, which has no other way to tell
where a sample came from; our streams carry it in their keys).

Each mode runs in its own process (clean peak RSS), every one with the allocator settings a loader
process applies to itself (mixplane.loader.memory.configure_allocator). Per mode: samples_per_s,
bytes_read_per_sample (bytes our reader issued; for HF the process's read() bytes, /proc/self/io
rchar), delivered_bytes_per_sample (UTF-8 bytes of the delivered text), read_amplification (their
ratio), peak_rss_mb, p50/p99 of the time to get one batch, pair_gap and window_coverage over the
delivered order. Page mode's `_extra.memory` splits its memory at the end of the run: base_mb
(interpreter, libraries, index), buffer_mb (inherent: the rows in the shuffle buffer), slab_overhead_mb,
dictionaries_mb and other_mb (allocator slack, transient buffers, Python objects).

window_coverage can be at most 1.0 (all 100 buckets), so it can exceed a baseline's at most
1.0 / baseline times: with HF at 0.13 here, "10x HF" is out of reach for any order, a full shuffle included.

Workers (issue 26 item 3): a partition's samples/s against its worker threads (`sources[].workers`). The same
files read as a `text` source with every other setting at its default (page shuffle, 10,000-row / 32 MB buffer),
tokenized by a byte-level BPE tokenizer (vocab 8192) trained once on the corpus, through the loader's read path
(`loader.workers.TransformPipeline`: the stream's takes on the loader's thread, transforms on N threads, chunks of
64 rows, in order), TOKENIZERS_PARALLELISM=false as in a loader. Per count: samples_per_s, tokens_per_s, speedup
over 1 worker, cores_used (process CPU seconds / wall), samples_per_cpu_s (what the threads cost), take_share
(the wall time in the stream's takes, which stay on the loader's thread), peak_rss_mb; and gil_free_share, the share
of one thread's CPU time per chunk spent in the tokenizer's batch call (which releases the GIL), with model_speedup =
1 / ((1 - share) + share / N), what N threads give on N free cores at best (Amdahl) — measurable on a loaded core,
where samples_per_s against N is not; with the machine's cores and load average
before and after, since a shared machine's figures move with its load. Counts above the cores the process may use
are run anyway and flagged `oversubscribed`.

Usage: python bench/loader_io.py [--quick] [--gb 1.0] [--data DIR] [--workers 1,2,4] [--workers-only]
The last stdout line is one JSON object:
{"modes": {"page": {...}, "row": {...}, "rowgroup": {...}, "hf_streaming": {...}}, "index_bytes_per_page": N, "dataset_bytes": N,
 "workers": {"1": {...}, "2": {...}, "4": {...}, "cores": N, ...}}
(`--workers-only`: the dataset and the workers runs only; the last line then has "workers" and "dataset_bytes").
The line before it compares page mode's memory at two dataset sizes.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

MODE_FIELDS = ["samples_per_s", "bytes_read_per_sample", "delivered_bytes_per_sample", "read_amplification",
               "peak_rss_mb", "p50_batch_ms", "p99_batch_ms", "pair_gap", "window_coverage"]


# ------------------------------------------------------------------------------------------------
# data


def _corpus_files(quick: bool) -> list[str]:
    roots = [os.path.dirname(os.__file__)]
    if not quick:
        import numpy as _np

        roots.append(os.path.dirname(os.path.dirname(_np.__file__)))  # site-packages
        roots.append("/usr/share/doc")
    out = []
    for r in roots:
        for d, _, fs in os.walk(r):
            for f in fs:
                if f.endswith((".py", ".md", ".rst", ".txt", ".gz")) or f in ("README", "copyright", "changelog"):
                    p = os.path.join(d, f)
                    try:
                        if 64 <= os.path.getsize(p) <= 256 << 10:
                            out.append(p)
                    except OSError:
                        pass
    return sorted(out)


def _read_text(p: str) -> str | None:
    try:
        raw = open(p, "rb").read()
        if p.endswith(".gz"):
            raw = gzip.decompress(raw)
            if len(raw) > 256 << 10:
                return None
        t = raw.decode("utf-8")
        return t if t.strip() else None
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def build_dataset(out_dir: str, target_bytes: int, quick: bool) -> dict:
    """Write the source (or reuse it); returns its manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    man_path = os.path.join(out_dir, "manifest.json")
    if os.path.exists(man_path):
        man = json.load(open(man_path))
        if man.get("target_bytes") == target_bytes and man.get("layout") == 2 and all(os.path.exists(p) for p in man["paths"]):
            return man
    os.makedirs(out_dir, exist_ok=True)
    for p in glob.glob(os.path.join(out_dir, "*.parquet")):
        os.unlink(p)
    t0 = time.time()
    docs = [t for t in (_read_text(p) for p in _corpus_files(quick)) if t is not None]
    lens = np.array([len(d.encode()) for d in docs], np.int64)
    avg = float(lens.mean())
    rng = np.random.default_rng(0)
    # measure the on-disk bytes per row with the writer's defaults
    probe = rng.choice(len(docs), min(2000, len(docs)), replace=False)
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [docs[i] for i in probe], "id": np.arange(len(probe))}), sink)
    disk_per_row = sink.getvalue().size / len(probe)
    total_rows = int(target_bytes / disk_per_row) + 1
    nfiles = 16 if not quick else 4
    rows_per_file = -(-total_rows // nfiles)
    write_batch = max(8, int((1 << 20) / avg))  # ~1 MB of rows between page-size checks -> ~1 MB pages
    paths, written, start = [], 0, 0
    for k in range(nfiles):
        n = min(rows_per_file, total_rows - start)
        if n <= 0:
            break
        pick = rng.integers(0, len(docs), n)
        table = pa.table({"text": pa.array([docs[i] for i in pick], pa.string()),
                          "id": pa.array(np.arange(start, start + n, dtype=np.int64))})
        p = os.path.join(out_dir, f"part-{k:05d}.parquet")
        # the writer's default row-group size (2^20 rows) keeps each file one row group: >= 64 MB compressed
        pq.write_table(table, p, write_batch_size=write_batch, write_page_index=True)
        del table
        paths.append(p)
        written += os.path.getsize(p)
        start += n
    md = pq.ParquetFile(paths[0]).metadata
    rg_bytes = [md.row_group(i).total_byte_size for i in range(md.num_row_groups)]
    rg_comp = [sum(md.row_group(i).column(j).total_compressed_size for j in range(md.num_columns))
               for i in range(md.num_row_groups)]
    man = {"target_bytes": target_bytes, "layout": 2, "paths": paths, "rows": start, "dataset_bytes": written,
           "corpus_docs": len(docs), "corpus_bytes": int(lens.sum()), "avg_doc_bytes": avg,
           "row_group_bytes_uncompressed": rg_bytes, "row_group_bytes_compressed": rg_comp,
           "write_batch_size": write_batch, "build_s": round(time.time() - t0, 1)}
    json.dump(man, open(man_path, "w"))
    return man


# ------------------------------------------------------------------------------------------------
# one mode, in its own process


def _rchar() -> int:
    try:
        for line in open("/proc/self/io"):
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pss_mb() -> float:
    try:
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _peak_rss_mb() -> float:
    """VmHWM: this process's peak resident set (ru_maxrss would carry the parent's peak across exec)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def quality(pos: np.ndarray, n_total: int) -> tuple[float, float]:
    pair_gap = float(np.abs(np.diff(pos.astype(np.int64))).mean() / n_total) if len(pos) > 1 else 0.0
    first = pos[: max(1, n_total // 100)]
    buckets = np.unique(np.minimum(first * 100 // n_total, 99))
    return pair_gap, len(buckets) / 100.0


def _rss_mb() -> float:
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def run_mode(mode: str, data_dir: str, n_total: int, samples: int, batch: int, budget_s: float, buffer_rows: int) -> dict:
    # every mode (HF included) runs with the allocator settings a loader process applies to itself
    from mixplane.loader.memory import configure_allocator

    alloc = configure_allocator()
    import pyarrow.compute as pc

    need = max(n_total // 100, 1)  # window_coverage needs the first 1%
    lat, pos_parts, delivered = [], [], 0
    t_open = time.perf_counter()
    if mode == "hf_streaming":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import datasets

        datasets.disable_progress_bars()
        files = sorted(glob.glob(os.path.join(data_dir, "*.parquet")))
        ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True,
                                   columns=["text", "id"], cache_dir=os.path.join(data_dir, ".hf-cache"))
        # as HF's docs advise for shuffling Parquet: one shard per row group (here one per file, as
        # each file is one row group), then shard order shuffled and a 10,000-sample buffer fed by
        # up to `max_buffer_input_shards` (default 10) shards at a time
        ds = ds.reshard().shuffle(seed=0, buffer_size=10_000)
        stats = {"num_shards": ds.num_shards}
        it = ds.iter(batch_size=batch)
        open_s = time.perf_counter() - t_open
        r0 = _rchar()
        t0 = time.perf_counter()
        got, delivered = drain_hf_batches(it, lat, pos_parts,
                                          lambda got: got < samples and (got < need or time.perf_counter() - t0 < budget_s))
        wall = time.perf_counter() - t0
        bytes_read = _rchar() - r0
        stats["allocator"] = alloc
    else:
        from mixplane.loader.stream import open_stream
        from mixplane.samples import key_row
        from mixplane.spec import SourceSpec

        src = SourceSpec(name="bench", uri=data_dir, columns=["text"], kind="text", shuffle=mode,
                         shuffle_buffer_mb=None)  # the same 10,000-row buffer as HF streaming
        s = open_stream(src, seed=0, buffer_rows=buffer_rows)
        open_s = time.perf_counter() - t_open
        base_mb = _rss_mb()  # interpreter, libraries and the index: before any page is read
        b0, r0 = s.stats.bytes_read, _rchar()
        t0 = time.perf_counter()
        got = 0
        while got < samples and (got < need or time.perf_counter() - t0 < budget_s):
            t = time.perf_counter()
            r = s.take(batch)
            lat.append(time.perf_counter() - t)
            pos_parts.append(key_row(r.keys))
            delivered += int(pc.sum(pc.binary_length(r.columns["text"])).as_py() or 0)
            got += len(r)
        wall = time.perf_counter() - t0
        bytes_read = s.stats.bytes_read - b0
        st = s.status()
        stats = {"rchar_per_sample": (_rchar() - r0) / max(got, 1), "index_bytes_per_page": st["index_bytes_per_page"],
                 "pages": st["pages"], "quarantined": st["quarantined"]["pages"], "allocator": alloc}
        if mode == "page":
            stats["page_reads"] = s.segments[0].page_reads
            stats["memory"] = _page_memory(s, base_mb, delivered / max(got, 1))
        s.close()
    pos = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.int64)
    pair_gap, cover = quality(pos, n_total)
    lat_ms = np.array(lat) * 1000
    out = {
        "samples_per_s": round(got / wall, 1) if wall > 0 else 0.0,
        "bytes_read_per_sample": round(bytes_read / max(got, 1), 1),
        "delivered_bytes_per_sample": round(delivered / max(got, 1), 1),
        "read_amplification": round(bytes_read / max(delivered, 1), 3),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "p50_batch_ms": round(float(np.percentile(lat_ms, 50)), 2) if len(lat) else 0.0,
        "p99_batch_ms": round(float(np.percentile(lat_ms, 99)), 2) if len(lat) else 0.0,
        "pair_gap": round(pair_gap, 4),
        "window_coverage": round(cover, 3),
    }
    out["_extra"] = {"samples": got, "wall_s": round(wall, 2), "open_s": round(open_s, 2), "pss_mb": round(_pss_mb(), 1),
                     "batch": batch, **stats}
    return out



def drain_hf_batches(it, lat: list, pos_parts: list, keep_going) -> tuple[int, int]:
    """Consume an HF streaming iterator while keep_going(samples so far): batch latencies and ids into
    lat / pos_parts; returns (samples, delivered text bytes). Shared with bench/remote_io.py."""
    got = delivered = 0
    while keep_going(got):
        t = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        lat.append(time.perf_counter() - t)
        pos_parts.append(np.asarray(b["id"], np.int64))
        delivered += sum(len(s.encode()) for s in b["text"])
        got += len(b["id"])
    return got, delivered

def _page_memory(s, base_mb: float, row_bytes: float) -> dict:
    """Where a page-mode stream's memory goes, at the end of the run (MB)."""
    rss = _rss_mb()
    sim = s._plan_obj.sim
    arena = s.cache.arena.resident_bytes / 2**20
    dicts = s.reader._dicts.nbytes / 2**20
    buffer = sim.size * row_bytes / 2**20
    return {
        "rss_mb": round(rss, 1),
        "base_mb": round(base_mb, 1),  # interpreter + libraries + index, before reading
        "buffer_mb": round(buffer, 1),  # inherent: rows in the shuffle buffer x mean decoded row
        "slab_overhead_mb": round(arena - buffer, 1),  # the two below
        "slab_delivered_mb": round(s.cache.arena.used_bytes / 2**20 - buffer, 1),  # rows delivered, not yet compacted away
        "slab_unused_mb": round(arena - s.cache.arena.used_bytes / 2**20, 1),  # slab tails, rest of the newest, spare slabs
        "dictionaries_mb": round(dicts, 1),
        "other_mb": round(rss - base_mb - arena - dicts, 1),  # allocator slack, transient buffers, Python objects
        "index_mb": round(s.index.nbytes / 2**20, 3),
        "buffer_rows": int(sim.size),
        "slab_bytes_written_per_row_byte": round(s.cache.arena.copied_bytes / max(1.0, s.position * row_bytes), 2),
    }


def _load() -> list[float]:
    try:
        return [float(x) for x in open("/proc/loadavg").read().split()[:3]]
    except OSError:
        return []


def ensure_tokenizer(data_dir: str, quick: bool) -> str:
    """A byte-level BPE tokenizer (vocab 8192, mixplane's demo recipe) trained on the first ~4 MB of the corpus."""
    path = os.path.join(data_dir, "tokenizer.json")
    if os.path.exists(path):
        return path
    from mixplane.demo.data import train_tokenizer

    def texts():
        left = 4 << 20
        for p in _corpus_files(quick):
            t = _read_text(p)
            if t is None:
                continue
            yield t
            left -= len(t)
            if left <= 0:
                return

    train_tokenizer(texts(), 8192, path + ".tmp")  # type: ignore[arg-type]
    os.replace(path + ".tmp", path)
    return path


def run_workers(data_dir: str, tokenizer: str, workers: int, samples: int, budget_s: float) -> dict:
    """One partition (partition 0 of 1) read and tokenized with `workers` threads, as a loader's window does."""
    from mixplane.loader.memory import configure_allocator

    configure_allocator()
    from mixplane.loader.stream import open_stream
    from mixplane.loader.transforms import make_transform
    from mixplane.loader.window import CHUNK
    from mixplane.loader.workers import TransformPipeline, available_cores
    from mixplane.spec import SourceSpec

    src = SourceSpec(name="bench", uri=data_dir, columns=["text"], kind="text", tokenizer=tokenizer, workers=workers)
    stream = open_stream(src, seed=0)

    class Timed:  # the stream, its takes timed: what stays on the loader's thread (reads, decoding, the buffer)
        take_s = 0.0

        def __getattr__(self, name):
            return getattr(stream, name)

        def take(self, n, **kw):
            t = time.perf_counter()
            try:
                return stream.take(n, **kw)
            finally:
                Timed.take_s += time.perf_counter() - t

    pipe = TransformPipeline(Timed(), make_transform(src), src.workers if isinstance(src.workers, int) else 1)  # type: ignore[arg-type]
    pipe.next(CHUNK)  # warm-up: the first pages and the tokenizer's caches
    got = tokens = nbytes = 0
    lat = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    Timed.take_s = 0.0
    t0 = time.perf_counter()
    while got < samples and time.perf_counter() - t0 < budget_s:
        t = time.perf_counter()
        raw, out = pipe.next(CHUNK)
        lat.append(time.perf_counter() - t)
        got += len(raw)
        tokens += int(out.ntokens.sum()) if out is not None else 0
        nbytes += int(raw.columns["text"].nbytes)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    peak_chunks = pipe.peak_chunks
    pipe.close()
    gil_free = _gil_free_share(stream, make_transform(src), src.tokenizer) if workers == 1 else None
    stream.close()
    return {"workers": workers, "samples_per_s": round(got / wall, 1), "tokens_per_s": round(tokens / wall, 1),
            "mb_per_s": round(nbytes / wall / 1e6, 2), "cores_used": round(cpu / wall, 2),
            "samples_per_cpu_s": round(got / cpu, 1) if cpu > 0 else 0.0,
            "take_share": round(Timed.take_s / wall, 3),  # of the wall time, in the stream's takes (loader thread)
            "p99_chunk_ms": round(float(np.percentile(np.array(lat) * 1000, 99)), 2) if lat else 0.0,
            "peak_rss_mb": round(_peak_rss_mb(), 1), "samples": got, "wall_s": round(wall, 2),
            "peak_chunks_in_flight": peak_chunks, "oversubscribed": workers > available_cores(), "gil_free_share": gil_free}


def _gil_free_share(stream, transform, tokenizer: str, chunks: int = 8) -> float:
    """Of one thread's CPU time per chunk (take + transform), the share spent in the tokenizer's batch call, which runs
    without the GIL: what N worker threads can overlap at best (Amdahl), measurable on a single loaded core."""
    from mixplane.loader.transforms import load_tokenizer
    from mixplane.loader.window import CHUNK

    tok = load_tokenizer(tokenizer)
    total = free = 0.0
    # this thread's CPU time, not the wall clock: a loaded machine's wall times swing with the scheduler
    # (TOKENIZERS_PARALLELISM=false: the batch call runs on the calling thread)
    for _ in range(chunks):
        t0 = time.thread_time()
        raw = stream.take(CHUNK)
        transform(raw)
        total += time.thread_time() - t0
        texts = raw.columns["text"].to_pylist()
        t1 = time.thread_time()
        tok.encode_batch_fast(texts, add_special_tokens=False)
        free += time.thread_time() - t1
    return round(free / total, 3) if total > 0 else 0.0


def workers_section(data: str, quick: bool, counts: list[int]) -> dict:
    """Every worker count in its own process, the counts interleaved over two rounds (a shared machine's load
    drifts); a count's figure is its better round, both rounds are printed."""
    from mixplane.loader.workers import available_cores

    tok = ensure_tokenizer(data, quick)
    samples, budget = (20_000, 10.0) if quick else (100_000, 30.0)
    load_before = _load()
    rounds: dict[int, list[dict]] = {n: [] for n in counts}
    for rnd in range(2):
        for n in counts:
            res = spawn(f"workers:{n}", data, 0, samples, 64, budget, 0, tokenizer=tok)
            print(json.dumps({"workers_run": rnd, **res}), flush=True)
            rounds[n].append(res)
    out: dict = {}
    for n in counts:
        best = max(rounds[n], key=lambda r: r["samples_per_s"])
        out[str(n)] = {k: best[k] for k in ("samples_per_s", "tokens_per_s", "mb_per_s", "cores_used", "samples_per_cpu_s",
                                            "take_share", "p99_chunk_ms", "peak_rss_mb", "oversubscribed")}
        out[str(n)]["rounds_samples_per_s"] = [r["samples_per_s"] for r in rounds[n]]
    base = out[str(counts[0])]["samples_per_s"] if counts and counts[0] == 1 else None
    shares = [r["gil_free_share"] for r in rounds.get(1, []) if r.get("gil_free_share") is not None]
    share = float(np.median(shares)) if shares else None
    for n in counts:
        if base:
            out[str(n)]["speedup"] = round(out[str(n)]["samples_per_s"] / base, 2)
        if share is not None:  # Amdahl over the GIL-free share, on n free cores
            out[str(n)]["model_speedup"] = round(1.0 / ((1.0 - share) + share / n), 2)
    out["gil_free_share"] = share
    out.update({"cores": available_cores(), "cpu_count": os.cpu_count(), "load_before": load_before,
                "load_after": _load(), "tokenizer": "byte-level BPE, vocab 8192", "chunk_rows": 64})
    return out


def run_worker(args) -> None:
    if args.worker.startswith("workers:"):
        print(json.dumps(run_workers(args.data, args.tokenizer, int(args.worker.split(":")[1]), args.samples,
                                     args.budget)))
        return
    res = run_mode(args.worker, args.data, args.n_total, args.samples, args.batch, args.budget, args.buffer_rows)
    print(json.dumps(res))


def spawn(mode: str, data_dir: str, n_total: int, samples: int, batch: int, budget: float, buffer_rows: int,
          tokenizer: str | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--data", data_dir, "--n-total", str(n_total),
           "--samples", str(samples), "--batch", str(batch), "--budget", str(budget), "--buffer-rows", str(buffer_rows)]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    env = dict(os.environ)
    env["TOKENIZERS_PARALLELISM"] = "false"  # as every loader process runs (mixplane.launch)
    env["PYTHONPATH"] = os.path.join(ROOT, "src") + os.pathsep + env.get("PYTHONPATH", "")
    # allocator settings: each worker applies the loader's own (mixplane.loader.memory), whatever the mode
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"mode {mode} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small dataset and sample counts (ends within 60 s)")
    ap.add_argument("--gb", type=float, default=None, help="dataset size on disk (default 1.05, quick 0.04)")
    ap.add_argument("--data", default=None, help="dataset directory (default bench/data/loader_io[_quick])")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n-total", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--buffer-rows", type=int, default=10_000, help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workers", default="1,2,4", help="worker counts of the workers section (default 1,2,4)")
    ap.add_argument("--workers-only", action="store_true", help="build the dataset, then run the workers section only")
    args = ap.parse_args()
    if args.worker:
        run_worker(args)
        return
    quick = args.quick
    gb = args.gb if args.gb is not None else (0.04 if quick else 1.05)
    data = args.data or os.path.join(HERE, "data", "loader_io_quick" if quick else "loader_io")
    t0 = time.time()
    man = build_dataset(data, int(gb * (1 << 30)), quick)
    n = man["rows"]
    print(json.dumps({"dataset": {k: man[k] for k in man if k != "paths"}, "files": len(man["paths"])}), flush=True)

    # the page index sidecars are built once here (its cost is reported), as a loader's first start does
    os.environ.setdefault("MIXPLANE_INDEX_CACHE", os.path.join(data, ".pageindex"))
    counts = [int(x) for x in args.workers.split(",") if x.strip()]
    if args.workers_only:
        print(json.dumps({"workers": workers_section(data, quick, counts), "dataset_bytes": man["dataset_bytes"]}))
        return
    from mixplane.loader.indexscan import build_source_index

    ti = time.time()
    idx = build_source_index(man["paths"], ["text"])
    index_s = time.time() - ti
    print(json.dumps({"index": {"pages": idx.num_pages, "units": idx.num_units, "rows": idx.num_rows,
                                "index_bytes": idx.nbytes, "bytes_per_page": round(idx.bytes_per_page, 1),
                                "build_s": round(index_s, 2),
                                "mean_page_bytes": float(idx.primary["unit_len"].mean())}}), flush=True)

    if quick:
        plan = {"page": (4000, 6), "rowgroup": (4000, 6), "hf_streaming": (4000, 8), "row": (1000, 4)}
    else:
        plan = {"page": (60_000, 60), "rowgroup": (60_000, 60), "hf_streaming": (60_000, 90), "row": (max(n // 100, 2000), 60)}
    modes = {}
    for mode in ("page", "row", "rowgroup", "hf_streaming"):
        samples, budget = plan[mode]
        res = spawn(mode, data, n, samples, 256, budget, 10_000)
        print(json.dumps({"mode": mode, **res}), flush=True)
        modes[mode] = {k: res[k] for k in MODE_FIELDS}
        if mode == "page":
            page_extra = res["_extra"]

    # page mode's memory at a second dataset size: the first quarter of the files
    small = data.rstrip("/") + "_quarter"  # outside the source directory, which is scanned recursively
    os.makedirs(small, exist_ok=True)
    quarter = man["paths"][: max(1, len(man["paths"]) // 4)]
    for p in quarter:
        q = os.path.join(small, os.path.basename(p))
        if not os.path.exists(q):
            os.symlink(p, q)
    n_small = sum(__import__("pyarrow.parquet", fromlist=["x"]).ParquetFile(p).metadata.num_rows for p in quarter)
    samples, budget = plan["page"]
    res_small = spawn("page", small, n_small, samples, 256, budget, 10_000)
    print(json.dumps({"page_memory_vs_size": {
        "full": {"dataset_bytes": man["dataset_bytes"], "rows": n, "peak_rss_mb": modes["page"]["peak_rss_mb"],
                 "breakdown": page_extra["memory"]},
        "quarter": {"dataset_bytes": sum(os.path.getsize(p) for p in quarter), "rows": n_small,
                    "peak_rss_mb": res_small["peak_rss_mb"], "breakdown": res_small["_extra"]["memory"]},
        "rowgroup_peak_rss_mb": modes["rowgroup"]["peak_rss_mb"]}, "total_s": round(time.time() - t0, 1)}), flush=True)

    workers = workers_section(data, quick, counts)
    print(json.dumps({"modes": modes, "index_bytes_per_page": round(idx.bytes_per_page, 1),
                      "dataset_bytes": man["dataset_bytes"], "workers": workers}))


if __name__ == "__main__":
    main()
