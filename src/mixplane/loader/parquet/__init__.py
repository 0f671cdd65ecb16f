"""Read Parquet data pages directly: footer and page headers (our own Thrift compact reader),
decompression (cramjam), and decoding with numpy — no pyarrow reader, no per-row Python loop.

The numpy path covers what training data mostly holds: data pages v1 and v2; PLAIN and dictionary
(PLAIN_DICTIONARY / RLE_DICTIONARY) encodings; RLE / bit-packed hybrid levels; nulls; flat columns
of every physical type but INT96, fields of structs (``meta.url``) and one level of list
(``list<int32>`` token columns, legacy two-level lists too). Every other page — DELTA_BINARY_PACKED,
DELTA_LENGTH_BYTE_ARRAY, DELTA_BYTE_ARRAY, BYTE_STREAM_SPLIT (what Spark's, DuckDB's and pyarrow's
v2 writers produce), and lists of lists — is handed as stored to Arrow's own decoders in a one-page
in-memory file (:func:`arrow_decode_page`). Codecs: none, SNAPPY, GZIP, ZSTD, BROTLI, LZ4_RAW. Page
CRCs are checked when the writer stored them. Anything else raises an error that names the file,
row group, column and page, so the caller can quarantine exactly that unit.

The one loop that is not vectorised walks the 4-byte length prefixes of PLAIN BYTE_ARRAY values of
pages of few values (one step per value, not per byte); everything else is numpy or Arrow C++.

The package's parts, bottom up: :mod:`.format` (the format's numbers), :mod:`.thrift` (the compact protocol),
:mod:`.errors`, :mod:`.io` (counted positional reads), :mod:`.metadata` (footer, column projection, page headers),
:mod:`.encodings` (decompression, levels, PLAIN and dictionary values) and :mod:`.pages` (a page, a run of pages).
What the rest of the loader uses is re-exported here, so a caller names the reader, not the file a function lives in.
"""

from __future__ import annotations

from mixplane.loader.parquet.encodings import Dictionary, decode_hybrid, decompress, int64_array, unpack_bits
from mixplane.loader.parquet.errors import (
    ChecksumError, CorruptFileError, CorruptPageError, EmptyFileError, MissingColumnError, MissingObjectFileError,
    ParquetError, SchemaMismatchError, UnsupportedError,
)
from mixplane.loader.parquet.format import (
    BROTLI, CODEC_NAMES, DATA_PAGE, DATA_PAGE_V2, DICTIONARY_PAGE, GZIP, INDEX_PAGE, LZ4_RAW, SNAPPY, UNCOMPRESSED, ZSTD,
)
from mixplane.loader.parquet.io import IOStats, RangeReader
from mixplane.loader.parquet.metadata import (
    ChunkMeta, ColumnInfo, FileMeta, PageHeader, RowGroupMeta, SchemaNode, footer_bytes, parse_page_header, read_file_meta,
    read_offset_index, resolve_columns,
)
from mixplane.loader.parquet.pages import (
    arrow_decode_page, check_crc, count_rows_v1, decode_data_page, decode_page_run, first_rep_level, page_rows,
    read_dictionary,
)
from mixplane.loader.parquet.thrift import ThriftError, read_struct

__all__ = [
    "BROTLI", "CODEC_NAMES", "DATA_PAGE", "DATA_PAGE_V2", "DICTIONARY_PAGE", "GZIP", "INDEX_PAGE", "LZ4_RAW", "SNAPPY",
    "UNCOMPRESSED", "ZSTD",
    "ChecksumError", "CorruptFileError", "CorruptPageError", "EmptyFileError", "MissingColumnError",
    "MissingObjectFileError", "ParquetError", "SchemaMismatchError", "UnsupportedError", "ThriftError",
    "IOStats", "RangeReader",
    "ChunkMeta", "ColumnInfo", "FileMeta", "PageHeader", "RowGroupMeta", "SchemaNode",
    "footer_bytes", "parse_page_header", "read_file_meta", "read_offset_index", "read_struct", "resolve_columns",
    "Dictionary", "decode_hybrid", "decompress", "int64_array", "unpack_bits",
    "arrow_decode_page", "check_crc", "count_rows_v1", "decode_data_page", "decode_page_run", "first_rep_level",
    "page_rows", "read_dictionary",
]
