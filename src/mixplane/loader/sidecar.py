"""The page-index cache, so a restart or a new replica does not rescan: one small .npz per file keyed by its
identity (path, size, mtime, projected columns), and for a listing of many files one pack holding every file's
index under the same identity. A damaged or stale sidecar or pack is never fatal: it is ignored and rebuilt."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import posixpath
import tempfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from mixplane.loader.files import BESIDE_DIR
from mixplane.loader.pageindex import ColumnPages, FileIndex
from mixplane.loader.parquet import ColumnInfo

INDEX_VERSION = 4  # 4: two .npz members (meta, data) instead of one per array


def default_cache_dir() -> str | None:
    d = os.environ.get("MIXPLANE_INDEX_CACHE")
    if d is not None:
        return d or None  # empty string disables the sidecar cache
    return os.path.join(os.path.expanduser("~"), ".cache", "mixplane", "pageindex")


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def index_prefix(path: str) -> str:
    """How the name of every index of `path` starts, whatever the file's version: its base name and a hash of
    its path. Then come a stamp of the version (format, size, mtime) and a hash of the projected columns."""
    return f"{os.path.basename(path)[:60]}.{_digest(path, 12)}."


def index_stamp(size: int, mtime_ns: int) -> str:
    return _digest(f"v{INDEX_VERSION}|{size}|{mtime_ns}", 16)


def index_name(path: str, size: int, mtime_ns: int, columns: list[str]) -> str:
    return f"{index_prefix(path)}{index_stamp(size, mtime_ns)}.{_digest(','.join(columns), 16)}.npz"


def sidecar_path(cache_dir: str, path: str, size: int, mtime_ns: int, columns: list[str]) -> str:
    return os.path.join(cache_dir, index_name(path, size, mtime_ns, columns))


def beside_path(path: str, size: int, mtime_ns: int, columns: list[str]) -> str:
    """Where a file's index is kept beside it in its store (`sources[].index_beside_data`): `<dir>/_mixplane_index/`,
    named as in the local cache (the name holds the file's path, size, mtime and columns, so a rewritten file's
    index is never taken for it). Listings leave that directory out (loader.files), so it never becomes part of a
    source, whatever the uri's glob."""
    return posixpath.join(posixpath.dirname(path), BESIDE_DIR, index_name(path, size, mtime_ns, columns))


def stale_indexes(names: Iterable[str], current: Mapping[str, str]) -> list[str]:
    """The names among `names` that index an older version of a file: `current` maps each file's index_prefix to
    the index_stamp of the version read now. Indexes of the current version (any columns) and of files not in
    `current` are kept: another source may read them."""
    out = []
    for name in names:
        parts = name[: -len(".npz")].rsplit(".", 2) if name.endswith(".npz") else []
        if len(parts) != 3:
            continue
        want = current.get(parts[0] + ".")
        if want is not None and parts[1] != want:
            out.append(name)
    return out


def sidecar_bytes(fi: FileIndex) -> bytes:
    """The index as the .npz bytes `load_sidecar` reads (what goes to the local cache or beside the data)."""
    buf = io.BytesIO()
    np.savez(buf, allow_pickle=False, **_sidecar_arrays(fi))  # (read back with allow_pickle=False too)
    return buf.getvalue()


def save_sidecar(fi: FileIndex, file: str) -> None:
    data = sidecar_bytes(fi)
    write_atomically(file, lambda f: f.write(data))


def write_atomically(file: str, write: Callable[[BinaryIO], object]) -> None:
    """Write `file` through a temporary file in its directory renamed over it, so a reader never sees a part."""
    os.makedirs(os.path.dirname(file), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(file), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, file)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _sidecar_arrays(fi: FileIndex) -> dict[str, np.ndarray]:
    """Two members, ``meta`` (JSON) and ``data`` (every array's bytes, 8-aligned, where ``meta["arrays"]`` says):
    an .npz member costs a zip entry and a header parse on each load, so 13 small arrays per file made the
    sidecars most of a warm start's time at 10^4-10^5 files (bench/startup.py)."""
    schema = pa.schema([pa.field(f"v{i}", c.value_type) for i, c in enumerate(fi.columns)]
                       + [pa.field(f"a{i}", c.arrow_type) for i, c in enumerate(fi.columns)])
    parts: list[tuple[str, np.ndarray]] = [("schema", np.frombuffer(schema.serialize().to_pybytes(), np.uint8)),
                                           ("rg_rows", np.asarray(fi.rg_rows))]
    for i, c in enumerate(fi.columns):
        cp = fi.pages[c.name]
        parts += [(f"{i}.{f}", np.ascontiguousarray(getattr(cp, f))) for f in ColumnPages.FIELDS]
    layout, chunks, off = [], [], 0
    for name, a in parts:
        layout.append([name, a.dtype.str, int(a.size), off])
        raw = a.tobytes()
        pad = -len(raw) % 8
        chunks.append(raw + b"\0" * pad)
        off += len(raw) + pad
    meta = {"version": INDEX_VERSION, "path": fi.path, "size": fi.size, "mtime_ns": fi.mtime_ns, "num_rows": fi.num_rows,
            "columns": [{"name": c.name, "leaf": c.leaf, "physical_type": c.physical_type, "type_length": c.type_length,
                         "max_def": c.max_def, "max_rep": c.max_rep, "list_def": c.list_def, "item_def": c.item_def,
                         "leaf_schema": c.leaf_schema.hex(), "struct_depth": c.struct_depth}
                        for c in fi.columns],
            "arrays": layout}
    return {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
            "data": np.frombuffer(b"".join(chunks), np.uint8)}


@functools.lru_cache(maxsize=64)
def _schema(data: bytes) -> pa.Schema:
    """The files of a source share their schema: read it once, not once per file."""
    return pa.ipc.read_schema(pa.py_buffer(data))


def load_sidecar(file: str | io.BytesIO, path: str, size: int, mtime_ns: int, columns: list[str]) -> FileIndex | None:
    """The index in `file` (a path, or the bytes read from beside the data) if it is `path`'s at this size, mtime
    and columns; None when it is another's, stale or damaged (then the file is indexed again)."""
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if (meta["version"] != INDEX_VERSION or meta["path"] != path or meta["size"] != size
                    or meta["mtime_ns"] != mtime_ns or [c["name"] for c in meta["columns"]] != list(columns)):
                return None
            data = z["data"]
        arrays = {}
        for name, dt, count, off in meta["arrays"]:
            dtype = np.dtype(dt)
            if off < 0 or off + count * dtype.itemsize > len(data):
                return None
            arrays[name] = data[off: off + count * dtype.itemsize].view(dtype)  # views of the one buffer read
        schema = _schema(arrays["schema"].tobytes())
        cols, pages = [], {}
        for i, c in enumerate(meta["columns"]):
            c = dict(c, leaf_schema=bytes.fromhex(c["leaf_schema"]))
            cols.append(ColumnInfo(value_type=schema.field(f"v{i}").type, arrow_type=schema.field(f"a{i}").type, **c))
            pages[c["name"]] = ColumnPages(**{f: arrays[f"{i}.{f}"] for f in ColumnPages.FIELDS})
        return FileIndex(path=path, size=size, mtime_ns=mtime_ns, num_rows=meta["num_rows"], rg_rows=arrays["rg_rows"],
                         columns=cols, pages=pages)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError, pa.ArrowException, zlib.error):
        return None
    except Exception:  # a damaged sidecar is never fatal: rebuild it
        return None


# ----------------------------------------------------------------------------------------------
# a source's pack: the indexes of every file of one listing in one file

PACK_PREFIX = "source-"
PACK_MIN_FILES = 256  # smaller listings use the per-file sidecars only


def pack_path(cache_dir: str, columns: list[str], ids: list[tuple[str, int, int]]) -> str:
    """Where the pack of exactly these files (path, size, mtime, in this order) and columns is kept: the name is a
    hash of them, so a warm start finds it from the listing alone, and any file added, removed or rewritten
    makes it another pack (then the per-file sidecars still serve the unchanged files)."""
    h = hashlib.sha256(f"v{INDEX_VERSION}|{','.join(columns)}\n".encode())
    for p, s, m in ids:
        h.update(f"{p}|{s}|{m}\n".encode())
    return os.path.join(cache_dir, f"{PACK_PREFIX}{h.hexdigest()[:32]}.npz")


def _column_meta(fi: FileIndex) -> str:
    schema = pa.schema([pa.field(f"v{i}", c.value_type) for i, c in enumerate(fi.columns)]
                       + [pa.field(f"a{i}", c.arrow_type) for i, c in enumerate(fi.columns)])
    return json.dumps({"schema": schema.serialize().to_pybytes().hex(),
                       "columns": [{"name": c.name, "leaf": c.leaf, "physical_type": c.physical_type,
                                    "type_length": c.type_length, "max_def": c.max_def, "max_rep": c.max_rep,
                                    "list_def": c.list_def, "item_def": c.item_def, "leaf_schema": c.leaf_schema.hex(),
                                    "struct_depth": c.struct_depth} for c in fi.columns]})


def _layout_key(fi: FileIndex) -> tuple:
    """What decides a file's column layout in a pack, cheaply (the JSON of `_column_meta` once per layout, not
    once per file: at 10^5 files that was a second of serialising the same schema)."""
    return tuple((c.name, c.leaf, c.physical_type, c.type_length, c.max_def, c.max_rep, c.list_def, c.item_def,
                  c.leaf_schema, c.struct_depth, str(c.value_type), str(c.arrow_type)) for c in fi.columns)


def save_pack(fis: list[FileIndex], file: str) -> None:
    """One .npz for a whole listing: per file (path, size, mtime, rows, its column layout), and each array of
    every file concatenated with its lengths -- one read instead of one per file on a warm start."""
    layouts: dict[str, int] = {}
    by_key: dict[tuple, int] = {}
    files = []
    for fi in fis:
        key = _layout_key(fi)
        lay = by_key.get(key)
        if lay is None:
            lay = by_key[key] = layouts.setdefault(_column_meta(fi), len(layouts))
        files.append([fi.path, fi.size, fi.mtime_ns, fi.num_rows, lay])
    ncols = len(fis[0].columns) if fis else 0
    arrays: dict[str, np.ndarray] = {
        "meta": np.frombuffer(json.dumps({"version": INDEX_VERSION, "files": files, "layouts": list(layouts)}).encode(),
                              np.uint8),
        "rg_rows": np.concatenate([fi.rg_rows for fi in fis]) if fis else np.zeros(0, np.int64),
        "rg_rows.len": np.array([len(fi.rg_rows) for fi in fis], np.int64)}
    for i in range(ncols):
        for f in ColumnPages.FIELDS:
            parts = [getattr(fi.pages[fi.columns[i].name], f) for fi in fis]
            arrays[f"{i}.{f}"] = np.concatenate(parts)
            arrays[f"{i}.{f}.len"] = np.array([len(a) for a in parts], np.int64)
    write_atomically(file, lambda out: np.savez(out, allow_pickle=False, **arrays))


def _split(data: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    ends = np.cumsum(lens).tolist()
    starts = [0] + ends[:-1]
    return [data[a:b] for a, b in zip(starts, ends)]


def _read_pack(file: str, columns: list[str], ids: list[tuple[str, int, int]] | None) -> list[FileIndex] | None:
    """Every index in a pack at these columns; with `ids`, only if the pack holds exactly those files (path, size,
    mtime, in order). None when it is missing, damaged, of other columns or (with `ids`) another listing's."""
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            files = meta["files"]
            if meta["version"] != INDEX_VERSION or (ids is not None and (len(files) != len(ids) or any(
                    (f[0], f[1], f[2]) != t for f, t in zip(files, ids)))):
                return None
            layouts = []
            for text in meta["layouts"]:
                lay = json.loads(text)
                if [c["name"] for c in lay["columns"]] != list(columns):
                    return None
                schema = _schema(bytes.fromhex(lay["schema"]))
                layouts.append([ColumnInfo(value_type=schema.field(f"v{i}").type, arrow_type=schema.field(f"a{i}").type,
                                           **dict(c, leaf_schema=bytes.fromhex(c["leaf_schema"])))
                                for i, c in enumerate(lay["columns"])])
            rg = _split(z["rg_rows"], z["rg_rows.len"])
            per = {(i, f): _split(z[f"{i}.{f}"], z[f"{i}.{f}.len"]) for i in range(len(columns)) for f in ColumnPages.FIELDS}
        if len(rg) != len(files) or any(len(v) != len(files) for v in per.values()):
            return None
        out = []
        for k, (path, size, mtime, rows, lay) in enumerate(files):
            cols = layouts[lay]
            pages = {c.name: ColumnPages(**{f: per[(i, f)][k] for f in ColumnPages.FIELDS}) for i, c in enumerate(cols)}
            out.append(FileIndex(path=path, size=size, mtime_ns=mtime, num_rows=rows, rg_rows=rg[k], columns=cols,
                                 pages=pages))
        return out
    except (OSError, ValueError, KeyError, TypeError, IndexError, json.JSONDecodeError, pa.ArrowException, zlib.error):
        return None
    except Exception:  # a damaged pack is never fatal: the files are indexed one by one
        return None


def load_pack(file: str, columns: list[str], ids: list[tuple[str, int, int]]) -> list[FileIndex] | None:
    """The indexes in a pack, if it holds exactly the files `ids` (path, size, mtime, in order) at these columns;
    None when it is missing, damaged or another listing's (then the files are read one by one)."""
    return _read_pack(file, columns, ids)


def load_pack_files(file: str, columns: list[str]) -> dict[tuple[str, int, int], FileIndex]:
    """The indexes in a pack of another listing, by file (path, size, mtime): a listing with a file added, removed
    or rewritten takes the unchanged files' indexes from the pack of the listing before. Empty when the pack is
    missing, damaged or of other columns."""
    got = _read_pack(file, columns, None) or []
    return {(fi.path, fi.size, fi.mtime_ns): fi for fi in got}


# the packs a source wrote last, newest first: found from any listing of it (the listing's common path prefix and
# the columns name it), so a listing that changed reuses the unchanged files' indexes; older packs are removed
RECENT_PREFIX = "recent-"
RECENT_PACKS = 3


def recent_path(cache_dir: str, columns: list[str], paths: list[str]) -> str:
    root = posixpath.commonprefix([min(paths), max(paths)]) if paths else ""
    return os.path.join(cache_dir, f"{RECENT_PREFIX}{_digest(f'v{INDEX_VERSION}|{chr(0).join(columns)}|{root}', 32)}.json")


def recent_packs(file: str) -> list[str]:
    """The pack names a recent-list holds (newest first); [] when it is missing or damaged."""
    try:
        with open(file, "rb") as f:
            names = json.loads(f.read().decode())
    except (OSError, ValueError):
        return []
    if not isinstance(names, list):
        return []
    return [n for n in names if isinstance(n, str) and n.startswith(PACK_PREFIX) and n.endswith(".npz")
            and os.path.basename(n) == n]


def remember_pack(file: str, pack: str) -> None:
    """Put `pack` first in the recent-list `file`; the packs beyond RECENT_PACKS are removed (best effort: a pack
    is named by a hash of its files and columns, so only this list can name it)."""
    name = os.path.basename(pack)
    names = recent_packs(file)
    if names[:1] == [name]:
        return
    names = [name] + [n for n in names if n != name]
    write_atomically(file, lambda f: f.write(json.dumps(names[:RECENT_PACKS]).encode()))
    for old in names[RECENT_PACKS:]:
        try:
            os.unlink(os.path.join(os.path.dirname(file), old))
        except OSError:
            pass
