"""`mixplane calibrate` against real torch kernels on this CPU (a tiny model): the fit is positive, it predicts
the times it was fitted on, the written spec loads and the planner's cost model then predicts seconds; bad
input is named."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import yaml

from mixplane.calibrate import calibrate, layer_flops, measured_dims, microbatches, time_layer
from mixplane.planner.cost import backbone_cost, microbatch_features
from mixplane.spec import ModelDims, load_spec, parse_spec
from tests.conftest import token_mixture

TINY = {"backbone": {"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "vocab": 500}}


def test_calibrate_fits_the_measured_kernels_and_the_planner_predicts_seconds(token_sources, tmp_path):
    doc = token_mixture(token_sources["root"], batch={"sequences": 8, "seq_len": 512, "microbatches": 2}, model=TINY)
    spec = parse_spec(doc)
    cal, report = calibrate(spec, device="cpu", max_hidden=None, microbatch_count=10, repeats=2)
    assert cal.linear_s_per_flop > 0 and cal.pair_s_per_flop > 0 and cal.document_s >= 0
    assert report["module"] == "backbone" and report["microbatches"] == 10 and report["measured_hidden"] == 64
    assert cal.measured_hidden is None and cal.device.startswith("cpu")
    assert report["fit_error_median"] < 0.5, report  # a shared machine: loose, the benchmark measures the error
    # the spec with it: the planner's backbone cost is seconds now, ~ what a layer takes x layers (+ the LM head)
    spec2 = parse_spec({**doc, "model": {"backbone": {**TINY["backbone"], "calibration": cal.model_dump(mode="json")}}})
    bc = backbone_cost(spec2)
    assert bc.flops.calibrated and bc.flops.per_document == cal.document_s
    docs = [[512], [128] * 4]
    one = time_layer(ModelDims(**TINY["backbone"]), docs, repeats=2)
    feats = microbatch_features(layer_flops(ModelDims(**TINY["backbone"])), docs)
    per_layer = feats @ np.array([cal.linear_s_per_flop, cal.pair_s_per_flop, cal.document_s / 3])
    assert np.all(per_layer > 0) and np.all(one.seconds > 0)
    pred = np.array([bc({"length": np.array(d)}).sum() for d in docs])
    assert np.all(pred >= 3 * per_layer * 0.999)  # three layers and the head


def test_measured_dims_shrink_a_large_model_by_one_factor():
    d = measured_dims(ModelDims(hidden=4096, heads=32, kv_heads=8, layers=32), 256)
    assert (d.hidden, d.heads, d.kv_heads, d.layers) == (256, 2, 1, 1) and d.hidden // d.heads == 128
    assert measured_dims(ModelDims(hidden=128, heads=4), 256).hidden == 128
    mbs = microbatches(1024, np.random.default_rng(0), 12)
    assert len(mbs) == 12 and mbs[0] == [1024] and all(0 < sum(m) <= 1024 for m in mbs)


def test_the_cli_writes_the_calibration_into_the_spec_and_names_bad_input(token_sources, tmp_path):
    doc = token_mixture(token_sources["root"], batch={"sequences": 8, "seq_len": 256, "microbatches": 2}, model=TINY)
    src = tmp_path / "mix.yaml"
    src.write_text(yaml.safe_dump(doc))
    out = tmp_path / "calibrated.yaml"
    r = subprocess.run([sys.executable, "-m", "mixplane.cli", "calibrate", str(src), "--microbatches", "6", "--repeats", "1",
                        "--write", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    printed = json.loads(r.stdout)
    spec = load_spec(str(out))
    assert spec.model["backbone"].calibration.model_dump(mode="json") == printed["calibration"]
    assert spec.model["backbone"].hidden == 64  # the rest as written
    bad = subprocess.run([sys.executable, "-m", "mixplane.cli", "calibrate", str(src), "--module", "vit"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--module vit: not a module of topology.modules (backbone)" in bad.stderr
