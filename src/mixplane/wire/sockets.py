"""Socket policy every component shares: high-water marks, send-with-deadline (backpressure),
non-blocking sends, receive with a deadline, ZMTP heartbeats and the size bound on received messages."""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.wire.framing import Kind, Message, encode, recv


class Backpressure(MixplaneError, TimeoutError):
    """A send that could not proceed before its deadline because the peer's queue is full (HWM)."""


class PeerTimeout(MixplaneError, TimeoutError):
    """No reply from a peer within the deadline; the message names the peer's endpoint."""


# A TCP connect that gets no answer is given up after this long and tried again on a new connection (ZeroMQ's
# default leaves it to the kernel: SYN retransmissions for ~127 s). On Kubernetes a connection to a ClusterIP
# is translated by kube-proxy's rules once, on its first SYN: a SYN sent while the rules change (a Service just
# created, its endpoint going ready) can go out untranslated, and its retransmissions keep that conntrack entry,
# so the connect hangs past the clients' 120 s step timeout while every new connection would be served (the
# likely cause of tests/k8s/test_e2e.py's flake: a constructor that never registered, so no trainer's ROUTE was
# answered; docs/deploy.md). A new connection has a new source port, hence a new conntrack entry, translated by
# the rules of that moment.
CONNECT_TIMEOUT_S = 3.0


def configure_socket(sock: Any, *, sndhwm: int | None = None, rcvhwm: int | None = None, linger_ms: int = 0,
                     heartbeat_s: float | None = None, router_mandatory: bool = False,
                     max_msgsize: int | None = None, connect_timeout_s: float | None = CONNECT_TIMEOUT_S) -> Any:
    """Apply mixplane's socket policy; call before bind / connect.

    High-water marks bound each queue (in messages): a full queue blocks the sender (backpressure)
    instead of growing memory. ZMTP heartbeats (PING/PONG) detect dead TCP peers within
    ``3 * heartbeat_s``. ``router_mandatory`` makes a ROUTER raise on an unknown peer instead of dropping.
    ``max_msgsize`` drops oversized messages at the transport before they are buffered.
    ``connect_timeout_s`` bounds a TCP connect without an answer (see CONNECT_TIMEOUT_S): the socket then
    connects again (messages queued meanwhile stay queued and go out on the new connection).
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
    if connect_timeout_s:
        sock.setsockopt(zmq.CONNECT_TIMEOUT, max(1, int(connect_timeout_s * 1000)))
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



def heartbeat(sock: Any, *, route: Iterable[bytes] = (), **meta: Any) -> bool:
    """Send a HEARTBEAT without blocking (dropped, not queued, when the peer is congested)."""
    return try_send(sock, Kind.HEARTBEAT, {"t": time.time(), **meta}, route=route, checksum=True)
