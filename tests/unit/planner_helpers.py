"""Shared helpers for planner tests: specs built in code and deterministic synthetic loader streams.

Windows are filled by the loaders' own code (`mixplane.replay.ReplayLoaders` driving
`loader.window.LoaderWindow`) over synthetic streams, so tests announce exactly what a loader
would: unconsumed positions in order, empty documents dropped, the shortest prefix that fills.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mixplane.loader.transforms import TransformedSamples
from mixplane.planner.core import StepPlanner
from mixplane.replay import ReplayLoaders
from mixplane.samples import Ragged, make_key
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
    return parse_spec(doc)


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


# meta(source, replica, positions, seq_len) -> (keys, tokens, patches) of those stream positions
Meta = Callable[[int, int, np.ndarray, int], tuple[np.ndarray, np.ndarray, np.ndarray]]


def planner_meta(*, heavy: bool = True, images: bool = False) -> Meta:
    def meta(source: int, replica: int, pos: np.ndarray, seq_len: int):
        _, key, tok, pat = sample_meta(source, replica, pos, seq_len, heavy=heavy, images=images)
        return key, tok, pat

    return meta


@dataclass
class SyntheticRows:
    keys: np.ndarray
    positions: np.ndarray
    ntokens: np.ndarray
    npatches: np.ndarray

    def __len__(self) -> int:
        return len(self.keys)


class SyntheticStream:
    """A loader stream whose position p holds a sample with metadata meta(source, replica, p)."""

    def __init__(self, meta: Meta, source: int, replica: int, seq_len: int):
        self.meta, self.source, self.replica, self.seq_len = meta, source, replica, seq_len
        self.position = 0

    def seek(self, position: int) -> None:
        self.position = int(position)

    def take(self, n: int, *, timeout: float | None = None) -> SyntheticRows:
        pos = np.arange(self.position, self.position + n, dtype=np.int64)
        self.position += n
        key, tok, pat = self.meta(self.source, self.replica, pos, self.seq_len)
        return SyntheticRows(np.asarray(key, np.int64), pos, np.asarray(tok, np.int64), np.asarray(pat, np.int64))


def synthetic_transform(raw: SyntheticRows) -> TransformedSamples:
    """Token ids do not matter to the planner: zeros of each sample's length."""
    n = raw.ntokens.astype(np.int32)
    offsets = np.zeros(len(n) + 1, np.int64)
    np.cumsum(n, out=offsets[1:])
    return TransformedSamples(Ragged(np.zeros(int(offsets[-1]), np.int32), offsets), None, n,
                              raw.npatches.astype(np.int32))


def synthetic_loaders(meta: Meta) -> ReplayLoaders:
    """Source Loaders over synthetic streams: a WindowFiller for `replan` and for planner tests."""
    return ReplayLoaders(lambda spec, si, r: (SyntheticStream(meta, si, r, spec.batch.seq_len), synthetic_transform))


_loaders: "weakref.WeakKeyDictionary[StepPlanner, tuple[Any, ReplayLoaders]]" = weakref.WeakKeyDictionary()


def fill(planner: StepPlanner, *, heavy: bool = True, images: bool = False, meta: Meta | None = None) -> None:
    """Top every window up as the loaders would (each planner keeps its own synthetic loaders)."""
    how = (heavy, images) if meta is None else meta
    have = _loaders.get(planner)
    if have is None or have[0] != how:
        have = _loaders[planner] = (how, synthetic_loaders(meta or planner_meta(heavy=heavy, images=images)))
    have[1](planner)


def run(planner: StepPlanner, steps: int, **kw) -> list:
    out = []
    for _ in range(steps):
        fill(planner, **kw)
        out.append(planner.plan())
    return out
