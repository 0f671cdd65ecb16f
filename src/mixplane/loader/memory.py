"""Process-wide allocator settings for a loader process, applied by the process itself at start-up.

A loader decodes pages into short-lived buffers of a few hundred KB to a few MB, all the time.
Where those buffers come from decides how much memory the process keeps beyond what it uses:

* Arrow's buffers (decompressed pages, take / concat results) come from Arrow's default memory
  pool, chosen when pyarrow first needs it; the environment variable ``ARROW_DEFAULT_MEMORY_POOL``
  picks it, and :func:`configure_allocator` sets it with ``pyarrow.set_memory_pool`` so that a pod
  needs no environment for it.
* glibc's malloc (Python bytes, numpy arrays) serves blocks above a threshold with their own mmap
  and gives them back on free; that threshold grows on its own after large frees (up to 32 MB), after
  which page-sized blocks come from the heap and their holes are not returned. ``mallopt``
  fixes the threshold (the ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` environment
  variables do the same, but only if set before the process starts).

The decoded rows of the page-mode shuffle buffer do not depend on either: they live in slabs of
their own (:mod:`mixplane.loader.arena`). What these settings change is the slack around the
transient buffers (the loader benchmark reports it as ``other_mb``). Measured on the loader
benchmark (page mode, 10,000-row buffer, 60k samples): peak RSS 306 MB with jemalloc, 320 MB with
the system allocator, 373 MB with pyarrow's default mimalloc; with jemalloc the glibc thresholds
moved it by less than the run-to-run noise (310-315 MB for 128 KB, 1 MB, 4 MB and 32 MB
thresholds). So the Arrow pool matters and is set here; the glibc threshold is fixed only so that
it cannot drift upwards on its own.

Settings already given in the environment win, so an operator can still override them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

ARROW_POOL = "jemalloc"  # the pool a loader uses unless ARROW_DEFAULT_MEMORY_POOL says otherwise
MMAP_THRESHOLD = 4 << 20  # glibc: blocks of at least this size get their own mmap
TRIM_THRESHOLD = 1 << 20  # glibc: give free heap top back beyond this size

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied: dict | None = None


def configure_allocator(*, arrow_pool: str | None = None, mmap_threshold: int | None = None,
                        trim_threshold: int | None = None) -> dict:
    """Apply the loader's allocator settings to this process (once; later calls return the first
    result). Returns what was applied, for logs and benchmarks."""
    global _applied
    if _applied is not None:
        return _applied
    import pyarrow as pa

    out: dict = {}
    want = os.environ.get("ARROW_DEFAULT_MEMORY_POOL") or arrow_pool or ARROW_POOL
    pools = {"jemalloc": getattr(pa, "jemalloc_memory_pool", None), "mimalloc": getattr(pa, "mimalloc_memory_pool", None),
             "system": pa.system_memory_pool}
    try:
        make = pools.get(want)
        if make is None:
            raise NotImplementedError(f"unknown pool {want!r}")
        pa.set_memory_pool(make())
    except (NotImplementedError, pa.ArrowException) as e:  # a pyarrow built without that allocator
        log.info("Arrow memory pool %r not available (%s); using %s", want, e, pa.default_memory_pool().backend_name)
    out["arrow_pool"] = pa.default_memory_pool().backend_name

    libc = _libc()
    for key, env, opt, default, arg in (
            ("mmap_threshold", "MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD, mmap_threshold),
            ("trim_threshold", "MALLOC_TRIM_THRESHOLD_", _M_TRIM_THRESHOLD, TRIM_THRESHOLD, trim_threshold)):
        if env in os.environ:
            out[key] = f"env {os.environ[env]}"
            continue
        value = int(arg if arg is not None else default)
        if libc is not None and libc.mallopt(opt, value) == 1:
            out[key] = value
        else:
            out[key] = "unchanged (not glibc)"
    _applied = out
    return out


def _libc():
    try:
        name = ctypes.util.find_library("c") or "libc.so.6"
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None
