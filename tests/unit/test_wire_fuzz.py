"""Fuzzing the framing: random and malformed frames at every socket kind.

The receiver must never crash (only WireError for bad messages) and must deliver exactly the valid
messages, bit for bit; damaged checksummed messages are rejected, never delivered.
"""

import json
import random

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings, strategies as st

from mixplane import wire
from mixplane.wire import Kind, WireError

frames_st = st.lists(st.binary(max_size=64), min_size=0, max_size=5)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames_st)
def test_decode_of_random_frames_raises_only_wire_error(frames):
    try:
        wire.decode(frames)
    except WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.integers(0, 255), st.integers(0, 0xFFFF), st.integers(0, 5))
def test_decode_of_random_headers_and_meta(meta, kind, flags, nbuf):
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, kind, flags, len(meta)) + meta
    try:
        wire.decode([head] + [b"\0" * 4] * nbuf)
    except WireError:
        pass


json_st = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                       lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(json_st, st.lists(st.binary(max_size=32), max_size=3))
def test_decode_of_random_json_descriptors(descr, bufs):
    body = json.dumps({"arrays": descr}).encode()
    head = wire.HEADER.pack(wire.MAGIC, wire.VERSION, int(Kind.SAMPLES), 0, len(body)) + body
    try:
        wire.decode([head, *bufs])
    except WireError:
        pass


def _valid(i: int, rng: np.random.Generator) -> tuple[dict, dict]:
    meta = {"seq": i, "step": int(rng.integers(0, 1000))}
    n = int(rng.choice([0, 7, 100_000]))  # empty, small (copied) and zero-copy sizes
    arrays = {"x": rng.integers(0, 1 << 30, size=n).astype(np.int32), "y": rng.random(3).astype(np.float32)}
    return meta, arrays


def _mutate(frames: list, rnd: random.Random) -> list:
    frames = [bytes(np.asarray(f).tobytes()) if not isinstance(f, bytes) else f for f in frames]
    op = rnd.randrange(6)
    if op == 0:  # flip a bit somewhere
        i = rnd.randrange(len(frames))
        if not frames[i]:
            return frames[:i] + [b"\x01"] + frames[i + 1:]
        b = bytearray(frames[i])
        j = rnd.randrange(len(b))
        b[j] ^= 1 << rnd.randrange(8)
        frames[i] = bytes(b)
    elif op == 1:  # truncate a frame
        i = rnd.randrange(len(frames))
        frames[i] = frames[i][: rnd.randrange(len(frames[i]))] if frames[i] else b"\x00"
    elif op == 2:  # drop a frame
        del frames[rnd.randrange(len(frames))]
        if not frames:
            frames = [b""]
    elif op == 3:  # duplicate a frame
        i = rnd.randrange(len(frames))
        frames.insert(i, frames[i])
    elif op == 4:  # swap the two buffers
        frames[1], frames[2] = frames[2], frames[1]
        if frames[1] == frames[2]:
            frames.append(b"junk")
    else:  # random garbage
        frames = [rnd.randbytes(rnd.randrange(1, 40)) for _ in range(rnd.randrange(1, 4))]
    return frames


PAIRS = [(zmq.DEALER, zmq.ROUTER), (zmq.ROUTER, zmq.DEALER), (zmq.PUSH, zmq.PULL), (zmq.PUB, zmq.SUB),
         (zmq.PAIR, zmq.PAIR), (zmq.DEALER, zmq.DEALER)]


@pytest.mark.parametrize("sender_type,receiver_type", PAIRS, ids=lambda t: zmq.SocketType(t).name)
def test_socket_fuzz_delivers_exactly_the_valid_messages(sender_type, receiver_type):
    rnd = random.Random(sender_type * 100 + receiver_type)
    rng = np.random.default_rng(sender_type)
    ctx = zmq.Context()
    try:
        recv_sock = wire.configure_socket(ctx.socket(receiver_type), rcvhwm=10_000)
        send_sock = wire.configure_socket(ctx.socket(sender_type), sndhwm=10_000)
        if receiver_type == zmq.SUB:
            recv_sock.setsockopt(zmq.SUBSCRIBE, b"")
        if sender_type == zmq.ROUTER:  # the ROUTER must know its peer: receiver binds with an identity
            recv_sock.setsockopt(zmq.IDENTITY, b"peer")
            port = send_sock.bind_to_random_port("tcp://127.0.0.1")
            recv_sock.connect(f"tcp://127.0.0.1:{port}")
        else:
            port = recv_sock.bind_to_random_port("tcp://127.0.0.1")
            send_sock.connect(f"tcp://127.0.0.1:{port}")
        routed = receiver_type == zmq.ROUTER
        route = [b"peer"] if sender_type == zmq.ROUTER else []
        # wait for the connection (PUB drops messages until the subscriber is connected)
        for _ in range(200):
            if sender_type == zmq.ROUTER:
                try:
                    send_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                    wire.send(send_sock, Kind.HEARTBEAT, {"sync": 1}, route=route)
                except zmq.ZMQError:
                    send_sock.poll(10)
                    continue
            else:
                wire.send(send_sock, Kind.HEARTBEAT, {"sync": 1})
            if recv_sock.poll(20):
                break
        while recv_sock.poll(50):
            recv_sock.recv_multipart()
        expected = []
        for i in range(300):
            meta, arrays = _valid(i, rng)
            frames = wire.encode(Kind.SAMPLES, meta, arrays, checksum=True)
            if rnd.random() < 0.4:
                expected.append((meta, {k: v.copy() for k, v in arrays.items()}))
                send_sock.send_multipart([*route, *frames], copy=False)
            else:
                send_sock.send_multipart([*route, *_mutate(frames, rnd)])
        wire.send(send_sock, Kind.SHUTDOWN, route=route, checksum=True)
        delivered, rejected = [], 0
        for _ in range(10_000):
            assert recv_sock.poll(5000), "receiver starved: a message was lost"
            try:
                _, m = wire.recv(recv_sock, routed=routed)
            except WireError:
                rejected += 1
                continue
            if m.kind == Kind.SHUTDOWN:
                break
            delivered.append(m)
        assert rejected > 0
        assert len(delivered) == len(expected)
        for m, (meta, arrays) in zip(delivered, expected):
            assert m.meta == meta
            for k, v in arrays.items():
                np.testing.assert_array_equal(m.array(k), v)
    finally:
        ctx.destroy(linger=0)
