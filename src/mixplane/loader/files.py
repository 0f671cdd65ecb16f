"""Resolve a source's `uri` (file, directory, glob; local or pyarrow.fs URI) to a sorted file list."""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from mixplane.errors import MixplaneError
from mixplane.loader.iceberg import IcebergError, data_files, is_iceberg
from mixplane.loader.remote import RemoteError, fsspec_filesystem, gcs_filesystem, s3_filesystem, with_retries

if TYPE_CHECKING:
    from mixplane.spec import SourceSpec

GLOB_CHARS = "*?["
# where `sources[].index_beside_data` keeps each file's page index (loader.sidecar.beside_path): never a file
# of the source, whatever the uri's glob matches
BESIDE_DIR = "_mixplane_index"


def _is_beside_index(path: str) -> bool:
    return f"/{BESIDE_DIR}/" in path.replace(os.sep, "/")


class SourceFilesError(MixplaneError, ValueError):
    """A source uri that cannot be listed or a file that cannot be opened; the text names it."""


@dataclass
class SourceFiles:
    """A source's listing: its files (sorted by path) with the sizes and mtimes the listing gave, the filesystem
    they are read from, when the store was listed (unix time) and, for a listing kept from an earlier start
    (loader.listing), where it was kept (else None: listed by this process)."""

    uri: str
    filesystem: pafs.FileSystem
    paths: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    mtimes_ns: list[int] = field(default_factory=list)
    listed_at: float = 0.0
    kept_from: str | None = None

    @property
    def digest(self) -> str:
        """16 hex digits naming exactly these files, sizes and mtimes in this order (`listing_digest`)."""
        return listing_digest(self)


def listing_digest(files: SourceFiles) -> str:
    """sha256 over (path, size, mtime_ns) of every file in listing order, as 16 hex digits: the same listing has
    the same digest in every process, and any file added, removed or rewritten changes it."""
    h = hashlib.sha256()
    h.update("\n".join(f"{p}\0{s}\0{m}" for p, s, m in zip(files.paths, files.sizes, files.mtimes_ns)).encode())
    h.update(f"\n{len(files.paths)}".encode())
    return h.hexdigest()[:16]


def _has_glob(s: str) -> bool:
    return any(c in s for c in GLOB_CHARS)


def list_source_files(uri: str, *, endpoint: str | None = None, region: str | None = None) -> SourceFiles:
    """All Parquet files of a source, sorted by path so every process sees the same order.
    ``endpoint`` / ``region``: an S3-compatible endpoint override and region for ``s3://`` uris."""
    listed_at = time.time()  # before the listing: a file written while it runs may or may not be in it
    if is_iceberg(uri):
        out = _list_iceberg(uri, endpoint, region)
        out.listed_at = listed_at
        return out
    if "://" not in uri:
        fs: pafs.FileSystem = pafs.LocalFileSystem()
        path = os.path.expanduser(uri)
        if _has_glob(path):
            found = [p for p in glob.glob(path, recursive=True) if os.path.isfile(p)]
        elif os.path.isdir(path):
            found = [os.path.join(d, f) for d, _, fs_ in os.walk(path) for f in fs_ if f.endswith(".parquet")]
        elif os.path.isfile(path):
            found = [path]
        else:
            found = []
        found = sorted(os.path.abspath(p) for p in found)
        infos: list[pafs.FileInfo] = fs.get_file_info(found) if found else []
    else:
        infos, fs = _list_remote(uri, endpoint, region)  # the listing carries sizes and times: no HEAD per object
    out = SourceFiles(uri=uri, filesystem=fs, listed_at=listed_at)
    if infos:
        for info in infos:
            if _is_beside_index(info.path):
                continue
            out.paths.append(info.path if "://" in uri else os.path.abspath(info.path))
            out.sizes.append(int(info.size or 0))
            out.mtimes_ns.append(int(info.mtime_ns or 0))
    return out


def _list_iceberg(uri: str, endpoint: str | None, region: str | None) -> SourceFiles:
    """The data files of an Iceberg table's snapshot (loader.iceberg), on the filesystem they live on."""
    try:
        _, _, files = data_files(uri)
    except IcebergError as e:
        raise SourceFilesError(str(e)) from None
    schemes = {p.split("://", 1)[0] if "://" in p else "file" for p, _ in files}
    if len(schemes) > 1:
        raise SourceFilesError(f"{uri}: data files on several filesystems ({', '.join(sorted(schemes))})")
    scheme = schemes.pop() if schemes else "file"
    out = SourceFiles(uri=uri, filesystem=iceberg_filesystem(uri, scheme, endpoint, region))
    for path, size in files:
        out.paths.append(path.split("://", 1)[1] if "://" in path else path)  # file:///a -> /a, s3://b/k -> b/k
        out.sizes.append(size)
        out.mtimes_ns.append(0)  # an Iceberg data file never changes once written
    return out


def iceberg_filesystem(uri: str, scheme: str, endpoint: str | None, region: str | None) -> pafs.FileSystem:
    """The filesystem an Iceberg table's data files of this scheme are read from."""
    if scheme == "file":
        return pafs.LocalFileSystem()
    if scheme in ("s3", "s3a"):
        return s3_filesystem(endpoint=endpoint, region=region)
    if scheme in ("gs", "gcs"):
        return gcs_filesystem(endpoint=endpoint)
    raise SourceFilesError(f"{uri}: data files on {scheme}://, which mixplane does not read")


def filesystem_scheme(fs: pafs.FileSystem) -> str:
    """The scheme `iceberg_filesystem` makes `fs` from: file, s3, gs (another filesystem: its type name)."""
    return {"local": "file", "s3": "s3", "gcs": "gs"}.get(fs.type_name, fs.type_name)


def list_source(source: SourceSpec) -> SourceFiles:
    """The files of a SourceSpec (its uri, endpoint and region)."""
    return list_source_files(source.uri, endpoint=source.endpoint, region=source.region)


def _remote_filesystem(scheme: str, base: str, endpoint: str | None,
                       region: str | None) -> tuple[pafs.FileSystem, str]:
    """The filesystem of a remote uri's scheme and the path of `base` (the uri's part after the scheme) on it."""
    if scheme == "s3":
        return s3_filesystem(endpoint=endpoint, region=region), base.rstrip("/")
    if scheme in ("gs", "gcs"):
        return gcs_filesystem(endpoint=endpoint), base.rstrip("/")
    if scheme in ("hf", "http", "https"):
        # fsspec's HTTP paths are whole URLs; the Hub's are repo paths (datasets/org/name/...)
        return fsspec_filesystem(scheme, endpoint=endpoint), (f"{scheme}://{base}" if scheme != "hf" else base).rstrip("/")
    return pafs.FileSystem.from_uri(f"{scheme}://{base}")


def _glob_base(rest: str) -> tuple[int, str]:
    glob_at = min((rest.find(c) for c in GLOB_CHARS if c in rest), default=-1)
    return glob_at, rest if glob_at < 0 else rest[:glob_at].rsplit("/", 1)[0]


def source_filesystem(uri: str, *, endpoint: str | None = None, region: str | None = None) -> pafs.FileSystem:
    """The filesystem `list_source_files` reads a (non-Iceberg) uri's files from, without listing anything."""
    if "://" not in uri:
        return pafs.LocalFileSystem()
    scheme, rest = uri.split("://", 1)
    try:
        return _remote_filesystem(scheme, _glob_base(rest)[1], endpoint, region)[0]
    except (OSError, ValueError) as e:
        raise SourceFilesError(f"cannot open the filesystem of {uri}: {e}") from None


def source_dir(uri: str, *, endpoint: str | None = None, region: str | None = None) -> str:
    """The directory a (non-Iceberg) uri's files are under, as a path on `source_filesystem(uri)`: the part before a
    glob, the parent of a `.parquet` file, else the uri's own path (a directory or prefix)."""
    if "://" not in uri:
        path = os.path.abspath(os.path.expanduser(uri))
        glob_at, base = _glob_base(path)
        if glob_at < 0 and (path.endswith(".parquet") or os.path.isfile(path)):
            base = os.path.dirname(path)
        return base.rstrip(os.sep) or os.sep
    scheme, rest = uri.split("://", 1)
    glob_at, base = _glob_base(rest)
    if glob_at < 0 and rest.endswith(".parquet"):
        base = rest.rsplit("/", 1)[0]
    try:
        return _remote_filesystem(scheme, base, endpoint, region)[1]
    except (OSError, ValueError) as e:
        raise SourceFilesError(f"cannot open the filesystem of {uri}: {e}") from None


def _list_remote(uri: str, endpoint: str | None = None, region: str | None = None):
    scheme, rest = uri.split("://", 1)
    glob_at, base = _glob_base(rest)
    try:
        fs, base_path = _remote_filesystem(scheme, base, endpoint, region)
        if scheme in ("http", "https"):
            base = f"{scheme}://{base}"
            rest = f"{scheme}://{rest}"

        def listing():
            if glob_at >= 0:
                infos = fs.get_file_info(pafs.FileSelector(base_path, recursive=True, allow_not_found=True))
                pattern = base_path + rest[len(base):]
                return [i for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, pattern)]
            info = fs.get_file_info(base_path)
            if info.type == pafs.FileType.Directory or (scheme in ("http", "https") and rest.endswith("/")):
                infos = fs.get_file_info(pafs.FileSelector(base_path, recursive=True))
                return [i for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")]
            return [info] if info.type == pafs.FileType.File else []

        found = with_retries("listing", uri, listing)
        if any(i.size is None for i in found):  # an HTTP index page has links, not sizes: one HEAD each
            found = with_retries("listing", uri, lambda: fs.get_file_info([i.path for i in found]))
        if not found and scheme in ("s3", "gs", "gcs"):
            bucket = base_path.split("/", 1)[0]
            if with_retries("listing", uri, lambda: fs.get_file_info(bucket)).type == pafs.FileType.NotFound:
                raise SourceFilesError(f"cannot list {uri}: bucket {bucket!r} does not exist")
    except RemoteError as e:
        raise SourceFilesError(f"cannot list {uri}: {e}") from None
    except (OSError, ValueError) as e:
        raise SourceFilesError(f"cannot list {uri}: {e}") from None
    return sorted(found, key=lambda i: i.path), fs


def open_parquet(files: SourceFiles, path: str) -> pq.ParquetFile:
    """Open one file of a source; errors name the file."""
    try:
        return pq.ParquetFile(files.filesystem.open_input_file(path))
    except Exception as e:  # noqa: BLE001 - a data file from any store: pyarrow raises ArrowInvalid, OSError variants
        # or ArrowNotImplementedError, an fsspec-backed filesystem its client's own types; each is named with the file
        raise SourceFilesError(f"{path}: not a readable Parquet file ({e})") from None


def read_schema_names(files: SourceFiles, path: str) -> list[str]:
    """Column names a source may project: the top-level columns and, for structs, ``a.b`` paths to
    their fields (what the page reader resolves)."""
    import pyarrow as pa

    out: list[str] = []

    def walk(prefix: str, t) -> None:
        for f in t:
            out.append(prefix + f.name)
            if pa.types.is_struct(f.type):
                walk(prefix + f.name + ".", f.type)

    walk("", open_parquet(files, path).schema_arrow)
    return out
