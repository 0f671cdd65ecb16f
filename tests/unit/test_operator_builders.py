"""Manifest builders: spec + launch plan + auto-partitioner pods -> the children of one DataMixture."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mixplane.operator.autopartition import (
    MIB,
    LoaderBudget,
    PartitionBounds,
    PodPlan,
    SourceCost,
    auto_partition,
    spec_schedule,
)
from mixplane.operator.builders import (
    COMPONENT_KEY_ITEMS,
    JOURNAL_MOUNT,
    KEY_MOUNT,
    ClusterOptions,
    dns_label,
    key_secret,
    render_mixture,
    resources,
    sidecar_containers,
    sidecar_volumes,
)
from mixplane.operator.reconcile import sidecar_layout, trainer_slots
from mixplane.spec import DataMixtureSpec, parse_spec
from tests.unit.operator_testdata import FakeKeys

OPTS = ClusterOptions(name="demo", namespace="ml", image="mixplane:test")
KEYS = FakeKeys()


def demo_spec(**over) -> DataMixtureSpec:
    doc = {
        "name": "demo",
        "sources": [{"name": n, "uri": f"s3://bucket/{n}", "kind": "tokens", "columns": ["t"]} for n in ("code", "man", "docs")],
        "mixture": {"weights": {"code": 0.2, "man": 0.3, "docs": 0.5},
                    "phases": [{"start_step": 100, "weights": {"code": 0.6, "man": 0.3, "docs": 0.0}}]},
        "batch": {"sequences": 12, "seq_len": 256, "microbatches": 2},
        "topology": {"modules": {"backbone": {"dp": 2, "tp": 2}}, "ranks_per_node": 2},
        "runtime": {"constructors": "per_node"},
    }
    doc.update(over)
    return parse_spec(doc)


def render(step=0, spec=None):
    spec = spec or demo_spec()
    costs = [SourceCost("code", 1.5e-6, 40 * MIB), SourceCost("man", 1.5e-6, 30 * MIB), SourceCost("docs", 1.4e-6, 30 * MIB)]
    plan = auto_partition(costs, spec_schedule(spec), 2_000_000, LoaderBudget(32, 1 << 40))
    resolved, objs = render_mixture(spec, OPTS, plan.pods_at(step), plan.partitions, KEYS)
    return plan, resolved, objs


def by(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_every_child_is_namespaced_labelled_and_every_container_has_resources():
    _, _, objs = render()
    kinds = sorted({o["kind"] for o in objs})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PersistentVolumeClaim", "PodDisruptionBudget", "Secret",
                     "Service", "ServiceAccount", "StatefulSet"]
    names = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names))
    for o in objs:
        assert o["metadata"]["namespace"] == "ml"
        assert o["metadata"]["labels"]["mixplane.io/instance"] == "demo"
        assert "mixplane.io/mixture" not in o["metadata"]["labels"]  # that label marks trainers for injection
        tmpl = o.get("spec", {}).get("template")
        if tmpl:
            pod = tmpl["spec"]
            assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "demo-mixplane"
            for c in pod["containers"]:
                assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
                assert c["resources"]["limits"]["memory"]
                assert c["command"] == ["mixplane"] and c["args"][0] in ("planner", "constructor", "loader")
                assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["runAsNonRoot"]
                pod_ip = [e for e in c["env"] if e["name"] == "POD_IP"][0]
                assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
                assert {"name": "keys", "mountPath": KEY_MOUNT, "readOnly": True} in c["volumeMounts"]
            # the pod template's labels match the selector
            assert o["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()


def test_planner_one_replica_recreate_fixed_port_and_service():
    _, _, objs = render()
    dep = by(objs, "Deployment")["demo-planner"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--bind") + 1] == "tcp://0.0.0.0:7000"
    assert args[args.index("--spec") + 1] == "/etc/mixplane/spec/spec.json"
    assert args[args.index("--curve-dir") + 1] == KEY_MOUNT
    svc = by(objs, "Service")["demo-planner"]
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"planner": 7000, "metrics": 9090}
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_constructors_are_a_statefulset_whose_ordinal_is_the_index():
    _, resolved, objs = render()
    from mixplane.topology import constructor_groups

    sts = by(objs, "StatefulSet")["demo-constructor"]
    assert sts["spec"]["replicas"] == len(constructor_groups(resolved)) == 2  # per node: 4 ranks / 2 per node
    assert sts["spec"]["serviceName"] == "demo-constructors"
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--index") + 1] == "$(POD_NAME)"
    assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"
    assert args[args.index("--planner") + 1] == "tcp://demo-planner.ml.svc:7000"
    svc = by(objs, "Service")["demo-constructors"]
    assert svc["spec"]["clusterIP"] == "None"


def test_loader_deployments_follow_the_partition_plan_and_idle_ones_run_zero_replicas():
    plan, resolved, objs = render(step=0)
    assert {s.name: s.replicas for s in resolved.sources} == dict(plan.partitions)
    loaders = {n: d for n, d in by(objs, "Deployment").items() if d["metadata"]["labels"]["mixplane.io/role"] == "loader"}
    pods = plan.pods_at(0).pods
    assert len(loaders) == len(pods)
    hosted = []
    for d in loaders.values():
        c = d["spec"]["template"]["spec"]["containers"][0]
        parts = d["metadata"]["annotations"]["mixplane.io/partitions"].split(",")
        hosted += parts
        pod = next(p for p in pods if [f"{s}:{r}" for s, r in p.members] == parts)
        assert c["resources"]["requests"]["cpu"] == f"{round(pod.cpu * 1000)}m"
        assert c["resources"]["requests"]["memory"] == f"{pod.memory // MIB}Mi"
        if len(parts) == 1:
            s, r = parts[0].split(":")
            assert c["args"][c["args"].index("--source") + 1] == s and c["args"][c["args"].index("--replica") + 1] == r
        else:
            assert c["args"][c["args"].index("--sources") + 1] == ",".join(parts)
        assert d["spec"]["replicas"] == 1
    assert sorted(hosted) == sorted(f"{s}:{r}" for s, n in plan.partitions.items() for r in range(n))
    # from step 100 docs has no weight: its loaders' Deployments run no pod
    _, _, later = render(step=100)
    for d in by(later, "Deployment").values():
        parts = d["metadata"].get("annotations", {}).get("mixplane.io/partitions", "")
        if parts and all(p.startswith("docs:") for p in parts.split(",")):
            assert d["spec"]["replicas"] == 0
        elif parts:
            assert d["spec"]["replicas"] == 1


def test_config_map_holds_the_resolved_spec():
    _, resolved, objs = render()
    cm = by(objs, "ConfigMap")["demo-spec"]
    assert DataMixtureSpec.model_validate_json(cm["data"]["spec.json"]) == resolved


def test_secret_is_a_key_dir_the_wire_layer_reads(tmp_path):
    import zmq

    from mixplane.wire import load_allowlist, load_keys

    keys = {}
    for role in ("server", "component", "client", "admin"):
        pub, sec = zmq.curve_keypair()
        keys[role] = (pub.decode(), sec.decode())
    secret = key_secret(OPTS, keys)
    for name in COMPONENT_KEY_ITEMS:  # what a component pod mounts
        (tmp_path / name).write_text(secret["stringData"][name])
    for role in ("server", "component"):
        k = load_keys(tmp_path, role)
        assert (k.public.decode(), k.secret.decode()) == keys[role]
    assert load_allowlist(tmp_path) == {keys[r][0].encode() for r in ("server", "component", "client", "admin")}
    with pytest.raises(ValueError, match="admin"):
        key_secret(OPTS, {r: keys[r] for r in ("server", "component", "client")})


def test_each_trainer_pod_gets_a_key_bound_to_its_ranks(tmp_path):
    """Issue 10 in a cluster: one `client-r<A>-<B>` pair per trainer pod (its ranks), in the Secret; components
    mount only the public halves (their ZAP handler then knows which ranks each key may claim)."""
    import base64

    import zmq

    from mixplane.operator.builders import MAX_POD_KEYS, component_key_items, pod_rank_keys, pod_rank_ranges
    from mixplane.operator.keys import existing_keys, with_pod_keys
    from mixplane.wire import has_rank_keys, load_keys, load_roles

    spec = demo_spec()  # dp 2 x tp 2, 2 ranks per node: 2 trainer pods
    assert pod_rank_ranges(spec) == [(0, 1), (2, 3)]
    assert pod_rank_keys(spec) == ("client-r0-1", "client-r2-3")
    assert pod_rank_ranges(demo_spec(kubernetes={"trainer_pods": 4})) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert pod_rank_keys(demo_spec(runtime={"constructors": "per_node", "rank_binding": "off"})) == ()

    pairs = {n: tuple(k.decode() for k in zmq.curve_keypair()) for n in ("server", "component", "client", "admin", "client-r0-1", "client-r2-3")}
    plan = auto_partition([SourceCost(n, 1.5e-6, 40 * MIB) for n in ("code", "man", "docs")], spec_schedule(spec), 2_000_000,
                          LoaderBudget(32, 1 << 40))
    _, objs = render_mixture(spec, OPTS, plan.pods_at(0), plan.partitions, pairs)
    secret = by(objs, "Secret")["demo-keys"]
    assert {"client-r0-1.key", "client-r0-1.key_secret", "client-r2-3.key", "client-r2-3.key_secret"} <= set(secret["stringData"])
    public = by(objs, "Secret")["demo-trainer-keys"]  # the trainer pods' public halves only, projected whole
    assert set(public["stringData"]) == {"client-r0-1.key", "client-r2-3.key"}
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        (vol,) = [v for v in o["spec"]["template"]["spec"]["volumes"] if v["name"] == "keys"]
        keys_src, trainer_src = (x["secret"] for x in vol["projected"]["sources"])
        items = [it["key"] for it in keys_src["items"]]
        assert keys_src["name"] == "demo-keys" and trainer_src == {"name": "demo-trainer-keys", "optional": True}
        assert not [i for i in items if i.startswith(("client", "admin")) and i.endswith("_secret")], items
        assert not [i for i in items if i.startswith("client-r")], items  # not in the template: a new world restarts nothing
    d = tmp_path / "component"
    d.mkdir()
    for item in component_key_items(replace(OPTS, rank_keys=pod_rank_keys(spec))):
        (d / item).write_text(secret["stringData"][item])
    for item, text in public["stringData"].items():
        (d / item).write_text(text)
    roles = load_roles(d)
    assert roles[pairs["client-r0-1"][0].encode()] == "client:0-1" and roles[pairs["client-r2-3"][0].encode()] == "client:2-3"
    assert has_rank_keys(d)  # rank_binding auto: the components require rank-bound claims
    t = tmp_path / "trainer-1"
    t.mkdir()
    (t / "client-r2-3.key_secret").write_text(secret["stringData"]["client-r2-3.key_secret"])
    assert load_keys(t, "client-r2-3").public.decode() == pairs["client-r2-3"][0]

    # the operator keeps the Secret's pairs across reconciles, issues pairs for new pods, drops those of gone pods
    stored = existing_keys({"data": {k: base64.b64encode(v.encode()).decode() for k, v in secret["stringData"].items()}})
    assert stored == pairs
    # a pod pair that is not base64 (or not text) is unreadable like a damaged one: issued again, never an error
    for junk in ("@@not base64@@", base64.b64encode(b"\xff\xfe").decode()):
        data = {k: base64.b64encode(v.encode()).decode() for k, v in secret["stringData"].items()}
        data["client-r2-3.key_secret"] = junk
        assert existing_keys({"data": data}) == {k: v for k, v in pairs.items() if k != "client-r2-3"}
        data["server.key_secret"] = junk
        assert existing_keys({"data": data}) is None  # a role's pair: as when it is missing
    grown = with_pod_keys(stored, ("client-r0-0", "client-r2-3"))
    assert set(grown) == {"server", "component", "client", "admin", "client-r0-0", "client-r2-3"}
    assert grown["client-r2-3"] == pairs["client-r2-3"] and grown["server"] == pairs["server"]
    assert len(grown["client-r0-0"][0]) == 40 and grown["client-r0-0"] != pairs["client-r0-1"]

    # more trainer pods than a Secret holds keys for: unbound under auto, an error under required
    big = {"topology": {"modules": {"backbone": {"dp": 2 * MAX_POD_KEYS}}, "ranks_per_node": 1},
           "batch": {"sequences": 2 * MAX_POD_KEYS, "seq_len": 256}}
    assert pod_rank_keys(demo_spec(**big)) == ()
    with pytest.raises(ValueError, match="exceed the 2048 a Secret holds"):
        pod_rank_keys(demo_spec(**big, runtime={"rank_binding": "required"}))

    # trainer pods the rank blocks do not reach (4 ranks on 3 pods: blocks of 2 fill 2): a pod would get sidecars
    # and no key (refused at admission), so no pod keys under auto, an error under required
    three = demo_spec(kubernetes={"trainer_pods": 3, "placement": "sidecar"})
    assert trainer_slots(three) == 3 and pod_rank_ranges(three) == [(0, 1), (2, 3)]
    assert pod_rank_keys(three) == ()
    with pytest.raises(ValueError, match="do not split the world's 4 ranks into one block per pod"):
        pod_rank_keys(demo_spec(kubernetes={"trainer_pods": 3}, runtime={"rank_binding": "required"}))
    # an uneven last block is still one per pod: 3 ranks on nodes of 2
    odd = demo_spec(topology={"modules": {"backbone": {"dp": 3}}, "ranks_per_node": 2}, batch={"sequences": 6, "seq_len": 256})
    assert pod_rank_keys(odd) == ("client-r0-1", "client-r2-2")


def test_only_loaders_get_the_storage_credentials_secret():
    spec = demo_spec(kubernetes={"source_secret": "s3-creds"})
    _, _, objs = render(spec=spec)
    seen = set()
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in o["spec"]["template"]["spec"]["containers"]:
            role = o["metadata"]["labels"]["mixplane.io/role"]
            seen.add(role)
            assert c.get("envFrom") == ([{"secretRef": {"name": "s3-creds"}}] if role == "loader" else None), (role, c.get("envFrom"))
    assert seen == {"planner", "constructor", "loader"}
    # sidecar loaders in trainer pods too (the trainer's own container is not touched by this)
    spec = demo_spec(kubernetes={"placement": "sidecar", "sidecar_cpu": 1.0, "sidecar_memory_mb": 2048, "source_secret": "s3-creds"})
    costs = [SourceCost("code", 1.5e-6, 40 * MIB), SourceCost("man", 1.5e-6, 30 * MIB), SourceCost("docs", 1.4e-6, 30 * MIB)]
    plan = auto_partition(costs, spec_schedule(spec), 2_000_000, LoaderBudget(32, 1 << 40))
    pods, placement = sidecar_layout(spec, plan, costs, 2_000_000, PartitionBounds(), 0)
    from mixplane.operator.builders import spec_options

    cars = sidecar_containers(spec, spec_options(OPTS, spec), pods.pods, plan.partitions, placement.slots[0])
    assert cars and all(c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}] for c in cars)
    # without one, no loader gets envFrom; a name that is not a Secret's is refused by the spec
    _, _, objs = render()
    assert not [c for o in objs if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"] if "envFrom" in c]
    with pytest.raises(Exception, match="source_secret"):
        demo_spec(kubernetes={"source_secret": "Not_A_Name"})


def test_loaders_keep_their_page_index_on_a_writable_volume():
    from mixplane.operator.builders import INDEX_CACHE

    _, _, objs = render()
    for o in objs:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        (c,) = o["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        if o["metadata"]["labels"]["mixplane.io/role"] != "loader":
            assert "MIXPLANE_INDEX_CACHE" not in env
            continue
        assert env["MIXPLANE_INDEX_CACHE"] == INDEX_CACHE
        # under a mount that is writable (the root filesystem is read-only)
        (m,) = [m for m in c["volumeMounts"] if INDEX_CACHE.startswith(m["mountPath"] + "/")]
        assert not m.get("readOnly") and c["securityContext"]["readOnlyRootFilesystem"]


def test_disruption_budgets_use_the_api_the_server_serves():
    from mixplane.operator.builders import disruption_budgets, pdb_api_version

    v120 = {"kind": "APIGroup", "name": "policy", "versions": [{"groupVersion": "policy/v1beta1", "version": "v1beta1"}]}
    v121 = {"kind": "APIGroup", "name": "policy", "versions": [{"groupVersion": "policy/v1", "version": "v1"},
                                                              {"groupVersion": "policy/v1beta1", "version": "v1beta1"}]}
    v125 = {"kind": "APIGroup", "name": "policy", "versions": [{"groupVersion": "policy/v1", "version": "v1"}]}
    assert pdb_api_version(v120) == "policy/v1beta1"
    assert pdb_api_version(v121) == pdb_api_version(v125) == "policy/v1"
    assert pdb_api_version(None) == "policy/v1"  # not discoverable: the current API
    assert {b["apiVersion"] for b in disruption_budgets(OPTS)} == {"policy/v1"}
    assert {b["apiVersion"] for b in disruption_budgets(replace(OPTS, pdb_api_version="policy/v1beta1"))} == {"policy/v1beta1"}


def test_network_policies_and_budgets():
    _, _, objs = render()
    nps = by(objs, "NetworkPolicy")
    planner = nps["demo-planner"]["spec"]
    assert planner["podSelector"]["matchLabels"] == {"mixplane.io/instance": "demo", "mixplane.io/role": "planner"}
    sources = [f["podSelector"]["matchLabels"] for f in planner["ingress"][0]["from"]]
    assert {"mixplane.io/mixture": "demo"} in sources and {"mixplane.io/instance": "demo"} in sources
    loaders = nps["demo-loaders"]["spec"]["ingress"][0]["from"]
    assert [f["podSelector"]["matchLabels"] for f in loaders] == [{"mixplane.io/instance": "demo"}]  # no trainer
    pdbs = by(objs, "PodDisruptionBudget")
    assert set(pdbs) == {"demo-planner", "demo-constructor"}
    sa = by(objs, "ServiceAccount")["demo-mixplane"]
    assert sa["automountServiceAccountToken"] is False


def test_names_and_resources_are_valid():
    long = dns_label("m" * 40 + "-loader-" + "s" * 40 + "-0-7")
    assert len(long) <= 63 and long != dns_label("m" * 40 + "-loader-" + "s" * 40 + "-0-8")
    with pytest.raises(ValueError, match="positive"):
        resources(0.0, 100, OPTS)
    assert json.dumps(render()[2])  # plain JSON, nothing else


def test_constructor_index_comes_from_the_statefulset_pod_name():
    import argparse

    from mixplane.cli import constructor_index

    assert constructor_index("3") == 3
    assert constructor_index("demo-constructor-12") == 12
    with pytest.raises(argparse.ArgumentTypeError, match="pod name"):
        constructor_index("demo-constructor")


def test_planner_journal_is_on_a_claim_unless_turned_off():
    _, _, objs = render(spec=demo_spec(kubernetes={"journal_mb": 2048, "storage_class": "fast"}))
    pvc = by(objs, "PersistentVolumeClaim")["demo-journal"]
    assert pvc["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "2048Mi"}},
                           "storageClassName": "fast"}
    pod = by(objs, "Deployment")["demo-planner"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"][c["args"].index("--run-dir") + 1] == JOURNAL_MOUNT  # where the planner journals
    assert {"name": "journal", "mountPath": JOURNAL_MOUNT} in c["volumeMounts"]
    assert {"name": "journal", "persistentVolumeClaim": {"claimName": "demo-journal"}} in pod["volumes"]
    # the compiled planning loops are cached beside the journal: a planner pod replacing a lost one loads them
    assert {"name": "NUMBA_CACHE_DIR", "value": JOURNAL_MOUNT + "/numba-cache"} in c["env"]
    # the ready file stays in the pod's own emptyDir: a restarted pod is not ready because the last one was
    assert c["args"][c["args"].index("--ready-file") + 1].startswith("/var/run/mixplane/run/")
    _, _, off = render(spec=demo_spec(kubernetes={"journal_mb": 0}))
    assert not by(off, "PersistentVolumeClaim")
    pod = by(off, "Deployment")["demo-planner"]["spec"]["template"]["spec"]
    assert {"name": "journal", "emptyDir": {}} in pod["volumes"]


def test_every_component_serves_metrics_on_a_fixed_port_a_service_monitor_finds():
    _, _, objs = render()
    services = [s for s in by(objs, "Service").values() if s["metadata"]["labels"].get("mixplane.io/metrics") == "true"]
    pods = [o for o in objs if o.get("spec", {}).get("template")]
    assert pods
    for o in pods:
        tmpl = o["spec"]["template"]
        ann = tmpl["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9090"
        (c,) = tmpl["spec"]["containers"]
        assert c["args"][c["args"].index("--metrics-port") + 1] == "9090"
        assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in c["ports"]
        assert {"name": "MIXPLANE_METRICS_HOST", "value": "0.0.0.0"} in c["env"]  # reachable from Prometheus
        # the chart's ServiceMonitor: a Service labelled mixplane.io/metrics with a port named metrics selects it
        svc = [s for s in services if s["spec"]["selector"].items() <= tmpl["metadata"]["labels"].items()]
        assert svc, o["metadata"]["name"]
        port = next(p for p in svc[0]["spec"]["ports"] if p["name"] == "metrics")
        assert port.get("targetPort", port["port"]) == 9090


def test_sidecar_placement_fills_trainer_pods_first_and_scales_out_the_rest():
    costs = [SourceCost("code", 1.5e-6, 40 * MIB), SourceCost("man", 1.5e-6, 30 * MIB), SourceCost("docs", 1.4e-6, 30 * MIB)]
    spec = demo_spec(kubernetes={"placement": "sidecar", "sidecar_cpu": 1.0, "sidecar_memory_mb": 2048})
    plan = auto_partition(costs, spec_schedule(spec), 2_000_000, LoaderBudget(32, 1 << 40))
    bounds = PartitionBounds()
    pods, placement = sidecar_layout(spec, plan, costs, 2_000_000, bounds, 0)
    assert trainer_slots(spec) == 2  # 4 ranks, 2 per node: one trainer pod per node
    side = [p for s in placement.slots for p in s]
    assert side and placement.remote  # 2 trainer pods x 1 core cannot hold ~3.7 peak cores: the rest is remote
    for s in placement.slots:
        assert sum(p.cpu for p in s) <= 1.0 + 1e-9 and sum(p.memory for p in s) <= 2048 * MIB
    every = sorted(m for p in pods.pods for m in p.members)
    assert every == sorted((s, r) for s, n in plan.partitions.items() for r in range(n))  # each partition once
    assert sorted(m for p in [*side, *placement.remote] for m in p.members) == every
    # remote pods become Deployments, sidecars do not
    remote = PodPlan(pods.weights, tuple(p for p in pods.pods if p not in side))
    _, objs = render_mixture(spec, OPTS, remote, plan.partitions, KEYS, side)
    hosted = {x for d in by(objs, "Deployment").values() for x in d["metadata"].get("annotations", {}).get("mixplane.io/partitions", "").split(",") if x}
    assert hosted == {f"{s}:{r}" for p in placement.remote for s, r in p.members}
    # the containers of trainer slot 0: the loader command line with its own metrics port, prefixed names
    ctrs = sidecar_containers(spec, OPTS, pods.pods, plan.partitions, placement.slots[0])
    assert len(ctrs) == len(placement.slots[0])
    vols = {v["name"] for v in sidecar_volumes(OPTS)}
    for i, c in enumerate(ctrs):
        assert c["name"].startswith("mixplane-loader") and c["args"][0] == "loader"
        assert c["args"][c["args"].index("--metrics-port") + 1] == str(9191 + i)
        assert {m["name"] for m in c["volumeMounts"]} <= vols and "readinessProbe" not in c
        parts = c["args"][c["args"].index("--sources") + 1] if "--sources" in c["args"] else \
            f"{c['args'][c['args'].index('--source') + 1]}:{c['args'][c['args'].index('--replica') + 1]}"
        assert parts == ",".join(f"{s}:{r}" for s, r in placement.slots[0][i].members)


def test_sidecars_are_what_the_pod_webhook_injects_for_the_pods_slot():
    from mixplane.operator.reconcile import sidecar_injection
    from mixplane.operator.webhooks import Injection, inject_pod, trainer_index

    spec_doc = json.loads(demo_spec(kubernetes={"placement": "sidecar", "sidecar_cpu": 1.0}).model_dump_json())
    body = {"metadata": {"name": "demo", "namespace": "ml", "annotations": {"mixplane.io/tokens-per-second": "2000000"}},
            "spec": spec_doc}
    prof = {"version": 1, "sources": {n: {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 30 * MIB} for n in ("code", "man", "docs")}}
    pod = {"metadata": {"name": "train-1", "labels": {"mixplane.io/mixture": "demo"},
                        "ownerReferences": [{"kind": "StatefulSet", "name": "train"}]},
           "spec": {"containers": [{"name": "train", "image": "t"}]}}
    assert trainer_index(pod) == 1
    assert trainer_index({"metadata": {"name": "x", "annotations": {"batch.kubernetes.io/job-completion-index": "3"}}}) == 3
    assert trainer_index({"metadata": {"name": "train-7f9c-abcde"}}) is None  # a Deployment's pod: no slot
    ctrs, vols = sidecar_injection(body, OPTS, prof, 1)
    assert ctrs and vols
    new = inject_pod(pod, Injection("demo", OPTS.planner_endpoint, OPTS.secret_name, sidecars=tuple(ctrs), volumes=tuple(vols)))
    names = [c["name"] for c in new["spec"]["containers"]]
    assert names[0] == "train" and names[1:] == [c["name"] for c in ctrs]
    assert sidecar_injection(body, OPTS, prof, None) == ([], [])
    assert sidecar_injection(body, OPTS, prof, 99) == ([], [])
    remote_body = {**body, "spec": {**spec_doc, "kubernetes": {"placement": "remote"}}}
    assert sidecar_injection(remote_body, OPTS, prof, 0) == ([], [])


def test_a_loaders_launch_list_without_the_partitions_of_re_partitioned_sources():
    from mixplane.operator.builders import loader_args_without

    one = ("loader", "--spec", "/s.json", "--source", "code", "--replica", "0", "--host-name", "loader-code-0", "--planner", "tcp://p")
    assert loader_args_without(one, {"code"}) == ("loader", "--spec", "/s.json", "--host-name", "loader-code-0", "--planner", "tcp://p")
    assert loader_args_without(one, {"web"}) == one
    group = ("loader", "--sources", "web:0,code:0,code:1", "--host-name", "g", "--shadow")
    assert loader_args_without(group, {"code"}) == ("loader", "--sources", "web:0", "--host-name", "g", "--shadow")
    assert loader_args_without(group, {"code", "web"}) == ("loader", "--host-name", "g", "--shadow")
