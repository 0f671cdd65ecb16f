"""Benchmark: the cost model against measured time (seed 001 Fig. 19 left), before and after calibration.

`mixplane calibrate` times one transformer layer of the model (forward + backward, causal attention per document)
on packed microbatches and fits seconds per token-wise FLOP, per attention-pair FLOP and per document. Here:

1. fit on `--train` microbatches (the calibration's own mix: pure cases and log-uniform documents);
2. on `--eval` *other* microbatches -- documents drawn from the demo corpus' token lengths (code, man pages, Debian
   docs: heavy-tailed), packed into rows of seq_len -- measure each one's time and compare it with
   * the calibrated prediction, and
   * the FLOPs-only model with the one time-per-FLOP factor that fits the training microbatches best (what the
     planner assumed before: every FLOP takes the same time);
   relative error |predicted / measured - 1|, median and p95;
3. (full run) bench/balance.py --quick with and without the calibration: the simulated speed-ups of balancing
   recomputed with the calibrated model.

The model: a Llama-8B-like backbone (h 4096, 32 layers, 32 heads, 8 KV heads, gated MLP), timed on this CPU at
hidden 256 (one factor; head dim and the GQA ratio kept) on one thread -- on a GPU machine the same script runs
at full width with --device cuda. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from mixplane.calibrate import device_name, layer_flops, measured_dims, microbatches, time_layer  # noqa: E402
from mixplane.planner.cost import fit_calibration, microbatch_features  # noqa: E402
from mixplane.spec import CostCalibration, ModelDims  # noqa: E402

MODEL = ModelDims(hidden=4096, layers=32, heads=32, kv_heads=8, vocab=128256)


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def errors(pred: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    rel = np.abs(pred / measured - 1.0)
    return {"median_rel_error": round(float(np.median(rel)), 4), "p95_rel_error": round(float(np.percentile(rel, 95)), 4),
            "max_rel_error": round(float(rel.max()), 4)}


def demo_lengths() -> np.ndarray:
    """The demo corpus' document lengths in tokens (bench/balance.py builds and caches them)."""
    sys.path.insert(0, str(HERE))
    from balance import demo_lengths as lengths

    return np.concatenate(list(lengths().values())).astype(np.int64)


def balance_speedups(calibration: dict | None) -> list[dict]:
    cmd = [sys.executable, str(HERE / "balance.py"), "--quick"]
    tmp = None
    if calibration is not None:
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(calibration, tmp)
        tmp.close()
        cmd += ["--calibration", tmp.name]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
    finally:
        if tmp is not None:
            os.unlink(tmp.name)
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    return [{k: r.get(k) for k in ("gpus", "seq", "dist", "imbalance_vanilla", "imbalance_greedy", "simulated_speedup")}
            for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter microbatches and no balance runs (< 1 min)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per microbatch (default 2048, quick 1024)")
    ap.add_argument("--max-hidden", type=int, default=256)
    ap.add_argument("--train", type=int, default=None)
    ap.add_argument("--eval", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    seq = args.seq_len or (512 if args.quick else 2048)
    n_train = args.train or (8 if args.quick else 16)
    n_eval = args.eval or (8 if args.quick else 24)
    repeats = 2 if args.quick else args.repeats
    small = measured_dims(MODEL, None if args.device.startswith("cuda") else args.max_hidden)
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    train_docs = microbatches(seq, np.random.default_rng(1), n_train)
    eval_docs = microbatches(seq, np.random.default_rng(2), n_eval + 4, demo_lengths())[4:]  # not the pure cases
    # timed in one pass, training and held-out microbatches interleaved at random: a shared machine's load drifts,
    # and it must not favour one set
    both = train_docs + eval_docs
    order = np.random.default_rng(3).permutation(len(both))
    timed = time_layer(small, [both[i] for i in order], device=args.device, repeats=repeats)
    seconds = np.empty(len(both))
    seconds[order] = timed.seconds
    train_s, held_s = seconds[:n_train], seconds[n_train:]
    flops = layer_flops(small)
    Xt = microbatch_features(flops, train_docs)
    a, b, c = fit_calibration(Xt, train_s, pair_fallback=True)
    log(f"timed {len(both)} microbatches in {time.perf_counter() - t0:.1f}s; fitted on {n_train}: {a:.3e} s/linear "
        f"FLOP, {b:.3e} s/pair FLOP, {c * 1e3:.3f} ms/document/layer")
    Xe = microbatch_features(flops, eval_docs)
    calibrated = Xe @ np.array([a, b, c])
    # FLOPs only: one seconds-per-FLOP factor, the best in relative terms on the same training microbatches
    ft, fe = Xt[:, 0] + Xt[:, 1], Xe[:, 0] + Xe[:, 1]
    r = ft / train_s
    scale = float(np.sum(r) / np.sum(r * r))
    flops_only = scale * fe
    cal = CostCalibration(linear_s_per_flop=a, pair_s_per_flop=b, document_s=c * MODEL.layers,
                          device=device_name(args.device),
                          measured_hidden=small.hidden if small.hidden != MODEL.hidden else None)
    row = {"device": cal.device, "model": "llama-8b-like", "measured_hidden": small.hidden, "seq_len": seq,
           "train_microbatches": n_train, "eval_microbatches": n_eval, "repeats": repeats,
           "load_avg": round(load, 2), "eval_docs_per_microbatch": round(float(np.mean([len(d) for d in eval_docs])), 1),
           "calibrated": errors(calibrated, held_s), "flops_only": errors(flops_only, held_s),
           "coefficients": {"linear_s_per_flop": a, "pair_s_per_flop": b, "document_s_per_layer": c},
           "attention_flop_cost_vs_linear": round(b / a, 3)}
    log(f"held-out ({n_eval}, demo corpus lengths): calibrated {row['calibrated']}, FLOPs only {row['flops_only']}")
    if not args.quick:
        cal_json = cal.model_dump(mode="json")
        before = balance_speedups(None)
        after = balance_speedups(cal_json)
        row["balance_speedups"] = [{"gpus": x["gpus"], "seq": x["seq"], "dist": x["dist"],
                                    "flops": x["simulated_speedup"], "calibrated": y["simulated_speedup"]}
                                   for x, y in zip(before, after)]
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
