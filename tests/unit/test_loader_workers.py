"""A partition's worker threads (sources[].workers, loader/workers.py): the delivered order, the window's
announcements, the consumed tokens and the cursor are the same for 1, 2 and 4 workers; a loader killed with
SIGKILL mid-run and resumed from its last cursor with another worker count continues exactly; errors of a
worker are raised in order and name what failed; what is in flight is bounded."""

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
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mixplane.loader.snapshot import window_cursor
from mixplane.loader.stream import RawSamples, open_stream
from mixplane.loader.transforms import TransformError, make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.loader.workers import MAX_AUTO_WORKERS, TransformPipeline, resolve_workers
from mixplane.samples import key_epoch
from mixplane.spec import SourceSpec

ROOT = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(300)]
BAD_ROWS = (17, 230, 411)  # invalid UTF-8: quarantined by the transform (a worker's record, kept in stream order)
BOUNDS = (8, 600, 64)


@pytest.fixture(autouse=True)
def _no_index_cache(monkeypatch):
    monkeypatch.setenv("MIXPLANE_INDEX_CACHE", "")


def make_tokenizer(path: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(path)
    return path


def make_corpus(d: str) -> None:
    """3 files of binary text (some rows not UTF-8), small pages: many units, several epochs in a test."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(11)
    row = 0
    for k in range(3):
        texts = []
        for _ in range(150):
            t = " ".join(rng.choice(WORDS, int(rng.integers(1, 40))).tolist()).encode()
            texts.append(b"\xff\xfe" + t if row in BAD_ROWS else t)
            row += 1
        pq.write_table(pa.table({"text": pa.array(texts, pa.binary())}), os.path.join(d, f"p{k}.parquet"),
                       data_page_size=1024, row_group_size=100, write_batch_size=20)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("workers")
    make_corpus(str(d / "data"))
    return str(d / "data"), make_tokenizer(str(d / "tok.json"))


def source(data: str, tok: str, **kw) -> SourceSpec:
    return SourceSpec(name="w", uri=data, tokenizer=tok, shuffle_buffer=200, **kw)


def window(data: str, tok: str, workers: int, partition: int = 0, parts: int = 1, **kw) -> LoaderWindow:
    src = source(data, tok, **kw)
    return LoaderWindow(open_stream(src, seed=5, partition=partition, num_partitions=parts, cache_dir=None),
                        make_transform(src), BOUNDS, workers=workers)


def step(w: LoaderWindow) -> dict:
    """What a planner and a constructor would do with one step: take the window's announcements, consume the
    three lowest positions whole and 2 tokens of the fourth; the consumed spans and the cursor after them."""
    a = w.fill()
    ann = [[int(p), int(k), int(t)] for p, k, t in zip(a.pos, a.key, a.tokens)]
    held = sorted(w.buffer)
    spans = []
    for p in held[:3]:
        key, toks = w.span(p, w.buffer[p].done, len(w.buffer[p].tokens) - w.buffer[p].done - 1)
        spans.append([p, key, toks.tolist()])
        w.retire(p)
    if len(held) > 3:
        p = held[3]
        b = w.buffer[p]
        if len(b.tokens) - b.done > 3:
            key, toks = w.span(p, b.done, 2)
            spans.append([p, key, toks.tolist()])
    rest = sorted(w.buffer)
    cur = window_cursor(rest, {p: w.buffer[p].done for p in rest}, int(w.position or 0))
    return {"announced": ann, "spans": spans, "cursor": cur.to_json()}


def run(w: LoaderWindow, steps: int) -> list[dict]:
    try:
        return [step(w) for _ in range(steps)]
    finally:
        w.close()
        w.stream.close()


@pytest.mark.parametrize("parts", [1, 2])
def test_output_is_identical_for_1_2_and_4_workers(corpus, parts):
    data, tok = corpus
    ref = run(window(data, tok, 1, partition=parts - 1, parts=parts), 150)
    epochs = {int(key_epoch(k)) for s in ref for _, k, _ in s["spans"]}
    assert len(epochs) >= 2, "the run must cross an epoch boundary"
    for n in (2, 4):
        w = window(data, tok, n, partition=parts - 1, parts=parts)
        got = [step(w) for _ in range(150)]
        assert w.pipeline.peak_chunks > 1, "nothing was transformed ahead"
        q = w.transform.quarantine  # type: ignore[attr-defined]
        w.close()
        w.stream.close()
        for i, (a, b) in enumerate(zip(got, ref)):
            assert a == b, f"{n} workers: step {i} differs"
        ref_q = window(data, tok, 1, partition=parts - 1, parts=parts)
        run(ref_q, 150)
        assert q.messages() == ref_q.transform.quarantine.messages()  # type: ignore[attr-defined]
    if parts == 1:
        assert len(ref_q.transform.quarantine.messages()) == len(BAD_ROWS)  # type: ignore[attr-defined]


def test_a_window_resumed_from_its_cursor_with_other_workers_continues_exactly(corpus):
    data, tok = corpus
    ref = run(window(data, tok, 1), 60)
    for before, after, at in ((4, 2, 20), (1, 4, 33), (2, 1, 47)):
        w = window(data, tok, before)
        first = [step(w) for _ in range(at)]
        w.close()
        w.stream.close()
        assert [s["spans"] for s in first] == [s["spans"] for s in ref[:at]]
        fresh = window(data, tok, after)
        fresh.seek(first[-1]["cursor"])
        rest = run(fresh, 60 - at)
        assert [s["spans"] for s in rest] == [s["spans"] for s in ref[at:]], (before, after, at)
        assert [s["cursor"] for s in rest] == [s["cursor"] for s in ref[at:]]


def test_a_warm_seek_keeps_the_chunks_taken_ahead_and_announces_what_a_cold_one_does(corpus):
    data, tok = corpus
    warm = window(data, tok, 4)
    warm.read_ahead_tokens = 3000
    warm.seek({"low": 0})
    for _ in range(6):
        warm.read_ahead()
    assert warm.pipeline.in_flight > 0  # chunks taken ahead, not yet handed to the window
    assert warm.position is not None and warm.position < warm.stream.position
    cursor = {"low": 40, "next": 50, "skip": [41, 44], "partial": {"42": 2}}
    warm.seek(cursor)
    assert warm.warm_seeks == 1
    cold = window(data, tok, 1)
    cold.seek(cursor)
    assert run(warm, 20) == run(cold, 20)


CHILD = """
import json, os, sys
sys.path[:0] = [{src!r}, {root!r}]
from tests.unit.test_loader_workers import step, window
w = window({data!r}, {tok!r}, {workers})
with open({out!r}, "a") as f:
    for i in range(100000):
        f.write(json.dumps(step(w)) + "\\n")
        f.flush()
"""


def test_sigkill_mid_run_then_resume_from_the_cursor_with_other_workers_is_exact(corpus, tmp_path):
    """A real process reading with 4 workers is SIGKILLed while its threads are busy; a window with 2 workers
    resumed from the last cursor it wrote continues exactly as an unbroken 1-worker run."""
    data, tok = corpus
    out = tmp_path / "steps.jsonl"
    code = CHILD.format(src=str(ROOT / "src"), root=str(ROOT), data=data, tok=tok, workers=4, out=str(out))
    env = {**os.environ, "MIXPLANE_INDEX_CACHE": "", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not out.exists() or out.read_text().count("\n") < 25:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
            assert time.monotonic() < deadline, "the child wrote too few steps"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    lines = out.read_text().split("\n")
    done = [json.loads(x) for x in lines[:-1]]  # the last line may be cut by the kill
    k = len(done)
    ref = run(window(data, tok, 1), k + 30)
    assert done == ref[:k]
    fresh = window(data, tok, 2)
    fresh.seek(done[-1]["cursor"])
    rest = run(fresh, 30)
    assert [s["spans"] for s in rest] == [s["spans"] for s in ref[k:]]
    assert [s["cursor"] for s in rest] == [s["cursor"] for s in ref[k:]]


@pytest.mark.parametrize("workers", [1, 4])
def test_a_workers_error_is_raised_in_order_and_names_the_file_and_row(corpus, workers):
    """A transform that fails on one chunk (a bug in user code, a tokenizer that raises): the chunks before it
    are delivered, then its error is raised — its own message, plus the file and row of the chunk's rows."""
    data, tok = corpus
    src = source(data, tok, shuffle="sequential")
    inner = make_transform(src)

    def fails_at_row_100(raw):
        if (raw.keys == 100).any():
            raise TransformError("source 'w', column 'text': the tokenizer gave up")
        return inner(raw)

    p = TransformPipeline(open_stream(src, seed=5, cache_dir=None), fails_at_row_100, workers)
    got = [int(p.next(16)[0].keys[0]) for _ in range(6)]
    assert got == [0, 16, 32, 48, 64, 80]
    with pytest.raises(TransformError, match="the tokenizer gave up") as e:
        p.next(16)
    note = " ".join(e.value.__notes__)
    assert "stream positions 96..111" in note and f"file {data}/p0.parquet, row 96" in note, note
    assert p.in_flight == 0  # dropped: nothing after a failed chunk is handed out
    p.close()
    p.stream.close()


class FailingStream:
    """A real stream whose take fails on its 5th call (as a stream fails when every page of an epoch is bad)."""

    def __init__(self, stream):
        self.inner, self.calls = stream, 0
        self.name, self.live = stream.name, False

    @property
    def position(self) -> int:
        return self.inner.position

    def take(self, n: int, **kw) -> RawSamples:
        self.calls += 1
        if self.calls == 5:
            raise ValueError("page 3 of /data/x.parquet is unreadable")
        return self.inner.take(n, **kw)


def test_an_error_of_a_take_made_ahead_comes_when_its_chunk_is_asked_for(corpus):
    data, tok = corpus
    src = source(data, tok)
    stream = FailingStream(open_stream(src, seed=5, cache_dir=None))
    p = TransformPipeline(stream, make_transform(src), 4)  # type: ignore[arg-type]
    got = [len(p.next(16)[0]) for _ in range(4)]
    assert got == [16] * 4 and stream.calls >= 5  # the 5th take was made ahead and failed
    with pytest.raises(ValueError, match="page 3 of /data/x.parquet is unreadable"):
        p.next(16)
    p.close()
    stream.inner.close()


def test_chunks_in_flight_are_bounded_in_number_and_bytes(corpus):
    data, tok = corpus
    src = source(data, tok)
    inner = make_transform(src)
    running, most = [0], [0]
    lock = threading.Lock()

    def slow(raw):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        try:
            return inner(raw)
        finally:
            with lock:
                running[0] -= 1

    stream = open_stream(src, seed=5, cache_dir=None)
    p = TransformPipeline(stream, slow, 2, depth=3)
    for _ in range(40):
        p.next(32)
        assert p.in_flight <= 3
    assert p.peak_chunks == 3 and most[0] <= 2
    chunk = p.peak_bytes / 2  # raw bytes of one chunk of 32 rows, about
    assert chunk > 0
    # a byte bound below one chunk: one chunk beyond the one waited for, never more (but always one)
    q = TransformPipeline(stream, slow, 4, depth=8, max_bytes=1)
    for _ in range(20):
        q.next(32)
    assert q.peak_chunks == 2
    # a bound of ~3 chunks: the depth (8) is never reached, the bytes beyond the head stay under bound + one chunk
    r = TransformPipeline(stream, slow, 4, depth=8, max_bytes=int(3 * chunk))
    for _ in range(20):
        r.next(32)
    assert 3 <= r.peak_chunks <= 6 and r.peak_bytes <= 3 * chunk + 1.5 * chunk
    r.close()
    p.close()
    q.close()
    stream.close()


def test_auto_workers_follow_the_cores_the_process_may_use():
    assert resolve_workers(3) == 3
    assert resolve_workers("auto", cores=1) == 1
    assert resolve_workers("auto", cores=2.5) == 2
    assert resolve_workers("auto", cores=64) == MAX_AUTO_WORKERS
    assert 1 <= resolve_workers("auto") <= MAX_AUTO_WORKERS
    with pytest.raises(ValueError, match="workers must be >= 1"):
        resolve_workers(0)


def token_files(d: Path, files: int = 70, rows: int = 30) -> list[str]:
    """More files than a reader keeps open (64): decode threads read files the LRU opens and closes."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(3)
    paths = []
    for k in range(files):
        ids = [rng.integers(0, 5000, int(rng.integers(1, 60))).astype(np.int32) for _ in range(rows)]
        p = str(d / f"t{k:03d}.parquet")
        pq.write_table(pa.table({"ids": pa.array(ids, pa.list_(pa.int32()))}), p, data_page_size=512,
                       row_group_size=15, write_page_checksum=True, compression="zstd")
        paths.append(p)
    return paths


def corrupt_first_page(path: str) -> None:
    off = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    with open(path, "r+b") as f:
        f.seek(off + 40)  # inside the page's payload, past its header: the CRC check fails
        b = f.read(1)
        f.seek(off + 40)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("mode", ["page", "row", "rowgroup", "sequential"])
def test_pages_decoded_on_worker_threads_give_the_same_rows_and_quarantine(tmp_path, mode):
    paths = token_files(tmp_path / "t")
    corrupt_first_page(paths[7])
    out = {}
    for n in (1, 4):
        src = SourceSpec(name="t", uri=str(tmp_path / "t"), kind="tokens", columns=["ids"], shuffle=mode,
                         shuffle_buffer=300, workers=n)
        s = open_stream(src, seed=2, cache_dir=None)
        assert s.workers == n
        rows = []
        for _ in range(70):  # 4480 rows: past the end of the first epoch (2100 rows) and most of the second
            r = s.take(64)
            rows.append((r.keys.tolist(), r.positions.tolist(), r.columns["ids"].to_pylist()))
        out[n] = (rows, s.quarantine.messages(), s._decoders is not None)
        s.close()
    assert out[4][0] == out[1][0]
    assert out[4][1] == out[1][1] and len(out[1][1]) >= 1  # the bad page, named the same, in the same order
    assert f"{paths[7]}" in out[1][1][0]
    if mode in ("page", "row"):  # a take's new units come from many pages: they were decoded on the threads
        assert out[4][2]


def test_auto_reads_the_cgroup_cpu_quota(tmp_path):
    from mixplane.loader.workers import _cfs_quota, _cpu_max

    assert _cpu_max("max 100000\n", "cpu.max") is None  # no quota: the affinity decides
    assert _cpu_max("150000 100000\n", "cpu.max") == 1.5
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert _cfs_quota("250000\n", str(tmp_path / "cpu.cfs_quota_us")) == 2.5
    assert _cfs_quota("-1\n", str(tmp_path / "cpu.cfs_quota_us")) is None
    assert resolve_workers("auto", cores=1.5) == 1  # a pod limited to 1.5 cores: one worker thread
