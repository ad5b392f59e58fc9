"""Safetensors files without torch: a JSON header and the tensors' raw bytes, back to back.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and `data_offsets` (from the end of the header), an optional
`__metadata__` of strings, then the bytes. Reading checks the header as strictly as the
reference implementation does (its 100 MB bound; every byte of the data section belongs
to exactly one tensor, none overlap) and maps each tensor from the file (`FileTensors`);
the skeleton is the flat mapping of names to tensors, `__metadata__` kept in it so a pull
writes it back. Writing needs such a flat state (of a Checkpointer's training state, its
model's, `held_part`): the header goes first, its offsets known
from the manifest's shapes, then each tensor's chunks, written in place as they arrive.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slurm_geo.ckpt.files.skeleton import TensorFileError, encode_skeleton, walk_skeleton
from slurm_geo.ckpt.files.tensorfile import FileRegion, FileTensor, FileTensors, TensorFile
from slurm_geo.ckpt.files.ziparchive import Fill
from slurm_geo.ckpt.format.manifest import TensorEntry, tensor_nbytes

MAX_HEADER_SIZE = 100_000_000  # the reference implementation's bound
METADATA_KEY = "__metadata__"
SUFFIX = ".safetensors"
# safetensors' dtype names with an exact checkpoint equivalent; F8 are torch's e4m3fn/e5m2.
DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def is_safetensors_file(path: Path) -> bool:
    """Whether the file starts as a safetensors file does: a bounded length, then `{`."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(9)
            size = handle.seek(0, 2)
    except OSError:
        return False  # the torch.save reader names what is wrong with it
    if len(start) < 9:
        return False
    (length,) = struct.unpack("<Q", start[:8])
    return length <= MAX_HEADER_SIZE and 8 + length <= size and start[8:9] == b"{"


@dataclass(frozen=True, slots=True)
class _HeaderTensor:
    name: str
    dtype: str  # the checkpoint's name
    shape: tuple[int, ...]
    start: int  # in the data section
    end: int


def read_safetensors_file(path: Path) -> TensorFile:
    """The tensors (mapped) and skeleton of a safetensors file."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            size = handle.seek(0, 2)
            if len(prefix) < 8:
                raise TensorFileError(f"{path} is not a safetensors file: shorter than its "
                                      "8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_SIZE:
                raise TensorFileError(f"{path}: its safetensors header claims {length} bytes, "
                                      f"over the {MAX_HEADER_SIZE}-byte limit: not a "
                                      "safetensors file, or a damaged one")
            if 8 + length > size:
                raise TensorFileError(f"{path}: its safetensors header claims {length} bytes "
                                      f"but the file has {size}: truncated or not safetensors")
            handle.seek(8)
            header = handle.read(length)
    except OSError as exc:
        raise TensorFileError(f"{path}: cannot read it ({exc.strerror})") from None
    metadata, tensors = _parse_header(path, header, size - 8 - length)
    state: dict[str, Any] = {} if metadata is None else {METADATA_KEY: metadata}
    state.update((t.name, t) for t in tensors)
    leaves, skeleton = encode_skeleton(state, lambda v: isinstance(v, _HeaderTensor))
    base = 8 + length
    files = [FileTensor(leaf, t.dtype, t.shape, _loader(path, base + t.start, t.end - t.start))
             for leaf, t in leaves]
    return TensorFile(FileTensors(files), skeleton)


def _loader(path: Path, start: int, length: int):
    return lambda: FileRegion(path, start, length)


def _parse_header(path: Path, header: bytes, data_size: int
                  ) -> tuple[dict[str, str] | None, list[_HeaderTensor]]:
    """The metadata and the tensors in file order; TensorFileError on any broken rule."""
    try:
        document = json.loads(header.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, _DuplicateKey) as exc:
        raise TensorFileError(f"{path}: its safetensors header is not JSON ({exc})"[:300]
                              ) from None
    if not isinstance(document, dict):
        raise TensorFileError(f"{path}: its safetensors header is not a JSON object")
    metadata = document.pop(METADATA_KEY, None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            type(v) is str for v in metadata.values())):
        raise TensorFileError(f"{path}: its {METADATA_KEY} is not a mapping of strings")
    tensors = sorted((_tensor(path, name, info) for name, info in document.items()),
                     key=lambda t: (t.start, t.end))
    position = 0
    for tensor in tensors:
        if tensor.start != position:
            relation = "overlaps the tensor before it" if tensor.start < position else (
                f"leaves bytes {position}-{tensor.start} of the data unclaimed")
            raise TensorFileError(f"{path}: tensor {tensor.name!r:.80} at data_offsets "
                                  f"[{tensor.start}, {tensor.end}] {relation}")
        position = tensor.end
    if position != data_size:
        raise TensorFileError(f"{path}: its tensors cover {position} bytes of a {data_size}-"
                              "byte data section: truncated, or bytes no tensor claims")
    return metadata, tensors


def _tensor(path: Path, name: str, info: Any) -> _HeaderTensor:
    where = f"{path}: tensor {name!r:.80}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise TensorFileError(f"{where} lacks its dtype, shape or data_offsets")
    kind, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if type(kind) is not str:
        raise TensorFileError(f"{where} has dtype {kind!r:.40}")
    dtype = DTYPES.get(kind)
    if dtype is None:
        raise TensorFileError(f"{where} has dtype {kind:.40}, which a checkpoint cannot hold "
                              f"(it holds {', '.join(DTYPES)})")
    if not (_naturals(shape) and _naturals(offsets) and len(offsets) == 2):
        raise TensorFileError(f"{where} has shape {shape!r:.60} and data_offsets "
                              f"{offsets!r:.60}: non-negative integers, two offsets")
    start, end = offsets
    if end < start:
        raise TensorFileError(f"{where} has data_offsets [{start}, {end}], which end before "
                              "they start")
    nbytes = tensor_nbytes(dtype, shape)
    if end - start != nbytes:
        raise TensorFileError(f"{where} is {kind} of shape {shape} ({nbytes} bytes) but its "
                              f"data_offsets span {end - start}")
    return _HeaderTensor(name, dtype, tuple(shape), start, end)


def _naturals(values: Any) -> bool:
    return type(values) is list and all(type(v) is int and v >= 0 for v in values)


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(f"{key!r:.80} appears twice")
        found[key] = value
    return found


# --- writing ----------------------------------------------------------------------------

def write_safetensors_file(path: Path, state: Any, tensors: Sequence[TensorEntry],
                           fill: Fill) -> None:
    """A safetensors file of the skeleton's flat `state`, the bytes of each of `tensors`
    (in manifest order) written in place by `fill`."""
    names, metadata = _flat_names(state)
    unnamed = [t.path for t in tensors if t.path not in names]
    if unnamed:
        raise TensorFileError(f"the checkpoint holds tensor {unnamed[0]!r:.80}, which its "
                              "skeleton does not name: pull it to a directory")
    header: dict[str, Any] = {} if metadata is None else {METADATA_KEY: metadata}
    position = 0
    for entry in tensors:
        kind = DTYPE_NAMES.get(entry.dtype)
        if kind is None:
            raise TensorFileError(f"tensor {names[entry.path]!r:.80} is {entry.dtype}, which "
                                  "safetensors cannot hold: pull it to FILE.pt instead")
        end = position + tensor_nbytes(entry.dtype, entry.shape)
        header[names[entry.path]] = {"dtype": kind, "shape": list(entry.shape),
                                     "data_offsets": [position, end]}
        position = end
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)  # as the reference pads it: the data 8-aligned
    with open(path, "xb") as out:  # a new file, as ziparchive.write_archive makes
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        out.flush()
        data = out.tell()
        fill(out.fileno(), [data + header[names[t.path]]["data_offsets"][0] for t in tensors])


# The top-level entries of a `slurm_geo.torch.Checkpointer` state.
TRAINING_STATE_KEYS = ("model", "optimizer", "scheduler", "rng", "data_position", "extra")


def held_part(state: Any) -> tuple[Any, list[str]]:
    """The part of the skeleton's state a safetensors file holds, and what it leaves out.

    A Checkpointer's training state gives its model's state dict (names as
    `model.state_dict()` has them, so `model.load_state_dict(load_file(...))` takes it);
    the optimizer, scheduler, RNG states, data position and extra are left out (named,
    those that hold anything). Any other state is held whole, or refused when written."""
    if (isinstance(state, dict) and "$" not in state
            and set(TRAINING_STATE_KEYS) <= state.keys()):
        return state["model"], [k for k, v in state.items() if k != "model" and v is not None]
    return state, []


@dataclass(frozen=True, slots=True)
class _Leaf:
    path: str


class _Unheld:
    """A skeleton node a safetensors header has no place for."""


def _flat_names(state: Any) -> tuple[dict[str, str], dict[str, str] | None]:
    """Each tensor's name by its checkpoint path, and the metadata, of a flat state."""
    root = walk_skeleton(state, _Flattener())
    refusal = ("the checkpoint's state is not a flat mapping of names to tensors ({}), "
               "which a safetensors file cannot hold: pull it to FILE.pt or a directory")
    if not isinstance(root, dict):
        raise TensorFileError(refusal.format("its root is not a mapping"))
    names: dict[str, str] = {}
    metadata = root.pop(METADATA_KEY, None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            type(k) is str and type(v) is str for k, v in metadata.items())):
        raise TensorFileError(refusal.format(f"{METADATA_KEY} is not a mapping of strings"))
    for name, value in root.items():
        if type(name) is not str or not isinstance(value, _Leaf):
            raise TensorFileError(refusal.format(f"entry {name!r:.60} is not a tensor"))
        if value.path in names:
            raise TensorFileError(refusal.format(f"tensor {value.path!r:.60} is named twice"))
        names[value.path] = name
    return names, metadata


class _Flattener:
    """Skeleton nodes as the values a flat state needs; anything else is `_Unheld`."""

    def tensor(self, path: str) -> Any:
        return _Leaf(path)

    def plain(self, value: Any) -> Any:
        return value

    def sequence(self, kind: str, items: list[Any]) -> Any:
        return _Unheld()

    def mapping(self, items: list[tuple[Any, Any]], metadata: Any, ordered: bool) -> Any:
        # An nn.Module state dict's `_metadata` (module versions) has no place in the
        # header; safetensors' own save_file drops it too.
        if not all(type(k) is str for k, _ in items):
            return _Unheld()
        return dict(items)

    def named(self, kind: str, value: Any) -> Any:
        return _Unheld()
