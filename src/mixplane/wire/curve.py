"""CURVE encryption: key files, the ZAP authenticator with its public-key allowlist, and the
per-component :class:`Security` that applies the spec's ``runtime.curve`` to sockets."""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol


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
    public: bytes | None = None
    secret: bytes | None = None
    for line in path.read_text().splitlines():
        line = line.strip()
        for key in ("public-key", "secret-key"):
            if line.startswith(key):
                v = line.partition("=")[2].strip().strip('"').encode()
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


def role_of_key_name(stem: str) -> str:
    """The role of a key file `<stem>.key` (the ZAP User-Id of its holder): the role names themselves,
    `server` (the pair components share) -> component, anything else a client without control rights."""
    if stem in ("component", "client", "admin"):
        return stem
    return "component" if stem == "server" else "client"


_RANK_KEY = re.compile(r"^client-r(\d+)(?:-(\d+))?$")


def ranks_of_key_name(stem: str) -> tuple[int, int] | None:
    """The trainer ranks a client key is bound to, from its file name: `client-r3` -> (3, 3),
    `client-r0-7` (a trainer pod's ranks) -> (0, 7); None for any other key."""
    m = _RANK_KEY.match(stem)
    if m is None:
        return None
    lo = int(m.group(1))
    return lo, int(m.group(2)) if m.group(2) is not None else lo


def rank_key_name(key_dir: str | os.PathLike, rank: int) -> str | None:
    """The name of the key pair in key_dir bound to `rank` (`client-r<rank>`, else a `client-r<a>-<b>`
    range holding it) whose secret is present; None when there is none."""
    d = Path(key_dir)
    if (d / f"client-r{rank}{SECRET_SUFFIX}").is_file():
        return f"client-r{rank}"
    for p in sorted(d.glob(f"client-r*{SECRET_SUFFIX}")):
        stem = p.name[: -len(SECRET_SUFFIX)]
        r = ranks_of_key_name(stem)
        if r is not None and r[0] <= rank <= r[1]:
            return stem
    return None


def has_rank_keys(key_dir: str | os.PathLike) -> bool:
    """Whether key_dir holds rank-bound client keys (then a run in `rank_binding: auto` requires them)."""
    return any(ranks_of_key_name(p.name[: -len(PUBLIC_SUFFIX)]) is not None
               for p in Path(key_dir).glob(f"client-r*{PUBLIC_SUFFIX}"))


def ensure_rank_keys(key_dir: str | os.PathLike, world_size: int) -> None:
    """One `client-r<N>` key pair per trainer rank (a rank's batches then go only to its key's holder)."""
    ensure_keys(key_dir, [f"client-r{r}" for r in range(world_size)])


def load_roles(key_dir: str | os.PathLike) -> dict[bytes, str]:
    """Public key -> ZAP User-Id of every `*.key` in key_dir (the allowlist with each key's role, and for
    rank-bound client keys the ranks: `client:3-3`, see protocol.parse_user_id)."""
    out: dict[bytes, str] = {}
    for p in sorted(Path(key_dir).glob(f"*{PUBLIC_SUFFIX}")):
        public, _ = _read_cert(p)
        if public is not None:
            stem = p.name[: -len(PUBLIC_SUFFIX)]
            role = role_of_key_name(stem)
            ranks = ranks_of_key_name(stem)
            if ranks is not None:
                role = f"{role}:{ranks[0]}-{ranks[1]}"
            if out.get(public) not in ("admin", "component"):  # one key in two files: the stronger role
                out[public] = role
    return out


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
    The ZAP User-Id of an admitted peer is its role (``roles``: public key -> role, from the key file
    names; keys without one are ``client``), which every message of the peer then carries (frame
    property ``User-Id``) for the component to check against ``protocol.ALLOWED_ROLES``.
    """

    def __init__(self, ctx: Any, allow: Iterable[bytes], *, key_dir: str | os.PathLike | None = None,
                 roles: dict[bytes, str] | None = None):
        import zmq

        self.ctx = ctx
        self.allow = set(allow)
        self.roles = dict(roles or {})
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
                        self.roles = load_roles(self.key_dir)
                        self.allow = set(self.roles)
                    except (OSError, ValueError):
                        pass
                    ok = key in self.allow
            if not ok:
                self.denied += 1
            user = self.roles.get(key, "client").encode() if ok else b""
            reply = [version, request_id, b"200" if ok else b"400", b"OK" if ok else text, user, b""]
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


class CurveSettings(Protocol):
    """What Security reads of its CURVE settings: the spec's ``runtime.curve`` (CurveSpec) or a control client's
    ControlCurve (always enabled)."""

    @property
    def enabled(self) -> bool: ...

    @property
    def key_dir(self) -> str | None: ...


class Security:
    """Transport security of one component, from the spec's ``runtime.curve`` (a no-op when disabled).

    Servers (binding sockets) present the ``server`` key pair and admit only clients whose public key
    is in the key directory (the allowlist, re-read when an unknown key knocks), each with the role its
    key file names (:func:`role_of_key_name`). Connecting sockets present the ``<role>`` pair when the
    key directory has one (``component``, ``admin``, ``client``), else the ``server`` pair (which
    stands for the component role).
    """

    def __init__(self, ctx: Any, curve: CurveSettings | None = None, *, name: str = "server", role: str | None = None):
        self.ctx = ctx
        self.enabled = curve is not None and curve.enabled
        self.key_dir = curve.key_dir if curve is not None and curve.enabled else None
        if self.enabled and not self.key_dir:
            raise ValueError("runtime.curve.enabled needs runtime.curve.key_dir")
        key_dir = self.key_dir  # set whenever enabled (checked above)
        self.keys = load_keys(key_dir, name) if key_dir else None
        self.client_keys = self.keys
        if key_dir and role and (Path(key_dir) / f"{role}{SECRET_SUFFIX}").exists():
            self.client_keys = load_keys(key_dir, role)
        self.server_public = load_public_key(key_dir, "server") if key_dir else None

    def _authenticator(self) -> Authenticator:
        with _AUTH_LOCK:  # one ZAP handler per context
            a = _AUTHENTICATORS.get(id(self.ctx))
            if a is None or a.ctx is not self.ctx:
                assert self.key_dir, "an authenticator is made for an enabled transport only"
                roles = load_roles(self.key_dir)
                a = _AUTHENTICATORS[id(self.ctx)] = Authenticator(self.ctx, set(roles), key_dir=self.key_dir, roles=roles)
            return a

    def server(self, sock: Any) -> Any:
        if self.enabled:
            self._authenticator()
            curve_server(sock, self.keys)  # type: ignore[arg-type]
        return sock

    def client(self, sock: Any) -> Any:
        if self.enabled:
            curve_client(sock, self.client_keys, self.server_public)  # type: ignore[arg-type]
        return sock
