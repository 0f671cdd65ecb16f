"""A loader's Prometheus counters follow what its stream and transform quarantined."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mixplane.loader.server import LoaderServer
from mixplane.loader.stream import open_stream
from mixplane.samples import key_row
from mixplane.spec import parse_spec
from tests.integration.test_transport_multimodal import P, _images, _tokenizer


def _counter(m, name: str, source: str) -> float:
    return m.registry.get_sample_value(name, {"source": source}) or 0.0


def test_undecodable_images_are_counted_in_the_loader_metrics(tmp_path):
    rng = np.random.default_rng(5)
    _tokenizer(tmp_path / "tok.json")
    n = 100
    images, _ = _images(n, rng)
    bad = set(range(0, n, 7))
    images = [b"\x89PNG broken" if i in bad else im for i, im in enumerate(images)]
    pq.write_table(pa.table({"image": pa.array(images, pa.binary()), "caption": ["a cat"] * n}),
                   tmp_path / "vl.parquet", row_group_size=10)
    spec = parse_spec({
        "name": "bad-images",
        "sources": [{"name": "vl", "uri": str(tmp_path / "vl.parquet"), "kind": "image_text",
                     "columns": ["image", "caption"], "tokenizer": str(tmp_path / "tok.json"),
                     "image": {"patch_size": P, "max_side": 448}}],
        "batch": {"sequences": 2, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}},
        "runtime": {"window": 8, "metrics": False},
    })
    server = LoaderServer(spec, 0, 0, "tcp://127.0.0.1:9")  # never connected: the test drives _fill by hand
    try:
        server.welcomed = True
        server.window.seek({"low": 0})
        assert server._fill()
        # what the loader read: as many rows of the same deterministic stream as its metrics say
        n_read = int(server.m.registry.get_sample_value("mixplane_loader_samples_read_total", {"source": "vl"}))
        check = open_stream(spec.sources[0], seed=spec.mixture.seed)
        read_rows = {int(r) for r in key_row(check.take(n_read).keys)}
        check.close()
        rows = {int(key_row(b.key)) for b in server.window.buffer.values()}
        assert rows and rows <= read_rows - bad  # no bad sample announced
        expected = len(read_rows & bad)
        assert expected > 0
        assert _counter(server.m, "mixplane_loader_quarantined_samples_total", "vl") == expected
        server.window.seek({"low": 0})  # re-reading the same rows does not count them twice
        server._fill()
        assert _counter(server.m, "mixplane_loader_quarantined_samples_total", "vl") == expected
    finally:
        server.close()


def test_a_constructor_that_takes_nothing_does_not_block_the_loader(tmp_path):
    """Sample messages wait in the loader's outbox (no blocking send): a dead or slow constructor
    stalls only its own queue; once it reads again, every message arrives, in plan order."""
    import time

    import zmq

    from mixplane import wire
    from mixplane.wire import Kind
    from tests.conftest import write_token_source

    docs = write_token_source(tmp_path / "t", rows=400, files=1, mean_len=40, seed=3)
    spec = parse_spec({
        "name": "outbox", "sources": [{"name": "t", "uri": str(tmp_path / "t"), "kind": "tokens", "columns": ["tokens"]}],
        "batch": {"sequences": 2, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}}, "runtime": {"window": 32, "metrics": False},
    })
    ctx = zmq.Context()
    probe = ctx.socket(zmq.PULL)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(0)  # nobody listens there yet: the constructor is "down"
    server = LoaderServer(spec, 0, 0, "tcp://127.0.0.1:9", context=ctx)
    try:
        welcome = wire.decode(wire.encode(Kind.WELCOME, {"constructors": [f"tcp://127.0.0.1:{port}"], "session": 1,
                                                         "cursor": {"low": 0}}))
        server.handle(welcome)
        for s in server.pushers:
            s.setsockopt(zmq.SNDHWM, 2)
        sent = []
        t0 = time.monotonic()
        for step in range(40):  # far more messages than the high-water mark lets through
            server._fill()
            b = next(iter(server.window.buffer.values()))
            n = len(b.tokens) - b.done
            plan = {"pos": np.array([b.pos]), "start": np.array([b.done]), "len": np.array([n]),
                    "dest": np.array([0]), "retire": np.array([1]), "img": np.array([0])}
            server.handle(wire.decode(wire.encode(Kind.PLAN_LOADER, {"session": 1, "step": step}, plan)))
            sent.append((step, int(b.key)))
        assert time.monotonic() - t0 < 10  # never blocked on the missing peer
        assert server.outbox_messages > 0
        assert server.m.registry.get_sample_value("mixplane_loader_outbox_messages", {"source": "t"}) == server.outbox_messages
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"tcp://127.0.0.1:{port}")  # the constructor comes back
        got = []
        deadline = time.monotonic() + 20
        while len(got) < len(sent) and time.monotonic() < deadline:
            server.flush()
            if pull.poll(20):
                m = wire.recv(pull)[1]
                k = int(m.array("key")[0])
                got.append((m.get("step", int), k))
                assert np.array_equal(m.array("values")[:-1] if len(m.array("values")) > int(m.array("len")[0]) else
                                      m.array("values"), docs[int(key_row(k))][: int(m.array("len")[0])])
        assert got == sent and server.outbox_messages == 0
        pull.close(0)
    finally:
        server.close()
        ctx.term()


def _gauge(m, name: str, source: str) -> float | None:
    return m.registry.get_sample_value(name, {"source": source})


def test_dry_live_source_sets_the_dry_gauge_until_new_files_arrive(tmp_path):
    import time

    from tests.conftest import write_token_source

    live = tmp_path / "live"
    write_token_source(live, rows=20, files=1, mean_len=8, seed=1)  # far less than the window wants
    spec = parse_spec({
        "name": "dry", "sources": [{"name": "fresh", "uri": str(live / "*.parquet"), "kind": "tokens",
                                    "columns": ["tokens"], "live": True}],
        "batch": {"sequences": 2, "seq_len": 64, "microbatches": 1},
        "topology": {"modules": {"backbone": {"dp": 1}}}, "runtime": {"window": 64, "metrics": False},
    })
    server = LoaderServer(spec, 0, 0, "tcp://127.0.0.1:9")  # never connected: the test drives _fill by hand
    try:
        server.welcomed = True
        server.window.seek({"low": 0})
        assert server._fill()
        assert len(server.window.buffer) == 20 and server.stream.dry
        assert _gauge(server.m, "mixplane_loader_dry", "fresh") == 1.0
        write_token_source(tmp_path / "more", rows=100, files=1, mean_len=8, seed=2)
        (tmp_path / "more" / "part-000.parquet").rename(live / "part-001.parquet")  # appears atomically
        server.stream.next_rescan_at = time.monotonic()  # the next listing is due (poll_s 2 s in production)
        deadline = time.monotonic() + 5
        while server.stream.dry and time.monotonic() < deadline:
            time.sleep(0.06)  # the poll loop's next turns, after the listing interval
            server._fill()
        assert not server.stream.dry and len(server.window.buffer) == 64  # filled from the new file
        assert _gauge(server.m, "mixplane_loader_dry", "fresh") == 0.0
    finally:
        server.close()
