"""Rebuild what one rank received at any past step, from the planner's journal and the sources.

`planner.journal.replan` plans the step again from the nearest journaled cursor (checking every
replanned step's digest against the journal). Its windows are filled by `ReplayLoaders`: the Source
Loaders of the mixture run offline, each a `loader.window.LoaderWindow` over the loader's own
stream and transform — the code the loader server runs, not a re-implementation. A static source
the run pinned a listing of (journal ``listing`` records, cursors' ``listings``) is read with that
listing, kept by the loaders (`loader.listing.find_kept`), not with what its store lists today:
files added since would number every position differently. The step's token
spans are then taken from those windows (no second read of the sources), and the rank's batch is
materialised exactly as its Data Constructor did (Blender's "re-fetch any past batch", e.g. to
investigate a loss spike).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from mixplane import protocol
from mixplane.errors import MixplaneError
from mixplane.constructor.collate import SpanStore, hybrid_view, materialize_rank
from mixplane.constructor.hooks import apply_hook, hook_context, load_hook
from mixplane.layout import layout_digest
from mixplane.loader.files import SourceFiles, SourceFilesError, list_source, listing_digest
from mixplane.loader.listing import find_kept, keep_listing, places
from mixplane.loader.stream import SourceStream, open_stream
from mixplane.loader.transforms import Transform, make_transform
from mixplane.loader.window import LoaderWindow
from mixplane.planner.core import StepPlan, StepPlanner
from mixplane.planner.windows import ReplicaWindow
from mixplane.planner.journal import archived, read_journal, replan
from mixplane.control import default_run_dir
from mixplane.repartition import layouts_after
from mixplane.spec import DataMixtureSpec, SourceSpec, overlong_limit, pack_bucket
from mixplane.parallelism import cp_group_ranks
from mixplane.topology import backbone_coords, place_tree

LIVE_READ_TIMEOUT = 10.0  # seconds a replay waits on a dry live source before giving up

# (spec, source index, replica) -> (stream, transform) of that loader replica; called with `files=` (SourceFiles:
# the run's pinned listing of a static source) when the run pinned one
ReplicaOpener = Callable[..., tuple[SourceStream, Transform]]
# (spec, source index, replica, the source's re-partition records) -> the same, of a re-partitioned source (`files=`
# as above)
PartitionOpener = Callable[..., tuple[SourceStream, Transform]]


class ReplayError(MixplaneError, RuntimeError):
    pass


def open_replica(spec: DataMixtureSpec, source_index: int, replica: int, *,
                 files: SourceFiles | None = None) -> tuple[SourceStream, Transform]:
    """The stream and transform a Source Loader of this replica reads with (as `loader.server` opens them); `files`:
    the listing to read (None: the source's listing today, `loader.listing.source_listing`)."""
    src = spec.sources[source_index]
    stream = open_stream(src, seed=spec.mixture.seed, partition=replica, num_partitions=src.replicas,
                         **({"files": files} if files is not None else {}))
    return stream, make_transform(src)


def open_partition(spec: DataMixtureSpec, source_index: int, replica: int, records: list[dict[str, Any]], *,
                   files: SourceFiles | None = None) -> tuple[SourceStream, Transform]:
    """The stream and transform of a partition of a re-partitioned source (`records`: the planner's re-partition
    records of the source, oldest first; none: `open_replica`): its read order from `mixplane.repartition`."""
    if not records:
        return open_replica(spec, source_index, replica, files=files)
    src = spec.sources[source_index]
    m = int(records[-1]["partitions"])
    stream = open_stream(src, seed=spec.mixture.seed, partition=replica, num_partitions=m,
                         **({"files": files} if files is not None else {}))
    stream.set_layout(layouts_after(src.replicas, records, stream.epoch_rows, source=src.name)[replica])
    return stream, make_transform(src)


def pinned_files(source: SourceSpec, pin: protocol.ListingPin) -> SourceFiles:
    """The files the run read a static source with: its kept listing of the pinned digest (the loaders' cache, then
    beside the data), else the store's listing while it is still that one. ReplayError otherwise, naming the source,
    the run's listing and where it was looked for: today's listing would make a replay read other samples. The store's
    listing found to be the run's is kept (as a loader's start keeps it)."""
    files = find_kept(source, pin.digest)
    if files is not None:
        return files
    try:
        now: SourceFiles | None = list_source(source)
    except SourceFilesError as e:
        now, today = None, f"the store cannot be listed now ({e})"
    if now is not None:
        digest = listing_digest(now)
        if digest == pin.digest:
            keep_listing(source, now)  # kept again (as a loader's start keeps it): found after files change
            return now
        today = f"{source.uri} lists other files now ({len(now.paths)} files, digest {digest})"
    looked = ", ".join(p.where(f"{pin.digest}.npz") for p in places(source, None)) or "nowhere: no cache directory"
    raise ReplayError(
        f"source {source.name!r}: the run read it with a listing of {pin.files} files (digest {pin.digest}, order "
        f"{pin.order!r}) that is not kept here (looked for {looked}), and {today}: a replay would read other samples "
        f"than the run delivered. Give it the run's kept listing -- copy {pin.digest}.npz from the loaders' cache "
        "directory (MIXPLANE_INDEX_CACHE, under listings/) to the first place named, or keep listings beside the data "
        "with sources[].index_beside_data -- or restore the source's files as they were")


def check_order(source: SourceSpec, pin: protocol.ListingPin, stream: Any) -> None:
    """The stream opened with the run's listing counts positions as the run did (`protocol.listing_verdict`, what
    the planner asks of a loader); ReplayError naming the source and both orders otherwise."""
    have = protocol.ListingPin(listing_digest(stream.files), len(stream.files.paths), str(stream.order))
    verdict = protocol.listing_verdict(pin, have)
    if verdict == "refuse":
        raise ReplayError(f"replay: {protocol.order_refusal(source.name, pin, have)}")
    if verdict != "ok":
        raise ReplayError(f"source {source.name!r}: the listing read ({have.files} files, digest {have.digest}) is not "
                          f"the run's ({pin.files} files, digest {pin.digest})")


class ReplayLoaders:
    """The Source Loaders of a mixture, offline: a `planner.journal.WindowFiller`.

    One `LoaderWindow` per (source, replica), built as the loader server builds it. Each call
    first tells every loader window what the planner consumed since the last call — the spans
    handed off and the samples retired, as a PLAN_LOADER message does — then announces
    `LoaderWindow.fill()` into the planner's `ReplicaWindow`. A planner window that no longer holds
    what was announced to it (the planner was restored from a cursor, or it is another planner's)
    makes its loader window start over from the window's cursor, as a SEEK does. A static source the
    planner holds a pinned listing of (``planner.listings``: `journal.replan` sets them from the
    journal) is opened over that listing (`pinned_files`, the opener called with ``files=``) and its
    order checked (`check_order`). One instance serves one mixture (the sources of the first planner it
    fills); `close()` closes the streams.
    """

    def __init__(self, opener: ReplicaOpener = open_replica, partition_opener: PartitionOpener = open_partition):
        self.opener = opener
        self.partition_opener = partition_opener
        self.spec: DataMixtureSpec | None = None
        # keyed by (source, replica, the source's partitioning): a re-partitioned source's partitions read other orders
        self._windows: dict[tuple[int, int, str], tuple[ReplicaWindow, LoaderWindow]] = {}
        self._next: dict[tuple[int, int, str], int] = {}  # the planner window's next position after our last announcement
        self._current: dict[tuple[int, int], tuple[int, int, str]] = {}  # (source, replica) -> its key now
        self._files: dict[tuple[str, str], SourceFiles] = {}  # (source, digest) -> the run's pinned listing

    def __call__(self, planner: StepPlanner) -> None:
        self.spec = planner.spec
        self._current = {}
        for w in planner.windows:
            recs = planner.partitioning.get(w.source, [])
            pin = None if planner.spec.sources[w.source].live else planner.listings.get(w.source)
            key = (w.source, w.replica, ";".join(f"{r['step']}:{r['partitions']}" for r in recs)
                   + (f"@{pin.text()}" if pin is not None else ""))
            self._current[(w.source, w.replica)] = key
            lw = self._window(planner.spec, w, key, recs, pin)
            if not self._consumed(w, lw):
                lw.seek(w.cursor())
            a = lw.fill()
            if lw.stalled:
                raise ReplayError(f"source {planner.spec.sources[w.source].name!r} replica {w.replica}: the stream ran "
                                  f"dry at position {w.next_pos} while replaying (files removed since?)")
            new = a.pos >= w.next_pos  # after a restart: what the planner's window already holds
            w.add(a.pos[new], a.key[new], a.tokens[new], a.patches[new])
            self._next[key] = w.next_pos
            if len(lw.buffer) != len(w) or lw.unconsumed_tokens != w.unconsumed_tokens:
                raise ReplayError(f"source {planner.spec.sources[w.source].name!r} replica {w.replica}: the loader "
                                  f"window ({len(lw.buffer)} samples, {lw.unconsumed_tokens} tokens) disagrees with the "
                                  f"planner's ({len(w)} samples, {w.unconsumed_tokens} tokens)")

    def _window(self, spec: DataMixtureSpec, w: ReplicaWindow, key: tuple[int, int, str],
                records: list[dict[str, Any]], pin: protocol.ListingPin | None = None) -> LoaderWindow:
        have = self._windows.get(key)
        if have is not None and have[0] is w:
            return have[1]
        if have is not None:  # another planner's window (a new replay): same stream, start over
            lw = have[1]
            self._next.pop(key, None)
        else:
            src = spec.sources[w.source]
            files = {} if pin is None else {"files": self._pinned(src, pin)}  # the run's listing, not today's
            stream, transform = (self.partition_opener(spec, w.source, w.replica, records, **files) if records
                                 else self.opener(spec, w.source, w.replica, **files))
            if pin is not None:
                try:
                    check_order(src, pin, stream)
                except ReplayError:
                    stream.close()
                    raise
            live = src.live
            lw = LoaderWindow(stream, transform, spec.window_bounds(w.source),
                              read_timeout=LIVE_READ_TIMEOUT if live else None, drop_longer_than=overlong_limit(spec),
                              bucket=pack_bucket(spec.sources[w.source]))
        self._windows[key] = (w, lw)
        return lw

    def _pinned(self, source: SourceSpec, pin: protocol.ListingPin) -> SourceFiles:
        """The run's listing of a source, found once per replay (every replica reads the same)."""
        got = self._files.get((source.name, pin.digest))
        if got is None:
            got = self._files[(source.name, pin.digest)] = pinned_files(source, pin)
        return got

    def _consumed(self, w: ReplicaWindow, lw: LoaderWindow) -> bool:
        """Mirror the planner's consumption into the loader window (span what was delivered, retire what
        is used up); False if the two windows no longer describe the same stream prefix."""
        if self._next.get(self._current[(w.source, w.replica)]) != w.next_pos or w.restored_done:
            return False
        if w.skip and max(w.skip) >= w.next_pos:
            return False
        index = {int(p): i for i, p in enumerate(w.pos.tolist())}
        if any(p not in lw.buffer for p in index):
            return False
        for p, b in list(lw.buffer.items()):
            i = index.get(p)
            if i is None:
                if p < w.low or p in w.skip:  # fully consumed: the planner retires it
                    lw.retire(p)
                    continue
                return False
            d = int(w.done[i])
            if d < b.done:
                return False
            if d > b.done:
                lw.span(p, b.done, d - b.done)
        return True

    def span(self, source: int, replica: int, pos: int, start: int, length: int) -> tuple[int, np.ndarray]:
        """(key, tokens[start : start + length + 1]) of a sample in a replica's window, as its loader ships it."""
        key = self._current.get((source, replica))
        have = self._windows.get(key) if key is not None else None
        if have is None:
            raise KeyError(f"no loader window for source {source} replica {replica}")
        return have[1].span(pos, start, length)

    def close(self) -> None:
        for _, lw in self._windows.values():
            close = getattr(lw.stream, "close", None)
            if close is not None:
                close()
        self._windows.clear()
        self._next.clear()
        self._files.clear()

    def __enter__(self) -> "ReplayLoaders":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def fetch_spans(loaders: ReplayLoaders, plan: StepPlan) -> SpanStore:
    """The token spans of a step just replanned with `loaders`, from their windows (no second read)."""
    store = SpanStore.empty()
    p = plan.pieces
    names = loaders.spec.source_names() if loaders.spec is not None else []
    for i in range(len(p)):
        si, r, pos, s0, ln = int(p.source[i]), int(p.replica[i]), int(p.pos[i]), int(p.start[i]), int(p.length[i])
        name = names[si] if si < len(names) else str(si)
        try:
            key, tokens = loaders.span(si, r, pos, s0, ln)
        except KeyError:
            raise ReplayError(f"source {name!r}: stream position {pos} cannot be read back (quarantined since?)") from None
        if key != int(p.key[i]):
            raise ReplayError(f"source {name!r}: position {pos} now holds sample {key}, the plan says {int(p.key[i])} "
                              f"(did the files change?)")
        store.spans[(si, key, s0)] = tokens
    return store


def spec_at(path: str | Path, step: int, default: DataMixtureSpec) -> DataMixtureSpec:
    """The spec the planner ran `step` with: the journal's (a reshard changes the topology from a step on),
    with the given spec's fields for what the journal cannot know (it records the resolved spec)."""
    from mixplane.planner.journal import locate
    from mixplane.spec import parse_spec

    try:
        doc = locate(read_journal(path), step).spec
    except (OSError, ValueError, KeyError, TypeError):  # an unreadable journal, or an older one without a spec record
        return default
    journaled = parse_spec(doc)
    out = default
    if journaled.topology != default.topology:
        out = out.model_copy(update={"topology": journaled.topology})
    # an Iceberg source is read at the snapshot the run pinned (loader.iceberg): the table may have moved on
    pinned = {s.name: s.uri for s in journaled.sources}
    sources = [s.model_copy(update={"uri": pinned[s.name]})
               if s.uri.startswith("iceberg://") and pinned.get(s.name, s.uri) != s.uri
               and pinned[s.name].split("@", 1)[0] == s.uri.split("@", 1)[0] else s
               for s in out.sources]
    if sources != list(out.sources):
        out = out.model_copy(update={"sources": sources})
    return out


def replay_step(spec: DataMixtureSpec, *, step: int, rank: int, run_dir: str | None = None, save: str | None = None,
                journal: str | None = None) -> dict[str, Any]:
    """journal: a journal file (e.g. one an earlier run left in `<run_dir>/journals/`); default the run
    dir's current `journal.jsonl`."""
    rd = Path(run_dir) if run_dir else default_run_dir(spec)
    path = Path(journal) if journal else rd / "journal.jsonl"
    if not path.exists():
        raise ReplayError(f"no journal at {path}")
    journaled = {int(r["step"]): r for r in read_journal(path) if r.get("event") == "step"}
    if step not in journaled:
        older = archived(rd / "journal.jsonl") if not journal else []
        hint = f"; earlier runs' journals (--journal): {', '.join(older)}" if older else ""
        raise ReplayError(f"step {step} is not in {path} (journaled: {min(journaled, default=0)}..{max(journaled, default=-1)}){hint}")
    spec = spec_at(path, step, spec)  # the topology in force at that step (elastic resharding)
    coords = backbone_coords(spec, rank)
    with ReplayLoaders() as loaders:
        plan = replan(path, step, loaders)  # raises ReplayMismatch naming the first step that differs
        batch = materialize_rank(plan.layout, coords.dp, fetch_spans(loaders, plan), spec.batch.pad_id)
        hook = load_hook(spec)
        if hook is not None:  # hooks.constructor: what the trainer got was the hooked batch
            batch = apply_hook(hook, spec.hooks.constructor.name, batch,  # type: ignore[union-attr]
                               hook_context(spec, plan.layout, coords.dp))
    digest = layout_digest(plan.layout)
    names = spec.source_names()
    src = batch["source_ids"]
    out = {
        "step": step, "rank": rank, "coords": coords.as_dict(), "phase": plan.layout.phase, "lr_scale": plan.layout.lr_scale, "generation": plan.layout.generation,
        "digest": digest, "journal_digest": journaled[step].get("digest"), "digest_match": journaled[step].get("digest") == digest,
        "tokens_by_source": {n: int((src == i).sum()) for i, n in enumerate(names)},
        "segments": [{"source": names[int(s)], "key": int(k), "start": int(st), "len": int(ln), "row": int(r)}
                     for s, k, st, ln, r in zip(batch["segment_source"], batch["segment_key"], batch["segment_start"],
                                                batch["segment_len"], batch["segment_row"])],
    }
    if plan.layout.hybrid_cp:  # hybrid DP x CP: the rank's tensors are its parts of its CP groups, as delivered
        mesh = place_tree(spec).backbone
        batch = {k: v for k, v in hybrid_view(plan.layout, coords.dp, batch, coords.cp, spec.batch.pad_id).items()
                 if isinstance(v, np.ndarray)}
        batch["cp_group_ranks"] = cp_group_ranks(batch, lambda cp: mesh.rank_of(dp=coords.dp, pp=coords.pp, cp=cp, tp=coords.tp))
        out["cp_groups"] = [{"size": int(k), "first_cp_rank": int(f)}
                            for k, f in zip(batch["cp_group_size"], batch["cp_group_first"])]
    if save:
        np.savez(save, **batch)  # type: ignore[arg-type]  # numpy stubs: **kwds could be allow_pickle
        out["saved"] = save
    return out
