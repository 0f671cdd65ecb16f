"""Manifest builders: spec + launch plan + auto-partitioner pods -> the children of one DataMixture."""

from __future__ import annotations

import json

import pytest

from mixplane.operator.autopartition import (
    MIB,
    LoaderBudget,
    SourceCost,
    auto_partition,
    spec_schedule,
)
from mixplane.operator.builders import (
    COMPONENT_KEY_ITEMS,
    KEY_MOUNT,
    ClusterOptions,
    dns_label,
    key_secret,
    render_mixture,
    resources,
)
from mixplane.spec import DataMixtureSpec, parse_spec

OPTS = ClusterOptions(name="demo", namespace="ml", image="mixplane:test")
KEYS = {r: (f"{r}-public-".ljust(40, "x"), f"{r}-secret-".ljust(40, "y")) for r in ("server", "component", "client", "admin")}


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
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Secret", "Service",
                     "ServiceAccount", "StatefulSet"]
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
