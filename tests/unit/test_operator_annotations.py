"""The DataMixture's `mixplane.io/*` inputs parsed into one typed object: defaults, values, errors naming the
annotation, and docs/operator.md's table held to the list the operator reads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mixplane.operator.annotations import (
    ANN_CPU,
    ANN_MEMORY,
    ANN_PROFILE,
    ANN_PROFILER,
    ANN_REPARTITION,
    ANN_SCALE_COSTS,
    ANN_SCALE_ON,
    ANN_TPS,
    NOT_INPUTS,
    READ,
    MixtureAnnotations,
    ReconcileError,
    annotations_of,
)
from mixplane.operator.autopartition import LoaderBudget

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operator.md"


def obj(**ann):
    return {"metadata": {"name": "m", "annotations": ann}}


def test_no_annotations_give_the_defaults():
    got = annotations_of({"metadata": {"name": "m"}})
    assert got == MixtureAnnotations()
    assert (got.tokens_per_s, got.budget) == (1e6, LoaderBudget(64.0, 256 << 30))
    assert (got.scale_on, got.scale_costs, got.repartition, got.profiler, got.profile) == \
        ("measured", "measured", "grow", "auto", None)


def test_every_annotation_read_is_parsed():
    prof = {"version": 1, "sources": {"a": {"cpu_s_per_token": 1e-6}}}
    got = annotations_of(obj(**{ANN_TPS: "2.5e4", ANN_CPU: "8", ANN_MEMORY: "1e9", ANN_SCALE_ON: "declared",
                                ANN_SCALE_COSTS: "profiled", ANN_REPARTITION: "follow", ANN_PROFILER: "operator",
                                ANN_PROFILE: json.dumps(prof)}))
    assert got.tokens_per_s == 25000.0 and got.budget == LoaderBudget(8.0, 10**9)
    assert (got.scale_on, got.scale_costs, got.repartition, got.profiler) == ("declared", "profiled", "follow", "operator")
    assert got.profile == {"version": 1, "sources": {"a": {"cpu_s_per_token": 1e-6, "measured_by": "annotation"}}}
    with pytest.raises(AttributeError):
        got.tokens_per_s = 1.0  # type: ignore[misc]  (frozen: one pass reads one value)


@pytest.mark.parametrize(("key", "value", "says"), [
    (ANN_TPS, "fast", "expected a number > 0, got 'fast'"),
    (ANN_TPS, "-1", "expected a number > 0"),
    (ANN_CPU, "inf", "expected a number > 0"),
    (ANN_MEMORY, "0", "expected a number > 0"),
    (ANN_SCALE_ON, "guessed", "expected measured or declared, got 'guessed'"),
    (ANN_SCALE_COSTS, "x", "expected measured or profiled"),
    (ANN_REPARTITION, "shrink", "expected grow or follow"),
    (ANN_PROFILER, "pod", "expected auto, job or operator, got 'pod'"),
    (ANN_PROFILE, "{not json", "not JSON"),
])
def test_a_bad_value_is_refused_naming_its_annotation(key, value, says):
    with pytest.raises(ReconcileError, match=re.escape(f"metadata.annotations.{key}: {says}")):
        annotations_of(obj(**{key: value}))


def test_the_profiler_auto_resolves_by_the_source_secret():
    class K:
        source_secret = "creds"

    class Spec:
        kubernetes = K()

    assert MixtureAnnotations().profiler_for(Spec()) == "job"
    K.source_secret = None
    assert MixtureAnnotations().profiler_for(Spec()) == "auto"
    assert MixtureAnnotations(profiler="operator").profiler_for(Spec()) == "operator"


def test_the_documented_table_is_the_list_the_operator_reads():
    text = DOC.read_text()
    section = text.split("## Operator inputs beyond the spec", 1)[1].split("\n\n", 2)[1]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()[2:] if line.startswith("|")]
    assert [(r[0].strip("`"), r[1]) for r in rows] == [(a.key, a.default) for a in READ]
    # and every mixplane.io/* key the module names as an input is in READ
    assert {a.key for a in READ} == {ANN_TPS, ANN_CPU, ANN_MEMORY, ANN_PROFILE, ANN_PROFILER, ANN_SCALE_ON,
                                     ANN_SCALE_COSTS, ANN_REPARTITION}


def test_a_pass_reads_the_annotations_it_was_given():
    from mixplane.operator.builders import ClusterOptions
    from mixplane.operator.controller import Observed

    opts = ClusterOptions(name="m", namespace="ml", image="x")
    given = MixtureAnnotations(tokens_per_s=5.0)
    assert Observed(obj(**{ANN_TPS: "7"}), opts, {}, {}, {}, None, (True, ""), 0.0).inputs.tokens_per_s == 7.0
    assert Observed(obj(**{ANN_TPS: "7"}), opts, {}, {}, {}, None, (True, ""), 0.0, annotations=given).inputs is given
    with pytest.raises(ReconcileError, match=f"metadata.annotations.{ANN_TPS}"):
        Observed(obj(**{ANN_TPS: "x"}), opts, {}, {}, {}, None, (True, ""), 0.0)


def test_every_mixplane_key_the_operator_names_is_an_input_or_said_not_to_be():
    named = set()
    for f in (ROOT / "src" / "mixplane" / "operator").glob("*.py"):
        for m in re.finditer(r"(?:mixplane\.io|\{API_GROUP\})/([a-z][a-z0-9-]*)", f.read_text()):
            named.add(f"mixplane.io/{m.group(1)}")
    named.discard("mixplane.io/v1alpha1")  # the API version, not a key
    inputs = {a.key for a in READ}
    assert not inputs & set(NOT_INPUTS)
    assert named - inputs - set(NOT_INPUTS) == set(), "a new mixplane.io/* key: add it to READ or NOT_INPUTS"
    assert set(NOT_INPUTS) <= named  # and none is listed that the operator no longer names
