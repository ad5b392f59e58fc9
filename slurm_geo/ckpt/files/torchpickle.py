"""The pickle of a `torch.save` archive (`data.pkl`) read without running anything it
names, within bounds: the one decoder of pickles in slurm-geo (docs/security.md).

A `.pt` file and a DCP checkpoint's non-tensor item (a `torch.save` blob) are written by
whoever holds the run's key; a pickle names functions that the standard unpickler calls, so
reading one with `torch.load(weights_only=False)` runs its writer's code as its reader.
Here `find_class` hands the unpickler only stand-ins of our own for the globals a state
needs (the tensor rebuild functions, storage classes, dtypes, `torch.Size`, `torch.device`,
`collections.OrderedDict`, `_codecs.encode` for bytes, and numpy's array, dtype and scalar
reconstructors, which numpy's RNG state needs); any other global refuses the pickle before
anything is called. The stand-ins only record what they are given; nothing of the
writer's is called, imported or instantiated.

Bounds, each a `TensorFileError` (one line) before the memory is spent:

* the pickle is at most `MAX_PICKLE_BYTES` (read so from a deflated zip entry, so a small
  compressed bomb stops at the limit);
* its opcodes are checked before it is loaded: memo indices as a pickler numbers them
  (CPython's unpickler sizes its memo by the largest index: one `LONG_BINPUT 2**30` in a
  few bytes asks for gigabytes), no extension-registry codes;
* the loaded state, counted as the tree every later step walks (shared objects counted at
  each place they appear, one per node plus the length of each string, bytes and array),
  is at most `MAX_STATE_UNITS` and `MAX_DEPTH` deep, with no cycles: a few hundred bytes of
  memo references double at each level and would expand to gigabytes.

Tensors are `StoredTensor`s (a storage, offset, shape, stride; the caller maps or copies
the bytes), checked to lie inside their storage and to hold no more elements than it does.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from slurm_geo.ckpt.files.skeleton import TensorFileError, TorchName, TorchSize
from slurm_geo.ckpt.files.tensorfile import check_dtype
from slurm_geo.ckpt.format.manifest import DTYPE_SIZES

MAX_PICKLE_BYTES = 64 << 20  # a state dict of 100k tensors pickles to ~20 MB
MAX_STATE_UNITS = 64 << 20  # nodes + string/bytes/array lengths, as the tree is walked
MAX_DEPTH = 200  # nesting: a state dict is a few levels deep
MAX_ARCHIVE_BYTES = 1 << 30  # a DCP non-tensor item, read into memory whole

# torch's legacy storage classes by the dtype they hold; other dtypes use UntypedStorage.
STORAGE_CLASSES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}
# numpy's dtype codes (kind, item size) for the dtypes a checkpoint names
NUMPY_DTYPES = {
    "f8": "float64", "f4": "float32", "f2": "float16", "c8": "complex64",
    "c16": "complex128", "i8": "int64", "i4": "int32", "i2": "int16", "i1": "int8",
    "u8": "uint64", "u4": "uint32", "u2": "uint16", "u1": "uint8", "b1": "bool",
}
SCALAR_FORMATS = {
    "float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i",
    "int16": "<h", "int8": "<b", "uint64": "<Q", "uint32": "<I", "uint16": "<H",
    "uint8": "<B", "bool": "<?",
}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_REFUSED_OPS = {"EXT1", "EXT2", "EXT4", "PERSID"}
_NDARRAY = TorchName("numpy", "ndarray")  # only `_reconstruct`'s first argument


@dataclass(frozen=True, slots=True)
class Storage:
    key: str
    dtype: str  # "uint8" for an untyped storage: its bytes
    numel: int
    offset: int  # of its bytes in the archive


@dataclass(frozen=True, slots=True)
class StorageType:
    dtype: str


@dataclass(frozen=True, slots=True)
class StoredTensor:
    storage: Storage
    dtype: str
    offset: int  # in elements of dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NumpyScalar:
    dtype: str
    value: bool | int | float


class NumpyDType:
    """What `numpy.dtype(code, align, copy)` and its BUILD state said: a plain dtype."""

    def __init__(self, name: str):
        self.name = name

    def __setstate__(self, state: Any) -> None:
        if not (type(state) is tuple and len(state) >= 5 and state[1] in ("<", "|", "=")
                and state[2:5] == (None, None, None)):
            raise TensorFileError(f"a numpy dtype {self.name} that is big-endian or "
                                  "structured, which a checkpoint cannot hold")


class NumpyArray:
    """`numpy.ndarray` as its pickle rebuilds one: `_reconstruct` makes an empty one and
    BUILD gives its shape, dtype, order and bytes, each checked here."""

    def __init__(self) -> None:
        self.dtype = ""
        self.shape: tuple[int, ...] = ()
        self.fortran = False
        self.data = b""
        self.built = False

    def __setstate__(self, state: Any) -> None:
        if not (type(state) is tuple and len(state) == 5 and state[0] == 1
                and _ints(state[1]) and isinstance(state[2], NumpyDType)
                and type(state[3]) is bool
                and type(state[4]) is bytes):
            raise TensorFileError("a numpy array whose pickled state is not a plain array's "
                                  "(shape, dtype, order, bytes)")
        shape, dtype, data = tuple(state[1]), state[2].name, state[4]
        if len(data) != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise TensorFileError(f"a numpy array of shape {list(shape)[:8]} and dtype {dtype} "
                                  f"pickled with {len(data)} bytes")
        self.dtype, self.shape, self.fortran, self.data = dtype, shape, state[3], data
        self.built = True

    def strides(self) -> tuple[int, ...]:
        """In elements, of `data` as pickled (Fortran order reverses C's)."""
        steps, step = [], 1
        for size in (self.shape if self.fortran else reversed(self.shape)):
            steps.append(step)
            step *= size
        return tuple(steps) if self.fortran else tuple(reversed(steps))


class MetadataDict(OrderedDict):
    """`collections.OrderedDict` as a state dict pickles it: BUILD may set only the
    `_metadata` that `nn.Module.state_dict` attaches."""

    def __setstate__(self, state: Any) -> None:
        if not (type(state) is dict and set(state) == {"_metadata"}):
            raise TensorFileError("an OrderedDict whose pickled state is not nn.Module's "
                                  "_metadata")
        self._metadata = state["_metadata"]


def unpickle_state(pickled: bytes, where: str, storages: dict[str, Storage]) -> Any:
    """The state `pickled` holds: plain values, `StoredTensor`s, `NumpyArray`s,
    `NumpyScalar`s, `TorchName`s and `TorchSize`s; a `TensorFileError` naming `where`
    when it is more than a state or beyond the bounds."""
    check_opcodes(pickled, where)
    try:
        state = _Unpickler(pickled, where, storages).load()
    except TensorFileError as exc:
        raise TensorFileError(_named(where, str(exc))) from None
    # A damaged or foreign pickle fails with whatever the opcodes meet first.
    except Exception as exc:  # noqa: BLE001
        raise TensorFileError(f"{where}: its pickle does not load as a state dict "
                              f"({type(exc).__name__}: {exc})"[:300]) from None
    check_tree(state, where)
    return state


def check_opcodes(pickled: bytes, where: str) -> None:
    """Every opcode parses, memo indices are numbered as a pickler numbers them, and no
    opcode reaches the extension registry or a text persistent id."""
    if len(pickled) > MAX_PICKLE_BYTES:
        raise TensorFileError(f"{where}: its pickle is {len(pickled)} bytes, over the "
                              f"{MAX_PICKLE_BYTES >> 20} MiB a state's pickle may have")
    memo = 0
    try:
        for opcode, arg, _pos in pickletools.genops(pickled):
            name = opcode.name
            if name in _PUTS:
                if not (type(arg) is int and 0 <= arg <= memo):
                    raise TensorFileError(f"{where}: its pickle stores memo entry {arg!r:.20} "
                                          f"after {memo} (a pickler numbers them in order)")
                memo += arg == memo
            elif name == "MEMOIZE":
                memo += 1
            elif name in _GETS and not (type(arg) is int and 0 <= arg < memo):
                raise TensorFileError(f"{where}: its pickle reads memo entry {arg!r:.20} "
                                      "it never stored")
            elif name in _REFUSED_OPS:
                raise TensorFileError(f"{where}: its pickle uses opcode {name}, which a "
                                      "torch.save state does not")
    except ValueError as exc:  # genops on truncated or unknown opcodes
        raise TensorFileError(f"{where}: its pickle does not load as a state dict "
                              f"({exc})"[:300]) from None


def check_tree(state: Any, where: str) -> None:
    """The state, walked as a tree (shared parts at each place), is within the bounds."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(value: Any, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise TensorFileError(f"{where}: its state nests deeper than {MAX_DEPTH} levels")
        if type(value) in (str, bytes):
            return 1 + len(value)
        if isinstance(value, NumpyArray):
            if not value.built:
                raise TensorFileError(f"{where}: a numpy array its pickle never filled")
            return 1 + len(value.data)
        children = _children(value)
        if children is None:
            return 1
        key = id(value)
        if key in sizes:
            return sizes[key]
        if key in open_:
            raise TensorFileError(f"{where}: its state contains itself (a cycle)")
        open_.add(key)
        total = 1
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_STATE_UNITS:
                raise TensorFileError(
                    f"{where}: its state expands to over {MAX_STATE_UNITS >> 20} M nodes and "
                    "bytes (shared parts repeated): refused before it is built")
        open_.discard(key)
        sizes[key] = total
        return total

    size(state, 0)


def _children(value: Any) -> list[Any] | None:
    if isinstance(value, dict):
        items = [x for pair in value.items() for x in pair]
        metadata = getattr(value, "_metadata", None)
        return items + ([metadata] if metadata is not None else [])
    if type(value) in (list, tuple, TorchSize):
        return list(value)
    return None


def _named(where: str, message: str) -> str:
    return message if message.startswith(where) else f"{where}: {message}"


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str, storages: dict[str, Storage]):
        super().__init__(io.BytesIO(data))
        self.where = where
        self.storages = storages
        self.globals = self._allowed()

    def _allowed(self) -> dict[tuple[str, str], Any]:
        allowed: dict[tuple[str, str], Any] = {
            ("torch._utils", "_rebuild_tensor_v2"): self.rebuild_v2,
            ("torch._utils", "_rebuild_tensor_v3"): self.rebuild_v3,
            ("torch._utils", "_rebuild_parameter"): self.parameter,
            ("torch._utils", "_rebuild_parameter_with_state"): self.parameter,
            ("torch.storage", "UntypedStorage"): StorageType("uint8"),
            ("collections", "OrderedDict"): MetadataDict,
            ("torch", "Size"): self.size,
            ("torch", "device"): self.device,
            ("_codecs", "encode"): self.encode,
        }
        allowed.update({("torch", cls): StorageType(dtype)
                        for dtype, cls in STORAGE_CLASSES.items()})
        allowed.update({("torch", dtype): TorchName("dtype", dtype) for dtype in DTYPE_SIZES})
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            allowed[(module, "_reconstruct")] = self.reconstruct
            allowed[(module, "scalar")] = self.scalar
        allowed[("numpy", "ndarray")] = _NDARRAY
        allowed[("numpy", "dtype")] = self.numpy_dtype
        return allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self.globals.get((module, name))
        if found is None:
            raise TensorFileError(
                f"{self.where}: refused to unpickle {module}.{name}: a torch.save file of a "
                "state dict needs only tensors and plain values (nothing was run; load it "
                "with torch yourself if you trust whoever wrote it)"[:400])
        return found

    def persistent_load(self, pid: Any) -> Storage:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], StorageType) and pid[1].dtype in DTYPE_SIZES
                and type(pid[2]) is str and type(pid[4]) is int and pid[4] >= 0):
            raise TensorFileError(f"{self.where}: its pickle names a storage as {pid!r:.80}")
        kind, key, numel = pid[1], pid[2], pid[4]
        stored = self.storages.get(key)
        if stored is None or stored.numel < numel * DTYPE_SIZES[kind.dtype]:
            raise TensorFileError(f"{self.where}: storage {key!r:.40} is missing or short")
        return Storage(key, kind.dtype, numel, stored.offset)

    def rebuild_v2(self, storage: Any, offset: Any, size: Any, stride: Any, *_rest: Any
                   ) -> StoredTensor:
        if not isinstance(storage, Storage):
            raise TensorFileError(f"{self.where}: a tensor rebuilt from {type(storage)}")
        return self._tensor(storage, storage.dtype, offset, size, stride)

    def rebuild_v3(self, storage: Any, offset: Any, size: Any, stride: Any,
                   _requires_grad: Any, _hooks: Any, dtype: Any, *_rest: Any) -> StoredTensor:
        if not isinstance(storage, Storage) or storage.dtype != "uint8" or not (
                isinstance(dtype, TorchName) and dtype.kind == "dtype"):
            raise TensorFileError(f"{self.where}: a tensor rebuilt from {type(storage)}")
        return self._tensor(storage, dtype.name, offset, size, stride)

    def _tensor(self, storage: Storage, dtype: str, offset: Any, size: Any,
                stride: Any) -> StoredTensor:
        if not (_ints(size) and _ints(stride) and len(size) == len(stride) and _ints((offset,))):
            raise TensorFileError(f"{self.where}: a tensor of size {size!r:.60} stride "
                                  f"{stride!r:.60}")
        check_dtype(dtype, self.where)
        tensor = StoredTensor(storage, dtype, offset, tuple(size), tuple(stride))
        check_tensor(tensor, self.where)
        return tensor

    def parameter(self, data: Any, *_rest: Any) -> StoredTensor:
        if not isinstance(data, StoredTensor):
            raise TensorFileError(f"{self.where}: a parameter of {type(data)}")
        return data

    def size(self, dims: Any = ()) -> TorchSize:
        if not _ints(dims):
            raise TensorFileError(f"{self.where}: torch.Size{dims!r:.60}")
        return TorchSize(dims)

    def device(self, kind: Any, index: Any = None) -> TorchName:
        if type(kind) is not str or not (index is None or type(index) is int):
            raise TensorFileError(f"{self.where}: torch.device{(kind, index)!r:.60}")
        return TorchName("device", kind if index is None else f"{kind}:{index}")

    def encode(self, text: Any, encoding: Any = "utf-8") -> bytes:
        if type(text) is not str or encoding != "latin1":
            raise TensorFileError(f"{self.where}: _codecs.encode of {type(text)}, "
                                  f"{encoding!r:.20}")
        return text.encode("latin1")

    def reconstruct(self, kind: Any, shape: Any, code: Any) -> NumpyArray:
        if kind is not _NDARRAY or shape != (0,) or code != b"b":
            raise TensorFileError(f"{self.where}: numpy _reconstruct of {type(kind)}")
        return NumpyArray()

    def numpy_dtype(self, code: Any, align: Any = False, copy: Any = False) -> NumpyDType:
        if type(code) is not str or code not in NUMPY_DTYPES:
            raise TensorFileError(f"{self.where}: numpy dtype {code!r:.20}, which a "
                                  "checkpoint cannot hold")
        return NumpyDType(NUMPY_DTYPES[code])

    def scalar(self, dtype: Any, data: Any) -> NumpyScalar:
        if not (isinstance(dtype, NumpyDType)
                and dtype.name in SCALAR_FORMATS and type(data) is bytes
                and len(data) == DTYPE_SIZES[dtype.name]):
            raise TensorFileError(f"{self.where}: a numpy scalar that is not a plain number")
        value = struct.unpack(SCALAR_FORMATS[dtype.name], data)[0]
        return NumpyScalar(dtype.name, value)


def check_tensor(tensor: StoredTensor, where: str) -> None:
    """The tensor lies inside its storage and holds no more elements than the storage
    does (a stride-0 view of one element as a 10**12-element tensor would be copied out
    at full size)."""
    element = DTYPE_SIZES[tensor.dtype]
    available = tensor.storage.numel * DTYPE_SIZES[tensor.storage.dtype] // element
    numel = math.prod(tensor.shape)
    if numel == 0:
        return
    last = tensor.offset + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride,
                                                         strict=True))
    if last >= available:
        raise TensorFileError(f"{where}: a tensor reaches past the end of storage "
                              f"{tensor.storage.key!r:.40}")
    if numel > available:
        raise TensorFileError(f"{where}: a tensor of {numel} elements views storage "
                              f"{tensor.storage.key!r:.40} of {available} (overlapping "
                              "strides): save a copy of it (tensor.clone())")


def _ints(values: Any) -> bool:
    return type(values) in (tuple, TorchSize) and all(
        type(v) is int and v >= 0 for v in values)
