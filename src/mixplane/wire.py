"""Message framing for every mixplane socket: a small versioned header plus raw buffers.

A message is a list of ZeroMQ frames::

    frame 0   header: magic b"MXPL", version (u8), kind (u8), flags (u16), meta length (u32),
              followed by `meta` as UTF-8 JSON (small: ids, steps, array descriptors)
    frame 1.. raw array buffers, described in meta["arrays"] as [name, dtype, shape]

Nothing is ever pickled. Decoding validates everything a peer controls (magic, version, kind,
JSON, dtypes against an allowlist, buffer sizes against shapes) and raises :class:`WireError`
naming the problem, so a server can count and drop a bad message instead of crashing.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

MAGIC = b"MXPL"
VERSION = 1
HEADER = struct.Struct("!4sBBHI")
MAX_META_BYTES = 16 << 20
ZERO_COPY_MIN_BYTES = 64 << 10
ALLOWED_DTYPES = frozenset(
    ["|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"]
)


class Kind(enum.IntEnum):
    """Message kinds; values are part of the wire format, never reuse one."""

    HELLO = 1  # component registers with the planner
    WELCOME = 2  # planner's reply to HELLO (peer endpoints, session)
    HEARTBEAT = 3
    LOADER_META = 4  # loader -> planner: metadata of newly buffered samples
    PLAN_LOADER = 5  # planner -> loader: which buffered samples go to which constructor
    PLAN_CONSTRUCTOR = 6  # planner -> constructor: the step layout for its ranks
    SAMPLES = 7  # loader -> constructor: payloads of planned samples
    NEED_STEPS = 8  # constructor -> planner: plan up to this step
    GET_STEP = 9  # client -> constructor
    STEP_DATA = 10  # constructor -> client
    ROUTE = 11  # client -> planner: which constructor serves this rank?
    ROUTE_REPLY = 12
    RESUME = 13  # client/constructor -> planner: restart delivery from a cursor
    SEEK = 14  # planner -> loader: reset the stream to a cursor (new session)
    STATUS = 15  # anyone -> planner: progress and health
    STATUS_REPLY = 16
    UPDATE_MIXTURE = 17  # operator/CLI -> planner: new spec generation
    ACK = 18
    ERROR = 19
    SHUTDOWN = 20
    RESET = 21  # planner -> constructor: drop all steps of older sessions


class WireError(ValueError):
    """A message that does not follow the framing; the text names the field at fault."""


@dataclass
class Message:
    kind: Kind
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def array(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise WireError(f"{self.kind.name}: missing array {name!r}") from None

    def get(self, name: str, typ: type | tuple[type, ...] = object) -> Any:
        """A required meta field of the expected type, or WireError naming it."""
        if name not in self.meta:
            raise WireError(f"{self.kind.name}: missing field {name!r}")
        value = self.meta[name]
        if typ is not object and not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise WireError(f"{self.kind.name}: field {name!r} has type {type(value).__name__}")
        return value


def encode(kind: Kind, meta: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None) -> list:
    """Frames for one message; large arrays are passed by reference (no copy)."""
    meta = dict(meta or {})
    buffers: list = []
    if arrays:
        descr = []
        for name, arr in arrays.items():
            a = np.ascontiguousarray(arr)
            dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
            a = a.astype(dt, copy=False)
            if dt.str not in ALLOWED_DTYPES:
                raise WireError(f"array {name!r}: dtype {dt.str} cannot go on the wire")
            descr.append([name, dt.str, list(a.shape)])
            buffers.append(a if a.nbytes >= ZERO_COPY_MIN_BYTES else a.tobytes())
        meta["arrays"] = descr
    body = json.dumps(meta, separators=(",", ":")).encode()
    if len(body) > MAX_META_BYTES:
        raise WireError(f"{kind.name}: meta of {len(body)} bytes exceeds {MAX_META_BYTES}")
    return [HEADER.pack(MAGIC, VERSION, int(kind), 0, len(body)) + body, *buffers]


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    return frame.buffer  # zmq.Frame received with copy=False


def decode(frames: Sequence[Any]) -> Message:
    """Parse and validate frames; arrays are zero-copy, read-only views of the frames."""
    if not frames:
        raise WireError("empty message")
    head = _buffer(frames[0])
    if len(head) < HEADER.size:
        raise WireError(f"header frame of {len(head)} bytes is shorter than {HEADER.size}")
    magic, version, kind_v, _flags, meta_len = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {VERSION})")
    try:
        kind = Kind(kind_v)
    except ValueError:
        raise WireError(f"unknown message kind {kind_v}") from None
    if meta_len != len(head) - HEADER.size:
        raise WireError(f"{kind.name}: meta length {meta_len} does not match frame ({len(head) - HEADER.size})")
    try:
        meta = json.loads(bytes(head[HEADER.size :]).decode()) if meta_len else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"{kind.name}: meta is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise WireError(f"{kind.name}: meta is not an object")
    descr = meta.pop("arrays", [])
    if not isinstance(descr, list) or len(descr) != len(frames) - 1:
        raise WireError(f"{kind.name}: {len(frames) - 1} buffers but {len(descr) if isinstance(descr, list) else '?'} described")
    arrays: dict[str, np.ndarray] = {}
    for i, d in enumerate(descr):
        if not (isinstance(d, list) and len(d) == 3 and isinstance(d[0], str) and isinstance(d[1], str) and isinstance(d[2], list)):
            raise WireError(f"{kind.name}: array descriptor {i} is malformed")
        name, dts, shape = d
        if dts not in ALLOWED_DTYPES:
            raise WireError(f"{kind.name}: array {name!r} has forbidden dtype {dts!r}")
        if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < (1 << 40) for s in shape):
            raise WireError(f"{kind.name}: array {name!r} has a bad shape {shape!r}")
        dt = np.dtype(dts)
        buf = _buffer(frames[i + 1])
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if n * dt.itemsize != len(buf):
            raise WireError(f"{kind.name}: array {name!r} is {len(buf)} bytes, shape {shape} {dts} needs {n * dt.itemsize}")
        arrays[name] = np.frombuffer(buf, dtype=dt).reshape(shape)
    return Message(kind, meta, arrays)


def send(sock: Any, kind: Kind, meta: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None,
         *, route: Iterable[bytes] = (), flags: int = 0) -> None:
    """Send one message, prefixed by ROUTER routing frames when given."""
    frames = [*route, *encode(kind, meta, arrays)]
    sock.send_multipart(frames, flags=flags, copy=False)


def recv(sock: Any, *, routed: bool = False, flags: int = 0) -> tuple[list[bytes], Message]:
    """Receive one message; with ``routed`` the leading identity frames (ROUTER) are split off."""
    frames = sock.recv_multipart(flags=flags, copy=False)
    route: list[bytes] = []
    if routed:
        # ROUTER prepends the peer identity; DEALER peers send no empty delimiter.
        if not frames:
            raise WireError("empty message")
        route = [frames[0].bytes]
        frames = frames[1:]
    return route, decode(frames)
