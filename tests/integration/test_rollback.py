"""Trainer rollback restarts (issue 22 item 1), with real trainer processes and SIGKILL.

Trainers checkpoint every N steps, so a restarted rank resumes *behind* the ranks that kept running (one
replica restarting while the others go on: torchft, HSDP replica groups), or every rank restarts together
from an older checkpoint (torchrun / a Job restart). In every case each rank gets exactly the batches of a
failure-free run from the step it resumes at, and the ranks that keep running never see an error.

Each trainer is a process (`TRAINER` below) that takes `step_s` per step, writes a digest of every batch
it receives, saves its `state_dict()` at one step and, at a later one, kills itself with SIGKILL; it is
started again from the saved state. The runs use the documented defaults (`prefetch_s` 10 s,
`journal_every` 100, `max_lead_steps` 32), so the rank that keeps running holds 32 steps requested ahead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

STEP_S = 0.02
REF_STEPS = 230

TRAINER = r"""
import hashlib, json, os, signal, sys, time
from mixplane.client import MixtureLoader
endpoint, rank, stop, out, step_s, save_at, kill_at, how = sys.argv[1:9]
rank, stop, step_s, save_at, kill_at = int(rank), int(stop), float(step_s), int(save_at), int(kill_at)
state_file = out + ".state"
resumed = os.path.exists(state_file)
f = open(out, "a")

def run(loader, rolled_back):
    for b in loader:
        step = int(b["step"])
        h = hashlib.blake2b(digest_size=16)
        for k in ("input_ids", "segment_source", "segment_key", "segment_start", "segment_len"):
            h.update(b[k].numpy().tobytes())
        f.write(json.dumps({"step": step, "digest": h.hexdigest(), "generation": int(b.get("generation", 0)),
                            "phase": int(b["phase"]), "t": time.time()}) + "\n")
        f.flush()
        if step == save_at and not (resumed or rolled_back):
            json.dump(loader.state_dict(), open(state_file + ".tmp", "w"))
            os.replace(state_file + ".tmp", state_file)
        if step == kill_at and not (resumed or rolled_back):
            if how == "kill":  # the process dies; the test starts it again
                os.kill(os.getpid(), signal.SIGKILL)
            # "reopen": the trainer rolls back in this process (a new loader from the saved state at once)
            loader.close()
            again = MixtureLoader(endpoint, rank=rank, max_steps=stop, timeout_s=120)
            again.load_state_dict(json.load(open(state_file)))
            f.write(json.dumps({"start": again.next_step, "pid": os.getpid(), "t": time.time()}) + "\n")
            return run(again, True)
        time.sleep(step_s)

loader = MixtureLoader(endpoint, rank=rank, max_steps=stop, timeout_s=120)
if resumed:
    loader.load_state_dict(json.load(open(state_file)))
f.write(json.dumps({"start": loader.next_step, "pid": os.getpid(), "t": time.time()}) + "\n")
run(loader, False)
"""


def spec(root: Path, **runtime):
    # the documented defaults (prefetch_s, journal_every, max_lead_steps); only metrics off and a small window
    return parse_spec(token_mixture(root, runtime={"window": 64, "metrics": False, **runtime}))


class Trainer:
    """One trainer rank as a process; `records` reads what it wrote (every incarnation appends)."""

    def __init__(self, endpoint: str, rank: int, stop: int, out: Path, *, save_at: int = -1, kill_at: int = -1,
                 step_s: float = STEP_S, how: str = "kill"):
        self.cmd = [sys.executable, "-c", TRAINER, endpoint, str(rank), str(stop), str(out), str(step_s),
                    str(save_at), str(kill_at), how]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        self.err = out.with_suffix(".err")
        self.out = out
        self.proc = self.start()

    def start(self) -> subprocess.Popen:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=open(self.err, "ab"))
        return self.proc

    def records(self) -> list[dict]:
        if not self.out.exists():
            return []
        return [json.loads(x) for x in self.out.read_text().splitlines() if x.strip()]

    def steps(self) -> dict[int, list[str]]:
        got: dict[int, list[str]] = {}
        for r in self.records():
            if "step" in r:
                got.setdefault(r["step"], []).append(r["digest"])
        return got

    def step_at(self, t: float) -> int:
        """The last step received before time `t`."""
        return max((r["step"] for r in self.records() if "step" in r and r["t"] <= t), default=-1)

    def restarted_at(self) -> float:
        """When the trainer rolled back (its second start)."""
        starts = [r["t"] for r in self.records() if "start" in r]
        assert len(starts) == 2, starts
        return starts[1]

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"{self.out.name}: still running after {timeout_s:g} s; stderr:\n{self.stderr()}") from None

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")[-3000:] if self.err.exists() else ""


def wait_until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(token_sources, tmp_path_factory):
    """Digests of a failure-free run: {rank: {step: digest}} for 2 ranks and REF_STEPS steps."""
    d = tmp_path_factory.mktemp("ref")
    with EmbeddedRuntime(spec(token_sources["root"]), d / "run") as rt:
        ts = [Trainer(rt.planner_endpoint, r, REF_STEPS, d / f"rank{r}.jsonl", step_s=0) for r in (0, 1)]
        for t in ts:
            assert t.wait(240) == 0, t.stderr()
    ref = {}
    for r, t in enumerate(ts):
        got = t.steps()
        assert sorted(got) == list(range(REF_STEPS))
        ref[r] = {s: v[0] for s, v in got.items()}
    return ref


def max_gap(trainer: Trainer) -> float:
    """The longest time between two consecutive steps the trainer received."""
    ts = [r["t"] for r in trainer.records() if "step" in r]
    return round(max((b - a for a, b in zip(ts, ts[1:])), default=0.0), 3)


def assert_exact(trainer: Trainer, ref: dict[int, str], stop: int, *, rolled_back: bool) -> None:
    """Every step 0..stop-1 received, each time with the failure-free run's batch (a rolled-back rank gets
    the steps from its checkpoint on a second time, identical)."""
    got = trainer.steps()
    assert sorted(got) == list(range(stop)), f"{trainer.out.name}: steps {sorted(set(range(stop)) - set(got))} missing"
    for s, digests in got.items():
        assert all(d == ref[s] for d in digests), f"{trainer.out.name}: step {s} differs from the failure-free run"
        if not rolled_back:
            assert len(digests) == 1, f"{trainer.out.name}: step {s} received {len(digests)} times"


@pytest.mark.parametrize("rollback,how", [(1, "reopen"), (4, "reopen"), (17, "reopen"), (100, "reopen"),
                                          (17, "kill"), (100, "kill")])
def test_one_rank_rolls_back_while_the_other_runs(token_sources, tmp_path, reference, rollback, how):
    """Rank 1 saves its state at step `save` and `rollback` steps later restarts from it -- in the same process
    (a new MixtureLoader, the issue's minimal case) or SIGKILLed and started again -- while rank 0 keeps
    running with 32 steps requested ahead: rank 0 sees no error and no repeat, rank 1 gets the failure-free
    run's batches again from `save` + 1 on."""
    save = 20
    kill = save + rollback
    stop = kill + 100  # rank 0 is still running when rank 1 rolls back
    with EmbeddedRuntime(spec(token_sources["root"]), tmp_path / "run") as rt:
        # rank 1 is the slower rank (its steps take 3x longer): rank 0 runs ahead as far as the data plane lets it
        r0 = Trainer(rt.planner_endpoint, 0, stop, tmp_path / "rank0.jsonl")
        r1 = Trainer(rt.planner_endpoint, 1, stop, tmp_path / "rank1.jsonl", save_at=save, kill_at=kill, how=how,
                     step_s=3 * STEP_S)
        if how == "kill":
            assert r1.wait(180) == -signal.SIGKILL, r1.stderr()
            r1.start()
        assert r1.wait(240) == 0, r1.stderr()
        assert r0.wait(240) == 0, r0.stderr()
        st = rt.status()
    ahead = r0.step_at(r1.restarted_at()) - save  # how far ahead of the resumed step rank 0 was
    assert ahead > 0, "rank 0 must be running ahead of the rolled-back rank for this case to mean anything"
    assert_exact(r0, reference[0], stop, rolled_back=False)
    assert_exact(r1, reference[1], stop, rolled_back=True)
    again = [s for s, d in r1.steps().items() if len(d) > 1]
    assert again == list(range(save + 1, kill + 1)), again
    print(json.dumps({"rollback_steps": rollback, "how": how, "rank0_steps_ahead_of_resume": ahead,
                      "session": st["session"], "max_gap_rank0_s": max_gap(r0)}))


def test_every_rank_restarts_together_from_a_checkpoint_50_steps_old(token_sources, tmp_path, reference):
    """The torchrun / Job restart: both ranks save at step 20, are SIGKILLed at step 70 and start again from
    their states; each gets the failure-free run's batches from step 21 on."""
    save, kill, stop = 20, 70, 110
    with EmbeddedRuntime(spec(token_sources["root"]), tmp_path / "run") as rt:
        ts = [Trainer(rt.planner_endpoint, r, stop, tmp_path / f"rank{r}.jsonl", save_at=save, kill_at=kill) for r in (0, 1)]
        for t in ts:
            assert t.wait(180) == -signal.SIGKILL, t.stderr()
        for t in ts:
            t.start()
        for t in ts:
            assert t.wait(240) == 0, t.stderr()
    for r, t in enumerate(ts):
        assert_exact(t, reference[r], stop, rolled_back=True)
        again = [s for s, d in t.steps().items() if len(d) > 1]
        assert again == list(range(save + 1, kill + 1))


def test_a_rollback_across_a_live_update_and_a_phase_boundary_gets_the_same_batches(token_sources, tmp_path):
    """A live mixture update (effective at step 50) and a phase (from step 60) lie between rank 1's checkpoint
    (step 40) and its restart (step 75): the steps it gets again carry the same generation, phase and batches
    as the first time, and rank 0, running ahead, gets every step once."""
    from mixplane import control

    doc = token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False})
    doc["mixture"]["phases"] = [{"start_step": 60, "weights": {"a": 0.1, "b": 0.2, "c": 0.7}}]
    save, kill, stop = 40, 75, 140
    with EmbeddedRuntime(parse_spec(doc), tmp_path / "run") as rt:
        ack = control.update_mixture(rt.planner_endpoint, {"weights": {"a": 0.8, "b": 0.1, "c": 0.1},
                                                           "effective_step": 50}, curve=rt.control_curve)
        assert ack["generation"] == 1
        r0 = Trainer(rt.planner_endpoint, 0, stop, tmp_path / "rank0.jsonl")
        r1 = Trainer(rt.planner_endpoint, 1, stop, tmp_path / "rank1.jsonl", save_at=save, kill_at=kill, how="reopen",
                     step_s=3 * STEP_S)
        assert r1.wait(240) == 0, r1.stderr()
        assert r0.wait(240) == 0, r0.stderr()
    assert r0.step_at(r1.restarted_at()) > save
    got0, got1 = r0.steps(), r1.steps()
    assert sorted(got0) == sorted(got1) == list(range(stop))
    assert all(len(d) == 1 for d in got0.values())
    again = {s: d for s, d in got1.items() if len(d) > 1}
    assert sorted(again) == list(range(save + 1, kill + 1))
    assert all(d[0] == d[1] for d in again.values()), "a step received again differs from its first delivery"
    recs = {}
    for r in r1.records():
        if "step" in r:
            recs.setdefault(r["step"], []).append((r["generation"], r["phase"]))
    for s in range(save + 1, kill + 1):
        first, second = recs[s]
        assert first == second
        assert first[0] == (1 if 50 <= s < 60 else first[0])  # the update is in force from step 50
        assert first[1] == (1 if s >= 60 else 0)  # the phase starts at step 60
