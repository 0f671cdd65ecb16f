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

import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

PROFILE_VERSION = 1
# bytes of a container's termination message the kubelet keeps: a profiling Job's pod hands its result back there
TERMINATION_LIMIT = 4096
# what the auto-partitioner needs of a source; the rest of a profile stays in the pod's log
SLIM_FIELDS = ("cpu_s_per_token", "memory_per_partition", "max_partitions", "mean_tokens_per_sample")
# environment variables whose values never leave a profiling pod (storage credentials from kubernetes.source_secret)
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|SESSION|AUTH|SIGNATURE", re.IGNORECASE)


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


def _g6(x: float) -> float:
    return float(f"{x:.6g}")


def slim_profile(profile: Mapping[str, Any]) -> dict[str, Any]:
    """A profile with only what the auto-partitioner reads (six significant digits): what fits a termination message."""
    out = {}
    for name, p in profile["sources"].items():
        out[name] = {"cpu_s_per_token": _g6(p["cpu_s_per_token"]), "memory_per_partition": int(p["memory_per_partition"]),
                     "max_partitions": int(p["max_partitions"]), "mean_tokens_per_sample": _g6(p["mean_tokens_per_sample"])}
    return {"version": PROFILE_VERSION, "sources": out}


def _compact(doc: Any) -> str:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True)


def slim_entry_bound(name: str) -> int:
    """Bytes one source takes at most in a slim profile's message (the widest numbers each field can have)."""
    widest = {"cpu_s_per_token": -1.23457e-100, "memory_per_partition": 1 << 63, "max_partitions": 1 << 63,
              "mean_tokens_per_sample": -1.23457e-100}
    return len(_compact({name: widest})) - 1  # minus one of the braces; the comma between entries takes its place


def message_envelope() -> int:
    """Bytes of a slim profile's message besides its sources."""
    return len(_compact({"version": PROFILE_VERSION, "sources": {}}))


def termination_message(profile: Mapping[str, Any]) -> str:
    """The slim profile as a profiling pod's termination message; ValueError when it would not fit (the operator
    gives each pod few enough sources that it always does)."""
    text = _compact(slim_profile(profile))
    if len(text.encode()) > TERMINATION_LIMIT:
        raise ValueError(f"the profile of {len(profile['sources'])} sources takes {len(text.encode())} bytes, more than "
                         f"the {TERMINATION_LIMIT} a termination message holds; profile fewer sources (--sources)")
    return text


def redact(text: str, environ: Mapping[str, str]) -> str:
    """`text` without the value of any environment variable named like a credential (KEY, SECRET, TOKEN, ...): an
    error a storage client raises must not carry a Secret's value into the operator's status."""
    for k, v in environ.items():
        if v and len(v) >= 4 and _SECRET_NAME.search(k):
            text = text.replace(v, "***")
    return text


def error_message(error: str, environ: Mapping[str, str]) -> str:
    """A failed profile's termination message: the error, redacted, cut to fit."""
    text = redact(error, environ)
    out = _compact({"version": PROFILE_VERSION, "error": text})
    while len(out) > TERMINATION_LIMIT:  # ASCII (json escapes the rest): characters are bytes
        text = text[: len(text) - max(16, len(out) - TERMINATION_LIMIT)]
        out = _compact({"version": PROFILE_VERSION, "error": text + "..."})
    return out


def parse_message(text: str) -> dict[str, Any]:
    """A profiling pod's termination message: the slim profile, or {"error": ...}; ValueError when it is neither."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != PROFILE_VERSION:
        raise ValueError(f"not a mixplane profile message (version {PROFILE_VERSION})")
    if "error" in doc:
        return {"error": str(doc["error"])}
    costs_from_profile(doc)  # every source with the fields the auto-partitioner needs
    for name, p in doc["sources"].items():
        if not (isinstance(p.get("mean_tokens_per_sample"), (int, float)) and p["cpu_s_per_token"] >= 0
                and p["memory_per_partition"] >= 0 and p["max_partitions"] >= 1):
            raise ValueError(f"sources.{name}: figures out of range")
    return doc


def costs_from_profile(profile: dict[str, Any]) -> list[Any]:
    """The auto-partitioner's inputs from a profile (as printed, or kept in the status)."""
    from mixplane.operator.autopartition import PartitionError, SourceCost

    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION or not isinstance(profile.get("sources"), dict):
        raise PartitionError(f"not a mixplane profile (version {PROFILE_VERSION}): expected {{version, sources}}")
    out = []
    for name, p in profile["sources"].items():
        try:
            out.append(SourceCost(name, float(p["cpu_s_per_token"]), int(p["memory_per_partition"]), int(p.get("max_partitions", 1 << 20))))
        except (KeyError, TypeError, ValueError) as e:
            raise PartitionError(f"profile sources.{name}: {e}") from None
    return out
