"""A static source's positions count over the run's pinned listing, not over what the store lists today: a loader
restarted after a file was added (SIGKILL) and a resume from a trainer's cursor into a new run directory both reopen
their stream with the run's kept listing, so every sample of epoch 0 is delivered exactly once and the new file is
not read by the run. Real processes, real files."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mixplane.client import MixtureLoader
from mixplane.runtime import EmbeddedRuntime, RestartPolicy
from mixplane.samples import key_epoch, key_row
from mixplane.spec import parse_spec
from tests.conftest import write_token_source

ROWS = 240  # rows of the source's two files
STEPS = 22  # past epoch 0 (about 15 steps of 1,024 tokens)
SAVE_AT = 5
KEYS = ("input_ids", "segment_source", "segment_key", "segment_start")


@pytest.fixture(autouse=True)
def kept_listings(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", str(tmp_path / "cache"))  # where the loaders keep their listings


def setup(tmp_path: Path, name: str, journal_every: int = 4, **runtime):
    """A static source of 2 files; a third waits in staging, named so that it sorts before them (a listing with it
    numbers every position differently)."""
    src = tmp_path / name
    write_token_source(src, rows=ROWS, files=2, mean_len=40, seed=31, rows_per_group=40)
    write_token_source(tmp_path / f"{name}-staging", rows=90, files=1, mean_len=40, seed=32)
    doc = {
        "name": "pinned",
        "sources": [{"name": "web", "uri": str(src), "kind": "tokens", "columns": ["tokens"]}],
        "mixture": {"weights": {"web": 1.0}, "seed": 7},
        "batch": {"sequences": 4, "seq_len": 256, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}}, "strategy": {"name": "vanilla"},
        "runtime": {"window": 8, "window_tokens": 600, "metrics": False, "journal_every": journal_every, **runtime},
    }
    return parse_spec(doc), src, tmp_path / f"{name}-staging" / "part-000.parquet"


def add_file(src: Path, part: Path) -> None:
    shutil.copy(part, src / ".incoming")
    os.replace(src / ".incoming", src / "part--new.parquet")  # sorts before part-000


def take(endpoint: str, start: int, stop: int, state: dict | None = None) -> tuple[dict[int, dict], dict]:
    loader = MixtureLoader(endpoint, rank=0, max_steps=stop, timeout_s=90)
    if state is not None:
        loader.load_state_dict(state)
    got = {}
    for b in loader:
        got[int(b["step"])] = {k: b[k].numpy().copy() for k in KEYS}
    st = loader.state_dict()
    loader.close()
    assert sorted(got) == list(range(start, stop))
    return got, st


def assert_epoch0_exactly_once(got: dict[int, dict]) -> None:
    """Every row of the two files delivered once in epoch 0 (a piece of a document split across rows counted by its
    start), nothing more: the added file's rows would show as rows past ROWS or as a row delivered twice."""
    keys, starts = [], []
    for s in sorted(got):
        src, key, start = (got[s][k].reshape(-1) for k in ("segment_source", "segment_key", "segment_start"))
        real = (src == 0) & (key >= 0)
        keys.append(key[real])
        starts.append(start[real])
    k, st = np.concatenate(keys), np.concatenate(starts)
    e0 = key_epoch(k) == 0
    assert (key_epoch(k) == 1).any(), "the run did not get past epoch 0"
    pairs = list(zip(key_row(k[e0]).tolist(), st[e0].tolist()))
    assert len(pairs) == len(set(pairs)), "a sample of epoch 0 was delivered twice"
    assert sorted(set(key_row(k[e0]).tolist())) == list(range(ROWS))


def assert_same(a: dict, b: dict, steps: range) -> None:
    for s in steps:
        for k in KEYS:
            assert np.array_equal(a[s][k], b[s][k]), f"step {s}: {k} differs from the run without the new file"


def test_loader_restarted_after_a_file_was_added_reads_the_runs_listing(tmp_path):
    spec, _, _ = setup(tmp_path, "ref")
    with EmbeddedRuntime(spec, tmp_path / "run-ref") as rt:
        reference, _ = take(rt.planner_endpoint, 0, STEPS)
    assert_epoch0_exactly_once(reference)
    spec, src, extra = setup(tmp_path, "restarted")
    with EmbeddedRuntime(spec, tmp_path / "run-k", restart=RestartPolicy(backoff_s=0.05)) as rt:
        first, state = take(rt.planner_endpoint, 0, SAVE_AT)
        assert set(state["cursor"]["listings"]) == {"0"}  # the run's listing travels in the trainer's cursor
        victim = next(c for c in rt.children if c.component is not None and c.component.role == "loader")
        add_file(src, extra)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        deadline = time.monotonic() + 60
        while not rt.supervise():
            assert time.monotonic() < deadline, "the killed loader was not restarted"
            time.sleep(0.05)
        rest, _ = take(rt.planner_endpoint, SAVE_AT, STEPS, state)
        log = (tmp_path / "run-k" / "logs" / f"{victim.name}.log").read_text()
    got = {**first, **rest}
    assert_epoch0_exactly_once(got)
    assert_same(reference, got, range(STEPS))
    assert "reopening its stream with the run's listing (240 files" not in log  # (files, not rows)
    assert "reopening its stream with the run's listing (2 files" in log


def test_resume_into_a_new_run_after_a_file_was_added_reads_the_cursors_listing(tmp_path):
    spec, _, _ = setup(tmp_path, "ref")
    with EmbeddedRuntime(spec, tmp_path / "run-ref") as rt:
        reference, _ = take(rt.planner_endpoint, 0, STEPS)
    spec, src, extra = setup(tmp_path, "resumed")
    with EmbeddedRuntime(spec, tmp_path / "run-a") as rt:
        first, state = take(rt.planner_endpoint, 0, SAVE_AT)
    add_file(src, extra)  # between the two runs: run-b's loaders list 3 files
    with EmbeddedRuntime(spec, tmp_path / "run-b") as rt:
        rest, _ = take(rt.planner_endpoint, SAVE_AT, STEPS, state)
        logs = "".join(p.read_text() for p in (tmp_path / "run-b" / "logs").glob("loader*.log"))
    got = {**first, **rest}
    assert_epoch0_exactly_once(got)
    assert_same(reference, got, range(STEPS))
    assert "reopening its stream with the run's listing (2 files" in logs


def test_a_planner_restarted_from_its_journal_keeps_the_runs_listing(tmp_path):
    """The planner and the loader SIGKILLed after a file was added: the restarted planner pins the run's listing again
    (its journal's listing record -- no checkpoint holds it: journal_every 100 -- or the cursor a constructor holds;
    tests/unit/test_listing_pin.py has the journal alone), so the restarted loader reopens with it."""
    # a short look-ahead: the steps after the kills need the restarted loader
    short = {"journal_every": 100, "max_lead_steps": 2, "prefetch_s": 0, "prefetch_steps": 1}
    spec, _, _ = setup(tmp_path, "ref", **short)
    with EmbeddedRuntime(spec, tmp_path / "run-ref") as rt:
        reference, _ = take(rt.planner_endpoint, 0, STEPS)
    spec, src, extra = setup(tmp_path, "recovered", **short)
    got: dict[int, dict] = {}
    errors: list[BaseException] = []

    def fetch(endpoint: str) -> None:
        try:
            loader = MixtureLoader(endpoint, rank=0, max_steps=STEPS, timeout_s=90)
            for b in loader:
                got[int(b["step"])] = {k: b[k].numpy().copy() for k in KEYS}
                time.sleep(0.1)
            loader.close()
        except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)

    rt = EmbeddedRuntime(spec, tmp_path / "run-p", restart=RestartPolicy(budget=2, window_s=600, backoff_s=0.1)).start()
    try:
        rt.supervise_in_background(0.1)
        t = threading.Thread(target=fetch, args=(rt.planner_endpoint,), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while len(got) < SAVE_AT and not errors:
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.01)
        add_file(src, extra)
        for role in ("planner", "loader"):
            victim = next(c for c in rt.children if c.component is not None and c.component.role == role)
            os.kill(victim.proc.pid, signal.SIGKILL)
        t.join(120)
        assert not errors and not t.is_alive(), errors
        rt.check()
        loader_log = (tmp_path / "run-p" / "logs" / f"{victim.name}.log").read_text()
        planner_log = (tmp_path / "run-p" / "logs" / "planner.log").read_text()
    finally:
        rt.stop()
    assert_epoch0_exactly_once(got)
    assert_same(reference, got, range(STEPS))
    assert "recovering session" in planner_log
    assert "reopening its stream with the run's listing (2 files" in loader_log


def test_a_loader_restarted_with_another_read_order_is_refused_not_restarted(tmp_path):
    """An upgrade between restarts that reads the source block by block (lazy_index_files, block_files): the restarted
    loader would number the same files' positions otherwise. The planner refuses it with the error naming both orders
    and the spec fields; the loader exits with its own status and the runtime does not restart it again."""
    import json

    from mixplane.protocol import EXIT_LISTING
    from mixplane.runtime import ComponentFailed

    spec, _, _ = setup(tmp_path, "upgraded")
    with EmbeddedRuntime(spec, tmp_path / "run-u", restart=RestartPolicy(backoff_s=0.05)) as rt:
        take(rt.planner_endpoint, 0, 2)
        spec_file = tmp_path / "run-u" / "spec.json"
        doc = json.loads(spec_file.read_text())
        doc["sources"][0].update(lazy_index_files=2, block_files=1)  # what the restarted loader reads
        spec_file.write_text(json.dumps(doc))
        victim = next(c for c in rt.children if c.component is not None and c.component.role == "loader")
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        deadline = time.monotonic() + 60
        with pytest.raises(ComponentFailed) as failed:
            while True:
                assert time.monotonic() < deadline, "the refused loader was not given up on"
                rt.supervise()
                time.sleep(0.05)
        refused = rt.status()["refused_loaders"]["web/0"]
        codes = [c.proc.returncode for c in rt.children if c.component is not None and c.component.role == "loader"]
    text = str(failed.value)
    assert f"exited with code {EXIT_LISTING}" in text and "not restarted" in text
    for why in (text, refused):
        assert "lazy_index_files" in why and "'blocks:1'" in why and "'pages'" in why and "'web'" in why
    assert codes == [EXIT_LISTING]


def test_a_loader_that_cannot_find_the_runs_listing_is_refused_not_restarted(tmp_path):
    """A file added and the kept listings gone (a pod on a node with an empty cache, no copy beside the data): the
    restarted loader cannot number the run's positions, says so naming both listings -- to the planner too, whose
    STATUS names it (it waited for the planner's acknowledgement before it exited) -- and exits; not restarted."""
    from mixplane.protocol import EXIT_LISTING
    from mixplane.runtime import ComponentFailed

    spec, src, extra = setup(tmp_path, "lost")
    with EmbeddedRuntime(spec, tmp_path / "run-l", restart=RestartPolicy(backoff_s=0.05)) as rt:
        _, state = take(rt.planner_endpoint, 0, 2)
        add_file(src, extra)
        shutil.rmtree(tmp_path / "cache")
        victim = next(c for c in rt.children if c.component is not None and c.component.role == "loader")
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        deadline = time.monotonic() + 60
        with pytest.raises(ComponentFailed) as failed:
            while True:
                assert time.monotonic() < deadline, "the refused loader was not given up on"
                rt.supervise()
                time.sleep(0.05)
        refused = rt.status()["refused_loaders"]
    text = str(failed.value)
    pinned = state["cursor"]["listings"]["0"].split(":")
    assert f"exited with code {EXIT_LISTING}" in text and "'web'" in text and "is not kept here" in text
    assert f"({pinned[1]} files, digest {pinned[0]})" in text and "(3 files, digest " in text
    assert list(refused) == ["web/0"]
    assert "is not kept here" in refused["web/0"] and f"({pinned[1]} files, digest {pinned[0]})" in refused["web/0"]


def test_replay_after_a_file_was_added_reads_the_runs_listing(tmp_path):
    """`mixplane replay` rebuilds a step with the run's kept listing, not the store's today: a file that sorts first
    added after the run would renumber every position (and the replay read other samples). With the kept listing
    gone and the files as they were, the store's listing is the run's; with the file added too, the replay fails
    naming the source, the run's listing and where it is kept."""
    from mixplane.replay import ReplayError, replay_step

    spec, src, extra = setup(tmp_path, "replayed")
    run_dir = tmp_path / "run-r"
    with EmbeddedRuntime(spec, run_dir) as rt:
        got, state = take(rt.planner_endpoint, 0, 8)
    pinned = state["cursor"]["listings"]["0"].split(":")
    assert pinned[1:] == ["2", "pages"]

    def replayed(step: int) -> dict:
        out = replay_step(spec, step=step, rank=0, run_dir=str(run_dir), save=str(tmp_path / f"r{step}.npz"))
        assert out["digest_match"], out
        return dict(np.load(tmp_path / f"r{step}.npz"))

    shutil.rmtree(tmp_path / "cache")  # the run's kept listing gone, the files as they were: listed, the same
    assert_same({3: got[3]}, {3: replayed(3)}, range(3, 4))
    add_file(src, extra)  # (that listing was kept again by the replay: found below)
    for step in (2, 6):  # from the open record's cursor (the journal's listing record), and a checkpoint's (step 4)
        assert_same(got, {step: replayed(step)}, range(step, step + 1))
    shutil.rmtree(tmp_path / "cache")
    with pytest.raises(ReplayError) as lost:
        replay_step(spec, step=6, rank=0, run_dir=str(run_dir))
    text = str(lost.value)
    assert "'web'" in text and f"{pinned[1]} files (digest {pinned[0]}" in text and "(3 files, digest " in text
    assert "MIXPLANE_INDEX_CACHE" in text and "index_beside_data" in text
    assert str(tmp_path / "cache" / "listings") in text  # where it was looked for
