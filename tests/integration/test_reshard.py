"""Trainer restarts and elastic resharding (issue 11 item 6), with real processes.

* a checkpoint taken at DP = 2 resumes in a new run at DP = 4 (and at DP = 1);
* a running data plane changes DP 2 -> 4 at a step boundary (`EmbeddedRuntime.reshard`: the planner adopts
  it, the constructors are replaced from the new launch plan);
* a trainer rank process killed with SIGKILL resumes from its own state_dict and rejoins the running session;

and in every case the global sequence of samples per step equals a failure-free run's (only distributed
differently), and `mixplane replay` rebuilds delivered (step, rank) batches bit for bit from the journal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mixplane.client import MixtureLoader
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

STEPS = 16
BOUNDARY = 7
SEG = ("segment_source", "segment_key", "segment_start", "segment_len")


def spec(root: Path, dp: int):
    return parse_spec(token_mixture(root, topology={"modules": {"backbone": {"dp": dp}}},
                                    runtime={"window": 64, "metrics": False, "journal_every": 5}))


def fetch(endpoint: str, ranks: int, *, start: int = 0, stop: int = STEPS, state: dict | None = None) -> tuple[dict, dict]:
    """Every rank in a thread from `start` (a state_dict) to `stop`: {rank: {step: batch}}, the states at `stop`."""
    got: dict[int, dict[int, dict]] = {r: {} for r in range(ranks)}
    states: dict[int, dict] = {}
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            loader = MixtureLoader(endpoint, rank=r, max_steps=stop, timeout_s=90)
            if state is not None:
                loader.load_state_dict(state)
            for b in loader:
                got[r][int(b["step"])] = {k: b[k].numpy().copy() for k in ("input_ids", "source_ids", *SEG)}
            states[r] = loader.state_dict()
            loader.close()
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads)
    for r in range(ranks):
        assert sorted(got[r]) == list(range(start, stop)), f"rank {r} got steps {sorted(got[r])}"
    return got, states


def global_step(got: dict[int, dict[int, dict]], step: int) -> tuple[list[tuple[int, int, int, int]], np.ndarray]:
    """What the whole job consumed at `step`: its segments (sorted) and its rows in rank (= dp) order."""
    segs = sorted(t for r in got for t in zip(*(got[r][step][k].tolist() for k in SEG)))
    rows = np.concatenate([got[r][step]["input_ids"] for r in sorted(got)])
    return segs, rows


def assert_same_global(reference: dict, got: dict, steps: range) -> None:
    for s in steps:
        ref_segs, ref_rows = global_step(reference, s)
        segs, rows = global_step(got, s)
        assert segs == ref_segs, f"step {s}: another set of samples than the failure-free run"
        assert np.array_equal(rows, ref_rows), f"step {s}: rows differ from the failure-free run"


@pytest.fixture(scope="module")
def reference(token_sources, tmp_path_factory):
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path_factory.mktemp("ref")) as rt:
        got, _ = fetch(rt.planner_endpoint, 2)
    return got


@pytest.mark.parametrize("dp", [4, 1])
def test_checkpoint_at_dp2_resumes_in_a_new_run_at_another_dp(token_sources, tmp_path, reference, dp):
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "a") as rt:
        _, states = fetch(rt.planner_endpoint, 2, stop=BOUNDARY)
    state = json.loads(json.dumps(states[0]))  # as a checkpoint file holds it
    with EmbeddedRuntime(spec(token_sources["root"], dp), tmp_path / "b") as rt:
        got, _ = fetch(rt.planner_endpoint, dp, start=BOUNDARY, state=state)
    assert_same_global(reference, got, range(BOUNDARY, STEPS))


def test_live_reshard_dp2_to_dp4_keeps_the_global_sequence_and_replays(token_sources, tmp_path, reference, monkeypatch):
    run_dir = tmp_path / "live"
    with EmbeddedRuntime(spec(token_sources["root"], 2), run_dir) as rt:
        before, states = fetch(rt.planner_endpoint, 2, stop=BOUNDARY)
        old = {c.name: c.proc.pid for c in rt.children if c.component and c.component.role == "constructor"}
        reply = rt.reshard({"modules": {"backbone": {"dp": 4}}}, states[1], attempt="reshard-test")
        assert reply["step"] == BOUNDARY and reply["world_size"] == 4 and reply["constructors"] == 4
        new = {c.name: c.proc.pid for c in rt.children if c.component and c.component.role == "constructor"}
        assert len(new) == 4 and not set(new.values()) & set(old.values())
        assert parse_spec(json.loads((run_dir / "spec.json").read_text())).topology.backbone()[1].dp == 4
        monkeypatch.setenv("MIXPLANE_RESUME_ID", "reshard-test")
        after, _ = fetch(rt.planner_endpoint, 4, start=BOUNDARY, state=states[0])
        st = rt.status()
        assert st["constructors"] == 4 and st["session"] == 1, st  # the ranks' resumes did not rewind again
    assert_same_global(reference, before, range(0, BOUNDARY))
    assert_same_global(reference, after, range(BOUNDARY, STEPS))
    journal = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    assert any(r["event"] == "spec" and r["mode"] == "reconfigure" and r["effective_step"] == BOUNDARY for r in journal)
    # replay rebuilds batches before (dp 2) and after (dp 4) the change bit for bit
    sp = spec(token_sources["root"], 2)
    for step, rank, got in ((3, 1, before), (BOUNDARY, 3, after), (STEPS - 1, 2, after)):
        out = replay_step(sp, step=step, rank=rank, run_dir=str(run_dir), save=str(tmp_path / f"r{step}.npz"))
        assert out["digest_match"] and out["coords"]["dp"] == rank
        saved = np.load(tmp_path / f"r{step}.npz")
        assert np.array_equal(saved["input_ids"], got[rank][step]["input_ids"]), (step, rank)
        assert np.array_equal(saved["segment_key"], got[rank][step]["segment_key"]), (step, rank)


def test_reshard_is_rejected_when_it_would_change_the_global_batch(token_sources, tmp_path):
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "x") as rt:
        _, states = fetch(rt.planner_endpoint, 2, stop=2)
        before = [c.proc.pid for c in rt.children]
        with pytest.raises(RuntimeError, match="reshard rejected"):  # 8 rows cannot split over dp 16 x 2 microbatches
            rt.reshard({"modules": {"backbone": {"dp": 16}}}, states[0])
        assert [c.proc.pid for c in rt.children] == before and not rt.dead()
        got, _ = fetch(rt.planner_endpoint, 2, start=2, stop=4, state=states[0])  # still serving at dp 2
        assert set(got) == {0, 1}


TRAINER = r"""
import json, os, sys, hashlib
from mixplane.client import MixtureLoader
endpoint, rank, stop, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
loader = MixtureLoader(endpoint, rank=rank, max_steps=stop, timeout_s=90)
if os.path.exists(out + ".state"):
    loader.load_state_dict(json.load(open(out + ".state")))
with open(out, "a") as f:
    for b in loader:
        st = loader.state_dict()
        f.write(json.dumps({"step": int(b["step"]), "ids": b["input_ids"].numpy().tolist()}) + "\n")
        f.flush()
        tmp = out + ".state.tmp"
        json.dump(st, open(tmp, "w"))
        os.replace(tmp, out + ".state")
"""


def test_trainer_rank_sigkilled_resumes_from_its_state_dict(token_sources, tmp_path, reference):
    """Rank 1 runs in its own process, saves its state_dict after every step and is killed with SIGKILL
    mid-run; started again, it loads that state and rejoins: rank 0 (never stopped) and rank 1 get exactly
    the failure-free run's batches, no step missing or repeated."""
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "t") as rt:
        out = tmp_path / "rank1.jsonl"
        cmd = [sys.executable, "-c", TRAINER, rt.planner_endpoint, "1", str(STEPS), str(out)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.Popen(cmd, env=env)
        t0 = [0.0]
        rank0: dict[int, dict] = {}

        def rank_zero() -> None:
            for b in MixtureLoader(rt.planner_endpoint, rank=0, max_steps=STEPS, timeout_s=90):
                rank0[int(b["step"])] = b["input_ids"].numpy().copy()
        th = threading.Thread(target=rank_zero, daemon=True)
        th.start()
        deadline = time.monotonic() + 120
        while not (out.exists() and len(out.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline and proc.poll() is None, "rank 1 made no progress"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        t0[0] = time.monotonic()
        proc = subprocess.Popen(cmd, env=env)
        assert proc.wait(180) == 0
        th.join(180)
        assert not th.is_alive()
        assert rt.status()["session"] == 0  # nobody rewound: the rank rejoined the running session
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    # a line may be written for a step whose state was not saved yet when the kill came: the restart repeats it
    by_step: dict[int, list] = {}
    for rec in lines:
        by_step.setdefault(rec["step"], []).append(rec["ids"])
    assert sorted(by_step) == list(range(STEPS))
    for s in range(STEPS):
        for ids in by_step[s]:
            assert np.array_equal(np.array(ids), reference[1][s]["input_ids"]), f"rank 1 step {s}"
        assert np.array_equal(rank0[s], reference[0][s]["input_ids"]), f"rank 0 step {s}"


def test_live_reshard_to_tensor_parallel_keeps_the_global_sequence(token_sources, tmp_path, reference, monkeypatch):
    """DP 2 -> DP 2 x TP 2 (world 4) in the running system: the TP peers of a DP rank get its rows, and the DP
    ranks together get the failure-free run's rows, step by step."""
    from mixplane.topology import backbone_coords

    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "tp") as rt:
        _, states = fetch(rt.planner_endpoint, 2, stop=BOUNDARY)
        reply = rt.reshard({"modules": {"backbone": {"dp": 2, "tp": 2}}}, states[0], attempt="tp-test")
        assert reply["world_size"] == 4
        new_spec = parse_spec(reply["spec"])
        monkeypatch.setenv("MIXPLANE_RESUME_ID", "tp-test")
        after, _ = fetch(rt.planner_endpoint, 4, start=BOUNDARY, state=states[0])
    coords = {r: backbone_coords(new_spec, r) for r in range(4)}
    leaders = {coords[r].dp: r for r in range(4) if coords[r].tp == 0}
    assert sorted(leaders) == [0, 1]
    by_dp = {d: {s: after[r][s] for s in after[r]} for d, r in leaders.items()}
    assert_same_global(reference, by_dp, range(BOUNDARY, STEPS))
    for r in range(4):
        lead = leaders[coords[r].dp]
        for s in range(BOUNDARY, STEPS):
            assert np.array_equal(after[r][s]["input_ids"], after[lead][s]["input_ids"]), (r, s)


def test_every_rank_rolls_back_across_a_live_dp_change_to_a_checkpoint_saved_before_it(token_sources, tmp_path, reference,
                                                                                       monkeypatch):
    """The job checkpoints at step 4 (DP 2), changes DP 2 -> 4 live at step 7, runs on to step 12 and then restarts
    every rank of its new world from the step-4 checkpoint: the data plane rewinds across the DP change and the
    global sequence of every step from 4 on is the failure-free run's (split over 4 ranks now)."""
    with EmbeddedRuntime(spec(token_sources["root"], 2), tmp_path / "run") as rt:
        _, ckpt = fetch(rt.planner_endpoint, 2, stop=4)
        _, states = fetch(rt.planner_endpoint, 2, start=4, stop=BOUNDARY, state=ckpt[0])
        rt.reshard({"modules": {"backbone": {"dp": 4}}}, states[1], attempt="dp-change")
        monkeypatch.setenv("MIXPLANE_RESUME_ID", "dp-change")
        fetch(rt.planner_endpoint, 4, start=BOUNDARY, stop=12, state=states[0])
        monkeypatch.setenv("MIXPLANE_RESUME_ID", "rollback")  # the job's next launch
        got, _ = fetch(rt.planner_endpoint, 4, start=4, stop=STEPS, state=json.loads(json.dumps(ckpt[0])))
        st = rt.status()
    assert st["constructors"] == 4
    assert_same_global(reference, got, range(4, STEPS))


def test_reshard_by_id_at_the_next_unplanned_step_once_journaled_and_replayed(token_sources, tmp_path, reference, monkeypatch):
    """What the operator sends for a patch of spec.topology: RESHARD with an id and no cursor. The planner takes the
    first step it has not planned (its own cursor there), acknowledges the id once (the same id again: the same step,
    `duplicate`, no constructor replaced), lists it in STATUS and journals it; the new world (DP 1) resumes from a
    DP-2 rank's state_dict at an earlier step and gets the global sequence of a run that never resharded; replay is
    exact before and after; a planner started again on the journal knows the id and serves the journaled topology
    even with the old spec file."""
    from mixplane import control
    from mixplane.planner.server import PlannerServer
    from mixplane.wire import Kind, Message

    run_dir = tmp_path / "byid"
    with EmbeddedRuntime(spec(token_sources["root"], 2), run_dir) as rt:
        before, states = fetch(rt.planner_endpoint, 2, stop=BOUNDARY)
        planned = rt.status()["planned_through"]
        assert planned >= BOUNDARY - 1
        reply = rt.reshard({"modules": {"backbone": {"dp": 1}}}, reshard_id="ns/demo/topology-2")
        assert reply["step"] >= planned + 1 and reply["world_size"] == 1 and reply["duplicate"] is False, reply
        pids = sorted(c.proc.pid for c in rt.children)
        again = rt.reshard({"modules": {"backbone": {"dp": 1}}}, reshard_id="ns/demo/topology-2")
        assert again["duplicate"] is True and again["step"] == reply["step"] and again["generation"] == reply["generation"]
        assert sorted(c.proc.pid for c in rt.children) == pids  # nothing stopped, nothing started
        st = rt.status()
        assert [r["reshard_id"] for r in st["reshards"]] == ["ns/demo/topology-2"] and st["world_size"] == 1
        assert control.reshard_acknowledged(st, "ns/demo/topology-2")["step"] == reply["step"]
        with pytest.raises(RuntimeError, match="reshard rejected: give a cursor"):
            control.reshard(rt.planner_endpoint, {"topology": {"modules": {"backbone": {"dp": 2}}}}, 10.0,
                            curve=rt.control_curve)
        # the new world's one rank resumes from its checkpoint (step BOUNDARY <= the reshard's step: a rewind)
        after, _ = fetch(rt.planner_endpoint, 1, start=BOUNDARY, state=states[0])
    assert_same_global(reference, before, range(0, BOUNDARY))
    assert_same_global(reference, after, range(BOUNDARY, STEPS))
    journal = [json.loads(line) for line in (run_dir / "journal.jsonl").read_text().splitlines()]
    recs = [r for r in journal if r["event"] == "spec" and r.get("reshard_id") == "ns/demo/topology-2"]
    assert len(recs) == 1 and recs[0]["effective_step"] == reply["step"] and recs[0]["mode"] == "reconfigure"
    # the first step the planner had not planned: the old world's session planned exactly the steps before it
    assert max(r["step"] for r in journal if r["event"] == "step" and r["session"] == 0) == reply["step"] - 1
    sp = spec(token_sources["root"], 2)
    for step, rank, got in ((BOUNDARY - 1, 1, before), (BOUNDARY, 0, after), (reply["step"], 0, after), (STEPS - 1, 0, after)):
        out = replay_step(sp, step=step, rank=rank, run_dir=str(run_dir), save=str(tmp_path / f"b{step}.npz"))
        assert out["digest_match"], (step, out)
        saved = np.load(tmp_path / f"b{step}.npz")
        assert np.array_equal(saved["input_ids"], got[rank][step]["input_ids"]), (step, rank)
    # a planner started again on this journal with the old (DP 2) spec file: the id is known, the topology journaled
    server = PlannerServer(sp, "tcp://127.0.0.1:0", run_dir=str(run_dir), metrics_port=None)
    try:
        assert server.spec.world_size == 1 and len(server.groups) == 1
        sent: list[tuple[Kind, dict]] = []
        monkeypatch.setattr(server, "_send", lambda ident, kind, meta=None, *a, **k: sent.append((kind, meta or {})) or True)
        server.handle(b"admin", Message(Kind.RESHARD, {"topology": {"modules": {"backbone": {"dp": 1}}},
                                                       "reshard_id": "ns/demo/topology-2"}))
        assert sent and sent[-1][0] == Kind.ACK and sent[-1][1]["duplicate"] is True
        assert sent[-1][1]["step"] == reply["step"], sent[-1]
        # a constructor whose spec file is still of the old topology (a ConfigMap mounted before the reshard) is
        # told to stop and not registered; one of the served topology is welcomed
        from mixplane.topology import topology_digest

        hello = {"role": "constructor", "index": 0, "data_endpoint": "tcp://127.0.0.1:1", "client_endpoint": "tcp://127.0.0.1:2"}
        server.handle(b"stale", Message(Kind.HELLO, {**hello, "topology": topology_digest(sp)}))
        assert sent[-1][0] == Kind.SHUTDOWN and not server.constructors
        server.handle(b"fresh", Message(Kind.HELLO, {**hello, "topology": topology_digest(server.spec)}))
        kinds = [k for k, _ in sent]
        assert Kind.WELCOME in kinds[kinds.index(Kind.SHUTDOWN):] and server.constructors[0].identity == b"fresh"
    finally:
        server.close()
