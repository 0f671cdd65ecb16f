"""`mixplane profile FILE`: what each source costs a Source Loader, measured on a few of its pages.

The auto-partitioner (mixplane.operator.autopartition) needs CPU seconds per token and memory per
partition for every source. Guessing them is how loaders end up starved or idle, so this reads the
first pages of each source through the loader's own stream (page index, page reader, shuffle) and
transforms (tokenizer, image decode), and times them with the process CPU clock. The operator keeps the
result in the DataMixture's status so a restart does not profile again.

Memory per partition is an estimate from measured quantities: the shuffle buffer (rows x measured
decoded bytes per row, capped by `shuffle_buffer_mb`), the read-ahead window (window tokens x bytes per
token delivered, patches included) and the resident-set growth of opening the source (page index,
footers, tokenizer).

A source of many files is profiled on a sample of them (`sample_files`, default SAMPLE_FILES): the listing
is read whole (it is cheap: one request per 1,000 objects on object storage, sizes included), but only the
sampled files' footers and pages are, so profiling a source of 100,000 files costs what one of 64 files does.
The sample is deterministic: the first half in listing order (what a sequential loader reads first), the rest
evenly spaced over the remaining files (later shards may differ). `max_partitions` (rows, row groups or
pages, by shuffle mode) is then extrapolated from the sample to the listing by bytes (the listing's sizes;
by file count where a listing has no sizes), 10% under the estimate (ESTIMATE_MARGIN), rounded down. The
result says so: `files_listed`, `files_sampled`, `sampled`. A source of at most `sample_files` files is
profiled on all of them, exactly as before. A loader of a source read in the whole source's page order indexes all
of its files, so the memory per partition of such a sampled source adds the index of the files not read: the sample's heap bytes per file
(`index_bytes_per_file`, tracemalloc's peak of opening half the sample and all of it, with one indexing
thread: the profile's own open of the sample is the second measurement) times the rest, by bytes. At 50,000 files of bench/startup.py's corpus that is 4.0-4.2 KB a file,
~200-210 MB; a loader's RSS grows by 190-230 MB over its cold index build there (docs/loader.md). It is an
estimate of the heap: the allocator's slack is not in it, and in the operator's process tracemalloc also sees
what other threads allocate meanwhile.

A source its loaders read block by block (`loader.blocks.lazy_indexing`: static, page mode, at least
`lazy_index_files` files listed) says `order: blocks` (else `pages`) with `blocks` and `block_files`: it is measured
in page order on its sample all the same (costs per file), but a partition reads whole blocks, so `max_partitions` is
at most its number of blocks, and a loader holds the index of the block it reads and the next LOOKAHEAD_BLOCKS
(`files_indexed` files, at the listing's mean heap a file from the sample's), the row starts of its last few blocks
and the whole listing (paths, sizes, mtimes, the block permutation), not every file's index: that is its memory per
partition in place of the sample's index.

An image source's profile also has `image_costs` (decode CPU seconds, raw and decoded bytes per image over the
first images read; `loader.transforms.image_costs_of`): what the operator resolves `image.decode_at: auto` from,
as the embedded runtime resolves it from its own measurement.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from mixplane.profile_message import (  # noqa: F401 - re-exported: the CLI, tests and benches import them from here
    PROFILE_VERSION, SLIM_FIELDS, TERMINATION_LIMIT, costs_from_profile, error_message, message_envelope, parse_message,
    redact, slim_entry_bound, slim_profile, termination_message,
)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


# footers read at most per source when profiling: a source of more files is profiled on a sample of this many
SAMPLE_FILES = 64
# an extrapolated max_partitions is this share of the estimate: a cap the auto-partitioner reaches must still be
# within the source's true count when the sample misjudges it by less (more partitions than units fail the stream)
ESTIMATE_MARGIN = 0.9


def sample_indices(n: int, k: int = SAMPLE_FILES) -> list[int]:
    """Which of `n` listed files (listing order) a profile reads: all of them when n <= k, else the first k // 2
    and k - k // 2 evenly spaced over the rest, the last file included. Sorted, deterministic."""
    if k < 1:
        raise ValueError(f"sample_files must be >= 1, not {k}")
    if n <= k:
        return list(range(n))
    first = k // 2
    spread = np.linspace(first, n - 1, k - first).round().astype(np.int64)
    return sorted({*range(first), *(int(i) for i in spread)})


def sample_files_of(files: Any, k: int = SAMPLE_FILES) -> Any:
    """`files` (a loader.files.SourceFiles) with only the sampled files (`sample_indices`); itself when all are."""
    from mixplane.loader.files import SourceFiles

    pick = sample_indices(len(files.paths), k)
    if len(pick) == len(files.paths):
        return files
    return SourceFiles(uri=files.uri, filesystem=files.filesystem, paths=[files.paths[i] for i in pick],
                       sizes=[files.sizes[i] for i in pick], mtimes_ns=[files.mtimes_ns[i] for i in pick])


def extrapolate(count: int, listed: Any, sampled: Any) -> int:
    """`count` units (rows, row groups, pages) found in the `sampled` files, scaled to the `listed` ones: by bytes
    when the listing has every file's size, else by file count; ESTIMATE_MARGIN of that, rounded down, never below
    `count` (the sampled files alone hold that many)."""
    if len(sampled.paths) >= len(listed.paths):
        return int(count)
    return max(int(count), math.floor(count * _ratio(listed, sampled) * ESTIMATE_MARGIN))


def _ratio(listed: Any, sampled: Any) -> float:
    """How many times the sample the listing is: by bytes when every listed file has a size, else by file count."""
    part = sum(sampled.sizes)
    if all(s > 0 for s in listed.sizes) and part > 0:
        return sum(listed.sizes) / part
    return len(listed.paths) / max(1, len(sampled.paths))


# one indexing thread where the heap of opening a source is measured: with a pool the peak depends on how the threads'
# allocations overlap (3.4-5.4 KB a file at 50,000 files in three runs, 4.0-4.2 KB with one thread)
MEASURE_INDEX_THREADS = 1


def _subset(sample: Any, part: slice) -> Any:
    from mixplane.loader.files import SourceFiles

    return SourceFiles(uri=sample.uri, filesystem=sample.filesystem, paths=sample.paths[part], sizes=sample.sizes[part],
                       mtimes_ns=sample.mtimes_ns[part])


def _index_options(src: Any, files: Any) -> dict[str, Any]:
    """open_stream's options for an open whose heap is measured: one indexing thread (a block-by-block stream of a
    large page-mode source takes its own index options: there the pool decides)."""
    if src.shuffle == "page" and not src.live and src.lazy_index_files:
        from mixplane.loader.blocks import lazy_indexing

        if lazy_indexing(src, len(files.paths)):
            return {}
    return {"index_options": {"threads": MEASURE_INDEX_THREADS}}


def held_files(blocks: Any) -> int:
    """Files whose index a loader of a block-read source holds at most: the block it reads and the ones indexed
    ahead (LOOKAHEAD_BLOCKS), a block's files each."""
    from mixplane.loader.blocks import LOOKAHEAD_BLOCKS

    return min(blocks.num_files, (1 + LOOKAHEAD_BLOCKS) * blocks.block_files)


def held_index_bytes(blocks: Any, per_file: float, listed: Any, sample: Any) -> int:
    """Heap bytes of the index a loader of a block-read source holds: `held_files` files at the listing's mean
    per-file heap (the sample's `per_file`, scaled to the listing by bytes as the whole index would be: a block is a
    random draw of the listing), plus the row starts of the last RECENT_BLOCKS blocks (an int64 and a list slot a
    file; the paths are the listing's)."""
    from mixplane.loader.blocks import RECENT_BLOCKS

    mean = per_file * len(sample.paths) * _ratio(listed, sample) / max(1, len(listed.paths))
    recent = RECENT_BLOCKS * min(blocks.num_files, blocks.block_files) * 16
    return math.ceil(mean * held_files(blocks)) + recent


def listing_bytes(files: Any) -> int:
    """Heap bytes of a listing (paths, sizes, mtimes): what a loader of a block-read source holds of every file, and
    the block layout's permutation of them (8 bytes a file)."""
    import sys

    n = len(files.paths)
    lists = sum(sys.getsizeof(x) for x in (files.paths, files.sizes, files.mtimes_ns))
    items = sum(sys.getsizeof(p) for p in files.paths) + sum(sys.getsizeof(int(v)) for v in files.sizes)
    items += sum(sys.getsizeof(int(v)) for v in files.mtimes_ns)
    return lists + items + 8 * n


def traced_open(src: Any, files: Any, seed: int) -> tuple[Any, int, int]:
    """(the stream, tracemalloc's peak while opening it, tracemalloc's own bytes then) of `files` of a source, opened
    as a loader opens it with one indexing thread."""
    import gc
    import tracemalloc

    from mixplane.loader.stream import open_stream

    gc.collect()  # garbage of what ran before is not freed inside the measurement
    tracemalloc.start()
    try:
        stream = open_stream(src, seed=seed, partition=0, num_partitions=1, cache_dir=None, files=files,
                             **_index_options(src, files))
        return stream, tracemalloc.get_traced_memory()[1], tracemalloc.get_tracemalloc_memory()
    finally:
        tracemalloc.stop()


def index_bytes_per_file(src: Any, sample: Any, seed: int, sample_peak: int | None = None) -> float:
    """Heap bytes a loader's page index and file bookkeeping hold per file of `sample`, measured (tracemalloc's peak)
    as the difference between opening the stream on every other sampled file and on all of them, so what an open
    costs whatever the file count cancels out. `sample_peak`: the peak of an open of all of `sample` already
    measured (`traced_open`: the profile's own open), so only the half is opened here. Call it after one open of the
    source (first-use costs are paid)."""
    half = _subset(sample, slice(None, None, 2))
    stream, half_peak, _ = traced_open(src, half, seed)
    stream.close()
    if sample_peak is None:
        stream, sample_peak, _ = traced_open(src, sample, seed)
        stream.close()
    return max(0.0, (sample_peak - half_peak) / max(1, len(sample.paths) - len(half.paths)))


def profile_source(spec: Any, index: int, *, max_rows: int = 2048, max_cpu_s: float = 1.0, take: int = 32,
                   sample_files: int = SAMPLE_FILES, files: Any = None) -> dict[str, Any]:
    """Read up to `max_rows` rows (or `max_cpu_s` CPU seconds) of one source the way a loader does, from at most
    `sample_files` of its files (see the module docstring). `files`: the source's listing, when the caller has it
    (a loader.files.SourceFiles; else the source is listed here)."""
    from mixplane.loader.blocks import block_order
    from mixplane.loader.listing import source_listing
    from mixplane.loader.stream import open_stream
    from mixplane.loader.transforms import image_costs_of, make_transform

    src = spec.sources[index]
    rss0 = _rss()  # modules are imported above: the growth is this source's index, footers and tokenizer
    c0 = time.process_time()
    listed = files if files is not None else source_listing(src)
    sample = sample_files_of(listed, sample_files)
    sampled = sample is not listed
    blocks = block_order(src, len(listed.paths))
    if blocks is not None:  # the sample (or the few files) measured in page order: costs per file, whatever the order
        src = src.model_copy(update={"lazy_index_files": 0})
    sample_peak = traced_bytes = 0
    if sampled:
        # the index of the files not read is estimated from this open's heap (index_bytes_per_file): it is measured
        # (one indexing thread, traced), after an open of one file has paid what a first open costs whatever its files
        first = _subset(sample, slice(0, 1))
        open_stream(src, seed=spec.mixture.seed, partition=0, num_partitions=1, cache_dir=None, files=first,
                    **_index_options(src, first)).close()
        stream, sample_peak, traced_bytes = traced_open(src, sample, spec.mixture.seed)
    else:
        stream = open_stream(src, seed=spec.mixture.seed, partition=0, num_partitions=1, cache_dir=None, files=sample)
    # a stream given its files lists the storage again at its first take (a live source's new files): not before
    # poll_s, as when it lists them itself, and never for a sample (that would read every footer after all)
    stream.next_rescan_at = math.inf if sampled else time.monotonic() + stream.poll_s
    transform = make_transform(src)
    open_cpu = time.process_time() - c0
    open_rss = max(0, _rss() - rss0 - traced_bytes)  # less what tracemalloc itself held (a sampled source's open)
    try:
        rows = tokens = patches = raw_bytes = delivered_bytes = 0
        cpu = 0.0
        images = None  # image_text: decode CPU, raw and decoded bytes per image (where `decode_at: auto` decodes)
        while rows < max_rows and cpu < max_cpu_s:
            c = time.process_time()
            raw = stream.take(min(take, max_rows - rows), timeout=0.5 if src.live else None)
            out = transform(raw)
            dt = time.process_time() - c
            if len(raw) == 0:
                break
            if images is None and src.kind == "image_text":  # outside the timed window; before the next take
                images = image_costs_of(src, raw.columns[src.columns[0]])  # reuses what it read (slabs)
            cpu += dt
            rows += len(raw)
            tokens += int(out.ntokens.sum())
            patches += int(out.npatches.sum())
            raw_bytes += sum(int(a.nbytes) for a in raw.columns.values())
            delivered_bytes += 4 * int(out.ntokens.sum()) + (int(out.patches.values.nbytes) if out.patches is not None else 0)
        if rows == 0 or tokens == 0:
            raise ValueError(f"source {src.name!r}: no tokens in the first rows of {src.uri}; cannot profile")
        if src.live:
            max_parts = 1  # a live source has one replica (spec rule)
        elif src.shuffle == "row":
            max_parts = extrapolate(int(stream.index.num_rows), listed, sample)
        elif src.shuffle == "rowgroup":
            max_parts = extrapolate(len(stream.index.chunk_rows), listed, sample)
        else:
            max_parts = extrapolate(int(stream.index.num_units), listed, sample)
        if blocks is not None:  # partitions take whole blocks: no more partitions than blocks
            max_parts = min(max_parts, blocks.num_blocks)
    finally:
        stream.close()
    per_file = 0.0
    if sampled:
        per_file = index_bytes_per_file(src, sample, spec.mixture.seed, sample_peak)
        if blocks is None:  # the loader indexes every file: the rest of the listing's index, at the sample's bytes a file
            open_rss += math.ceil(per_file * len(sample.paths) * (_ratio(listed, sample) - 1.0))
        else:  # the loader holds the index of the blocks it keeps, not the sample's: the difference, and the listing
            open_rss = max(0, open_rss + held_index_bytes(blocks, per_file, listed, sample)
                           - math.ceil(per_file * len(sample.paths)))
            open_rss += listing_bytes(listed) if files is not None else 0  # else in the RSS growth already
    per_row = raw_bytes / rows
    buffer_bytes = src.shuffle_buffer * per_row
    if src.shuffle_buffer_mb is not None:
        buffer_bytes = min(buffer_bytes, src.shuffle_buffer_mb * (1 << 20))
    _, window_tokens, window_max = spec.window_bounds(index)
    bytes_per_token = delivered_bytes / tokens
    window_bytes = min(window_tokens, window_max * tokens / rows) * bytes_per_token
    return {
        "cpu_s_per_token": cpu / tokens,
        "memory_per_partition": math.ceil(buffer_bytes + window_bytes + open_rss),
        "max_partitions": max_parts,
        "rows": rows, "tokens": tokens, "patches": patches, "cpu_s": cpu, "open_cpu_s": open_cpu,
        "mean_tokens_per_sample": tokens / rows, "raw_bytes_per_row": per_row, "open_rss_bytes": open_rss,
        "kind": src.kind, "files_listed": len(listed.paths), "files_sampled": len(sample.paths), "sampled": sampled,
        "order": "pages" if blocks is None else "blocks",
        **({"blocks": blocks.num_blocks, "block_files": blocks.block_files,
            "files_indexed": held_files(blocks)} if blocks is not None else {}),
        **({"index_bytes_per_file": round(per_file, 1)} if sampled else {}),
        **({"image_costs": {"decode_s": images.decode_s, "raw_bytes": images.raw_bytes,
                            "decoded_bytes": images.decoded_bytes, "images": images.images}} if images is not None else {}),
    }


def profile_spec(spec: Any, names: Iterable[str] | None = None, **options: Any) -> dict[str, Any]:
    """Profile every source of a validated spec (or those in `names`); the JSON `mixplane profile` prints."""
    want = None if names is None else set(names)
    if want is not None and (unknown := want - {s.name for s in spec.sources}):
        raise ValueError(f"no source named {', '.join(sorted(unknown))} in the spec")
    return {"version": PROFILE_VERSION, "mixture": spec.name,
            "sources": {s.name: profile_source(spec, i, **options) for i, s in enumerate(spec.sources)
                        if want is None or s.name in want}}
