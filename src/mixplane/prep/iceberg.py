"""Prep's output as an Iceberg table: the Parquet files a stage wrote become the table's next snapshot, registered
in place (pyiceberg's ``add_files``: no copy, the files are the table's data files), so a blend names
``iceberg://<catalog>/<namespace>.<table>@<snapshot>`` -- an immutable input, as poolside's Blender takes them.

The table is created on first use with the files' schema; a later run replaces its rows (one snapshot that deletes
the previous files from the table and adds the new ones), and older snapshots stay readable as long as their files
exist -- so a run must not write into a directory an earlier snapshot's files live in (`check_target` refuses it
before anything is written). The catalog is configured as for Iceberg sources (:mod:`mixplane.loader.iceberg`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mixplane.loader.iceberg import IcebergError, IcebergRef, load_catalog, parse_ref


def _target(uri: str) -> IcebergRef:
    ref = parse_ref(uri)
    if ref.snapshot is not None:
        raise IcebergError(f"{uri}: prep writes a new snapshot; name the table without @<snapshot-id>")
    return ref


def _table(ref: IcebergRef) -> Any | None:
    from pyiceberg.exceptions import NoSuchTableError

    try:
        return load_catalog(ref).load_table(ref.table)
    except NoSuchTableError:
        return None


def _where(p: str) -> str:
    """A path or uri without its scheme (local paths absolute), for comparing locations."""
    return p.split("://", 1)[1].rstrip("/") if "://" in p else os.path.abspath(p)


def _inside(path: str, directory: str) -> bool:
    return _where(path).startswith(_where(directory) + "/")


def check_target(uri: str, output: str) -> None:
    """Before a stage writes `output`: the table reference is valid and none of the table's current data files lie
    in `output` (overwriting them would break the snapshots that name them)."""
    ref = _target(uri)
    table = _table(ref)
    if table is None or table.current_snapshot() is None:
        return
    inside = [t.file.file_path for t in table.scan().plan_files() if _inside(str(t.file.file_path), output)]
    if inside:
        raise IcebergError(f"{uri}: its current snapshot's data files lie in {output} (e.g. {inside[0]}); write this "
                           "run to another directory (the table keeps the files it names)")


def publish(uri: str, paths: Sequence[str]) -> dict[str, Any]:
    """Register the Parquet files `paths` as the table's next snapshot (created with their schema when the table
    does not exist; replacing its rows when it does). The report: the pinned uri, the snapshot, the files."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq
    from pyiceberg.exceptions import NamespaceAlreadyExistsError
    from pyiceberg.expressions import AlwaysTrue

    ref = _target(uri)
    if not paths:
        raise IcebergError(f"{uri}: the stage wrote no Parquet file to register")
    table = _table(ref)
    if table is None:
        fs, path = pafs.FileSystem.from_uri(paths[0]) if "://" in paths[0] else (pafs.LocalFileSystem(), paths[0])
        schema = pq.read_schema(path, filesystem=fs)
        catalog = load_catalog(ref)
        namespace = ref.table.rsplit(".", 1)[0]
        try:
            catalog.create_namespace(namespace)
        except NamespaceAlreadyExistsError:
            pass
        table = catalog.create_table(ref.table, schema=schema)
    with table.transaction() as tx:
        if table.current_snapshot() is not None:
            tx.delete(AlwaysTrue())
        tx.add_files(list(paths))
    snap = int(table.refresh().current_snapshot().snapshot_id)
    return {"table": ref.uri, "snapshot": snap, "uri": IcebergRef(ref.catalog, ref.table, snap).uri,
            "files": len(paths)}
