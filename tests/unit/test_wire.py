"""Wire framing, checksums, socket policy, heartbeats and CURVE with an allowlist."""

import json
import time

import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from mixplane import wire
from mixplane.wire import Kind, WireError


def test_round_trip_zero_copy_and_small_arrays():
    big = np.arange(100_000, dtype=np.int32)
    frames = wire.encode(Kind.STEP_DATA, {"step": 3}, {"big": big, "small": np.array([1.5], np.float32)})
    assert frames[1] is not None and np.shares_memory(np.asarray(frames[1]), big)
    m = wire.decode(frames)
    assert m.kind == Kind.STEP_DATA and m.meta == {"step": 3}
    np.testing.assert_array_equal(m.array("big"), big)
    assert m.array("small").tolist() == [1.5]


@pytest.mark.parametrize("checksum", [False, True])
def test_checksum_round_trip(checksum):
    a = np.arange(1000, dtype=np.int64)
    m = wire.decode(wire.encode(Kind.SAMPLES, {"x": [1, 2]}, {"a": a}, checksum=checksum))
    assert m.meta == {"x": [1, 2]}
    np.testing.assert_array_equal(m.array("a"), a)


def test_checksum_catches_damage_anywhere():
    a = np.arange(50_000, dtype=np.int32)  # zero-copy frame
    frames = wire.encode(Kind.SAMPLES, {"step": 1}, {"a": a, "b": np.ones(3, np.int8)}, checksum=True)
    head = bytearray(frames[0])
    for i in range(len(head)):
        bad = bytearray(head)
        bad[i] ^= 0x10
        with pytest.raises(WireError):
            wire.decode([bytes(bad), *frames[1:]])
    buf = bytearray(np.asarray(frames[1]).tobytes())
    buf[12345] ^= 1
    with pytest.raises(WireError, match="checksum"):
        wire.decode([frames[0], bytes(buf), frames[2], frames[3]])
    with pytest.raises(WireError):
        wire.decode([frames[0], frames[2], frames[1], frames[3]])  # swapped buffers
    with pytest.raises(WireError, match="truncated"):
        wire.decode(frames[:3])  # the end-of-message marker is missing


def test_reserved_and_unsendable_meta():
    with pytest.raises(WireError, match="reserved"):
        wire.encode(Kind.ACK, {"arrays": 1})
    with pytest.raises(WireError, match="JSON"):
        wire.encode(Kind.ACK, {"x": object()})
    loop: dict = {}
    loop["me"] = loop
    for bad in ({"x": float("nan")}, {"x": float("inf")}, loop, {"x": {1j: 2}}):
        with pytest.raises(WireError, match="JSON"):
            wire.encode(Kind.ACK, bad)
    assert wire.decode(wire.encode(Kind.ACK, {"x": 1})).meta == {"x": 1}  # a failed encode leaves nothing behind
    with pytest.raises(WireError, match="dtype"):
        wire.encode(Kind.ACK, arrays={"o": np.array([object()])})


@pytest.mark.parametrize("frames,match", [
    ([], "empty"),
    ([b"xx"], "shorter"),
    ([wire.HEADER.pack(b"NOPE", 1, 1, 0, 0)], "magic"),
    ([wire.HEADER.pack(b"MXPL", 9, 1, 0, 0)], "version"),
    ([wire.HEADER.pack(b"MXPL", 1, 250, 0, 0)], "kind"),
    ([wire.HEADER.pack(b"MXPL", 1, 1, 0x80, 0)], "flags"),
    ([wire.HEADER.pack(b"MXPL", 1, 1, 0, 5) + b"{}"], "length"),
    ([wire.HEADER.pack(b"MXPL", 1, 1, 0, 2) + b"[]"], "object"),
    ([wire.HEADER.pack(b"MXPL", 1, 1, 0, 3000) + b"[" * 3000], "JSON"),
    ([wire.HEADER.pack(b"MXPL", 1, 1, 0, 1) + b"\xff"], "JSON"),
])
def test_decode_names_the_problem(frames, match):
    with pytest.raises(WireError, match=match):
        wire.decode(frames)


def test_descriptor_checks():
    def msg(descr, *bufs):
        import json
        body = json.dumps({"arrays": descr}).encode()
        return [wire.HEADER.pack(b"MXPL", 1, int(Kind.SAMPLES), 0, len(body)) + body, *bufs]

    with pytest.raises(WireError, match="twice"):
        wire.decode(msg([["a", "<i4", [1]], ["a", "<i4", [1]]], b"\0" * 4, b"\0" * 4))
    with pytest.raises(WireError, match="forbidden dtype"):
        wire.decode(msg([["a", "|O", [1]]], b"\0" * 8))
    with pytest.raises(WireError, match="bad shape"):
        wire.decode(msg([["a", "<i4", [-1]]], b""))
    with pytest.raises(WireError, match="needs"):
        # a product that overflows int64 must not wrap around to the buffer size
        wire.decode(msg([["a", "|u1", [1 << 39, 1 << 39, 1 << 39, 0x10]]], b""))
    with pytest.raises(WireError, match="described"):
        wire.decode(msg([["a", "<i4", [1]]]))


def test_liveness_table():
    now = [0.0]
    lv = wire.Liveness(1.0, misses=3, clock=lambda: now[0])
    lv.seen(b"a")
    now[0] = 2.0
    lv.seen(b"b")
    assert lv.due() and not lv.due()
    now[0] = 3.5
    assert lv.expired() == [b"a"] and list(lv.last) == [b"b"]


def test_backpressure_and_timeouts_name_the_endpoint():
    ctx = zmq.Context()
    try:
        push = wire.configure_socket(ctx.socket(zmq.PUSH), sndhwm=1)
        pull = wire.configure_socket(ctx.socket(zmq.PULL), rcvhwm=1)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        big = np.zeros(1 << 20, np.uint8)
        with pytest.raises(wire.Backpressure, match=f"127.0.0.1:{port}"):
            for _ in range(1000):  # the receiver never reads: queues fill, then the deadline hits
                wire.send_frames(push, wire.encode(Kind.SAMPLES, arrays={"a": big}), timeout_s=0.2, what="samples")
        d = ctx.socket(zmq.DEALER)
        d.linger = 0
        d.connect(f"tcp://127.0.0.1:{port + 0}")
        with pytest.raises(wire.PeerTimeout, match=f"step 5 from tcp://127.0.0.1:{port}"):
            wire.recv_timeout(d, 0.05, what="step 5")
        assert not wire.try_send(push, Kind.ACK)
    finally:
        ctx.destroy(linger=0)


def _pair(ctx, server_keys, client_keys, server_public):
    srv = wire.curve_server(ctx.socket(zmq.ROUTER), server_keys)
    srv.linger = 0
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    cli = ctx.socket(zmq.DEALER)
    cli.linger = 0
    wire.curve_client(cli, client_keys, server_public)
    cli.connect(f"tcp://127.0.0.1:{port}")
    return srv, cli


def test_curve_allowlist(tmp_path):
    server = wire.generate_keys(tmp_path, "constructor")
    client = wire.generate_keys(tmp_path, "client-0")
    stranger = wire.generate_keys(tmp_path / "elsewhere", "stranger")
    assert (tmp_path / "constructor.key_secret").stat().st_mode & 0o777 == 0o600
    assert wire.load_keys(tmp_path, "constructor") == server
    assert wire.load_public_key(tmp_path, "client-0") == client.public
    allow = wire.load_allowlist(tmp_path)
    assert allow == {server.public, client.public}
    ctx = zmq.Context()
    auth = wire.Authenticator(ctx, allow)
    try:
        srv, cli = _pair(ctx, server, client, server.public)
        wire.send(cli, Kind.GET_STEP, {"step": 1})
        route, m = wire.recv_timeout(srv, 5, routed=True)
        assert m.meta == {"step": 1}
        # a client whose key is not on the allowlist never gets a message through
        srv2, bad = _pair(ctx, server, stranger, server.public)
        wire.send(bad, Kind.GET_STEP, {"step": 2})
        assert not srv2.poll(500)
        assert auth.denied >= 1
        # a client that expects another server key cannot talk to this server
        srv3, wrong = _pair(ctx, server, client, stranger.public)
        wire.send(wrong, Kind.GET_STEP, {"step": 3})
        assert not srv3.poll(300)
    finally:
        auth.close()
        ctx.destroy(linger=0)


def test_key_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nobody.key_secret"):
        wire.load_keys(tmp_path, "nobody")
    (tmp_path / "broken.key_secret").write_text('curve\n public-key = "short"\n')
    with pytest.raises(ValueError, match="broken.key_secret"):
        wire.load_keys(tmp_path, "broken")


def test_heartbeat_is_a_valid_message():
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://hb")
        b.connect("inproc://hb")
        assert wire.heartbeat(a, who="loader-0")
        _, m = wire.recv_timeout(b, 1)
        assert m.kind == Kind.HEARTBEAT and m.meta["who"] == "loader-0"
    finally:
        ctx.destroy(linger=0)


def test_every_message_is_checksummed_by_default_payloads_also_end_with_a_marker():
    ctl = wire.encode(Kind.PLAN_CONSTRUCTOR, {"step": 3}, {"rows": np.arange(10, dtype=np.int64)})
    payload = wire.encode(Kind.SAMPLES, {"step": 3}, {"values": np.arange(10, dtype=np.int32)})
    flags = lambda frames: wire.HEADER.unpack_from(bytes(frames[0]))[3]
    assert flags(ctl) == wire.FLAG_CHECKSUM and flags(payload) == wire.FLAG_CHECKSUM | wire.FLAG_END
    assert bytes(payload[-1]).startswith(wire.END_MARKER) and len(payload) == 3
    assert flags(wire.encode(Kind.STEP_DATA, {}, checksum=False)) == 0  # runtime.checksum_payloads: false
    assert not flags(wire.encode(Kind.ACK, {}, checksum=False)) & wire.FLAG_CHECKSUM
    # a bit flip in a default (control) message is rejected, in the header, the meta or a buffer
    head = bytearray(ctl[0])
    head[wire.HEADER.size + 2] ^= 0x01
    with pytest.raises(WireError, match="checksum"):
        wire.decode([bytes(head), *ctl[1:]])
    buf = bytearray(bytes(ctl[1]))
    buf[5] ^= 0x80
    with pytest.raises(WireError, match="checksum"):
        wire.decode([ctl[0], bytes(buf)])
    # the same flip in a payload is caught too; without checksums (checksum_payloads: false) it would not be
    pbuf = bytearray(bytes(payload[1]))
    pbuf[5] ^= 0x80
    with pytest.raises(WireError, match="checksum"):
        wire.decode([payload[0], bytes(pbuf), payload[2]])
    plain = wire.encode(Kind.SAMPLES, {"step": 3}, {"values": np.arange(10, dtype=np.int32)}, checksum=False)
    assert wire.decode([plain[0], bytes(pbuf)]).array("values")[1] != 1


def _former_header(kind, meta, arrays, checksum):
    """The header frame as encode built it with json.dumps of the whole meta (the text encode now writes
    itself for the array descriptors and sums)."""
    import json
    import struct
    import zlib

    from mixplane.wire import framing

    meta = dict(meta)
    bufs = []
    if arrays:
        descr = []
        for name, arr in arrays.items():
            a = np.ascontiguousarray(arr)
            dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
            a = a.astype(dt, copy=False)
            descr.append([name, dt.str, list(a.shape)])
            bufs.append(a if a.nbytes >= framing.ZERO_COPY_MIN_BYTES else a.tobytes())
        meta["arrays"] = descr
    if checksum:
        meta["sums"] = [framing._digest(b) for b in bufs]
    body = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    flags = (framing.FLAG_CHECKSUM if checksum else 0) | (framing.FLAG_END if checksum and kind in framing.PAYLOAD_KINDS else 0)
    head = framing.HEADER.pack(framing.MAGIC, framing.VERSION, int(kind), flags, len(body)) + body
    return head + struct.pack("!I", zlib.crc32(head)) if checksum else head


def test_header_bytes_are_what_json_dumps_of_the_whole_meta_gave():
    rng = np.random.default_rng(3)
    dtypes = ["<i8", ">i4", "|u1", "<f4", ">f8", "|b1", "<u2"]
    metas = [{}, {"step": 7}, {"session": 0, "step": 3, "x": [1, "é\"q", {"k": None}], "f": 1.5, "t": True}]
    for i in range(60):
        arrays = {}
        for j in range(int(rng.integers(0, 5))):
            shape = [(), (int(rng.integers(0, 40)),), (3, int(rng.integers(0, 7)))][int(rng.integers(0, 3))]
            a = (rng.random(shape) * 100).astype(np.dtype(dtypes[int(rng.integers(0, len(dtypes)))]))
            if a.ndim == 2 and rng.random() < 0.5:
                a = a.T  # not C-contiguous
            name = ["pos", "len", "naïve \"name\"", f"a{j}"][int(rng.integers(0, 4))]
            arrays[name] = a
        if rng.random() < 0.1:
            arrays["big"] = np.arange(20_000, dtype=np.int64)  # zero-copy frame
        if rng.random() < 0.1:
            arrays["zero_d"] = np.array(5, np.int32)  # travels as shape [1], as ascontiguousarray makes it
        meta, checksum = metas[i % len(metas)], bool(i % 2)
        kind = Kind.SAMPLES if i % 3 == 0 else Kind.PLAN_LOADER
        frames = wire.encode(kind, meta, arrays, checksum=checksum)
        assert bytes(frames[0]) == _former_header(kind, meta, arrays, checksum)
        m = wire.decode(frames)
        assert m.meta == meta and set(m.arrays) == set(arrays)
        for name, a in arrays.items():
            np.testing.assert_array_equal(m.arrays[name], a)


def test_meta_may_be_any_mapping():
    from types import MappingProxyType

    frames = wire.encode(Kind.PLAN_LOADER, MappingProxyType({"step": 3}), {"pos": np.arange(4)})
    m = wire.decode(frames)
    assert m.meta == {"step": 3} and m.array("pos").tolist() == [0, 1, 2, 3]
    assert wire.decode(wire.encode(Kind.PLAN_LOADER, None)).meta == {}


# ---- many messages at once (wire.encode_columns) ---------------------------------------------------------

def _bytes(frames: list) -> list[bytes]:
    return [bytes(memoryview(f).cast("B")) for f in frames]


_COLUMN_DTYPES = ["<i8", "<i4", "|u1", "<u2", "|b1", "<f8", ">i4", ">f2", "<i2"]


def _random_batch(seed: int):
    """A batch as the planner builds one (cut columns, shared arrays, one meta or one per message) with odd
    cases mixed in: empty messages and batches, big-endian and strided columns, multi-dim shared arrays."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 7))
    cols, names = [], [f"c{i}" for i in range(int(rng.integers(0, 6)))]
    for name in names:
        dt = np.dtype(_COLUMN_DTYPES[int(rng.integers(len(_COLUMN_DTYPES)))])
        if rng.random() < 0.3:  # shared by every message, any shape, big ones passed by reference
            shape = tuple(int(x) for x in rng.integers(0, 5, int(rng.integers(1, 3))))
            if rng.random() < 0.2:
                shape = (int(rng.integers(20_000, 40_000)),)
            data = (rng.random(shape) * 100).astype(dt)
            cols.append(wire.Column(name, data))
            continue
        cuts = np.sort(rng.integers(0, 30, n + 1)) if n else np.zeros(1, np.int64)
        total = int(cuts[-1]) + int(rng.integers(0, 3))
        data = (rng.random(2 * total) * 1000).astype(dt)
        data = data[::2] if rng.random() < 0.3 else data[:total]  # strided (non-contiguous) or not
        bounds = cuts.tolist() if rng.random() < 0.5 else cuts
        cols.append(wire.Column(name, data, bounds))
    if rng.random() < 0.5 and any(c.bounds is not None for c in cols):
        metas = {"session": int(rng.integers(0, 3)), "step": int(rng.integers(0, 99)), "x": [1.5, "é", None]}
        per = [metas] * n
    else:
        metas = [{} if rng.random() < 0.2 else {"step": i, "dp_ranks": list(range(i)), "lr": 0.1 * i} for i in range(n)]
        per = metas
    arrays = [{c.name: c.data if c.bounds is None else c.data[int(c.bounds[i]):int(c.bounds[i + 1])] for c in cols}
              for i in range(n)]
    return metas, cols, per, arrays


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([None, True, False]),
       st.sampled_from([Kind.PLAN_LOADER, Kind.PLAN_CONSTRUCTOR, Kind.SAMPLES]))
def test_encode_columns_gives_the_bytes_of_encode_per_message(seed, checksum, kind):
    """Every frame byte for byte what wire.encode gives each message (header, meta, descriptors, digests, CRC,
    end-of-message marker), and each message decodes to its meta and arrays."""
    metas, cols, per, arrays = _random_batch(seed)
    got = wire.encode_columns(kind, metas, cols, checksum=checksum)
    assert len(got) == len(per)
    for frames, meta, arrs in zip(got, per, arrays):
        assert _bytes(frames) == _bytes(wire.encode(kind, meta, arrs, checksum=checksum))
        m = wire.decode(frames)
        assert m.kind == kind and m.meta == json.loads(json.dumps(meta)) and list(m.arrays) == list(arrs)
        for name, a in arrs.items():
            assert np.array_equal(m.arrays[name], a)


def test_encode_columns_shares_what_every_message_carries():
    shared = np.arange(100_000, dtype=np.uint8)
    col = np.arange(10, dtype=np.int64)
    got = wire.encode_columns(Kind.PLAN_CONSTRUCTOR, [{"i": 0}, {"i": 1}],
                              [wire.Column("a", col, [0, 4, 10]), wire.Column("cursor", shared)])
    assert got[0][2] is got[1][2] and np.shares_memory(np.asarray(got[0][2]), shared)  # once, by reference
    assert np.shares_memory(np.frombuffer(got[1][1], np.int64), col)  # cut columns: views, no copies
    assert wire.decode(got[1]).array("a").tolist() == [4, 5, 6, 7, 8, 9]


def test_encode_columns_refuses_what_encode_refuses_and_bad_cuts():
    col = wire.Column("a", np.arange(5), [0, 2, 5])
    with pytest.raises(WireError, match="reserved"):
        wire.encode_columns(Kind.PLAN_LOADER, {"sums": 1}, [col])
    with pytest.raises(WireError, match="JSON"):
        wire.encode_columns(Kind.PLAN_LOADER, [{"x": object()}, {}], [col])
    with pytest.raises(WireError, match="dtype"):
        wire.encode_columns(Kind.PLAN_LOADER, [{}, {}], [col, wire.Column("o", np.array([object()]))])
    for bounds in ([0, 2], [0, 3, 2], [0, 2, 6], [-1, 2, 5]):
        with pytest.raises(WireError, match="bounds"):
            wire.encode_columns(Kind.PLAN_LOADER, [{}, {}], [wire.Column("a", np.arange(5), bounds)])
    with pytest.raises(WireError, match="1-d"):
        wire.encode_columns(Kind.PLAN_LOADER, [{}], [wire.Column("m", np.zeros((2, 2)), [0, 1])])
    with pytest.raises(WireError, match="count"):
        wire.encode_columns(Kind.PLAN_LOADER, {"step": 1}, [wire.Column("s", np.arange(3))])
