"""Loader failover benchmark (issue 11 items 2-3): how long trainers wait when a loader process fails.

    python bench/failover.py [--quick] [--steps N] [--pause S] [--failover-after S]

One mixture (3 token sources, 2 ranks, 8 x 256-token rows per step) runs with the embedded runtime; trainer
ranks are threads consuming their steps with a fixed compute time per step. Runs:

* reference — no failure: the batches every other run must equal, and the median step gap;
* no_shadow_sigkill — the loader process of source a is SIGKILLed; the runtime's supervision restarts it
  (no backoff) and the planner resends what was planned for it (a new interpreter, a cold window);
* shadow_sigkill / shadow_sigstop — `runtime.shadow_loaders: 1`: the primary of a is SIGKILLed / SIGSTOPped;
  the planner finds its host silent after `runtime.failover_after_s` and hands the partition to the shadow
  (a running process with a warm window). The stopped one is resumed later and must deliver nothing.

Stall = the longest gap any rank waited for a step across the failure (from the signal to its next step,
and between later steps), minus nothing: the raw wait a trainer sees. Every run's batches are compared
with the reference (input_ids, labels and segments of every rank and step).

Last stdout line: {"steps", "pause_s", "failover_after_s", "median_step_gap_s", "stall_s": {run: s},
"promoted_after_s": {run: s}, "batches_equal": {run: bool}, "failover_handoffs": {run: n}}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from mixplane.client import MixtureLoader  # noqa: E402
from mixplane.runtime import EmbeddedRuntime, RestartPolicy  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402

RANKS = 2
KEYS = ("input_ids", "labels", "source_ids", "segment_source", "segment_key", "segment_start")


def write_sources(root: Path) -> None:
    for name, rows, mean, seed in (("a", 3000, 60, 1), ("b", 2000, 150, 2), ("c", 1500, 400, 3)):
        rng = np.random.default_rng(seed)
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        lens = np.maximum(1, rng.lognormal(np.log(mean), 0.9, rows).astype(np.int64))
        docs = [rng.integers(3, 1000, n, dtype=np.int32) for n in lens]
        for f in range(2):
            part = docs[f * rows // 2 : (f + 1) * rows // 2]
            pq.write_table(pa.table({"tokens": pa.array(part, type=pa.list_(pa.int32()))}), d / f"part-{f}.parquet",
                           row_group_size=200, write_page_index=True)


def spec(root: Path, **runtime: Any):
    return parse_spec({
        "name": "failover",
        "sources": [{"name": n, "uri": str(root / n), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"}
                    for n in ("a", "b", "c")],
        "mixture": {"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 7},
        "batch": {"sequences": 8, "seq_len": 256, "microbatches": 2},
        "topology": {"modules": {"backbone": {"dp": RANKS}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": 64, "metrics": False, **runtime},
    })


class Ranks:
    def __init__(self, endpoint: str, steps: int, pause_s: float):
        self.got: dict[int, list[dict[str, np.ndarray]]] = {r: [] for r in range(RANKS)}
        self.times: dict[int, list[float]] = {r: [] for r in range(RANKS)}
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(endpoint, r, steps, pause_s), daemon=True)
                        for r in range(RANKS)]
        for t in self.threads:
            t.start()

    def _run(self, endpoint: str, r: int, steps: int, pause_s: float) -> None:
        try:
            with MixtureLoader(endpoint, rank=r, max_steps=steps, timeout_s=120) as loader:
                for b in loader:
                    self.got[r].append({k: b[k].numpy().copy() for k in KEYS})
                    self.times[r].append(time.monotonic())
                    time.sleep(pause_s)
        except BaseException as e:  # noqa: BLE001 - reported by join
            self.errors.append(e)

    def delivered(self) -> int:
        return min(len(v) for v in self.got.values())

    def join(self) -> None:
        for t in self.threads:
            t.join(300)
        if self.errors:
            raise self.errors[0]


def same(a: dict[int, list[dict]], b: dict[int, list[dict]]) -> bool:
    return all(len(a[r]) == len(b[r]) and all(np.array_equal(x[k], y[k]) for x, y in zip(a[r], b[r]) for k in KEYS)
               for r in range(RANKS))


def stall(ranks: Ranks, at: dict[int, int], t0: float) -> float:
    return max(float(np.max(np.diff([t0, *ranks.times[r][at[r]:]]))) for r in range(RANKS))


def run(root: Path, work: Path, name: str, steps: int, pause_s: float, failover_after_s: float,
        kill_at: int) -> dict[str, Any]:
    shadow = name.startswith("shadow")
    how = signal.SIGSTOP if name.endswith("sigstop") else signal.SIGKILL
    sp = spec(root, failover_after_s=failover_after_s, **({"shadow_loaders": 1} if shadow else {}))
    policy = RestartPolicy(budget=5, backoff_s=0.0) if name != "reference" else None
    out: dict[str, Any] = {}
    with EmbeddedRuntime(sp, work / name, restart=policy, log_level="WARNING") as rt:
        if shadow:
            deadline = time.monotonic() + 60
            while not rt.partitions()["partitions"]["a:0"]["shadows"]:
                assert time.monotonic() < deadline, "no shadow followed a:0"
                time.sleep(0.05)
        ranks = Ranks(rt.planner_endpoint or "", steps, pause_s)
        if name != "reference":
            while ranks.delivered() < kill_at and not ranks.errors:
                time.sleep(0.005)
            a0 = rt.partitions()["partitions"]["a:0"]
            victim = next(c for c in rt.children if c.name == a0["host"])
            at = {r: len(ranks.times[r]) for r in range(RANKS)}
            t0 = time.monotonic()
            os.kill(victim.proc.pid, how)
            if shadow:
                while rt.partitions(timeout_s=10)["partitions"]["a:0"]["host"] == a0["host"]:
                    time.sleep(0.005)
                out["promoted_after_s"] = round(time.monotonic() - t0, 3)
            if how == signal.SIGSTOP:
                time.sleep(1.0)
                os.kill(victim.proc.pid, signal.SIGCONT)
            while any(t.is_alive() for t in ranks.threads):
                rt.supervise()  # restarts the SIGKILLed process (no shadow: it serves again; shadow: the new shadow)
                time.sleep(0.02)
        ranks.join()
        if name != "reference":
            out["stall_s"] = round(stall(ranks, at, t0), 3)
        st = rt.status()
        out["failover_handoffs"] = sum(1 for h in st.get("handoffs", []) if h.get("reason") == "failover")
    out["got"] = ranks.got
    gaps = [float(x) for r in range(RANKS) for x in np.diff(ranks.times[r])]
    out["median_gap_s"] = statistics.median(gaps) if gaps else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--pause", type=float, default=0.05, help="trainer compute time per step (s)")
    ap.add_argument("--failover-after", type=float, default=1.0, help="runtime.failover_after_s")
    args = ap.parse_args()
    steps = args.steps or (30 if args.quick else 60)
    kill_at = steps // 3
    with tempfile.TemporaryDirectory(prefix="mixplane-failover-") as tmp:
        work = Path(tmp)
        write_sources(work / "data")
        results = {}
        for name in ("reference", "no_shadow_sigkill", "shadow_sigkill", "shadow_sigstop"):
            results[name] = run(work / "data", work, name, steps, args.pause, args.failover_after, kill_at)
            r = results[name]
            print(json.dumps({"run": name, **{k: v for k, v in r.items() if k not in ("got",)}}), flush=True)
    ref = results["reference"]["got"]
    runs = [n for n in results if n != "reference"]
    print(json.dumps({
        "steps": steps, "pause_s": args.pause, "failover_after_s": args.failover_after,
        "median_step_gap_s": round(results["reference"]["median_gap_s"], 3),
        "stall_s": {n: results[n]["stall_s"] for n in runs},
        "promoted_after_s": {n: results[n]["promoted_after_s"] for n in runs if "promoted_after_s" in results[n]},
        "batches_equal": {n: same(results[n]["got"], ref) for n in runs},
        "failover_handoffs": {n: results[n]["failover_handoffs"] for n in runs},
    }))


if __name__ == "__main__":
    main()
