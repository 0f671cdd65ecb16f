"""Analytical cost models: training FLOPs of a transformer backbone and of a ViT encoder per sample.

Seed 001 §4.2 (`cost`): the encoder's cost is a function of the image sequence length, the
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

    @classmethod
    def from_dims(cls, dims: ModelDims, *, causal: bool = True, lm_head: bool = True) -> "TransformerFlops":
        return cls(hidden=dims.hidden, layers=dims.layers, ffn=default_ffn(dims),
                   vocab=dims.vocab if lm_head else 0, topk=dims.moe_topk, gated=dims.gated_mlp, causal=causal,
                   kv_dim=kv_width(dims))

    @property
    def projection_per_token(self) -> float:
        """Forward FLOPs of Q, K, V, O per token and layer: GQA shrinks only K and V."""
        h = float(self.hidden)
        kv = h if self.kv_dim is None else float(self.kv_dim)
        return 2.0 * h * h + 2.0 * 2.0 * h * kv + 2.0 * h * h

    @property
    def linear_per_token(self) -> float:
        h = float(self.hidden)
        mats = 3.0 if self.gated else 2.0
        per_layer = self.projection_per_token + 2.0 * mats * h * self.ffn * self.topk
        return self.train_factor * (self.layers * per_layer + 2.0 * h * self.vocab)

    @property
    def per_pair(self) -> float:
        return self.train_factor * self.layers * 4.0 * float(self.hidden)

    def __call__(self, length: np.ndarray) -> np.ndarray:
        L = np.asarray(length, dtype=np.float64)
        pairs = L * (L + 1.0) * 0.5 if self.causal else L * L
        return self.linear_per_token * L + self.per_pair * pairs

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
