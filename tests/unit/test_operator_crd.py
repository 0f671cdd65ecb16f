"""The DataMixture CRD is generated from the spec model: in sync on disk, structural, with the model's rules."""

from __future__ import annotations

from pathlib import Path

import yaml

from mixplane.operator.crd import (
    CRD_NAME,
    MixtureStatus,
    crd_manifest,
    crd_yaml,
    spec_schema,
)
from mixplane.spec import DataMixtureSpec

REPO = Path(__file__).resolve().parents[2]
GENERATED = [REPO / "crds" / f"{CRD_NAME}.yaml", REPO / "charts" / "mixplane" / "crds" / f"{CRD_NAME}.yaml"]


def test_crd_files_are_in_sync_with_the_model():
    want = crd_yaml()
    for f in GENERATED:
        assert f.read_text() == want, (f"{f.relative_to(REPO)} drifted from src/mixplane/spec.py; regenerate with: "
                                       "mixplane crd --out crds/datamixtures.mixplane.io.yaml --out charts/mixplane/crds/datamixtures.mixplane.io.yaml")


def _walk(node, path="spec"):
    yield path, node
    if isinstance(node, dict):
        for k, v in (node.get("properties") or {}).items():
            yield from _walk(v, f"{path}.{k}")
        if isinstance(node.get("items"), dict):
            yield from _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            yield from _walk(node["additionalProperties"], f"{path}.*")


def test_schema_is_structural():
    crd = crd_manifest()
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(root["properties"]["spec"]):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node and "const" not in node, path
        # everywhere but an int-or-string node (sources[].workers: N or "auto"), which Kubernetes wants without one
        assert ("type" in node) != bool(node.get("x-kubernetes-int-or-string")), f"{path}: structural schemas need a type everywhere"
        assert not ("properties" in node and "additionalProperties" in node), path
        for b in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(b, False), bool), f"{path}.{b} must be boolean in OpenAPI v3.0"


def test_every_model_field_is_in_the_schema_with_its_bounds_and_enums():
    props = spec_schema()["properties"]
    assert set(props) == set(DataMixtureSpec.model_fields)
    src = props["sources"]["items"]["properties"]
    assert src["kind"]["enum"] == ["text", "tokens", "image_text"]
    assert src["replicas"]["minimum"] == 1 and src["replicas"]["default"] == 1
    assert src["name"]["maxLength"] == 40 and src["name"]["pattern"].startswith("^[a-z0-9]")
    mb = src["shuffle_buffer_mb"]
    assert mb["nullable"] is True and mb["minimum"] == 0 and mb["exclusiveMinimum"] is True and mb["default"] == 32.0
    assert props["runtime"]["properties"]["planner_port"]["maximum"] == 65535
    assert props["kubernetes"]["properties"]["placement"]["enum"] == ["remote", "sidecar"]
    assert props["strategy"]["properties"]["options"]["x-kubernetes-preserve-unknown-fields"] is True
    assert props["mixture"]["properties"]["weights"]["additionalProperties"] == {"type": "number"}
    assert set(spec_schema()["required"]) == {"sources", "batch"}
    assert "default" not in props["name"], "spec.name must fall back to metadata.name, not to the model default"


def test_defaults_match_the_model():
    """Each default in the schema is the model's own default (factories included)."""
    props = spec_schema()["properties"]
    rt = DataMixtureSpec.model_fields["runtime"].annotation
    for name, f in rt.model_fields.items():
        d = f.get_default(call_default_factory=True)
        node = props["runtime"]["properties"][name]
        if d is None:
            assert "default" not in node, name
        elif hasattr(d, "model_dump"):
            assert node["default"] == {}, name
        else:
            assert node["default"] == d, name
    assert props["topology"]["properties"]["order"]["default"] == ["tp", "cp", "dp", "pp"]


def test_status_schema_and_printer_columns():
    v = crd_manifest()["spec"]["versions"][0]
    assert v["subresources"] == {"status": {}}
    cols = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"]}
    assert list(cols) == ["Phase", "Step", "Sources", "Loaders", "Ready", "Realised", "Age"]
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]
    cond = status["properties"]["conditions"]["items"]["properties"]
    assert cond["type"]["enum"] == ["Ready", "Progressing", "Degraded", "MixtureApplied", "TopologyApplied", "PartitionsApplied",
                                     "StatusTooLarge"]
    assert "observedGeneration" in status["properties"] and "observedGeneration" in cond
    src = status["properties"]["sources"]["items"]["properties"]
    assert {"name", "targetWeight", "realisedWeight", "partitions", "loaderPods"} <= set(src)
    for path, node in _walk(status, "status"):
        assert "default" not in node, f"{path}: the API server must not invent status"
    # a status the operator builds is valid under its own schema's field names
    st = MixtureStatus(phase="Running", step=3, conditions=[{"type": "Ready", "status": "True"}])
    assert set(st.model_dump(exclude_none=True)) <= set(status["properties"])


def test_crd_yaml_round_trips():
    assert yaml.safe_load(crd_yaml()) == crd_manifest()
