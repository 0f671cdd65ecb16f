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
damaged anywhere (bit flips, truncated or swapped frames) is rejected, never delivered. Checksums cost
about 1 ms per 30 MB here; every message except the bulk payloads (``PAYLOAD_KINDS``: SAMPLES,
STEP_DATA) carries them by default (``checksum=None``), payloads when ``runtime.checksum_payloads`` is set.

Beyond framing this module holds the socket policy every component shares: high-water marks and
send-with-deadline (backpressure), ZMTP heartbeats plus an application-level liveness table, and
CURVE encryption with a public-key allowlist enforced by a ZAP authenticator.
"""

from __future__ import annotations

import enum
import json
import math
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xxhash


MAGIC = b"MXPL"
VERSION = 1
HEADER = struct.Struct("!4sBBHI")
MAX_META_BYTES = 16 << 20
MAX_FRAMES = 4096
FLAG_CHECKSUM = 0x0001
KNOWN_FLAGS = FLAG_CHECKSUM
CRC = struct.Struct("!I")
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


# bulk data: checksummed only on request (runtime.checksum_payloads); everything else always
PAYLOAD_KINDS = frozenset({Kind.SAMPLES, Kind.STEP_DATA})


def wants_checksum(kind: Kind, checksum: bool | None = None) -> bool:
    """Whether a message of `kind` is checksummed: explicit choice, else control messages only
    (they are small, so damage to a plan or a cursor is caught at no measurable cost)."""
    return (kind not in PAYLOAD_KINDS) if checksum is None else bool(checksum)


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


def _digest(buf: Any) -> str:
    return xxhash.xxh3_64_hexdigest(buf)


def encode(kind: Kind, meta: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None,
           *, checksum: bool | None = None) -> list:
    """Frames for one message; large arrays are passed by reference (no copy).

    With ``checksum`` the message carries CRC-32 of header+meta and xxh3 of each buffer (FLAG_CHECKSUM);
    None (default) checksums control messages and not payloads (:func:`wants_checksum`).
    """
    checksum = wants_checksum(kind, checksum)
    meta = dict(meta or {})
    if "arrays" in meta or "sums" in meta:
        raise WireError(f"{kind.name}: meta keys 'arrays' and 'sums' are reserved")
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
    if checksum:
        meta["sums"] = [_digest(b) for b in buffers]
    try:
        body = json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise WireError(f"{kind.name}: meta cannot be sent as JSON ({e})") from None
    if len(body) > MAX_META_BYTES:
        raise WireError(f"{kind.name}: meta of {len(body)} bytes exceeds {MAX_META_BYTES}")
    head = HEADER.pack(MAGIC, VERSION, int(kind), FLAG_CHECKSUM if checksum else 0, len(body)) + body
    if checksum:
        head += CRC.pack(zlib.crc32(head))
    return [head, *buffers]


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
    return Message(kind, meta, arrays)


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


# ------------------------------------------------------------------------------------------- socket policy
class Backpressure(TimeoutError):
    """A send that could not proceed before its deadline because the peer's queue is full (HWM)."""


class PeerTimeout(TimeoutError):
    """No reply from a peer within the deadline; the message names the peer's endpoint."""


def configure_socket(sock: Any, *, sndhwm: int | None = None, rcvhwm: int | None = None, linger_ms: int = 0,
                     heartbeat_s: float | None = None, router_mandatory: bool = False,
                     max_msgsize: int | None = None) -> Any:
    """Apply mixplane's socket policy; call before bind / connect.

    High-water marks bound each queue (in messages): a full queue blocks the sender (backpressure)
    instead of growing memory. ZMTP heartbeats (PING/PONG) detect dead TCP peers within
    ``3 * heartbeat_s``. ``router_mandatory`` makes a ROUTER raise on an unknown peer instead of dropping.
    ``max_msgsize`` drops oversized messages at the transport before they are buffered.
    """
    import zmq

    if sndhwm is not None:
        sock.setsockopt(zmq.SNDHWM, int(sndhwm))
    if rcvhwm is not None:
        sock.setsockopt(zmq.RCVHWM, int(rcvhwm))
    sock.setsockopt(zmq.LINGER, int(linger_ms))
    if heartbeat_s:
        ivl = max(1, int(heartbeat_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl)
    if router_mandatory and sock.type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if max_msgsize is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, int(max_msgsize))
    return sock


def endpoint_of(sock: Any) -> str:
    """The endpoint a socket is bound or connected to (for error messages)."""
    import zmq

    try:
        ep = sock.getsockopt(zmq.LAST_ENDPOINT)
        ep = ep.decode() if isinstance(ep, bytes) else str(ep)
    except zmq.ZMQError:
        ep = ""
    return ep or getattr(sock, "mixplane_endpoint", "<unconnected>")


def send_frames(sock: Any, frames: list, *, timeout_s: float | None = None, what: str = "") -> None:
    """Send frames, waiting at most `timeout_s` for room under the high-water mark.

    Raises :class:`Backpressure` naming the endpoint when the peer does not drain in time.
    """
    import zmq

    if timeout_s is None:
        sock.send_multipart(frames, copy=False)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Backpressure(f"{what or 'send'} to {endpoint_of(sock)}: peer queue full for {timeout_s:.1f}s") from None
            sock.poll(int(min(left, 0.1) * 1000) + 1, zmq.POLLOUT)


def try_send(sock: Any, kind: Kind, meta: Mapping[str, Any] | None = None, arrays: Mapping[str, np.ndarray] | None = None,
             *, route: Iterable[bytes] = (), checksum: bool | None = None) -> bool:
    """Send without blocking; False when the high-water mark is reached (the caller keeps the message)."""
    import zmq

    try:
        sock.send_multipart([*route, *encode(kind, meta, arrays, checksum=checksum)], flags=zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        return False


def recv_timeout(sock: Any, timeout_s: float, *, routed: bool = False, what: str = "") -> tuple[list[bytes], Message]:
    """Receive one message or raise :class:`PeerTimeout` naming the socket's endpoint."""
    import zmq

    if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
        raise PeerTimeout(f"{what or 'no message'} from {endpoint_of(sock)} within {timeout_s:g}s")
    return recv(sock, routed=routed)


class Liveness:
    """Application-level liveness of peers: who was heard from recently (any message counts)."""

    def __init__(self, interval_s: float, misses: int = 3, clock=time.monotonic):
        self.interval_s = interval_s
        self.misses = misses
        self.clock = clock
        self.last: dict[bytes, float] = {}
        self._next_beat = 0.0

    def seen(self, peer: bytes) -> None:
        self.last[peer] = self.clock()

    def forget(self, peer: bytes) -> None:
        self.last.pop(peer, None)

    def expired(self) -> list[bytes]:
        """Peers silent for longer than misses * interval (removed from the table)."""
        limit = self.clock() - self.misses * self.interval_s
        dead = [p for p, t in self.last.items() if t < limit]
        for p in dead:
            del self.last[p]
        return dead

    def due(self) -> bool:
        """True once per interval: time to send our own HEARTBEAT."""
        now = self.clock()
        if now >= self._next_beat:
            self._next_beat = now + self.interval_s
            return True
        return False


def heartbeat(sock: Any, *, route: Iterable[bytes] = (), **meta: Any) -> bool:
    """Send a HEARTBEAT without blocking (dropped, not queued, when the peer is congested)."""
    return try_send(sock, Kind.HEARTBEAT, {"t": time.time(), **meta}, route=route, checksum=True)


# ------------------------------------------------------------------------------------------- CURVE
@dataclass(frozen=True)
class CurveKeys:
    """A component's CURVE key pair (Z85 text, 40 bytes each)."""

    public: bytes
    secret: bytes


PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"


def generate_keys(key_dir: str | os.PathLike, name: str) -> CurveKeys:
    """Create `<name>.key` (public, shareable) and `<name>.key_secret` (mode 0600) in key_dir."""
    import zmq

    d = Path(key_dir)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    header = f"#   mixplane CURVE certificate {name}\n#   generated {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n"
    (d / f"{name}{PUBLIC_SUFFIX}").write_text(f'{header}metadata\ncurve\n    public-key = "{public.decode()}"\n')
    sp = d / f"{name}{SECRET_SUFFIX}"
    fd = os.open(sp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'{header}metadata\ncurve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n')
    return CurveKeys(public, secret)


def _read_cert(path: Path) -> tuple[bytes | None, bytes | None]:
    public = secret = None
    for line in path.read_text().splitlines():
        line = line.strip()
        for key in ("public-key", "secret-key"):
            if line.startswith(key):
                _, _, v = line.partition("=")
                v = v.strip().strip('"').encode()
                if len(v) != 40:
                    raise ValueError(f"{path}: {key} is not a 40-character Z85 key")
                if key == "public-key":
                    public = v
                else:
                    secret = v
    return public, secret


def load_keys(key_dir: str | os.PathLike, name: str) -> CurveKeys:
    """Load `<name>`'s key pair; errors name the file."""
    p = Path(key_dir) / f"{name}{SECRET_SUFFIX}"
    if not p.exists():
        raise FileNotFoundError(f"{p}: no CURVE secret key for {name!r} (create it with generate_keys)")
    public, secret = _read_cert(p)
    if public is None or secret is None:
        raise ValueError(f"{p}: not a CURVE key pair")
    return CurveKeys(public, secret)


def load_public_key(key_dir: str | os.PathLike, name: str) -> bytes:
    p = Path(key_dir) / f"{name}{PUBLIC_SUFFIX}"
    if not p.exists():
        raise FileNotFoundError(f"{p}: no CURVE public key for {name!r}")
    public, _ = _read_cert(p)
    if public is None:
        raise ValueError(f"{p}: no public-key line")
    return public


def load_allowlist(key_dir: str | os.PathLike) -> set[bytes]:
    """Every public key (`*.key`) in key_dir: the clients allowed to connect."""
    out = set()
    for p in sorted(Path(key_dir).glob(f"*{PUBLIC_SUFFIX}")):
        public, _ = _read_cert(p)
        if public is not None:
            out.add(public)
    return out


def curve_server(sock: Any, keys: CurveKeys) -> Any:
    """Make a (binding) socket a CURVE server; call before bind. Needs a running :class:`Authenticator`."""
    import zmq

    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"mixplane")
    return sock


def curve_client(sock: Any, keys: CurveKeys, server_public: bytes) -> Any:
    """Make a (connecting) socket a CURVE client of the server with `server_public`; call before connect."""
    import zmq

    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    return sock


class Authenticator:
    """ZAP handler of one ZeroMQ context: CURVE clients whose public key is on the allowlist get in.

    Runs a small thread answering the context's ZAP requests (RFC 27); denied peers never complete
    the handshake, so no message of theirs reaches the server socket. ``allow`` may be updated live.
    """

    def __init__(self, ctx: Any, allow: Iterable[bytes], *, key_dir: str | os.PathLike | None = None):
        import zmq

        self.ctx = ctx
        self.allow = set(allow)
        self.key_dir = key_dir  # when set, an unknown key triggers (at most once a second) a re-read of the allowlist
        self._reloaded = 0.0
        self.denied = 0
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind("inproc://zeromq.zap.01")
        self._thread = threading.Thread(target=self._run, name="mixplane-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq
        import zmq.utils.z85

        while not self._stop.is_set():
            try:
                if not self._sock.poll(100):
                    continue
                msg = self._sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(msg) < 6:
                continue
            version, request_id, _domain, _address, _identity, mechanism = msg[:6]
            ok, text = False, b"not allowed"
            if mechanism == b"CURVE" and len(msg) >= 7:
                key = zmq.utils.z85.encode(msg[6]) if len(msg[6]) == 32 else b""
                ok = key in self.allow
                if not ok and self.key_dir is not None and time.monotonic() - self._reloaded > 1.0:
                    self._reloaded = time.monotonic()
                    try:
                        self.allow = load_allowlist(self.key_dir)
                    except (OSError, ValueError):
                        pass
                    ok = key in self.allow
            if not ok:
                self.denied += 1
            reply = [version, request_id, b"200" if ok else b"400", b"OK" if ok else text, b"", b""]
            try:
                self._sock.send_multipart(reply)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)

    def __enter__(self) -> "Authenticator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class CurveSetup:
    """CURVE settings of one component: its keys, the allowlist (servers) and known server keys (clients)."""

    keys: CurveKeys
    allow: set[bytes] = field(default_factory=set)
    key_dir: str = ""

    @classmethod
    def from_dir(cls, key_dir: str | os.PathLike, name: str) -> "CurveSetup":
        return cls(load_keys(key_dir, name), load_allowlist(key_dir), str(key_dir))

    def server_key(self, name: str) -> bytes:
        return load_public_key(self.key_dir, name)


def ensure_keys(key_dir: str | os.PathLike, names: Iterable[str] = ("server", "client")) -> None:
    """Create the named key pairs in key_dir unless they exist (call once before starting components)."""
    for name in names:
        if not (Path(key_dir) / f"{name}{SECRET_SUFFIX}").exists():
            generate_keys(key_dir, name)


_AUTHENTICATORS: dict[int, Authenticator] = {}
_AUTH_LOCK = threading.Lock()


class Security:
    """Transport security of one component, from the spec's ``runtime.curve`` (a no-op when disabled).

    Servers (binding sockets) present the ``server`` key pair and admit only clients whose public key
    is in the key directory (the allowlist, re-read when an unknown key knocks); components connecting
    to other components use the ``server`` pair as well (they are trusted), trainer clients their own.
    """

    def __init__(self, ctx: Any, curve: Any = None, *, name: str = "server"):
        self.ctx = ctx
        self.enabled = bool(curve is not None and getattr(curve, "enabled", False))
        self.key_dir = getattr(curve, "key_dir", None) if self.enabled else None
        if self.enabled and not self.key_dir:
            raise ValueError("runtime.curve.enabled needs runtime.curve.key_dir")
        self.keys = load_keys(self.key_dir, name) if self.enabled else None
        self.server_public = load_public_key(self.key_dir, "server") if self.enabled else None

    def _authenticator(self) -> Authenticator:
        with _AUTH_LOCK:  # one ZAP handler per context
            a = _AUTHENTICATORS.get(id(self.ctx))
            if a is None or a.ctx is not self.ctx:
                a = _AUTHENTICATORS[id(self.ctx)] = Authenticator(self.ctx, load_allowlist(self.key_dir), key_dir=self.key_dir)
            return a

    def server(self, sock: Any) -> Any:
        if self.enabled:
            self._authenticator()
            curve_server(sock, self.keys)  # type: ignore[arg-type]
        return sock

    def client(self, sock: Any) -> Any:
        if self.enabled:
            curve_client(sock, self.keys, self.server_public)  # type: ignore[arg-type]
        return sock
