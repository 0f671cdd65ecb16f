"""Resolve a source's `uri` (file, directory, glob; local or pyarrow.fs URI) to a sorted file list."""

from __future__ import annotations

import fnmatch
import glob
import os
from dataclasses import dataclass, field

import pyarrow.fs as pafs
import pyarrow.parquet as pq

GLOB_CHARS = "*?["


class SourceFilesError(ValueError):
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


def list_source_files(uri: str) -> SourceFiles:
    """All Parquet files of a source, sorted by path so every process sees the same order."""
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
    else:
        found, fs = _list_remote(uri)
    out = SourceFiles(uri=uri, filesystem=fs)
    if found:
        for info in fs.get_file_info(found):
            out.paths.append(info.path if "://" in uri else os.path.abspath(info.path))
            out.sizes.append(int(info.size or 0))
            out.mtimes_ns.append(int(info.mtime_ns or 0))
    return out


def _list_remote(uri: str) -> tuple[list[str], pafs.FileSystem]:
    scheme, rest = uri.split("://", 1)
    glob_at = min((rest.find(c) for c in GLOB_CHARS if c in rest), default=-1)
    base = rest if glob_at < 0 else rest[:glob_at].rsplit("/", 1)[0]
    try:
        fs, base_path = pafs.FileSystem.from_uri(f"{scheme}://{base}")
        if glob_at >= 0:
            infos = fs.get_file_info(pafs.FileSelector(base_path, recursive=True))
            pattern = base_path + rest[len(base):]
            found = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, pattern)]
        else:
            info = fs.get_file_info(base_path)
            if info.type == pafs.FileType.Directory:
                infos = fs.get_file_info(pafs.FileSelector(base_path, recursive=True))
                found = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")]
            else:
                found = [base_path] if info.type == pafs.FileType.File else []
    except (OSError, ValueError) as e:
        raise SourceFilesError(f"cannot list {uri}: {e}") from None
    return sorted(found), fs


def open_parquet(files: SourceFiles, path: str) -> pq.ParquetFile:
    """Open one file of a source; errors name the file."""
    try:
        return pq.ParquetFile(files.filesystem.open_input_file(path))
    except (OSError, ValueError) as e:
        raise SourceFilesError(f"{path}: not a readable Parquet file ({e})") from None
    except Exception as e:  # pyarrow raises ArrowInvalid (a ValueError) or ArrowIOError variants
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
