"""Partition handoff between loader processes, shadow loaders promoted on SIGKILL and SIGSTOP, and a fenced
zombie (issue 11 items 2 and 3). Real processes and signals; every rank's batches must equal a failure-free
run's, step by step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mixplane.launch import Component
from mixplane.runtime import Child, EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture
from tests.integration.test_loader_restart import KEYS, RANKS, STEPS, Fetcher


def make_spec(root: Path, **runtime):
    return parse_spec(token_mixture(root, runtime={"window": 64, "metrics": False, **runtime}))


@pytest.fixture(scope="module")
def reference(token_sources, tmp_path_factory):
    with EmbeddedRuntime(make_spec(token_sources["root"]), tmp_path_factory.mktemp("reference")) as rt:
        return Fetcher(rt.planner_endpoint).join()


def assert_same_batches(got, reference):
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS)), f"rank {r}: steps out of order or missing"
        for step in range(STEPS):
            for k in KEYS:
                assert np.array_equal(got[r][step][k], reference[r][step][k]), f"rank {r} step {step}: {k} differs"


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def wait_steps(fetch: Fetcher, n: int, timeout_s: float = 120) -> None:
    wait_for(lambda: fetch.delivered() >= n or fetch.errors, timeout_s, f"{n} steps")
    assert not fetch.errors, fetch.errors


def child(rt: EmbeddedRuntime, name: str) -> Child:
    return next(c for c in rt.children if c.name == name)


def spawn_empty_host(rt: EmbeddedRuntime, name: str) -> Child:
    """A loader process started with no partitions (a pod added by scaling): it serves what it is handed."""
    plan = rt.plan()
    ready = str(rt.run_dir / "ready" / f"{name}.json")
    args = ["loader", "--spec", plan.target.spec_file, "--ready-file", ready, "--host-name", name,
            "--planner", rt.planner_endpoint or ""]
    if rt.key_dir:
        args += ["--curve-dir", str(rt.key_dir)]
    c = rt._spawn(Component("loader", name, tuple(args), env={"PYTHONUNBUFFERED": "1"}, ready_file=ready))
    rt._wait_ready([c])
    return c


def stall_after(fetch: Fetcher, at: dict[int, int], t0: float) -> float:
    """Longest wait of any rank for its next step after `t0` (the moment of the failure)."""
    worst = 0.0
    for r in range(RANKS):
        times = [t0, *fetch.times[r][at[r]:]]
        worst = max(worst, float(np.max(np.diff(times))) if len(times) > 1 else float("nan"))
    return worst


def metric_sum(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))


def test_handoff_on_request_moves_partitions_between_processes_at_a_step_boundary(token_sources, reference, tmp_path):
    with EmbeddedRuntime(make_spec(token_sources["root"]), tmp_path / "run") as rt:
        # start() returns once the loaders wrote their ready files; each is in the table once its HELLO arrived
        wait_for(lambda: rt.partitions()["partitions"]["a:0"]["host"], 30, "loader-a-0 to register a:0")
        table = rt.partitions()
        assert table["partitions"]["a:0"]["host"] == "loader-a-0" and table["partitions"]["a:0"]["epoch"] == 1
        extra = spawn_empty_host(rt, "scale-out-1")
        wait_for(lambda: rt.partitions()["hosts"].get("scale-out-1", {}).get("alive"), 30, "the empty host to register")
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.02)
        wait_steps(fetch, 5)
        # scaling out: an added process takes a partition; then another moves to an existing process
        r1 = rt.handoff("a:0", "scale-out-1")
        assert (r1["partition"], r1["from"], r1["to"], r1["epoch"]) == ("a:0", "loader-a-0", "scale-out-1", 2)
        assert r1["after_step"] >= 4
        wait_steps(fetch, 12)
        # the same through the command line, with the run dir's admin key
        cli = [sys.executable, "-m", "mixplane.cli", "handoff", "--run-dir", str(rt.run_dir)]
        shown = json.loads(subprocess.run(cli, check=True, capture_output=True, text=True, timeout=60).stdout)
        assert shown["partitions"]["a:0"]["host"] == "scale-out-1"
        r2 = json.loads(subprocess.run([*cli, "c:0", "--to", "loader-b-0"], check=True, capture_output=True, text=True,
                                       timeout=60).stdout)
        assert r2["epoch"] == 2 and r2["after_step"] >= 11
        bad = subprocess.run([*cli, "c:0", "--to", "nobody"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "loader host 'nobody' is not alive (never registered)" in bad.stderr, bad.stderr
        wait_steps(fetch, 18)
        r3 = rt.handoff("a:0", "loader-a-0")  # and back
        assert r3["epoch"] == 3
        with pytest.raises(RuntimeError, match="no loader host 'nobody'|not alive"):
            rt.handoff("b:0", "nobody")
        with pytest.raises(RuntimeError, match="unknown source"):
            rt.handoff("z:0", "loader-a-0")
        got = fetch.join()
        table = rt.partitions()
        assert extra.proc.poll() is None and not rt.dead()
        planner_log = (rt.run_dir / "logs" / "planner.log").read_text(errors="replace")
    assert table["partitions"]["a:0"] == {"host": "loader-a-0", "epoch": 3, "shadows": []}
    assert table["partitions"]["c:0"]["host"] == "loader-b-0"
    assert table["hosts"]["loader-b-0"]["partitions"] == ["b:0", "c:0"]
    assert [h["reason"] for h in table["handoffs"]] == ["request"] * 3
    assert "partition a:0: loader-a-0 -> scale-out-1 (epoch 2, request)" in planner_log
    assert_same_batches(got, reference)


def test_handoff_needs_the_admin_key(token_sources, tmp_path):
    from mixplane import control
    from mixplane.control import ControlCurve

    with EmbeddedRuntime(make_spec(token_sources["root"]), tmp_path / "run") as rt:
        with pytest.raises((TimeoutError, RuntimeError)):
            control.handoff(rt.planner_endpoint or "", "a:0", "loader-b-0", timeout_s=2.0,
                            curve=ControlCurve(str(rt.key_dir), "client"))
        assert rt.partitions()["partitions"]["a:0"]["host"] == "loader-a-0"


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_shadow_is_promoted_when_its_primary_dies_or_hangs_and_the_old_one_delivers_nothing(
        token_sources, reference, tmp_path, how):
    # no time-sized look-ahead: steps must still be planned for the hung loader when it wakes up (fencing)
    spec = make_spec(token_sources["root"], shadow_loaders=1, metrics=True, prefetch_s=0)
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        wait_for(lambda: rt.partitions()["partitions"]["a:0"]["shadows"], 30, "a shadow to follow a:0")
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.05)
        wait_steps(fetch, 8)
        a0 = rt.partitions()["partitions"]["a:0"]
        victim, shadow = child(rt, a0["host"]), a0["shadows"][0]
        at = {r: len(fetch.times[r]) for r in range(RANKS)}
        t0 = time.monotonic()
        os.kill(victim.proc.pid, getattr(signal, how))
        wait_for(lambda: rt.partitions()["partitions"]["a:0"]["host"] == shadow, 30, "the promotion", poll_s=0.01)
        promoted_s = time.monotonic() - t0
        if how == "SIGKILL":
            victim.proc.wait(10)
            assert victim.proc.returncode == -signal.SIGKILL
            fresh = rt._spawn(victim.component)  # what supervision does: the restarted primary becomes the shadow
            rt._wait_ready([fresh])
        else:
            time.sleep(1.0)  # the planner planned steps for the hung loader before it was found silent
            os.kill(victim.proc.pid, signal.SIGCONT)  # the zombie wakes up with plans and spans of its old epoch
        wait_for(lambda: victim.name in rt.partitions()["partitions"]["a:0"]["shadows"], 60,
                 "the old primary to become the shadow")
        got = fetch.join()
        table = rt.partitions()
        fenced = sum(metric_sum(child(rt, f"constructor-{i}").info["metrics_port"], "mixplane_fenced_messages_total")
                     for i in range(2))
        planner_log = (rt.run_dir / "logs" / "planner.log").read_text(errors="replace")
    assert f"promoting shadow {shadow} for partition a:0" in planner_log
    assert table["partitions"]["a:0"]["epoch"] >= 2
    assert_same_batches(got, reference)
    if how == "SIGSTOP":
        # the resumed zombie built and pushed the spans planned for it before it hung: all dropped as fenced
        assert fenced > 0, "the zombie sent nothing the constructors had to drop (test did not exercise fencing)"
    stall = stall_after(fetch, at, t0)
    print(json.dumps({"failure": how, "shadow": True, "promoted_after_s": round(promoted_s, 3),
                      "max_stall_s": round(stall, 3), "fenced_samples": fenced, "steps": STEPS}))


def test_a_restarted_loader_restores_its_differential_checkpoint_and_the_planner_bridges_the_gap(
        token_sources, reference, tmp_path):
    # no time-sized look-ahead: steps must still be planned for the restarted loader (its new snapshots)
    spec = make_spec(token_sources["root"], loader_snapshot_every=3, prefetch_s=0)
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.03)
        wait_steps(fetch, 10)
        snap_file = rt.run_dir / "loader-state" / "a-0.json"
        first = wait_for(lambda: snap_file.exists() and json.loads(snap_file.read_text()), 30, "a snapshot of a:0")
        assert first["source"] == "a" and first["replica"] == 0 and first["epoch"] == 1 and first["step"] >= 2
        victim = child(rt, "loader-a-0")
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        snap = json.loads(snap_file.read_text())
        fresh = rt._spawn(victim.component)
        rt._wait_ready([fresh])
        got = fetch.join()
        later = json.loads(snap_file.read_text())
        loader_log = (rt.run_dir / "logs" / "loader-a-0.log").read_text(errors="replace")
        table = rt.partitions()
    assert f"restored its snapshot of step {snap['step']}" in loader_log, loader_log[-2000:]
    assert later["epoch"] == 2 and later["step"] > snap["step"]  # the new incarnation snapshots under its epoch
    assert table["partitions"]["a:0"]["epoch"] == 2
    assert_same_batches(got, reference)
