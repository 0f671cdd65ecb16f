"""Message framing for every mixplane socket: a small versioned header plus raw buffers.

A message is a list of ZeroMQ frames::

    frame 0   header: magic b"MXPL", version (u8), kind (u8), flags (u16), meta length (u32),
              followed by `meta` as UTF-8 JSON (small: ids, steps, array descriptors)
    frame 1.. raw array buffers, described in meta["arrays"] as [name, dtype, shape]

Nothing is ever pickled. Decoding validates everything a peer controls (magic, version, kind,
JSON, dtypes against an allowlist, buffer sizes against shapes) and raises :class:`WireError`
naming the problem, so a server can count and drop a bad message instead of crashing.

Flags (u16 in the header): bit 0 ``FLAG_CHECKSUM`` — the header frame ends with a CRC-32 of header and
meta, and ``meta["sums"]`` holds an xxh3-64 digest of every buffer; decode verifies both, so a message
damaged anywhere (bit flips, truncated or swapped frames) is rejected, never delivered. Bit 1 ``FLAG_END``
(bulk payloads, ``PAYLOAD_KINDS``: SAMPLES, STEP_DATA, whenever they are checksummed) — the last frame is an
end-of-message marker (``END_MARKER``, the message's frame count and payload bytes), so a message cut
short is named "truncated". Checksums cost about 1 ms per 30 MB here; every message carries them by
default (``checksum=None``); ``runtime.checksum_payloads: false`` turns them off for the payloads.
"""

from __future__ import annotations

import enum
import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xxhash

from mixplane.errors import MixplaneError


MAGIC = b"MXPL"
VERSION = 1
HEADER = struct.Struct("!4sBBHI")
MAX_META_BYTES = 16 << 20
MAX_FRAMES = 4096
FLAG_CHECKSUM = 0x0001
FLAG_END = 0x0002  # the last frame is the end-of-message marker (END_MARKER + frame count + payload bytes)
KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_END
CRC = struct.Struct("!I")
END_MARKER = b"MXPL:END"
END = struct.Struct("!8sIQ")
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
    RESHARD = 30  # admin -> planner: a new topology (DP/TP/PP/CP) from a step boundary (elastic resharding)
    # partition handoff (planner.partitions): values 40.. are the handoff's
    ADOPT = 40  # planner -> loader host: open a partition (as its primary, or as a shadow)
    RELEASE = 41  # planner -> loader: stop serving a partition (it moved to another host)
    FOLLOW = 42  # planner -> loader host: where a shadowed partition's primary stands (warm window)
    FENCE = 43  # planner -> constructor: drop SAMPLES of a partition's older epochs
    HANDOFF = 44  # admin -> planner: move a partition to another loader host at a step boundary
    REPARTITION = 45  # admin -> planner: read a source with another number of partitions from a step boundary
    RESEND = 22  # planner -> loader: push the SAMPLES of recent steps again to a restarted constructor
    LOSS_REPORT = 50  # trainer client -> planner: per-source token loss sums and token counts (one-way: no answer)


# bulk data: checksummed and closed by an end-of-message marker unless runtime.checksum_payloads is off
PAYLOAD_KINDS = frozenset({Kind.SAMPLES, Kind.STEP_DATA})


def wants_checksum(kind: Kind, checksum: bool | None = None) -> bool:
    """Whether a message of `kind` is checksummed: explicit choice, else always (xxh3 runs at several
    GB/s per core; see bench/transport.py for what it costs the payload path)."""
    return True if checksum is None else bool(checksum)


class WireError(MixplaneError, ValueError):
    """A message that does not follow the framing; the text names the field at fault."""


@dataclass
class Message:
    kind: Kind
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    flags: int = 0  # header flags it arrived with (FLAG_CHECKSUM: verified against its checksums)

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


def _digest(buf: Any) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


_DTYPES: dict[np.dtype, tuple[np.dtype, str]] = {}  # dtype -> (little-endian dtype, its JSON-quoted str)
_NAMES: dict[str, str] = {}  # array name -> its JSON string
_META_JSON = json.JSONEncoder(separators=(",", ":"), allow_nan=False)  # = json.dumps(.., separators, allow_nan=False)
# the C encoder JSONEncoder.encode builds on every call, built once (no circular-reference markers: a
# circular meta ends in RecursionError instead); the same text. None without the _json extension.
_c_make_encoder = getattr(json.encoder, "c_make_encoder", None)
_C_META_JSON = (_c_make_encoder(None, _META_JSON.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False,
                                False) if _c_make_encoder is not None else None)


def _wire_dtype(dtype: np.dtype, name: str) -> tuple[np.dtype, str]:
    got = _DTYPES.get(dtype)
    if got is None:
        dt = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
        if dt.str not in ALLOWED_DTYPES:
            raise WireError(f"array {name!r}: dtype {dt.str} cannot go on the wire")
        got = _DTYPES[dtype] = (dt, json.dumps(dt.str))
    return got


def _json_name(name: str) -> str:
    got = _NAMES.get(name)
    if got is None:
        got = json.dumps(name)
        if len(_NAMES) < 4096:  # array names are a small fixed set; never let odd ones grow this
            _NAMES[name] = got
    return got


def _meta_text(kind: Kind, meta: Mapping[str, Any] | None) -> str:
    """The caller's meta fields as JSON text (``arrays`` / ``sums`` are the framing's own)."""
    if not isinstance(meta, dict):  # any Mapping, as the signature says (the JSON encoder takes only dicts)
        meta = dict(meta or {})
    if "arrays" in meta or "sums" in meta:
        raise WireError(f"{kind.name}: meta keys 'arrays' and 'sums' are reserved")
    try:
        return "".join(_C_META_JSON(meta, 0)) if _C_META_JSON is not None else _META_JSON.encode(meta)
    except (TypeError, ValueError, RecursionError) as e:
        raise WireError(f"{kind.name}: meta cannot be sent as JSON ({e})") from None


def _flags(kind: Kind, checksum: bool) -> tuple[int, bool]:
    """(header flags, whether the message ends with the end-of-message marker)."""
    end = checksum and kind in PAYLOAD_KINDS  # bulk payloads also end with a marker: truncation is named as such
    return (FLAG_CHECKSUM if checksum else 0) | (FLAG_END if end else 0), end


def _frames(kind: Kind, flags: int, text: str, buffers: list, end: bool) -> list:
    """Header frame (+ CRC with FLAG_CHECKSUM), the buffers, and the end marker when `end`."""
    body = text.encode()
    if len(body) > MAX_META_BYTES:
        raise WireError(f"{kind.name}: meta of {len(body)} bytes exceeds {MAX_META_BYTES}")
    head = HEADER.pack(MAGIC, VERSION, int(kind), flags, len(body)) + body
    if flags & FLAG_CHECKSUM:
        head += CRC.pack(zlib.crc32(head))
    if end:
        return [head, *buffers, END.pack(END_MARKER, len(buffers) + 2, sum(_nbytes(b) for b in buffers))]
    return [head, *buffers]


def encode(kind: Kind, meta: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None,
           *, checksum: bool | None = None) -> list:
    """Frames for one message; large arrays are passed by reference (no copy).

    With ``checksum`` the message carries CRC-32 of header+meta and xxh3 of each buffer (FLAG_CHECKSUM);
    None (default) checksums control messages and not payloads (:func:`wants_checksum`).

    The meta JSON is the caller's fields, then ``arrays`` (descriptors) and ``sums``; those two are written
    straight as JSON text (the bytes json.dumps would give) -- encoding is per-message CPU the planner
    spends on every peer every step.
    """
    checksum = wants_checksum(kind, checksum)
    text = _meta_text(kind, meta)
    buffers: list = []
    extra: list[str] = []
    if arrays:
        descr = []
        for name, arr in arrays.items():
            a = arr if isinstance(arr, np.ndarray) and arr.ndim and arr.flags.c_contiguous else np.ascontiguousarray(arr)
            dt, dt_json = _wire_dtype(a.dtype, name)
            if dt is not a.dtype:
                a = a.astype(dt, copy=False)
            shape = str(a.shape[0]) if a.ndim == 1 else ",".join(map(str, a.shape))
            descr.append(f"[{_json_name(name)},{dt_json},[{shape}]]")
            buffers.append(a if a.nbytes >= ZERO_COPY_MIN_BYTES else a.tobytes())
        extra.append('"arrays":[' + ",".join(descr) + "]")
    if checksum:
        extra.append('"sums":[' + ",".join(f'"{_digest(b)}"' for b in buffers) + "]")
    if extra:
        text = "{" + ",".join(extra) + "}" if text == "{}" else text[:-1] + "," + ",".join(extra) + "}"
    flags, end = _flags(kind, checksum)
    return _frames(kind, flags, text, buffers, end)


@dataclass(frozen=True)
class Column:
    """One named array of every message of a batch (:func:`encode_columns`): message i carries
    ``data[bounds[i]:bounds[i + 1]]`` (1-d `data` cut into consecutive parts, e.g. every loader's
    instructions from the step's routing), or all of `data` when `bounds` is None (an array every message
    carries, e.g. the cursor after the step: converted and digested once for the batch)."""

    name: str
    data: np.ndarray
    bounds: Sequence[int] | np.ndarray | None = None


def _wire_array(a: Any, name: str) -> np.ndarray:
    """`a` as encode puts it on the wire: C-contiguous, at least 1-d, little-endian."""
    a = a if isinstance(a, np.ndarray) and a.ndim and a.flags.c_contiguous else np.ascontiguousarray(a)
    dt, _ = _wire_dtype(a.dtype, name)
    return a if dt is a.dtype else a.astype(dt, copy=False)


def _column_parts(col: Column, n: int, cuts: dict[tuple[int, int], tuple[np.ndarray, list[int], list[int]]]
                  ) -> tuple[str, list[int] | None, list[Any]]:
    """(descriptor up to the shape's numbers, each message's item count (None: shared), each message's buffer).
    `cuts`: the batch's bounds checked and converted, per (id(bounds), item size) -- columns cut alike share them."""
    a = _wire_array(col.data, col.name)
    pre = f"[{_json_name(col.name)},{_wire_dtype(a.dtype, col.name)[1]},["
    if col.bounds is None:
        return f"{pre}{','.join(map(str, a.shape))}]]", None, [a if a.nbytes >= ZERO_COPY_MIN_BYTES else a.tobytes()] * n
    if a.ndim != 1:
        raise WireError(f"column {col.name!r}: only 1-d arrays are cut into messages (shape {a.shape})")
    key = (id(col.bounds), a.dtype.itemsize)
    got = cuts.get(key)
    if got is None:
        b = np.asarray(col.bounds, np.int64)
        if len(b) != n + 1 or (n and (b[0] < 0 or bool(np.any(b[1:] < b[:-1])))):
            raise WireError(f"column {col.name!r}: bounds do not cut {len(a)} items into {n} messages")
        got = cuts[key] = (b, (b[1:] - b[:-1]).tolist(), (b * a.dtype.itemsize).tolist())
    b, counts, offs = got
    if n and b[-1] > len(a):
        raise WireError(f"column {col.name!r}: bounds do not cut {len(a)} items into {n} messages")
    mv = a.data.cast("B")
    return pre, counts, [mv[lo:hi] for lo, hi in zip(offs[:-1], offs[1:])]


def _descriptors(columns: Sequence[Column], parts: list[tuple[str, list[int] | None, list[Any]]], n: int) -> list[str]:
    """Each message's array descriptors (JSON text) from one template: the shared columns' descriptors
    written once, each cut column's item count a placeholder per distinct `bounds` (a loader's six arrays
    share one: a cached text per item count; a constructor's segments and images: two)."""
    groups: dict[int, int] = {}  # id(bounds) -> placeholder
    counts: list[list[int]] = []
    pieces = []
    for col, (pre, cnt, _) in zip(columns, parts):
        pre = pre.replace("{", "{{").replace("}", "}}")
        if cnt is None:
            pieces.append(pre)
            continue
        g = groups.setdefault(id(col.bounds), len(groups))
        if g == len(counts):
            counts.append(cnt)
        pieces.append(f"{pre}{{{g}}}]]")
    template = ",".join(pieces)
    if not counts:
        return [template.format()] * n
    if len(counts) > 1:
        return list(map(template.format, *counts))
    cache: dict[int, str] = {}
    out = []
    for k in counts[0]:
        got = cache.get(k)
        if got is None:
            got = cache[k] = template.format(k)
        out.append(got)
    return out


def encode_columns(kind: Kind, metas: Mapping[str, Any] | Sequence[Mapping[str, Any]], columns: Sequence[Column],
                   *, checksum: bool | None = None) -> list[list]:
    """Frames of a batch of messages of one kind: message i is, byte for byte, what :func:`encode` gives for
    ``metas[i]`` (or `metas` itself, one Mapping for all) and ``{c.name: c's part i for c in columns}``.

    Why: the planner sends every loader and constructor a message each step (1,280 at 16,384 GPUs x 1,024
    sources), and per-message Python work is most of what encoding costs. Here the work is done column by
    column: each column's slices, descriptors and digests in one pass, the meta JSON once when every message
    shares it, shared arrays converted and digested once. Buffers are zero-copy views of the columns:
    they must not change until the frames are sent (ZeroMQ copies those under its copy threshold).
    """
    checksum = wants_checksum(kind, checksum)
    cut = [c for c in columns if c.bounds is not None]
    if isinstance(metas, Mapping):
        if not cut:
            raise WireError(f"{kind.name}: one meta for a batch needs a cut column to count its messages")
        n = len(cut[0].bounds) - 1  # type: ignore[arg-type]
        texts = [_meta_text(kind, metas)] * n
    else:
        n = len(metas)
        texts = [_meta_text(kind, m) for m in metas]
    if not columns:
        return [encode(kind, m, checksum=checksum) for m in ([metas] * n if isinstance(metas, Mapping) else metas)]
    cuts: dict[tuple[int, int], tuple[np.ndarray, list[int], list[int]]] = {}
    parts = [_column_parts(c, n, cuts) for c in columns]
    if not n:
        return []
    descr = _descriptors(columns, parts, n)
    buffers = list(zip(*(b for _, _, b in parts)))
    if checksum:
        digest = [[_digest(b[0])] * n if counts is None else list(map(_digest, b)) for _, counts, b in parts]
        extra = [f'"arrays":[{d}],"sums":["{s}"]}}' for d, s in zip(descr, map('","'.join, zip(*digest)))]
    else:
        extra = [f'"arrays":[{d}]}}' for d in descr]
    flags, end = _flags(kind, checksum)
    if end:
        return [_frames(kind, flags, ("{" if t == "{}" else t[:-1] + ",") + x, list(b), end)
                for t, x, b in zip(texts, extra, buffers)]
    # _frames inlined (no end marker): the header's fixed part once, each message's length, meta and CRC
    bodies = [(("{" if t == "{}" else t[:-1] + ",") + x).encode() for t, x in zip(texts, extra)]
    if max(map(len, bodies)) > MAX_META_BYTES:
        raise WireError(f"{kind.name}: meta of {max(map(len, bodies))} bytes exceeds {MAX_META_BYTES}")
    fixed = HEADER.pack(MAGIC, VERSION, int(kind), flags, 0)[:-4]
    heads = [fixed + len(body).to_bytes(4, "big") + body for body in bodies]
    if checksum:
        crc32 = zlib.crc32
        heads = [h + crc32(h).to_bytes(4, "big") for h in heads]
    return [[h, *b] for h, b in zip(heads, buffers)]


def _nbytes(b: Any) -> int:
    return int(b.nbytes) if isinstance(b, np.ndarray) else len(b)


def peek_meta(frames: Sequence[Any]) -> dict[str, Any]:
    """Best effort, nothing verified: the meta of a message that failed to decode (to name its sender and
    step in a log line and to ask for it again). Empty when even that cannot be read."""
    try:
        head = _buffer(frames[0])
        _, _, _, _, meta_len = HEADER.unpack_from(head)
        meta = json.loads(bytes(head[HEADER.size: HEADER.size + meta_len]).decode())
        return meta if isinstance(meta, dict) else {}
    except Exception:  # noqa: BLE001 - damaged bytes may fail in any way
        return {}


def _buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    if isinstance(buf, memoryview):
        return buf
    return memoryview(frame).cast("B")  # numpy arrays handed over by encode (zero-copy)


def decode(frames: Sequence[Any]) -> Message:
    """Parse and validate frames; arrays are zero-copy views of the frames (writable for received frames).

    Anything a peer could get wrong raises :class:`WireError`; nothing else escapes.
    """
    if not frames:
        raise WireError("empty message")
    if len(frames) > MAX_FRAMES:
        raise WireError(f"message of {len(frames)} frames exceeds {MAX_FRAMES}")
    try:
        head = _buffer(frames[0])
    except (AttributeError, TypeError):
        raise WireError("header frame is not a buffer") from None
    if len(head) < HEADER.size:
        raise WireError(f"header frame of {len(head)} bytes is shorter than {HEADER.size}")
    magic, version, kind_v, flags, meta_len = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {VERSION})")
    try:
        kind = Kind(kind_v)
    except ValueError:
        raise WireError(f"unknown message kind {kind_v}") from None
    if flags & ~KNOWN_FLAGS:
        raise WireError(f"{kind.name}: unknown flags {flags:#06x}")
    if flags & FLAG_END:
        try:
            tail = _buffer(frames[-1]) if len(frames) > 1 else memoryview(b"")
        except (AttributeError, TypeError):
            raise WireError(f"{kind.name}: end-of-message frame is not a buffer") from None
        if tail.nbytes != END.size or bytes(tail[:len(END_MARKER)]) != END_MARKER:
            raise WireError(f"{kind.name}: truncated: no end-of-message marker (got {len(frames)} frames)")
        _, nframes, nbytes = END.unpack_from(tail)
        frames = frames[:-1]
        if nframes != len(frames) + 1:
            raise WireError(f"{kind.name}: truncated: the end marker counts {nframes} frames, {len(frames) + 1} arrived")
        got = 0
        for f in frames[1:]:
            try:
                got += _buffer(f).nbytes
            except (AttributeError, TypeError):
                raise WireError(f"{kind.name}: a frame is not a buffer") from None
        if got != nbytes:
            raise WireError(f"{kind.name}: truncated: the end marker counts {nbytes} payload bytes, {got} arrived")
    trailer = CRC.size if flags & FLAG_CHECKSUM else 0
    if meta_len > MAX_META_BYTES or meta_len != len(head) - HEADER.size - trailer:
        raise WireError(f"{kind.name}: meta length {meta_len} does not match frame ({len(head) - HEADER.size - trailer})")
    if trailer:
        (crc,) = CRC.unpack_from(head, HEADER.size + meta_len)
        if zlib.crc32(head[: HEADER.size + meta_len]) != crc:
            raise WireError(f"{kind.name}: header checksum mismatch")
    try:
        meta = json.loads(bytes(head[HEADER.size : HEADER.size + meta_len]).decode()) if meta_len else {}
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"{kind.name}: meta is not JSON ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise WireError(f"{kind.name}: meta is not an object")
    descr = meta.pop("arrays", [])
    sums = meta.pop("sums", None)
    if not isinstance(descr, list) or len(descr) != len(frames) - 1:
        raise WireError(f"{kind.name}: {len(frames) - 1} buffers but {len(descr) if isinstance(descr, list) else '?'} described")
    if trailer and not (isinstance(sums, list) and len(sums) == len(descr)):
        raise WireError(f"{kind.name}: checksummed message without one digest per buffer")
    arrays: dict[str, np.ndarray] = {}
    for i, d in enumerate(descr):
        if not (isinstance(d, list) and len(d) == 3 and isinstance(d[0], str) and isinstance(d[1], str) and isinstance(d[2], list)):
            raise WireError(f"{kind.name}: array descriptor {i} is malformed")
        name, dts, shape = d
        if name in arrays:
            raise WireError(f"{kind.name}: array {name!r} appears twice")
        if dts not in ALLOWED_DTYPES:
            raise WireError(f"{kind.name}: array {name!r} has forbidden dtype {dts!r}")
        if len(shape) > 8 or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < (1 << 40) for x in shape):
            raise WireError(f"{kind.name}: array {name!r} has a bad shape {shape!r}")
        dt = np.dtype(dts)
        try:
            buf = _buffer(frames[i + 1])
        except (AttributeError, TypeError):
            raise WireError(f"{kind.name}: frame {i + 1} is not a buffer") from None
        need = math.prod(shape) * dt.itemsize
        if need != buf.nbytes:
            raise WireError(f"{kind.name}: array {name!r} is {buf.nbytes} bytes, shape {shape} {dts} needs {need}")
        if trailer and sums[i] != _digest(buf):
            raise WireError(f"{kind.name}: array {name!r} checksum mismatch")
        arrays[name] = np.frombuffer(buf, dtype=dt).reshape(shape)
    return Message(kind, meta, arrays, flags)


def send(sock: Any, kind: Kind, meta: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None,
         *, route: Iterable[bytes] = (), flags: int = 0, checksum: bool | None = None) -> None:
    """Send one message, prefixed by ROUTER routing frames when given."""
    frames = [*route, *encode(kind, meta, arrays, checksum=checksum)]
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
