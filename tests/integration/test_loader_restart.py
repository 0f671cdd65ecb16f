"""A loader process killed with SIGKILL mid-run and started again: every rank's batches are exactly those
of a failure-free run (issue 11: no lost, repeated or reordered sample). Real processes, real signals."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mixplane.client import MixtureLoader
from mixplane.runtime import Child, EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.conftest import token_mixture

STEPS = 80  # more than KILL_AFTER + max_lead_steps (32): the look-ahead cannot hold every step before the kill
KILL_AFTER = 8  # steps every rank received before the loader is stopped, then killed
RANKS = 2
KEYS = ("input_ids", "labels", "source_ids", "segment_source", "segment_key", "segment_start")


class Fetcher:
    """Every rank in its own thread, as trainer processes would; records what arrived and when."""

    def __init__(self, endpoint: str, pause_s: float = 0.0):
        self.endpoint = endpoint
        self.pause_s = pause_s
        self.got: dict[int, list[dict]] = {r: [] for r in range(RANKS)}
        self.times: dict[int, list[float]] = {r: [] for r in range(RANKS)}
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._work, args=(r,), daemon=True) for r in range(RANKS)]
        for t in self.threads:
            t.start()

    def _work(self, r: int) -> None:
        try:
            loader = MixtureLoader(self.endpoint, rank=r, max_steps=STEPS, timeout_s=90)
            for b in loader:
                self.got[r].append({k: b[k].numpy().copy() for k in (*KEYS, "step")})
                self.times[r].append(time.monotonic())
                time.sleep(self.pause_s)
            loader.close()
        except BaseException as e:  # surfaced by join
            self.errors.append(e)

    def delivered(self) -> int:
        return min(len(v) for v in self.got.values())

    def join(self, timeout_s: float = 240) -> dict[int, list[dict]]:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        assert not any(t.is_alive() for t in self.threads), f"clients still waiting after {timeout_s}s"
        return self.got


def spec(root: Path, workers: int = 1):
    doc = token_mixture(root)
    for s in doc["sources"]:
        s["workers"] = workers
    return parse_spec(doc)


@pytest.mark.parametrize("workers", [1, 3])
def test_loader_sigkill_mid_run_changes_no_batch(token_sources, tmp_path, workers):
    """workers 3: the killed run's loaders transform on 3 threads each (sources[].workers), the reference on one."""
    with EmbeddedRuntime(spec(token_sources["root"]), tmp_path / "reference") as rt:
        reference = Fetcher(rt.planner_endpoint).join()
    run_dir = tmp_path / "chaos"
    with EmbeddedRuntime(spec(token_sources["root"], workers), run_dir) as rt:
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.02)
        deadline = time.monotonic() + 120
        while fetch.delivered() < KILL_AFTER and not fetch.errors:
            assert time.monotonic() < deadline, "clients made no progress before the kill"
            time.sleep(0.01)
        victim = next(c for c in rt.children if c.component is not None and c.component.role == "loader")
        # stop it first, so that the planner plans steps whose spans it never sends, then kill it
        os.kill(victim.proc.pid, signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(victim.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        at_kill = {r: len(fetch.times[r]) for r in range(RANKS)}
        victim.proc.wait(10)
        assert victim.proc.returncode == -signal.SIGKILL
        fresh: Child = rt._spawn(victim.component)  # the restart the runtime's supervision performs
        got = fetch.join()
        assert fresh.proc.poll() is None, "the restarted loader died"
        planner_log = (run_dir / "logs" / "planner.log").read_text(errors="replace")
    # the kill hit spans in flight: the planner had the restarted loader send planned steps again (a restarted
    # loader host re-adopts its partition under a new epoch: planner.partitions)
    assert ("said HELLO again" in planner_log or "restart) after step" in planner_log), planner_log[-3000:]
    assert "resending the spans of" in planner_log, planner_log[-3000:]
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS))
        for step in range(STEPS):
            for k in KEYS:
                assert np.array_equal(got[r][step][k], reference[r][step][k]), f"rank {r} step {step}: {k} differs"
    # stall: from the kill to the first step any rank received after it
    after = [fetch.times[r][at_kill[r]] for r in range(RANKS) if len(fetch.times[r]) > at_kill[r]]
    stall = min(after) - killed_at if after else float("nan")
    worst_gap = max(float(np.max(np.diff([killed_at, *fetch.times[r][at_kill[r]:]]))) for r in range(RANKS))
    print(f'{{"loader_restart_stall_s": {stall:.3f}, "loader_restart_max_gap_s": {worst_gap:.3f}, '
          f'"killed_after_steps": {min(at_kill.values())}, "steps": {STEPS}}}')
