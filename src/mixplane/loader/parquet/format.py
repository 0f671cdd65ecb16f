"""The Parquet format's numbers: the magic, physical types, encodings, codecs, page types and repetitions, as the
Thrift definitions (parquet.thrift) number them, so that every part of the reader names them alike."""

from __future__ import annotations

MAGIC = b"PAR1"

# physical types
BOOLEAN, INT32, INT64, INT96, FLOAT, DOUBLE, BYTE_ARRAY, FIXED_LEN_BYTE_ARRAY = range(8)
TYPE_NAMES = ["BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY", "FIXED_LEN_BYTE_ARRAY"]
# encodings
PLAIN, PLAIN_DICTIONARY, RLE, BIT_PACKED, RLE_DICTIONARY = 0, 2, 3, 4, 8
ENCODING_NAMES = {0: "PLAIN", 2: "PLAIN_DICTIONARY", 3: "RLE", 4: "BIT_PACKED", 5: "DELTA_BINARY_PACKED",
                  6: "DELTA_LENGTH_BYTE_ARRAY", 7: "DELTA_BYTE_ARRAY", 8: "RLE_DICTIONARY", 9: "BYTE_STREAM_SPLIT"}
# codecs
UNCOMPRESSED, SNAPPY, GZIP, LZO, BROTLI, LZ4, ZSTD, LZ4_RAW = range(8)
CODEC_NAMES = ["UNCOMPRESSED", "SNAPPY", "GZIP", "LZO", "BROTLI", "LZ4", "ZSTD", "LZ4_RAW"]
# page types
DATA_PAGE, INDEX_PAGE, DICTIONARY_PAGE, DATA_PAGE_V2 = range(4)
# repetition
REQUIRED, OPTIONAL, REPEATED = range(3)


def type_name(physical_type: int | None) -> str:
    """A physical type's name for a message (the number itself when the footer holds an unknown one)."""
    if physical_type is not None and 0 <= physical_type < len(TYPE_NAMES):
        return TYPE_NAMES[physical_type]
    return str(physical_type)


def codec_name(codec: int) -> str:
    """A codec's name for a message (the number itself when unknown)."""
    return CODEC_NAMES[codec] if 0 <= codec < len(CODEC_NAMES) else str(codec)


def encoding_name(encoding: int) -> str:
    """An encoding's name for a message (the number itself when unknown)."""
    return ENCODING_NAMES.get(encoding, str(encoding))
