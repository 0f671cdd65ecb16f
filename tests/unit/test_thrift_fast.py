"""The Thrift decoder footers and page headers go through (`thrift.read_struct`, varints and common types inline)
gives exactly what the generic `CompactReader` gives -- the same structs and end positions on the footers,
OffsetIndexes and page headers of files from every writer in the zoo, and a ThriftError for the same damaged
inputs (truncated, bytes flipped) -- never another exception."""

import os
import random
import struct

import pytest

from mixplane.loader.parquet import thrift as th
from tests.unit.writer_zoo import write_zoo


def _reference(buf, pos=0):
    r = th.CompactReader(buf, pos)
    try:
        return r.struct(), r.pos
    except IndexError:
        raise th.ThriftError("truncated thrift data") from None


def _same_or_both_fail(buf, pos=0):
    try:
        want = _reference(buf, pos)
    except th.ThriftError:
        with pytest.raises(th.ThriftError):
            th.read_struct(buf, pos)
        return False
    assert th.read_struct(buf, pos) == want
    return True


@pytest.fixture(scope="module")
def structs(tmp_path_factory):
    """(bytes, position) of every footer, OffsetIndex and first page header of the zoo's files."""
    out = []
    for _, path, _, _ in write_zoo(str(tmp_path_factory.mktemp("zoo")), rows=600):
        data = open(path, "rb").read()
        flen = struct.unpack("<I", data[-8:-4])[0]
        footer = data[-8 - flen: -8]
        out.append((footer, 0))
        fm, _ = _reference(footer)
        for rg in fm.get(4, []):
            for cc in rg[1]:
                if cc.get(4) and cc.get(5):
                    out.append((data[cc[4]: cc[4] + cc[5]], 0))
                md = cc[3]
                out.append((data, md[9]))  # the chunk's first data page header, read in the whole file
    return out


def test_the_same_structs_as_the_generic_reader(structs):
    assert len(structs) > 50
    for buf, pos in structs:
        assert _same_or_both_fail(buf, pos)
        assert _same_or_both_fail(bytearray(buf), pos)
        assert _same_or_both_fail(memoryview(buf), pos)


def test_damaged_input_fails_as_the_generic_reader_does(structs):
    rnd = random.Random(7)
    footers = [b for b, p in structs if p == 0]
    failed = 0
    for buf in footers:
        for cut in sorted({1, len(buf) // 3, len(buf) // 2, len(buf) - 1} & set(range(1, len(buf)))):
            failed += not _same_or_both_fail(buf[:cut])
        for _ in range(40):
            b = bytearray(buf)
            for _ in range(rnd.randint(1, 4)):
                b[rnd.randrange(len(b))] = rnd.randrange(256)
            failed += not _same_or_both_fail(bytes(b))
    assert failed > 0  # some damage is caught (the rest decodes to the same other values)
    # the edge cases by hand: a varint of 11 bytes, nesting past the limit, a binary past the end, end= honoured
    assert not _same_or_both_fail(b"\x15" + b"\xff" * 10 + b"\x01\x00")
    assert not _same_or_both_fail(b"\x1c" * 40 + b"\x00" * 40)
    assert not _same_or_both_fail(b"\x18\x7fab\x00")
    with pytest.raises(th.ThriftError):
        th.read_struct(b"\x15\x04\x00", 0, 2)
    assert th.read_struct(b"\x15\x04\x00\x99", 0, 3) == ({1: 2}, 3)
    assert os.environ.get("PYTHONHASHSEED") != "fail"  # (the module's inputs do not depend on it)
