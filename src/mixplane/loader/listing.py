"""The kept listing: a static source's file list (paths, sizes, mtimes) kept from one start to the next, so that the
loaders, checks and profiles of a source of 10^5 objects read it instead of listing the store again.

Listing an object store is one request per 1,000 keys, one after the other (50,000 keys: 50 round trips, 17 s on
the test server), paid by every loader process at every start. `source_listing` is what every consumer of a static
source's files calls: a remote (`scheme://`) static source whose newest kept listing is younger than
`sources[].listing_max_age_s` is served from it without a request to the store; any other source is listed
(`files.list_source`) and the listing kept. Live sources are always listed and never kept (they must see the store).

Where a listing is kept: under the page-index cache (`MIXPLANE_INDEX_CACHE`, `sidecar.default_cache_dir`) in
`listings/<key>/<digest>.npz`, key a hash of (uri, endpoint, region); for a remote source with
`sources[].index_beside_data` also beside the data, `<dir>/_mixplane_index/listings/<key>/<digest>.npz` with key a hash of the uri (the store is the same
whatever endpoint reaches it), so a new pod with an empty cache finds it with two reads instead of a listing. Each
place holds a `latest.json` (the newest digests and when they were listed) and the KEEP_LISTINGS newest listings;
older ones are removed. Writes are atomic locally and best effort beside the data (read-only credentials only lose
that copy). A kept file that is damaged is logged and ignored (the source is listed again); a file of a kept
listing removed or rewritten since is the readers' to quarantine (they check each file's size and mtime).

`find_kept` finds one listing by its digest (`files.listing_digest`): what a run pinned to a listing reopens.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import time
import zipfile
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow.fs as pafs

from mixplane.errors import MixplaneError
from mixplane.loader.files import (
    BESIDE_DIR, SourceFiles, SourceFilesError, filesystem_scheme, iceberg_filesystem, list_source, listing_digest,
    source_dir, source_filesystem,
)
from mixplane.loader.iceberg import is_iceberg
from mixplane.loader.sidecar import default_cache_dir, write_atomically

if TYPE_CHECKING:
    from mixplane.spec import SourceSpec

__all__ = ["listing_digest", "keep_listing", "find_kept", "source_listing", "refresh_listing", "listing_report",
           "ListingError", "LISTINGS_DIR", "KEEP_LISTINGS"]

log = logging.getLogger(__name__)

LISTING_VERSION = 1
LISTINGS_DIR = "listings"  # under the cache dir, and under `<dir>/_mixplane_index/` beside the data
LATEST = "latest.json"
KEEP_LISTINGS = 4  # digests kept per source and place; older ones are removed
MAX_CLOCK_SKEW_S = 300.0  # a listing "listed" this far in the future (another host's clock) still counts as fresh


class ListingError(MixplaneError, ValueError):
    """A kept listing file that cannot be read (truncated, not a listing, another source's); the text names it."""


# ----------------------------------------------------------------------------------------------
# pure: keys, the file format, the recent list, freshness


def _hash(text: str, n: int = 24) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def cache_key(uri: str, endpoint: str | None, region: str | None) -> str:
    """The directory name of a source's listings in the local cache: its uri, endpoint and region."""
    return _hash(f"v{LISTING_VERSION}\0{uri}\0{endpoint or ''}\0{region or ''}")


def beside_key(uri: str) -> str:
    """The directory name of a source's listings beside its data: its uri alone (the listing is of that store)."""
    return _hash(f"v{LISTING_VERSION}\0{uri}")


def reuses_kept(source: SourceSpec) -> bool:
    """Whether a start may take this source's files from a kept listing instead of listing the store: a remote
    (`scheme://`), static, non-Iceberg source (an Iceberg table's snapshot pins its files) with a max age."""
    return ("://" in source.uri and not source.live and not is_iceberg(source.uri)
            and float(source.listing_max_age_s) > 0)


def is_fresh(listed_at: float, now: float, max_age_s: float) -> bool:
    """A listing listed at `listed_at` may serve a start at `now`."""
    age = now - listed_at
    return listed_at > 0 and -MAX_CLOCK_SKEW_S <= age < max_age_s


def listing_bytes(files: SourceFiles, *, digest: str, endpoint: str | None, region: str | None) -> bytes:
    """The .npz a listing is kept as: `meta` (JSON), the paths' UTF-8 bytes joined with their offsets, sizes and
    mtimes (compressed: 50,000 object keys are a few hundred KB and load in tens of milliseconds)."""
    enc = [p.encode() for p in files.paths]
    offsets = np.zeros(len(enc) + 1, np.int64)
    np.cumsum([len(e) for e in enc], out=offsets[1:])
    meta = {"version": LISTING_VERSION, "uri": files.uri, "endpoint": endpoint, "region": region,
            "listed_at": float(files.listed_at), "digest": digest, "files": len(enc),
            "fs": filesystem_scheme(files.filesystem)}
    buf = io.BytesIO()
    np.savez_compressed(buf, allow_pickle=False, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                        paths=np.frombuffer(b"".join(enc), np.uint8), offsets=offsets,
                        sizes=np.asarray(files.sizes, np.int64), mtimes=np.asarray(files.mtimes_ns, np.int64))
    return buf.getvalue()


@dataclass
class KeptListing:
    """A listing read back: its meta (uri, endpoint, region, listed_at, digest, fs) and files."""

    meta: dict[str, Any]
    paths: list[str]
    sizes: list[int]
    mtimes_ns: list[int]


def parse_listing(data: bytes, name: str) -> KeptListing:
    """A kept listing from its bytes; ListingError naming `name` when they are not one (truncated, damaged, an
    older format, or files that do not give the digest it claims)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            raw, offsets, sizes, mtimes = z["paths"], z["offsets"], z["sizes"], z["mtimes"]
        if not isinstance(meta, dict) or meta.get("version") != LISTING_VERSION:
            raise ListingError(f"{name}: not a kept listing of version {LISTING_VERSION}")
        n = int(meta["files"])
        if (len(offsets) != n + 1 or len(sizes) != n or len(mtimes) != n or (n and offsets[0] != 0)
                or offsets[-1] != len(raw) or bool(np.any(np.diff(offsets) < 0))):
            raise ListingError(f"{name}: the kept listing's arrays do not agree with its {n} files")
        buf, offs = raw.tobytes(), offsets.tolist()
        out = KeptListing(meta, [buf[a:b].decode() for a, b in zip(offs, offs[1:])], sizes.tolist(), mtimes.tolist())
    except ListingError:
        raise
    except (OSError, ValueError, KeyError, TypeError, EOFError, zlib.error, zipfile.BadZipFile) as e:
        raise ListingError(f"{name}: not a readable kept listing ({type(e).__name__}: {e})") from None
    except Exception as e:  # noqa: BLE001 - damaged bytes fail in numpy or zipfile in ways of their own: never fatal
        raise ListingError(f"{name}: not a readable kept listing ({type(e).__name__}: {e})") from None
    got = listing_digest(SourceFiles(uri="", filesystem=None, paths=out.paths, sizes=out.sizes,
                                     mtimes_ns=out.mtimes_ns))
    if got != meta.get("digest"):
        raise ListingError(f"{name}: its files give digest {got}, not the {meta.get('digest')} it was kept as")
    return out


def parse_latest(data: bytes, name: str) -> list[tuple[str, float]]:
    """The (digest, listed_at) pairs of a `latest.json`, newest first; ListingError naming `name` when damaged."""
    try:
        doc = json.loads(data.decode())
        out = [(str(d), float(t)) for d, t in doc["recent"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ListingError(f"{name}: not a readable list of kept listings ({type(e).__name__}: {e})") from None
    if any(len(d) != 16 or any(c not in "0123456789abcdef" for c in d) for d, _ in out):
        raise ListingError(f"{name}: a kept listing's digest is not 16 hex digits")
    return sorted(out, key=lambda r: -r[1])


def latest_bytes(recent: list[tuple[str, float]]) -> bytes:
    return json.dumps({"version": LISTING_VERSION, "recent": [[d, t] for d, t in recent]}).encode()


def remember(recent: list[tuple[str, float]], digest: str, listed_at: float,
             keep: int = KEEP_LISTINGS) -> tuple[list[tuple[str, float]], list[str]]:
    """`recent` with `digest` listed at `listed_at` (the later of the two times when it is there already), newest
    first, `digest` and the `keep` - 1 newest others; and the digests cut off (their files are removed). The listing
    just kept stays even when it is older than the others (a run pinned to it keeps it)."""
    times = dict(recent)
    times[digest] = max(listed_at, times.get(digest, listed_at))
    ordered = sorted(times.items(), key=lambda r: -r[1])
    others = [r for r in ordered if r[0] != digest]
    kept = {digest} | {d for d, _ in others[: max(0, keep - 1)]}
    return [r for r in ordered if r[0] in kept], [d for d, _ in ordered if d not in kept]


# ----------------------------------------------------------------------------------------------
# places: the local cache, and beside the data


@dataclass
class Place:
    """A directory holding one source's kept listings: on this machine (`fs` None) or in the source's store."""

    root: str
    fs: pafs.FileSystem | None = None
    beside: bool = False

    def path(self, name: str) -> str:
        return os.path.join(self.root, name) if self.fs is None else posixpath.join(self.root, name)

    def where(self, name: str) -> str:
        p = self.path(name)
        return p if self.fs is None or "://" in p else f"{filesystem_scheme(self.fs)}://{p}"

    def exists(self, name: str) -> bool:
        try:
            if self.fs is None:
                return os.path.exists(self.path(name))
            return bool(self.fs.get_file_info(self.path(name)).type == pafs.FileType.File)
        except (OSError, ValueError, NotImplementedError):
            return False

    def read(self, name: str) -> bytes | None:
        """The file's bytes; None when it is not there or cannot be read (never an error)."""
        try:
            if self.fs is None:
                with open(self.path(name), "rb") as f:
                    return f.read()
            with self.fs.open_input_stream(self.path(name)) as s:
                return bytes(s.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, NotImplementedError) as e:
            log.debug("kept listing %s not read: %s", self.where(name), e)
            return None

    def write(self, name: str, data: bytes) -> None:
        if self.fs is None:
            write_atomically(self.path(name), lambda f: f.write(data))
            return
        try:
            _put(self.fs, self.path(name), data)
        except OSError:  # a filesystem with real directories needs the parent first
            self.fs.create_dir(self.root, recursive=True)
            _put(self.fs, self.path(name), data)

    def delete(self, name: str) -> None:
        try:
            if self.fs is None:
                os.unlink(self.path(name))
            else:
                self.fs.delete_file(self.path(name))
        except (OSError, NotImplementedError):
            pass  # best effort: an old listing left behind is only bytes


def _put(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def _resolve_cache(cache_dir: str | None) -> str | None:
    """None: the default cache (MIXPLANE_INDEX_CACHE, else the user's); "": no cache."""
    return (default_cache_dir() if cache_dir is None else cache_dir) or None


def places(source: SourceSpec, cache_dir: str | None) -> list[Place]:
    """Where this source's listings are kept, in the order they are looked in: the local cache, then (a remote
    source with `index_beside_data`, not an Iceberg table) beside the data. A local source is listed at every start
    and its listing kept in the cache only (its directory is not written for it)."""
    out = []
    cache = _resolve_cache(cache_dir)
    if cache:
        out.append(Place(os.path.join(cache, LISTINGS_DIR, cache_key(source.uri, source.endpoint, source.region))))
    if source.index_beside_data and "://" in source.uri and not is_iceberg(source.uri):
        try:
            base = source_dir(source.uri, endpoint=source.endpoint, region=source.region)
            fs: pafs.FileSystem | None = source_filesystem(source.uri, endpoint=source.endpoint, region=source.region)
        except SourceFilesError as e:
            log.info("source %r: listing not kept beside the data (%s)", source.name, e)
        else:
            if isinstance(fs, pafs.LocalFileSystem):
                fs = None  # a file:// uri: written atomically like the cache
            join = posixpath.join if fs is not None else os.path.join
            out.append(Place(join(base, BESIDE_DIR, LISTINGS_DIR, beside_key(source.uri)), fs, beside=True))
    return out


def _recent(place: Place) -> list[tuple[str, float]]:
    data = place.read(LATEST)
    if data is None:
        return []
    try:
        return parse_latest(data, place.where(LATEST))
    except ListingError as e:
        log.warning("%s: ignored (the source is listed again and the list rewritten)", e)
        return []


def _keep_at(place: Place, files: SourceFiles, digest: str, data: bytes | None, source: SourceSpec) -> bytes | None:
    """Keep the listing at `place` (its .npz unless that digest is there already, and `latest.json`), then remove
    the listings that fell out of it. Best effort beside the data. The listing's bytes, made once for all places."""
    try:
        recent = _recent(place)
        have = {d for d, _ in recent}
        if digest not in have or not place.exists(f"{digest}.npz"):
            if data is None:
                data = listing_bytes(files, digest=digest, endpoint=source.endpoint, region=source.region)
            place.write(f"{digest}.npz", data)
        new, dropped = remember(recent, digest, files.listed_at)
        if new != recent:
            place.write(LATEST, latest_bytes(new))
        for d in dropped:
            place.delete(f"{d}.npz")
    except (OSError, ValueError, NotImplementedError) as e:
        if not place.beside:
            log.warning("source %r: listing not kept in %s (%s): the next start lists the store again",
                        source.name, place.root, e)
        else:
            log.info("source %r: listing not kept beside the data in %s (%s): only this machine's cache has it",
                     source.name, place.where(""), e)
    return data


# ----------------------------------------------------------------------------------------------
# the API


def keep_listing(source: SourceSpec, files: SourceFiles, *, cache_dir: str | None = None) -> str:
    """Keep `files` (the listing of `source`) in the local cache (`cache_dir`, default MIXPLANE_INDEX_CACHE; ""
    disables it) and, with `sources[].index_beside_data`, beside the data; the listing's digest. Never raises for
    a place that cannot be written (logged). A listing without a time (`listed_at` 0) is stamped now."""
    digest = files.digest
    if files.listed_at <= 0:  # a listing made without a time (a subset, a test's): kept as listed now
        files.listed_at = time.time()
    data: bytes | None = None
    for place in places(source, cache_dir):
        data = _keep_at(place, files, digest, data, source)
    return digest


def _files_of(source: SourceSpec, kept: KeptListing, where: str) -> SourceFiles:
    if is_iceberg(source.uri):
        fs = iceberg_filesystem(source.uri, str(kept.meta.get("fs") or "file"), source.endpoint, source.region)
    else:
        fs = source_filesystem(source.uri, endpoint=source.endpoint, region=source.region)
    return SourceFiles(uri=source.uri, filesystem=fs, paths=kept.paths, sizes=kept.sizes, mtimes_ns=kept.mtimes_ns,
                       listed_at=float(kept.meta.get("listed_at") or 0.0), kept_from=where)


def _find_at(source: SourceSpec, place: Place, digest: str) -> SourceFiles | None:
    name = f"{digest}.npz"
    data = place.read(name)
    if data is None:
        return None
    try:
        kept = parse_listing(data, place.where(name))
        if kept.meta.get("uri") != source.uri or kept.meta.get("digest") != digest:
            raise ListingError(f"{place.where(name)}: the listing of {kept.meta.get('uri')} "
                               f"({kept.meta.get('digest')}), not of {source.uri} ({digest})")
        return _files_of(source, kept, place.where(name))
    except ListingError as e:
        log.warning("source %r: %s: ignored", source.name, e)
    except SourceFilesError as e:
        log.warning("source %r: kept listing %s not usable: %s", source.name, place.where(name), e)
    return None


def find_kept(source: SourceSpec, digest: str, *, cache_dir: str | None = None) -> SourceFiles | None:
    """The kept listing of `source` with this digest (the local cache first, then beside the data), its files on
    the filesystem `list_source` would give; None when it is not kept or is damaged (a damaged file is logged)."""
    for place in places(source, cache_dir):
        got = _find_at(source, place, digest)
        if got is not None:
            return got
    return None


def _newest_fresh(source: SourceSpec, cache_dir: str | None, now: float) -> SourceFiles | None:
    """The newest kept listing of `source` still younger than its max age, from whichever place has it."""
    where = places(source, cache_dir)
    candidates = sorted({r for place in where for r in _recent(place)[:1]}, key=lambda r: -r[1])
    for digest, listed_at in candidates:
        if not is_fresh(listed_at, now, float(source.listing_max_age_s)):
            break
        for place in where:
            got = _find_at(source, place, digest)
            if got is not None:
                got.listed_at = max(got.listed_at, listed_at)
                if place.beside and not where[0].beside:  # found beside the data: into this machine's cache too
                    _keep_at(where[0], got, digest, None, source)
                return got
    return None


def refresh_listing(source: SourceSpec, *, cache_dir: str | None = None, now: float | None = None) -> SourceFiles:
    """List the store now and keep the listing (not for a live source): the next start reads what it names."""
    files = list_source(source)
    if now is not None:
        files.listed_at = float(now)
    if not source.live:
        keep_listing(source, files, cache_dir=cache_dir)
    return files


def source_listing(source: SourceSpec, *, cache_dir: str | None = None, now: float | None = None) -> SourceFiles:
    """The files of `source`, for every consumer of a static source's listing (loaders, checks, profiles): a
    remote static source's newest kept listing while it is younger than `sources[].listing_max_age_s` (no request
    to the store), else the store listed (`files.list_source`) and the listing kept. Live sources: listed, never
    kept. `cache_dir`: as `keep_listing`; `now`: the clock (unix seconds; a listing made here is stamped with it)."""
    if source.live:
        return list_source(source)
    t = time.time() if now is None else float(now)
    if reuses_kept(source):
        got = _newest_fresh(source, cache_dir, t)
        if got is not None:
            log.info("source %r: %d files from the listing kept at %s, listed %.0f s ago (listing_max_age_s %g); "
                     "files written under %s since are read once it is older, or after "
                     "`mixplane listing SPEC --refresh`", source.name, len(got.paths), got.kept_from,
                     t - got.listed_at, source.listing_max_age_s, source.uri)
            return got
    return refresh_listing(source, cache_dir=cache_dir, now=now)


def listing_report(source: SourceSpec, *, refresh: bool = False, cache_dir: str | None = None,
                   now: float | None = None) -> dict[str, Any]:
    """What `mixplane listing` prints for a source: its listing (kept, or listed now; `refresh`: listed now) as
    {source, files, digest, listed_at, age_s, kept_from} (kept_from "listed" when the store was listed)."""
    t = time.time() if now is None else float(now)
    files = (refresh_listing if refresh else source_listing)(source, cache_dir=cache_dir, now=now)
    return {"source": source.name, "files": len(files.paths), "digest": files.digest,
            "listed_at": round(files.listed_at, 3), "age_s": round(max(0.0, t - files.listed_at), 3),
            "kept_from": files.kept_from or "listed"}
