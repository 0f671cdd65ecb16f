"""Resolve a source's `uri` (file, directory, glob; local or pyarrow.fs URI) to a sorted file list."""

from __future__ import annotations

import fnmatch
import glob
import os
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
    uri: str
    filesystem: pafs.FileSystem
    paths: list[str] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    mtimes_ns: list[int] = field(default_factory=list)


def _has_glob(s: str) -> bool:
    return any(c in s for c in GLOB_CHARS)


def list_source_files(uri: str, *, endpoint: str | None = None, region: str | None = None) -> SourceFiles:
    """All Parquet files of a source, sorted by path so every process sees the same order.
    ``endpoint`` / ``region``: an S3-compatible endpoint override and region for ``s3://`` uris."""
    if is_iceberg(uri):
        return _list_iceberg(uri, endpoint, region)
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
    out = SourceFiles(uri=uri, filesystem=fs)
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
    if scheme == "file":
        fs: pafs.FileSystem = pafs.LocalFileSystem()
    elif scheme in ("s3", "s3a"):
        fs = s3_filesystem(endpoint=endpoint, region=region)
    elif scheme in ("gs", "gcs"):
        fs = gcs_filesystem(endpoint=endpoint)
    else:
        raise SourceFilesError(f"{uri}: data files on {scheme}://, which mixplane does not read")
    out = SourceFiles(uri=uri, filesystem=fs)
    for path, size in files:
        out.paths.append(path.split("://", 1)[1] if "://" in path else path)  # file:///a -> /a, s3://b/k -> b/k
        out.sizes.append(size)
        out.mtimes_ns.append(0)  # an Iceberg data file never changes once written
    return out


def list_source(source: SourceSpec) -> SourceFiles:
    """The files of a SourceSpec (its uri, endpoint and region)."""
    return list_source_files(source.uri, endpoint=source.endpoint, region=source.region)


def _list_remote(uri: str, endpoint: str | None = None, region: str | None = None):
    scheme, rest = uri.split("://", 1)
    glob_at = min((rest.find(c) for c in GLOB_CHARS if c in rest), default=-1)
    base = rest if glob_at < 0 else rest[:glob_at].rsplit("/", 1)[0]
    try:
        if scheme == "s3":
            fs: pafs.FileSystem = s3_filesystem(endpoint=endpoint, region=region)
            base_path = base.rstrip("/")
        elif scheme in ("gs", "gcs"):
            fs = gcs_filesystem(endpoint=endpoint)
            base_path = base.rstrip("/")
        elif scheme in ("hf", "http", "https"):
            fs = fsspec_filesystem(scheme, endpoint=endpoint)
            # fsspec's HTTP paths are whole URLs; the Hub's are repo paths (datasets/org/name/...)
            base_path = (f"{scheme}://{base}" if scheme != "hf" else base).rstrip("/")
            if scheme != "hf":
                base = f"{scheme}://{base}"
                rest = f"{scheme}://{rest}"
        else:
            fs, base_path = pafs.FileSystem.from_uri(f"{scheme}://{base}")

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
