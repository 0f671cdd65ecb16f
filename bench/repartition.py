"""Re-partition benchmark (issue 20 item 4): how long trainers wait when a running source is re-partitioned.

    python bench/repartition.py [--quick] [--steps N] [--pause S]

One mixture (3 token sources, source a in 2 partitions, 2 ranks, 8 x 256-token rows per step) runs with the
embedded runtime; trainer ranks are threads consuming their steps with a fixed compute time per step. Runs:

* reference — no re-partition: the median step gap, and the longest gap over the steps around the point where the
  other runs re-partition (what the machine's noise alone gives);
* to_3 / to_1 — a third of the way in, `EmbeddedRuntime.repartition("a", M)` (a loader process started first for a
  new partition, off the trainers' path), applied at the first step not planned yet.

Stall = the longest gap any rank waited for a step between the step before the change and 15 steps after it
(the raw wait a trainer sees). `applied_after_s`: from the request to the planner applying it (it holds planning
at the step until every earlier step is complete at every constructor).

Last stdout line: {"steps", "pause_s", "median_step_gap_s", "reference_max_gap_s", "stall_s": {run: s},
"applied_after_s": {run: s}, "at_step": {run: step}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

from failover import RANKS, Ranks, write_sources  # noqa: E402
from mixplane.runtime import EmbeddedRuntime  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402

AFTER = 15  # steps after the change whose gaps count


def spec(root: Path):
    return parse_spec({
        "name": "repartition",
        "sources": [{"name": n, "uri": str(root / n), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup",
                     **({"replicas": 2} if n == "a" else {})} for n in ("a", "b", "c")],
        "mixture": {"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 7},
        "batch": {"sequences": 8, "seq_len": 256, "microbatches": 2},
        "topology": {"modules": {"backbone": {"dp": RANKS}}},
        "strategy": {"name": "vanilla"},
        "runtime": {"window": 64, "metrics": False},
    })


def window_gap(ranks: Ranks, lo: int, hi: int) -> float:
    return max(float(np.max(np.diff(ranks.times[r][max(lo, 0):hi]))) for r in range(RANKS))


def run(root: Path, work: Path, name: str, steps: int, pause_s: float, at: int, to: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with EmbeddedRuntime(spec(root), work / name, log_level="WARNING") as rt:
        ranks = Ranks(rt.planner_endpoint or "", steps, pause_s)
        while ranks.delivered() < at and not ranks.errors:
            time.sleep(0.005)
        if to is not None:
            t0 = time.monotonic()
            entry = rt.repartition("a", to, wait=True)
            out["request_s"] = round(time.monotonic() - t0, 3)  # hosts started + applied
            out["applied_after_s"] = entry["applied_after_s"]
            out["at_step"] = int(entry["step"])
        ranks.join()
        out["source_partitions"] = rt.status()["source_partitions"]["a"]
    s = out.get("at_step", at + 8)
    out["max_gap_s"] = round(window_gap(ranks, s - 1, s + AFTER), 3)
    gaps = [float(x) for r in range(RANKS) for x in np.diff(ranks.times[r])]
    out["median_gap_s"] = statistics.median(gaps) if gaps else 0.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (about a minute)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--pause", type=float, default=0.05, help="trainer compute time per step (s)")
    args = ap.parse_args()
    steps = args.steps or (120 if args.quick else 200)  # the change applies at the first step not planned: ~40 ahead
    at = steps // 3
    with tempfile.TemporaryDirectory(prefix="mixplane-repartition-") as tmp:
        work = Path(tmp)
        write_sources(work / "data")
        results = {}
        for name, to in (("reference", None), ("to_3", 3), ("to_1", 1)):
            results[name] = run(work / "data", work, name, steps, args.pause, at, to)
            print(json.dumps({"run": name, **results[name]}), flush=True)
    runs = [n for n in results if n != "reference"]
    print(json.dumps({
        "steps": steps, "pause_s": args.pause, "median_step_gap_s": round(results["reference"]["median_gap_s"], 3),
        "reference_max_gap_s": results["reference"]["max_gap_s"],
        "stall_s": {n: results[n]["max_gap_s"] for n in runs},
        "applied_after_s": {n: results[n]["applied_after_s"] for n in runs},
        "at_step": {n: results[n]["at_step"] for n in runs},
    }))


if __name__ == "__main__":
    main()
