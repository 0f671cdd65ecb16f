"""A trainer pod's end under sidecar placement (mixplane.podend): what the client's ranks leave in the shared directory
when their processes end in each way (real child processes: a clean close, an exception, a close in a `finally`
an exception passes through, sys.exit(0) and sys.exit(2), no close, SIGKILL), and the loader's decision from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mixplane.podend import (
    EXIT_TRAINER_FAILED,
    PodEndWatch,
    RankState,
    mark_done,
    mark_running,
    parse_ranks,
    rank_state,
)

REPO = Path(__file__).resolve().parents[2]
D, R, E, W, X = RankState.DONE, RankState.RUNNING, RankState.ENDED, RankState.WAITING, RankState.EXITED

# a trainer rank: a MixtureLoader (it connects on the first batch only, so no planner is needed for the marks),
# then what the case says
TRAINER = textwrap.dedent("""
    import os, sys, time
    from mixplane.client import MixtureLoader
    case, rank = sys.argv[1], int(sys.argv[2])
    loader = MixtureLoader("tcp://127.0.0.1:9", rank=rank)
    print("started", flush=True)
    if case == "with-clean":
        with loader:
            pass
    elif case == "with-raise":
        with loader:
            raise RuntimeError("a training step failed")
    elif case == "finally-close":
        try:
            raise RuntimeError("a training step failed")
        finally:
            loader.close()
    elif case == "close-in-except-stopiteration":
        try:
            next(iter([]))
        except StopIteration:
            loader.close()
    elif case == "exit-0":
        with loader:
            sys.exit(0)
    elif case == "exit-2":
        with loader:
            sys.exit(2)
    elif case == "no-close":
        pass
    elif case == "no-close-exit-1":
        sys.exit(1)
    elif case == "no-close-raise":
        raise RuntimeError("a training step failed")
    elif case == "close-then-hang":
        loader.close()
        time.sleep(600)
""")


def run_rank(pod_dir: Path, case: str, rank: int = 0, wait: bool = True) -> subprocess.Popen:
    env = {**os.environ, "MIXPLANE_POD_DIR": str(pod_dir), "PYTHONPATH": str(REPO / "src")}
    p = subprocess.Popen([sys.executable, "-c", TRAINER, case, str(rank)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if wait:
        p.wait(120)
    return p


@pytest.mark.parametrize("case,code,state", [
    ("with-clean", 0, D), ("close-in-except-stopiteration", 0, D), ("exit-0", 0, D),
    ("with-raise", 1, E), ("finally-close", 1, E), ("exit-2", 2, E), ("no-close-raise", 1, E),
    # never closed, no exception unhandled: the weaker at-exit mark (it cannot tell sys.exit(1) from a success)
    ("no-close", 0, X), ("no-close-exit-1", 1, X),
])
def test_what_a_rank_leaves_when_its_process_ends(tmp_path, case, code, state):
    p = run_rank(tmp_path, case)
    assert p.returncode == code, p.stderr
    assert rank_state(str(tmp_path), 0) is state, (case, sorted(os.listdir(tmp_path)))


def test_a_running_rank_holds_its_lock_until_its_process_ends_even_after_close_and_by_sigkill(tmp_path):
    assert rank_state(str(tmp_path), 0) is W
    p = run_rank(tmp_path, "close-then-hang", wait=False)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while not (tmp_path / "rank-0.done").exists():
            assert time.monotonic() < deadline and p.poll() is None, p.stderr
            time.sleep(0.05)
        # closed cleanly, but the process still runs (it may take another loader): not done yet
        assert rank_state(str(tmp_path), 0) is R
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    assert rank_state(str(tmp_path), 0) is D  # its close was clean, and its process is gone
    # a crash after a clean close of an earlier run: the new process clears the mark when it starts
    p = run_rank(tmp_path, "with-raise")
    assert p.returncode == 1 and rank_state(str(tmp_path), 0) is E


def test_the_lock_is_held_against_another_process_and_the_mark_cleared_on_start(tmp_path):
    mark_running(str(tmp_path), 5)  # this process runs rank 5
    mark_done(str(tmp_path), 5)
    probe = subprocess.run([sys.executable, "-c", "import sys; from mixplane.podend import rank_state; "
                            "print(rank_state(sys.argv[1], 5).value)", str(tmp_path)],
                           env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "running", probe.stderr
    mark_running(str(tmp_path), 5)  # started again (a loader used again): the done mark goes
    assert not (tmp_path / "rank-5.done").exists()
    assert oct((tmp_path / "rank-5.lock").stat().st_mode & 0o777) == "0o644"  # the loader's uid reads it


def test_parse_ranks():
    assert parse_ranks("0-3") == [0, 1, 2, 3] and parse_ranks("7") == [7]
    for bad in ("3-1", "x", "-1"):
        with pytest.raises(ValueError, match="--trainer-ranks"):
            parse_ranks(bad)


def test_done_needs_every_rank_and_quiet():
    w = PodEndWatch([0, 1], "Never", quiet_s=5.0, gone_s=30.0)
    assert w.update({0: D, 1: R}, 0.0, 100.0) is None  # rank 1 still trains
    assert w.update({0: D, 1: D}, 1.0, 2.0) is None  # the loader sent something 2 s ago: the other pods' last steps
    d = w.update({0: D, 1: D}, 2.0, 5.0)
    assert d is not None and d.code == 0 and "ranks 0-1" in d.reason


def test_never_fails_the_pod_once_no_rank_runs_for_gone_s():
    w = PodEndWatch([0, 1], "Never", quiet_s=0.0, gone_s=30.0)
    assert w.update({0: W, 1: W}, 0.0, 1e9) is None  # before any rank started: wait however long
    assert w.update({0: W, 1: W}, 1000.0, 1e9) is None
    assert w.update({0: R, 1: R}, 1001.0, 0.0) is None
    assert w.update({0: E, 1: R}, 1002.0, 0.0) is None  # torchrun restarts a worker in the container: still one runs
    assert w.crashes == {0: 1}
    assert w.update({0: E, 1: E}, 1003.0, 0.0) is None  # nothing runs: the clock starts
    assert w.update({0: R, 1: E}, 1010.0, 0.0) is None  # rank 0 came back: the clock stops
    assert w.update({0: E, 1: D}, 1020.0, 0.0) is None
    assert w.update({0: E, 1: D}, 1049.0, 0.0) is None
    d = w.update({0: E, 1: D}, 1050.0, 0.0)
    assert d is not None and d.code == EXIT_TRAINER_FAILED and "rank 0 ended" in d.reason and "Never" in d.reason
    assert w.crashes == {0: 2, 1: 1}


def test_a_rank_that_exited_without_closing_counts_as_done_once_no_restart_can_come():
    never = PodEndWatch([0, 1], "Never", quiet_s=1.0, gone_s=30.0)
    assert never.update({0: X, 1: R}, 0.0, 100.0) is None
    d = never.update({0: X, 1: D}, 1.0, 100.0)  # Never: the trainer container's own exit status decides the pod
    assert d is not None and d.code == 0 and "without closing" in d.reason
    again = PodEndWatch([0], "OnFailure", quiet_s=1.0, gone_s=30.0)
    assert again.update({0: R}, 0.0, 0.0) is None
    assert again.update({0: X}, 1.0, 100.0) is None  # a failed container comes back within gone_s: wait
    assert again.update({0: R}, 12.0, 0.0) is None  # it did (sys.exit(1) without a close looks the same at exit)
    assert again.update({0: X}, 20.0, 100.0) is None
    assert again.update({0: X}, 49.0, 100.0) is None
    d = again.update({0: X}, 50.0, 100.0)
    assert d is not None and d.code == 0


@pytest.mark.parametrize("policy", ["OnFailure", "Always"])
def test_a_crash_the_kubelet_restarts_in_the_pod_keeps_the_loader(policy):
    w = PodEndWatch([3], policy, quiet_s=0.0, gone_s=1.0)
    assert w.update({3: R}, 0.0, 0.0) is None
    for t in (1.0, 100.0, 10_000.0):
        assert w.update({3: E}, t, 1e9) is None  # restarted in place: the loader serves on
    assert w.update({3: R}, 10_001.0, 0.0) is None  # the restarted container's rank found it
    d = w.update({3: D}, 10_002.0, 1.0)
    assert d is not None and d.code == 0 and w.crashes == {3: 1}


def test_bad_arguments():
    with pytest.raises(ValueError, match="restartPolicy|--trainer-restart"):
        PodEndWatch([0], "Sometimes")
    with pytest.raises(ValueError):
        PodEndWatch([], "Never")
