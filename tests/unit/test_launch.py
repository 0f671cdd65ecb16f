"""The launch plan is pure data: which components run, with which arguments, ports and partitions."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from mixplane.cli import build_parser
from mixplane.launch import (
    PLANNER_PLACEHOLDER,
    LaunchTarget,
    Partition,
    launch_plan,
    loader_groups,
)
from mixplane.spec import parse_spec
from mixplane.topology import constructor_groups
from tests.conftest import token_mixture


def spec_of(tmp_path, **overrides):
    doc = token_mixture(tmp_path, **overrides)
    return parse_spec(doc)


def test_module_imports_no_sockets_processes_or_kubernetes():
    import subprocess

    code = ("import sys, mixplane.launch; bad = [m for m in ('zmq', 'subprocess', 'kubernetes', 'kopf', 'mixplane.wire', "
            "'mixplane.runtime') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_planner_first_then_one_constructor_per_group_and_every_partition_once(tmp_path):
    spec = spec_of(tmp_path, sources=[{"name": n, "uri": str(tmp_path / n), "kind": "tokens", "columns": ["tokens"],
                                       "replicas": r} for n, r in (("a", 2), ("b", 1), ("c", 3))],
                   topology={"modules": {"backbone": {"dp": 4, "tp": 2}}})
    plan = launch_plan(spec, LaunchTarget(run_dir="/run/x"))
    assert plan.components[0].role == "planner" and plan.planner is plan.components[0]
    cons = plan.of_role("constructor")
    groups = constructor_groups(spec)
    assert [c.index for c in cons] == list(range(len(groups)))
    assert [list(c.ranks) for c in cons] == groups
    parts = [p for c in plan.of_role("loader") for p in c.partitions]
    assert Counter(parts) == Counter(Partition(s.name, r) for s in spec.sources for r in range(s.replicas))
    assert len(parts) == 6 and len(plan.of_role("loader")) == 6  # sources_per_loader 1: a process each
    names = [c.name for c in plan.components]
    assert len(set(names)) == len(names)
    assert "loader-c-2" in names and "constructor-0" in names


def test_sources_per_loader_groups_in_spec_order(tmp_path):
    spec = spec_of(tmp_path, runtime={"sources_per_loader": 2})
    assert loader_groups(spec) == [[("a", 0), ("b", 0)], [("c", 0)]]
    loaders = launch_plan(spec, LaunchTarget(run_dir="/r")).of_role("loader")
    assert [c.partitions for c in loaders] == [(Partition("a", 0), Partition("b", 0)), (Partition("c", 0),)]
    assert loaders[0].name == "loaders-a-0+1" and "--sources" in loaders[0].args
    assert loaders[0].args[loaders[0].args.index("--sources") + 1] == "a:0,b:0"
    assert loaders[1].name == "loader-c-0" and "--source" in loaders[1].args


def test_every_component_command_line_is_accepted_by_its_entrypoint(tmp_path):
    spec = spec_of(tmp_path, runtime={"sources_per_loader": 2, "metrics": True})
    target = LaunchTarget(run_dir="/run/m", bind_host="0.0.0.0", planner_host="planner.ns.svc", planner_port=5555,
                          key_dir="/etc/mixplane/keys", metrics_port=9090, spec_path="/etc/mixplane/spec.json",
                          constructor_ports=(6000, 6001), advertise_host="$(POD_IP)")
    plan = launch_plan(spec, target)
    parser = build_parser()
    for c in plan.components:
        ns = parser.parse_args(list(c.args))
        assert ns.command == c.role
        assert ns.spec == "/etc/mixplane/spec.json" and ns.curve_dir == "/etc/mixplane/keys"
        assert ns.ready_file == f"/run/m/ready/{c.name}.json" == c.ready_file
        if c.role == "planner":
            assert ns.bind == "tcp://0.0.0.0:5555" and ns.run_dir == "/run/m" and c.ports["planner"] == 5555
        else:
            assert ns.planner == "tcp://planner.ns.svc:5555"
        if c.role == "constructor":
            assert ns.index == c.index and ns.host == "0.0.0.0" and ns.advertise_host == "$(POD_IP)"
            assert (ns.data_port, ns.client_port) == (6000, 6001) == (c.ports["data"], c.ports["clients"])
            assert c.binds == {"data": "tcp://0.0.0.0:6000", "clients": "tcp://0.0.0.0:6001"}
        # every process serves one fixed metrics port (a loader hosting a group: its partitions merged)
        assert ns.metrics_port == 9090 and c.ports["metrics"] == 9090


def test_hosts_come_from_the_target_not_from_localhost(tmp_path):
    spec = spec_of(tmp_path)
    plan = launch_plan(spec, LaunchTarget(run_dir="/r", bind_host="0.0.0.0", planner_host="p.svc", planner_port=7000))
    text = " ".join(a for c in plan.components for a in c.args) + " ".join(e for c in plan.components for e in c.binds.values())
    assert "127.0.0.1" not in text and "localhost" not in text
    assert not plan.needs_planner_endpoint


def test_a_port_picked_at_start_is_filled_in_later(tmp_path):
    spec = spec_of(tmp_path, runtime={"host": "127.0.0.2"})
    plan = launch_plan(spec, LaunchTarget.local(spec, "/r"))
    assert plan.needs_planner_endpoint
    assert plan.planner.binds["planner"] == "tcp://127.0.0.2:*"
    assert all(PLANNER_PLACEHOLDER in c.args for c in plan.components if c.role != "planner")
    bound = plan.with_planner("tcp://127.0.0.2:4242")
    assert not bound.needs_planner_endpoint
    for c in bound.components:
        if c.role != "planner":
            assert c.args[c.args.index("--planner") + 1] == "tcp://127.0.0.2:4242"
    assert plan.needs_planner_endpoint  # the original is unchanged (frozen data)


def test_no_key_dir_no_curve_arguments(tmp_path):
    plan = launch_plan(spec_of(tmp_path), LaunchTarget(run_dir="/r"))
    assert not any("--curve-dir" in c.args for c in plan.components)


def test_resource_hints_grow_with_what_a_component_holds(tmp_path):
    small = spec_of(tmp_path)
    big_buf = spec_of(tmp_path, sources=[{"name": n, "uri": str(tmp_path / n), "kind": "tokens", "columns": ["tokens"],
                                          "shuffle_buffer_mb": 256.0} for n in ("a", "b", "c")])
    t = LaunchTarget(run_dir="/r")
    ld_small = launch_plan(small, t).component("loader-a-0")
    ld_big = launch_plan(big_buf, t).component("loader-a-0")
    assert ld_big.resources.memory_bytes > ld_small.resources.memory_bytes + 400 * (1 << 20)
    grouped = launch_plan(spec_of(tmp_path, runtime={"sources_per_loader": 3}), t).of_role("loader")[0]
    assert grouped.resources.memory_bytes > ld_small.resources.memory_bytes
    bigger_batch = spec_of(tmp_path, batch={"sequences": 64, "seq_len": 4096, "microbatches": 2})
    assert (launch_plan(bigger_batch, t).component("constructor-0").resources.memory_bytes
            > launch_plan(small, t).component("constructor-0").resources.memory_bytes)
    for c in launch_plan(small, t).components:
        assert c.resources.cpu > 0 and c.resources.memory_bytes > 0


def test_constructor_memory_covers_the_time_sized_look_ahead(tmp_path):
    """With prefetch_s (the default) a trainer with short steps keeps up to max_lead_steps steps requested: the
    constructor's estimate (its pod's request; the limit is a multiple of it) covers them, not prefetch_steps only."""
    from mixplane.launch import steps_held

    batch = {"sequences": 64, "seq_len": 4096, "microbatches": 2}
    t = LaunchTarget(run_dir="/r")

    def mem(**runtime) -> int:
        return launch_plan(spec_of(tmp_path, batch=batch, runtime=runtime), t).component("constructor-0").resources.memory_bytes

    fixed = spec_of(tmp_path, batch=batch, runtime={"prefetch_s": 0, "prefetch_steps": 2})
    timed = spec_of(tmp_path, batch=batch, runtime={"prefetch_s": 10.0, "max_lead_steps": 32})
    assert steps_held(fixed) == 4 and steps_held(timed) == 34
    share = timed.tokens_per_step // len(launch_plan(timed, t).of_role("constructor"))
    assert mem(prefetch_s=10.0, max_lead_steps=32) - mem(prefetch_s=0, prefetch_steps=2) == 30 * share * 24
    assert mem(prefetch_s=10.0, max_lead_steps=8) < mem(prefetch_s=10.0, max_lead_steps=32)


def test_env_and_dns_names(tmp_path):
    plan = launch_plan(spec_of(tmp_path, runtime={"sources_per_loader": 2}), LaunchTarget(run_dir="/r"))
    for c in plan.components:
        assert c.env["PYTHONUNBUFFERED"] == "1"
        assert len(c.dns_name) <= 63 and all(ch.isalnum() or ch == "-" for ch in c.dns_name)
        assert c.dns_name == c.dns_name.lower()
    assert plan.component("loaders-a-0+1").dns_name == "loaders-a-0-1"
    assert plan.of_role("loader")[0].env["TOKENIZERS_PARALLELISM"] == "false"
    with pytest.raises(KeyError, match="no component 'nope'"):
        plan.component("nope")


def test_a_constructor_announces_its_advertised_host_with_the_bound_ports(tmp_path):
    import zmq

    from mixplane.constructor.server import ConstructorServer

    ctx = zmq.Context()
    try:
        srv = ConstructorServer(spec_of(tmp_path), 0, "tcp://127.0.0.1:1", context=ctx, metrics_port=None,
                                advertise_host="localhost")
        try:
            for ep, sock in ((srv.data_endpoint, srv.data), (srv.client_endpoint, srv.clients)):
                port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
                assert ep == f"tcp://localhost:{port}" and int(port) > 0
        finally:
            srv.close()  # every socket, the planner socket's connection monitor too
    finally:
        ctx.term()
