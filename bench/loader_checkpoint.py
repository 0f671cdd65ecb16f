"""Differential checkpointing of loaders (seed 001 §6.1, Fig. 11; issue 11 item 4): recovery time against K.

    python bench/loader_checkpoint.py [--quick] [--data DIR] [--ks 1,4,16,64,256]

A Source Loader of the demo's `man` source (real text, a real BPE tokenizer: every sample read is
tokenized) is restarted after a failure. Its partition is consumed in stream order, `tokens_per_step`
tokens a step; the planner keeps the last `inflight` steps for a resend (planner.inflight). The loader
snapshots every K steps (loader.snapshot); the failure comes just before the next snapshot (the worst
case: K - 1 steps since the last one). What a restarted loader must do before it can serve, timed from a
fresh process state (stream opened, tokenizer loaded — both counted as `open_s`, the same for every K):

* `replay` (seed 001's differential checkpointing): restore the snapshot's stream position and replay
  the steps since it — read and tokenize forward to the end of the window it had at the failure (from the
  in-flight steps' position when that is lower: they are resent either way);
* `cursor` (what mixplane does with or without a snapshot): the planner's cursor is exact and a stream
  seek reads no data, so it seeks straight to the lowest position of the in-flight steps and reads from
  there to the same window end — independent of K;
* `snapshot_write_s`: the cost of one snapshot (JSON, atomic rename), and its size.

Last stdout line: {"source", "tokens_per_step", "inflight_steps", "open_s", "cursor_recovery_s",
"by_k": [{"k", "gap_steps", "replay_recovery_s", "replay_samples", "replay_over_cursor"}], "snapshot_write_s",
"snapshot_bytes"}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

import numpy as np  # noqa: E402

from mixplane.loader import snapshot  # noqa: E402
from mixplane.loader.stream import open_stream  # noqa: E402
from mixplane.loader.transforms import make_transform  # noqa: E402
from mixplane.loader.window import LoaderWindow  # noqa: E402
from mixplane.spec import load_spec  # noqa: E402

CACHE = Path.home() / ".cache" / "mixplane" / "launch-demo"
SOURCE = "man"  # 1.7k documents of a few kB: many samples a step, like most sources


def open_window(src, seed: int) -> tuple[LoaderWindow, float]:
    t0 = time.perf_counter()
    stream = open_stream(src, seed=seed)
    w = LoaderWindow(stream, make_transform(src), (8, 4096, 256))
    return w, time.perf_counter() - t0


def layout(src, seed: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and token counts of the partition's samples in stream order, through `tokens` tokens."""
    w, _ = open_window(src, seed)
    w.seek({"low": 0})
    w.read_ahead_tokens = tokens
    while w.read_ahead():
        pass
    pos = np.array([b.pos for b in w.staged], np.int64)
    ntok = np.array([len(b.tokens) for b in w.staged], np.int64)
    return pos, ntok


def recover(src, seed: int, start: int, end: int) -> tuple[float, int]:
    """From a fresh stream: seek to `start`, read and tokenize until position `end` is in hand."""
    w, _ = open_window(src, seed)
    t0 = time.perf_counter()
    w.seek({"low": start})
    w.read_ahead_tokens = 1 << 60
    while w.stream.position <= end and w.read_ahead():
        pass
    return time.perf_counter() - t0, w._read_samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", type=Path, default=CACHE, help="demo data directory (built there if missing)")
    ap.add_argument("--ks", default=None, help="snapshot intervals in steps (default 1,4,16,64[,256])")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args()
    ks = [int(k) for k in (args.ks or ("1,4,16,64" if args.quick else "1,4,16,64,256")).split(",")]
    repeats = args.repeats or (2 if args.quick else 3)
    if not (args.data / "mixture.yaml").exists():
        from mixplane.demo.data import build_demo_data

        print(f"building demo data in {args.data}", file=sys.stderr)
        build_demo_data(args.data, max_mb=8.0)
    spec = load_spec(args.data / "mixture.yaml")
    si = spec.source_index(SOURCE)
    src, seed = spec.sources[si], spec.mixture.seed
    tokens_per_step = int(spec.tokens_per_step)  # as if the partition fed whole steps (more samples per step)
    inflight = spec.runtime.prefetch_steps + 2
    window_tokens = spec.window_bounds(si)[1]
    base = 50  # steps before the first snapshot interval starts (past the few book-length pages at the start)
    worst = max(ks)
    need = (base + 2 * worst + inflight + 4) * tokens_per_step + 2 * window_tokens
    pos, ntok = layout(src, seed, need)
    cum = np.cumsum(ntok)

    def low_at(step: int) -> int:
        """The cursor's low position after `step` steps (the first sample not fully consumed)."""
        i = int(np.searchsorted(cum, step * tokens_per_step, side="right"))
        return int(pos[min(i, len(pos) - 1)])

    def window_end(step: int) -> int:
        i = int(np.searchsorted(cum, step * tokens_per_step + window_tokens, side="right"))
        return int(pos[min(i, len(pos) - 1)])

    _, open_s = open_window(src, seed)
    rows = []
    cursor_times = []
    for k in ks:
        snap_step = base + k  # a snapshot at step base + k; the failure just before the next one
        fail = snap_step + k - 1
        end = window_end(fail)
        # the in-flight steps are resent either way: replay starts at the snapshot or at them, whichever is lower
        replay = [recover(src, seed, min(low_at(snap_step), low_at(max(0, fail - inflight))), end) for _ in range(repeats)]
        cur = [recover(src, seed, low_at(max(0, fail - inflight)), end) for _ in range(repeats)]
        cursor_times += [t for t, _ in cur]
        rt = statistics.median(t for t, _ in replay)
        rows.append({"k": k, "gap_steps": k - 1, "replay_recovery_s": round(rt, 4), "replay_samples": replay[0][1],
                     "cursor_recovery_s": round(statistics.median(t for t, _ in cur), 4),
                     "replay_over_cursor": round(rt / max(1e-9, statistics.median(t for t, _ in cur)), 2)})
        print(json.dumps(rows[-1]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        w, _ = open_window(src, seed)
        w.seek({"low": low_at(base)})
        w.fill()
        cur = snapshot.window_cursor(list(w.buffer), {p: b.done for p, b in w.buffer.items()}, w.stream.position)
        times = []
        for i in range(20):
            t0 = time.perf_counter()
            p = snapshot.write(tmp, snapshot.LoaderSnapshot(SOURCE, 0, 1, 0, base + i, cur.to_json(),
                                                            w.stream.state_dict(), time.time()))
            times.append(time.perf_counter() - t0)
        size = p.stat().st_size
    print(json.dumps({"source": SOURCE, "tokenizer": True, "tokens_per_step": tokens_per_step, "inflight_steps": inflight,
                      "open_s": round(open_s, 4), "cursor_recovery_s": round(statistics.median(cursor_times), 4),
                      "by_k": [{k: v for k, v in r.items() if k != "cursor_recovery_s"} for r in rows],
                      "snapshot_write_s": round(statistics.median(times), 6), "snapshot_bytes": size}))


if __name__ == "__main__":
    main()
