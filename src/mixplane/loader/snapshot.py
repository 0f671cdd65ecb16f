"""Differential checkpoints of a Source Loader (MegaScale-Data §6.1, Fig. 11).

Every `runtime.loader_snapshot_every` steps planned for it, a loader writes where its partition's stream
stands — its window's low position, the partial progress of the samples it holds, its epoch and session,
and the stream's own state (for live sources, the file listing it consumed) — to
``<state_dir>/<source>-<replica>.json`` (atomic rename; a few hundred bytes). The planner journals far
more often (every step, full cursors every `journal_every`); a restarted loader restores its snapshot,
starts reading ahead from it while it registers, and the planner's record bridges the gap: the in-flight
steps it resends and the window cursor it seeks to are exact.

What the snapshot saves *in this codebase* (measured by bench/loader_checkpoint.py): a stream seek is
exact and reads no data (positions are a pure function of the seed and the file listing), and the
planner's cursor is the exact position, so positioning needs no snapshot at all; the read-ahead from the
snapshot only pays when the snapshot is younger than the in-flight steps (small K), otherwise the
restarted loader seeks straight to the planner's cursor. What the planner cannot rebuild — the listing a
live source consumed — is what the snapshot adds. Pure file I/O, no sockets.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mixplane.protocol import WindowCursor

VERSION = 1


@dataclass(frozen=True)
class LoaderSnapshot:
    source: str
    replica: int
    epoch: int
    session: int
    step: int  # the last step planned for the loader when it was taken
    cursor: dict[str, Any]  # WindowCursor.to_json(): low, partial progress (skip left empty: a lower bound)
    stream: dict[str, Any]  # SourceStream.state_dict() (live sources: the listing consumed)
    written: float  # time.time()
    version: int = VERSION


def path_for(state_dir: str | os.PathLike, source: str, replica: int) -> Path:
    return Path(state_dir) / f"{source}-{replica}.json"


def window_cursor(buffer_positions: list[int], partial: dict[int, int], next_position: int) -> WindowCursor:
    """The loader's own lower bound of its cursor: the lowest position it holds (or the stream's next one),
    with the progress of partly delivered samples; consumed positions above it are not known here (the
    planner's cursor has them), so a restore from this cursor reads a little more, never less."""
    low = min(buffer_positions) if buffer_positions else next_position
    return WindowCursor(low, low, frozenset(), {p: d for p, d in partial.items() if p >= low and d > 0})


def write(state_dir: str | os.PathLike, snap: LoaderSnapshot) -> Path:
    """Write atomically (a crash mid-write leaves the previous snapshot)."""
    p = path_for(state_dir, snap.source, snap.replica)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(snap), separators=(",", ":")))
    os.replace(tmp, p)
    return p


def read(state_dir: str | os.PathLike, source: str, replica: int) -> LoaderSnapshot | None:
    """The snapshot of a partition, or None when there is none or it is unusable (named in the error)."""
    p = path_for(state_dir, source, replica)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: unreadable loader snapshot ({e})") from None
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        raise ValueError(f"{p}: loader snapshot version {doc.get('version') if isinstance(doc, dict) else None} "
                         f"is not {VERSION}")
    try:
        snap = LoaderSnapshot(**doc)
        WindowCursor.parse(snap.cursor)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{p}: malformed loader snapshot ({e})") from None
    if (snap.source, snap.replica) != (source, replica):
        raise ValueError(f"{p}: snapshot of {snap.source}:{snap.replica}, not {source}:{replica}")
    return snap


def age_s(snap: LoaderSnapshot) -> float:
    return max(0.0, time.time() - snap.written)
