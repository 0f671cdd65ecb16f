"""A running source re-partitioned at a step boundary (issue 20 item 4) with real processes: loader hosts
started for the new partitions, the old ones released, every rank's batches equal to a second run given the same
re-partition at the same step, `mixplane replay` bit-exact across the change, nothing of an epoch delivered twice
or skipped; the longest trainer stall is measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict

import numpy as np
import pytest

from mixplane.loader.stream import open_stream
from mixplane.repartition import layouts_after
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime, RestartPolicy
from mixplane.samples import key_epoch, key_row
from mixplane.spec import parse_spec
from tests.conftest import token_mixture, write_token_source
from tests.integration.test_loader_restart import KEYS, RANKS, STEPS, Fetcher
from tests.integration.test_runtime import fetch as fetch_with_states

AT = 14  # the step the re-partition applies from
ROWS_A = 160


def make_spec(root, **runtime):
    doc = token_mixture(root, runtime={"window": 64, "metrics": False, **runtime})
    doc["sources"][0].update(uri=str(root / "small_a"), replicas=2)
    return parse_spec(doc)


@pytest.fixture(scope="module")
def small_a(token_sources):
    write_token_source(token_sources["root"] / "small_a", rows=ROWS_A, files=2, mean_len=50, seed=9, rows_per_group=10)
    return token_sources["root"]


def run(root, run_dir, partitions):
    with EmbeddedRuntime(make_spec(root), run_dir) as rt:
        st = rt.status()
        assert st["source_partitions"]["a"] == 2 and st["planned_through"] < AT, st["planned_through"]
        t0 = time.monotonic()
        ack = rt.repartition("a", partitions, step=AT, wait=False)
        hosts_started_s = time.monotonic() - t0
        assert ack == {"source": "a", "from": 2, "partitions": partitions, "step": AT}
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.02)
        got = fetch.join()
        st = rt.status()
        table = rt.partitions()
    (entry,) = [r for r in st["repartitions"] if r["source"] == "a"]
    return got, fetch.times, entry, st, table, hosts_started_s


def longest_gap(times, lo, hi):
    return max(float(np.max(np.diff(times[r][lo:hi]))) for r in range(RANKS))


@pytest.fixture(scope="module")
def first_run(small_a, tmp_path_factory):
    d = tmp_path_factory.mktemp("first")
    return d, run(small_a, d / "a", 3)


def test_repartition_of_a_running_source(small_a, first_run, tmp_path):
    root = small_a
    base, (got, times, entry, st, table, hosts_s) = first_run
    run_a = base / "a"
    assert entry["applied"] and entry["from"] == 2 and entry["partitions"] == 3 and entry["step"] == AT
    assert st["source_partitions"]["a"] == 3
    assert set(k for k in table["partitions"] if k.startswith("a:")) == {"a:0", "a:1", "a:2"}
    assert table["partitions"]["a:2"]["host"] == entry["hosts"][2] != table["partitions"]["a:0"]["host"]
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS))

    # the same re-partition at the same step in another run: the same batches, rank by rank, step by step
    again, _, entry2, _, _, _ = run(root, tmp_path / "b", 3)
    assert entry2["hosts"] == entry["hosts"]
    for r in range(RANKS):
        for s in range(STEPS):
            for k in KEYS:
                assert np.array_equal(got[r][s][k], again[r][s][k]), f"rank {r} step {s}: {k} differs"

    # nothing of source a twice: every document's tokens at most once; every finished epoch's rows all delivered
    spans = defaultdict(list)
    ai = 0  # source index of a
    for r in range(RANKS):
        for b in got[r]:
            src, key, start = b["segment_source"], b["segment_key"], b["segment_start"]
            for s_, k_, st_ in zip(src.tolist(), key.tolist(), start.tolist()):
                if s_ == ai and k_ >= 0:
                    spans[k_].append(st_)
    keys = np.array(sorted(spans), np.int64)
    assert all(len(set(v)) == len(v) for v in spans.values()), "a span of a document delivered twice"
    ep = key_epoch(keys)
    firsts = {k for k, v in spans.items() if 0 in v}
    # every epoch the re-partition's remainders finish (those before the new partitions' own first epoch E) has
    # every row started exactly once; later epochs are read by partitions at their own pace (no repeat: above)
    journal = [json.loads(x) for x in (run_a / "journal.jsonl").read_text().splitlines() if x.strip()]
    (rec,) = [x for x in journal if x.get("event") == "repartition"]
    assert rec["step"] == AT and rec["from"] == 2 and rec["partitions"] == 3 and len(rec["cursors"]) == 2
    spec = make_spec(root)
    stream = open_stream(spec.sources[0], seed=spec.mixture.seed, partition=0, num_partitions=3)
    lays = layouts_after(2, [rec], stream.epoch_rows, source="a")
    E = lays[0].epoch
    assert E >= 1 and int(ep.max()) > E
    for e in range(E):
        got_rows = sorted(int(key_row(k)) for k in firsts if int(key_epoch(k)) == e)
        assert got_rows == list(range(ROWS_A)), f"epoch {e}: {len(got_rows)} rows started, {ROWS_A} expected"

    # mixplane replay rebuilds steps around the change bit-exact from the journal
    for s in (AT - 1, AT, AT + 2, STEPS - 1):
        for r in range(RANKS):
            out = replay_step(spec, step=s, rank=r, run_dir=str(run_a), save=str(tmp_path / f"r{s}-{r}.npz"))
            assert out["digest_match"], (s, r)
            saved = np.load(tmp_path / f"r{s}-{r}.npz")
            for k in ("input_ids", "segment_key", "segment_start"):
                assert np.array_equal(saved[k], got[r][s][k]), f"replay of step {s} rank {r}: {k} differs"

    stall = longest_gap(times, max(0, AT - 12), min(STEPS, AT + 30))
    steady = float(np.median(np.diff(times[0][AT + 30:])))
    print("REPARTITION_FIGURE", json.dumps({"steps": STEPS, "at": AT, "from": 2, "to": 3, "pause_s": 0.02,
                                            "stall_s": round(stall, 3), "median_step_gap_s": round(steady, 3),
                                            "hosts_started_s": round(hosts_s, 2),
                                            "applied_after_s": entry["applied_after_s"]}))


def test_loaders_killed_after_the_repartition_change_no_batch(small_a, first_run, tmp_path):
    """SIGKILL the process of a new partition, then the one that kept partition 0, after the change: each restarted
    process registers again, the planner hands it its new partition (with the records: the new read order) and has
    it resend the steps in flight; every rank's batches equal the run without kills."""
    _, (reference, *_rest) = first_run
    with EmbeddedRuntime(make_spec(small_a), tmp_path / "kill") as rt:
        ack = rt.repartition("a", 3, step=AT, wait=False)
        assert ack["step"] == AT
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.02)
        table = None
        for after, part in ((AT + 8, "a:2"), (AT + 24, "a:0")):
            deadline = time.monotonic() + 120
            while fetch.delivered() < after and not fetch.errors:
                assert time.monotonic() < deadline, "no progress"
                time.sleep(0.01)
            table = rt.partitions()
            host = table["partitions"][part]["host"]
            victim = next(c for c in rt.children if c.name == host)
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)
            rt._spawn(victim.component)  # what the runtime's supervision does
        got = fetch.join()
        table = rt.partitions()
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS))
        for s in range(STEPS):
            for k in KEYS:
                assert np.array_equal(got[r][s][k], reference[r][s][k]), f"rank {r} step {s}: {k} differs"
    assert table["partitions"]["a:2"]["epoch"] >= 2 and table["partitions"]["a:0"]["epoch"] >= 3


def test_every_partition_keeps_its_shadow_across_the_change_and_a_new_partitions_shadow_takes_over(
        small_a, first_run, tmp_path):
    """runtime.shadow_loaders 1, source a 2 -> 3: after the change every partition has a live shadow again -- a:0 and
    a:1 their original shadows, a:2 the shadow started beside its new host (`--shadow-of`). SIGKILL a:2's primary:
    its shadow is promoted and serves, the restarted primary becomes the shadow, and every rank's batches equal the
    run without shadows and kills."""
    _, (reference, *_rest) = first_run
    with EmbeddedRuntime(make_spec(small_a, shadow_loaders=1, prefetch_s=0), tmp_path / "shadowed") as rt:
        ack = rt.repartition("a", 3, step=AT, wait=False)
        assert ack["step"] == AT
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.05)
        deadline = time.monotonic() + 120
        while fetch.delivered() < AT + 4 and not fetch.errors:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.01)
        assert not fetch.errors, fetch.errors

        def shadowed():
            t = rt.partitions()
            return t if all(len([s for s in p["shadows"] if t["hosts"][s]["alive"]]) == 1
                            for p in t["partitions"].values()) else None

        deadline = time.monotonic() + 30
        while (table := shadowed()) is None:
            assert time.monotonic() < deadline, f"not every partition has a shadow: {rt.partitions()['partitions']}"
            time.sleep(0.05)
        assert set(k for k in table["partitions"] if k.startswith("a:")) == {"a:0", "a:1", "a:2"}
        a2 = table["partitions"]["a:2"]
        primary, shadow = a2["host"], f"{a2['host']}-shadow1"
        assert a2["shadows"] == [shadow] and table["hosts"][shadow]["shadow_of"] == primary
        for k in ("a:0", "a:1"):  # the shadows launched with the old partitions stand by for the new ones
            assert table["partitions"][k]["shadows"] == [f"{table['partitions'][k]['host']}-shadow1"]
        at_kill = fetch.delivered()
        assert at_kill < STEPS - 30, f"the kill came too late to matter (step {at_kill} of {STEPS})"
        victim = next(c for c in rt.children if c.name == primary)
        t0 = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        deadline = time.monotonic() + 30
        while rt.partitions()["partitions"]["a:2"]["host"] != shadow:
            assert time.monotonic() < deadline, f"no promotion: {rt.partitions()['partitions']['a:2']}"
            time.sleep(0.01)
        promoted_s = time.monotonic() - t0
        rt._wait_ready([rt._spawn(victim.component)])  # what supervision does: the restarted primary stands by
        deadline = time.monotonic() + 60
        while rt.partitions()["partitions"]["a:2"]["shadows"] != [primary]:
            assert time.monotonic() < deadline, f"the restarted primary is no shadow: {rt.partitions()['partitions']}"
            time.sleep(0.05)
        got = fetch.join()
        table = rt.partitions()
        planner_log = (rt.run_dir / "logs" / "planner.log").read_text(errors="replace")
    assert f"promoting shadow {shadow} for partition a:2" in planner_log
    assert table["partitions"]["a:2"]["host"] == shadow and table["partitions"]["a:2"]["epoch"] >= 2
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS))
        for s in range(STEPS):
            for k in KEYS:
                assert np.array_equal(got[r][s][k], reference[r][s][k]), f"rank {r} step {s}: {k} differs"
    stall = longest_gap(fetch.times, at_kill, STEPS)
    print("REPARTITION_SHADOW_FIGURE", json.dumps({"steps": STEPS, "at": AT, "killed_at_step": at_kill,
                                                   "promoted_after_s": round(promoted_s, 3),
                                                   "stall_after_kill_s": round(stall, 3), "pause_s": 0.05}))


def test_a_repartition_asked_from_a_thread_that_ends_keeps_its_new_loader_process(small_a, first_run, tmp_path):
    """EmbeddedRuntime.repartition called from a thread that ends once it asked (as the operator test's embedded
    reference asks a later re-partition from a helper thread): the loader process started there for the new
    partition lives on and serves it -- a child's parent-death signal follows this process, not the thread that
    started it (it used to get SIGTERM as the thread ended, exit 0 right after its ADOPT, and the step of the
    re-partition waited for its partition until the trainers timed out). Every rank's batches equal the run that
    asked from the main thread."""
    _, (reference, *_rest) = first_run
    with EmbeddedRuntime(make_spec(small_a), tmp_path / "thread") as rt:
        before = {c.name for c in rt.children}
        acks: list = []
        asker = threading.Thread(target=lambda: acks.append(rt.repartition("a", 3, step=AT, wait=False)))
        asker.start()
        asker.join(180)
        assert acks and acks[0]["step"] == AT, acks
        (new,) = [c for c in rt.children if c.name not in before]
        # longer than the planner's failover window: a host that went away would be listed silent by now
        time.sleep(2 * rt.spec.runtime.failover_after_s + 0.5)
        assert new.proc.poll() is None, f"{new.name} exited with code {new.proc.returncode} after its thread ended"
        assert rt.partitions()["hosts"][new.name]["alive"]
        got = Fetcher(rt.planner_endpoint, pause_s=0.02).join()
        assert new.proc.poll() is None
        table = rt.partitions()
    assert table["partitions"]["a:2"]["host"] == new.name
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS))
        for s in range(STEPS):
            for k in KEYS:
                assert np.array_equal(got[r][s][k], reference[r][s][k]), f"rank {r} step {s}: {k} differs"


def test_trainers_resume_from_a_state_taken_after_the_change_in_a_new_run(small_a, first_run, tmp_path):
    """Every rank saves its state_dict after step AT + 6 of a re-partitioned run; a new run of the same spec (source a
    in 2 partitions) resumes from those states: the planner adopts the cursor's partitioning (3 partitions, the
    records' read orders) and every rank gets exactly the batches of the run that never stopped."""
    _, (reference, *_rest) = first_run
    save = AT + 6
    with EmbeddedRuntime(make_spec(small_a), tmp_path / "one") as rt:
        rt.repartition("a", 3, step=AT, wait=False)
        states: dict = {"at": save}
        fetch_with_states(rt.planner_endpoint, RANKS, save + 4, states=states)
    assert set(states["saved"]) == set(range(RANKS))
    with EmbeddedRuntime(make_spec(small_a), tmp_path / "two") as rt:
        got = fetch_with_states(rt.planner_endpoint, RANKS, STEPS, start=states["saved"])
        st = rt.status()
    assert st["source_partitions"]["a"] == 3
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(save + 1, STEPS))
        for b in got[r]:
            s = int(b["step"])
            for k in KEYS:
                assert np.array_equal(b[k], reference[r][s][k]), f"rank {r} step {s}: {k} differs"


def test_a_planner_killed_after_the_change_recovers_the_new_partitions(small_a, first_run, tmp_path):
    """SIGKILL the planner after the re-partition; the restarted planner's table follows the journal's records, the
    loader hosts registering again are handed their new partitions back, the recovery starts at or after the
    re-partition's checkpoint, and every rank's batches equal the run without a kill."""
    _, (reference, *_rest) = first_run
    run_dir = tmp_path / "planner-kill"
    rt = EmbeddedRuntime(make_spec(small_a), run_dir, restart=RestartPolicy(budget=2, window_s=600, backoff_s=0.1)).start()
    try:
        rt.supervise_in_background(0.1)
        rt.repartition("a", 3, step=AT, wait=False)
        fetch = Fetcher(rt.planner_endpoint, pause_s=0.02)
        deadline = time.monotonic() + 120
        while fetch.delivered() < AT + 10 and not fetch.errors:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.01)
        victim = rt.child("planner")
        old_pid = victim.proc.pid
        os.kill(old_pid, signal.SIGKILL)
        got = fetch.join()
        rt.check()
        assert rt.child("planner").proc.pid != old_pid
        st = rt.status()
    finally:
        rt.stop()
    log = (run_dir / "logs" / "planner.log").read_text(errors="replace")
    assert "the journal re-partitioned 'a' to 3 partitions" in log, log[-3000:]
    assert "differs from the journal" not in log and "would re-plan across" not in log
    assert st["source_partitions"]["a"] == 3
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(STEPS))
        for s in range(STEPS):
            for k in KEYS:
                assert np.array_equal(got[r][s][k], reference[r][s][k]), f"rank {r} step {s}: {k} differs"


def test_a_state_from_before_the_change_brings_the_old_partitions_back(small_a, first_run, tmp_path):
    """A run re-partitioned at its very first step (3 partitions) is resumed from states saved at step 6 of a run
    that was still in 2 partitions then: the planner goes back to the 2 partitions of the cursor (the hosts re-open
    the spec's read orders) and the ranks get exactly that run's steps 7..13 (after 13 the saved run re-partitioned,
    this one does not)."""
    _, (reference, *_rest) = first_run
    save = 6
    with EmbeddedRuntime(make_spec(small_a), tmp_path / "saved") as rt:
        states: dict = {"at": save}
        fetch_with_states(rt.planner_endpoint, RANKS, save + 2, states=states)
    with EmbeddedRuntime(make_spec(small_a), tmp_path / "back") as rt:
        entry = rt.repartition("a", 3, step=0, timeout_s=60)
        assert entry["applied"] and entry["step"] == 0 and rt.status()["source_partitions"]["a"] == 3
        got = fetch_with_states(rt.planner_endpoint, RANKS, AT + 6, start=states["saved"])
        st = rt.status()
        log = (tmp_path / "back" / "logs" / "planner.log").read_text(errors="replace")
    assert st["source_partitions"]["a"] == 2 and "partitions 3 -> 2 to serve the resumed cursor" in log
    for r in range(RANKS):
        assert [int(b["step"]) for b in got[r]] == list(range(save + 1, AT + 6))
        for b in got[r]:
            s = int(b["step"])
            if s < AT:
                for k in KEYS:
                    assert np.array_equal(b[k], reference[r][s][k]), f"rank {r} step {s}: {k} differs"


def test_bad_requests_are_refused_naming_the_field(small_a, tmp_path):
    with EmbeddedRuntime(make_spec(small_a), tmp_path / "bad") as rt:
        from mixplane import control
        ep, curve = rt.planner_endpoint or "", rt.control_curve
        for kw, msg in ((dict(source="zz", partitions=2), "source: no source 'zz'"),
                        (dict(source="a", partitions=0), "partitions: must be an integer in [1, 1024], not 0"),
                        (dict(source="a", partitions=2), "partitions: source 'a' already has 2 partitions"),
                        (dict(source="a", partitions=3, hosts=["nope", "x", "y"]), "hosts: no loader host 'nope'")):
            with pytest.raises(RuntimeError, match="repartition rejected: " + msg.replace("[", r"\[").replace("]", r"\]")):
                control.repartition(ep, kw.pop("source"), kw.pop("partitions"), 5.0, curve=curve, **kw)
        with pytest.raises(RuntimeError, match="step: -1 is planned already"):
            control.repartition(ep, "a", 3, 5.0, step=-1, curve=curve)
        # more partitions than the source has pages: refused before anything starts (the runtime reads the index)
        with pytest.raises(ValueError, match="partitions: source 'a': .* cannot be split into 1000 partitions"):
            rt.repartition("a", 1000)
        assert rt.status()["repartitions"] == []
        # the command line: refusals name the field (exit 1), an accepted request prints the planner's answer
        cli = [sys.executable, "-m", "mixplane.cli", "repartition", "a", "--run-dir", str(rt.run_dir)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        bad = subprocess.run([*cli, "--partitions", "5000"], capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 1 and "partitions: must be an integer in [1, 1024], not 5000" in bad.stderr
        ok = subprocess.run([*cli, "--partitions", "3", "--step", "500"], capture_output=True, text=True, timeout=60,
                            env=env)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout) == {"source": "a", "from": 2, "partitions": 3, "step": 500}
        (pending,) = rt.status()["repartitions"]
        assert pending["step"] == 500 and not pending["applied"]
        with pytest.raises(RuntimeError, match="a re-partition at step 500 is pending"):
            control.repartition(ep, "a", 4, 5.0, curve=curve)
