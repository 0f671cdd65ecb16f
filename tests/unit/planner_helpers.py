"""Shared helpers for planner tests: specs built in code and deterministic synthetic loader streams."""

from __future__ import annotations

from typing import Any

import numpy as np

from mixplane.planner.core import StepPlanner
from mixplane.samples import make_key
from mixplane.spec import parse_spec


def make_spec(*, sources: int = 3, weights: dict[str, float] | None = None, seq_len: int = 256, rows: int = 16,
              microbatches: int = 2, dp: int = 2, pp: int = 1, cp: int = 1, tp: int = 1, encoder: bool = False,
              window: int = 64, replicas: int = 1, unit: str = "tokens", strategy: str = "vanilla",
              options: dict[str, Any] | None = None, phases: list[dict] | None = None, anneal: dict | None = None,
              temperature: float = 1.0, model: dict | None = None, packing: str = "best_fit",
              overlong: str = "split", constructors: str = "per_dp_group"):
    srcs = []
    for i in range(sources):
        s = {"name": f"s{i}", "uri": f"/nonexistent/s{i}", "kind": "tokens", "replicas": replicas}
        if encoder and i == 0:
            s.update(kind="image_text", tokenizer="/nonexistent/tok.json", columns=["image", "caption"])
        srcs.append(s)
    modules: dict[str, Any] = {"backbone": {"dp": dp, "pp": pp, "cp": cp, "tp": tp}}
    if encoder:
        modules["encoder"] = {"dp": dp * pp * cp * tp}
    mixture: dict[str, Any] = {"weights": weights or {}, "unit": unit, "temperature": temperature}
    if phases:
        mixture["phases"] = phases
    if anneal:
        mixture["anneal"] = anneal
    doc = {"name": "t", "sources": srcs, "mixture": mixture,
           "batch": {"sequences": rows, "seq_len": seq_len, "microbatches": microbatches,
                     "packing": packing, "overlong": overlong},
           "topology": {"modules": modules}, "strategy": {"name": strategy, "options": options or {}},
           "runtime": {"window": window, "constructors": constructors}}
    if model:
        doc["model"] = model
    return parse_spec(doc, check_files=False)


def sample_meta(source: int, replica: int, pos: np.ndarray, seq_len: int, *, heavy: bool = True,
                images: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Deterministic metadata of stream positions: a pure function of (source, replica, pos)."""
    pos = np.asarray(pos, dtype=np.int64)
    tok = np.empty(len(pos), dtype=np.int64)
    pat = np.zeros(len(pos), dtype=np.int64)
    for j, p in enumerate(pos):
        rng = np.random.default_rng([source, replica, int(p)])
        if heavy and source % 3 == 1:  # code-like heavy tail, some longer than seq_len
            tok[j] = int(min(4 * seq_len, 1 + rng.pareto(1.1) * seq_len / 8))
        elif heavy and source % 3 == 2:
            tok[j] = int(rng.integers(1, seq_len // 2))
        else:
            tok[j] = int(rng.integers(4, max(5, seq_len // 6)))
        if images and source == 0:
            pat[j] = int(rng.integers(16, 400))
            tok[j] = min(seq_len, tok[j] % 40 + 1 + pat[j] // 4)
    keys = make_key(0, pos * 8 + replica)
    return pos, np.asarray(keys, dtype=np.int64), tok, pat


def fill(planner: StepPlanner, *, heavy: bool = True, images: bool = False) -> None:
    """Top every window up from its deterministic stream (skipping consumed positions) until it is full,
    exactly as a loader announces the shortest stream prefix that fills it."""
    S = planner.spec.batch.seq_len
    for w in planner.windows:
        p = w.next_pos
        while not w.ready:
            while p in w.skip:
                p += 1
            pos_a, key, tok, pat = sample_meta(w.source, w.replica, np.array([p]), S, heavy=heavy, images=images)
            w.add(pos_a, key, tok, pat)
            p += 1


def run(planner: StepPlanner, steps: int, **kw) -> list:
    out = []
    for _ in range(steps):
        fill(planner, **kw)
        out.append(planner.plan())
    return out
