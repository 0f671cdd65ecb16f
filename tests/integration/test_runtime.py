"""The embedded runtime end to end: processes, ZeroMQ, two ranks, real Parquet sources."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import yaml

from mixplane.client import MixtureLoader
from mixplane.runtime import EmbeddedRuntime
from mixplane.samples import key_epoch, key_row
from mixplane.spec import parse_spec
from tests.conftest import token_mixture, write_token_source

STEPS = 24


def fetch(endpoint: str, ranks: int, steps: int, states: dict | None = None, start: dict | None = None) -> dict[int, list[dict]]:
    """Each rank in its own thread, as trainer processes would; optionally resume from `start`."""
    out: dict[int, list[dict]] = {}
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            loader = MixtureLoader(endpoint, rank=r, max_steps=steps, timeout_s=60)
            if start is not None:
                loader.load_state_dict(start[r])
            got = []
            for b in loader:
                got.append({k: v.numpy().copy() for k, v in b.items()})
                if states is not None and int(b["step"]) == states.get("at"):
                    states.setdefault("saved", {})[r] = loader.state_dict()
            loader.close()
            out[r] = got
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    if errors:
        raise errors[0]
    return out


def as_client(sock, rt: EmbeddedRuntime):
    """Present the run's client key (a secured run, the default, admits no one else): hostile peers in
    these tests are authenticated trainers, the strongest case for the servers' own message checks."""
    from mixplane import wire

    setup = rt.curve_setup("client")
    if setup is not None:
        wire.curve_client(sock, setup.keys, setup.server_key("server"))
    return sock


@pytest.fixture(scope="module")
def run_result(token_sources, tmp_path_factory):
    doc = token_mixture(token_sources["root"], mixture={"weights": {"a": 0.5, "b": 0.3, "c": 0.2}, "seed": 7,
                                                        "phases": [{"start_step": 12, "weights": {"a": 0.1, "c": 0.7}, "lr_scale": 0.25}]})
    spec = parse_spec(doc)
    run_dir = tmp_path_factory.mktemp("run")
    with EmbeddedRuntime(spec, run_dir) as rt:
        pids = [c.proc.pid for c in rt.children]
        batches = fetch(rt.planner_endpoint, 2, STEPS)
        status = rt.status()
    return {"spec": spec, "batches": batches, "pids": pids, "status": status, "run_dir": run_dir}


def spans(b: dict) -> set[tuple[int, int, int]]:
    return set(zip(b["segment_source"].tolist(), b["segment_key"].tolist(), b["segment_start"].tolist()))


def test_every_step_delivers_exactly_the_global_batch(run_result, token_sources):
    spec = run_result["spec"]
    docs = token_sources["docs"]
    names = spec.source_names()
    for r in (0, 1):
        assert [int(b["step"]) for b in run_result["batches"][r]] == list(range(STEPS))
    for step in range(STEPS):
        rows = 0
        for r in (0, 1):
            b = run_result["batches"][r][step]
            assert b["input_ids"].shape == (4, 256)  # 8 sequences / 2 ranks
            rows += b["input_ids"].shape[0]
            # every token is the right token of the right document, and labels stay inside it
            for s, k, st, ln, row in zip(b["segment_source"], b["segment_key"], b["segment_start"], b["segment_len"], b["segment_row"]):
                doc = docs[names[s]][int(key_row(k))]
                ids = b["input_ids"][row]
                lab = b["labels"][row]
                srcs = b["source_ids"][row]
                where = np.flatnonzero((srcs == s) & (b["position_ids"][row] == 0))
                hit = [o for o in where if np.array_equal(ids[o : o + ln], doc[st : st + ln])]
                assert hit, f"step {step}: tokens of {names[s]}/{k}@{st} not found in row {row}"
                o = hit[0]
                assert np.array_equal(lab[o : o + ln - 1], doc[st + 1 : st + ln])
                expected_last = doc[st + ln] if st + ln < len(doc) else -100
                assert lab[o + ln - 1] == expected_last
                assert np.array_equal(b["position_ids"][row][o : o + ln], np.arange(ln))
            pad = b["source_ids"] < 0
            assert np.all(b["labels"][pad] == -100) and np.all(b["input_ids"][pad] == spec.batch.pad_id)
            # cu_seqlens covers the flattened rows, with a boundary at every row end
            cu = b["cu_seqlens"]
            assert cu[0] == 0 and cu[-1] == 4 * 256 and np.all(np.diff(cu) > 0)
            assert set(range(0, 4 * 256 + 1, 256)) <= set(cu.tolist())
        assert rows == spec.rows_per_step


def test_ranks_get_disjoint_samples(run_result):
    for step in range(STEPS):
        a = spans(run_result["batches"][0][step])
        b = spans(run_result["batches"][1][step])
        assert a and b and not (a & b)


def test_no_span_repeats(run_result):
    seen: set = set()
    for step in range(STEPS):
        for r in (0, 1):
            s = spans(run_result["batches"][r][step])
            assert not (seen & s), f"step {step}: repeated spans"
            seen |= s


def test_fractions_track_targets_and_phase_changes_at_its_step(run_result):
    names = run_result["spec"].source_names()
    tok = {0: np.zeros(3), 1: np.zeros(3)}
    for step in range(STEPS):
        for r in (0, 1):
            b = run_result["batches"][r][step]
            phase = 0 if step < 12 else 1
            assert int(b["phase"]) == phase and float(b["lr_scale"]) == (1.0 if phase == 0 else 0.25)
            src = b["source_ids"][b["source_ids"] >= 0]
            tok[phase] += np.bincount(src, minlength=3)
    f0 = tok[0] / tok[0].sum()
    f1 = tok[1] / tok[1].sum()
    assert np.allclose(f0, [0.5, 0.3, 0.2], atol=0.01), dict(zip(names, f0))
    assert np.allclose(f1, np.array([0.1, 0.3, 0.7]) / 1.1, atol=0.01), dict(zip(names, f1))


def test_shutdown_leaves_no_process(run_result):
    for pid in run_result["pids"]:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_journal_records_every_step(run_result):
    from mixplane.planner.journal import read_journal

    recs = read_journal(Path(run_result["run_dir"]) / "journal.jsonl")
    assert recs[0]["event"] == "open" and recs[0]["step"] == 0
    steps = [r["step"] for r in recs if r["event"] == "step"]
    assert steps[:STEPS] == list(range(STEPS))
    assert any(r["event"] == "checkpoint" and r["step"] == 0 for r in recs)


def test_resume_mid_run_equals_uninterrupted_run(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "full") as rt:
        states: dict = {"at": 9}
        full = fetch(rt.planner_endpoint, 2, 20, states=states)
    saved = states["saved"]
    assert saved[0] == saved[1]  # the data-plane state is global: every rank saves the same
    with EmbeddedRuntime(spec, tmp_path / "resumed") as rt:
        resumed = fetch(rt.planner_endpoint, 2, 20, start=saved)
    for r in (0, 1):
        assert [int(b["step"]) for b in resumed[r]] == list(range(10, 20))
        for a, b in zip(full[r][10:], resumed[r]):
            assert a.keys() == b.keys()
            for k in a:
                assert np.array_equal(a[k], b[k]), (r, int(a["step"]), k)


def test_epochs_do_not_repeat_samples(tmp_path):
    """A tiny source wraps around several times: within an epoch every document is delivered once, whole."""
    docs = write_token_source(tmp_path / "tiny", rows=60, files=2, mean_len=40, seed=5, rows_per_group=16)
    big = write_token_source(tmp_path / "big", rows=2000, files=1, mean_len=40, seed=6)
    doc = {
        "name": "epochs",
        "sources": [{"name": "tiny", "uri": str(tmp_path / "tiny"), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"},
                    {"name": "big", "uri": str(tmp_path / "big"), "kind": "tokens", "columns": ["tokens"], "shuffle": "rowgroup"}],
        "mixture": {"weights": {"tiny": 0.5, "big": 0.5}},
        "batch": {"sequences": 4, "seq_len": 128, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}}, "strategy": {"name": "vanilla"},
        "runtime": {"window": 8, "metrics": False},
    }
    spec = parse_spec(doc)
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        got = fetch(rt.planner_endpoint, 2, 30)
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r in (0, 1):
        for b in got[r]:
            for s, k, st, ln in zip(b["segment_source"], b["segment_key"], b["segment_start"], b["segment_len"]):
                if s == 0:
                    covered.setdefault((int(key_epoch(k)), int(key_row(k))), []).append((int(st), int(ln)))
    epochs = sorted({e for e, _ in covered})
    assert len(epochs) >= 3, "the test should wrap the tiny source several times"
    for e in epochs[:-1]:  # every complete epoch: each row exactly once, covered exactly
        rows = sorted(r for ep, r in covered if ep == e)
        assert rows == list(range(60)), f"epoch {e}"
        for r in rows:
            pieces = sorted(covered[(e, r)])
            assert sum(l for _, l in pieces) == len(docs[r]) and pieces[0][0] == 0


def test_cli_run_stops_cleanly_on_sigterm(token_sources, tmp_path, monkeypatch):
    f = tmp_path / "mix.yaml"
    f.write_text(yaml.safe_dump(token_mixture(token_sources["root"])))
    proc = subprocess.Popen([sys.executable, "-m", "mixplane.cli", "run", str(f), "--run-dir", str(tmp_path / "run")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "export MIXPLANE_CURVE_DIR=" in line:  # printed after the planner line: a run is secured by default
            break
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 1 + 2 + 3, lines  # planner, 2 constructors, 3 loaders
    endpoint = next(ln for ln in lines if "export MIXPLANE_PLANNER=" in ln).split("export MIXPLANE_PLANNER=")[1].split(")")[0]
    monkeypatch.setenv("MIXPLANE_CURVE_DIR", line.split("export MIXPLANE_CURVE_DIR=")[1].split(";")[0])
    assert os.environ["MIXPLANE_CURVE_DIR"] == str(tmp_path / "run" / "keys")
    got = fetch(endpoint, 2, 3)
    assert len(got[0]) == 3
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "mixplane: stopped" in out
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


def test_garbage_on_sockets_does_not_disturb_delivery(token_sources, tmp_path):
    """Random frames at the planner and a constructor are dropped; the next batches are still exact."""
    import zmq

    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "ok") as rt:
        ref = fetch(rt.planner_endpoint, 2, 6)
    with EmbeddedRuntime(spec, tmp_path / "noisy") as rt:
        ctx = zmq.Context.instance()
        rng = np.random.default_rng(0)
        targets = [rt.planner_endpoint, rt.endpoints()["components"]["constructor-0"]["client_endpoint"]]
        for ep in targets:
            s = as_client(ctx.socket(zmq.DEALER), rt)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            for _ in range(50):
                s.send_multipart([rng.bytes(int(n)) for n in rng.integers(0, 64, rng.integers(1, 4))])
            s.send_multipart([b"MXPL\x01\x09\x00\x00\x00\x00\x00\x05{}"])  # meta length lies
            time.sleep(0.2)
            s.close(0)
        got = fetch(rt.planner_endpoint, 2, 6)
        assert not rt.dead()
    for r in (0, 1):
        for a, b in zip(ref[r], got[r]):
            for k in a:
                assert np.array_equal(a[k], b[k])


@pytest.mark.parametrize("step,rank", [(0, 0), (13, 1), (STEPS - 1, 0)])
def test_replay_rebuilds_what_a_rank_received(run_result, step, rank, tmp_path):
    from mixplane.replay import replay_step

    out = replay_step(run_result["spec"], step=step, rank=rank, run_dir=str(run_result["run_dir"]), save=str(tmp_path / "b.npz"))
    assert out["digest_match"], out
    saved = np.load(tmp_path / "b.npz")
    delivered = run_result["batches"][rank][step]
    for k in saved.files:
        assert np.array_equal(saved[k], delivered[k]), k


def test_every_component_serves_prometheus_metrics(token_sources, tmp_path):
    import urllib.request

    spec = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": True}))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        fetch(rt.planner_endpoint, 2, 5)
        comps = rt.endpoints()["components"]

        def scrape(name: str) -> str:
            port = comps[name]["metrics_port"]
            return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

        planner = scrape("planner")
        steps = float(next(l.split()[-1] for l in planner.splitlines() if l.startswith("mixplane_planner_steps_planned_total")))
        assert steps >= 5
        assert 'mixplane_planner_target_fraction{source="a"} 0.5' in planner
        assert "mixplane_planner_realized_fraction" in planner and "mixplane_planner_packing_efficiency" in planner
        loader = scrape("loader-b-0")
        assert 'mixplane_loader_samples_read_total{source="b"}' in loader and "mixplane_loader_quarantined_pages_total" in loader
        cons = scrape("constructor-1")
        built = float(next(l.split()[-1] for l in cons.splitlines() if l.startswith("mixplane_constructor_steps_total")))
        assert built >= 5


def test_corrupt_page_is_quarantined_and_counted_while_delivery_goes_on(tmp_path):
    import urllib.request

    docs_ok = write_token_source(tmp_path / "ok", rows=800, files=1, mean_len=80, seed=11)
    docs_bad = write_token_source(tmp_path / "bad", rows=200, files=2, mean_len=80, seed=12, rows_per_group=25,
                                  page_checksum=True)
    victim = sorted((tmp_path / "bad").glob("*.parquet"))[0]
    raw = bytearray(victim.read_bytes())
    mid = len(raw) // 3
    raw[mid : mid + 64] = bytes(64)  # zero out bytes inside a data page
    victim.write_bytes(bytes(raw))
    doc = {
        "name": "corrupt",
        "sources": [{"name": "ok", "uri": str(tmp_path / "ok"), "kind": "tokens", "columns": ["tokens"]},
                    {"name": "bad", "uri": str(tmp_path / "bad"), "kind": "tokens", "columns": ["tokens"]}],
        "mixture": {"weights": {"ok": 0.5, "bad": 0.5}},
        "batch": {"sequences": 4, "seq_len": 256, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 2}}}, "strategy": {"name": "vanilla"},
        "runtime": {"window": 16},
    }
    spec = parse_spec(doc)
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        got = fetch(rt.planner_endpoint, 2, 60)  # more than an epoch of the bad source
        port = rt.endpoints()["components"]["loader-bad-0"]["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert not rt.dead()
    line = next(l for l in text.splitlines() if l.startswith('mixplane_loader_quarantined_pages_total{source="bad"}'))
    assert float(line.split()[-1]) >= 1
    docs = {0: docs_ok, 1: docs_bad}
    for r in (0, 1):
        for b in got[r]:
            for s, k, st, ln, row in zip(b["segment_source"], b["segment_key"], b["segment_start"], b["segment_len"], b["segment_row"]):
                doc_tokens = docs[int(s)][int(key_row(k))]
                ids = b["input_ids"][row]
                assert any(np.array_equal(ids[o : o + ln], doc_tokens[st : st + ln])
                           for o in np.flatnonzero(b["position_ids"][row] == 0)), "delivered tokens differ from the source"


def test_live_source_blocks_when_dry_and_resumes_when_files_arrive(tmp_path):
    import shutil

    write_token_source(tmp_path / "static", rows=3000, files=1, mean_len=60, seed=21)
    staging = tmp_path / "staging"
    write_token_source(staging, rows=300, files=3, mean_len=60, seed=22)
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    parts = sorted(staging.glob("*.parquet"))
    shutil.copy(parts[0], live_dir / parts[0].name)
    doc = {
        "name": "live",
        "sources": [{"name": "static", "uri": str(tmp_path / "static"), "kind": "tokens", "columns": ["tokens"]},
                    {"name": "fresh", "uri": str(live_dir / "*.parquet"), "kind": "tokens", "columns": ["tokens"], "live": True}],
        "mixture": {"weights": {"static": 0.5, "fresh": 0.5}},
        "batch": {"sequences": 4, "seq_len": 256, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}}, "strategy": {"name": "vanilla"},
        "runtime": {"window": 8, "window_tokens": 600},
    }
    spec = parse_spec(doc)
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        loader = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=3, prefetch=0)
        delivered = 0
        from mixplane.client import DeliveryError

        with pytest.raises(DeliveryError, match="not delivered"):
            while True:  # 100 rows of ~60 tokens: the live source runs dry after a few steps
                next(loader)
                delivered += 1
        assert delivered >= 1
        st = rt.status()
        assert "fresh/0" in st["waiting"]  # blocked on the dry source, not failed
        assert not rt.dead()
        for p in parts[1:]:
            shutil.copy(p, live_dir / p.name)
        loader.close()
        loader = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=30, prefetch=0)
        loader.next_step = delivered  # continue where the blocked request was
        b = next(loader)
        assert int(b["step"]) == delivered and (b["source_ids"] == 1).any()
        loader.close()


def test_runtime_mixture_update_takes_effect_at_its_step_and_replays(token_sources, tmp_path):
    from mixplane.replay import replay_step

    spec = parse_spec(token_mixture(token_sources["root"], batch={"sequences": 16, "seq_len": 256, "microbatches": 2}))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        first = fetch(rt.planner_endpoint, 2, 4)
        assert int(first[0][-1]["phase"]) == 0
        too_early = subprocess.run([sys.executable, "-m", "mixplane.cli", "update", "--planner", rt.planner_endpoint,
                                    "--step", "1", "--weight", "a=1"], capture_output=True, text=True, timeout=30)
        assert too_early.returncode == 1 and "already planned" in too_early.stderr
        r = subprocess.run([sys.executable, "-m", "mixplane.cli", "update", "--planner", rt.planner_endpoint,
                            "--step", "12", "--weight", "a=0.1", "--weight", "c=0.6", "--lr-scale", "0.5"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        ranks = {}
        for rank in (0, 1):
            loader = MixtureLoader(rt.planner_endpoint, rank=rank, timeout_s=60, max_steps=30)
            loader.next_step = 4
            ranks[rank] = [{k: v.numpy().copy() for k, v in b.items()} for b in loader]
            loader.close()
    tok = np.zeros(3)
    for rank in (0, 1):
        for b in ranks[rank]:
            step = int(b["step"])
            # a runtime update keeps the spec's phase id (0: no phases); its lr_scale shows where it starts
            assert int(b["phase"]) == 0 and float(b["lr_scale"]) == (0.5 if step >= 12 else 1.0)
            assert int(b["generation"]) == (1 if step >= 12 else 0)  # the update is named by its generation
            if step >= 12:
                tok += np.bincount(b["source_ids"][b["source_ids"] >= 0], minlength=3)
    assert np.allclose(tok / tok.sum(), np.array([0.1, 0.3, 0.6]), atol=0.01)
    out = replay_step(spec, step=20, rank=1, run_dir=str(tmp_path / "run"))
    assert out["digest_match"] and out["phase"] == 0 and out["lr_scale"] == 0.5 and out["generation"] == 1


def test_ranks_resuming_at_different_times_restart_delivery_once(token_sources, tmp_path, monkeypatch):
    """Ranks of one relaunch share an attempt id: the first resume restarts delivery, later ones join it."""
    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "full") as rt:
        states: dict = {"at": 9}
        full = fetch(rt.planner_endpoint, 2, 20, states=states)
    monkeypatch.setenv("MIXPLANE_RESUME_ID", "job-7/restart-1")
    with EmbeddedRuntime(spec, tmp_path / "resumed") as rt:
        early = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=60, max_steps=20)
        early.load_state_dict(states["saved"][0])
        got0 = [{k: v.numpy().copy() for k, v in next(early).items()} for _ in range(5)]  # rank 0 runs ahead
        late = MixtureLoader(rt.planner_endpoint, rank=1, timeout_s=60, max_steps=20)  # rank 1 resumes later
        late.load_state_dict(states["saved"][1])
        got1 = [{k: v.numpy().copy() for k, v in b.items()} for b in late]
        got0 += [{k: v.numpy().copy() for k, v in b.items()} for b in early]
        early.close()
        late.close()
        assert rt.status()["session"] == 1  # one restart for the whole relaunch
    for r, got in ((0, got0), (1, got1)):
        assert [int(b["step"]) for b in got] == list(range(10, 20))
        for a, b in zip(full[r][10:], got):
            assert all(np.array_equal(a[k], b[k]) for k in a)


def test_source_grouping_delivers_the_same_batches(token_sources, tmp_path):
    """Three Source Loaders in one process (runtime.sources_per_loader) plan and deliver exactly what
    one process per source does."""
    spec = parse_spec(token_mixture(token_sources["root"]))
    grouped = parse_spec(token_mixture(token_sources["root"], runtime={"window": 64, "metrics": False, "sources_per_loader": 3}))
    with EmbeddedRuntime(spec, tmp_path / "apart") as rt:
        ref = fetch(rt.planner_endpoint, 2, 8)
    with EmbeddedRuntime(grouped, tmp_path / "together") as rt:
        names = [c.name for c in rt.children]
        got = fetch(rt.planner_endpoint, 2, 8)
    assert sum(n.startswith("loader") for n in names) == 1, names
    for r in (0, 1):
        for a, b in zip(ref[r], got[r]):
            assert all(np.array_equal(a[k], b[k]) for k in a)


def test_a_malformed_resume_is_refused_and_the_run_goes_on(token_sources, tmp_path):
    from mixplane.control import request
    from mixplane.wire import Kind

    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        first = fetch(rt.planner_endpoint, 2, 3)
        for bad in ({"step": 2}, {"step": 2, "windows": [{"source": 0, "replica": 0, "low": 0, "partial": [1]}],
                                  "sampler": {}, "schedule": {}}):
            with pytest.raises(RuntimeError, match="cannot resume"):
                request(rt.planner_endpoint, Kind.RESUME, {"cursor": bad})
        st = rt.status()
        assert st["session"] == 0 and not rt.dead()
        more = []
        for r in (0, 1):
            loader = MixtureLoader(rt.planner_endpoint, rank=r, timeout_s=60, max_steps=6)
            loader.next_step = 3
            more.append([int(b["step"]) for b in loader])
            loader.close()
    assert more == [[3, 4, 5], [3, 4, 5]] and len(first[0]) == 3


def test_a_request_far_in_the_future_is_refused_not_planned(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        from mixplane.client import DeliveryError

        loader = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=30, prefetch=0)
        loader.next_step = 1_000_000
        with pytest.raises(DeliveryError, match="max_lead_steps"):
            next(loader)
        loader.close()
        assert rt.status()["planned_through"] < 100
        got = fetch(rt.planner_endpoint, 2, 3)  # and the run is fine
        assert [int(b["step"]) for b in got[1]] == [0, 1, 2]


def test_client_configured_by_mesh_coordinates(token_sources, tmp_path):
    """coords={dp, pp, cp, tp} instead of RANK: the planner maps them to the global rank; bad ones are refused."""
    from mixplane.client import DeliveryError
    from mixplane.topology import backbone_rank

    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        want = backbone_rank(spec, {"dp": 1})
        by_rank = MixtureLoader(rt.planner_endpoint, rank=want, timeout_s=60, max_steps=2)
        by_coords = MixtureLoader(rt.planner_endpoint, coords={"dp": 1}, timeout_s=60, max_steps=2)
        a, b = list(by_rank), list(by_coords)
        assert by_coords.rank == want and by_coords.coords["dp"] == 1
        assert len(a) == len(b) == 2 and all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
        by_rank.close()
        by_coords.close()
        bad = MixtureLoader(rt.planner_endpoint, coords={"dp": 5}, timeout_s=20, max_steps=1)
        with pytest.raises(DeliveryError, match=r"route refused .*coordinate dp=5 outside 0\.\.1"):
            next(bad)
        bad.close()
    with pytest.raises(ValueError, match="rank= or coords="):
        MixtureLoader("tcp://127.0.0.1:9", rank=0, coords={"dp": 0})


def test_overlong_drop_leaves_long_documents_out_and_counts_them(tmp_path):
    """batch.overlong: drop — no delivered span comes from a document longer than seq_len, every
    delivered document is whole, and the loader counts what it dropped; replay agrees."""
    import urllib.request

    from mixplane.replay import replay_step

    docs = write_token_source(tmp_path / "d", rows=600, files=1, mean_len=60, seed=21)
    S = 128
    assert sum(len(d) > S for d in docs) > 20  # the source has plenty of over-long documents
    spec = parse_spec({
        "name": "drop", "sources": [{"name": "d", "uri": str(tmp_path / "d"), "kind": "tokens", "columns": ["tokens"]}],
        "batch": {"sequences": 4, "seq_len": S, "microbatches": 1, "overlong": "drop"},
        "topology": {"modules": {"backbone": {"dp": 2}}}, "runtime": {"window": 16},
    })
    with EmbeddedRuntime(spec, tmp_path / "run") as rt:
        got = fetch(rt.planner_endpoint, 2, 10)
        port = rt.endpoints()["components"]["loader-d-0"]["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    delivered = 0
    for r in (0, 1):
        for b in got[r]:
            for k, st, ln in zip(b["segment_key"], b["segment_start"], b["segment_len"]):
                doc = docs[int(key_row(k))]
                assert len(doc) <= S and int(st) == 0 and int(ln) == len(doc)
                delivered += 1
    assert delivered > 20
    line = next(l for l in text.splitlines() if l.startswith('mixplane_loader_dropped_overlong_total{source="d"}'))
    assert float(line.split()[-1]) >= 1
    out = replay_step(spec, step=7, rank=1, run_dir=str(tmp_path / "run"))
    assert out["digest_match"]
