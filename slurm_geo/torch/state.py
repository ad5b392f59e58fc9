"""Nested training state <-> (checkpoint tensors, extra-state bytes), both ways, purely.

A state is any nesting of dicts, lists and tuples whose leaves are tensors, numpy arrays or
plain values: `model.state_dict()`, `optimizer.state_dict()`, RNG states, a data position.
Flattening pulls every tensor out as a `slurm_geo.ckpt.Tensor` named by a stable dotted
path (`model.fc1.weight`, `optimizer.state.0.exp_avg`), so the same tensor of the next save
has the same path and the repository can deduplicate or delta it. What is left, the
*skeleton*, is written as JSON into the checkpoint's extra state.

No pickle anywhere. Plain values are JSON; what JSON cannot say (tuples, non-string dict
keys, NaN, bytes, numpy scalars, torch dtypes) is a tagged object `{"$": kind, ...}`, and a
dict that itself has a "$" key is written in the tagged form too, so tags are unambiguous.
Any other object is refused with a TypeError naming its path: pickling it would make
loading a checkpoint run code, and the store is off-site (sealing authenticates it, but a
reader should not have to trust every writer's Python environment). Put such objects in
the state as bytes you serialize yourself.
"""

from __future__ import annotations

import base64
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from slurm_geo.ckpt import Tensor
from slurm_geo.ckpt.files.skeleton import SKELETON_FORMAT, SkeletonEncoder
from slurm_geo.ckpt.files.tensorfile import FileRegion, map_range
from slurm_geo.ckpt.files.torchfile import read_torch_bytes, read_torch_file
from slurm_geo.ckpt.format.manifest import DTYPE_SIZES
from slurm_geo.ckpt.repo.repository import StreamedTensor

TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {
    dtype: name
    for name in DTYPE_SIZES
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}
TORCH_DTYPES = {name: dtype for dtype, name in TORCH_DTYPE_NAMES.items()}

try:
    import numpy
except ImportError:  # numpy is optional: states then hold no arrays
    numpy = None  # type: ignore[assignment]


class StateFormatError(ValueError):
    """Extra state that is not a skeleton this module wrote, or tensors it does not match."""


def flatten_state(state: Any, *, copy: bool = False,
                  sources: dict[str, torch.Tensor] | None = None) -> tuple[list[Tensor], bytes]:
    """The tensors of `state` and its skeleton; `copy` snapshots tensors into new CPU memory.

    Without `copy`, a CPU tensor's bytes are shared, not copied (a view of the tensor's own
    memory, only its elements, not the rest of its storage): the caller must not change
    the tensors until the result has been written. `sources`, if given, receives the torch
    tensor each path was taken from (the caller's, not the snapshot).
    """
    if sys.byteorder != "little":
        raise RuntimeError("the checkpoint format is little-endian; this host is not")
    encoder = _Encoder(copy, sources)
    skeleton = encoder.encode(state, ())
    document = {"format": SKELETON_FORMAT, "state": skeleton}
    return encoder.tensors, json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def unflatten_state(tensors: Iterable[Tensor], extra_state: bytes) -> Any:
    """The state `flatten_state` was given, with tensors on the CPU."""
    try:
        document = json.loads(extra_state)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StateFormatError(f"extra state is not a training-state skeleton ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != SKELETON_FORMAT:
        raise StateFormatError(f"extra state is not in format {SKELETON_FORMAT!r}")
    decoder = _Decoder({t.path: t for t in tensors})
    state = decoder.decode(document.get("state"))
    unused = decoder.records.keys() - decoder.used
    if unused:
        raise StateFormatError(f"tensors {sorted(unused)[:5]} are not in the skeleton")
    return state


def tensors_from_torch_file(path: Path | str) -> tuple[list[Tensor], bytes]:
    """A `torch.save` file of a state dict as checkpoint tensors and skeleton.

    Read through slurm-geo's restricted, bounded unpickler (`slurm_geo.ckpt.files.torchpickle`),
    never torch's: nothing the file names is run, and a file that would expand beyond
    bounds is refused; a `TensorFileError` names the file. Tensor bytes are mapped from
    the file. torch's legacy format (before 1.6) is refused: save it again.
    """
    tensor_file = read_torch_file(Path(path))
    return _records(tensor_file.tensors), tensor_file.extra_state


def load_torch_bytes(data: bytes | bytearray | memoryview, where: str) -> Any:
    """A `torch.save` archive held in memory (a DCP checkpoint's non-tensor item) as the
    value it holds, read as `tensors_from_torch_file` reads a file: nothing it names runs,
    and only tensors, numpy arrays and scalars, plain values, `torch.Size`, dtypes and
    devices come out. A `TensorFileError` names `where`."""
    tensor_file = read_torch_bytes(data, where)
    return unflatten_state(_records(tensor_file.tensors), tensor_file.extra_state)


def _records(tensors: Sequence[Tensor | StreamedTensor]) -> list[Tensor]:
    records = []
    for t in tensors:
        if isinstance(t, StreamedTensor):
            region = t.data
            assert isinstance(region, FileRegion)
            t = Tensor(t.path, t.dtype, t.shape, map_range(region.path, region.start,
                                                           region.length))
        records.append(t)
    return records


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The C-contiguous bytes of a CPU tensor's elements; a view when it is contiguous."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.contiguous().cpu()
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def tensor_from_bytes(dtype: str, shape: tuple[int, ...], data: Any) -> torch.Tensor:
    """A new, writable CPU tensor holding `data` (copied) as `dtype` and `shape`."""
    if dtype not in TORCH_DTYPES:
        raise StateFormatError(f"dtype {dtype!r} has no torch equivalent here")
    raw = bytearray(data)
    if not raw:
        return torch.empty(shape, dtype=TORCH_DTYPES[dtype])
    return torch.frombuffer(raw, dtype=torch.uint8).view(TORCH_DTYPES[dtype]).reshape(shape)


def _snapshot(tensor: torch.Tensor, copy: bool) -> torch.Tensor:
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if copy or tensor.device.type != "cpu" or not tensor.is_contiguous():
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        out.copy_(tensor)
        return out
    return tensor


class _Encoder(SkeletonEncoder):
    """Torch values: tensors, numpy arrays and scalars, `torch.Size`, dtypes and devices."""

    def __init__(self, copy: bool, sources: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.copy = copy
        self.sources = sources
        self.tensors: list[Tensor] = []

    def encode_leaf(self, value: Any, where: tuple[str, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            return {"$": "tensor", "path": self.add_tensor(value, where)}
        if numpy is not None and isinstance(value, (numpy.ndarray, numpy.generic)):
            return self.encode_numpy(value, where)
        if isinstance(value, torch.dtype):
            return {"$": "dtype", "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$": "device", "v": str(value)}
        return None

    def is_size(self, value: Any) -> bool:
        return type(value) is torch.Size

    def refusal(self, value: Any, where: tuple[str, ...]) -> Exception:
        return TypeError(
            f"state at {'.'.join(where) or '<root>'!r} is a {type(value).__qualname__}, which "
            "a checkpoint cannot hold: use tensors, arrays, numbers, strings, bytes, "
            "lists, tuples and dicts")

    def encode_numpy(self, value: Any, where: tuple[str, ...]) -> Any:
        if isinstance(value, numpy.generic):
            return {"$": "npscalar", "dtype": value.dtype.name,
                    "v": self.encode(value.item(), where)}
        name = value.dtype.name
        if name not in DTYPE_SIZES or value.dtype.byteorder == ">":
            raise TypeError(f"state at {'.'.join(where)!r}: numpy dtype {value.dtype} "
                            "cannot be stored")
        data = numpy.ascontiguousarray(value)
        if self.copy and data is value:
            data = data.copy()
        path = self.unique_path(where)
        self.tensors.append(Tensor(path, name, tuple(data.shape), data.reshape(-1).data.cast("B")))
        return {"$": "ndarray", "path": path}

    def add_tensor(self, tensor: torch.Tensor, where: tuple[str, ...]) -> str:
        name = '.'.join(where) or '<root>'
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"tensor {name!r}: {tensor.layout} tensors cannot be stored")
        if tensor.dtype not in TORCH_DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {tensor.dtype} has no checkpoint name")
        snapshot = _snapshot(tensor, self.copy)
        path = self.unique_path(where)
        if self.sources is not None:
            self.sources[path] = tensor
        self.tensors.append(Tensor(path, TORCH_DTYPE_NAMES[tensor.dtype], tuple(snapshot.shape),
                                   tensor_bytes(snapshot)))
        return path


class _Decoder:
    def __init__(self, records: dict[str, Tensor]):
        self.records = records
        self.used: set[str] = set()

    def decode(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "$" not in node:
            return {k: self.decode(v) for k, v in node.items()}
        try:
            return self.decode_tagged(node["$"], node)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StateFormatError):
                raise
            raise StateFormatError(f"malformed {node.get('$')!r} entry in skeleton") from exc

    def decode_tagged(self, kind: str, node: dict[str, Any]) -> Any:
        if kind == "tensor":
            record = self.record(node["path"])
            return tensor_from_bytes(record.dtype, tuple(record.shape), record.data)
        if kind == "ndarray":
            record = self.record(node["path"])
            return numpy.frombuffer(bytes(record.data), dtype=record.dtype).reshape(
                record.shape).copy()
        if kind == "dict":
            decoded = OrderedDict((self.decode(k), self.decode(v)) for k, v in node["items"])
            if "metadata" in node:
                decoded._metadata = self.decode(node["metadata"])  # type: ignore[attr-defined]
                return decoded
            return dict(decoded)
        if kind in ("tuple", "size"):
            items = tuple(self.decode(v) for v in node["items"])
            return torch.Size(items) if kind == "size" else items
        simple: dict[str, Callable[[Any], Any]] = {
            "float": lambda v: float(v),
            "bytes": base64.b64decode,
            "dtype": lambda v: TORCH_DTYPES[v],
            "device": torch.device,
            "npscalar": lambda v: numpy.dtype(node["dtype"]).type(self.decode(v)),
        }
        if kind not in simple:
            raise StateFormatError(f"unknown skeleton entry kind {kind!r}")
        return simple[kind](node["v"])

    def record(self, path: str) -> Tensor:
        if path not in self.records:
            raise StateFormatError(f"the skeleton names tensor {path!r}, which is missing")
        self.used.add(path)
        return self.records[path]
