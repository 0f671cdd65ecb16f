"""Framework adapters' overhead per step against the raw MixtureLoader (issue 23).

    python bench/integrations.py [--quick]

Real batches are fetched once from a running data plane (EmbeddedRuntime, DP 1, token sources made here: 8 rows x
2,048 tokens per step, 2 microbatches) by a raw `MixtureLoader`, with its real `state_dict()` after every step.
They are then replayed from memory, so that what is timed is the adapter's own work per step and not the data
plane's delivery: iterating the replay alone (the baseline), through `MicrobatchStream` (microbatches + the
exact per-microbatch state), through `HFMixtureLoader` (+ the padding-free flattening, sources kept for loss
reports), through the Lightning form (+ the microbatch tag and `mark_consumed` for every microbatch), and
`LRScale` (pre/post optimizer-step hooks, per optimizer step), and `source_loss` + `report_loss` per step (the
per-source sums; sending is bounded to one message a second). Figures: microseconds per step (median of the
repeats). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mixplane.client import MixtureLoader, source_loss  # noqa: E402
from mixplane.integrations.hf import HFMixtureLoader  # noqa: E402
from mixplane.integrations.steps import INDEX_KEY, LRScale, MicrobatchStream  # noqa: E402
from mixplane.runtime import EmbeddedRuntime  # noqa: E402
from mixplane.spec import parse_spec  # noqa: E402
from tests.conftest import token_mixture, write_token_source  # noqa: E402


class Replay:
    """The MixtureLoader interface over batches and states recorded from a real one."""

    def __init__(self, batches, states, sources):
        self.batches, self.states, self.sources = batches, states, sources
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= len(self.batches):
            raise StopIteration
        self.i += 1
        return self.batches[self.i - 1]

    def state_dict(self):
        return copy.deepcopy(self.states[self.i])

    def load_state_dict(self, s):
        pass

    def report_loss(self, step, s, n):  # what MixtureLoader.report_loss does between sends
        ls, tk = s.detach().cpu().numpy(), n.detach().cpu().numpy()
        self._s = ls if not hasattr(self, "_s") else self._s + ls
        self._n = tk if not hasattr(self, "_n") else self._n + tk

    def close(self):
        pass


def timed(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps, repeats = (20, 5) if args.quick else (60, 15)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for i, (n, mean) in enumerate((("a", 300), ("b", 900), ("c", 2500))):
            write_token_source(root / n, rows=1500, files=2, mean_len=mean, seed=i + 1, vocab=32000)
        spec = parse_spec(token_mixture(root, batch={"sequences": 8, "seq_len": 2048, "microbatches": 2},
                                        topology={"modules": {"backbone": {"dp": 1}}},
                                        runtime={"window": 64, "metrics": False}))
        with EmbeddedRuntime(spec, root / "run") as rt:
            loader = MixtureLoader(rt.planner_endpoint, rank=0, max_steps=steps, timeout_s=120)
            states, batches = [loader.state_dict()], []
            t0 = time.perf_counter()
            for b in loader:
                batches.append({k: v.clone() for k, v in b.items()})
                states.append(loader.state_dict())
            delivered_s = time.perf_counter() - t0
            sources = list(loader.sources)
            loader.close()
    n_src = len(sources)

    def run(make):
        def go():
            for _ in make(Replay(batches, states, sources)):
                pass
        return go

    def lightning_like(rep):
        s = MicrobatchStream(rep, tag=True)
        for mb in s:
            s.mark_consumed(mb.pop(INDEX_KEY))
            yield mb

    def with_loss(rep):
        s = MicrobatchStream(rep)
        for mb in s:
            tok = mb["input_ids"].double()  # a stand-in per-token loss of the right shape
            rep.report_loss(int(mb["step"]), *source_loss(tok, mb["source_ids"], n_src, mb["labels"]))
            yield mb

    base = timed(run(lambda r: r), repeats)
    per = {
        "microbatch_stream": timed(run(lambda r: MicrobatchStream(r)), repeats),
        "hf_loader": timed(run(lambda r: HFMixtureLoader(r, with_sources=True)), repeats),
        "lightning_stream": timed(run(lightning_like), repeats),
        "stream_plus_source_loss": timed(run(with_loss), repeats),
    }
    us = {k: round((v - base) / steps * 1e6, 1) for k, v in per.items()}

    w = torch.nn.Parameter(torch.zeros(1024))
    opt = torch.optim.SGD([w], lr=0.1)
    w.grad = torch.ones(1024)
    n_opt = 2000

    def steps_plain():
        for _ in range(n_opt):
            opt.step()

    plain = timed(steps_plain, repeats)
    hook = LRScale(opt, lambda: 0.5, lambda: 0)
    scaled = timed(steps_plain, repeats)
    hook.remove()
    us["lr_scale_hooks_per_optimizer_step"] = round((scaled - plain) / n_opt * 1e6, 2)
    result = {"steps": steps, "tokens_per_step": 8 * 2048, "microbatches_per_step": 2, "sources": n_src,
              "raw_mixture_loader_ms_per_step_delivered": round(delivered_s / steps * 1e3, 2),
              "overhead_us_per_step": us}
    print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
