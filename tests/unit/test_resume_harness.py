"""Save / load state of every stateful part through one harness (tests/resume_harness.py): SourceStream
in every shuffle mode, LoaderWindow driven by planner cursors, and the planner's cursor over real
loaders. Each run crosses an epoch boundary and is resumed before and after it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.resume_harness import Resumable, check_save_load_state
from tests.unit.loader_testdata import write_source
from mixplane.loader.blocks import MAX_BLOCK_SLOTS
from mixplane.loader.blockstream import BlockStream
from mixplane.loader.policies import POLICIES
from mixplane.loader.stream import open_stream
from mixplane.loader.transforms import make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.planner.core import StepPlanner
from mixplane.planner.windows import ReplicaWindow
from mixplane.replay import ReplayLoaders
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec, parse_spec

MODES = sorted(POLICIES)


@pytest.fixture(autouse=True)
def _no_index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """~2 x 130 rows of text + token ids: an epoch is short enough to cross several times."""
    d = tmp_path_factory.mktemp("small")
    write_source(str(d), nfiles=2, rows=130, page_size=512, row_group_size=60)
    return str(d)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """16 files of 10-20 rows, read block by block (lazy_index_files 8, blocks of 3 files: 6 blocks)."""
    d = tmp_path_factory.mktemp("many")
    for k in range(16):
        write_source(str(d / f"f{k:02d}"), nfiles=1, rows=10 + k % 11, page_size=512, row_group_size=5, seed=k)
    return str(d)


LAZY = {"lazy_index_files": 8, "block_files": 3}


def epochs(keys) -> set[int]:
    return set(key_epoch(np.asarray(keys, np.int64)).tolist())


# ---------------------------------------------------------------- the harness itself


class _Counter:
    def __init__(self):
        self.n = 0


def test_harness_catches_a_resume_that_is_off_by_one():
    """The harness must fail on a part whose restore skips an item (else it proves nothing)."""
    good = Resumable(make=_Counter, next_item=lambda c: (setattr(c, "n", c.n + 1), c.n)[1],
                     save=lambda c: {"n": c.n}, load=lambda c, st: setattr(c, "n", st["n"]))
    check_save_load_state(good, total=10, midpoints=[3, 7])
    bad = Resumable(make=_Counter, next_item=good.next_item, save=good.save,
                    load=lambda c, st: setattr(c, "n", st["n"] + 1))
    with pytest.raises(AssertionError, match="resumed run differs"):
        check_save_load_state(bad, total=10, midpoints=[3])
    # a state that does not survive a JSON round trip is not a checkpoint
    unsaveable = Resumable(make=_Counter, next_item=good.next_item, save=lambda c: {"n": {c.n}}, load=good.load)
    with pytest.raises(TypeError):
        check_save_load_state(unsaveable, total=4, midpoints=[2])


# ---------------------------------------------------------------- SourceStream


@pytest.mark.parametrize("partition,num_partitions", [(0, 1), (1, 2)])
@pytest.mark.parametrize("mode", MODES)
def test_source_stream_resumes_exactly(small, mode, partition, num_partitions):
    spec = SourceSpec(name="small", uri=small, columns=["text", "ids", "row"], kind="text", shuffle=mode)

    def make():
        return open_stream(spec, seed=3, partition=partition, num_partitions=num_partitions, buffer_rows=40,
                           cache_dir=None)

    def next_item(s):
        r = s.take(23)
        return (r.keys.tolist(), r.positions.tolist(), r.columns["text"].to_pylist(), r.columns["ids"].to_pylist())

    per_epoch = 260 // num_partitions // 23  # items in one epoch of this partition
    check_save_load_state(
        Resumable(make=make, next_item=next_item, save=lambda s: s.state_dict(), load=lambda s, st: s.load_state_dict(st),
                  close=lambda s: s.close(), epoch_of=lambda item: epochs(item[0])),
        total=3 * per_epoch, midpoints=[1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 2])


def test_live_source_stream_resumes_exactly_across_a_new_segment(tmp_path):
    """A live source: two files at open (segment 0), a third found when they run out (segment 1);
    a state from either segment restores the same segments and continues the same order."""
    import os

    import pyarrow.fs as pafs

    from mixplane.loader.files import SourceFiles

    d = str(tmp_path / "live")
    paths, table = write_source(d, nfiles=3, rows=100, page_size=512, row_group_size=60)
    first = sum(len(t) for t in [table.slice(0, 100), table.slice(100, 137)])  # rows of the first two files
    spec = SourceSpec(name="live", uri=d, columns=["text", "row"], kind="text", live=True)
    st = [os.stat(p) for p in paths[:2]]
    at_open = SourceFiles(d, pafs.LocalFileSystem(), paths[:2], [x.st_size for x in st], [x.st_mtime_ns for x in st])

    def make():
        return open_stream(spec, seed=2, buffer_rows=40, cache_dir=None, files=at_open, poll_s=0.0)

    def next_item(s):
        r = s.take(23, timeout=5)
        return (r.keys.tolist(), r.positions.tolist(), r.columns["row"].to_pylist())

    ref = check_save_load_state(
        Resumable(make=make, next_item=next_item, save=lambda s: s.state_dict(), load=lambda s, st: s.load_state_dict(st),
                  close=lambda s: s.close(), epoch_of=lambda item: {int(p >= first) for p in item[1]}),
        total=17, midpoints=[1, 5, 10, 11, 12, 15])
    rows = [r for item in ref for r in item[2]]
    assert sorted(rows[:first]) == list(range(first))  # segment 0 is the first two files, once
    assert len(set(rows)) == len(rows) == 17 * 23


# ---------------------------------------------------------------- LoaderWindow


class WindowPair:
    """A loader's window and the planner's view of it: consumption follows a fixed rule on the
    window's content, so it is the same after a resume; the state is the planner's window cursor."""

    def __init__(self, d: str, mode: str, **more):
        src = SourceSpec(name="small", uri=d, columns=["ids"], kind="tokens", shuffle=mode, **more)
        self.stream = open_stream(src, seed=5, buffer_rows=40, cache_dir=None)
        bounds = (6, 40, 16)
        self.lw = LoaderWindow(self.stream, make_transform(src), bounds)
        self.rw = ReplicaWindow(0, 0, *bounds)

    def step(self):
        a = self.lw.fill()
        new = a.pos >= self.rw.next_pos  # after a seek the loader re-announces what the planner still holds
        self.rw.add(a.pos[new], a.key[new], a.tokens[new], a.patches[new])
        held = (self.rw.pos.tolist(), self.rw.key.tolist(), self.rw.tokens.tolist(), self.rw.done.tolist())
        spans = []
        for i in range(min(8, len(self.rw))):  # whole samples, and halves of every third one
            p, left = int(self.rw.pos[i]), int(self.rw.tokens[i] - self.rw.done[i])
            n = (left + 1) // 2 if (i > 0 and p % 3 == 1) else left
            key, toks = self.lw.span(p, int(self.rw.done[i]), n)
            spans.append((p, key, int(self.rw.done[i]), n, toks.tolist()))
            self.rw.done[i] += n
        for p in self.rw.compact().tolist():
            self.lw.retire(int(p))
        return held, spans

    def save(self):
        return self.rw.cursor()

    def load(self, cur):
        self.rw.restore(cur)
        self.lw.seek(cur)


@pytest.mark.parametrize("mode", MODES)
def test_loader_window_resumes_from_a_planner_cursor(small, mode):
    check_save_load_state(
        Resumable(make=lambda: WindowPair(small, mode), next_item=WindowPair.step, save=WindowPair.save,
                  load=WindowPair.load, close=lambda w: w.stream.close(),
                  epoch_of=lambda item: epochs([s[1] for s in item[1]])),
        total=110, midpoints=[1, 9, 40, 75, 101])


def test_loader_window_of_a_source_read_block_by_block_resumes_from_a_planner_cursor(many):
    w = WindowPair(many, "page", **LAZY)
    assert isinstance(w.stream, BlockStream) and w.stream.per_epoch == 6
    for _ in range(30):
        w.step()
    assert w.stream.position > 2 * MAX_BLOCK_SLOTS  # into the third block (positions name blocks)
    w.stream.close()
    check_save_load_state(
        Resumable(make=lambda: WindowPair(many, "page", **LAZY), next_item=WindowPair.step, save=WindowPair.save,
                  load=WindowPair.load, close=lambda w: w.stream.close(),
                  epoch_of=lambda item: epochs([s[1] for s in item[1]])),
        total=110, midpoints=[1, 9, 40, 75, 101])


# ---------------------------------------------------------------- the planner's cursor


@pytest.fixture(scope="module")
def token_dirs(tmp_path_factory):
    out = []
    for k, rows in enumerate((70, 160)):
        d = tmp_path_factory.mktemp(f"tok{k}")
        write_source(str(d), nfiles=2, rows=rows, page_size=512, row_group_size=40, seed=k)
        out.append(str(d))
    return out


class PlannerRun:
    """A StepPlanner fed by real Source Loaders (ReplayLoaders: real streams, transforms, windows)."""

    def __init__(self, spec):
        self.planner = StepPlanner(spec)
        self.loaders = ReplayLoaders()

    def step(self):
        self.loaders(self.planner)
        pc = self.planner.plan().pieces
        return tuple(getattr(pc, f).tolist() for f in ("bin", "source", "key", "start", "length", "replica", "pos"))

    def save(self):
        return self.planner.cursor()

    def load(self, cur):
        self.planner.restore(cur)


@pytest.mark.parametrize("shuffle", ["page", "row", "blocks"])
def test_planner_cursor_resumes_exactly(token_dirs, many, shuffle):
    dirs, more = (token_dirs, {}) if shuffle != "blocks" else ([token_dirs[0], many], LAZY)
    spec = parse_spec({
        "name": "resume",
        "sources": [{"name": f"s{k}", "uri": d, "kind": "tokens", "columns": ["ids"],
                     "shuffle": "page" if shuffle == "blocks" else shuffle, "replicas": 1 + k, **more}
                    for k, d in enumerate(dirs)],
        "mixture": {"weights": {"s0": 0.6, "s1": 0.4}, "seed": 4,
                    "phases": [{"start_step": 20, "weights": {"s0": 0.3}}]},
        "batch": {"sequences": 4, "seq_len": 32, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}},
        "runtime": {"window": 8, "metrics": False},
    })

    def small_epochs(item):  # the small source (s0) wraps first
        return epochs([k for s, k in zip(item[1], item[2]) if s == 0])

    check_save_load_state(
        Resumable(make=lambda: PlannerRun(spec), next_item=PlannerRun.step, save=PlannerRun.save, load=PlannerRun.load,
                  close=lambda r: r.loaders.close(), epoch_of=small_epochs),
        total=40, midpoints=[1, 13, 20, 33])
