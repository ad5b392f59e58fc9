"""Where chunks are cut (docs/format.md §7.2). Pure functions over byte buffers."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
_MASK64 = (1 << 64) - 1
_WINDOW = 64  # a gear hash depends only on the last 64 bytes: older bits are shifted out

GEAR = tuple(
    int.from_bytes(hashlib.sha256(b"slurm-geo/v1/gear" + bytes([i])).digest()[:8], "little")
    for i in range(256)
)


def fixed_chunks(data: memoryview, chunk_size: int) -> Iterator[memoryview]:
    """Cut one tensor's bytes at multiples of `chunk_size`, so unchanged slices repeat."""
    for start in range(0, len(data), chunk_size):
        yield data[start:start + chunk_size]


@dataclass(frozen=True)
class CdcParams:
    min_size: int = 256 * 1024
    mask_bits: int = 20  # a cut is expected every 2**mask_bits bytes after min_size
    max_size: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not _WINDOW <= self.min_size <= self.max_size or not 1 <= self.mask_bits <= 63:
            raise ValueError(f"bad content-defined chunking parameters {self}")


def content_defined_chunks(data: memoryview, params: CdcParams) -> Iterator[memoryview]:
    """Cut an opaque blob where its content says, so an insertion moves only nearby cuts."""
    start = 0
    while start < len(data):
        end = next_cut(data, start, params)
        yield data[start:end]
        start = end


def next_cut(data: memoryview, start: int, params: CdcParams) -> int:
    end = min(len(data), start + params.max_size)
    first_cut = start + params.min_size
    if end <= first_cut:
        return end
    # Start hashing a window before the first allowed cut: the result equals hashing from
    # `start` (the spec's definition) and skips most of the min_size bytes in Python.
    h = 0
    for byte in data[first_cut - _WINDOW:first_cut - 1]:
        h = ((h << 1) + GEAR[byte]) & _MASK64
    threshold = 1 << (64 - params.mask_bits)
    for position, byte in enumerate(data[first_cut - 1:end], first_cut):
        h = ((h << 1) + GEAR[byte]) & _MASK64
        if h < threshold:
            return position
    return end
