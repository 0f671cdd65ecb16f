"""End-to-end data plane benchmark: mixplane vs the way people do it today (issue 2).

mixplane: the demo mixture (3 real sources) delivered to DP=4 client ranks at seq_len 2048 by the
embedded runtime (one Source Loader per source, one Data Constructor for the node, the planner).
baseline: 4 rank processes, each with a PyTorch DataLoader (2 workers) whose IterableDataset opens
every source with pyarrow, mixes by weight, tokenizes on the fly (batched) and packs
concat-and-chunk rows of seq_len — a careful version of today's per-rank loaders.

Both: each rank consumes STEPS batches of ROWS rows and touches every tensor. Measured: tokens/s
delivered (non-padding tokens, all ranks, from the first request to the last batch), CPU seconds
per million tokens over every process involved (ranks, workers, data-plane components), and the
peak of the summed RSS of all those processes (sampled every 50 ms).

    python bench/e2e.py [--quick] [--steps N] [--repeats K] [--security secure|open|both]
Each side runs K times, interleaved; the figures are medians. Last stdout line: {"mixplane": {...}, "baseline": {...}, "throughput_ratio": .., "memory_ratio": ..}
mixplane runs with the runtime's default (`runtime.security: secure`: CURVE on every socket, keys per role);
`--security open` measures the open configuration instead, `both` runs the two interleaved and adds
"mixplane_open" and "secure_cost" (open / secure tokens/s and secure / open CPU per Mtok).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RANKS = 4
ROWS = 4  # rows per rank per step
SEQ = 2048
WEIGHTS = {"code": 0.2, "man": 0.3, "docs": 0.5}


def cpu_seconds_self_and_children() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


# ---- rank processes ---------------------------------------------------------------------

def mixplane_rank(rank: int, steps: int, out: str) -> None:
    from mixplane.client import MixtureLoader

    loader = MixtureLoader(rank=rank, max_steps=steps, prefetch=2, timeout_s=300)
    tokens = 0
    checksum = 0
    t0 = time.time()
    for b in loader:
        tokens += int((b["source_ids"] >= 0).sum())
        checksum += int(b["input_ids"][:, :8].sum()) + int(b["labels"][:, -1].sum()) + int(b["position_ids"][:, -1].sum())
    t1 = time.time()
    loader.close()
    Path(out).write_text(json.dumps({"tokens": tokens, "t0": t0, "t1": t1, "cpu": cpu_seconds_self_and_children(), "checksum": checksum}))


def baseline_rank(rank: int, steps: int, out: str, data: str, seed: int = 0) -> None:
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info

    names = list(WEIGHTS)
    weights = [WEIGHTS[n] for n in names]

    class MixedTokenStream(IterableDataset):
        """Per worker: every source open with pyarrow, documents mixed by weight, tokenized, packed."""

        def __iter__(self):
            from tokenizers import Tokenizer

            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            shard, nshards = rank * nw + wid, RANKS * nw
            tok = Tokenizer.from_file(os.path.join(data, "tokenizer.json"))
            eos = tok.token_to_id("<|endoftext|>")
            rng = np.random.default_rng(seed + shard)

            def documents(name: str):
                files = sorted(Path(data, name).glob("*.parquet"))
                units = [(f, rg) for f in files for rg in range(pq.ParquetFile(f).metadata.num_row_groups)]
                mine = units[shard % len(units) :: nshards] or units
                while True:
                    for f, rg in mine:
                        pf = pq.ParquetFile(f)
                        for batch in pf.iter_batches(batch_size=64, row_groups=[rg], columns=["text"]):
                            texts = batch.column(0).to_pylist()
                            for enc in tok.encode_batch_fast(texts, add_special_tokens=False):
                                yield enc.ids + [eos]

            readers = [documents(n) for n in names]
            buf: list[int] = []
            while True:
                src = int(rng.choice(len(names), p=weights))
                buf.extend(next(readers[src]))
                while len(buf) >= SEQ + 1:
                    row = torch.tensor(buf[: SEQ + 1], dtype=torch.int64)
                    buf = buf[SEQ:]
                    yield {"input_ids": row[:-1], "labels": row[1:], "position_ids": torch.arange(SEQ)}

    dl = DataLoader(MixedTokenStream(), batch_size=ROWS, num_workers=2, prefetch_factor=2)
    tokens = 0
    checksum = 0
    t0 = time.time()
    it = iter(dl)
    for _ in range(steps):
        b = next(it)
        tokens += int(b["input_ids"].numel())
        checksum += int(b["input_ids"][:, :8].sum()) + int(b["labels"][:, -1].sum()) + int(b["position_ids"][:, -1].sum())
    t1 = time.time()
    del it  # shuts the workers down, so their CPU time is counted in RUSAGE_CHILDREN
    Path(out).write_text(json.dumps({"tokens": tokens, "t0": t0, "t1": t1, "cpu": cpu_seconds_self_and_children(), "checksum": checksum}))


# ---- harness ----------------------------------------------------------------------------

class TreeSampler:
    """Peak of the summed RSS of a set of process trees, sampled in the background."""

    def __init__(self, roots_fn, period: float = 0.05):
        import psutil

        self.psutil = psutil
        self.roots_fn = roots_fn
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            seen = set()
            for root in self.roots_fn():
                try:
                    procs = [root, *root.children(recursive=True)]
                except self.psutil.NoSuchProcess:
                    continue
                for p in procs:
                    if p.pid in seen:
                        continue
                    seen.add(p.pid)
                    try:
                        total += p.memory_info().rss
                    except self.psutil.NoSuchProcess:
                        pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.period)

    def __enter__(self) -> "TreeSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def run_ranks(role: str, steps: int, tmp: Path, env: dict, extra: list[str]) -> list[dict]:
    procs = []
    for r in range(RANKS):
        out = tmp / f"{role}-{r}.json"
        out.unlink(missing_ok=True)
        procs.append((subprocess.Popen([sys.executable, __file__, "--role", role, "--rank", str(r), "--steps", str(steps),
                                        "--out", str(out), *extra], env={**env, "RANK": str(r), "WORLD_SIZE": str(RANKS)}), out))
    return procs


def collect(procs) -> list[dict]:
    results = []
    for p, out in procs:
        if p.wait() != 0:
            raise SystemExit(f"a rank failed with exit code {p.returncode}")
        results.append(json.loads(out.read_text()))
    return results


def summarize(results: list[dict], extra_cpu: float, peak_rss: int) -> dict:
    tokens = sum(r["tokens"] for r in results)
    wall = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    cpu = sum(r["cpu"] for r in results) + extra_cpu
    return {"tokens_per_s": round(tokens / wall, 1), "cpu_s_per_mtok": round(cpu / (tokens / 1e6), 3),
            "rss_mb": round(peak_rss / 2**20, 1), "tokens": tokens, "wall_s": round(wall, 3), "cpu_s": round(cpu, 2)}


def bench_mixplane(data: Path, steps: int, tmp: Path, security: str = "secure") -> dict:
    import psutil

    from mixplane.runtime import EmbeddedRuntime
    from mixplane.spec import parse_spec

    spec = parse_spec({
        "name": "bench-e2e",
        "sources": [{"name": n, "uri": str(data / n), "tokenizer": str(data / "tokenizer.json")} for n in WEIGHTS],
        "mixture": {"weights": WEIGHTS, "seed": 1},
        "batch": {"sequences": RANKS * ROWS, "seq_len": SEQ, "microbatches": 1, "pad_id": 1},
        "topology": {"modules": {"backbone": {"dp": RANKS}}, "ranks_per_node": 8},
        "strategy": {"name": "llm_balance"},
        "runtime": {"constructors": "per_node", "prefetch_steps": 3, "metrics": False, "security": security},
    })
    with EmbeddedRuntime(spec, tmp / "mixplane-run") as rt:
        comps = [psutil.Process(c.proc.pid) for c in rt.children]
        env = {**os.environ, "MIXPLANE_PLANNER": rt.planner_endpoint, "OMP_NUM_THREADS": "1"}
        procs = run_ranks("mixplane-rank", steps, tmp, env, [])
        ranks = [psutil.Process(p.pid) for p, _ in procs]
        with TreeSampler(lambda: comps + ranks) as sampler:
            results = collect(procs)
        comp_cpu = sum(sum(p.cpu_times()[:2]) for p in comps)
        breakdown = {c.name: {"cpu_s": round(sum(p.cpu_times()[:2]), 2), "rss_mb": round(p.memory_info().rss / 2**20, 1)}
                     for c, p in zip(rt.children, comps)}
    print(f"mixplane components: {json.dumps(breakdown)}", file=sys.stderr)
    print(f"mixplane ranks: cpu_s {[round(r['cpu'], 2) for r in results]}", file=sys.stderr)
    return summarize(results, comp_cpu, sampler.peak)


def bench_baseline(data: Path, steps: int, tmp: Path) -> dict:
    import psutil

    # what careful users set (and HF's fork warning asks for): one tokenizer thread per worker process
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = run_ranks("baseline-rank", steps, tmp, env, ["--data", str(data)])
    ranks = [psutil.Process(p.pid) for p, _ in procs]
    with TreeSampler(lambda: ranks) as sampler:
        results = collect(procs)
    print(f"baseline ranks (with their workers): cpu_s {[round(r['cpu'], 2) for r in results]}", file=sys.stderr)
    return summarize(results, 0.0, sampler.peak)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--repeats", type=int, help="runs of each side, interleaved; medians are reported (default 3, quick 1)")
    ap.add_argument("--data", default=str(ROOT / "bench" / "data" / "demo"))
    ap.add_argument("--role")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--out")
    ap.add_argument("--security", choices=("secure", "open", "both"), default="secure")
    args = ap.parse_args()
    if args.role == "mixplane-rank":
        return mixplane_rank(args.rank, args.steps, args.out)
    if args.role == "baseline-rank":
        return baseline_rank(args.rank, args.steps, args.out, args.data)

    steps = args.steps or (30 if args.quick else 200)
    data = Path(args.data)
    if not (data / "SUMMARY.json").exists():
        from mixplane.demo.data import build_demo_data

        print(f"building demo data in {data}", file=sys.stderr)
        build_demo_data(data, max_mb=8.0 if args.quick else 24.0)
    repeats = args.repeats or (1 if args.quick else 3)
    runs: dict[str, list[dict]] = {"mixplane": [], "baseline": [], "mixplane_open": []}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for i in range(repeats):  # interleaved, so load on the shared machine hits both alike
            runs["mixplane"].append(bench_mixplane(data, steps, tmp, "open" if args.security == "open" else "secure"))
            print(f"mixplane run {i} ({'open' if args.security == 'open' else 'secure'}): {runs['mixplane'][-1]}", file=sys.stderr)
            if args.security == "both":
                runs["mixplane_open"].append(bench_mixplane(data, steps, tmp, "open"))
                print(f"mixplane run {i} (open): {runs['mixplane_open'][-1]}", file=sys.stderr)
            runs["baseline"].append(bench_baseline(data, steps, tmp))
            print(f"baseline run {i}: {runs['baseline'][-1]}", file=sys.stderr)
    mix, base = median_run(runs["mixplane"]), median_run(runs["baseline"])
    out = {"mixplane": mix, "baseline": base, "steps": steps, "ranks": RANKS, "seq_len": SEQ, "repeats": repeats,
           "throughput_ratio": round(mix["tokens_per_s"] / base["tokens_per_s"], 3),
           "memory_ratio": round(base["rss_mb"] / mix["rss_mb"], 3),
           "throughput_ratio_per_run": [round(m["tokens_per_s"] / b["tokens_per_s"], 3)
                                        for m, b in zip(runs["mixplane"], runs["baseline"])],
           "security": args.security}
    if runs["mixplane_open"]:
        op = median_run(runs["mixplane_open"])
        out["mixplane_open"] = op
        out["secure_cost"] = {"throughput_open_over_secure": round(op["tokens_per_s"] / mix["tokens_per_s"], 3),
                              "cpu_per_mtok_secure_over_open": round(mix["cpu_s_per_mtok"] / op["cpu_s_per_mtok"], 3)}
    print(json.dumps(out))


def median_run(runs: list[dict]) -> dict:
    """Median of each figure over repeated runs."""
    import statistics

    keys = ("tokens_per_s", "cpu_s_per_mtok", "rss_mb", "tokens", "wall_s", "cpu_s")
    return {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}


if __name__ == "__main__":
    main()
