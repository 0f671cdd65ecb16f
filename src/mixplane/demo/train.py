"""`mixplane demo`: train a small GPT on the CPU with data-parallel ranks fed only by mixplane.

The demo builds the demo data if needed, starts the embedded runtime, launches one trainer
process per rank the way torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT, MIXPLANE_PLANNER in
the environment), trains with torch.distributed (gloo) + DDP, and reports what the data plane
delivered: per-phase per-source token fractions against their targets, per-source loss,
tokens/s and a closing summary.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

DEMO_MIXTURE = """\
# The demo mixture: three real sources, a curriculum change half-way, 2 data-parallel ranks.
name: demo
sources:
  - {{name: code, uri: code, tokenizer: tokenizer.json}}
  - {{name: man,  uri: man,  tokenizer: tokenizer.json}}
  - {{name: docs, uri: docs, tokenizer: tokenizer.json}}
mixture:
  weights: {{code: 0.2, man: 0.3, docs: 0.5}}
  phases:
    - {{start_step: {half}, weights: {{code: 0.6, man: 0.3, docs: 0.1}}, lr_scale: 0.5}}
  seed: 1234
batch: {{sequences: {rows}, seq_len: 256, microbatches: 2, pad_id: 1}}
topology: {{modules: {{backbone: {{dp: {ranks}}}}}}}
strategy: {{name: llm_balance}}
model: {{backbone: {{hidden: 128, layers: 4, heads: 4, vocab: 8192}}}}
runtime: {{window: 256, prefetch_steps: 3}}
"""

ROWS_PER_RANK = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_demo_mixture(data_dir: Path, steps: int, ranks: int) -> Path:
    path = data_dir / "mixture.yaml"
    path.write_text(DEMO_MIXTURE.format(half=steps // 2, rows=ROWS_PER_RANK * ranks, ranks=ranks))
    return path


# ---- the model ----------------------------------------------------------------------------

def build_model(vocab: int, seq_len: int, d: int = 128, layers: int = 4, heads: int = 4):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)
            x = x + self.out(a)
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        """GPT with document masking: a token attends only to earlier tokens of its own piece."""

        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq_len, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            for mod in self.modules():
                if isinstance(mod, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(mod.weight, std=0.02)
                if isinstance(mod, nn.Linear) and mod.bias is not None:
                    nn.init.zeros_(mod.bias)

        def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            doc = torch.cumsum((pos == 0).to(torch.int32), dim=1)  # piece id per token (position restarts at 0)
            t = ids.shape[1]
            causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
            mask = (doc[:, :, None] == doc[:, None, :]) & causal
            x = self.tok(ids) + self.pos(pos)
            for blk in self.blocks:
                x = blk(x, mask[:, None])
            return self.ln(x) @ self.tok.weight.T

    return TinyGPT()


# ---- one trainer rank (a separate process, like torchrun's) ------------------------------

def trainer_main(result_path: str, steps: int, spec_path: str) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from mixplane import settings
    from mixplane.client import MixtureLoader, microbatches
    from mixplane.mixing import MixtureSchedule
    from mixplane.spec import load_spec

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rank, world = settings.get("RANK"), settings.get("WORLD_SIZE")
    if rank is None or world is None:
        raise SystemExit("mixplane demo trainer: RANK and WORLD_SIZE must be set (it runs under torchrun)")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    spec = load_spec(spec_path)
    names = spec.source_names()
    n_src = len(names)
    schedule = MixtureSchedule(spec)
    dims = spec.model.get("backbone")
    model = build_model(dims.vocab if dims else 8192, spec.batch.seq_len)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    base_lr, warmup = 3e-3, 20
    loader = MixtureLoader(rank=rank, max_steps=steps, prefetch=2)

    # per step: tokens by source, loss sum by source, label count by source, total tokens, phase
    stats = torch.zeros(steps, 3 * n_src + 2, dtype=torch.float64)
    t_start = None
    tty = sys.stdout.isatty()
    for batch in loader:
        step = int(batch["step"])
        if t_start is None:
            t_start = time.perf_counter()
        lr = base_lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        lr *= float(batch["lr_scale"])
        for g in opt.param_groups:
            g["lr"] = lr
        mbs = list(microbatches(batch))
        row = stats[step]
        for i, mb in enumerate(mbs):
            ctx = ddp.no_sync() if i < len(mbs) - 1 else _nullcontext()
            with ctx:
                logits = ddp(mb["input_ids"], mb["position_ids"])
                tok_loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), mb["labels"].reshape(-1),
                                           ignore_index=-100, reduction="none")
                valid = mb["labels"].reshape(-1) != -100
                loss = tok_loss.sum() / max(1, int(valid.sum())) / len(mbs)
                loss.backward()
            src = mb["source_ids"].reshape(-1).to(torch.int64)
            has = src >= 0
            row[:n_src] += torch.bincount(src[has], minlength=n_src).double()
            row[n_src : 2 * n_src] += torch.bincount(src[valid], weights=tok_loss.detach()[valid].double(), minlength=n_src)
            row[2 * n_src : 3 * n_src] += torch.bincount(src[valid], minlength=n_src).double()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        row[3 * n_src] = float(batch["input_ids"].numel())
        row[3 * n_src + 1] = float(batch["phase"])
        if rank == 0:
            done = step + 1
            elapsed = time.perf_counter() - t_start
            tok = stats[:done, :n_src].sum().item() * world
            mean_loss = (row[n_src : 2 * n_src].sum() / row[2 * n_src : 3 * n_src].sum().clamp(min=1)).item()
            bar = "#" * int(30 * done / steps)
            line = (f"[{bar:<30}] {done:>4}/{steps}  loss {mean_loss:6.3f}  phase {int(batch['phase'])}  "
                    f"lr {lr:.2e}  {tok / max(elapsed, 1e-9) / 1e3:6.1f}k tok/s")
            if tty:
                print("\r" + line, end="", flush=True)
            elif done % 20 == 0 or done == steps:
                print(line, flush=True)
    elapsed = time.perf_counter() - (t_start or time.perf_counter())
    loader.close()
    summed = stats[:, : 3 * n_src].contiguous()  # collectives need contiguous memory
    dist.all_reduce(summed)
    stats[:, : 3 * n_src] = summed
    if rank == 0:
        stats[:, 3 * n_src] *= world
        if tty:
            print()
        phases: list[dict[str, Any]] = []
        ph = stats[:, 3 * n_src + 1].to(torch.int64)
        for p in sorted(set(ph.tolist())):
            sel = ph == p
            idx = torch.nonzero(sel).flatten()
            first, last = int(idx.min()), int(idx.max())
            tok_p = stats[sel, :n_src].sum(0)
            lsum = stats[sel, n_src : 2 * n_src].sum(0)
            lcnt = stats[sel, 2 * n_src : 3 * n_src].sum(0)
            target = schedule.at(first).probs
            phases.append({
                "phase": p, "first_step": first, "last_step": last,
                "sources": {names[i]: {"target": float(target[i]), "realized": float(tok_p[i] / tok_p.sum()),
                                       "tokens": int(tok_p[i]), "loss": float(lsum[i] / lcnt[i].clamp(min=1))}
                            for i in range(n_src)},
            })
        real_tokens = float(stats[:, :n_src].sum())
        row_tokens = float(stats[:, 3 * n_src].sum())
        result = {"steps": steps, "ranks": world, "seconds": elapsed, "tokens": real_tokens,
                  "tokens_per_s": real_tokens / max(elapsed, 1e-9), "fill": real_tokens / max(row_tokens, 1.0),
                  "final_loss": float(stats[-10:, n_src : 2 * n_src].sum() / stats[-10:, 2 * n_src : 3 * n_src].sum()),
                  "phases": phases}
        Path(result_path).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# ---- the whole demo -----------------------------------------------------------------------

def print_summary(result: dict[str, Any], out=sys.stdout) -> None:
    w = out.write
    w("\nRealised per-source token fractions (what the trainers received) against the targets\n")
    w(f"{'phase':<6}{'steps':<10}{'source':<8}{'target':>8}{'realised':>10}{'delta':>9}{'loss':>8}\n")
    for ph in result["phases"]:
        for i, (name, s) in enumerate(ph["sources"].items()):
            steps = f"{ph['first_step']}-{ph['last_step']}" if i == 0 else ""
            w(f"{ph['phase'] if i == 0 else '':<6}{steps:<10}{name:<8}{100 * s['target']:7.1f}%{100 * s['realized']:9.2f}%"
              f"{100 * (s['realized'] - s['target']):+8.2f}pp{s['loss']:8.3f}\n")
    worst = max(abs(s["realized"] - s["target"]) for ph in result["phases"] for s in ph["sources"].values())
    w("\nSummary\n")
    rows = [("steps", f"{result['steps']} on {result['ranks']} data-parallel ranks (gloo, CPU)"),
            ("tokens delivered", f"{int(result['tokens']):,} (rows {100 * result['fill']:.1f}% full after packing)"),
            ("training time", f"{result['seconds']:.1f} s"),
            ("throughput", f"{result['tokens_per_s'] / 1e3:.1f}k tokens/s"),
            ("final loss", f"{result['final_loss']:.3f}"),
            ("worst mixture error", f"{100 * worst:.3f} pp (target: within 1 pp)")]
    for k, v in rows:
        w(f"  {k:<22}{v}\n")


QUICK_MAX_MB, FULL_MAX_MB = 6.0, 24.0


class Terminated(SystemExit):
    """SIGTERM reached the demo: unwind (stopping trainers and the data plane) and exit 128 + 15."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


@contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into an exception so every `finally` runs; without it the trainers outlive the demo."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Terminate every process still running, then kill what has not exited after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _run_trainers(ranks: int, steps: int, spec_path: Path, result_path: Path, planner: str) -> list[int]:
    """Start one trainer process per rank (torchrun-style environment) and wait; none survives this call."""
    port = _free_port()
    procs: list[subprocess.Popen] = []
    try:
        for r in range(ranks):
            env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "MIXPLANE_PLANNER": planner, "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, "-m", "mixplane.demo.train", str(result_path), str(steps), str(spec_path)],
                                          env=env, stdout=None if r == 0 else subprocess.DEVNULL))
        return [p.wait() for p in procs]
    finally:
        stop_processes(procs)


def run_demo(data_dir: Path, *, steps: int = 200, ranks: int = 2, quick: bool = False, max_mb: float | None = None) -> int:
    with sigterm_unwinds():
        return _run_demo(data_dir, steps=steps, ranks=ranks, quick=quick, max_mb=max_mb)


def _run_demo(data_dir: Path, *, steps: int, ranks: int, quick: bool, max_mb: float | None) -> int:
    from mixplane.checks import default_checks
    from mixplane.demo.data import ensure_demo_data
    from mixplane.runtime import EmbeddedRuntime
    from mixplane.spec import load_spec

    t0 = time.perf_counter()
    data_dir = data_dir.resolve()
    if quick:
        steps = min(steps, 40)
    if max_mb is None:
        max_mb = QUICK_MAX_MB if quick else FULL_MAX_MB
    print(f"mixplane demo: demo data in {data_dir} ({max_mb:g} MB per source) ...", flush=True)
    if ensure_demo_data(data_dir, max_mb=max_mb):
        print("mixplane demo: built the demo data (Python stdlib, man pages, Debian docs)", flush=True)
    spec_path = write_demo_mixture(data_dir, steps, ranks)
    spec = load_spec(spec_path, checks=default_checks())
    run_dir = data_dir.parent / "demo-run"
    print(f"mixplane demo: {len(spec.sources)} sources, {ranks} ranks, {steps} steps, phase change at step {steps // 2}", flush=True)
    with EmbeddedRuntime(spec, run_dir) as rt:
        print(f"mixplane demo: data plane up in {time.perf_counter() - t0:.1f}s (planner {rt.planner_endpoint}; logs in {run_dir / 'logs'})", flush=True)
        result_path = run_dir / "demo-result.json"
        result_path.unlink(missing_ok=True)
        codes = _run_trainers(ranks, steps, spec_path, result_path, rt.planner_endpoint or "")
        if any(codes) or not result_path.exists():
            print(f"mixplane demo: a trainer failed (exit codes {codes}); data plane logs in {run_dir / 'logs'}", file=sys.stderr)
            return 1
    result = json.loads(result_path.read_text())
    result["wall_seconds"] = time.perf_counter() - t0
    result_path.write_text(json.dumps(result, indent=1))
    print_summary(result)
    print(f"  {'wall time':<22}{result['wall_seconds']:.1f} s (data, data plane, training)")
    return 0


if __name__ == "__main__":
    sys.exit(trainer_main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
