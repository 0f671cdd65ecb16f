"""Iceberg tables and snapshots as sources (poolside's Model Factory: a blend's inputs are immutable table snapshots).

``uri: iceberg://<catalog>/<namespace>.<table>[@<snapshot-id>]``. The catalog is pyiceberg's, configured the way
pyiceberg is (``~/.pyiceberg.yaml`` or ``PYICEBERG_CATALOG__<NAME>__URI`` / ``__WAREHOUSE`` / ``__S3.ENDPOINT``
... environment variables): a SQL catalog (SQLite, Postgres), REST, Glue, Hive. The table's snapshot is planned
into its data files, and those Parquet files are read by the same page-level reader as any source: same shuffle
modes, page index, quarantine.

Pinning: `mixplane run` resolves a uri without a snapshot to the table's current snapshot before any component
starts (:func:`pin_sources`), so every loader reads the same files, and the resolved spec -- in the run
directory and in the planner's journal -- names the snapshot: resume and `mixplane replay` read exactly the same
data after the table moved on. A live source (`live: true`) is not pinned: its loaders list the current
snapshot again as they list a directory, and files a new snapshot adds become the stream's next segment (a
snapshot that rewrites or removes files -- compaction, deletes -- is not followed: the listing names what
vanished). Row-level deletes (merge-on-read delete files) are refused with the table's name: a data file's rows
would be served although the table deleted them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mixplane.errors import MixplaneError

SCHEME = "iceberg://"
_REF = re.compile(r"^iceberg://(?P<catalog>[A-Za-z0-9_.-]+)/(?P<table>[A-Za-z0-9_.-]+\.[A-Za-z0-9_-]+)(@(?P<snap>-?\d+))?/?$")


class IcebergError(MixplaneError, ValueError):
    """An Iceberg source that cannot be resolved; the text names the uri and what is wrong."""


@dataclass(frozen=True)
class IcebergRef:
    catalog: str
    table: str  # namespace.table
    snapshot: int | None

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.catalog}/{self.table}" + ("" if self.snapshot is None else f"@{self.snapshot}")


def is_iceberg(uri: str) -> bool:
    return uri.startswith(SCHEME)


def parse_ref(uri: str) -> IcebergRef:
    m = _REF.match(uri)
    if m is None:
        raise IcebergError(f"{uri}: not an Iceberg source uri (iceberg://<catalog>/<namespace>.<table>[@<snapshot-id>])")
    snap = m.group("snap")
    return IcebergRef(m.group("catalog"), m.group("table"), None if snap is None else int(snap))


def load_catalog(ref: IcebergRef) -> Any:
    """The catalog `ref` names, configured as pyiceberg is configured now (IcebergError naming it when it cannot be)."""
    try:
        from pyiceberg.catalog import load_catalog as pyiceberg_catalog
        from pyiceberg.utils.config import Config
    except ImportError as e:  # the iceberg extra
        raise IcebergError(f"{ref.uri}: Iceberg tables need pyiceberg (pip install 'mixplane[iceberg]'): {e}") from None
    try:
        # the configuration as it is now (pyiceberg reads its environment once, at import)
        props: dict[str, Any] = dict(Config().get_catalog_config(ref.catalog) or {})
        return pyiceberg_catalog(ref.catalog, **props)
    except Exception as e:  # noqa: BLE001 - pyiceberg raises ValueError, KeyError or driver errors for a bad config
        raise IcebergError(f"{ref.uri}: catalog {ref.catalog!r} cannot be loaded ({type(e).__name__}: {e}); configure "
                           f"it as pyiceberg does (PYICEBERG_CATALOG__{ref.catalog.upper()}__URI, ~/.pyiceberg.yaml)") from None


def load_table(ref: IcebergRef) -> Any:
    catalog = load_catalog(ref)  # first: without pyiceberg, an IcebergError that says so
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    try:
        return catalog.load_table(ref.table)
    except (NoSuchTableError, NoSuchNamespaceError) as e:
        raise IcebergError(f"{ref.uri}: no table {ref.table!r} in catalog {ref.catalog!r} ({e})") from None


def snapshot_id(table: Any, ref: IcebergRef) -> int:
    """The snapshot `ref` names, or the table's current one; IcebergError for an unknown one or an empty table."""
    if ref.snapshot is not None:
        if table.snapshot_by_id(ref.snapshot) is None:
            known = [s.snapshot_id for s in table.metadata.snapshots][-5:]
            raise IcebergError(f"{ref.uri}: table {ref.table!r} has no snapshot {ref.snapshot} (latest: {known})")
        return ref.snapshot
    cur = table.current_snapshot()
    if cur is None:
        raise IcebergError(f"{ref.uri}: table {ref.table!r} has no snapshot yet (nothing was written to it)")
    return int(cur.snapshot_id)


def data_files(uri: str) -> tuple[IcebergRef, int, list[tuple[str, int]]]:
    """(the reference, the snapshot read, [(data file path as the table names it, size in bytes)]) sorted by path."""
    ref = parse_ref(uri)
    table = load_table(ref)
    snap = snapshot_id(table, ref)
    out = []
    for task in table.scan(snapshot_id=snap).plan_files():
        if task.delete_files:
            raise IcebergError(f"{uri}: table {ref.table!r} snapshot {snap} has row-level deletes (delete files on "
                               f"{task.file.file_path}); mixplane reads data files as written: compact the table first")
        if str(task.file.file_format).upper().find("PARQUET") < 0:
            raise IcebergError(f"{uri}: {task.file.file_path} is {task.file.file_format}, not Parquet")
        out.append((str(task.file.file_path), int(task.file.file_size_in_bytes)))
    return ref, snap, sorted(out)


def pin(uri: str) -> str:
    """`uri` with the snapshot it reads now (unchanged when it names one)."""
    ref = parse_ref(uri)
    if ref.snapshot is not None:
        return uri
    return IcebergRef(ref.catalog, ref.table, snapshot_id(load_table(ref), ref)).uri


def pin_sources(spec: Any) -> Any:
    """`spec` with every Iceberg source that is not live pinned to its table's current snapshot."""
    changed = False
    sources = []
    for s in spec.sources:
        if is_iceberg(s.uri) and not s.live and parse_ref(s.uri).snapshot is None:
            s = s.model_copy(update={"uri": pin(s.uri)})
            changed = True
        sources.append(s)
    return spec.model_copy(update={"sources": sources}) if changed else spec
