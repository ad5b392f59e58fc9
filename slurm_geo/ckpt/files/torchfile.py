"""`torch.save` files without torch: read through a restricted unpickler, written by hand.

A torch.save file is a zip archive, every entry stored uncompressed: `<name>/data.pkl`, a
pickle of the state in which each tensor is a call to `torch._utils._rebuild_tensor_v2`
(v3 for dtypes without a legacy storage class) on a persistent id naming a raw storage,
`<name>/data/<key>`; `<name>/byteorder` says how those bytes are ordered.

Reading never imports torch and never runs anything a file names: the pickle goes through
`slurm_geo.ckpt.files.torchpickle`'s restricted, bounded unpickler, which knows only stand-ins
of our own for the few globals a state needs and refuses any other before anything is
called. Tensors come out mapped from the file (`FileTensors`); `read_torch_bytes` reads
an archive held in memory (a DCP checkpoint's non-tensor item) the same way.

Writing emits the pickle opcodes directly (torch itself could not be imported to pickle
its own functions by reference) in the form `torch.load(weights_only=True)` accepts; the
storages, aligned to 64 bytes as torch aligns them (so `torch.load(mmap=True)` maps them),
are written in place as the chunks arrive (`slurm_geo.ckpt.files.ziparchive`).
"""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from slurm_geo.ckpt.files.skeleton import (
    SKELETON_FORMAT,
    SkeletonEncoder,
    TensorFileError,
    TorchName,
    walk_skeleton,
)
from slurm_geo.ckpt.files.tensorfile import (
    FileRegion,
    FileTensor,
    FileTensors,
    Loader,
    TensorFile,
    check_dtype,
    contiguous_strides,
    gathered,
    is_contiguous,
    map_range,
)
from slurm_geo.ckpt.files.torchpickle import (
    MAX_PICKLE_BYTES,
    STORAGE_CLASSES,
    NumpyArray,
    NumpyScalar,
    Storage,
    StoredTensor,
    unpickle_state,
)
from slurm_geo.ckpt.files.ziparchive import Fill, Member, write_archive
from slurm_geo.ckpt.format.manifest import DTYPE_SIZES, TensorEntry, tensor_nbytes

ALIGNMENT = 64  # of each storage in the archive, as torch.save writes it
ARCHIVE = "archive"


def is_torch_zip(path: Path) -> bool:
    return zipfile.is_zipfile(path)


def read_torch_file(path: Path) -> TensorFile:
    """The tensors (mapped) and skeleton of a torch.save zip file of a state."""
    if not is_torch_zip(path):
        raise TensorFileError(f"{path} is not a torch.save zip file (torch's legacy format, "
                              "before 1.6, is not read: save it again with torch.save)")
    with open(path, "rb") as handle:
        state = _read_archive(handle, str(path))

    def region(start: int, length: int) -> FileRegion:
        return FileRegion(path, start, length)

    def mapped(start: int, length: int) -> memoryview:
        return map_range(path, start, length)

    return _tensor_file(state, region, mapped)


def read_torch_bytes(data: bytes | bytearray | memoryview, where: str) -> TensorFile:
    """The tensors (copied out of `data`) and skeleton of a torch.save archive held in
    memory, such as a DCP checkpoint's non-tensor item; `where` names it in errors."""
    view = memoryview(data).cast("B")
    state = _read_archive(io.BytesIO(view), where)

    def piece(start: int, length: int) -> memoryview:
        return view[start:start + length]

    return _tensor_file(state, piece, piece)


def _read_archive(handle: BinaryIO, where: str) -> Any:
    """The state of the archive `handle` reads, its tensors `StoredTensor`s."""
    try:
        with zipfile.ZipFile(handle) as archive:
            prefix, storages = _storages(where, archive, handle)
            pickled = _read_bounded(archive, prefix + "data.pkl", where)
    except (zipfile.BadZipFile, OSError, KeyError, ValueError, EOFError) as exc:
        raise TensorFileError(f"{where}: not a readable torch.save archive ({exc})"[:300]
                              ) from None
    return unpickle_state(pickled, where, storages)


def _read_bounded(archive: zipfile.ZipFile, name: str, where: str) -> bytes:
    """The entry's bytes, never more than MAX_PICKLE_BYTES of them whatever its header
    claims (a deflated entry of a few hundred KB can inflate to gigabytes)."""
    with archive.open(name) as entry:
        data = entry.read(MAX_PICKLE_BYTES + 1)
    if len(data) > MAX_PICKLE_BYTES:
        raise TensorFileError(f"{where}: its {name} inflates to over "
                              f"{MAX_PICKLE_BYTES >> 20} MiB, more than a state's pickle has")
    return data


Piece = Callable[[int, int], FileRegion | memoryview]


def _tensor_file(state: Any, region: Piece, mapped: Callable[[int, int], memoryview]
                 ) -> TensorFile:
    """The state's tensors and arrays, each loaded from `region` (contiguous) or
    gathered from `mapped` (strided), and its skeleton."""
    encoder = _FileEncoder()
    document = {"format": SKELETON_FORMAT, "state": encoder.encode(state, ())}
    skeleton = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
    tensors = []
    for path, leaf in encoder.leaves:
        if isinstance(leaf, NumpyArray):
            tensors.append(FileTensor(path, leaf.dtype, leaf.shape, _array_loader(leaf)))
        else:
            tensors.append(FileTensor(path, leaf.dtype, leaf.shape,
                                      _loader(leaf, region, mapped)))
    return TensorFile(FileTensors(tensors), skeleton)


class _FileEncoder(SkeletonEncoder):
    """The skeleton `slurm_geo.torch.state.flatten_state` writes for the same state: a
    tensor or numpy array is a leaf with a path, a numpy scalar its dtype and value."""

    def __init__(self) -> None:
        super().__init__()
        self.leaves: list[tuple[str, StoredTensor | NumpyArray]] = []

    def encode_leaf(self, value: Any, where: tuple[str, ...]) -> Any:
        if isinstance(value, StoredTensor | NumpyArray):
            path = self.unique_path(where)
            self.leaves.append((path, value))
            return {"$": "tensor" if isinstance(value, StoredTensor) else "ndarray",
                    "path": path}
        if isinstance(value, NumpyScalar):
            return {"$": "npscalar", "dtype": value.dtype, "v": self.encode(value.value, where)}
        if isinstance(value, TorchName) and value.kind in ("dtype", "device"):
            return {"$": value.kind, "v": value.name}
        return None


def _storages(where: str, archive: zipfile.ZipFile, handle: BinaryIO
              ) -> tuple[str, dict[str, Storage]]:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise TensorFileError(f"{where} is a zip file but not a torch.save archive (no "
                              "<name>/data.pkl)")
    prefix = pickles[0].removesuffix("data.pkl")
    names = set(archive.namelist())
    if prefix + "byteorder" in names and _read_bounded(archive, prefix + "byteorder",
                                                       where) != b"little":
        raise TensorFileError(f"{where} holds big-endian storages; save it on a little-endian "
                              "host")
    storages = {}
    for info in archive.infolist():
        if not info.filename.startswith(prefix + "data/"):
            continue
        if info.compress_type != zipfile.ZIP_STORED:
            raise TensorFileError(f"{where}: storage {info.filename} is compressed; "
                                  "torch.save stores them as they are")
        handle.seek(info.header_offset)
        header = handle.read(30)
        if header[:4] != b"PK\x03\x04":
            raise TensorFileError(f"{where}: damaged zip entry {info.filename}")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        key = info.filename.removeprefix(prefix + "data/")
        storages[key] = Storage(key, "uint8", info.file_size,
                                info.header_offset + 30 + name_length + extra_length)
    return prefix, storages


def _loader(tensor: StoredTensor, region: Piece, mapped: Callable[[int, int], memoryview]
            ) -> Loader:
    size = DTYPE_SIZES[tensor.dtype]
    numel = math.prod(tensor.shape)
    start = tensor.storage.offset + tensor.offset * size
    if numel == 0 or is_contiguous(tensor.shape, tensor.stride):
        return lambda: region(start, numel * size)
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride, strict=True))
    return lambda: gathered(mapped(start, span * size), size, tensor.shape, tensor.stride)


def _array_loader(array: NumpyArray) -> Loader:
    if math.prod(array.shape) == 0 or not array.fortran:
        return lambda: memoryview(array.data)
    return lambda: gathered(memoryview(array.data), DTYPE_SIZES[array.dtype], array.shape,
                            array.strides())


# --- writing ----------------------------------------------------------------------------

def write_torch_file(path: Path, state: Any, tensors: Sequence[TensorEntry],
                     fill: Fill) -> None:
    """A torch.save file of the skeleton's `state`, the storage of each of `tensors` (in
    manifest order) written in place by `fill`."""
    if sys.byteorder != "little":
        raise TensorFileError("the checkpoint format is little-endian; this host is not")
    keys = {t.path: str(i) for i, t in enumerate(tensors)}
    pickled = walk_skeleton(state, _Pickler(keys, {t.path: t for t in tensors}))
    write_archive(path, [
        Member(f"{ARCHIVE}/data.pkl", b"\x80\x02" + pickled + b"."),
        Member(f"{ARCHIVE}/byteorder", b"little"),
        *(Member(f"{ARCHIVE}/data/{keys[t.path]}", size=tensor_nbytes(t.dtype, t.shape),
                 alignment=ALIGNMENT) for t in tensors),
        Member(f"{ARCHIVE}/version", b"3\n"),
    ], fill)


def _str(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _tuple(items: list[bytes]) -> bytes:
    if not items:
        return b")"
    if len(items) <= 3:
        return b"".join(items) + b"\x85\x86\x87"[len(items) - 1:len(items)]
    return b"(" + b"".join(items) + b"t"


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if -2**31 <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    encoded = pickle.encode_long(value)  # type: ignore[attr-defined]
    if len(encoded) < 256:
        return b"\x8a" + bytes([len(encoded)]) + encoded
    return b"\x8b" + struct.pack("<i", len(encoded)) + encoded


EMPTY_ORDERED_DICT = _global("collections", "OrderedDict") + b")R"


class _Pickler:
    """Pickle opcodes (protocol 2) of each skeleton node, the way torch.save writes them."""

    def __init__(self, keys: dict[str, str], entries: dict[str, TensorEntry]):
        self.keys, self.entries = keys, entries

    def tensor(self, path: str) -> bytes:
        entry = self.entries.get(path)
        if entry is None:
            raise TensorFileError(f"the checkpoint's skeleton names tensor {path!r}, which "
                                  "it does not hold")
        shape = [_int(n) for n in entry.shape]
        stride = [_int(s) for s in contiguous_strides(entry.shape)]
        numel = math.prod(entry.shape)
        legacy = STORAGE_CLASSES.get(entry.dtype)
        storage_class = _global("torch", legacy) if legacy else _global("torch.storage",
                                                                         "UntypedStorage")
        pid = (b"(" + _str("storage") + storage_class + _str(self.keys[path]) + _str("cpu")
               + _int(numel if legacy else numel * DTYPE_SIZES[entry.dtype]) + b"tQ")
        args = pid + _int(0) + _tuple(shape) + _tuple(stride) + b"\x89" + EMPTY_ORDERED_DICT
        if legacy:
            return _global("torch._utils", "_rebuild_tensor_v2") + b"(" + args + b"tR"
        return (_global("torch._utils", "_rebuild_tensor_v3") + b"(" + args
                + _global("torch", entry.dtype) + b"tR")

    def plain(self, value: Any) -> bytes:
        if value is None:
            return b"N"
        if type(value) is bool:
            return b"\x88" if value else b"\x89"
        if type(value) is int:
            return _int(value)
        if type(value) is float:
            return b"G" + struct.pack(">d", value)
        if type(value) is str:
            return _str(value)
        raise TensorFileError(f"the checkpoint's skeleton holds a {type(value).__name__}")

    def sequence(self, kind: str, items: list[bytes]) -> bytes:
        if kind == "tuple":
            return _tuple(items)
        if kind == "size":
            return _global("torch", "Size") + _tuple([_tuple(items)]) + b"R"
        return b"]" + (b"(" + b"".join(items) + b"e" if items else b"")

    def mapping(self, items: list[tuple[bytes, bytes]], metadata: bytes | None,
                ordered: bool) -> bytes:
        body = b"(" + b"".join(k + v for k, v in items) + b"u" if items else b""
        if not ordered:
            return b"}" + body
        state = b"}" + _str("_metadata") + metadata + b"s" if metadata is not None else b""
        return EMPTY_ORDERED_DICT + body + (state + b"b" if state else b"")

    def named(self, kind: str, value: Any) -> bytes:
        if kind == "float":
            return b"G" + struct.pack(">d", value)
        if kind == "bytes":
            return (_global("_codecs", "encode") + _str(value.decode("latin1")) + _str("latin1")
                    + b"\x86R")
        if kind == "dtype":
            check_dtype(value, "the checkpoint's skeleton")
            return _global("torch", value)
        return _global("torch", "device") + _tuple([_str(value)]) + b"R"
