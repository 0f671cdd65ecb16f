"""How received arrays become torch tensors: zero-copy views of the ZeroMQ frames, copies only where
sharing would be wrong, and metadata-only receive buffers for every dtype the wire allows."""

import numpy as np
import pytest
import torch
import zmq

from mixplane import wire
from mixplane.client import DeliveryError, MixtureLoader, _tensor
from mixplane.wire import Kind


def _loader() -> MixtureLoader:
    return MixtureLoader("tcp://127.0.0.1:1", rank=1)  # never connects: only _to_tensors is used


def _frame_range(frame: zmq.Frame) -> tuple[int, int]:
    base = np.frombuffer(frame.buffer, np.uint8).ctypes.data
    return base, base + len(frame.buffer)


def test_received_tensors_share_memory_with_the_frames():
    ctx = zmq.Context()
    try:
        rx = ctx.socket(zmq.PULL)
        rx.linger = 0
        port = rx.bind_to_random_port("tcp://127.0.0.1")
        tx = ctx.socket(zmq.PUSH)
        tx.linger = 0
        tx.connect(f"tcp://127.0.0.1:{port}")
        ids = np.arange(4 * 8192, dtype=np.int64).reshape(4, 8192)  # 256 KB: a zero-copy frame
        wire.send(tx, Kind.STEP_DATA, {"step": 0, "rank": 1, "lr_scale": 1.0, "phase": 0}, {"input_ids": ids})
        assert rx.poll(5000)
        frames = rx.recv_multipart(copy=False)
        msg = wire.decode(frames)
        out = _loader()._to_tensors(msg, 0)
        lo, hi = _frame_range(frames[1])
        t = out["input_ids"]
        assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi  # no copy
        assert torch.equal(t, torch.from_numpy(ids))
        t[0, 0] = -1  # received frames are writable: the trainer may modify its batch in place
        assert msg.array("input_ids")[0, 0] == -1
    finally:
        ctx.destroy(linger=0)


def test_read_only_and_unsigned_arrays_are_copied():
    ro = np.arange(6, dtype=np.int32)
    ro.flags.writeable = False
    t = _tensor(ro)
    assert t.data_ptr() != ro.ctypes.data and t.tolist() == list(range(6))
    t[0] = 7  # writing the copy leaves the read-only buffer untouched
    assert ro[0] == 0
    w = np.arange(6, dtype=np.int32)
    assert _tensor(w).data_ptr() == w.ctypes.data
    u = np.array([1, 65535], np.uint16)
    assert _tensor(u).dtype == torch.int64 and _tensor(u).tolist() == [1, 65535]


@pytest.mark.parametrize("dt, torch_dt", [("<u2", torch.int64), ("<u4", torch.int64), ("<u8", torch.int64),
                                          ("<i4", torch.int32), ("|u1", torch.uint8), ("|b1", torch.bool)])
def test_metadata_only_buffers_for_every_wire_dtype(dt, torch_dt):
    msg = wire.Message(Kind.STEP_DATA, {"step": 2, "rank": 1, "lr_scale": 1.0, "phase": 0, "meta_only": True,
                                        "shapes": {"x": [dt, [2, 3]]}})
    out = _loader()._to_tensors(msg, 2)
    assert out["x"].shape == (2, 3) and out["x"].dtype == torch_dt and bool(out["meta_only"])


def test_metadata_only_buffer_of_an_unknown_dtype_is_refused():
    msg = wire.Message(Kind.STEP_DATA, {"step": 2, "rank": 1, "lr_scale": 1.0, "phase": 0, "meta_only": True,
                                        "shapes": {"x": ["<c8", [2]]}})
    with pytest.raises(DeliveryError, match="'x' has dtype <c8"):
        _loader()._to_tensors(msg, 2)
