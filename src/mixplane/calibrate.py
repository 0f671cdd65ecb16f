"""`mixplane calibrate`: the cost model's coefficients from the trainer's own kernels, timed with torch.

The planner balances ranks and microbatches by a cost per document (`planner/cost.py`): token-wise work
(projections, MLP, LM head) linear in the document's length, attention scores quadratic in it. In FLOPs the two
are weighed as if every FLOP took the same time; on real hardware attention runs at another efficiency than the
matrix multiplies, and every document (attention segment) costs some fixed work. This module times one transformer
layer of the spec's model -- Q/K/V/O projections with its grouped-query widths, its (gated) MLP, causal attention
per document as varlen kernels compute it -- forward and backward on packed microbatches of documents, and fits
seconds per token-wise FLOP, per attention-pair FLOP and per document (`cost.fit_calibration`). The result goes
into the spec (`model.<module>.calibration`), and the planner's costs become predicted seconds.

On a GPU it runs at the model's width (`device="cuda"`). On a CPU a large model's layer is too slow to time in
minutes: `max_hidden` shrinks hidden, heads and MLP width by one factor and the coefficients measured there are
applied to the model's own FLOP counts (`measured_hidden` in the result says so).

A shell: imports torch (the client's extra); the fit and the features are pure (`planner/cost.py`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from mixplane.planner.cost import TransformerFlops, default_ffn, fit_calibration, kv_width, microbatch_features
from mixplane.spec import CostCalibration, DataMixtureSpec, ModelDims


@dataclass(frozen=True)
class Timed:
    documents: list[list[int]]
    seconds: np.ndarray  # per microbatch, forward + backward of one layer (the fastest of the repeats)


def measured_dims(dims: ModelDims, max_hidden: int | None) -> ModelDims:
    """The dims one layer is timed at: the model's, or (max_hidden) hidden, heads and MLP width shrunk by one
    factor (head dim and the kv_heads / heads ratio kept where they divide)."""
    if max_hidden is None or dims.hidden <= max_hidden:
        return dims
    f = max_hidden / dims.hidden
    heads = max(1, round(dims.heads * f))
    hidden = heads * (dims.hidden // dims.heads)
    kv = dims.kv_heads if dims.kv_heads is not None else dims.heads
    kv_heads = max(1, round(kv * heads / dims.heads))
    while heads % kv_heads:
        kv_heads -= 1
    return dims.model_copy(update={"hidden": hidden, "heads": heads, "kv_heads": kv_heads,
                                   "ffn_hidden": max(1, round(default_ffn(dims) * hidden / dims.hidden)),
                                   "layers": 1, "calibration": None})


def layer_flops(dims: ModelDims) -> TransformerFlops:
    """One layer, no LM head: what a timed microbatch computes."""
    one = dims.model_copy(update={"layers": 1, "calibration": None})
    return TransformerFlops.from_dims(one, causal=True, lm_head=False)


def microbatches(seq_len: int, rng: np.random.Generator, n: int, lengths: np.ndarray | None = None) -> list[list[int]]:
    """Packed microbatches of at most `seq_len` tokens: documents drawn from `lengths` (a corpus' document
    lengths; default: log-uniform 16..seq_len), greedily packed, plus the pure cases that separate the terms
    (one document of seq_len; seq_len/L documents of L)."""
    out: list[list[int]] = []
    for L in (seq_len, seq_len // 2, seq_len // 8, seq_len // 32):
        if L >= 1:
            out.append([L] * (seq_len // L))
    while len(out) < n:
        docs: list[int] = []
        room = seq_len
        while room > 0:
            if lengths is not None and len(lengths):
                d = int(lengths[rng.integers(len(lengths))])
            else:
                d = int(round(math.exp(rng.uniform(math.log(16), math.log(seq_len)))))
            d = max(1, min(d, room))
            docs.append(d)
            room -= d
            if room < 8:
                break
        out.append(docs)
    return out[:n]


def time_layer(dims: ModelDims, documents: list[list[int]], *, device: str = "cpu", repeats: int = 3,
               dtype: str = "float32", seed: int = 0, cpu_threads: int | None = 1) -> Timed:
    """Forward + backward of one layer of `dims` on each packed microbatch; the fastest of `repeats` runs each
    (on a CPU with `cpu_threads` threads: one by default, the steadiest timing on a shared machine)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    dt = getattr(torch, dtype)
    h, heads = dims.hidden, dims.heads
    hd = h // heads
    kvh = dims.kv_heads if dims.kv_heads is not None else heads
    kv = int(kv_width(dims))
    ffn = default_ffn(dims)
    dev = torch.device(device)

    def lin(i: int, o: int) -> torch.nn.Linear:
        return torch.nn.Linear(i, o, bias=False, device=dev, dtype=dt)

    q, k, v, o = lin(h, h), lin(h, kv), lin(h, kv), lin(h, h)
    up = lin(h, ffn * (2 if dims.gated_mlp else 1))
    down = lin(ffn, h)

    def layer(x: torch.Tensor, docs: list[int]) -> torch.Tensor:
        T = x.shape[0]
        qq = q(x).view(T, heads, hd)
        kk = k(x).view(T, kvh, hd).repeat_interleave(heads // kvh, dim=1)
        vv = v(x).view(T, kvh, hd).repeat_interleave(heads // kvh, dim=1)
        outs = []
        s = 0
        for L in docs:  # attention never crosses documents: one causal kernel per segment (varlen)
            outs.append(F.scaled_dot_product_attention(qq[s:s + L].transpose(0, 1), kk[s:s + L].transpose(0, 1),
                                                       vv[s:s + L].transpose(0, 1), is_causal=True).transpose(0, 1))
            s += L
        a = x + o(torch.cat(outs).reshape(T, h))
        u = up(a)
        if dims.gated_mlp:
            g, u = u.chunk(2, dim=-1)
            u = F.silu(g) * u
        else:
            u = F.gelu(u)
        return a + down(u)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed_once(docs: list[int]) -> float:
        x = torch.randn(sum(docs), h, device=dev, dtype=dt, requires_grad=True)
        best = math.inf
        for r in range(repeats + 1):  # the first run warms caches and kernels up: not counted
            sync()
            t0 = time.perf_counter()
            layer(x, docs).float().square().mean().backward()
            sync()
            if r:
                best = min(best, time.perf_counter() - t0)
            x.grad = None
        return best

    seconds = np.zeros(len(documents))
    threads = torch.get_num_threads()
    if dev.type == "cpu" and cpu_threads is not None:
        torch.set_num_threads(cpu_threads)  # one thread: steadier timings on a shared machine
    try:
        for i, docs in enumerate(documents):
            seconds[i] = timed_once(docs)
    finally:
        torch.set_num_threads(threads)
    return Timed(documents, seconds)


def device_name(device: str) -> str:
    import os

    import torch

    if device.startswith("cuda"):
        return f"{device}:{torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu ({os.cpu_count()} cores, timed on 1 thread)"


def calibrate(spec: DataMixtureSpec, module: str | None = None, *, device: str = "cpu", max_hidden: int | None = 256,
              microbatch_count: int = 16, repeats: int = 3, lengths: np.ndarray | None = None,
              seed: int = 0) -> tuple[CostCalibration, dict[str, Any]]:
    """The calibration of `module` (default: the backbone) of `spec`'s model on `device`, and a report (the fit's
    relative errors on the microbatches it was fitted on)."""
    name = module or spec.topology.backbone()[0]
    dims = spec.model.get(name) or ModelDims()
    small = measured_dims(dims, None if device.startswith("cuda") else max_hidden)
    docs = microbatches(spec.batch.seq_len, np.random.default_rng(seed), microbatch_count, lengths)
    timed = time_layer(small, docs, device=device, repeats=repeats, seed=seed)
    feats = microbatch_features(layer_flops(small), docs)
    a, b, c = fit_calibration(feats, timed.seconds, pair_fallback=True)
    rel = (feats @ np.array([a, b, c])) / timed.seconds - 1.0
    cal = CostCalibration(linear_s_per_flop=a, pair_s_per_flop=b, document_s=c * dims.layers,
                          device=device_name(device), measured_hidden=small.hidden if small.hidden != dims.hidden else None)
    report = {"module": name, "device": cal.device, "measured_hidden": small.hidden, "microbatches": len(docs),
              "fit_error_median": float(np.median(np.abs(rel))), "fit_error_max": float(np.max(np.abs(rel))),
              "attention_to_linear_speed": a / b,
              # False: attention was too small a share of the timed microbatches to be told apart (tiny model or
              # short sequences); a pair FLOP is then costed at the token-wise rate
              "pair_measured": b != a}
    return cal, report


def with_calibration(doc: dict[str, Any], module: str, cal: CostCalibration) -> dict[str, Any]:
    """The spec document `doc` with `model.<module>.calibration` set (the rest as written)."""
    out = dict(doc)
    model = dict(out.get("model") or {})
    model[module] = {**dict(model.get(module) or {}), "calibration": cal.model_dump(mode="json")}
    out["model"] = model
    return out
