"""A live source resumes exactly even when files were added in between (issue 11 item 7): the planner's
cursor names the file listing its positions count over, and a resumed run, a restarted loader and a
replay number the positions over that listing, not over today's. Real processes, real files."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np

from mixplane.client import MixtureLoader
from mixplane.replay import replay_step
from mixplane.runtime import EmbeddedRuntime, RestartPolicy
from mixplane.spec import parse_spec
from tests.conftest import write_token_source

STEPS = 14
SAVE_AT = 6
KEYS = ("input_ids", "segment_source", "segment_key", "segment_start")


def setup(tmp_path: Path, name: str):
    """A static source and a live one whose directory holds 2 files; a third file waits in staging, named
    so that it sorts before them (a listing that includes it numbers every position differently)."""
    staging = tmp_path / "staging"
    if not staging.exists():
        write_token_source(tmp_path / "static", rows=3000, files=1, mean_len=60, seed=21)
        write_token_source(staging, rows=1200, files=3, mean_len=60, seed=22)
    live = tmp_path / name
    live.mkdir()
    parts = sorted(staging.glob("*.parquet"))
    for p in parts[:2]:
        shutil.copy(p, live / p.name)
    doc = {
        "name": "live",
        "sources": [{"name": "static", "uri": str(tmp_path / "static"), "kind": "tokens", "columns": ["tokens"]},
                    {"name": "fresh", "uri": str(live / "*.parquet"), "kind": "tokens", "columns": ["tokens"],
                     "live": True, "shuffle": "rowgroup"}],
        "mixture": {"weights": {"static": 0.5, "fresh": 0.5}, "seed": 5},
        "batch": {"sequences": 4, "seq_len": 256, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}}, "strategy": {"name": "vanilla"},
        "runtime": {"window": 8, "window_tokens": 600, "metrics": False, "journal_every": 4},
    }
    return parse_spec(doc), live, parts[2]


def add_file(live: Path, part: Path) -> None:
    shutil.copy(part, live / ".incoming")
    os.replace(live / ".incoming", live / "part--new.parquet")  # sorts before part-000


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


def assert_same(a: dict, b: dict, steps: range) -> None:
    for s in steps:
        for k in KEYS:
            assert np.array_equal(a[s][k], b[s][k]), f"step {s}: {k} differs from the run without new files"


def test_resume_after_files_were_added_is_exact_and_replays(tmp_path):
    spec, live, _ = setup(tmp_path, "ref")
    with EmbeddedRuntime(spec, tmp_path / "run-ref") as rt:
        reference, _ = take(rt.planner_endpoint, 0, STEPS)
    spec, live, extra = setup(tmp_path, "resumed")
    with EmbeddedRuntime(spec, tmp_path / "run-a") as rt:
        _, state = take(rt.planner_endpoint, 0, SAVE_AT)
    fresh = next(w for w in state["cursor"]["windows"] if w["source"] == 1)
    assert [sorted(os.path.basename(p) for p in seg) for seg in fresh["listing"]] == [["part-000.parquet", "part-001.parquet"]]
    add_file(live, extra)  # between the two runs
    with EmbeddedRuntime(spec, tmp_path / "run-b") as rt:
        got, _ = take(rt.planner_endpoint, SAVE_AT, STEPS, state)
    assert_same(reference, got, range(SAVE_AT, STEPS))
    out = replay_step(spec, step=STEPS - 1, rank=0, run_dir=str(tmp_path / "run-b"), save=str(tmp_path / "r.npz"))
    assert out["digest_match"]
    assert np.array_equal(np.load(tmp_path / "r.npz")["input_ids"], got[STEPS - 1]["input_ids"])


def test_loader_restarted_after_files_were_added_sends_the_same_samples(tmp_path):
    spec, live, _ = setup(tmp_path, "ref")
    with EmbeddedRuntime(spec, tmp_path / "run-ref") as rt:
        reference, _ = take(rt.planner_endpoint, 0, STEPS)
    spec, live, extra = setup(tmp_path, "restarted")
    with EmbeddedRuntime(spec, tmp_path / "run-k", restart=RestartPolicy(backoff_s=0.05)) as rt:
        first, state = take(rt.planner_endpoint, 0, SAVE_AT)
        victim = next(c for c in rt.children if c.component is not None and c.component.role == "loader"
                      and any(p.source == "fresh" for p in c.component.partitions))
        add_file(live, extra)
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(10)
        deadline = time.monotonic() + 60
        while not rt.supervise():
            assert time.monotonic() < deadline, "the killed loader was not restarted"
            time.sleep(0.05)
        rest, _ = take(rt.planner_endpoint, SAVE_AT, STEPS, state)
        log = (tmp_path / "run-k" / "logs" / f"{victim.name}.log").read_text()
    assert_same(reference, {**first, **rest}, range(STEPS))
    assert "positions follow the recorded listing" in log
