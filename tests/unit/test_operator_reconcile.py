"""From a DataMixture object to owned children and a status; the profile is kept so restarts do not re-profile."""

from __future__ import annotations

import pytest

from mixplane.operator.annotations import ANN_TPS, annotations_of
from mixplane.operator.builders import ClusterOptions
from mixplane.operator.reconcile import (
    ReconcileError,
    desired,
    fallback_profile,
    profile_from_status,
    status_of,
)
from tests.unit.operator_testdata import FakeKeys

OPTS = ClusterOptions(name="demo", namespace="ml", image="mixplane:test")
KEYS = FakeKeys({r: ("p" * 40, "s" * 40) for r in ("server", "component", "client", "admin")})
PROFILE = {"version": 1, "sources": {
    "text": {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 40 << 20, "max_partitions": 50, "mean_tokens_per_sample": 500.0,
             "files_listed": 20},
    "pairs": {"cpu_s_per_token": 6e-5, "memory_per_partition": 60 << 20, "max_partitions": 50, "mean_tokens_per_sample": 80.0,
              "files_listed": 30}}}


def body(**ann):
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": "ml", "uid": "u-1", "generation": 3, "annotations": {ANN_TPS: "40000", **ann}},
        "spec": {
            "sources": [{"name": "text", "uri": "s3://b/text", "tokenizer": "/data/tok.json"},
                        {"name": "pairs", "uri": "s3://b/pairs", "kind": "image_text", "columns": ["image", "caption"],
                         "tokenizer": "/data/tok.json"}],
            "mixture": {"weights": {"text": 0.8, "pairs": 0.2}, "phases": [{"start_step": 100, "weights": {"pairs": 0.8}}]},
            "batch": {"sequences": 8, "seq_len": 512},
            "topology": {"modules": {"backbone": {"dp": 2}, "encoder": {"dp": 2}}},
            "strategy": {"name": "vlm_balance"},
        },
    }


def test_children_are_owned_by_the_mixture_and_sized_by_the_profile():
    d = desired(body(), OPTS, PROFILE, KEYS)
    for o in d.objects:
        (ref,) = o["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture", "name": "demo", "uid": "u-1",
                       "controller": True, "blockOwnerDeletion": True}
    # from step 100 pairs has 0.8 / (0.8 + 0.8) of the tokens: 0.5 x 40k tokens/s x 60 us = 1.2 cores,
    # x 1.05 headroom -> 2 partitions of <= 1 core
    assert dict(d.plan.partitions) == {"text": 1, "pairs": 2}
    assert [s.replicas for s in d.spec.sources] == [1, 2]


def test_status_has_conditions_endpoint_step_and_per_source_fields():
    b = body()
    d = desired(b, OPTS, PROFILE, KEYS, step=120)
    st = status_of(b, d, OPTS, PROFILE, ready=False, progressing=(True, "RollingOut", "x"), degraded=(False, "AsPlanned", ""),
                   planner_status={"planned_through": 130, "sources": ["text", "pairs"], "target": [0.5, 0.5], "realized_phase": [0.49, 0.51]})
    assert st["plannerEndpoint"] == "tcp://demo-planner.ml.svc:7000" and st["step"] == 130 and st["observedGeneration"] == 3
    assert {c["type"]: c["status"] for c in st["conditions"]} == {"Ready": "False", "Progressing": "True", "Degraded": "False"}
    assert all(c["observedGeneration"] == 3 for c in st["conditions"])
    pairs = next(s for s in st["sources"] if s["name"] == "pairs")
    assert pairs["partitions"] == 2 and pairs["realisedWeight"] == 0.51 and pairs["targetWeight"] == 0.5
    assert pairs["loaderPods"] >= 2 and pairs["profile"]["cpuSecondsPerToken"] == 6e-5
    # the profile comes back from the status: a restarted operator does not profile again
    kept = profile_from_status({**b, "status": st})
    assert kept is not None
    assert {n: p["cpu_s_per_token"] for n, p in kept["sources"].items()} == {"text": 1.5e-6, "pairs": 6e-5}
    assert desired({**b, "status": st}, OPTS, kept, KEYS).plan.partitions == d.plan.partitions
    # a condition keeps its transition time while its status holds
    again = status_of({**b, "status": st}, d, OPTS, PROFILE, ready=False, progressing=(True, "RollingOut", "x"),
                      degraded=(False, "AsPlanned", ""))
    assert again["conditions"][0]["lastTransitionTime"] == st["conditions"][0]["lastTransitionTime"]


def test_bad_annotations_and_specs_name_the_field():
    with pytest.raises(ReconcileError, match=f"metadata.annotations.{ANN_TPS}: expected a number > 0"):
        annotations_of(body(**{ANN_TPS: "fast"}))
    b = body()
    b["spec"]["mixture"]["weights"] = {"nope": 1.0}
    with pytest.raises(ReconcileError, match=r"spec\.mixture\.weights\.nope: unknown source"):
        desired(b, OPTS, PROFILE, KEYS)


def test_fallback_profile_sizes_images_dearer_than_text():
    from mixplane.operator.reconcile import spec_of

    prof = fallback_profile(spec_of(body()))
    assert prof["sources"]["pairs"]["cpu_s_per_token"] > prof["sources"]["text"]["cpu_s_per_token"]
    assert all(p["source"] == "fallback" for p in prof["sources"].values())


def test_partitions_of_a_running_mixture_are_kept_when_weights_change():
    b = body()
    d = desired(b, OPTS, PROFILE, KEYS)
    st = status_of(b, d, OPTS, PROFILE, ready=True, progressing=(False, "Converged", ""), degraded=(False, "AsPlanned", ""))
    patched = {**b, "status": st}
    patched["spec"] = {**b["spec"], "mixture": {"weights": {"text": 1.0, "pairs": 0.0}}}
    d2 = desired(patched, OPTS, PROFILE, KEYS)
    assert d2.plan.partitions == d.plan.partitions  # the data split stays; pods change
    pairs_pods = d2.plan.pods_at(0).pods_of("pairs")
    assert pairs_pods and all(p.idle for p in pairs_pods)
    # only the mixture changed: pod templates keep their hash, so nothing restarts for a weight change
    def hashes(objs):
        return {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"]["mixplane.io/spec-hash"]
                for o in objs if o["kind"] in ("Deployment", "StatefulSet")}
    h1, h2 = hashes(d.objects), hashes(d2.objects)
    assert h1["demo-planner"] == h2["demo-planner"] and h1["demo-constructor"] == h2["demo-constructor"]


def test_fallback_costs_are_not_kept_as_a_profile():
    from mixplane.operator.reconcile import spec_of

    b = body()
    prof = fallback_profile(spec_of(b))
    d = desired(b, OPTS, prof, KEYS)
    st = status_of(b, d, OPTS, prof, ready=False, progressing=(True, "RollingOut", "x"),
                   degraded=(True, "FallbackCosts", "sources not profiled"))
    assert profile_from_status({**b, "status": st}) is None


def test_shares_decided_by_the_scaling_policy_size_the_loader_pods():
    b = body()
    scaled = desired(b, OPTS, PROFILE, KEYS, shares={"text": 0.2, "pairs": 0.8})
    base = desired(b, OPTS, PROFILE, KEYS)
    assert scaled.plan.partitions == base.plan.partitions  # the policy moves pods, never the data split

    def loader_cpu(d, source):
        return sum(int(o["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"][:-1])
                   for o in d.objects if o["kind"] == "Deployment" and o["spec"]["replicas"]
                   and source in o["metadata"].get("annotations", {}).get("mixplane.io/partitions", ""))

    assert loader_cpu(scaled, "pairs") > loader_cpu(base, "pairs")  # 0.8 of the tokens instead of 0.2
    off = desired(b, OPTS, PROFILE, KEYS, shares={"text": 1.0, "pairs": 0.0})
    pairs = [o for o in off.objects if o["kind"] == "Deployment" and "pairs:" in o["metadata"].get("annotations", {}).get("mixplane.io/partitions", "")]
    assert pairs and all(o["spec"]["replicas"] == 0 for o in pairs)


def test_planner_figures_per_source_for_the_status():
    from mixplane.operator.reconcile import planner_source_figures

    st = {"sources": ["text", "pairs"], "target": [0.7, 0.3], "realized_phase": [0.6912345678, 0.3087654322],
          "source_tokens_per_s": [1234.56789, -1.0]}
    assert planner_source_figures(st) == {
        "text": {"targetWeight": 0.7, "realisedWeight": 0.691235, "deliveredTokensPerSecond": 1234.568},
        "pairs": {"targetWeight": 0.3, "realisedWeight": 0.308765, "deliveredTokensPerSecond": 0.0}}
    # a list that does not match the sources is left out, never misattributed
    assert planner_source_figures({"sources": ["a", "b"], "target": [1.0]}) == {}
    assert planner_source_figures({}) == {}


def _spec_json(d):
    import json

    (cm,) = [o for o in d.objects if o["kind"] == "ConfigMap" and "spec.json" in o.get("data", {})]
    return json.loads(cm["data"]["spec.json"])


def test_decode_at_auto_is_resolved_from_the_profiles_image_costs_into_the_spec_the_components_read():
    from mixplane.imagedecode import ImageCosts, choose_decode_place

    # PNG figures: raw bytes far fewer than the pixels -> the constructor; noise: raw as large as pixels -> the loader
    small = {"decode_s": 2e-3, "raw_bytes": 15e3, "decoded_bytes": 190e3, "images": 32}
    noise = {"decode_s": 2e-3, "raw_bytes": 190e3, "decoded_bytes": 190e3, "images": 32}
    for ic, want in ((small, "constructor"), (noise, "loader")):
        assert choose_decode_place(ImageCosts(**ic), consumers=1) == want  # the embedded runtime's rule
        prof = {"version": 1, "sources": {**PROFILE["sources"], "pairs": {**PROFILE["sources"]["pairs"], "image_costs": ic}}}
        b = body()
        d = desired(b, OPTS, prof, KEYS)
        assert d.spec.sources[1].image.decode_at == want
        assert _spec_json(d)["sources"][1]["image"]["decode_at"] == want  # what every component reads
        st = status_of(b, d, OPTS, prof, ready=True, progressing=(False, "Converged", ""), degraded=(False, "AsPlanned", ""))
        pairs = next(s for s in st["sources"] if s["name"] == "pairs")
        text = next(s for s in st["sources"] if s["name"] == "text")
        assert pairs["decodeAt"] == want and "decodeAt" not in text and "imageCosts" not in text["profile"]
        assert pairs["profile"]["imageCosts"] == {"decodeSeconds": 2e-3, "rawBytes": ic["raw_bytes"],
                                                  "decodedBytes": 190e3, "images": 32}
        # a restarted operator reads the costs back from the status and resolves the same place
        kept = profile_from_status({**b, "status": st})
        assert kept["sources"]["pairs"]["image_costs"] == ic
        assert desired({**b, "status": st}, OPTS, kept, KEYS).spec.sources[1].image.decode_at == want
    # no image costs in the profile (costs by kind, an annotation without them): the loader, said explicitly
    assert desired(body(), OPTS, PROFILE, KEYS).spec.sources[1].image.decode_at == "loader"
    # a place the user chose stays, whatever the costs say
    b = body()
    b["spec"]["sources"][1]["image"] = {"decode_at": "client"}
    prof = {"version": 1, "sources": {**PROFILE["sources"], "pairs": {**PROFILE["sources"]["pairs"], "image_costs": small}}}
    assert desired(b, OPTS, prof, KEYS).spec.sources[1].image.decode_at == "client"
    bad = {"version": 1, "sources": {**PROFILE["sources"], "pairs": {**PROFILE["sources"]["pairs"], "image_costs": {"decode_s": "x"}}}}
    with pytest.raises(ReconcileError, match="profile sources.pairs.image_costs"):
        desired(body(), OPTS, bad, KEYS)


def test_an_older_profile_of_a_source_that_may_be_read_block_by_block_is_measured_again():
    """A kept profile without a file count (an older mixplane's status: its profile did not cap a block-read source's
    max_partitions at the blocks) of a static page-mode source with lazy_index_files on is not kept when its
    maxPartitions is above the fewest blocks such a source has (ceil(lazy_index_files / block_files)): the operator
    profiles again, and the new profile records filesListed, so it is kept."""
    import copy

    b = body()
    d = desired(b, OPTS, PROFILE, KEYS)
    st = status_of(b, d, OPTS, PROFILE, ready=True, progressing=(False, "Converged", ""), degraded=(False, "AsPlanned", ""))
    assert [s["profile"]["filesListed"] for s in st["sources"]] == [20, 30]
    kept = profile_from_status({**b, "status": st})
    assert kept is not None and kept["sources"]["pairs"]["files_listed"] == 30

    def older(status, max_partitions, measured_by=None):
        out = copy.deepcopy(status)
        for s in out["sources"]:
            del s["profile"]["filesListed"]
            s["profile"]["maxPartitions"] = max_partitions
            if measured_by:
                s["profile"]["measuredBy"] = measured_by
        return {**b, "status": out}

    # pages of a source of 50,000 files (196 blocks of the default 256 files): measured again
    assert profile_from_status(older(st, 905_194)) is None
    assert profile_from_status(older(st, 905_194, "job")) is None
    # a cap no larger than the fewest blocks (4,096 / 256 = 16) is one for a block-read source too: kept
    assert profile_from_status(older(st, 16))["sources"]["text"]["max_partitions"] == 16
    assert profile_from_status(older(st, 17)) is None
    # a profile given by hand (mixplane.io/profile) is the user's figures: kept
    assert profile_from_status(older(st, 905_194, "annotation")) is not None
    # sources never read block by block: another shuffle mode, or lazy_index_files 0; block_files moves the bound
    for change in ({"shuffle": "rowgroup"}, {"lazy_index_files": 0}):
        other = older(st, 905_194)
        other["spec"] = {**b["spec"], "sources": [{**s, **change} for s in b["spec"]["sources"]]}
        assert profile_from_status(other)["sources"]["pairs"]["max_partitions"] == 905_194
    small_blocks = older(st, 64)
    small_blocks["spec"] = {**b["spec"], "sources": [{**s, "block_files": 64} for s in b["spec"]["sources"]]}
    assert profile_from_status(small_blocks) is not None  # 4,096 / 64 = 64 blocks at the fewest
    small_blocks["status"]["sources"][0]["profile"]["maxPartitions"] = 65
    assert profile_from_status(small_blocks) is None
