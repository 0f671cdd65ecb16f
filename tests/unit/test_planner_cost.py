"""Analytical FLOPs cost models: backbone (linear + per-document quadratic attention, MoE, vocab) and ViT."""

from __future__ import annotations

import numpy as np
import pytest

from mixplane.planner.cost import (BackboneCost, EncoderCost, TransformerFlops, backbone_cost, default_ffn,
                                   encoder_cost, resolve_cost, token_cost)
from mixplane.spec import ModelDims

from .planner_helpers import make_spec


def test_dense_formula_by_hand():
    f = TransformerFlops(hidden=8, layers=2, ffn=32, vocab=100, topk=1, gated=False, causal=True)
    per_layer = 8 * 8 * 8 + 2 * 2 * 8 * 32  # QKVO + two MLP matrices
    lin = 3 * (2 * per_layer + 2 * 8 * 100)
    assert f.linear_per_token == lin
    assert f.per_pair == 3 * 2 * 4 * 8
    L = 10
    assert f(np.array([L]))[0] == pytest.approx(lin * L + f.per_pair * L * (L + 1) / 2)


def test_gqa_projection_flops_by_hand():
    """Llama-3-8B-like layer: h 4096, 32 query heads, 8 kv heads (head_dim 128, K/V width 1024)."""
    dims = dict(hidden=4096, layers=2, heads=32, ffn_hidden=14336, vocab=128256)
    mha = TransformerFlops.from_dims(ModelDims(**dims))
    gqa = TransformerFlops.from_dims(ModelDims(**dims, kv_heads=8))
    h, kv = 4096, 8 * 128
    assert gqa.projection_per_token == 2 * h * h + 2 * 2 * h * kv + 2 * h * h == 83_886_080
    assert mha.projection_per_token == 8 * h * h
    mlp = 2 * 3 * h * 14336
    assert gqa.linear_per_token == 3 * (2 * (83_886_080 + mlp) + 2 * h * 128256)
    # GQA removes 3 (train) x layers x 2 (K, V) x 2 h (h - kv) per token, and only that
    assert mha.linear_per_token - gqa.linear_per_token == 3 * 2 * 2 * 2 * h * (h - kv)
    assert gqa.per_pair == mha.per_pair == 3 * 2 * 4 * h  # the attention term per document is unchanged
    L = 8192
    assert gqa(np.array([L]))[0] == pytest.approx(gqa.linear_per_token * L + gqa.per_pair * L * (L + 1) / 2)


def test_kv_heads_comes_from_the_spec_and_is_checked():
    spec = make_spec(model={"backbone": {"hidden": 1024, "layers": 4, "heads": 16, "kv_heads": 4}})
    b = backbone_cost(spec)
    assert b.dims.kv_heads == 4 and b.flops.kv_dim == 256
    assert ModelDims().kv_heads is None and TransformerFlops.from_dims(ModelDims()).kv_dim == 4096
    with pytest.raises(ValueError, match="cannot exceed heads"):
        TransformerFlops.from_dims(ModelDims(heads=8, kv_heads=16))


def test_packed_row_costs_the_sum_of_its_documents_not_the_square_of_its_length():
    f = BackboneCost(ModelDims(hidden=1024, layers=4, heads=8, vocab=1000))
    docs = np.array([300, 500, 1200])
    row = f({"length": docs}).sum()
    as_one = f({"length": np.array([docs.sum()])})[0]
    lin = f.flops.linear_per_token * docs.sum()
    assert row < as_one  # attention never crosses documents
    assert row - lin == pytest.approx(f.flops.per_pair * (docs * (docs + 1) / 2).sum())


def test_quadratic_term_grows_with_length():
    f = TransformerFlops.from_dims(ModelDims(hidden=4096, layers=32, heads=32))
    shares = [f.attention_share(L) for L in (512, 4096, 32768)]
    assert shares[0] < shares[1] < shares[2]
    cost = f(np.array([1000, 2000]))
    assert cost[1] > 2 * cost[0]  # superlinear


def test_moe_topk_gating_and_vocab_change_the_linear_term():
    base = TransformerFlops.from_dims(ModelDims(hidden=512, layers=2, heads=8, vocab=1000, moe_topk=1))
    moe = TransformerFlops.from_dims(ModelDims(hidden=512, layers=2, heads=8, vocab=1000, moe_topk=2))
    mlp = 3 * 2 * 2 * 3 * 512 * default_ffn(ModelDims(hidden=512))  # 3x train, 2 layers, 2 flops, 3 mats
    assert moe.linear_per_token - base.linear_per_token == pytest.approx(mlp)
    big_vocab = TransformerFlops.from_dims(ModelDims(hidden=512, layers=2, heads=8, vocab=101000))
    assert big_vocab.linear_per_token - base.linear_per_token == pytest.approx(3 * 2 * 512 * 100000)
    assert default_ffn(ModelDims(hidden=768, gated_mlp=False)) == 3072
    assert default_ffn(ModelDims(hidden=768, gated_mlp=True)) == 2048
    assert default_ffn(ModelDims(hidden=768, ffn_hidden=1000)) == 1000


def test_vit_cost_from_patches_is_bidirectional_and_zero_without_image():
    enc = EncoderCost(ModelDims(hidden=64, layers=2, heads=4, gated_mlp=False))
    c = enc({"patches": np.array([0, 16, 256])})
    assert c[0] == 0
    P = 256
    assert c[2] == pytest.approx(enc.flops.linear_per_token * P + enc.flops.per_pair * P * P)
    assert enc.flops.vocab == 0


def test_dims_come_from_the_spec():
    spec = make_spec(encoder=True, model={"backbone": {"hidden": 2048, "layers": 24, "heads": 16, "moe_topk": 2},
                                          "encoder": {"hidden": 1024, "layers": 12, "heads": 16}})
    b, e = backbone_cost(spec), encoder_cost(spec)
    assert b.dims.hidden == 2048 and b.flops.topk == 2 and e.dims.layers == 12
    default = backbone_cost(make_spec())
    assert default.dims == ModelDims()
    assert resolve_cost(spec, "tokens") is token_cost
    assert isinstance(resolve_cost(spec, "encoder"), EncoderCost)
    with pytest.raises(ValueError, match="unknown cost"):
        resolve_cost(spec, "flops")


def test_a_calibration_turns_flops_into_seconds_per_term_and_document():
    from mixplane.spec import CostCalibration

    dims = ModelDims(hidden=64, layers=4, heads=4, vocab=1000)
    plain = TransformerFlops.from_dims(dims)
    cal = TransformerFlops.from_dims(dims.model_copy(update={"calibration": CostCalibration(
        linear_s_per_flop=2e-12, pair_s_per_flop=8e-12, document_s=1e-4)}))
    assert not plain.calibrated and cal.calibrated
    assert cal.linear_flops_per_token == plain.linear_per_token and cal.pair_flops == plain.per_pair
    L = np.array([0, 1, 100, 2048])
    pairs = L * (L + 1) / 2
    want = 2e-12 * plain.linear_per_token * L + 8e-12 * plain.per_pair * pairs + 1e-4 * (L > 0)
    assert cal(L) == pytest.approx(want, rel=1e-12)
    assert cal(L)[0] == 0.0  # an empty piece costs nothing, not a document's fixed cost


def test_fit_calibration_recovers_the_coefficients_that_made_the_times():
    from mixplane.planner.cost import fit_calibration, microbatch_features

    f = TransformerFlops.from_dims(ModelDims(hidden=256, layers=1, heads=2, vocab=1), lm_head=False)
    rng = np.random.default_rng(3)
    docs = [[2048], [1024, 1024], [256] * 8, [64] * 32] + [list(rng.integers(16, 400, size=rng.integers(1, 6)))
                                                          for _ in range(20)]
    X = microbatch_features(f, docs)
    assert X[0, 2] == 1 and X[3, 2] == 32 and X[0, 0] == pytest.approx(f.linear_flops_per_token * 2048)
    truth = np.array([9e-12, 4e-11, 8e-4])
    a, b, c = fit_calibration(X, X @ truth)
    assert (a, b, c) == pytest.approx(tuple(truth), rel=1e-6)
    noisy = X @ truth * rng.uniform(0.97, 1.03, len(docs))
    a, b, c = fit_calibration(X, noisy)
    assert a == pytest.approx(9e-12, rel=0.1) and b == pytest.approx(4e-11, rel=0.2) and c >= 0
    a, b, c = fit_calibration(X, X[:, :2] @ truth[:2])  # no per-document cost: none is fitted
    assert c == pytest.approx(0.0, abs=1e-9) and a == pytest.approx(9e-12, rel=1e-6)
    with pytest.raises(ValueError, match="positive times"):
        fit_calibration(X[:2], np.ones(2))
    with pytest.raises(ValueError, match="positive times"):
        fit_calibration(X, np.r_[0.0, np.ones(len(docs) - 1)])


def test_without_a_measurable_attention_term_the_fit_says_so_or_falls_back_to_the_token_rate():
    from mixplane.planner.cost import fit_calibration, microbatch_features

    f = TransformerFlops.from_dims(ModelDims(hidden=64, layers=1, heads=2, vocab=1), lm_head=False)
    docs = [[256], [128, 128], [64] * 4, [16] * 16, [100, 50], [30, 30, 30]]
    X = microbatch_features(f, docs)
    t = 1e-11 * X[:, 0] + 2e-4 * X[:, 2] - 1e-13 * X[:, 1]  # longer documents a little *cheaper*: no positive b
    with pytest.raises(ValueError, match="do not determine"):
        fit_calibration(X, t)
    a, b, c = fit_calibration(X, t, pair_fallback=True)
    assert a == b > 0 and c > 0
