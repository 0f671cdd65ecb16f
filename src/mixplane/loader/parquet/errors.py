"""The Parquet reader's errors: each names the file, row group, column and page it is about, and carries a
``kind`` (corrupt file, corrupt page, checksum, missing column, ...) so that the loader can quarantine exactly the
unit that failed and count it by kind."""

from __future__ import annotations

from mixplane.errors import MixplaneError


class ParquetError(MixplaneError, ValueError):
    """A Parquet file or page that cannot be read; the message names file, row group, column, page."""

    kind = "corrupt"
    # declared, not set here: the page indexer sets it on an error that lost a whole file, where the pages are known
    # (read it with getattr: absent otherwise)
    pages_lost: int

    def __init__(self, message: str, *, file: str | None = None, row_group: int | None = None,
                 column: str | None = None, page: int | None = None):
        self.file, self.row_group, self.column, self.page = file, row_group, column, page
        self.detail = message
        super().__init__(where(file, row_group, column, page) + message)


class CorruptFileError(ParquetError):
    kind = "corrupt_file"


class CorruptPageError(ParquetError):
    kind = "corrupt_page"
    # declared, not set here: the page indexer's header scan sets it, the bytes of the column chunk scanned before the
    # bad header (read it with getattr: absent otherwise)
    scanned_bytes: int


class ChecksumError(CorruptPageError):
    kind = "checksum"


class MissingColumnError(ParquetError):
    kind = "missing_column"


class SchemaMismatchError(ParquetError):
    kind = "type_mismatch"


class EmptyFileError(ParquetError):
    kind = "empty_file"


class UnsupportedError(ParquetError):
    kind = "unsupported"


class MissingObjectFileError(ParquetError):
    """The file (object) is gone: deleted or replaced since it was listed."""

    kind = "missing_object"


def where(file: str | None, rg: int | None, col: str | None, page: int | None) -> str:
    """The ``file, row group r, column 'c', page p: `` prefix of a message (only the parts known)."""
    parts = []
    if file is not None:
        parts.append(str(file))
    if rg is not None:
        parts.append(f"row group {rg}")
    if col is not None:
        parts.append(f"column {col!r}")
    if page is not None:
        parts.append(f"page {page}")
    return (", ".join(parts) + ": ") if parts else ""
