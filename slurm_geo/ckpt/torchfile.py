"""`torch.save` files without torch: read through a restricted unpickler, written by hand.

A torch.save file is a zip archive, every entry stored uncompressed: `<name>/data.pkl`, a
pickle of the state in which each tensor is a call to `torch._utils._rebuild_tensor_v2`
(v3 for dtypes without a legacy storage class) on a persistent id naming a raw storage,
`<name>/data/<key>`; `<name>/byteorder` says how those bytes are ordered.

Reading never imports torch and never runs anything a file names: `find_class` hands the
unpickler only stand-ins of our own for the few globals a state dict needs (the tensor
rebuild functions, storage classes, dtypes, `torch.Size`, `torch.device`,
`collections.OrderedDict`, `_codecs.encode` for bytes); any other global refuses the
file, before anything is called. Tensors come out mapped from the file (`FileTensors`).

Writing emits the pickle opcodes directly (torch itself could not be imported to pickle
its own functions by reference) in the form `torch.load(weights_only=True)` accepts; the
storages, aligned to 64 bytes as torch aligns them (so `torch.load(mmap=True)` maps them),
are written in place as the chunks arrive (`slurm_geo.ckpt.ziparchive`).
"""

from __future__ import annotations

import math
import pickle
import struct
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_geo.ckpt.manifest import DTYPE_SIZES, TensorEntry, tensor_nbytes
from slurm_geo.ckpt.skeleton import (
    TensorFileError,
    TorchName,
    TorchSize,
    encode_skeleton,
    walk_skeleton,
)
from slurm_geo.ckpt.tensorfile import (
    FileRegion,
    FileTensor,
    FileTensors,
    TensorFile,
    check_dtype,
    contiguous_strides,
    gathered,
    is_contiguous,
    map_range,
)
from slurm_geo.ckpt.ziparchive import Fill, Member, write_archive

# torch's legacy storage classes by the dtype they hold; other dtypes use UntypedStorage.
STORAGE_CLASSES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}
ALIGNMENT = 64  # of each storage in the archive, as torch.save writes it
ARCHIVE = "archive"


def is_torch_zip(path: Path) -> bool:
    return zipfile.is_zipfile(path)


def read_torch_file(path: Path) -> TensorFile:
    """The tensors (mapped) and skeleton of a torch.save zip file of a state."""
    if not is_torch_zip(path):
        raise TensorFileError(f"{path} is not a torch.save zip file (torch's legacy format, "
                              "before 1.6, is not read: save it again with torch.save)")
    try:
        with zipfile.ZipFile(path) as archive:
            prefix, storages = _storages(path, archive)
            pickled = archive.read(prefix + "data.pkl")
    except (zipfile.BadZipFile, OSError, KeyError, ValueError) as exc:
        raise TensorFileError(f"{path}: not a readable torch.save archive ({exc})") from None
    unpickler = _Unpickler(pickled, path, storages)
    try:
        state = unpickler.load()
    except TensorFileError:
        raise
    # A damaged or foreign pickle fails with whatever the opcodes meet first.
    except Exception as exc:  # noqa: BLE001
        raise TensorFileError(f"{path}: its pickle does not load as a state dict "
                              f"({type(exc).__name__}: {exc})"[:300]) from None
    leaves, skeleton = encode_skeleton(state, lambda v: isinstance(v, _StoredTensor))
    tensors = [FileTensor(p, t.dtype, t.shape, _loader(path, t)) for p, t in leaves]
    return TensorFile(FileTensors(tensors), skeleton)


@dataclass(frozen=True, slots=True)
class _Storage:
    key: str
    dtype: str  # "uint8" for an untyped storage: its bytes
    numel: int
    offset: int  # of its bytes in the file


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: str


@dataclass(frozen=True, slots=True)
class _StoredTensor:
    storage: _Storage
    dtype: str
    offset: int  # in elements of dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _storages(path: Path, archive: zipfile.ZipFile) -> tuple[str, dict[str, _Storage]]:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise TensorFileError(f"{path} is a zip file but not a torch.save archive (no "
                              "<name>/data.pkl)")
    prefix = pickles[0].removesuffix("data.pkl")
    names = set(archive.namelist())
    if prefix + "byteorder" in names and archive.read(prefix + "byteorder") != b"little":
        raise TensorFileError(f"{path} holds big-endian storages; save it on a little-endian "
                              "host")
    storages = {}
    with open(path, "rb") as handle:
        for info in archive.infolist():
            if not info.filename.startswith(prefix + "data/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise TensorFileError(f"{path}: storage {info.filename} is compressed; "
                                      "torch.save stores them as they are")
            handle.seek(info.header_offset)
            header = handle.read(30)
            if header[:4] != b"PK\x03\x04":
                raise TensorFileError(f"{path}: damaged zip entry {info.filename}")
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            key = info.filename.removeprefix(prefix + "data/")
            storages[key] = _Storage(key, "uint8", info.file_size,
                                     info.header_offset + 30 + name_length + extra_length)
    return prefix, storages


def _loader(path: Path, tensor: _StoredTensor):
    size = DTYPE_SIZES[tensor.dtype]
    numel = math.prod(tensor.shape)
    start = tensor.storage.offset + tensor.offset * size
    if numel == 0 or is_contiguous(tensor.shape, tensor.stride):
        return lambda: FileRegion(path, start, numel * size)
    span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride, strict=True))
    return lambda: gathered(map_range(path, start, span * size), size, tensor.shape,
                            tensor.stride)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path, storages: dict[str, _Storage]):
        import io

        super().__init__(io.BytesIO(data))
        self.path = path
        self.storages = storages
        self.globals = self._allowed()

    def _allowed(self) -> dict[tuple[str, str], Any]:
        allowed: dict[tuple[str, str], Any] = {
            ("torch._utils", "_rebuild_tensor_v2"): self.rebuild_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self.rebuild_v3,
            ("torch._utils", "_rebuild_parameter"): self.parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): self.parameter,
            ("torch.storage", "UntypedStorage"): _StorageType("uint8"),
            ("collections", "OrderedDict"): OrderedDict,
            ("torch", "Size"): self.size,
            ("torch", "device"): self.device,
            ("_codecs", "encode"): self.encode,
        }
        allowed.update({("torch", cls): _StorageType(dtype)
                        for dtype, cls in STORAGE_CLASSES.items()})
        allowed.update({("torch", dtype): TorchName("dtype", dtype) for dtype in DTYPE_SIZES})
        return allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self.globals.get((module, name))
        if found is None:
            raise TensorFileError(
                f"{self.path}: refused to unpickle {module}.{name}: a torch.save file of a "
                "state dict needs only tensors and plain values (nothing was run; load it "
                "with torch yourself if you trust whoever wrote it)"[:400])
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and type(pid[2]) is str
                and type(pid[4]) is int):
            raise TensorFileError(f"{self.path}: its pickle names a storage as {pid!r:.80}")
        kind, key, numel = pid[1], pid[2], pid[4]
        stored = self.storages.get(key)
        if stored is None or stored.numel < numel * DTYPE_SIZES[kind.dtype]:
            raise TensorFileError(f"{self.path}: storage {key!r} is missing or short")
        return _Storage(key, kind.dtype, numel, stored.offset)

    def rebuild_v2(self, storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any
                   ) -> _StoredTensor:
        if not isinstance(storage, _Storage):
            raise TensorFileError(f"{self.path}: a tensor rebuilt from {type(storage)}")
        return self._tensor(storage, storage.dtype, offset, size, stride)

    def rebuild_v3(self, storage: Any, offset: Any, size: Any, stride: Any,
                   _requires_grad: Any, _hooks: Any, dtype: Any, *_rest: Any) -> _StoredTensor:
        if not isinstance(storage, _Storage) or storage.dtype != "uint8" or not (
                isinstance(dtype, TorchName) and dtype.kind == "dtype"):
            raise TensorFileError(f"{self.path}: a tensor rebuilt from {type(storage)}")
        return self._tensor(storage, dtype.name, offset, size, stride)

    def _tensor(self, storage: _Storage, dtype: str, offset: Any, size: Any,
                stride: Any) -> _StoredTensor:
        if not (_ints(size) and _ints(stride) and len(size) == len(stride) and _ints((offset,))):
            raise TensorFileError(f"{self.path}: a tensor of size {size!r:.60} stride "
                                  f"{stride!r:.60}")
        check_dtype(dtype, str(self.path))
        element = DTYPE_SIZES[dtype]
        available = storage.numel * DTYPE_SIZES[storage.dtype] // element
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if math.prod(size) and last >= available:
            raise TensorFileError(f"{self.path}: a tensor reaches past the end of storage "
                                  f"{storage.key!r}")
        return _StoredTensor(storage, dtype, offset, tuple(size), tuple(stride))

    def parameter(self, data: Any, *_rest: Any) -> _StoredTensor:
        if not isinstance(data, _StoredTensor):
            raise TensorFileError(f"{self.path}: a parameter of {type(data)}")
        return data

    def size(self, dims: Any = ()) -> TorchSize:
        if not _ints(dims):
            raise TensorFileError(f"{self.path}: torch.Size{dims!r:.60}")
        return TorchSize(dims)

    def device(self, kind: Any, index: Any = None) -> TorchName:
        if type(kind) is not str or not (index is None or type(index) is int):
            raise TensorFileError(f"{self.path}: torch.device{(kind, index)!r:.60}")
        return TorchName("device", kind if index is None else f"{kind}:{index}")

    def encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        if type(text) is not str or encoding != "latin1":
            raise TensorFileError(f"{self.path}: _codecs.encode of {type(text)}, {encoding!r}")
        return text.encode("latin1")


def _ints(values: Any) -> bool:
    return type(values) in (tuple, TorchSize) and all(
        type(v) is int and v >= 0 for v in values)


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
