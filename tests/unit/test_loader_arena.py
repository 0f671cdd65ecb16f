"""Slab memory of the page-mode shuffle buffer: exact copies, reuse only of unreferenced slabs."""

import numpy as np
import pyarrow as pa

from tests.unit.loader_testdata import mixed_table
from mixplane.loader.arena import RowArena


def test_stored_arrays_equal_the_originals_and_live_in_slabs():
    t = mixed_table(300)
    ar = RowArena(1 << 16)
    for i in range(0, 300, 50):
        part = {c: t.column(c).combine_chunks().slice(i, 50) for c in t.column_names}
        part = {c: a.take(pa.array(np.arange(len(a)))) for c, a in part.items()}  # own buffers, as the stream stores them
        got = ar.store(i, part)
        for c, a in part.items():
            got[c].validate(full=True)
            assert got[c].equals(a), c
    assert ar.num_slabs >= 2 and ar.used_bytes <= ar.resident_bytes
    big = {"t": pa.array(["x" * 200_000])}  # larger than a slab: a slab of its own
    assert ar.store(999, big)["t"].equals(big["t"])


def test_emptied_slab_is_reused_only_when_nothing_points_into_it():
    ar = RowArena(4096, spares=1)
    a = ar.store(1, {"t": pa.array(["a" * 3000])})
    ar.store(2, {"t": pa.array(["b" * 3000])})  # opens a second slab: the first is no longer the newest
    ar.release(1)  # slab 0 is empty, but `a` still points into it: not reused
    assert not ar._spares and len(ar._pending) == 1
    ar.store(3, {"t": pa.array(["c" * 3000])})  # needs a new slab
    assert a["t"][0].as_py() == "a" * 3000  # still intact
    before = ar.new_slabs
    del a
    ar.release(2)
    ar.reclaim()
    assert len(ar._spares) == 1
    ar.store(4, {"t": pa.array(["d" * 3000])})  # takes the spare: no new mapping
    assert ar.new_slabs == before


def test_sparse_slabs_are_those_mostly_delivered():
    ar = RowArena(8192)
    for u in range(6):  # ~1.6 KB each: units 0-4 fill slab 0, unit 5 opens the newest slab
        ar.store(u, {"t": pa.array(["z" * 1500])})
    assert {ar.slab_of(u) for u in range(5)} == {ar.slab_of(0)} != {ar.slab_of(5)}
    mostly_live = {u: 1400.0 for u in range(6)}
    assert ar.sparse_slabs(mostly_live, 0.75) == []
    mostly_delivered = {u: 200.0 for u in range(6)}
    assert sorted(ar.sparse_slabs(mostly_delivered, 0.75)) == [0, 1, 2, 3, 4]  # never the newest slab


def test_allocator_settings_are_applied_by_the_process_itself():
    """A loader process sets its allocator at start-up, no environment needed (a subprocess, so
    this test process keeps its own settings); an operator's environment still wins."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, pyarrow as pa; from mixplane.loader.memory import configure_allocator as c; "
            "a = c(); assert c() is a; print(json.dumps([a, pa.default_memory_pool().backend_name]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "ARROW_DEFAULT_MEMORY_POOL"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    a, pool = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                        check=True).stdout)
    assert a["arrow_pool"] == pool and pool in ("jemalloc", "system", "mimalloc")
    assert a["mmap_threshold"] == 4 << 20 or "not glibc" in str(a["mmap_threshold"])
    env.update(ARROW_DEFAULT_MEMORY_POOL="system", MALLOC_MMAP_THRESHOLD_="131072")
    a, pool = json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                        check=True).stdout)
    assert pool == "system" and a["mmap_threshold"] == "env 131072"
