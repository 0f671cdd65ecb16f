"""Memory benchmark (paper Fig. 12 / 17): loader-side memory of the data-parallel baseline vs mixplane.

    python bench/memory.py [--quick] [--budget-gb 9]

Both sides run for real on this machine with R trainer ranks on one node, CP = 2, PP = 4 (so
DP = R / 8), M Parquet sources of 5 MB row groups (token ids), seq_len 2048:

* baseline — what a careful user writes today: every rank builds one PyTorch ``DataLoader`` with
  w = 2 workers over an ``IterableDataset`` whose every worker opens every source with
  ``pyarrow.parquet.ParquetFile.iter_batches`` (small record batches, one column), mixes the sources by
  weight and packs rows; CP and PP ranks each run their own loader (as with Megatron-style loaders
  that are unaware of CP / PP).
* mixplane — as its partitioner deploys it on one node: one logical Source Loader per source,
  sources grouped 16 per loader process, one Data Constructor per node (``constructors: per_node``),
  the planner, and the trainer client (``MixtureLoader``) in every rank. Loaders read pages in random
  order with a shuffle buffer of 256 rows per source (the size of the baseline's record batches; the
  spec's default of 10,000 rows is measured for R = 16, M = 128 as well) and a read-ahead window of 64
  samples.

Memory is PSS (``/proc/<pid>/smaps_rollup``) summed over every process involved, so pages shared
between processes (libraries, fork copy-on-write) are counted once. Trainer processes are part of both
setups, so the loader-side figure is the total minus the PSS of the same number of idle trainer
processes (python + torch + numpy imported, nothing loaded). Configurations whose baseline would not
fit the memory budget are extrapolated from a measured run of the same M with fewer ranks (per-rank
footprint × R) and marked ``"extrapolated": true``.

``--quick`` (a smoke run, within a minute): 1 MB row groups, the baseline measured with one rank at
every M and multiplied by R, mixplane measured once (R = 8, M = 32) and scaled to the other rows by
its per-source share; every row is then marked extrapolated.

``--shadows``: every mixplane row that is measured is measured again with one shadow loader per loader group
(``runtime.shadow_loaders: 1``: a hot standby process opening the same sources with a warm window, issue 11);
seed 001 leaves shadows out of its memory figures, so both are reported: ``mixplane_with_shadows_mb``,
``shadow_cost_mb`` (the difference), ``shadow_cost_per_group_mb`` and ``ratio_with_shadows``.

The last stdout line is ``{"rows": [{"ranks", "sources", "baseline_rss_mb", "mixplane_rss_mb", "ratio",
"extrapolated"[, shadow columns]}]}`` (MB = 2**20 bytes, PSS).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(SRC))

SEQ = 2048
CP, PP = 2, 4
WORKERS = 2
GROUP = 16  # sources per loader process
WINDOW = 64  # samples of read-ahead per source in mixplane
STEPS = 6
# rows in each Source Loader's page-shuffle buffer: 256, the record batches the baseline reader hands out.
# (The loaders still read pages in random order, a shuffle the baseline does not have at all; the spec's
# default of 10,000 rows is measured too, for the headline configuration, and printed before the table.)
SHUFFLE_BUFFER = 256


# ------------------------------------------------------------------------------------------ data
def make_sources(root: Path, m: int, rg_mb: float, rgs: int = 2) -> list[str]:
    """m Parquet files of `rgs` row groups of about rg_mb MB of token ids each (cached)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = root / f"src-rg{rg_mb:g}"
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    tok_per_rg = int(rg_mb * (1 << 20) / 4)
    for i in range(m):
        p = d / f"s{i:03d}.parquet"
        paths.append(str(p))
        if p.exists():
            continue
        rng = np.random.default_rng(i)
        tables = []
        for _ in range(rgs):
            lens = np.clip(rng.lognormal(6.3, 0.9, size=tok_per_rg // 500 + 8).astype(np.int64), 8, 16384)
            lens = lens[: np.searchsorted(np.cumsum(lens), tok_per_rg) + 1]
            vals = rng.integers(0, 50_000, size=int(lens.sum()), dtype=np.int32)
            off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            tables.append(pa.table({"tokens": pa.ListArray.from_arrays(pa.array(off), pa.array(vals))}))
        tmp = p.with_suffix(".tmp")
        with pq.ParquetWriter(tmp, tables[0].schema, compression="zstd", write_page_index=True) as w:
            for t in tables:
                w.write_table(t, row_group_size=len(t))
        os.replace(tmp, p)
    return paths


# ------------------------------------------------------------------------------------------ roles
def role_idle() -> None:
    import numpy  # noqa: F401
    import torch  # noqa: F401

    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM})


def role_baseline(paths: list[str], rank: int, world: int) -> None:
    """One trainer rank with the baseline DataLoader."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    class MixedSources(IterableDataset):
        def __init__(self, paths, rows, seed):
            self.paths, self.rows, self.seed = paths, rows, seed

        def __iter__(self):
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            shard, nshard = rank * nw + wid, world * nw
            rng = np.random.default_rng(self.seed + shard)
            files = [pq.ParquetFile(p) for p in self.paths]  # every worker opens every source

            def docs(f):
                k = 0
                while True:
                    for rb in f.iter_batches(batch_size=256, columns=["tokens"]):
                        col = rb.column(0)
                        off = col.offsets.to_numpy()
                        vals = col.values.to_numpy()
                        for j in range(len(col)):
                            if k % nshard == shard:
                                yield vals[off[j]:off[j + 1]]
                            k += 1

            its = [docs(f) for f in files]
            carry: list[np.ndarray] = []
            while True:
                out = np.zeros((self.rows, SEQ), dtype=np.int64)
                for r in range(self.rows):
                    fill = 0
                    while fill < SEQ:
                        d = carry.pop() if carry else next(its[int(rng.integers(len(its)))])
                        n = min(len(d), SEQ - fill)
                        out[r, fill:fill + n] = d[:n]
                        fill += n
                        if n < len(d):
                            carry.append(d[n:])
                yield torch.from_numpy(out)

    ds = MixedSources(paths, rows=2, seed=1234)
    dl = DataLoader(ds, batch_size=None, num_workers=WORKERS, prefetch_factor=2, persistent_workers=True)
    it = iter(dl)
    # every source is drawn within the first steps; run until each worker has touched every source
    for _ in range(STEPS + len(paths) // 2):
        next(it)
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM})


def role_mixplane(planner: str, rank: int) -> None:
    import torch  # noqa: F401

    from mixplane.client import MixtureLoader

    loader = MixtureLoader(planner, rank=rank, prefetch=2, timeout_s=300)
    it = iter(loader)
    for _ in range(STEPS):
        next(it)
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM})


# ------------------------------------------------------------------------------------------ measuring
def pss_kb(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def tree(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for p in pids:
        try:
            pr = psutil.Process(p)
            out.append(p)
            out.extend(c.pid for c in pr.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return sorted(set(out))


def measure(pids: list[int], samples: int = 3) -> tuple[float, int]:
    """Peak over a few samples of the PSS summed over the processes and all their descendants (MB)."""
    best, nproc = 0.0, 0
    for _ in range(samples):
        all_pids = tree(pids)
        total = sum(pss_kb(p) for p in all_pids) / 1024
        if total > best:
            best, nproc = total, len(all_pids)
        time.sleep(0.3)
    return best, nproc


def _py(*args: str, env: dict | None = None, reports_ready: bool = True) -> subprocess.Popen:
    """A child whose log goes to an unlinked temporary file, not a pipe: nobody drains a pipe while the
    processes run, and a component blocked on a full 64 KiB stderr pipe (warnings of 16 loader processes)
    stops answering. Only children that print "ready" keep their stdout on a pipe."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(SRC) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update(env or {})
    log = tempfile.TemporaryFile(mode="w+")
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE if reports_ready else subprocess.DEVNULL,
                         stderr=log, text=True, env=e, start_new_session=True)
    p.log = log  # type: ignore[attr-defined]
    return p


def log_tail(p: subprocess.Popen, n: int = 3000) -> str:
    log = p.log  # type: ignore[attr-defined]
    log.seek(0)
    return log.read()[-n:]


def wait_ready(procs: list[subprocess.Popen], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"{what}: process exited with {p.returncode}: {log_tail(p)}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: not ready within {timeout:.0f}s")
            import select
            r, _, _ = select.select([p.stdout], [], [], min(left, 1.0))
            if r:
                line = p.stdout.readline()
                if line.strip() == "ready":
                    break


def stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)
        p.log.close()  # type: ignore[attr-defined]


def run_idle(r: int) -> float:
    procs = [_py(__file__, "--role", "idle") for _ in range(r)]
    try:
        wait_ready(procs, 300, "idle trainers")
        return measure([p.pid for p in procs])[0]
    finally:
        stop_all(procs)


def run_baseline(paths: list[str], r: int) -> tuple[float, int]:
    pl = json.dumps(paths)
    procs = [_py(__file__, "--role", "baseline", "--paths", pl, "--rank", str(i), "--world", str(r)) for i in range(r)]
    try:
        wait_ready(procs, 900, f"baseline R={r} M={len(paths)}")
        return measure([p.pid for p in procs])
    finally:
        stop_all(procs)


def mixture_spec(paths: list[str], r: int, run_dir: str, shadows: int = 0) -> dict:
    dp = max(1, r // (CP * PP))
    return {
        "name": "membench",
        "sources": [{"name": f"s{i:03d}", "uri": p, "kind": "tokens", "columns": ["tokens"],
                     "shuffle_buffer": SHUFFLE_BUFFER} for i, p in enumerate(paths)],
        "batch": {"sequences": 2 * dp, "seq_len": SEQ, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": dp, "pp": PP, "cp": CP, "tp": 1}}, "ranks_per_node": r},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": WINDOW, "constructors": "per_node", "metrics": False, "prefetch_steps": 2,
                    "run_dir": run_dir, **({"shadow_loaders": shadows} if shadows else {})},
    }


def run_mixplane(paths: list[str], r: int, workdir: Path, shadows: int = 0) -> tuple[float, int]:
    """PSS of the whole mixplane side (and the trainers); `shadows` hot standby loader processes per loader
    group (runtime.shadow_loaders: same partitions, warm windows, nothing sent until promoted)."""
    from mixplane.spec import parse_spec

    run_dir = Path(tempfile.mkdtemp(prefix="mixplane-mem-", dir=workdir))
    spec = parse_spec(mixture_spec(paths, r, str(run_dir), shadows))
    spec_file = run_dir / "spec.json"
    spec_file.write_text(spec.model_dump_json())
    procs: list[subprocess.Popen] = []
    try:
        ready = run_dir / "planner.ready"
        procs.append(_py("-m", "mixplane.cli", "planner", "--spec", str(spec_file), "--ready-file", str(ready),
                         "--bind", "tcp://127.0.0.1:*", "--run-dir", str(run_dir), reports_ready=False))
        deadline = time.monotonic() + 60
        while not ready.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"planner did not start: {log_tail(procs[0], 2000)}")
            time.sleep(0.05)
        ep = json.loads(ready.read_text())["endpoint"]
        procs.append(_py("-m", "mixplane.cli", "constructor", "--spec", str(spec_file), "--index", "0", "--planner", ep, reports_ready=False))
        names = [s.name for s in spec.sources]
        for g in range(0, len(names), GROUP):
            group = ",".join(names[g:g + GROUP])
            procs.append(_py("-m", "mixplane.cli", "loader", "--spec", str(spec_file), "--planner", ep,
                             "--sources", group, "--host-name", f"loaders-{g}", reports_ready=False))
            for i in range(shadows):
                procs.append(_py("-m", "mixplane.cli", "loader", "--spec", str(spec_file), "--planner", ep,
                                 "--sources", group, "--host-name", f"loaders-{g}-shadow{i + 1}", "--shadow",
                                 reports_ready=False))
        ranks = [_py(__file__, "--role", "mixplane", "--planner", ep, "--rank", str(i)) for i in range(r)]
        procs.extend(ranks)
        wait_ready(ranks, 900, f"mixplane R={r} M={len(paths)}")
        return measure([p.pid for p in procs])
    finally:
        stop_all(procs)


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="finish within 60 s (smaller data, more extrapolation)")
    ap.add_argument("--budget-gb", type=float, default=9.0, help="largest baseline run to measure directly")
    ap.add_argument("--shadows", action="store_true", help="also measure every mixplane row with one shadow "
                    "loader per loader group (runtime.shadow_loaders: 1) and report the cost")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "mixplane-bench-memory"))
    ap.add_argument("--role", help=argparse.SUPPRESS)
    ap.add_argument("--paths", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--planner", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "idle":
        return role_idle()
    if args.role == "baseline":
        return role_baseline(json.loads(args.paths), args.rank, args.world)
    if args.role == "mixplane":
        return role_mixplane(args.planner, args.rank)

    root = Path(args.data_dir)
    root.mkdir(parents=True, exist_ok=True)
    ranks_list, sources_list = [8, 16], [8, 32, 128]
    rg_mb = 1.0 if args.quick else 5.0
    all_paths = make_sources(root, max(sources_list), rg_mb)
    budget_mb = args.budget_gb * 1024
    # baseline estimate for the budget check: per rank a main process plus w workers holding ~2 row groups per source
    est = lambda r, m: r * (60 + WORKERS * (60 + 2.2 * rg_mb * m))  # noqa: E731

    idle: dict[int, float] = {}

    def idle_mb(r: int) -> float:
        if r not in idle:
            idle[r] = run_idle(r)
        return idle[r]

    def baseline(paths: list[str], r: int, note: str = "") -> float:
        tot, n = run_baseline(paths, r)
        print(json.dumps({"side": "baseline", "ranks": r, "sources": len(paths), "pss_total_mb": round(tot, 1),
                          "idle_trainers_mb": round(idle_mb(r), 1), "processes": n, **({"note": note} if note else {})}),
              flush=True)
        return tot - idle_mb(r)

    small_r = 1 if args.quick else 2
    rows = []
    shadow_mb: dict[tuple[int, int], float] = {}
    for m in sources_list:
        paths = all_paths[:m]
        per_rank: float | None = None  # loader-side MB per baseline rank, from a smaller measured run
        for r in ranks_list:
            mp = None
            if not args.quick or (r == 8 and m == 32):
                tot, n = run_mixplane(paths, r, root)
                mp = tot - idle_mb(r)
                print(json.dumps({"side": "mixplane", "ranks": r, "sources": m, "pss_total_mb": round(tot, 1),
                                  "idle_trainers_mb": round(idle_mb(r), 1), "processes": n}), flush=True)
                if args.shadows:
                    tot_s, n_s = run_mixplane(paths, r, root, shadows=1)
                    shadow_mb[(r, m)] = tot_s - idle_mb(r)
                    print(json.dumps({"side": "mixplane+shadows", "ranks": r, "sources": m, "pss_total_mb": round(tot_s, 1),
                                      "shadow_loaders": 1, "loader_groups": -(-m // GROUP), "processes": n_s}), flush=True)
            if not args.quick and est(r, m) <= budget_mb:
                base, extrap = baseline(paths, r), False
                per_rank = base / r
            else:
                if per_rank is None:
                    per_rank = baseline(paths, small_r, "measured for extrapolation") / small_r
                base, extrap = per_rank * r, True
            rows.append({"ranks": r, "sources": m, "baseline_rss_mb": round(base, 1),
                         "mixplane_rss_mb": None if mp is None else round(mp, 1), "extrapolated": extrap})
    if not args.quick:  # sensitivity: the headline configuration with the spec's default shuffle buffer
        global SHUFFLE_BUFFER
        saved, SHUFFLE_BUFFER = SHUFFLE_BUFFER, 10000
        tot, n = run_mixplane(all_paths[:128], 16, root)
        SHUFFLE_BUFFER = saved
        head = next((x for x in rows if x["ranks"] == 16 and x["sources"] == 128), None)
        side = tot - idle_mb(16)
        print(json.dumps({"side": "mixplane", "ranks": 16, "sources": 128, "shuffle_buffer": 10000,
                          "pss_total_mb": round(tot, 1), "loader_side_mb": round(side, 1),
                          "ratio": round(head["baseline_rss_mb"] / side, 2) if head else None}), flush=True)
    if args.quick:  # mixplane measured once: scale its per-source part, keep its per-rank part
        ref = next(x for x in rows if x["mixplane_rss_mb"] is not None)
        for x in rows:
            if x["mixplane_rss_mb"] is None:
                x["mixplane_rss_mb"] = round(ref["mixplane_rss_mb"] * (0.5 + 0.5 * x["sources"] / ref["sources"]), 1)
                x["extrapolated"] = True
    for x in rows:
        x["ratio"] = round(x["baseline_rss_mb"] / x["mixplane_rss_mb"], 2) if x["mixplane_rss_mb"] else None
        key = (x["ranks"], x["sources"])
        if key in shadow_mb:  # measured, not extrapolated: seed 001 leaves shadows out of its figures; both here
            sh = shadow_mb[key]
            x.update(mixplane_with_shadows_mb=round(sh, 1), shadow_cost_mb=round(sh - x["mixplane_rss_mb"], 1),
                     shadow_cost_per_group_mb=round((sh - x["mixplane_rss_mb"]) / -(-x["sources"] // GROUP), 1),
                     ratio_with_shadows=round(x["baseline_rss_mb"] / sh, 2))
    cols = ("ranks", "sources", "baseline_rss_mb", "mixplane_rss_mb", "ratio", "extrapolated")
    extra = ("mixplane_with_shadows_mb", "shadow_cost_mb", "shadow_cost_per_group_mb", "ratio_with_shadows")
    rows = [{k: x[k] for k in (*cols, *(e for e in extra if e in x))}
            for x in sorted(rows, key=lambda x: (x["ranks"], x["sources"]))]
    print(json.dumps({"rows": rows}), flush=True)


if __name__ == "__main__":
    main()
