"""Payload integrity (issue 11 item 1): SAMPLES and STEP_DATA carry checksums and an end-of-message marker; a
damaged or truncated one sent by a test peer is refused (counted, logged with its sender) and asked for again,
never delivered. Real sockets and processes."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from mixplane import wire
from mixplane.client import MixtureLoader
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from mixplane.wire import Kind, WireError
from tests.conftest import token_mixture


def step_data(step: int, seed: int) -> tuple[dict, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 1000, size=(2, 64), dtype=np.int64)
    meta = {"step": step, "rank": 0, "phase": 0, "lr_scale": 1.0, "generation": 0, "session": 0, "seq_len": 64}
    return meta, {"input_ids": ids, "labels": np.roll(ids, -1, axis=1),
                  "cu_seqlens": np.array([0, 64, 128], np.int32)}


def flip(frames: list, frame: int, at: int = 7) -> list:
    out = [bytes(f) if not isinstance(f, np.ndarray) else f.tobytes() for f in frames]
    b = bytearray(out[frame])
    b[at % len(b)] ^= 0x40
    out[frame] = bytes(b)
    return out


def test_framing_names_truncation_and_damage():
    meta, arrays = step_data(0, 0)
    frames = wire.encode(Kind.STEP_DATA, meta, arrays)
    assert wire.decode(frames).flags & wire.FLAG_END  # payloads are checksummed and closed by default
    with pytest.raises(WireError, match="truncated: no end-of-message marker"):
        wire.decode(frames[:-1])
    with pytest.raises(WireError, match="truncated: the end marker counts"):
        wire.decode([*frames[:1], *frames[2:]])
    with pytest.raises(WireError, match="checksum mismatch"):
        wire.decode(flip(frames, 1))
    assert wire.peek_meta(flip(frames, 1))["step"] == 0  # the header still names what it was


def fake_constructor(ctx: zmq.Context, bad: dict[int, str], served: list[tuple[int, str]]) -> tuple[str, threading.Thread]:
    """Planner + constructor stand-in on 127.0.0.1: answers ROUTE; the first answer to GET_STEP s is damaged in
    the way bad[s] names, every later one is intact."""
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:0")
    ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def run() -> None:
        try:
            while sock.poll(10_000):
                route, msg = wire.recv(sock, routed=True)
                if msg.kind == Kind.ROUTE:
                    wire.send(sock, Kind.ROUTE_REPLY, {"constructor": 0, "endpoint": ep, "session": 0, "coords": {"dp": 0},
                                                       "sources": ["a"], "rank": 0, "start_step": 0,
                                                       "checksum_payloads": True}, route=route)
                elif msg.kind == Kind.GET_STEP:
                    s = msg.get("step", int)
                    meta, arrays = step_data(s, s)
                    frames = wire.encode(Kind.STEP_DATA, meta, arrays)
                    how = bad.pop(s, "ok")
                    if how == "flip":
                        frames = flip(frames, 2, 100)
                    elif how == "truncate":
                        frames = frames[:-2]
                    elif how == "plain":
                        frames = wire.encode(Kind.STEP_DATA, meta, arrays, checksum=False)
                    served.append((s, how))
                    sock.send_multipart([*route, *frames], copy=False)
                elif msg.kind == Kind.SHUTDOWN:
                    return
        finally:
            sock.close(0)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return ep, t


def test_a_damaged_step_data_is_refused_and_asked_for_again_never_delivered():
    ctx = zmq.Context()
    served: list[tuple[int, str]] = []
    ep, t = fake_constructor(ctx, {0: "flip", 1: "truncate", 2: "plain"}, served)
    loader = MixtureLoader(ep, rank=0, max_steps=4, timeout_s=20, prefetch=0, context=ctx, heartbeat_s=0)
    got = [b for b in loader]
    assert [int(b["step"]) for b in got] == [0, 1, 2, 3]
    for s, b in enumerate(got):
        _, want = step_data(s, s)
        assert np.array_equal(b["input_ids"].numpy(), want["input_ids"]), f"step {s}: a damaged payload was delivered"
    assert loader.damaged == 3
    assert [x for x in served if x[1] != "ok"] == [(0, "flip"), (1, "truncate"), (2, "plain")]
    assert sorted(s for s, how in served if how == "ok") == [0, 1, 2, 3]  # each bad one was asked for again
    loader.close()
    s = ctx.socket(zmq.DEALER)
    s.connect(ep)
    wire.send(s, Kind.SHUTDOWN)
    t.join(10)
    s.close(0)
    ctx.term()


def test_damaged_samples_from_a_test_peer_are_refused_and_batches_stay_exact(token_sources, tmp_path):
    spec = parse_spec(token_mixture(token_sources["root"]))
    with EmbeddedRuntime(spec, tmp_path / "reference") as rt:
        loaders = [MixtureLoader(rt.planner_endpoint, rank=r, max_steps=12, timeout_s=60) for r in range(2)]
        reference = [[{k: v.clone() for k, v in b.items()} for b in ld] for ld in loaders]
    run_dir = tmp_path / "damaged"
    with EmbeddedRuntime(spec, run_dir) as rt:
        data_ep = rt.endpoints()["components"]["constructor-0"]["data_endpoint"]
        peer = zmq.Context.instance().socket(zmq.PUSH)
        setup = rt.curve_setup("component")
        if setup is not None:
            wire.curve_client(peer, setup.keys, setup.server_key("server"))
        peer.connect(data_ep)
        sent = 0
        for step in range(2, 10):  # SAMPLES the constructor will need, damaged in transit, before the real ones
            for src in range(3):
                arrays = {"key": np.array([1], np.int64), "start": np.array([0], np.int64), "len": np.array([4], np.int64),
                          "offsets": np.array([0, 4], np.int64), "values": np.arange(4, dtype=np.int32)}
                frames = wire.encode(Kind.SAMPLES, {"session": 0, "step": step, "source": src, "replica": 0, "epoch": 1},
                                     arrays)
                frames = flip(frames, 5, 1) if (step + src) % 2 else frames[:-1]  # a flipped bit, or cut short
                peer.send_multipart(frames)
                sent += 1
        plain = wire.encode(Kind.SAMPLES, {"session": 0, "step": 10, "source": 0, "replica": 0, "epoch": 1},
                            {"key": np.array([1], np.int64), "start": np.array([0], np.int64), "len": np.array([4], np.int64),
                             "offsets": np.array([0, 4], np.int64), "values": np.arange(4, dtype=np.int32)}, checksum=False)
        peer.send_multipart(plain)  # without checksums at all: refused too
        loaders = [MixtureLoader(rt.planner_endpoint, rank=r, max_steps=12, timeout_s=60) for r in range(2)]
        got = [[{k: v.clone() for k, v in b.items()} for b in ld] for ld in loaders]
        peer.close(0)
        log = (run_dir / "logs" / "constructor-0.log").read_text(errors="replace")
    for r in range(2):
        assert len(got[r]) == 12
        for a, b in zip(reference[r], got[r]):
            for k in ("input_ids", "labels", "source_ids"):
                assert bool((a[k] == b[k]).all()), f"rank {r} step {int(a['step'])}: {k} differs"
    assert "refused a damaged SAMPLES message from loader:a:0" in log, log[-2000:]
    assert "truncated" in log and "checksum mismatch" in log and "SAMPLES without checksums" in log
