"""Analytical cost models: training FLOPs of a transformer backbone and of a ViT encoder per sample.

MegaScale-Data §4.2 (`cost`): the encoder's cost is a function of the image sequence length, the
embedding / MLP dimensions and the depth; the backbone's of the sequence length, experts per
token, vocabulary and hidden size. Everything here is vectorised over arrays of samples.

Per layer and token, forward FLOPs (multiply-add = 2 FLOPs):

* attention projections: Q and O ``2 h^2`` each, K and V ``2 h d_kv`` each, with
  ``d_kv = kv_heads * h / heads`` (grouped-query attention; ``8 h^2`` when kv_heads = heads)
* MLP: ``2 * m * h * f * topk`` with m = 3 matrices (gated, SwiGLU) or 2, f the MLP width,
  topk the experts each token visits (1 for dense); the router's ``2 h E`` is negligible
* attention scores and weighted sum: ``4 h`` per (query, key) pair the query attends to

A causal document of length L has ``L (L + 1) / 2`` such pairs, a bidirectional one (ViT) ``L^2``.
Attention never crosses documents: a packed row costs the **sum over its documents**, never
``(sum of lengths)^2``; every piece of a split document is its own attention segment (that is how
constructors build ``cu_seqlens``), so a piece costs what a document of its length costs. The LM
head adds ``2 h V`` per token once. Training (forward + backward) is 3x forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from mixplane.spec import DataMixtureSpec, ModelDims

CostFn = Callable[[Mapping[str, np.ndarray]], np.ndarray]


def default_ffn(dims: ModelDims) -> int:
    """MLP width when not given: 4h, or 8h/3 for a gated MLP (same parameter count, Llama rule)."""
    if dims.ffn_hidden:
        return int(dims.ffn_hidden)
    return int(round(8 * dims.hidden / 3)) if dims.gated_mlp else 4 * dims.hidden


def kv_width(dims: ModelDims) -> float:
    """Width of the K and V projections: kv_heads x head_dim (head_dim = hidden / heads); GQA makes
    K and V narrower than the hidden size, which changes what a token costs."""
    kv_heads = dims.heads if dims.kv_heads is None else dims.kv_heads
    if kv_heads > dims.heads:
        raise ValueError(f"kv_heads ({kv_heads}) cannot exceed heads ({dims.heads})")
    return kv_heads * dims.hidden / dims.heads


@dataclass(frozen=True)
class TransformerFlops:
    """Training FLOPs of a transformer stack as ``linear * L + pair * pairs(L)`` per document."""

    hidden: int
    layers: int
    ffn: int
    vocab: int = 0  # 0: no LM head (encoders)
    topk: int = 1
    gated: bool = True
    causal: bool = True
    train_factor: float = 3.0
    kv_dim: float | None = None  # width of K and V (kv_heads x head_dim); None: hidden (no GQA)
    # a calibration (spec model.<m>.calibration): seconds per FLOP of each term and per document; 1, 1, 0: FLOPs
    linear_scale: float = 1.0
    pair_scale: float = 1.0
    per_document: float = 0.0

    @classmethod
    def from_dims(cls, dims: ModelDims, *, causal: bool = True, lm_head: bool = True) -> "TransformerFlops":
        cal = dims.calibration
        return cls(hidden=dims.hidden, layers=dims.layers, ffn=default_ffn(dims),
                   vocab=dims.vocab if lm_head else 0, topk=dims.moe_topk, gated=dims.gated_mlp, causal=causal,
                   kv_dim=kv_width(dims),
                   **({} if cal is None else {"linear_scale": cal.linear_s_per_flop, "pair_scale": cal.pair_s_per_flop,
                                              "per_document": cal.document_s}))

    @property
    def calibrated(self) -> bool:
        return (self.linear_scale, self.pair_scale, self.per_document) != (1.0, 1.0, 0.0)

    @property
    def projection_per_token(self) -> float:
        """Forward FLOPs of Q, K, V, O per token and layer: GQA shrinks only K and V."""
        h = float(self.hidden)
        kv = h if self.kv_dim is None else float(self.kv_dim)
        return 2.0 * h * h + 2.0 * 2.0 * h * kv + 2.0 * h * h

    @property
    def linear_per_token(self) -> float:
        """Cost per token of everything but attention scores (FLOPs, or seconds when calibrated)."""
        return self.linear_scale * self.linear_flops_per_token

    @property
    def linear_flops_per_token(self) -> float:
        """Training FLOPs per token of everything but attention scores (uncalibrated)."""
        h = float(self.hidden)
        mats = 3.0 if self.gated else 2.0
        per_layer = self.projection_per_token + 2.0 * mats * h * self.ffn * self.topk
        return self.train_factor * (self.layers * per_layer + 2.0 * h * self.vocab)

    @property
    def per_pair(self) -> float:
        """Cost per (query, key) pair (FLOPs, or seconds when calibrated)."""
        return self.pair_scale * self.pair_flops

    @property
    def pair_flops(self) -> float:
        """Training FLOPs per (query, key) pair (uncalibrated)."""
        return self.train_factor * self.layers * 4.0 * float(self.hidden)

    def __call__(self, length: np.ndarray) -> np.ndarray:
        L = np.asarray(length, dtype=np.float64)
        pairs = L * (L + 1.0) * 0.5 if self.causal else L * L
        out = self.linear_per_token * L + self.per_pair * pairs
        return out + self.per_document * (L > 0) if self.per_document else out

    def attention_share(self, length: float) -> float:
        """Fraction of a document's cost spent in attention scores (how quadratic it is)."""
        c = float(self(np.array([length]))[0])
        return 1.0 - self.linear_per_token * length / c if c else 0.0


class BackboneCost:
    """Cost of backbone pieces from their token count (``meta['length']``)."""

    def __init__(self, dims: ModelDims):
        self.dims = dims
        self.flops = TransformerFlops.from_dims(dims, causal=True, lm_head=True)

    def __call__(self, meta: Mapping[str, np.ndarray]) -> np.ndarray:
        return self.flops(meta["length"])

    def __repr__(self) -> str:
        d = self.dims
        return (f"BackboneCost(h={d.hidden}, layers={d.layers}, heads={d.heads}, kv_heads={d.kv_heads or d.heads}, "
                f"ffn={self.flops.ffn}, topk={d.moe_topk}, vocab={d.vocab})")


class EncoderCost:
    """Cost of encoding images from their patch count (``meta['patches']``), bidirectional attention."""

    def __init__(self, dims: ModelDims):
        self.dims = dims
        self.flops = TransformerFlops.from_dims(dims, causal=False, lm_head=False)

    def __call__(self, meta: Mapping[str, np.ndarray]) -> np.ndarray:
        p = np.asarray(meta["patches"], dtype=np.float64)
        return np.where(p > 0, self.flops(p), 0.0)

    def __repr__(self) -> str:
        d = self.dims
        return f"EncoderCost(h={d.hidden}, layers={d.layers}, ffn={self.flops.ffn})"


def token_cost(meta: Mapping[str, np.ndarray]) -> np.ndarray:
    """Tokens as cost (what a length-only balancer would use)."""
    return np.asarray(meta["length"], dtype=np.float64)


def _dims(spec: DataMixtureSpec, role: str) -> ModelDims:
    t = spec.topology
    if role == "backbone":
        name = t.backbone()[0]
    else:
        enc = t.encoder()
        if enc is None:
            raise ValueError("the spec has no encoder module (topology.modules)")
        name = enc[0]
    return spec.model.get(name) or ModelDims()


def backbone_cost(spec: DataMixtureSpec) -> BackboneCost:
    """The backbone's cost model with the dimensions in `spec.model` (defaults when absent)."""
    return BackboneCost(_dims(spec, "backbone"))


def encoder_cost(spec: DataMixtureSpec) -> EncoderCost:
    """The encoder's cost model; without an encoder module, the backbone's dims encode the patches."""
    try:
        return EncoderCost(_dims(spec, "encoder"))
    except ValueError:
        return EncoderCost(_dims(spec, "backbone"))


def resolve_cost(spec: DataMixtureSpec, fn: Any) -> CostFn:
    """A cost function from a name ('backbone', 'encoder', 'tokens'), an import path, or a callable."""
    if callable(fn):
        return fn
    if fn in (None, "backbone"):
        return backbone_cost(spec)
    if fn == "encoder":
        return encoder_cost(spec)
    if fn == "tokens":
        return token_cost
    if isinstance(fn, str) and ":" in fn:
        import importlib

        mod, _, attr = fn.partition(":")
        obj = getattr(importlib.import_module(mod), attr)
        return obj(spec) if isinstance(obj, type) else obj
    raise ValueError(f"unknown cost function {fn!r} (backbone, encoder, tokens, pkg.mod:fn or a callable)")


# ---- calibration: the cost model's coefficients from measured times (`mixplane calibrate`) --------------------
def microbatch_features(flops: TransformerFlops, documents: "list[np.ndarray] | list[list[int]]") -> np.ndarray:
    """Per microbatch (its documents' lengths): [token-wise training FLOPs, attention-pair FLOPs, documents] of
    `flops`' model -- what calibration regresses measured seconds on."""
    out = np.zeros((len(documents), 3), np.float64)
    for i, docs in enumerate(documents):
        L = np.asarray(docs, np.float64)
        L = L[L > 0]
        pairs = L * (L + 1.0) * 0.5 if flops.causal else L * L
        out[i] = (flops.linear_flops_per_token * L.sum(), flops.pair_flops * pairs.sum(), float(len(L)))
    return out


def fit_calibration(features: np.ndarray, seconds: np.ndarray, *, pair_fallback: bool = False) -> tuple[float, float, float]:
    """Seconds per token-wise FLOP, per pair FLOP and per document, >= 0 each, minimising the *relative* squared
    error of the predicted microbatch times (with and without the per-document term; the better fit whose
    coefficients are all >= 0 wins). ValueError when no positive cost per token-wise and per pair FLOP fits --
    unless `pair_fallback`: then a pair FLOP is taken at the token-wise rate (the result's b == a says so)."""
    X = np.asarray(features, np.float64)
    t = np.asarray(seconds, np.float64)
    if X.ndim != 2 or X.shape[1] != 3 or len(X) != len(t) or len(t) < 3 or not np.all(t > 0):
        raise ValueError("calibration needs >= 3 microbatches with positive times and 3 features each")
    w = 1.0 / t
    best: tuple[float, np.ndarray] | None = None
    for mask in ((0, 1, 2), (0, 1)):
        cols = list(mask)
        A = X[:, cols] * w[:, None]
        scale = np.where(A.max(axis=0) > 0, A.max(axis=0), 1.0)
        coef, *_ = np.linalg.lstsq(A / scale, np.ones_like(t), rcond=None)
        coef = coef / scale
        if np.any(coef < 0) or coef[0] <= 0 or coef[1] <= 0:
            continue
        full = np.zeros(3)
        full[cols] = coef
        err = float(np.sum(((X @ full) / t - 1.0) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, full)
    if best is None and pair_fallback:
        # attention too small a share of these microbatches to be measured apart (tiny models, short documents):
        # a pair FLOP is taken at the token-wise rate, the per-document cost still fitted
        for fallback in ((0, 2), (0,)):
            cols = list(fallback)
            A = X[:, cols] * w[:, None]
            scale = np.where(A.max(axis=0) > 0, A.max(axis=0), 1.0)
            coef, *_ = np.linalg.lstsq(A / scale, np.ones_like(t), rcond=None)
            coef = coef / scale
            if np.all(coef >= 0) and coef[0] > 0:
                full = np.zeros(3)
                full[cols] = coef
                full[1] = full[0]
                best = (0.0, full)
                break
    if best is None:
        raise ValueError("the measured times do not determine a positive cost per token-wise and per pair FLOP "
                         "(too few or too noisy measurements: time longer documents)")
    a, b, c = (float(x) for x in best[1])
    return a, b, c
