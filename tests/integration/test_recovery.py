"""Planner and constructor recovery (issue 11): a planner or a constructor killed with SIGKILL mid-run is
restarted by the embedded runtime's supervision and delivery continues with exactly the batches of a
failure-free run; a budget that is spent fails the run with a clear error. Real processes, real signals."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mixplane.client import MixtureLoader
from mixplane.control import read_ready
from mixplane.runtime import ComponentFailed, EmbeddedRuntime, RestartPolicy
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

STEPS = 40
KILL_AFTER = 12
RANKS = 2
KEYS = ("input_ids", "labels", "source_ids", "segment_source", "segment_key", "segment_start")


class Fetcher:
    """Every rank in its own thread, as trainer processes would; records what arrived and when."""

    def __init__(self, endpoint: str, pause_s: float = 0.0, steps: int = STEPS, timeout_s: float = 90):
        self.endpoint = endpoint
        self.pause_s = pause_s
        self.steps = steps
        self.timeout_s = timeout_s
        self.got: dict[int, list[dict]] = {r: [] for r in range(RANKS)}
        self.times: dict[int, list[float]] = {r: [] for r in range(RANKS)}
        self.errors: list[BaseException] = []
        self.loaders: dict[int, MixtureLoader] = {}
        self.threads = [threading.Thread(target=self._work, args=(r,), daemon=True) for r in range(RANKS)]
        for t in self.threads:
            t.start()

    def _work(self, r: int) -> None:
        try:
            loader = self.loaders[r] = MixtureLoader(self.endpoint, rank=r, max_steps=self.steps, timeout_s=self.timeout_s)
            for b in loader:
                self.got[r].append({k: b[k].numpy().copy() for k in (*KEYS, "step")})
                self.times[r].append(time.monotonic())
                time.sleep(self.pause_s)
            loader.close()
        except BaseException as e:  # surfaced by join
            self.errors.append(e)

    def delivered(self) -> int:
        return min(len(v) for v in self.got.values())

    def wait_for(self, n: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.delivered() < n and not self.errors:
            assert time.monotonic() < deadline, f"clients made no progress: {self.delivered()} of {n} steps"
            time.sleep(0.01)
        if self.errors:
            raise self.errors[0]

    def join(self, timeout_s: float = 240) -> dict[int, list[dict]]:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        assert not any(t.is_alive() for t in self.threads), f"clients still waiting after {timeout_s}s"
        return self.got


def spec(root: Path, **runtime):
    # checkpoints every 5 steps: recovery replays the planned steps after the last one; no time-sized
    # look-ahead (prefetch_s 0) unless asked: the recovery under test would finish after the last step
    runtime = {"window": 64, "metrics": False, "journal_every": 5, "prefetch_s": 0, **runtime}
    return parse_spec(token_mixture(root, runtime=runtime))


@pytest.fixture(scope="module")
def reference(token_sources, tmp_path_factory):
    with EmbeddedRuntime(spec(token_sources["root"]), tmp_path_factory.mktemp("reference")) as rt:
        return Fetcher(rt.planner_endpoint).join()


def assert_identical(got, reference, steps: int = STEPS) -> None:
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(steps)), f"rank {r}: steps {[int(b['step']) for b in got[r]]}"
        for step in range(steps):
            for k in KEYS:
                assert np.array_equal(got[r][step][k], reference[r][step][k]), f"rank {r} step {step}: {k} differs"


def stall(fetch: Fetcher, killed_at: float, at_kill: dict[int, int]) -> tuple[float, float]:
    """(first step after the kill, longest gap between steps from the kill on), seconds."""
    after = [fetch.times[r][at_kill[r]] for r in range(RANKS) if len(fetch.times[r]) > at_kill[r]]
    first = min(after) - killed_at if after else float("nan")
    gap = max(float(np.max(np.diff([killed_at, *fetch.times[r][at_kill[r]:]]))) for r in range(RANKS))
    return first, gap


def kill_mid_run(token_sources, run_dir: Path, role: str, reference, *, journal_every: int = 5,
                 hold_loader_s: float = 0.0) -> tuple[dict, float, float, EmbeddedRuntime]:
    """Run, SIGKILL the first component of `role` after KILL_AFTER steps, let supervision restart it, compare.
    hold_loader_s: SIGSTOP a loader that long before the kill (SIGCONT after it), so that steps are planned
    whose spans have not arrived anywhere when the victim dies."""
    policy = RestartPolicy(budget=2, window_s=600, backoff_s=0.1)
    rt = EmbeddedRuntime(spec(token_sources["root"], journal_every=journal_every), run_dir, restart=policy).start()
    try:
        rt.supervise_in_background(0.1)
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.05)
        fetch.wait_for(KILL_AFTER)
        victim = next(c for c in rt.children if c.component is not None and c.component.role == role)
        held = next(c for c in rt.children if c.name == "loader-b-0")
        if hold_loader_s:
            os.kill(held.proc.pid, signal.SIGSTOP)
            time.sleep(hold_loader_s)
        old_pid = victim.proc.pid
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        if hold_loader_s:
            os.kill(held.proc.pid, signal.SIGCONT)
        at_kill = {r: len(fetch.times[r]) for r in range(RANKS)}
        got = fetch.join()
        rt.check()
        fresh = rt.child(victim.name)
        assert fresh.proc.pid != old_pid and fresh.proc.poll() is None and fresh.exit_codes == [-signal.SIGKILL]
        first, gap = stall(fetch, killed_at, at_kill)
        assert_identical(got, reference)
        return got, first, gap, rt
    finally:
        rt.stop()


@pytest.mark.parametrize("journal_every", [5, 100])
def test_planner_sigkill_mid_run_recovers_from_the_journal_with_identical_batches(token_sources, tmp_path, reference,
                                                                                  journal_every):
    run_dir = tmp_path / "planner-kill"
    _, first, gap, rt = kill_mid_run(token_sources, run_dir, "planner", reference, journal_every=journal_every,
                                     hold_loader_s=1.0)
    log = (run_dir / "logs" / "planner.log").read_text(errors="replace")
    # constructors that hold the cursor after their last complete step make the planner re-plan from there (often
    # nothing), not from the journal's last checkpoint
    assert "recovering session 0: " in log and "recovery complete" in log, log[-3000:]
    assert "differs from the journal" not in log
    records = [json.loads(x) for x in (run_dir / "journal.jsonl").read_text().splitlines() if x.strip()]
    assert [r["event"] for r in records].count("open") == 1 and any(r["event"] == "recover" for r in records)
    for name in ("constructor-0", "loader-a-0"):
        comp_log = (run_dir / "logs" / f"{name}.log").read_text(errors="replace")
        assert "the planner was restarted" in comp_log, (name, comp_log[-2000:])
    line = next(x for x in log.splitlines() if "recovering session 0: " in x)
    print(json.dumps({"planner_restart_stall_s": round(first, 3), "planner_restart_max_gap_s": round(gap, 3),
                      "killed_after_steps": KILL_AFTER, "steps": STEPS, "journal_every": journal_every,
                      "replanned": line.split("re-planning steps ")[1].split(" ")[0] if "re-planning" in line else "none"}))
    assert gap <= 10.0


def test_a_warm_standby_takes_over_a_dead_planner_without_backoff(token_sources, tmp_path, reference):
    """RestartPolicy.standby (the default; issue 22): the runtime keeps prepared processes (interpreter started,
    the components' modules imported, the planner's compiled loops loaded), one of which becomes the restarted
    planner; a planner that ran `stable_s` after it was ready is restarted without backoff; a new standby is
    prepared behind it; the batches are those of a failure-free run; stop() leaves no standby behind."""
    policy = RestartPolicy(budget=2, window_s=600, stable_s=1.0)  # the default backoff (0.5 s): not paid here
    run_dir = tmp_path / "standby"

    def prepared() -> set[int]:
        return {info["pid"] for f in (run_dir / "ready").glob("standby-*.json") if (info := read_ready(f)) is not None}

    rt = EmbeddedRuntime(spec(token_sources["root"]), run_dir, restart=policy).start()
    try:
        rt.supervise_in_background(0.1)
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.2)
        fetch.wait_for(KILL_AFTER // 2)
        deadline = time.monotonic() + 120
        while len(standby_pids := prepared()) < policy.standbys:
            assert time.monotonic() < deadline, (run_dir / "logs" / "standby.log").read_text(errors="replace")
            time.sleep(0.05)
        old = rt.child("planner")
        assert old.ready_at is not None
        time.sleep(max(0.0, policy.stable_s - (time.monotonic() - old.ready_at)))
        incarnation = rt.status()["incarnation"]
        os.kill(old.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while True:  # kill -> the new planner answers STATUS
            assert time.monotonic() - killed_at < 60, "the planner was not restarted"
            try:
                if rt.status(timeout_s=0.3)["incarnation"] != incarnation:
                    break
            except (TimeoutError, RuntimeError, OSError):
                pass
        restart_s = time.monotonic() - killed_at
        got = fetch.join()
        rt.check()
        fresh = rt.child("planner")
        assert fresh.proc.pid in standby_pids and fresh.exit_codes == [-signal.SIGKILL]
        deadline = time.monotonic() + 120
        while not (new_pids := prepared() - standby_pids):
            assert time.monotonic() < deadline, "no new standby after the take-over"
            time.sleep(0.05)
        assert len(prepared()) == policy.standbys
    finally:
        rt.stop()
    assert_identical(got, reference)
    for pid in standby_pids | new_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    log = (run_dir / "logs" / "planner.log").read_text(errors="replace")
    assert "recovery complete" in log and "differs from the journal" not in log, log[-3000:]
    print(json.dumps({"standby_planner_restart_s": round(restart_s, 3)}))


def test_components_that_die_together_are_restarted_together(token_sources, tmp_path, reference):
    """Supervision does not wait for one restarted component to be ready before it restarts the next: a
    constructor and a loader SIGKILLed together (no standby: both start new interpreters, seconds on a loaded
    machine) are started again in the same look, and the batches are those of a failure-free run."""
    policy = RestartPolicy(budget=2, window_s=600, backoff_s=0.1, standby=False)
    rt = EmbeddedRuntime(spec(token_sources["root"]), tmp_path / "together", restart=policy).start()
    try:
        rt.supervise_in_background(0.1)
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.05)
        fetch.wait_for(KILL_AFTER)
        victims = [rt.child("constructor-0"), rt.child("loader-a-0")]
        for v in victims:
            os.kill(v.proc.pid, signal.SIGKILL)
        got = fetch.join()
        rt.check()
        fresh = [rt.child(v.name) for v in victims]
    finally:
        rt.stop()
    assert_identical(got, reference)
    assert all(f.exit_codes == [-signal.SIGKILL] and f.ready_at is not None for f in fresh)
    # restarted in the same look (a blocking restart would start the second one after the first was ready)
    assert abs(fresh[0].started - fresh[1].started) < 0.4, [f.started for f in fresh]


def test_constructor_sigkill_mid_run_is_rebuilt_with_identical_batches(token_sources, tmp_path, reference):
    run_dir = tmp_path / "constructor-kill"
    _, first, gap, rt = kill_mid_run(token_sources, run_dir, "constructor", reference, hold_loader_s=1.0)
    log = (run_dir / "logs" / "planner.log").read_text(errors="replace")
    assert "said HELLO again (restarted" in log and "loaders told to resend" in log, log[-3000:]
    print(json.dumps({"constructor_restart_stall_s": round(first, 3), "constructor_restart_max_gap_s": round(gap, 3),
                      "killed_after_steps": KILL_AFTER, "steps": STEPS}))
    assert gap <= 10.0


def test_lookahead_absorbs_a_constructor_and_a_planner_restart(token_sources, tmp_path, reference):
    """runtime.prefetch_s: each rank keeps that many seconds of steps requested (time-sized from its measured
    step time, at most max_lead_steps), so a constructor and then the planner, SIGKILLed and restarted while
    ranks train, cost them no wait: the longest gap between two steps stays near the step time."""
    pause, lead = 0.5, 16  # a rank holds up to 16 steps = 8 s of training
    policy = RestartPolicy(budget=2, window_s=600, backoff_s=0.1)
    run_dir = tmp_path / "lookahead"
    rt = EmbeddedRuntime(spec(token_sources["root"], prefetch_s=10.0, max_lead_steps=lead), run_dir, restart=policy).start()
    try:
        rt.supervise_in_background(0.1)
        fetch = Fetcher(rt.planner_endpoint, pause_s=pause)
        kills = []
        for role, after in (("constructor", 8), ("planner", 18)):
            fetch.wait_for(after)
            victim = next(c for c in rt.children if c.component is not None and c.component.role == role)
            os.kill(victim.proc.pid, signal.SIGKILL)
            kills.append((time.monotonic(), {r: len(fetch.times[r]) for r in range(RANKS)}))
        got = fetch.join()
        rt.check()
        assert all(rt.child(n).exit_codes == [-signal.SIGKILL] for n in ("constructor-0", "planner"))
        ahead = [fetch.loaders[r].lookahead for r in range(RANKS)]
    finally:
        rt.stop()
    assert_identical(got, reference)
    gaps = [stall(fetch, t, at)[1] for t, at in kills]
    log = (run_dir / "logs" / "planner.log").read_text(errors="replace")
    assert "recovery complete" in log and "said HELLO again (restarted" in log, log[-3000:]
    print(json.dumps({"lookahead_steps": ahead, "step_s": pause, "max_gap_after_constructor_kill_s": round(gaps[0], 3),
                      "max_gap_after_planner_kill_s": round(gaps[1], 3)}))
    assert ahead == [lead] * RANKS
    assert max(gaps) < pause + 1.0, gaps  # a restart takes seconds; the ranks waited for none of it


def test_spent_budget_names_the_component_and_its_exit_codes(token_sources, tmp_path):
    policy = RestartPolicy(budget=1, window_s=600, backoff_s=0.1)
    with EmbeddedRuntime(spec(token_sources["root"]), tmp_path / "budget", restart=policy) as rt:
        rt.supervise_in_background(0.1)
        for _ in range(2):
            victim = rt.child("constructor-0")
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)
            deadline = time.monotonic() + 60
            while rt.failure is None and rt.child("constructor-0") is victim and time.monotonic() < deadline:
                time.sleep(0.05)
        deadline = time.monotonic() + 30
        while rt.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ComponentFailed, match=r"constructor-0 exited with code -9 and was restarted 1 times .*budget.*"
                                                  r"exit codes of its incarnations: \[-9, -9\]; see .*constructor-0.log"):
            rt.check()


@pytest.mark.parametrize("role", ["planner", "constructor"])
def test_a_stopped_planner_or_constructor_is_reported_like_a_dead_one(token_sources, tmp_path, role):
    """SIGSTOP: the process lives but says nothing. Clients that wait say which component is silent and since
    when; the planner's STATUS lists a silent constructor; after SIGCONT delivery goes on."""
    from mixplane.client import DeliveryError

    with EmbeddedRuntime(spec(token_sources["root"]), tmp_path / role) as rt:
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.02, steps=400, timeout_s=8)
        fetch.wait_for(4)
        victim = next(c for c in rt.children if c.component is not None and c.component.role == role)
        os.kill(victim.proc.pid, signal.SIGSTOP)
        stopped = time.time()
        try:
            deadline = time.monotonic() + 60
            while not fetch.errors and time.monotonic() < deadline:
                time.sleep(0.1)
            status = rt.status(timeout_s=5) if role == "constructor" else None
        finally:
            os.kill(victim.proc.pid, signal.SIGCONT)
        assert fetch.errors and all(isinstance(e, DeliveryError) for e in fetch.errors), fetch.errors
        texts = [str(e) for e in fetch.errors]
        if role == "planner":
            # the constructor reports the planner silent (and the planner answers no status request)
            want = ("planner silent since", "did not answer a status request")
        else:
            want = ("constructor tcp://", "silent since", "no answer to heartbeats")
            assert status is not None and "constructor:0" in status["silent"], status
        assert any(all(w in t for w in want) for t in texts), texts
        print(json.dumps({"sigstop": role, "stopped_at": time.strftime("%H:%M:%S", time.localtime(stopped)),
                          "error": next(t for t in texts if all(w in t for w in want))[:400]}))
        # running again: nobody is silent any more
        deadline = time.monotonic() + 30
        while rt.status(timeout_s=5)["silent"] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not rt.status(timeout_s=5)["silent"]


def test_a_hung_constructor_is_killed_and_restarted_when_the_policy_says_so(token_sources, tmp_path, reference):
    """RestartPolicy(hang_after_s=...): a constructor stopped with SIGSTOP is found silent in the planner's STATUS,
    killed and rebuilt like a dead one; the batches stay those of a failure-free run."""
    policy = RestartPolicy(budget=2, window_s=600, backoff_s=0.1, hang_after_s=4.0)
    with EmbeddedRuntime(spec(token_sources["root"]), tmp_path / "hung", restart=policy) as rt:
        rt.supervise_in_background(0.2)
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.05)
        fetch.wait_for(KILL_AFTER)
        victim = rt.child("constructor-0")
        os.kill(victim.proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        at_kill = {r: len(fetch.times[r]) for r in range(RANKS)}
        got = fetch.join()
        rt.check()
        fresh = rt.child("constructor-0")
        assert fresh is not victim and victim.proc.returncode == -signal.SIGKILL and fresh.proc.poll() is None
    assert_identical(got, reference)
    first, gap = stall(fetch, stopped_at, at_kill)
    print(json.dumps({"hung_constructor_restart_max_gap_s": round(gap, 3), "hang_after_s": 4.0, "steps": STEPS}))
