"""Tensor files on disk, mapped a tensor at a time, and written a chunk at a time.

A push of a 4 GB file must not hold 4 GB: `FileTensors` is the sequence of checkpoint
tensors a file holds, each a `FileRegion` mapped a chunk at a time as the writer takes it
(a chunk's pages leave the process when the writer lets go of the chunk: a mapping of
the whole tensor would keep every page it read resident until the tensor is done).
`slurm_geo.ckpt.files.torchfile` and `slurm_geo.ckpt.files.safetensors` say where in the file each
tensor lies.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from slurm_geo.ckpt.files.skeleton import TensorFileError
from slurm_geo.ckpt.format.manifest import DTYPE_SIZES, tensor_nbytes
from slurm_geo.ckpt.repo.repository import StreamedTensor, Tensor


@dataclass(frozen=True)
class FileRegion:
    """Bytes `start` to `start + length` of the file at `path`."""

    path: Path
    start: int
    length: int

    def __len__(self) -> int:
        return self.length

    def chunks(self, chunk_size: int) -> Iterator[memoryview]:
        for offset in range(0, self.length, chunk_size):
            yield map_range(self.path, self.start + offset,
                            min(chunk_size, self.length - offset))


# The tensor's C-contiguous bytes: where they lie in the file, or a copy gathered from it.
Loader = Callable[[], FileRegion | memoryview]


@dataclass(frozen=True)
class FileTensor:
    path: str
    dtype: str
    shape: tuple[int, ...]
    load: Loader


@dataclass(frozen=True)
class TensorFile:
    """What a push takes from a file: tensors mapped on demand and the skeleton."""

    tensors: FileTensors
    extra_state: bytes


class FileTensors(Sequence[Tensor | StreamedTensor]):
    """Checkpoint tensors whose bytes are read from the file as the writer takes them."""

    def __init__(self, tensors: list[FileTensor]):
        self._tensors = tensors

    def __len__(self) -> int:
        return len(self._tensors)

    @overload
    def __getitem__(self, index: int) -> Tensor | StreamedTensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[Tensor | StreamedTensor]: ...

    def __getitem__(self, index: int | slice
                    ) -> Tensor | StreamedTensor | Sequence[Tensor | StreamedTensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        t = self._tensors[index]
        data = t.load()
        if isinstance(data, FileRegion):
            return StreamedTensor(t.path, t.dtype, t.shape, data)
        return Tensor(t.path, t.dtype, t.shape, data)

    @property
    def nbytes(self) -> int:
        return sum(tensor_nbytes(t.dtype, t.shape) for t in self._tensors)


def map_range(path: Path, start: int, length: int) -> memoryview:
    """Bytes `start` to `start + length` of the file, mapped read-only (empty: no map)."""
    if length == 0:
        return memoryview(b"")
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), length + start - aligned, access=mmap.ACCESS_READ,
                           offset=aligned)
    return memoryview(mapped)[start - aligned:]


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether elements lie in C order with no gaps (strides of size-1 dims do not count)."""
    expected = contiguous_strides(shape)
    return all(n == 1 or s == e for n, s, e in zip(shape, stride, expected, strict=True))


def gathered(region: memoryview, itemsize: int, shape: tuple[int, ...],
             stride: tuple[int, ...]) -> memoryview:
    """A C-contiguous copy of the strided view of `region` (element strides)."""
    import numpy
    from numpy.lib.stride_tricks import as_strided

    elements = numpy.frombuffer(region, dtype=numpy.dtype(f"V{itemsize}"))
    view = as_strided(elements, shape=shape, strides=tuple(s * itemsize for s in stride),
                      writeable=False)
    return numpy.ascontiguousarray(view).reshape(-1).view(numpy.uint8).data


def check_dtype(dtype: str, where: str) -> None:
    if dtype not in DTYPE_SIZES:
        raise TensorFileError(f"{where}: dtype {dtype} has no checkpoint equivalent")
