"""The planner's journal: a compact, append-only record from which any past step can be planned again.

A step's plan is a pure function of (spec generation, seed, step, cursor) and of the loaders'
deterministic metadata streams: the cursor holds the windows' consumption state, the sampler's
counters and the mixture schedule. So the journal does not store plans; it stores

* ``open``       — when a planner (re)starts: format version, the full spec of the running
                   generation, the checkpoint interval and the cursor it starts from;
* ``checkpoint`` — the cursor before every ``every``-th step (default 100); a cursor above 4 kB is
                   stored deflated (``cursor_z``, base64 of zlib JSON); with more than 64 sources it
                   also carries the per-source tokens / samples summed over the steps since the last
                   checkpoint (``interval``);
* ``step``       — per planned step, ~150 bytes: generation, phase, lr_scale, per-source tokens and
                   samples (up to 64 sources; beyond, their totals: a step record stays ~200 bytes
                   at 1,024 sources), and a digest of the StepLayout (to verify a replay bit for bit);
* ``update``     — a runtime mixture change: its generation, effective step, the step planned last
                   when it arrived, the update id when the sender gave one, and either the whole new
                   ``mixture`` section (with the resulting ``segments``) or new ``weights`` (with
                   ``lr_scale``, ``temperature`` and the resulting ``segment``);
* ``spec``       — a new spec generation adopted from a step on (topology / batch changes);
* ``repartition``— a source re-partitioned from a step on (``mixplane.repartition``): its old windows'
                   cursors and the new number of partitions, what loaders and replay build the new
                   partitions' read orders from;
* ``listing``    — a static source's listing pinned for the run (``protocol.ListingPin``: digest, files, read
                   order) when its first loader said HELLO; a restarted planner pins it again (cursors
                   carry it as well once taken);
* ``resume``     — the planner rewound to a client's cursor (a new session);
* ``recover``    — a restarted planner resumed its session from an earlier anchor's cursor (the journal
                   records it re-plans from there follow; see ``planner.recovery``).

One JSON object per line (`journal.jsonl`), flushed per record, so a crash loses at most the
record being written and a reader skips a torn last line. `replan(path, step, fill)` finds the
last anchor (open / resume / checkpoint) before the step's own record, restores its cursor, and
re-plays the records in between — applying updates exactly where the original planner applied
them — refilling windows with `fill` (a `WindowFiller`: the loaders' side, implemented outside the
planner) and checking each step's digest, so a replay that diverges fails at the first step that
differs, naming it.
"""

from __future__ import annotations

import base64
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from mixplane.errors import MixplaneError
from mixplane.layout import layout_digest  # noqa: F401  (one digest for journal, replay and tests)
from mixplane.planner.core import StepPlan, StepPlanner
from mixplane.protocol import ListingPin, parse_listing_pins
from mixplane.spec import DataMixtureSpec

VERSION = 1
DEFAULT_EVERY = 100
INLINE_SOURCES = 64  # step records list per-source tokens / samples up to this many sources
ZIP_CURSOR_BYTES = 4096  # checkpoint cursors larger than this are stored deflated (cursor_z)


def cursor_field(cursor: dict[str, Any]) -> dict[str, Any]:
    """{"cursor": ...}, or {"cursor_z": base64(zlib(json))} when large (1,024 sources: ~100 kB -> ~30 kB),
    so a checkpoint every 100 steps costs a few hundred bytes per step; read_journal inflates it."""
    text = _dump(cursor)
    if len(text) <= ZIP_CURSOR_BYTES:
        return {"cursor": cursor}
    return {"cursor_z": base64.b64encode(zlib.compress(text.encode(), 6)).decode("ascii")}

WindowFiller = Callable[[StepPlanner], None]
"""The loaders' side of a replay: ``fill(planner)`` announces into every one of ``planner.windows``
exactly what that replica's Source Loader would announce now (the shortest unconsumed stream prefix
that makes ``protocol.window_full`` true), given what the planner has consumed so far — also after the
planner was restored from a cursor. The planner only defines it: ``mixplane.replay.ReplayLoaders``
implements it over the real sources with the loaders' own ``LoaderWindow``; tests use synthetic
streams through the same class."""


class JournalError(MixplaneError, ValueError):
    """A journal that cannot be read or replayed (names the file, line or step)."""


class ReplayMismatch(JournalError):
    """A replanned step differs from what was journaled."""


def _dump(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=False, default=_default)


def _default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class Journal:
    """Writer used by the planner server: one call per event."""

    def __init__(self, path: str | os.PathLike, *, every: int = DEFAULT_EVERY):
        if every < 1:
            raise ValueError("checkpoint interval must be >= 1")
        self.path = os.fspath(path)
        self.every = every
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._session = 0
        # many sources: per-source counts summed from the last checkpoint on (written with the next one)
        self._since: int | None = None
        self._tokens = np.zeros(0, np.int64)
        self._samples = np.zeros(0, np.int64)

    def _write(self, rec: dict[str, Any]) -> None:
        self._f.write(_dump(rec) + "\n")
        self._f.flush()

    def open(self, spec: DataMixtureSpec, generation: int, cursor: dict[str, Any], session: int = 0) -> None:
        self._session = session
        self._write({"event": "open", "v": VERSION, "session": session, "generation": generation,
                     "step": int(cursor["step"]), "seed": spec.mixture.seed, "every": self.every,
                     "spec": spec.model_dump(mode="json"), "cursor": cursor})

    def step(self, plan: StepPlan) -> None:
        lay = plan.layout
        tok = np.asarray(plan.tokens_by_source).astype(np.int64)  # whole numbers (bincount's floats): int() of each
        smp = np.asarray(plan.samples_by_source).astype(np.int64)
        inline = len(tok) <= INLINE_SOURCES
        if lay.step % self.every == 0:
            rec: dict[str, Any] = {"event": "checkpoint", "step": lay.step, "session": self._session}
            if not inline and self._since is not None:
                rec["interval"] = {"from": self._since, "tokens": self._tokens.tolist(), "samples": self._samples.tolist()}
            rec.update(cursor_field(plan.cursor_before))
            self._write(rec)
            self._since, self._tokens, self._samples = lay.step, np.zeros(len(tok), np.int64), np.zeros(len(smp), np.int64)
        step = {"event": "step", "step": lay.step, "session": self._session, "generation": lay.generation,
                "phase": lay.phase, "lr_scale": lay.lr_scale, "digest": layout_digest(lay)}
        if plan.ended:  # sources whose last pass ended in this step (max_epochs, oversample: false)
            step["ended"] = list(plan.ended)
        if inline:
            step.update(tokens=tok.tolist(), samples=smp.tolist())
        else:  # per-source counts go to the next checkpoint's interval (a step record stays ~200 bytes)
            step.update(tokens_total=int(tok.sum()), samples_total=int(smp.sum()))
            if self._since is None:
                self._since, self._tokens, self._samples = lay.step, np.zeros(len(tok), np.int64), np.zeros(len(smp), np.int64)
            self._tokens = self._tokens + tok
            self._samples = self._samples + smp
        self._write(step)

    def update(self, event: dict[str, Any]) -> None:
        """A runtime mixture update, as returned by StepPlanner.update_mixture / adopt_mixture / apply_update."""
        rec = dict(event)
        rec["event"] = "update"
        rec["session"] = self._session
        self._write(rec)

    def spec_change(self, spec: DataMixtureSpec, generation: int, effective_step: int, planned_through: int,
                    mode: str = "rebase", reshard_id: str | None = None) -> None:
        """A new spec generation from effective_step on (mode 'rebase': its mixture replaces what follows;
        'reconfigure': its topology / batch take over at the next step; `reshard_id`: the id of the RESHARD that
        asked for it, acknowledged once also after a restart)."""
        rec = {"event": "spec", "session": self._session, "generation": generation, "mode": mode,
               "effective_step": effective_step, "planned_through": planned_through,
               "spec": spec.model_dump(mode="json")}
        if reshard_id is not None:
            rec["reshard_id"] = reshard_id
        self._write(rec)

    def checkpoint(self, cursor: dict[str, Any]) -> None:
        """A checkpoint out of turn: the cursor before step ``cursor['step']`` (a re-partition writes one at its step,
        so a recovery or replay after it never has to plan across it)."""
        self._write({"event": "checkpoint", "step": int(cursor["step"]), "session": self._session, **cursor_field(cursor)})

    def repartition(self, record: dict[str, Any]) -> None:
        """A re-partition (StepPlanner.repartition's record), applied before step ``record['step']``."""
        self._write({**record, "event": "repartition", "session": self._session})

    def listing(self, source: int, pin: str) -> None:
        """A static source's listing pinned for the run (``protocol.ListingPin.text``)."""
        self._write({"event": "listing", "session": self._session, "source": source, "pin": pin})

    def resume(self, cursor: dict[str, Any], session: int) -> None:
        self._session = session
        self._write({"event": "resume", "session": session, "step": int(cursor["step"]), "cursor": cursor})

    def recover(self, cursor: dict[str, Any], session: int, planned_through: int, incarnation: str) -> None:
        """A restarted planner continues `session` from `cursor` (an anchor's), re-planning through
        `planned_through` (the last step its predecessor journaled)."""
        self._session = session
        self._write({"event": "recover", "session": session, "step": int(cursor["step"]),
                     "planned_through": int(planned_through), "incarnation": incarnation, "cursor": cursor})

    def loss(self, report: Any) -> None:
        """A trainer rank's per-source loss report as the planner received it (protocol.LossReport); replay,
        recovery and rewinds skip these records."""
        self._write({"event": "loss", "session": self._session, "rank": report.rank, "from_step": report.from_step,
                     "step": report.step, "loss": list(report.loss), "tokens": list(report.tokens)})

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


ANCHORS = ("open", "resume", "checkpoint", "recover")  # records that carry a cursor a replay can start from
ARCHIVE_DIR = "journals"


def rotate(path: str | os.PathLike, *, now: float | None = None) -> str | None:
    """Move a previous run's journal to `journals/<UTC start>.jsonl` beside it, so a new run starts a
    fresh file without losing the old record (replay and recovery read it). Returns where it went
    (None: nothing to keep). Never overwrites: a name taken gets a `-<n>` suffix."""
    import time

    src = os.fspath(path)
    if not os.path.exists(src) or os.path.getsize(src) == 0:
        return None
    d = os.path.join(os.path.dirname(os.path.abspath(src)), ARCHIVE_DIR)
    os.makedirs(d, exist_ok=True)
    stem = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(os.path.getmtime(src) if now is None else now))
    dst = os.path.join(d, f"{stem}.jsonl")
    n = 1
    while os.path.exists(dst):
        dst = os.path.join(d, f"{stem}-{n}.jsonl")
        n += 1
    os.replace(src, dst)
    return dst


def archived(path: str | os.PathLike) -> list[str]:
    """The journals `rotate` kept beside `path`, oldest first."""
    d = os.path.join(os.path.dirname(os.path.abspath(os.fspath(path))), ARCHIVE_DIR)
    if not os.path.isdir(d):
        return []
    files = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".jsonl")]
    return sorted(files, key=lambda f: (os.path.getmtime(f), f))


def read_journal(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records; a torn last line (crash while writing) is ignored, any other bad line is an error."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise JournalError(f"{path}: cannot read: {e.strerror}") from None
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # the last non-empty line may be torn
                break
            raise JournalError(f"{path}:{i + 1}: not a JSON record") from None
        if not isinstance(rec, dict) or "event" not in rec:
            # records written by older servers have no 'event' for steps: tolerate them as steps
            if isinstance(rec, dict) and "step" in rec:
                rec = {"event": "legacy_step", **rec}
            else:
                raise JournalError(f"{path}:{i + 1}: record without an event")
        if "cursor_z" in rec:
            try:
                rec["cursor"] = json.loads(zlib.decompress(base64.b64decode(rec.pop("cursor_z"))))
            except (ValueError, zlib.error) as e:
                raise JournalError(f"{path}:{i + 1}: compressed cursor cannot be read ({e})") from None
        if rec["event"] == "open" and int(rec.get("v", VERSION)) > VERSION:
            raise JournalError(f"{path}:{i + 1}: journal format v{rec['v']} is newer than this mixplane (v{VERSION})")
        out.append(rec)
    return out


def _decoded(rec: dict[str, Any], where: str) -> dict[str, Any]:
    if "cursor_z" in rec:
        try:
            rec["cursor"] = json.loads(zlib.decompress(base64.b64decode(rec.pop("cursor_z"))))
        except (ValueError, zlib.error) as e:
            raise JournalError(f"{where}: compressed cursor cannot be read ({e})") from None
    return rec


def last_record(path: str | os.PathLike, events: tuple[str, ...], *, block: int = 1 << 16) -> dict[str, Any] | None:
    """The last record of one of `events` (e.g. ``("open", "spec")``: the spec a run last ran with), read from the
    journal's end backwards a block at a time: the step records after it are neither held nor parsed (a line is
    parsed only when it names one of `events`), and reading stops at the first match. A torn last line is skipped,
    as `read_journal` skips it; None when no such record exists."""
    path = os.fspath(path)
    marks = [f'"event":"{e}"'.encode() for e in events] + [f'"event": "{e}"'.encode() for e in events]
    try:
        f = open(path, "rb")
    except OSError as e:
        raise JournalError(f"{path}: cannot read: {e.strerror}") from None
    with f:
        pos = f.seek(0, os.SEEK_END)
        rest = b""  # the start of a line whose beginning lies in an earlier block
        last = True  # the next non-empty line is the file's last (which may be torn)
        while pos > 0:
            size = min(block, pos)
            pos -= size
            f.seek(pos)
            lines = (f.read(size) + rest).split(b"\n")
            rest = lines.pop(0) if pos > 0 else b""
            for line in reversed(lines):
                if not line.strip():
                    continue
                torn_ok, last = last, False
                if not any(m in line for m in marks):
                    continue
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    if torn_ok:
                        continue
                    raise JournalError(f"{path}: a record naming {' / '.join(events)} is not JSON") from None
                if isinstance(rec, dict) and rec.get("event") in events:
                    return _decoded(rec, path)
    return None


@dataclass
class ReplayPlan:
    """Where a replay of `step` starts and what it re-plays."""

    spec: dict[str, Any]
    generation: int
    anchor: dict[str, Any]
    records: list[dict[str, Any]]  # from after the anchor through the target's step record
    target: dict[str, Any] | None  # the target's step record (None: never planned)
    # static sources: the listings the run's positions counted over at the step (source -> pin; {}: an older journal)
    listings: dict[int, ListingPin] = field(default_factory=dict)


def pinned_listings(records: list[dict[str, Any]]) -> dict[int, ListingPin]:
    """The static sources' pinned listings after `records` (pure): as the planner holds them -- a ``listing`` record
    pins a source, a cursor that names listings (resume, checkpoint, recover) replaces those it names, one that names
    none keeps them. JournalError when a pin cannot be read."""
    out: dict[int, ListingPin] = {}
    for r in records:
        try:
            if r.get("event") == "listing":
                pin = ListingPin.parse(r.get("pin"), "journal listing record")
                if pin is not None:
                    out[int(r["source"])] = pin
            elif r.get("event") in ANCHORS and isinstance(r.get("cursor"), dict):
                out.update(parse_listing_pins(r["cursor"].get("listings"), 1 << 30))
        except (KeyError, TypeError, ValueError) as e:  # (WireError is a ValueError)
            raise JournalError(f"{r.get('event')} record of step {r.get('step', '?')}: {e}") from None
    return out


def locate(records: list[dict[str, Any]], step: int) -> ReplayPlan:
    """The anchor and records a replay of `step` needs (pure; see the module docstring)."""
    target_i = None
    for i, r in enumerate(records):
        if r["event"] == "step" and r["step"] == step:
            target_i = i
    end = target_i if target_i is not None else len(records) - 1
    anchor_i = None
    for i in range(end, -1, -1):
        r = records[i]
        if r["event"] in ANCHORS and int(r["step"]) <= step:
            anchor_i = i
            break
    if anchor_i is None:
        raise JournalError(f"step {step}: the journal has no cursor at or before it")
    spec_rec = None
    spec_i = -1
    for i in range(anchor_i, -1, -1):
        r = records[i]
        if r["event"] in ("open", "spec") and (r["event"] == "open" or r.get("planned_through", -1) < int(records[anchor_i]["step"])):
            spec_rec, spec_i = r, i
            break
    if spec_rec is None:
        raise JournalError(f"step {step}: no spec recorded before its cursor")
    # a topology change (a reshard: mode 'reconfigure') stays in force for everything planned after it, also for
    # the steps before its effective step that a later rewind (a trainer resuming from an older state) plans again
    for i in range(anchor_i, spec_i, -1):
        r = records[i]
        if r["event"] == "spec" and r.get("mode") == "reconfigure":
            spec_rec = r
            break
    gen = int(spec_rec["generation"])
    # updates recorded before the anchor are already inside the anchor's schedule state
    return ReplayPlan(spec_rec["spec"], gen, records[anchor_i], records[anchor_i + 1:end + 1],
                      records[target_i] if target_i is not None else None, pinned_listings(records[:end + 1]))


# ---- replay -------------------------------------------------------------------------------------

def _applied(planner: StepPlanner, rec: dict[str, Any]) -> bool:
    """Whether the planner's cursor already holds this re-partition (an anchor taken at its step, after it)."""
    have = planner.partitioning.get(int(rec["source"]), [])
    return any(int(h["step"]) == int(rec["step"]) and h["cursors"] == rec["cursors"] for h in have)


def replan(path: str | os.PathLike, step: int, fill: WindowFiller, *,
           strategy: Any = None, verify: bool = True, base_dir: str | None = None) -> StepPlan:
    """Plan journaled step `step` again and return its StepPlan (layout, pieces, cursor before it).

    fill: tops the planner's windows up before every step, as the loaders did (see `WindowFiller`;
    `mixplane.replay.ReplayLoaders` reads the real sources of the journaled spec, `planner.spec`).
    strategy: override the spec's strategy (default: resolve it from the spec).
    verify: compare every replanned step's digest with the journal (ReplayMismatch on the first
    difference). A step after the last journaled one is planned ahead from the last cursor.
    """
    from mixplane.planner.strategies import resolve_strategy
    from mixplane.spec import parse_spec

    records = read_journal(path)
    if step < 0:
        raise JournalError(f"step {step}: steps start at 0")
    rp = locate(records, step)
    spec = parse_spec(rp.spec)
    planner = StepPlanner(spec, strategy or resolve_strategy(spec, base_dir), rp.generation)
    planner.restore(rp.anchor["cursor"])
    # the listings the run read its static sources with (the fill opens their streams with them, not today's)
    planner.listings = {si: pin for si, pin in rp.listings.items() if 0 <= si < planner.n_sources}
    journaled: dict[int, dict[str, Any]] = {}
    last: StepPlan | None = None

    def plan_next() -> StepPlan:
        fill(planner)
        return planner.plan()

    for r in rp.records:
        ev = r["event"]
        if ev == "update":
            if planner.next_step <= int(r["effective_step"]):
                planner.apply_event(r)
        elif ev == "spec":
            new = parse_spec(r["spec"])
            if r.get("mode", "rebase") == "reconfigure":
                planner.reconfigure(new, int(r["generation"]))
                planner.strategy = strategy or resolve_strategy(new, base_dir)
            else:
                planner.schedule.rebase(new, int(r["effective_step"]), int(r["generation"]),
                                        planned_through=planner.next_step - 1)
        elif ev == "repartition":
            if planner.next_step == int(r["step"]) and not _applied(planner, r):
                planner.apply_repartition(r)
        elif ev == "step":
            s = int(r["step"])
            journaled[s] = r
            if s < planner.next_step:
                continue
            while planner.next_step <= s:
                last = plan_next()
                got = journaled.get(last.layout.step)
                if verify and got is not None and got.get("digest") != layout_digest(last.layout):
                    raise ReplayMismatch(f"step {last.layout.step}: replanned layout differs from the journal "
                                         f"(digest {layout_digest(last.layout)} != {got.get('digest')})")
        elif ev in ANCHORS:
            if int(r["step"]) != planner.next_step:
                raise JournalError(f"step {step}: journal record {ev} at step {r['step']} does not follow step "
                                   f"{planner.next_step - 1}")
    while planner.next_step <= step:
        last = plan_next()
    assert last is not None and last.layout.step == step
    return last
