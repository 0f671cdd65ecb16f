"""`mixplane replay` stays bit-exact across everything that can happen to a run (issue 11 item 8): a loader
SIGKILLed and replaced by its shadow, a trainer rank resuming from its state_dict, a partition handoff, a
runtime mixture update and a live DP change. Every delivered (step, rank) batch is rebuilt from the journal
and compared with what the rank received. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from mixplane.control import update_mixture
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime, RestartPolicy
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

from .test_reshard import fetch


def test_replay_is_bit_exact_after_kills_handoff_update_and_reshard(token_sources, tmp_path, monkeypatch):
    spec = parse_spec(token_mixture(token_sources["root"], topology={"modules": {"backbone": {"dp": 2}}},
                                    runtime={"window": 64, "metrics": False, "journal_every": 4, "shadow_loaders": 1}))
    run_dir = tmp_path / "run"
    delivered: dict[tuple[int, int], np.ndarray] = {}

    def keep(got: dict) -> None:
        for r, steps in got.items():
            for s, b in steps.items():
                delivered[(s, r)] = b["input_ids"]

    with EmbeddedRuntime(spec, run_dir, restart=RestartPolicy(backoff_s=0.05)) as rt:
        got, states = fetch(rt.planner_endpoint, 2, stop=5)
        keep(got)
        # a primary loader killed: its shadow takes over, the runtime restarts the dead process
        victim = next(c for c in rt.children if c.component and c.component.role == "loader" and not c.component.shadow)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        # the planner promotes the shadow once the dead host has been silent past failover_after_s; restarting
        # the process before that (supervision is quick) would let it re-adopt its own partitions instead
        moved = {str(p) for p in victim.component.partitions}
        deadline = time.monotonic() + 60
        while any(rt.partitions()["partitions"][p]["host"] == victim.component.name for p in moved):
            assert time.monotonic() < deadline, f"no shadow promoted for {sorted(moved)}"
            time.sleep(0.1)
        while not rt.supervise():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got, states = fetch(rt.planner_endpoint, 2, start=5, stop=9, state=states[0])  # ranks resume from their state
        keep(got)
        # a mixture update from step 12 and a handoff of partition b:0 to its shadow
        update_mixture(rt.planner_endpoint, {"weights": {"a": 0.2, "b": 0.2, "c": 0.6}, "effective_step": 12},
                       curve=rt.control_curve)
        table = rt.partitions()["partitions"]["b:0"]
        rt.handoff("b:0", table["shadows"][0])
        got, states = fetch(rt.planner_endpoint, 2, start=9, stop=14, state=states[0])
        keep(got)
        # live DP change 2 -> 4 at step 14
        rt.reshard({"modules": {"backbone": {"dp": 4}}}, states[0], attempt="replay-test")
        monkeypatch.setenv("MIXPLANE_RESUME_ID", "replay-test")
        got, _ = fetch(rt.planner_endpoint, 4, start=14, stop=18, state=states[0])
        keep(got)
    planner_log = (run_dir / "logs" / "planner.log").read_text()
    assert "promoting shadow" in planner_log and "resharded at step 14" in planner_log
    for (step, rank), ids in sorted(delivered.items()):
        if step % 3 and step not in (12, 13, 14):  # every third step, and the steps at each change
            continue
        out = replay_step(spec, step=step, rank=rank, run_dir=str(run_dir), save=str(tmp_path / "r.npz"))
        assert out["digest_match"], (step, rank)
        assert np.array_equal(np.load(tmp_path / "r.npz")["input_ids"], ids), f"step {step} rank {rank}"
        if step >= 12:
            assert out["generation"] >= 1
