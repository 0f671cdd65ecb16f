"""The constructor and client end to end with the embedded runtime (processes + ZeroMQ on 127.0.0.1).

Token ids encode (source, document, position), so every delivered token can be checked: packed rows
hold consecutive positions of one document per cu_seqlens segment, labels never cross a document,
CP shards / PP stages / TP copies are exactly the parts of one batch, and resuming from any
state_dict continues exactly like the uninterrupted run (across epoch boundaries).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from mixplane.client import MixtureLoader, microbatches
from mixplane.parallelism import cp_merge, zigzag_index
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from tests.integration.test_runtime import as_client

pytestmark = pytest.mark.timeout(240)


def token(source: int, doc: int, pos: int) -> int:
    return source * 10_000_000 + doc * 1_000 + pos + 1


def make_sources(tmp, n_sources: int, docs: int, max_len: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    paths = []
    for s in range(n_sources):
        lens = rng.integers(3, max_len, size=docs)
        rows = [[token(s, d, p) for p in range(int(n))] for d, n in enumerate(lens)]
        p = tmp / f"src{s}.parquet"
        pq.write_table(pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int32()))}), p, row_group_size=16)
        paths.append(str(p))
    return paths


def spec_for(paths, tmp, *, seq_len, sequences, topo, options=None, microbatches=1, window=32, strategy="vanilla"):
    return parse_spec({
        "name": "transport-test",
        "sources": [{"name": f"s{i}", "uri": p, "kind": "tokens", "columns": ["tokens"]} for i, p in enumerate(paths)],
        "batch": {"sequences": sequences, "seq_len": seq_len, "microbatches": microbatches},
        "topology": {"modules": {"backbone": topo}},
        "strategy": {"name": strategy, "options": options or {}},
        "runtime": {"window": window, "metrics": False, "run_dir": str(tmp / "run"), "step_timeout_s": 60},
    })


def check_rows(input_ids: np.ndarray, labels: np.ndarray, position_ids: np.ndarray, cu: np.ndarray, S: int) -> int:
    """Every segment is consecutive positions of one document; labels stay inside it. Returns real tokens."""
    flat_in, flat_lab, flat_pos = input_ids.reshape(-1), labels.reshape(-1), position_ids.reshape(-1)
    real = 0
    for a, b in zip(cu[:-1], cu[1:]):
        seg = flat_in[a:b]
        if seg[0] == 0:  # padding segment
            assert np.all(seg == 0) and np.all(flat_lab[a:b] == -100)
            continue
        assert a // S == (b - 1) // S, "a segment crosses a row"
        src, doc = seg // 10_000_000, (seg % 10_000_000) // 1_000
        assert np.all(src == src[0]) and np.all(doc == doc[0]), "a segment mixes documents"
        assert np.all(np.diff(seg) == 1), "tokens of a segment are not consecutive"
        assert np.array_equal(flat_pos[a:b], np.arange(b - a))
        lab = flat_lab[a:b]
        assert np.array_equal(lab[:-1], seg[1:])
        # the last label is the document's true next token, or ignored at the document's end
        assert lab[-1] == -100 or lab[-1] == seg[-1] + 1
        real += b - a
    return real


@pytest.fixture(scope="module")
def parallel_runtime(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("par")
    paths = make_sources(tmp, 2, docs=60, max_len=150)
    spec = spec_for(paths, tmp, seq_len=64, sequences=4, topo={"dp": 1, "pp": 2, "cp": 2, "tp": 2},
                    strategy="llm_balance", options={"broadcast": ["TP"]}, microbatches=2)
    spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"metrics": True})})  # build counts
    with EmbeddedRuntime(spec, tmp / "run", log_level="WARNING") as rt:
        yield spec, rt


def constructor_metric(rt, name: str, constructor: str = "constructor-0") -> float:
    import urllib.request

    port = rt.endpoints()["components"][constructor]["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(next(l.split()[-1] for l in text.splitlines() if l.startswith(name + " ")))


def test_cp_pp_tp_views_are_exact_parts_of_one_batch(parallel_runtime):
    spec, rt = parallel_runtime
    from mixplane.topology import backbone_coords

    world = spec.world_size
    loaders = [MixtureLoader(rt.planner_endpoint, rank=r, prefetch=1, timeout_s=60, max_steps=3) for r in range(world)]
    coords = [backbone_coords(spec, r) for r in range(world)]
    S = spec.batch.seq_len
    built0 = constructor_metric(rt, "mixplane_constructor_steps_total")
    sent0 = constructor_metric(rt, "mixplane_constructor_bytes_sent_total")
    received = 0
    try:
        for step in range(3):
            got = [next(l) for l in loaders]
            received += sum(v.numel() * v.element_size() for b in got if not bool(b["meta_only"]) for k, v in b.items()
                            if v.dim() > 0)
            for b in got:
                assert int(b["step"]) == step
            by = {(c.cp, c.pp, c.tp): b for c, b in zip(coords, got)}
            # TP: tp = 1 ranks get no data, only empty buffers of the right shapes
            for (cp, pp, tp), b in by.items():
                if tp == 1:
                    assert bool(b["meta_only"])
                    assert set(b) == set(by[(cp, pp, 0)])
                    for k, v in by[(cp, pp, 0)].items():
                        assert b[k].shape == v.shape and b[k].dtype == v.dtype
                else:
                    assert not bool(b["meta_only"])
            # PP: first stage inputs, last stage labels
            first, last = by[(0, 0, 0)], by[(0, 1, 0)]
            assert "input_ids" in first and "labels" not in first
            assert "labels" in last and "input_ids" not in last
            assert torch.equal(first["cu_seqlens"], last["cu_seqlens"])
            # CP: the two zig-zag shards merge back to full rows
            shards_in = [{k: by[(cp, 0, 0)][k].numpy() for k in ("input_ids", "position_ids", "cp_token_index")} for cp in (0, 1)]
            shards_lab = [{k: by[(cp, 1, 0)][k].numpy() for k in ("labels", "source_ids", "cp_token_index")} for cp in (0, 1)]
            assert shards_in[1]["cp_token_index"].tolist() == zigzag_index(S, 2, 1).tolist()
            full_in, full_lab = cp_merge(shards_in), cp_merge(shards_lab)
            cu = first["cu_seqlens"].numpy()
            real = check_rows(full_in["input_ids"], full_lab["labels"], full_in["position_ids"], cu, S)
            assert real > 0.5 * 4 * S  # best-fit packing fills rows
            # microbatches of any stage line up
            mbs = list(microbatches(last))
            assert len(mbs) == 2 and all(m["labels"].shape == (2, S // 2) for m in mbs)
            assert all(int(m["cu_seqlens"][-1]) == 2 * S for m in mbs)
        # one batch per DP rank (dp = 1) per step for all 8 CP x PP x TP ranks; the views are slices of it,
        # and metadata-only TP ranks cost no tensor bytes
        assert constructor_metric(rt, "mixplane_constructor_steps_total") - built0 == 3
        assert constructor_metric(rt, "mixplane_constructor_bytes_sent_total") - sent0 == received
    finally:
        for l in loaders:
            l.close()


@pytest.fixture(scope="module")
def resume_runtime(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    # a small dataset: the run below goes through it several times (epoch boundaries inside)
    paths = make_sources(tmp, 3, docs=12, max_len=40, seed=3)
    spec = spec_for(paths, tmp, seq_len=32, sequences=4, topo={"dp": 2}, window=8)
    with EmbeddedRuntime(spec, tmp / "run", log_level="WARNING") as rt:
        total = sum(pq.read_table(p).column("tokens").combine_chunks().flatten().__len__() for p in paths)
        yield spec, rt, total


STEPS = 14


def _run(rt, world, start_state=None, steps=STEPS, prefetch=2):
    out, states = [], []
    loaders = [MixtureLoader(rt.planner_endpoint, rank=r, prefetch=prefetch, timeout_s=60) for r in range(world)]
    try:
        if start_state is not None:
            for l, s in zip(loaders, start_state):
                l.load_state_dict(s)
        first = loaders[0].next_step
        states.append([l.state_dict() for l in loaders])
        for _ in range(first, steps):
            out.append([{k: v.clone() for k, v in next(l).items()} for l in loaders])
            states.append([l.state_dict() for l in loaders])
    finally:
        for l in loaders:
            l.close()
    return out, states


@pytest.fixture(scope="module")
def reference(resume_runtime):
    spec, rt, total = resume_runtime
    out, states = _run(rt, spec.world_size)
    delivered = sum(int((b["labels"] != -100).sum() + 0) for step in out for b in step)
    assert delivered > 2 * total, "the run should cross several epoch boundaries"
    return out, states


def _equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


_CACHE: dict = {}


@pytest.fixture(scope="module")
def resume_case(resume_runtime, reference):
    _CACHE["rt"], _CACHE["ref"] = resume_runtime, reference
    yield
    _CACHE.clear()


@pytest.mark.usefixtures("resume_case")
@settings(max_examples=6, deadline=None)
@given(k=st.integers(0, STEPS - 1), prefetch=st.sampled_from([0, 1, 3]))
def test_resume_at_any_step_equals_the_uninterrupted_run(k, prefetch):
    (spec, rt, _), (ref, states) = _CACHE["rt"], _CACHE["ref"]
    out, _ = _run(rt, spec.world_size, start_state=states[k], prefetch=prefetch)
    assert len(out) == STEPS - k
    for got, want in zip(out, ref[k:]):
        for g, w in zip(got, want):
            _equal(g, w)


def test_resume_twice_from_the_same_state(resume_runtime, reference):
    spec, rt, _ = resume_runtime
    ref, states = reference
    a, _ = _run(rt, spec.world_size, start_state=states[5], steps=9)
    b, _ = _run(rt, spec.world_size, start_state=states[5], steps=9)
    for x, y, w in zip(a, b, ref[5:9]):
        for g, h, r in zip(x, y, w):
            _equal(g, h)
            _equal(g, r)


def test_state_dict_is_plain_data(reference):
    import json

    _, states = reference
    s = states[3][0]
    assert json.loads(json.dumps(s)) == s  # checkpointable without pickle


def _junk(rnd) -> list[bytes]:
    import json as _json

    from mixplane import wire
    from mixplane.wire import Kind

    choice = rnd.randrange(7)
    if choice == 0:
        return [rnd.randbytes(rnd.randrange(0, 64)) for _ in range(rnd.randrange(1, 4))]
    if choice == 1:  # a valid header of a random kind with random meta
        kind = rnd.choice(list(Kind))
        return wire.encode(kind, {"step": rnd.choice([0, -1, 2**62, "x", None]), "rank": rnd.choice([0, 99, -5, "r"]),
                                  "session": rnd.choice([0, 1, 7])})
    if choice == 2:  # GET_STEP for ranks / steps it must refuse
        return wire.encode(Kind.GET_STEP, {"step": rnd.choice([-3, 0, 10**9]), "rank": rnd.choice([-1, 8, 10**6])})
    if choice == 3:  # a header claiming buffers that are missing or wrong
        body = _json.dumps({"arrays": [["key", "<i8", [rnd.randrange(100)]]]}).encode()
        return [wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Kind.SAMPLES), 0, len(body)) + body]
    if choice == 4:  # SAMPLES with inconsistent arrays
        import numpy as _np
        return wire.encode(Kind.SAMPLES, {"session": 0, "step": 1, "source": 0},
                           {"key": _np.arange(3), "start": _np.zeros(2, _np.int64), "len": _np.ones(3, _np.int64),
                            "offsets": _np.array([0, 5]), "values": _np.zeros(2, _np.int32)})
    if choice == 5:
        return [b"MXPL" + rnd.randbytes(rnd.randrange(0, 30))]
    return [b""]


def test_fuzzing_the_constructor_sockets_breaks_nothing(parallel_runtime):
    import random

    import zmq

    spec, rt = parallel_runtime
    info = rt.endpoints()["components"]["constructor-0"]
    ctx = zmq.Context()
    rnd = random.Random(4)
    socks = []
    try:
        for ep, typ in ((info["client_endpoint"], zmq.DEALER), (info["data_endpoint"], zmq.PUSH)):
            s = as_client(ctx.socket(typ), rt)
            s.linger = 0
            s.connect(ep)
            socks.append(s)
        for _ in range(400):
            rnd.choice(socks).send_multipart(_junk(rnd))
        # the constructor still serves correct data to every rank
        world = spec.world_size
        loaders = [MixtureLoader(rt.planner_endpoint, rank=r, prefetch=1, timeout_s=60, max_steps=2) for r in range(world)]
        try:
            for _ in range(2):
                for l in loaders:
                    b = next(l)
                    if "input_ids" in b and not bool(b["meta_only"]):
                        assert int(b["input_ids"].min()) >= 0
        finally:
            for l in loaders:
                l.close()
        # the fuzzing client got only well-formed answers
        from mixplane import wire
        from mixplane.wire import Kind

        while socks[0].poll(200):
            _, m = wire.recv(socks[0])
            assert m.kind in (Kind.ERROR, Kind.HEARTBEAT, Kind.STEP_DATA)  # a valid GET_STEP is answered
        assert not rt.dead(), rt.dead()
    finally:
        ctx.destroy(linger=0)


def test_curve_end_to_end_with_allowlist(tmp_path, monkeypatch):
    from mixplane import wire
    from mixplane.client import DeliveryError

    paths = make_sources(tmp_path, 2, docs=20, max_len=50)
    keys = tmp_path / "keys"
    spec = spec_for(paths, tmp_path, seq_len=32, sequences=2, topo={"dp": 1})
    spec = spec.model_copy(update={"runtime": spec.runtime.model_copy(update={
        "curve": spec.runtime.curve.model_copy(update={"enabled": True, "key_dir": str(keys)})})})
    with EmbeddedRuntime(spec, tmp_path / "run", log_level="WARNING") as rt:
        assert (keys / "server.key_secret").exists() and (keys / "client.key").exists()
        ok = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=30, max_steps=2,
                           curve=wire.CurveSetup.from_dir(keys, "client"))
        batches = list(ok)
        assert len(batches) == 2 and int(batches[1]["step"]) == 1
        ok.close()
        assert rt.status()["planned_through"] >= 1
        # a key pair that is not in the key directory is refused by the ZAP handler
        stranger = wire.generate_keys(tmp_path / "elsewhere", "stranger")
        bad = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=1.0, max_steps=1,
                            curve=wire.CurveSetup(stranger, key_dir=str(keys)))
        with pytest.raises(DeliveryError, match=f"no answer to route from the planner at {rt.planner_endpoint}"):
            next(bad)
        bad.close()
        with monkeypatch.context() as m:
            m.delenv("MIXPLANE_CURVE_DIR")  # the runtime exported it for in-process trainers
            plain = MixtureLoader(rt.planner_endpoint, rank=0, timeout_s=1.0, max_steps=1)
        with pytest.raises(DeliveryError, match="no answer to route"):
            next(plain)
        plain.close()
        assert not rt.dead()
