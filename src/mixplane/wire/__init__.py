"""mixplane's transport: framing (header + raw buffers, never pickle), socket policy, CURVE, liveness.

``mixplane.wire`` re-exports the public names of its parts, so callers write ``wire.send`` /
``wire.Kind`` / ``wire.Security`` whichever module holds them:

- :mod:`mixplane.wire.framing`  message kinds, encode / decode with validation and checksums
- :mod:`mixplane.wire.sockets`  high-water marks, deadlines, non-blocking sends, heartbeats
- :mod:`mixplane.wire.curve`    CURVE keys, the ZAP authenticator, per-component Security
- :mod:`mixplane.wire.liveness` who was heard from recently
"""

from __future__ import annotations

from mixplane.wire.curve import (
    PUBLIC_SUFFIX,
    SECRET_SUFFIX,
    Authenticator,
    CurveKeys,
    CurveSetup,
    Security,
    curve_client,
    curve_server,
    ensure_keys,
    ensure_rank_keys,
    generate_keys,
    has_rank_keys,
    rank_key_name,
    ranks_of_key_name,
    load_allowlist,
    load_keys,
    load_public_key,
    load_roles,
    role_of_key_name,
)
from mixplane.wire.framing import (
    ALLOWED_DTYPES,
    CRC,
    FLAG_CHECKSUM,
    HEADER,
    KNOWN_FLAGS,
    MAGIC,
    MAX_FRAMES,
    MAX_META_BYTES,
    PAYLOAD_KINDS,
    VERSION,
    ZERO_COPY_MIN_BYTES,
    Column,
    Kind,
    Message,
    WireError,
    decode,
    encode,
    encode_columns,
    recv,
    send,
    wants_checksum,
    END_MARKER,
    FLAG_END,
    peek_meta,
)
from mixplane.wire.liveness import Liveness
from mixplane.wire.sockets import (
    Backpressure,
    PeerTimeout,
    configure_socket,
    endpoint_of,
    heartbeat,
    recv_timeout,
    send_frames,
    try_send,
)

__all__ = [
    "ALLOWED_DTYPES", "CRC", "FLAG_CHECKSUM", "HEADER", "KNOWN_FLAGS", "MAGIC", "MAX_FRAMES", "MAX_META_BYTES",
    "PAYLOAD_KINDS", "PUBLIC_SUFFIX", "SECRET_SUFFIX", "VERSION", "ZERO_COPY_MIN_BYTES",
    "Authenticator", "Backpressure", "Column", "CurveKeys", "CurveSetup", "Kind", "Liveness", "Message", "PeerTimeout",
    "Security", "WireError",
    "configure_socket", "curve_client", "curve_server", "decode", "encode", "encode_columns", "endpoint_of", "ensure_keys",
    "ensure_rank_keys", "has_rank_keys", "rank_key_name", "ranks_of_key_name",
    "generate_keys", "heartbeat", "load_allowlist", "load_keys", "load_public_key", "load_roles", "recv", "role_of_key_name", "recv_timeout",
    "send", "send_frames", "try_send", "wants_checksum", "END_MARKER", "FLAG_END", "peek_meta",
]
