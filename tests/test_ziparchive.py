"""Zip archives written in place: what zipfile and torch read back, CRCs combined."""

from __future__ import annotations

import os
import random
import zipfile
import zlib

import pytest

from slurm_geo.ckpt.files.ziparchive import (
    MAX32,
    Member,
    _central,
    _end,
    crc32_combine,
    write_archive,
)


@pytest.mark.parametrize("lengths", [(0, 5), (5, 0), (1, 1), (4096, 4096), (4 << 20, 1234),
                                     (7, 3, 1 << 16, 9)])
def test_crcs_combine_into_the_crc_of_the_whole(lengths):
    rng = random.Random(sum(lengths))
    pieces = [rng.randbytes(n) for n in lengths]
    combined = zlib.crc32(pieces[0])
    for piece in pieces[1:]:
        combined = crc32_combine(combined, zlib.crc32(piece), len(piece))
    assert combined == zlib.crc32(b"".join(pieces))


def test_members_filled_out_of_order_read_back_through_zipfile(tmp_path):
    big = [os.urandom(100_000), b"", os.urandom(3)]

    def fill(fd, starts):
        for data, start in reversed(list(zip(big, starts, strict=True))):
            os.pwrite(fd, data, start)
        return [zlib.crc32(data) for data in big]

    members = [Member("a/data.pkl", b"pickle"), *(Member(f"a/data/{i}", size=len(d),
                                                         alignment=64)
                                                  for i, d in enumerate(big)),
               Member("a/version", b"3\n")]
    write_archive(tmp_path / "x.zip", members, fill)

    with zipfile.ZipFile(tmp_path / "x.zip") as archive:
        assert archive.testzip() is None  # every CRC right
        assert archive.read("a/data.pkl") == b"pickle"
        assert [archive.read(f"a/data/{i}") for i in range(3)] == big
        headers = [info.header_offset for info in archive.infolist()
                   if "/data/" in info.filename]
    raw = (tmp_path / "x.zip").read_bytes()
    starts = [h + 30 + int.from_bytes(raw[h + 26:h + 28], "little")
              + int.from_bytes(raw[h + 28:h + 30], "little") for h in headers]
    assert [raw[s:s + len(d)] for s, d in zip(starts, big, strict=True)] == big
    assert all(start % 64 == 0 for start in starts)


def test_offsets_and_sizes_past_4_gib_take_zip64_fields():
    """Too big to write in a test: the records zipfile would have to parse."""
    entry = _central(Member("a/data/0", size=MAX32 + 10), 7, MAX32 + 99)
    assert entry[20:28] == b"\xff" * 8 and entry[42:46] == b"\xff" * 4
    assert entry.endswith((MAX32 + 10).to_bytes(8, "little") * 2
                          + (MAX32 + 99).to_bytes(8, "little"))
    end = _end(3, 200, MAX32 + 500)
    assert end.startswith(b"PK\x06\x06") and end[56:60] == b"PK\x06\x07"
