"""Admission webhook logic: the same `field.path: message` texts as `mixplane validate`; pod injection."""

from __future__ import annotations

import base64
import json

from mixplane.operator.webhooks import (
    INJECTED_ANNOTATION,
    KEY_MOUNT,
    Injection,
    inject_pod,
    mutate_review,
    pod_merge_patch,
    pod_patch,
    review_mixture,
    validate_review,
)


def mixture(**spec_overrides) -> dict:
    spec = {"sources": [{"name": "web", "uri": "/data/web", "kind": "tokens", "columns": ["tokens"]},
                        {"name": "code", "uri": "/data/code", "kind": "tokens", "columns": ["tokens"]}],
            "mixture": {"weights": {"web": 0.7, "code": 0.3}},
            "batch": {"sequences": 8, "seq_len": 256},
            "topology": {"modules": {"backbone": {"dp": 2}}}}
    spec.update(spec_overrides)
    return {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture", "metadata": {"name": "demo", "namespace": "ml"},
            "spec": spec}


def review(obj, operation="CREATE", uid="u-1"):
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "operation": operation, "object": obj, "namespace": "ml"}}


def test_valid_mixture_has_no_problems():
    assert review_mixture(mixture()) == []
    out = validate_review(review(mixture()))
    assert out["response"] == {"uid": "u-1", "allowed": True}


def test_a_bad_operator_annotation_is_refused_at_admission_naming_it():
    bad = mixture()
    bad["metadata"]["annotations"] = {"mixplane.io/scale-on": "guessed", "mixplane.io/loader-cpu": "8"}
    assert review_mixture(bad) == ["metadata.annotations.mixplane.io/scale-on: expected measured or declared, got 'guessed'"]
    out = validate_review(review(bad))["response"]
    assert out["allowed"] is False and "mixplane.io/scale-on" in out["status"]["message"]
    bad["metadata"]["annotations"] = {"mixplane.io/scale-on": "declared", "mixplane.io/loader-cpu": "8"}
    assert review_mixture(bad) == []


def test_cross_field_problems_use_the_spec_texts_with_spec_prefix():
    bad = mixture(mixture={"weights": {"web": 1.0, "video": 2.0}}, batch={"sequences": 7, "seq_len": 256})
    probs = review_mixture(bad)
    assert "spec.mixture.weights.video: unknown source 'video' (sources: web, code)" in probs
    assert any(p.startswith("spec.batch: 7 sequences per step do not divide into dp (2)") for p in probs)
    out = validate_review(review(bad, uid="abc"))["response"]
    assert out["allowed"] is False and out["uid"] == "abc" and out["status"]["code"] == 422
    assert "spec.mixture.weights.video: unknown source" in out["status"]["message"]


def test_shape_problems_and_delete():
    probs = review_mixture(mixture(batch={"sequences": 8}))
    assert probs == ["spec.batch.seq_len: Field required"]
    assert validate_review(review(mixture(batch={}), operation="DELETE"))["response"]["allowed"] is True


def test_user_strategy_is_checked_for_form_but_never_imported():
    # importing would run code in the operator: a module that does not exist here is fine...
    assert review_mixture(mixture(strategy={"name": "my_company.strategies:plan", "options": {"k": 1}})) == []
    # ...a malformed reference is not
    probs = review_mixture(mixture(strategy={"name": ":plan"}))
    assert probs == ["spec.strategy.name: strategy ':plan': expected package.module:function or file.py:function"]
    assert review_mixture(mixture(strategy={"name": "nope"}))[0].startswith("spec.strategy.name: unknown strategy 'nope'")


def trainer_pod(**labels):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "trainer-0", "labels": {"mixplane.io/mixture": "demo", **labels}},
            "spec": {"containers": [{"name": "train", "image": "trainer:1",
                                     "env": [{"name": "MIXPLANE_PLANNER", "value": "tcp://mine:1"}]},
                                    {"name": "logger", "image": "log:1"}]}}


INJ = Injection(mixture="demo", planner="tcp://demo-planner.ml.svc:5555", secret_name="demo-curve")


def env_of(c):
    return {e["name"]: e["value"] for e in c.get("env", [])}


def test_inject_env_keys_and_idempotence():
    pod = trainer_pod()
    new = inject_pod(pod, INJ)
    train, logger = new["spec"]["containers"]
    assert env_of(train)["MIXPLANE_PLANNER"] == "tcp://mine:1", "what the user set wins"
    assert env_of(logger)["MIXPLANE_PLANNER"] == INJ.planner
    assert env_of(logger)["MIXPLANE_CURVE_DIR"] == KEY_MOUNT and env_of(logger)["MIXPLANE_CURVE_NAME"] == "client"
    assert {"name": "mixplane-keys", "mountPath": KEY_MOUNT, "readOnly": True} in train["volumeMounts"]
    (vol,) = new["spec"]["volumes"]
    assert vol["secret"]["secretName"] == "demo-curve"
    assert [i["key"] for i in vol["secret"]["items"]] == ["client.key", "client.key_secret", "server.key"]
    assert new["metadata"]["annotations"][INJECTED_ANNOTATION] == "demo"
    assert pod["spec"]["containers"][1].get("env") is None, "input not modified"
    assert inject_pod(new, INJ) == new and pod_patch(new, inject_pod(new, INJ)) == []


def test_sidecar_loaders_and_patch_forms():
    side = {"name": "loader-web-0", "image": "mixplane:0.1.0", "args": ["loader", "--source", "web"]}
    cfg = {"name": "spec", "configMap": {"name": "demo-spec"}}
    inj = Injection(mixture="demo", planner="tcp://p:1", secret_name="s", sidecars=(side,), volumes=(cfg,))
    pod = trainer_pod()
    new = inject_pod(pod, inj)
    assert [c["name"] for c in new["spec"]["containers"]] == ["train", "logger", "loader-web-0"]
    assert [v["name"] for v in new["spec"]["volumes"]] == ["mixplane-keys", "spec"]
    ops = pod_patch(pod, new)
    assert {o["path"]: o["op"] for o in ops} == {"/metadata/annotations": "add", "/spec/containers": "replace",
                                                  "/spec/volumes": "add"}
    merged = pod_merge_patch(pod, new)
    assert merged["spec"]["containers"] == new["spec"]["containers"] and merged["metadata"]["annotations"]


def test_mutate_review():
    out = mutate_review(review(trainer_pod()), lambda name, ns, pod: INJ if (name, ns) == ("demo", "ml") else None)["response"]
    assert out["allowed"] is True and out["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(out["patch"]))
    assert any(o["path"] == "/spec/volumes" for o in ops)
    refused = mutate_review(review(trainer_pod()), lambda name, ns, pod: None)["response"]
    assert refused["allowed"] is False and "metadata.labels.mixplane.io/mixture: no DataMixture 'demo'" in refused["status"]["message"]
    unlabelled = trainer_pod()
    del unlabelled["metadata"]["labels"]["mixplane.io/mixture"]
    assert mutate_review(review(unlabelled), lambda n, s, pod: INJ)["response"] == {"uid": "u-1", "allowed": True}


def test_an_update_of_a_running_mixture_is_refused_where_it_cannot_be_taken_live():
    from mixplane.operator.webhooks import review_change

    running = {**mixture(), "status": {"phase": "Running"}}

    def change(**spec):
        new = mixture(**spec)
        out = validate_review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "request": {"uid": "u", "operation": "UPDATE", "object": new, "oldObject": running}})
        return out["response"]

    # the mixture changes live: weights, temperature, phases
    assert change(mixture={"weights": {"web": 0.1, "code": 0.9}, "temperature": 2.0,
                           "phases": [{"start_step": 50, "weights": {"web": 1.0}}]})["allowed"] is True
    # weights that sum to 0 are refused by the spec's own rules, with the field
    zero = change(mixture={"weights": {"web": 0.0, "code": 0.0}})
    assert zero["allowed"] is False and "spec.mixture.weights" in zero["status"]["message"]
    # a renamed source, a moved uri, another seed, batch or topology: refused with the field path
    renamed = mixture(sources=[{"name": "web", "uri": "/data/web", "kind": "tokens", "columns": ["tokens"]},
                               {"name": "code2", "uri": "/data/code", "kind": "tokens", "columns": ["tokens"]}],
                      mixture={"weights": {"web": 0.7, "code2": 0.3}})
    assert review_change(running, renamed)[0].startswith("spec.sources: a running mixture's sources cannot be")
    moved = mixture(sources=[{"name": "web", "uri": "/data/web2", "kind": "tokens", "columns": ["tokens"]},
                             {"name": "code", "uri": "/data/code", "kind": "tokens", "columns": ["tokens"]}])
    assert review_change(running, moved) == [
        "spec.sources[0].uri: cannot change on a running mixture (was '/data/web', now '/data/web2'): the loaders' "
        "cursors point into the data it names"]
    seeded = change(mixture={"weights": {"web": 0.7, "code": 0.3}, "seed": 9})
    assert seeded["allowed"] is False and seeded["status"]["message"].startswith("spec.mixture.seed: cannot change")
    assert change(batch={"sequences": 16, "seq_len": 256})["status"]["message"].startswith("spec.batch:")
    # the topology changes live (the operator reshards): see test_a_running_mixtures_topology_changes_live_within_its_batch
    assert change(topology={"modules": {"backbone": {"dp": 4}}})["allowed"] is True
    # before it runs (no phase yet, or Failed) any valid change is a new start
    assert review_change(mixture(), moved) == []
    assert review_change({**mixture(), "status": {"phase": "Failed"}}, moved) == []


def test_a_running_mixtures_topology_changes_live_within_its_batch():
    """DP, TP, PP, CP and ranks per node change live (RESHARD); what the running data plane cannot take is refused
    with the topology's field path: a world the global batch cannot divide, a sidecar layout whose trainer pods would
    change, trainer pod keys rank_binding: required cannot give the new world."""
    from mixplane.operator.webhooks import review_change, topology_paths

    def change(old, **spec):
        new = {**old, "spec": {**old["spec"], **spec}}
        new.pop("status", None)
        out = validate_review({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                               "request": {"uid": "u", "operation": "UPDATE", "object": new, "oldObject": old}})
        return out["response"]

    running = {**mixture(), "status": {"phase": "Running"}}
    for topo in ({"dp": 1}, {"dp": 4}, {"dp": 2, "tp": 2}, {"dp": 2, "pp": 2}, {"dp": 2, "cp": 2}, {"dp": 4, "tp": 2}):
        assert change(running, topology={"modules": {"backbone": topo}}) == {"uid": "u", "allowed": True}, topo
    assert change(running, topology={"modules": {"backbone": {"dp": 2}}, "ranks_per_node": 1})["allowed"] is True
    # a world the batch (8 sequences) cannot divide: named by the topology's field, not spec.batch
    three = change(running, topology={"modules": {"backbone": {"dp": 3}}})
    assert three["allowed"] is False
    assert three["status"]["message"] == ("spec.topology.modules.backbone.dp: the running mixture cannot take this world "
                                          "(spec.batch: 8 sequences per step do not divide into dp (3) x microbatches (1))")
    cp3 = change(running, topology={"modules": {"backbone": {"dp": 2, "cp": 3}}})
    assert cp3["allowed"] is False and cp3["status"]["message"].startswith("spec.topology.modules.backbone.cp: ")
    # the same world before the mixture runs: the spec's own message (a new start, nothing to reshard)
    assert change(mixture(), topology={"modules": {"backbone": {"dp": 3}}})["status"]["message"].startswith("spec.batch: ")
    # a batch change together with the topology is a batch change
    both = change(running, topology={"modules": {"backbone": {"dp": 4}}}, batch={"sequences": 16, "seq_len": 256})
    assert both["allowed"] is False and both["status"]["message"].startswith("spec.batch:")
    # sidecar loaders live in trainer pods: their number cannot change under a running mixture
    side = {**mixture(topology={"modules": {"backbone": {"dp": 2}}, "ranks_per_node": 1},
                      kubernetes={"placement": "sidecar"}), "status": {"phase": "Running"}}
    refused = change(side, topology={"modules": {"backbone": {"dp": 4}}, "ranks_per_node": 1})
    assert refused["allowed"] is False and refused["status"]["message"].startswith(
        "spec.topology.modules.backbone.dp: kubernetes.placement sidecar fixes the loader containers of 2 trainer pods")
    assert change(side, topology={"modules": {"backbone": {"dp": 2, "tp": 2}}, "ranks_per_node": 2})["allowed"] is True
    # rank_binding: required needs one key per trainer pod: 3 pods cannot split a world of 4 into blocks
    req = {**mixture(topology={"modules": {"backbone": {"dp": 2}}}, runtime={"rank_binding": "required"},
                     kubernetes={"trainer_pods": 2}), "status": {"phase": "Running"}}
    assert change(req, topology={"modules": {"backbone": {"dp": 1}}})["allowed"] is False
    assert "runtime.rank_binding: required" in review_change(req, {**req, "spec": {**req["spec"], "topology": {"modules": {"backbone": {"dp": 1}}}}})[0]
    assert topology_paths({"topology": {"modules": {"backbone": {"dp": 2}}}},
                          {"topology": {"modules": {"backbone": {"dp": 1, "tp": 2}}, "ranks_per_node": 2}}) == [
        "spec.topology.modules.backbone.dp", "spec.topology.modules.backbone.tp", "spec.topology.ranks_per_node"]


def test_sidecar_loaders_end_with_the_trainer_a_shared_directory_and_the_pods_ranks():
    """Sidecar placement: the trainer's ranks mark a shared emptyDir (mixplane.podend) and the loader containers
    watch it with the pod's ranks and restart policy; a pod without loaders gets none of it."""
    from mixplane import podend

    side = {"name": "mixplane-loader-web-0", "image": "mixplane:0.1.0", "args": ["loader", "--source", "web"],
            "volumeMounts": [{"name": "mixplane-loader-spec", "mountPath": "/etc/mixplane/spec"}]}
    pod = trainer_pod()
    pod["spec"]["restartPolicy"] = "Never"
    inj = Injection(mixture="demo", planner="tcp://p:1", secret_name="s", sidecars=(side,), trainer_ranks=(8, 15))
    new = inject_pod(pod, inj)
    train, logger, loader = new["spec"]["containers"]
    assert {"name": podend.VOLUME, "emptyDir": {}} in new["spec"]["volumes"]
    for c in (train, logger, loader):  # (each container of the pod may be the one running the ranks)
        assert {"name": podend.VOLUME, "mountPath": podend.MOUNT} in c["volumeMounts"], c["name"]
    assert env_of(train)["MIXPLANE_POD_DIR"] == podend.MOUNT and env_of(logger)["MIXPLANE_POD_DIR"] == podend.MOUNT
    assert "MIXPLANE_POD_DIR" not in env_of(loader)
    assert loader["args"] == ["loader", "--source", "web", "--trainer-dir", podend.MOUNT, "--trainer-ranks", "8-15",
                              "--trainer-restart", "Never"]
    assert side["args"] == ["loader", "--source", "web"] and len(side["volumeMounts"]) == 1, "input not modified"
    assert inject_pod(new, inj) == new
    # a Pod's default restart policy is Always (the kubelet restarts a failed trainer in place)
    again = inject_pod(trainer_pod(), inj)["spec"]["containers"][2]["args"]
    assert again[-2:] == ["--trainer-restart", "Always"]
    # no loaders placed on this pod (or a mixture under remote placement): nothing to end, nothing added
    bare = inject_pod(trainer_pod(), Injection(mixture="demo", planner="tcp://p:1", secret_name="s", trainer_ranks=(0, 7)))
    assert [v["name"] for v in bare["spec"]["volumes"]] == ["mixplane-keys"]
    assert all("MIXPLANE_POD_DIR" not in env_of(c) for c in bare["spec"]["containers"])


def test_the_admission_resolver_gives_a_sidecar_pod_its_slots_ranks():
    """The operator's resolver (what its HTTPS webhook calls): a trainer pod of slot k of a sidecar-placed mixture
    gets the loader containers of its slot and slot k's block of ranks, which its loaders wait for."""
    from mixplane.operator.admission import resolver
    from mixplane.operator.webhooks import trainer_index

    doc = mixture(topology={"modules": {"backbone": {"dp": 4}}, "ranks_per_node": 2},
                  kubernetes={"placement": "sidecar", "sidecar_cpu": 1.0})
    doc["metadata"]["annotations"] = {"mixplane.io/tokens-per-second": "2000000"}
    resolve = resolver(lambda name, ns: doc if (name, ns) == ("demo", "ml") else None)
    got = {}
    for slot in (0, 1):
        pod = trainer_pod(**{"mixplane.io/trainer-index": str(slot)})
        inj = resolve("demo", "ml", pod)
        assert trainer_index(pod) == slot and inj.key_name == f"client-r{2 * slot}-{2 * slot + 1}"
        got[slot] = (len(inj.sidecars), inj.trainer_ranks)
    assert sum(n for n, _ in got.values()) >= 1, got
    for slot, (n, ranks) in got.items():  # a slot the layout left without loaders has nothing to wait for
        assert ranks == ((2 * slot, 2 * slot + 1) if n else None), got
    assert resolve("other", "ml", trainer_pod()) is None
