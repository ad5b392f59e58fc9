"""Uncompressed zip archives whose large members are written in place, in parallel.

A torch.save file is a zip of stored (uncompressed) members. `zipfile` writes a member
through one stream, computing its CRC-32 as it goes: a pull of 300 MB spent a second there
in one thread, while the chunks it writes are decrypted and verified by several. Here
every member's place in the file is laid out first (sizes are known from the manifest),
large members are filled by the caller wherever and in whatever order it likes (workers
`os.pwrite` their chunks), and each member's CRC-32 is combined from its chunks' CRCs,
which the workers computed, before the headers that hold it are written.

Zip64 fields are written for what does not fit 32 bits (members of 4 GiB and more,
offsets past 4 GiB), as `zipfile` and torch's reader (miniz) expect them.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

LOCAL = struct.Struct("<IHHHHHIIIHH")
CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
END = struct.Struct("<IHHHHIIH")
END64 = struct.Struct("<IQHHIIQQQQ")
LOCATOR64 = struct.Struct("<IIQI")
MAX32 = 0xFFFFFFFF
DOS_DATE = (1 << 5) | 1  # 1980-01-01, as torch.save dates its members
VERSION, VERSION64 = 20, 45


@dataclass(frozen=True)
class Member:
    """A stored member: its bytes (small ones), or its size, the caller filling it."""

    name: str
    data: bytes | None = None
    size: int = 0
    alignment: int = 1  # of the data's offset in the file

    @property
    def length(self) -> int:
        return self.size if self.data is None else len(self.data)


# Fills the members given by size: each one's bytes written at its start in the file
# (`os.pwrite` on the descriptor), returning each one's CRC-32, in order.
Fill = Callable[[int, Sequence[int]], Sequence[int]]


def write_archive(path: os.PathLike[str] | str, members: Sequence[Member], fill: Fill) -> None:
    """The archive of `members` at `path`, a new file (the umask's mode): never one that
    is there already, nor whatever a symlink planted at that name points to."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        headers, starts, end = _layout(members)
        for member, offset, start in zip(members, headers, starts, strict=True):
            if member.data is not None:
                os.pwrite(fd, _local(member, zlib.crc32(member.data), offset, start)
                          + member.data, offset)
        filled = [start for member, start in zip(members, starts, strict=True)
                  if member.data is None]
        crcs = iter(fill(fd, filled))
        central = b""
        for member, offset, start in zip(members, headers, starts, strict=True):
            crc = zlib.crc32(member.data) if member.data is not None else next(crcs)
            if member.data is None:
                os.pwrite(fd, _local(member, crc, offset, start), offset)
            central += _central(member, crc, offset)
        os.pwrite(fd, central + _end(len(members), len(central), end), end)
    finally:
        os.close(fd)


def _layout(members: Sequence[Member]) -> tuple[list[int], list[int], int]:
    """Each member's header offset and data offset, and where the central directory goes."""
    headers, starts, position = [], [], 0
    for member in members:
        headers.append(position)
        start = position + LOCAL.size + len(member.name.encode()) + len(_zip64_sizes(member))
        if member.alignment > 1:
            start += 4  # the padding field's header
            start += -start % member.alignment
        starts.append(start)
        position = start + member.length
    return headers, starts, position


def _zip64_sizes(member: Member) -> bytes:
    if member.length < MAX32:
        return b""
    return struct.pack("<HHQQ", 1, 16, member.length, member.length)


def _local(member: Member, crc: int, offset: int, start: int) -> bytes:
    name = member.name.encode()
    extra = _zip64_sizes(member)
    used = offset + LOCAL.size + len(name) + len(extra)
    if member.alignment > 1:  # torch pads with a field of its own, "FB", of "Z"s
        padding = start - used - 4
        extra += b"FB" + struct.pack("<H", padding) + b"Z" * padding
    size = MAX32 if extra.startswith(b"\x01\x00") else member.length
    version = VERSION64 if size == MAX32 else VERSION
    return LOCAL.pack(0x04034B50, version, 0, 0, 0, DOS_DATE, crc, size, size, len(name),
                      len(extra)) + name + extra


def _central(member: Member, crc: int, offset: int) -> bytes:
    name = member.name.encode()
    large = [member.length] * 2 if member.length >= MAX32 else []
    if offset >= MAX32:
        large.append(offset)
    extra = struct.pack(f"<HH{len(large)}Q", 1, 8 * len(large), *large) if large else b""
    size = MAX32 if member.length >= MAX32 else member.length
    version = VERSION64 if extra else VERSION
    return CENTRAL.pack(0x02014B50, version, version, 0, 0, 0, DOS_DATE, crc, size, size,
                        len(name), len(extra), 0, 0, 0, 0, min(offset, MAX32)) + name + extra


def _end(count: int, size: int, offset: int) -> bytes:
    if count < 0xFFFF and offset < MAX32:
        return END.pack(0x06054B50, 0, 0, count, count, size, offset, 0)
    end64 = END64.pack(0x06064B50, END64.size - 12, VERSION64, VERSION64, 0, 0, count, count,
                       size, offset)
    locator = LOCATOR64.pack(0x07064B50, 0, offset + size, 1)
    return end64 + locator + END.pack(0x06054B50, 0, 0, min(count, 0xFFFF),
                                      min(count, 0xFFFF), min(size, MAX32),
                                      min(offset, MAX32), 0)


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of A + B from those of A and B (zlib's crc32_combine, which Python lacks).

    Appending n bytes to A acts on its CRC as a linear map over GF(2): a 32x32 bit matrix,
    kept per n (a pull's chunks are mostly one size), so a combine is 32 xors at most.
    """
    return _apply(_shift_by(second_length), first) ^ second


def _apply(matrix: tuple[int, ...], vector: int) -> int:
    result, row = 0, 0
    while vector:
        if vector & 1:
            result ^= matrix[row]
        vector >>= 1
        row += 1
    return result


def _compose(outer: tuple[int, ...], inner: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_apply(outer, column) for column in inner)


@cache
def _shift_by(length: int) -> tuple[int, ...]:
    """The matrix that appends `length` zero bytes to a CRC-32 (identity for 0)."""
    if length == 0:
        return tuple(1 << n for n in range(32))
    if length == 1:
        one_bit = (0xEDB88320, *(1 << n for n in range(31)))  # the reflected polynomial
        matrix = one_bit
        for _ in range(3):  # 2, 4, 8 bits
            matrix = _compose(matrix, matrix)
        return matrix
    half = _shift_by(length // 2)
    doubled = _compose(half, half)
    return _compose(_shift_by(1), doubled) if length % 2 else doubled
