"""What the components say to each other, as one pure module both ends import.

- payload schemas: the meta fields (with types) and arrays each message kind must carry, checked once
  by the component base before a handler runs (:func:`check`), so a handler can trust them;
- the field lists shared by sender and receiver (the STEP_DATA encoder batch, SAMPLES image arrays);
- the loader window cursor ``{low, next, skip, partial}`` (:class:`WindowCursor`) with the one
  validating parser the planner and the loaders use, and :func:`window_full`, the predicate that
  makes both agree on a window's exact content;
- who may send what: the role table of every message kind (:data:`ALLOWED_ROLES`).

No sockets, no processes: this module only describes messages.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Mapping, overload

import numpy as np

from mixplane.wire.framing import HEADER, MAX_META_BYTES, Kind, Message, WireError

# ---------------------------------------------------------------------------------------------- field lists
#: STEP_DATA arrays of the encoder batch (per rank; never part of a TP broadcast of the backbone's tensors)
ENCODER_FIELDS = ("pixel_patches", "patch_cu_seqlens", "image_grid", "patch_position_ids", "image_ids", "image_quarantined")
#: SAMPLES arrays of the token spans and (image_text sources) of the pixels of the sample's image
SAMPLES_ARRAYS = ("key", "start", "len", "offsets", "values")
SAMPLES_IMAGE_ARRAYS = ("img_key", "img_grid", "img_offsets", "img_values")
#: PLAN_LOADER arrays (planner.routing.Instructions)
PLAN_LOADER_ARRAYS = ("pos", "start", "len", "dest", "retire", "img")
#: LOADER_META arrays
LOADER_META_ARRAYS = ("pos", "key", "tokens", "patches")
#: STEP_DATA meta keys every reply carries
STEP_DATA_FIELDS = ("step", "rank", "phase", "lr_scale", "generation", "session", "microbatches", "seq_len",
                    "cursor_after", "meta_only", "coords")


# ---------------------------------------------------------------------------------------------- schemas
@dataclass(frozen=True)
class Schema:
    """Required meta fields (name -> accepted types) and arrays of one message kind."""

    fields: Mapping[str, type | tuple[type, ...]] = field(default_factory=dict)
    arrays: tuple[str, ...] = ()


_NUM = (int, float)
SCHEMAS: dict[Kind, Schema] = {
    Kind.HELLO: Schema({"role": str}),
    Kind.WELCOME: Schema({"session": int}),
    Kind.HEARTBEAT: Schema(),
    Kind.LOADER_META: Schema({"session": int, "source": int, "replica": int}, LOADER_META_ARRAYS),
    Kind.PLAN_LOADER: Schema({"session": int, "step": int}, PLAN_LOADER_ARRAYS),
    Kind.PLAN_CONSTRUCTOR: Schema({"session": int}),
    Kind.SAMPLES: Schema({"session": int, "step": int, "source": int}, SAMPLES_ARRAYS),
    Kind.NEED_STEPS: Schema({"session": int, "through": int}),
    Kind.GET_STEP: Schema({"step": int, "rank": int}),
    Kind.STEP_DATA: Schema({"step": int, "phase": int, "lr_scale": _NUM}),
    Kind.ROUTE: Schema(),
    Kind.ROUTE_REPLY: Schema({"endpoint": str, "coords": dict, "sources": list}),
    Kind.RESUME: Schema({"cursor": dict}),
    Kind.SEEK: Schema({"session": int, "cursor": dict}),
    Kind.STATUS: Schema(),
    Kind.STATUS_REPLY: Schema(),
    Kind.UPDATE_MIXTURE: Schema(),  # `mixture` + `update_id` or `weights`: the planner checks it (StepPlanner.apply_update)
    Kind.ACK: Schema(),
    Kind.ERROR: Schema(),
    Kind.SHUTDOWN: Schema(),
    Kind.RESET: Schema({"session": int, "start_step": int}),
    Kind.RESHARD: Schema({"topology": dict}),  # + `cursor` (a trainer's) or `reshard_id` (the next unplanned step)
    Kind.ADOPT: Schema({"source": int, "replica": int, "epoch": int, "mode": str}),
    Kind.RELEASE: Schema({"source": int, "replica": int, "epoch": int}),
    Kind.FOLLOW: Schema({"source": int, "replica": int, "cursor": dict}),
    Kind.FENCE: Schema({"source": int, "replica": int, "epoch": int}),
    Kind.HANDOFF: Schema({"partition": str, "to": str}),
    Kind.REPARTITION: Schema({"source": str, "partitions": int}),  # + `step` (default: the first unplanned), `hosts`,
    # `repartition_id` (applied once: a repeat is acknowledged with `duplicate`)
    Kind.RESEND: Schema({"session": int, "constructor": int, "from_step": int}),
    Kind.LOSS_REPORT: Schema({"rank": int, "from_step": int, "step": int, "loss": list, "tokens": list}),
}


def check(msg: Message) -> Message:
    """Raise WireError naming the first required field or array `msg` lacks (or carries with a wrong type)."""
    schema = SCHEMAS.get(msg.kind)
    if schema is None:
        raise WireError(f"{msg.kind.name}: no schema")
    for name, typ in schema.fields.items():
        msg.get(name, typ)
    for name in schema.arrays:
        msg.array(name)
    return msg


# ---------------------------------------------------------------------------------------------- size limits
CONTROL_FRAME_BYTES = 1 << 20  # what a trainer client ever sends a constructor (GET_STEP, HEARTBEAT) fits easily


def max_message_bytes(spec: Any, socket: str) -> int:
    """The largest frame a component's `socket` can legitimately receive under `spec` (ZeroMQ MAXMSGSIZE,
    which libzmq checks per frame before buffering it): anything larger is garbage or an attack.

    ``planner``: control messages and LOADER_META (8 bytes per window sample); ``data`` (a constructor's
    SAMPLES): one step's tokens (int32, one label token per span) and the pixels of its images;
    ``clients`` (a constructor's client socket): small requests only; ``loader`` (from the planner):
    one step's PLAN_LOADER arrays."""
    meta = HEADER.size + MAX_META_BYTES + 4
    tokens = int(spec.tokens_per_step)
    rows = int(spec.rows_per_step)
    if socket == "planner":
        return max(meta, 8 * int(spec.runtime.window_max))
    if socket == "data":
        px = 0
        for src in spec.sources:
            if src.kind == "image_text":
                img = src.image
                px = max(px, tokens * int(img.merge) * int(img.patch_size) ** 2 * 3)
        return max(meta, 8 * (tokens + rows + 1), px + (1 << 20))
    if socket == "clients":
        return CONTROL_FRAME_BYTES
    if socket == "loader":
        return max(meta, 8 * 4 * (tokens + rows) * max(1, int(spec.world_size)))
    raise ValueError(f"unknown socket {socket!r}")


# ---------------------------------------------------------------------------------------------- window cursor
@dataclass(frozen=True)
class WindowCursor:
    """Where a loader replica's window stands: every position below ``low`` is consumed, ``next`` is
    the first position the planner has not seen, ``skip`` the consumed positions in between and
    ``partial`` the tokens already delivered of partly consumed samples (position -> tokens).

    ``listing`` (live sources only): the file listing the positions were counted over — the stream's
    segments in order, each the paths that joined it — so a loader restarted after files were added
    (or a replay, or a resume in a new run) numbers the positions the same way instead of over today's
    listing. None: not recorded (a static source, or an older cursor)."""

    low: int
    next: int
    skip: frozenset[int] = frozenset()
    partial: Mapping[int, int] = field(default_factory=dict)
    listing: tuple[tuple[str, ...], ...] | None = None

    @classmethod
    def parse(cls, cur: Any) -> "WindowCursor":
        """The one validating parser (planner restore, loader seek); ValueError naming what is wrong."""
        try:
            if not isinstance(cur, Mapping):
                raise TypeError(f"a cursor is a mapping, not {type(cur).__name__}")
            low = _int(cur["low"], "low")
            nxt = _int(cur.get("next", low), "next")
            skip_in = cur.get("skip", [])
            if not isinstance(skip_in, (list, tuple, set, frozenset)):
                raise TypeError("skip is not a list")
            skip = frozenset(_int(p, "skip") for p in skip_in)
            partial_in = cur.get("partial", {})
            if not isinstance(partial_in, Mapping):
                raise TypeError("partial is not a mapping")
            partial = {_int(p, "partial position"): _int(d, "partial tokens") for p, d in partial_in.items()}
            listing = parse_listing(cur.get("listing"))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"window cursor is malformed ({e})") from None
        if low < 0 or any(p < low for p in skip) or any(d <= 0 for d in partial.values()):
            raise ValueError("window cursor is inconsistent (negative or out-of-range positions)")
        if nxt < low:
            raise ValueError(f"window cursor is inconsistent (next {nxt} < low {low})")
        return cls(low, nxt, skip, partial, listing)

    def to_json(self) -> dict[str, Any]:
        """The wire / journal form (JSON object keys are strings)."""
        out: dict[str, Any] = {"low": self.low, "next": self.next, "skip": sorted(self.skip),
                               "partial": {str(p): int(d) for p, d in sorted(self.partial.items())}}
        if self.listing is not None:
            out["listing"] = [list(seg) for seg in self.listing]
        return out


def parse_listing(v: Any) -> tuple[tuple[str, ...], ...] | None:
    """A live source's listing (segments of paths) from a cursor or LOADER_META; TypeError if malformed."""
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(seg, (list, tuple)) and all(isinstance(p, str) for p in seg)
                                                    for seg in v):
        raise TypeError("listing is not a list of path lists")
    return tuple(tuple(seg) for seg in v)


# ---------------------------------------------------------------------------------------------- pinned listing
#: a loader process's exit status when it must not serve the run (the run's listing of its source cannot be read
#: there, or it reads it in another order): restarting it would only repeat the refusal, so the runtime does not
EXIT_LISTING = 4


@dataclass(frozen=True)
class ListingPin:
    """The file listing and read order a static source's positions count over: the digest of its listing
    (mixplane.loader.listing.listing_digest), its number of files and its read order -- ``pages`` (the whole
    source's page order), ``blocks:<block_files>`` (block by block: ``sources[].lazy_index_files``), or the
    shuffle mode's name. A run pins one per source (the first a loader says in HELLO, or the one of the cursor
    it resumes from) and keeps it in its cursor, so every loader of the run numbers positions the same way."""

    digest: str
    files: int
    order: str

    @classmethod
    def parse(cls, v: Any, what: str = "listing") -> "ListingPin | None":
        """From HELLO / WELCOME (a mapping) or a cursor (``digest:files:order``); None when absent; WireError
        naming `what` when malformed."""
        if v is None:
            return None
        try:
            if isinstance(v, str):
                digest, files, order = v.split(":", 2)
            elif isinstance(v, Mapping):
                digest, files, order = v["digest"], v["files"], v["order"]
            else:
                raise TypeError(f"not a mapping or text but {type(v).__name__}")
            if not (isinstance(digest, str) and len(digest) == 16 and all(c in "0123456789abcdef" for c in digest)):
                raise ValueError(f"digest {digest!r} is not 16 hex digits")
            if not isinstance(order, str) or not order:
                raise ValueError(f"order {order!r} is not a name")
            n = _int(files, "files")
            if n < 0:
                raise ValueError(f"files {n} is negative")
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"{what} is malformed ({e})") from None
        return cls(digest, n, order)

    def to_json(self) -> dict[str, Any]:
        """The HELLO / WELCOME form."""
        return {"digest": self.digest, "files": self.files, "order": self.order}

    def text(self) -> str:
        """The cursor's form (``digest:files:order``: ~30 bytes a source)."""
        return f"{self.digest}:{self.files}:{self.order}"


def listing_verdict(pinned: ListingPin | None, theirs: ListingPin | None) -> str:
    """What the planner does with a loader's HELLO of a static source: ``pin`` (nothing pinned yet: this listing
    becomes the run's), ``ok`` (the run's listing and order, or a loader that says none: a live source, an
    older loader), ``reopen`` (another listing: the loader reopens its stream with the run's kept listing
    before it serves) or ``refuse`` (the run's listing in another read order: it must not serve)."""
    if theirs is None:
        return "ok"
    if pinned is None:
        return "pin"
    if theirs.digest != pinned.digest:
        return "reopen"
    return "ok" if theirs.order == pinned.order else "refuse"


def order_refusal(source: str, pinned: ListingPin, theirs: ListingPin) -> str:
    """The error of a loader refused for reading the run's listing in another order (its spec differs)."""
    return (f"source {source!r}: this loader reads the run's listing ({pinned.files} files, digest {pinned.digest}) in "
            f"the order {theirs.order!r}, the run reads it in the order {pinned.order!r}: sources[].lazy_index_files / "
            "sources[].block_files differ from the spec the run started with (an upgrade between restarts?); the "
            "loader does not serve. Run it with the run's lazy_index_files and block_files, or start a new run")


def listing_not_kept(source: str, pinned: ListingPin, have: ListingPin) -> str:
    """The error of a loader that cannot find the run's kept listing (it lists other files now)."""
    return (f"source {source!r}: the run's listing ({pinned.files} files, digest {pinned.digest}) is not kept here, and "
            f"the store lists other files now ({have.files} files, digest {have.digest}): positions would name other "
            "samples, so the loader does not serve. Give it the run's kept listing (the loaders' cache directory "
            "MIXPLANE_INDEX_CACHE, or beside the data with sources[].index_beside_data) or the source's files as they "
            "were, or start a new run")


#: the longest refusal a loader's HELLO ``refused`` carries into the planner's STATUS (a longer one is cut)
REFUSAL_MAX_CHARS = 2000


def parse_refusal(v: Any, what: str = "refused") -> str | None:
    """A loader's own refusal of the run (HELLO ``refused``: why it does not serve, e.g. :func:`listing_not_kept`;
    it stops): None when absent, the text cut to REFUSAL_MAX_CHARS, WireError naming `what` when it is not a
    non-empty text."""
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise WireError(f"{what} is not a non-empty text but {type(v).__name__} {str(v)[:40]!r}")
    return v if len(v) <= REFUSAL_MAX_CHARS else v[:REFUSAL_MAX_CHARS - 3] + "..."


def parse_listing_pins(v: Any, n_sources: int) -> dict[int, ListingPin]:
    """A cursor's ``listings`` (source index -> ``digest:files:order``); {} when absent; ValueError if malformed."""
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise ValueError("cursor's listings is not a mapping")
    out: dict[int, ListingPin] = {}
    for k, x in v.items():
        try:
            si = _int(k, "listings source")
            pin = ListingPin.parse(x, f"cursor's listing of source {k}")
        except (TypeError, ValueError, WireError) as e:
            raise ValueError(str(e)) from None
        if not 0 <= si < n_sources or pin is None:
            raise ValueError(f"cursor's listings name source {k}, the spec has {n_sources}")
        out[si] = pin
    return out


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise TypeError(f"{what} is a boolean")
    if isinstance(v, str):  # JSON object keys (partial positions) are strings
        return int(v)
    if isinstance(v, float) and not v.is_integer():
        raise ValueError(f"{what} {v} is not an integer")
    return int(v)


@overload
def window_full(samples: int, unconsumed_tokens: int, min_samples: int, min_tokens: int, max_samples: int) -> bool: ...
@overload
def window_full(samples: np.ndarray, unconsumed_tokens: np.ndarray, min_samples: int, min_tokens: int,
                max_samples: int) -> np.ndarray: ...
def window_full(samples: Any, unconsumed_tokens: Any, min_samples: int, min_tokens: int, max_samples: int) -> Any:
    """The one predicate loaders and planner share, so both agree on a window's exact content. Elementwise over
    numpy arrays (a window after each of several candidate samples: see :func:`window_fill_length`)."""
    return (samples >= max_samples) | ((samples >= min_samples) & (unconsumed_tokens >= min_tokens))


def window_fill_length(samples: int, unconsumed_tokens: int, tokens: np.ndarray, min_samples: int, min_tokens: int,
                       max_samples: int) -> int | None:
    """How many of the next samples (their token counts `tokens`) a window of `samples` holding `unconsumed_tokens`
    takes until it is full: the shortest prefix a loader announces. None when all of them do not fill it."""
    n = len(tokens)
    full = window_full(samples + np.arange(1, n + 1), unconsumed_tokens + np.cumsum(tokens), min_samples, min_tokens,
                       max_samples)
    return int(np.argmax(full)) + 1 if n and full.any() else None


# ---------------------------------------------------------------------------------------------- roles
#: authenticated roles (the ZAP User-Id of a CURVE peer) and the role of a peer without CURVE
COMPONENT, CLIENT, ADMIN, ANONYMOUS = "component", "client", "admin", "anonymous"
ROLES = (COMPONENT, CLIENT, ADMIN, ANONYMOUS)
#: kinds that change what a run does (stop it, change its mixture, rewind or reset delivery)
CONTROL_KINDS = frozenset({Kind.LOSS_REPORT, Kind.SHUTDOWN, Kind.UPDATE_MIXTURE, Kind.RESUME, Kind.SEEK, Kind.RESET, Kind.RESHARD,
                           Kind.ADOPT, Kind.RELEASE, Kind.FOLLOW, Kind.FENCE, Kind.HANDOFF, Kind.REPARTITION})
_ANY = frozenset(ROLES)
#: which roles may send each kind; control kinds never include ANONYMOUS (see :func:`allowed`)
ALLOWED_ROLES: dict[Kind, frozenset[str]] = {
    **{k: _ANY for k in Kind},
    Kind.SHUTDOWN: frozenset({COMPONENT, ADMIN}),
    Kind.UPDATE_MIXTURE: frozenset({COMPONENT, ADMIN}),
    Kind.RESUME: frozenset({COMPONENT, CLIENT, ADMIN}),  # a trainer resuming from its state_dict
    Kind.SEEK: frozenset({COMPONENT, ADMIN}),
    Kind.RESET: frozenset({COMPONENT, ADMIN}),
    Kind.RESHARD: frozenset({ADMIN}),  # a new trainer topology: the runtime / operator, never a data-plane peer
    # partition handoff: the planner steers hosts and constructors; only an operator (admin) moves a partition
    Kind.ADOPT: frozenset({COMPONENT}),
    Kind.RELEASE: frozenset({COMPONENT}),
    Kind.FOLLOW: frozenset({COMPONENT}),
    Kind.FENCE: frozenset({COMPONENT}),
    Kind.HANDOFF: frozenset({ADMIN}),
    Kind.REPARTITION: frozenset({ADMIN}),  # re-partitioning a source: the runtime / operator / CLI
    Kind.RESEND: frozenset({COMPONENT}),
    Kind.LOSS_REPORT: frozenset({COMPONENT, CLIENT, ADMIN}),  # a trainer's per-source losses (they steer adaptive mixtures)
    # the data plane's own messages come from components only once peers are authenticated
    Kind.HELLO: frozenset({COMPONENT, ANONYMOUS}),
    Kind.LOADER_META: frozenset({COMPONENT, ANONYMOUS}),
    Kind.NEED_STEPS: frozenset({COMPONENT, ANONYMOUS}),
    Kind.SAMPLES: frozenset({COMPONENT, ANONYMOUS}),
}


#: kinds in which a trainer client names its rank (meta field ``rank``): bound to its key (see rank_claim_ok)
RANK_KINDS = frozenset({Kind.ROUTE, Kind.GET_STEP, Kind.RESUME, Kind.LOSS_REPORT})
Ranks = tuple[int, int]  # the ranks a client key is bound to, first..last inclusive


def parse_user_id(uid: str) -> tuple[str, Ranks | None]:
    """(role, bound ranks) of a ZAP User-Id: ``client`` (a shared client key: no binding),
    ``client:3-3`` / ``client:0-7`` (a key bound to ranks 3 / 0..7), ``admin``, ``component``.
    An unknown role is an authenticated client without control rights; a malformed binding binds
    to no rank at all (refused everywhere, never widened)."""
    role, _, bound = uid.partition(":")
    if role not in ROLES:
        role = CLIENT
    if not bound:
        return role, None
    a, _, b = bound.partition("-")
    try:
        lo, hi = int(a), int(b or a)
    except ValueError:
        return role, (0, -1)
    return role, (lo, hi)


def rank_claim_ok(kind: Kind, meta: Mapping[str, Any], role: str, ranks: Ranks | None, *, required: bool) -> bool:
    """Whether a peer may make the rank claim in a message of ``kind``: components and admins always;
    a client key bound to ranks only for those ranks; a shared (unbound) client key unless the run
    requires bound keys (``runtime.rank_binding``). A ROUTE by mesh coordinates names no rank (the
    constructor checks the GET_STEPs that follow); a client's RESUME must name its rank when bound."""
    if kind not in RANK_KINDS or role in (COMPONENT, ADMIN):
        return True
    rank = meta.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int):
        if kind == Kind.ROUTE and "coords" in meta:
            return True
        return ranks is None and not required
    if ranks is None:
        return not required
    return ranks[0] <= rank <= ranks[1]


def allowed(kind: Kind, role: str, *, open_run: bool = False) -> bool:
    """Whether a peer in `role` may send `kind`. An anonymous peer (no CURVE) may send control kinds
    only in a run the spec opened on purpose (``runtime.security: open``)."""
    if role == ANONYMOUS and kind in CONTROL_KINDS:
        return open_run
    return role in ALLOWED_ROLES.get(kind, frozenset())


# ---------------------------------------------------------------------------------------------- partitions
def loader_identity(source_name: str, replica: int, epoch: int) -> str:
    """The planner-facing identity of a partition's loader: the first assignment keeps the plain name
    (`loader:a:0`), later ones carry their epoch (`loader:a:0@3`), so an old incarnation's socket can
    never be mistaken for the new one (planner.partitions)."""
    base = f"loader:{source_name}:{replica}"
    return base if epoch <= 1 else f"{base}@{epoch}"


def host_identity(host: str) -> str:
    """The planner-facing identity of a loader process's host socket (ADOPT / FOLLOW arrive there)."""
    return f"host:{host}"


def beat_identity(host: str) -> str:
    """The identity a loader host's liveness thread beats from (planner.hosting watches it)."""
    return f"beat:{host}"


# ---------------------------------------------------------------------------------------------- plan cursor
#: PLAN_CONSTRUCTOR carries the cursor after its step as this uint8 array (JSON bytes): the planner
#: serialises it once per step and every constructor's message references the same buffer, where a
#: meta field was serialised once per constructor (~100 kB each at 1,024 sources)
CURSOR_ARRAY = "cursor_after"
MAX_CURSOR_BYTES = 1 << 28  # a deflated cursor may not inflate beyond this (a zip bomb is refused)
ZIP_CURSOR_BYTES = 4096  # larger cursors travel deflated (zlib): 1,024 sources ~100 kB -> ~30 kB per constructor


def cursor_array(cursor: Mapping[str, Any]) -> Any:
    """The cursor as the uint8 array PLAN_CONSTRUCTOR carries: JSON, deflated when large."""
    return cursor_text_array(json.dumps(cursor, separators=(",", ":")))


def cursor_text_array(json_text: str) -> Any:
    """cursor_array of the cursor whose compact JSON is `json_text` (the planner writes it without the dict)."""
    text = json_text.encode()
    if len(text) > ZIP_CURSOR_BYTES:
        text = zlib.compress(text, 1)
    return np.frombuffer(text, np.uint8)


def plan_cursor(msg: Message) -> dict[str, Any] | None:
    """The cursor after a PLAN_CONSTRUCTOR's step: its array, or (older planners) its meta field."""
    if CURSOR_ARRAY in msg.arrays:
        try:
            raw = msg.arrays[CURSOR_ARRAY].tobytes()
            if raw[:1] != b"{":  # deflated (a JSON object starts with '{', a zlib stream never does)
                raw = zlib.decompressobj().decompress(raw, MAX_CURSOR_BYTES)
            cur = json.loads(raw)
        except (ValueError, zlib.error) as e:
            raise WireError(f"{msg.kind.name}: array {CURSOR_ARRAY!r} is not a JSON cursor ({e})") from None
        if not isinstance(cur, dict):
            raise WireError(f"{msg.kind.name}: array {CURSOR_ARRAY!r} is not a cursor object")
        return cur
    cur = msg.meta.get(CURSOR_ARRAY)
    return cur if isinstance(cur, dict) else None


# ------------------------------------------------------------------------------ per-constructor images
#: PLAN_CONSTRUCTOR lists only the images the constructor needs (those encoded on its ranks' encoder
#: leaders, and those whose text starts in its rows) instead of every image of the step; the planner
#: then adds where each listed image's merged tokens sit in the all-gathered encoder output (int64,
#: one per listed image) and the merged tokens of every encoder rank (uint16 / int32 / int64 [world]: the gather's
#: sizes), which the constructor otherwise derives from the whole list. Meta STEP_IMAGES: the step's
#: image count (a constructor with none of them listed still builds the image fields of its batches).
IMG_BASE = "img_base"
ENCODER_TOKENS = "encoder_tokens"
STEP_IMAGES = "step_images"


def plan_images(msg: Message, n_listed: int, world: int) -> tuple[Any, Any, int]:
    """(img_base, encoder_tokens, step image count) of a PLAN_CONSTRUCTOR; the first two are None when
    the message lists every image of the step (older planners). WireError naming the field if bad."""
    base, enc = msg.arrays.get(IMG_BASE), msg.arrays.get(ENCODER_TOKENS)
    if base is None and enc is None:
        return None, None, n_listed
    if base is None or enc is None:
        raise WireError(f"{msg.kind.name}: arrays {IMG_BASE!r} and {ENCODER_TOKENS!r} come together")
    if base.ndim != 1 or len(base) != n_listed or base.dtype != np.int64:
        raise WireError(f"{msg.kind.name}: array {IMG_BASE!r} must be int64 with one entry per listed image ({n_listed})")
    if enc.ndim != 1 or len(enc) != world or enc.dtype not in (np.uint16, np.int32, np.int64):
        raise WireError(f"{msg.kind.name}: array {ENCODER_TOKENS!r} must be uint16/int32/int64 with one entry per rank ({world})")
    n = msg.meta.get(STEP_IMAGES)
    if not isinstance(n, int) or isinstance(n, bool) or n < n_listed:
        raise WireError(f"{msg.kind.name}: field {STEP_IMAGES!r} must be an int >= the {n_listed} listed images")
    return base, enc.astype(np.int64), n


# ---------------------------------------------------------------------------------------------- loss reports
MAX_LOSS_SOURCES = 1 << 16  # a report names at most this many sources


@dataclass(frozen=True)
class LossReport:
    """What a trainer rank trained on from `from_step` through `step`: per source (the mixture's source order)
    the sum of its tokens' losses and how many tokens had a label."""

    rank: int
    from_step: int
    step: int
    loss: tuple[float, ...]
    tokens: tuple[int, ...]


def parse_loss_report(meta: Mapping[str, Any], n_sources: int) -> LossReport:
    """A LOSS_REPORT's meta as a LossReport; WireError naming the field when it is not one (lengths other than
    the mixture's sources, a loss that is not a finite number >= 0, a count that is not an integer >= 0, a loss
    without tokens, steps out of order)."""
    def bad(what: str) -> WireError:
        return WireError(f"LOSS_REPORT: {what}")

    vals = {}
    for name in ("rank", "from_step", "step"):
        v = meta.get(name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise bad(f"{name} must be an integer >= 0, got {v!r}")
        vals[name] = v
    if vals["from_step"] > vals["step"]:
        raise bad(f"from_step {vals['from_step']} is after step {vals['step']}")
    loss, tokens = meta.get("loss"), meta.get("tokens")
    for name, v in (("loss", loss), ("tokens", tokens)):
        if not isinstance(v, list) or len(v) != n_sources or len(v) > MAX_LOSS_SOURCES:
            raise bad(f"{name} must list one value per source ({n_sources}), got "
                      f"{len(v) if isinstance(v, list) else type(v).__name__}")
    assert isinstance(loss, list) and isinstance(tokens, list)
    out_l: list[float] = []
    out_t: list[int] = []
    for i, (lv, tv) in enumerate(zip(loss, tokens)):
        if isinstance(tv, bool) or not isinstance(tv, int) or tv < 0:
            raise bad(f"tokens[{i}] must be an integer >= 0, got {tv!r}")
        if isinstance(lv, bool) or not isinstance(lv, (int, float)) or not math.isfinite(lv) or lv < 0:
            raise bad(f"loss[{i}] must be a finite number >= 0, got {lv!r}")
        if tv == 0 and lv != 0:
            raise bad(f"loss[{i}] is {lv} over 0 tokens")
        out_l.append(float(lv))
        out_t.append(tv)
    return LossReport(vals["rank"], vals["from_step"], vals["step"], tuple(out_l), tuple(out_t))


def update_refused(error: str) -> bool:
    """Whether the planner's ERROR answer to an UPDATE_MIXTURE rejects the update (a field or the step is wrong:
    sending it again fails again), not "not now" (a planner still recovering its session)."""
    return "mixture update rejected" in error


def acknowledgment(status: Mapping[str, Any], field: str, id_field: str, request_id: str) -> dict[str, Any] | None:
    """The planner's record of request `request_id` in its STATUS reply's list `field` (``updates``: live mixture
    updates by ``update_id``, ``reshards``: topology changes by ``reshard_id``, ``repartitions``: re-partitions by
    ``repartition_id``), or None when it is not listed: the
    level-triggered check of a sender that may have died between sending a request and reading its ACK."""
    for r in status.get(field) or ():
        if isinstance(r, Mapping) and r.get(id_field) == request_id:
            return dict(r)
    return None
