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
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

from mixplane.profile_message import (  # noqa: F401 - re-exported: the CLI, tests and benches import them from here
    PROFILE_VERSION, SLIM_FIELDS, TERMINATION_LIMIT, costs_from_profile, error_message, message_envelope, parse_message,
    redact, slim_entry_bound, slim_profile, termination_message,
)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def profile_source(spec: Any, index: int, *, max_rows: int = 2048, max_cpu_s: float = 1.0, take: int = 32) -> dict[str, Any]:
    """Read up to `max_rows` rows (or `max_cpu_s` CPU seconds) of one source the way a loader does."""
    from mixplane.loader.stream import open_stream
    from mixplane.loader.transforms import make_transform

    src = spec.sources[index]
    rss0 = _rss()  # modules are imported above: the growth is this source's index, footers and tokenizer
    c0 = time.process_time()
    stream = open_stream(src, seed=spec.mixture.seed, partition=0, num_partitions=1, cache_dir=None)
    transform = make_transform(src)
    open_cpu = time.process_time() - c0
    open_rss = max(0, _rss() - rss0)
    try:
        rows = tokens = patches = raw_bytes = delivered_bytes = 0
        cpu = 0.0
        while rows < max_rows and cpu < max_cpu_s:
            c = time.process_time()
            raw = stream.take(min(take, max_rows - rows), timeout=0.5 if src.live else None)
            out = transform(raw)
            dt = time.process_time() - c
            if len(raw) == 0:
                break
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
            max_parts = int(stream.index.num_rows)
        elif src.shuffle == "rowgroup":
            max_parts = len(stream.index.chunk_rows)
        else:
            max_parts = int(stream.index.num_units)
    finally:
        stream.close()
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
        "kind": src.kind,
    }


def profile_spec(spec: Any, names: Iterable[str] | None = None, **options: Any) -> dict[str, Any]:
    """Profile every source of a validated spec (or those in `names`); the JSON `mixplane profile` prints."""
    want = None if names is None else set(names)
    if want is not None and (unknown := want - {s.name for s in spec.sources}):
        raise ValueError(f"no source named {', '.join(sorted(unknown))} in the spec")
    return {"version": PROFILE_VERSION, "mixture": spec.name,
            "sources": {s.name: profile_source(spec, i, **options) for i, s in enumerate(spec.sources)
                        if want is None or s.name in want}}
