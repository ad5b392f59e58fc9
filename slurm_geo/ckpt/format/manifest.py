"""Manifests and latest pointers (docs/format.md §7): dataclasses, JSON and validation.

Parsing is strict and pure: a manifest that opened (its tag checked) but breaks a rule
is reported as corrupt, unsupported or unsafe, naming the manifest object.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from slurm_geo.ckpt.errors import (
    CorruptObject,
    MalformedData,
    StepMismatch,
    UnsafeObjectName,
    UnsupportedFormat,
)
from slurm_geo.ckpt.format.layout import Layout, layout_to_json, parse_layout
from slurm_geo.ckpt.format.names import is_hex_id, pack_name
from slurm_geo.ckpt.format.pack import ENTRY_OVERHEAD, HEADER_SIZE

# Version 2 names chunks by keyed BLAKE3 instead of HMAC-SHA256 (docs/format.md §4); a
# manifest's version says how its chunk ids are checked, so version 1 stays readable.
# Version 3 is a multi-rank checkpoint (§7.5): version 2 plus the "sharded" layout. Writers
# write 3 only for those, so a version 2 reader still reads every single-process one.
# Versions 4 and 5 are 2 and 3 with their packs under the run (`run-packs/<run>/`), so a
# store key minted for one run cannot overwrite another run's packs (docs/stores.md).
FORMAT_VERSION = 4
SHARDED_FORMAT = 5
FORMAT_VERSIONS = (1, 2, 3, 4, 5)
# What a single-process writer may be asked to write (`WriteOptions.format_version`): the
# current format, and the older ones tests write to check they still read.
WRITABLE_FORMATS = (1, 2, FORMAT_VERSION)
SHARDED_FORMATS = (3, 5)
RUN_PACKS_FROM = 4
LATEST_FORMAT = 2
LATEST_VERSIONS = (1, 2)  # a latest pointer is the same in formats 3 to 5
MAX_DELTA_DEPTH = 16
MAX_CHUNK_SIZE = 64 * 1024 * 1024
CHUNK_SIZE_MULTIPLE = 16

DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
}
# dtypes stored as byte planes, by element size (docs/format.md §6.1).
PLANE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ChunkRef:
    id: str
    pack: str
    offset: int
    length: int
    size: int
    base: ChunkRef | None = None

    @property
    def depth(self) -> int:
        return 0 if self.base is None else self.base.depth + 1


@dataclass(frozen=True)
class TensorEntry:
    path: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True)
class BlobEntry:
    size: int
    chunks: tuple[ChunkRef, ...]


@dataclass(frozen=True)
class Metadata:
    global_step: int
    optimizer_step: int  # the global step at which the optimizer state was taken
    epoch: int
    loss: float | None
    created_at: str
    cluster: str
    job_id: str


@dataclass(frozen=True)
class Manifest:
    run: str
    metadata: Metadata
    parent_step: int | None
    chunk_size: int
    tensors: tuple[TensorEntry, ...]
    extra_state: BlobEntry
    format: int = FORMAT_VERSION
    sharded: Layout | None = None  # format 3: the multi-rank layout of `tensors`
    # The fingerprint of the run data key the manifest was read sealed under (its packs are
    # sealed under it too: docs/format.md §4.2); None for one not read from a store.
    key: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def step(self) -> int:
        return self.metadata.global_step

    def pack_object(self, pack_id: str) -> str:
        """The object name of pack `pack_id` as this manifest's format places it."""
        return pack_name(pack_id, packs_run(self.run, self.format))

    def refs(self) -> Iterator[ChunkRef]:
        """Every chunk ref listed, tensors first; delta bases hang off their refs."""
        for tensor in self.tensors:
            yield from tensor.chunks
        yield from self.extra_state.chunks


def packs_run(run: str, manifest_format: int) -> str | None:
    """The run whose own directory holds the packs of a manifest of `run` in this format;
    None for the directory every run shares (formats 1 to 3)."""
    return run if manifest_format >= RUN_PACKS_FROM else None


def with_bases(refs: Iterable[ChunkRef]) -> Iterator[ChunkRef]:
    """Each ref, followed by the delta bases it needs to be read."""
    for ref in refs:
        current: ChunkRef | None = ref
        while current is not None:
            yield current
            current = current.base


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPE_SIZES[dtype] * math.prod(shape)


def check_steps(name: str, metadata: Metadata) -> None:
    if metadata.optimizer_step != metadata.global_step:
        raise StepMismatch(name, metadata.global_step, metadata.optimizer_step)


def check_metadata(name: str, metadata: Metadata) -> None:
    """Refuse, before a save writes anything, metadata its manifest could not hold."""
    try:
        _Parser(name).metadata(_metadata_to_json(metadata))
    except MalformedData as exc:
        raise ValueError(f"checkpoint '{name}': {exc}") from None
    check_steps(name, metadata)


def _metadata_to_json(meta: Metadata) -> dict[str, Any]:
    loss = meta.loss if meta.loss is not None and math.isfinite(meta.loss) else None
    return {
        "global_step": meta.global_step, "optimizer_step": meta.optimizer_step,
        "epoch": meta.epoch, "loss": loss, "created_at": meta.created_at,
        "cluster": meta.cluster, "job_id": meta.job_id,
    }


def manifest_to_json(manifest: Manifest) -> bytes:
    document = {
        "format": manifest.format,
        "run": manifest.run,
        "metadata": _metadata_to_json(manifest.metadata),
        "parent_step": manifest.parent_step,
        "chunk_size": manifest.chunk_size,
        "tensors": [
            {"path": t.path, "dtype": t.dtype, "shape": list(t.shape),
             "chunks": [_ref_to_json(r) for r in t.chunks]}
            for t in manifest.tensors
        ],
        "extra_state": {
            "size": manifest.extra_state.size,
            "chunks": [_ref_to_json(r) for r in manifest.extra_state.chunks],
        },
    }
    if manifest.sharded is not None:
        document["sharded"] = layout_to_json(manifest.sharded)
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def _ref_to_json(ref: ChunkRef) -> dict[str, Any]:
    return {
        "id": ref.id, "pack": ref.pack, "offset": ref.offset, "length": ref.length,
        "size": ref.size, "base": None if ref.base is None else _ref_to_json(ref.base),
    }


def parse_manifest(payload: bytes, name: str, run: str, step: int) -> Manifest:
    """The manifest in `payload`, read from object `name`, which stands for (`run`, `step`)."""
    try:
        document = _json_object(payload)
        manifest = _Parser(name).manifest(document, _check_format(document, name))
    except MalformedData as exc:
        raise CorruptObject(name, f"invalid manifest: {exc}") from None
    if manifest.run != run or manifest.step != step:
        raise CorruptObject(name, f"holds run {manifest.run!r} step {manifest.step}")
    check_steps(name, manifest.metadata)
    return manifest


def latest_to_json(run: str, step: int) -> bytes:
    return json.dumps({"format": LATEST_FORMAT, "run": run, "step": step}).encode()


def parse_latest(payload: bytes, name: str, run: str) -> int:
    try:
        document = _json_object(payload)
        _check_format(document, name, LATEST_VERSIONS)
        step = _get(document, "step", int, "latest")
        if document.get("run") != run or step < 0:
            raise MalformedData(f"names run {document.get('run')!r} step {step}")
    except MalformedData as exc:
        raise CorruptObject(name, f"invalid latest pointer: {exc}") from None
    return step


def _json_object(payload: bytes) -> dict[str, Any]:
    try:
        document = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedData(f"not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise MalformedData("not a JSON object")
    return document


def _check_format(document: dict[str, Any], name: str,
                  versions: tuple[int, ...] = FORMAT_VERSIONS) -> int:
    """The document's format version, if this reader knows it."""
    version = document.get("format")
    if version not in versions or isinstance(version, bool):
        raise UnsupportedFormat(name, version, " or ".join(map(str, versions)))
    return int(version)


def _get(obj: dict[str, Any], key: str, kind: type, where: str, nullable: bool = False) -> Any:
    if key not in obj:
        raise MalformedData(f"{where}: '{key}' is missing")
    value = obj[key]
    if value is None and nullable:
        return None
    accepted = (int, float) if kind is float else kind
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise MalformedData(f"{where}: '{key}' is not a {kind.__name__}")
    return value


class _Parser:
    """Turns a manifest's JSON into dataclasses; `name` is only for error messages."""

    def __init__(self, name: str):
        self.name = name

    def manifest(self, doc: dict[str, Any], version: int) -> Manifest:
        chunk_size = _get(doc, "chunk_size", int, "manifest")
        if not 0 < chunk_size <= MAX_CHUNK_SIZE or chunk_size % CHUNK_SIZE_MULTIPLE:
            raise MalformedData(f"chunk_size {chunk_size} is out of range")
        parent = _get(doc, "parent_step", int, "manifest", nullable=True)
        raw_tensors = _get(doc, "tensors", list, "manifest")
        tensors = tuple(self.tensor(raw, chunk_size) for raw in raw_tensors)
        if len({t.path for t in tensors}) != len(tensors):
            raise MalformedData("two tensors share a path")
        sharded = None
        if version in SHARDED_FORMATS:
            sharded = parse_layout(_get(doc, "sharded", dict, "manifest"),
                                   {t.path: (t.dtype, t.shape) for t in tensors})
        elif "sharded" in doc:
            raise MalformedData(f"a multi-rank layout in a format {version} manifest "
                                f"(it needs format {' or '.join(map(str, SHARDED_FORMATS))})")
        return Manifest(
            run=_get(doc, "run", str, "manifest"),
            metadata=self.metadata(_get(doc, "metadata", dict, "manifest")),
            parent_step=parent, chunk_size=chunk_size, tensors=tensors,
            extra_state=self.blob(_get(doc, "extra_state", dict, "manifest")),
            format=version, sharded=sharded,
        )

    def metadata(self, raw: dict[str, Any]) -> Metadata:
        keys = ("global_step", "optimizer_step", "epoch")
        ints = {k: _get(raw, k, int, "metadata") for k in keys}
        if min(ints.values()) < 0:
            raise MalformedData("metadata: negative step or epoch")
        strings = {k: _get(raw, k, str, "metadata") for k in ("created_at", "cluster", "job_id")}
        return Metadata(loss=_get(raw, "loss", float, "metadata", nullable=True), **ints, **strings)

    def tensor(self, raw: Any, chunk_size: int) -> TensorEntry:
        where = "tensor"
        if not isinstance(raw, dict):
            raise MalformedData("a tensor entry is not an object")
        path = _get(raw, "path", str, where)
        dtype = _get(raw, "dtype", str, path)
        shape = tuple(_get(raw, "shape", list, path))
        if dtype not in DTYPE_SIZES:
            raise MalformedData(f"{path}: unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise MalformedData(f"{path}: shape {list(shape)} is not a list of sizes")
        chunks = self.chunks(raw, path)
        sizes = [c.size for c in chunks]
        if sum(sizes) != tensor_nbytes(dtype, shape) or any(s != chunk_size for s in sizes[:-1]):
            raise MalformedData(f"{path}: chunk sizes {sizes} do not cut {dtype}{list(shape)}")
        return TensorEntry(path, dtype, shape, chunks)

    def blob(self, raw: dict[str, Any]) -> BlobEntry:
        size = _get(raw, "size", int, "extra_state")
        chunks = self.chunks(raw, "extra_state")
        if sum(c.size for c in chunks) != size:
            raise MalformedData(f"extra_state: chunks do not add up to {size} bytes")
        return BlobEntry(size, chunks)

    def chunks(self, raw: dict[str, Any], where: str) -> tuple[ChunkRef, ...]:
        return tuple(self.ref(r, where, 0) for r in _get(raw, "chunks", list, where))

    def ref(self, raw: Any, where: str, depth: int) -> ChunkRef:
        if depth > MAX_DELTA_DEPTH:
            raise MalformedData(f"{where}: delta chain deeper than {MAX_DELTA_DEPTH}")
        if not isinstance(raw, dict):
            raise MalformedData(f"{where}: a chunk ref is not an object")
        pack = _get(raw, "pack", str, where)
        if not is_hex_id(pack):
            raise UnsafeObjectName(pack, f"manifest '{self.name}' names it as a pack, and a "
                                   "pack id is 64 lowercase hex digits")
        chunk_id = _get(raw, "id", str, where)
        offset, length, size = (_get(raw, k, int, where) for k in ("offset", "length", "size"))
        if not is_hex_id(chunk_id) or offset < HEADER_SIZE or length < ENTRY_OVERHEAD:
            raise MalformedData(f"{where}: chunk ref {chunk_id!r} is malformed")
        if not 0 < size <= MAX_CHUNK_SIZE:
            raise MalformedData(f"{where}: chunk size {size} is out of range")
        base = _get(raw, "base", dict, where, nullable=True)
        return ChunkRef(chunk_id, pack, offset, length, size,
                        None if base is None else self.ref(base, where, depth + 1))
